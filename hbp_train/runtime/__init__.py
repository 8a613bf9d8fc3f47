"""The run folder and the run's life: the folder checked before training, checkpoints, what makes one complete, one
live run per folder, where the run stands, workers that notice their launcher died.

preflight.py the run folder before any worker trains · checkpoint.py save, exact resume, SIGTERM/SIGINT ·
manifest.py what a complete checkpoint holds · run_lock.py one live run per folder · status.py RUN_DIR/status.json
for schedulers · parent_watch.py workers save and exit when their launcher dies.

May import: common (and torch/DeepSpeed to save and load). Never the loop, the model or the batches: the loop
passes in the engine and the state to save.
"""
