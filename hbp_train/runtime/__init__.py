"""The run folder and the run's life: the folder checked before training, checkpoints, what makes one complete, one
live run per folder, where the run stands, workers that notice their launcher died.

preflight.py the run folder before any worker trains · checkpoint.py save, exact resume, SIGTERM/SIGINT ·
resume_config.py settings changed at a resume, applied or refused · elastic.py resume on another number of ranks ·
ledger.py which samples each step trained · manifest.py what a complete checkpoint holds · run_lock.py one live run
per folder · status.py RUN_DIR/status.json for schedulers · run_end.py how a run ended, one record for the
launcher's last line and status.json · parent_watch.py workers save and exit when their launcher dies.

May import: common (and torch/DeepSpeed to save and load). Never the loop, the model or the batches: the loop
passes in the engine and the state to save.
"""
