"""Performance: what a pack costs in time, FLOPs and memory, and the two programs that measure it.

The cost models (pure numpy, no torch; planning uses them): shape.py ModelShape and its one reader · flops.py the
one FLOPs formula (MFU and the cost model) · cost_model.py pack time · memory.py per-rank memory (profiler dry
run, trainer pre-flight) · profile_config.py the settings of the profiler (the run config's `profile` group).

The programs (entry points, above everything else): calibrate/ measures a calibration on a GPU or this CPU
(`python -m hbp_train.perf.calibrate`) · step_costs.py fits a calibration's step costs from a training run.
"""
