"""What a run shows: per-step metrics and their sinks, timings, the start-of-run summary, the plot, held-out loss.

telemetry.py the step's metrics, one log line, metrics.jsonl, TensorBoard, W&B · step_timing.py a rank's compute
and waits, seconds per SP degree · run_summary.py the start-of-run summary · metrics_plot.py RUN_DIR/metrics.png ·
heldout.py held-out loss during training.

May import: model, batches, distributed, planning (metrics), common. Never the loop (trainer, build, config): the
loop hands it what it shows.
"""
