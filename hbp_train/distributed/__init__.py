"""Process groups: the one module that creates them (groups.py), every SP degree's group built up front.

groups.py rank and world size, torch.distributed initialisation, every SP degree's groups and their data-parallel
partners. The SP attention that uses them is hbp_train/model/ulysses.py.

May import: common. Nothing above: the model, the loop and observation ask it for ranks and groups.
"""
