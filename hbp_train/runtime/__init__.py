"""The run folder and the run's life: checkpoints, what makes one complete, one live run per folder, workers that
notice their launcher died.

checkpoint.py save, exact resume, SIGTERM/SIGINT · manifest.py what a complete checkpoint holds · run_lock.py one
live run per folder · parent_watch.py workers save and exit when their launcher dies.

May import: common (and torch/DeepSpeed to save and load). Never the loop, the model or the batches: the loop
passes in the engine and the state to save.
"""
