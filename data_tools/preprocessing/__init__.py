"""Preprocessing: raw SFT records -> tokenized, labelled HF dataset shards, the work of hbp-preprocess
(data_tools/preprocess.py is its command line).

pipeline.py ``preprocess()``: inputs in, dataset and report.json out · inputs.py the files read (JSONL, JSON, CSV, each
also .gz; Parquet; saved HF datasets; a hub dataset's folder) into ``(path:N, record)`` · formats.py record shapes
(messages, sharegpt, alpaca, prompt/completion, text) normalised into a ``Sample`` · chat_labels.py the chat template
rendered and the trained tokens labelled · workers.py the tokenizing worker processes · mixing.py per-input weights
and the seeded held-out split · report.py report.json's counts and the printed summary.

May import: hbp_train's common and batches.vocab (the tokenizer record the trainer checks). Never packing or
simulation (independent stages), demo_data or the commands above (import-linter keeps it so).
"""
