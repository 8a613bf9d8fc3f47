"""Process groups: the one module that creates them (groups.py), every SP degree's group built up front.

groups.py rank and world size, torch.distributed initialisation, every SP degree's groups and their data-parallel
partners, every group's timeout · node_watch.py the launchers of a multi-node job watching each other (roll call,
heartbeats, who stopped first). The SP attention that uses the groups is hbp_train/model/ulysses.py.

May import: common. Nothing above: the model, the loop and observation ask it for ranks and groups.
"""
