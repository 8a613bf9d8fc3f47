"""Performance models: what a pack costs in time, FLOPs and memory (pure numpy, except the GPU calibration).

shape.py ModelShape and its one reader · flops.py the one FLOPs formula (MFU and the cost model) · cost_model.py
pack time · memory.py per-rank memory (profiler dry run, trainer preflight) · calibrate.py measures a calibration
on a GPU (`python -m hbp_train.perf.calibrate`, imports torch when run).
"""
