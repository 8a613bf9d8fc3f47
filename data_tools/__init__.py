"""Data tools for hbp-train: the commands that make, read and plan the data before training, and the shipped
tokenizer.

At the top, the commands (``python -m data_tools.<command>``; the hbp-* names are pyproject.toml's), each its command
line only: the flags, the checks that name them, what it prints, exit 2 on bad input and 130 on Ctrl-C ·
preprocess.py (hbp-preprocess) raw chats -> tokenized shards · pack.py (hbp-pack) lengths or tokenized shards ->
plan, packed shards · simulate.py (hbp-simulate) plans -> simulated time and speed-ups · compare.py (hbp-compare)
every strategy planned and simulated on the same lengths · make_demo_data.py the demo's synthetic chats ·
make_code_data.py (hbp-make-code-data) real-text chats from this Python's standard library · train_tokenizer.py the
shipped tokenizer, trained again.

The stages, one folder each (its __init__.py says what it holds and may import): preprocessing/ (the work of
preprocess) · packing/ (what pack reads, records and prints around hbp_train's planner) · simulation/ (what simulate
and compare share around hbp_train's simulator) · demo_data/ (the generated data sets and the BPE tokenizer) ·
assets/tokenizer/ (the shipped tokenizer's files: hbp_train/model/hf_model.py's default).

Layers (pyproject.toml's import-linter contracts): the commands, none importing another, over demo_data | simulation
over preprocessing | packing (``|``: independent). Every layer may use hbp_train's library, which never imports
data_tools (of hbp_train only an entry point does: export.py reads preprocessing's default chat template).
"""
