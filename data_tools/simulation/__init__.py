"""Simulation: what hbp-simulate and hbp-compare (data_tools/simulate.py, compare.py) share around the simulator
(hbp_train/planning/simulator.py, the simulated time of a plan; nothing runs on a GPU).

options.py the cost-model, link and ZeRO-communication flags both commands take, and the ``SimConfig`` and
``CostModel`` they ask for · plans.py a plan file read with one-line errors, its groups described, the isf plan it is
compared with when simulated alone · tables.py durations in the unit that shows them, fixed-width tables ·
strategies.py every strategy planned and simulated on the same lengths (compare's rows; also
bench/bench_simulated_speedup.py's).

May import: packing (the model a plan records) and hbp_train's library. Never demo_data (independent stages) or the
commands above (import-linter keeps it so).
"""
