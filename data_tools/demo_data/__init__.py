"""Demo data: data sets made here to try and to measure the trainer, and the tokenizer shipped for them.

synthetic_chats.py the deterministic, long-tailed synthetic chats of the demo, the tests and the CPU smoke run
(make_demo_data) · code_data.py real-text chats from this interpreter's standard library (make_code_data): files,
split by module, sample cap, tokenizer, token cap, report · code_tasks.py the tasks one module gives (fill a removed
body, docstring -> function, summary, methods) and the window a long module is cut to · bpe_tokenizer.py the
byte-level BPE trained on the synthetic chats (shipped in data_tools/assets/tokenizer/) or on given texts
(code_data's).

May import: preprocessing (the default chat template; make_code_data --tokenize runs the pipeline) and hbp_train's
common. Never simulation (independent stages) or the commands above (import-linter keeps it so).
"""
