"""Packing: what hbp-pack (data_tools/pack.py) reads, records and prints around the planner (hbp_train/planning/, the
planning itself) and the packed-shard writer (hbp_train/batches/shards.py).

lengths.py the sample lengths (a lengths file, or a tokenized dataset's length column) and the warning when they
pass --max-len · groups.py the packing groups (--groups by hand, with their memory levers, or the profiler's
--profile) and the ZeRO stage the plan records · model_record.py the model a plan is made for: read at pack time,
recorded in the plan, costed by the simulator · report.py the metrics table, the step line and the warnings pack
prints.

May import: hbp_train's library (planning, perf, batches, model.attention_calls, common). Never preprocessing
(independent stages), simulation, demo_data or the commands above (import-linter keeps it so).
"""
