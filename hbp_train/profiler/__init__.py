"""Auto group selection profiler (HBP Alg. 1, 3, 4): `python -m hbp_train.profiler` writes profile.json.

search.py the algorithms · backends.py measuring
(GPU, analytic, curves) · launcher.py + worker.py SP > 1 on the node's GPUs (one torchrun per degree) · nvml.py
device memory readings · report.py the text table · cli.py the entry point. Its settings, ProfileConfig, are
hbp_train/perf/profile_config.py (the run config composes them without importing the profiler).

An entry point: may import anything below it (config, model, observe, perf, ...); nothing imports it.
"""
