"""Auto group selection profiler (HBP Alg. 1, 3, 4): `python -m hbp_train.profiler` writes profile.json.

config.py ProfileConfig (the run config's `profile` group) · search.py the algorithms · backends.py measuring
(GPU, analytic, curves) · launcher.py + worker.py SP > 1 on the node's GPUs (one torchrun per degree) · nvml.py
device memory readings · report.py the text table · cli.py the entry point.
"""
