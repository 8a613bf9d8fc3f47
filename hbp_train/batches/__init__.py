"""The batches a rank reads: packed shards on disk, written from a plan and read back step by step.

shards.py writes packed shards (one row per pack) from a plan and tokenized shards · loader.py reads them:
PackedData, a rank's micro-batches of a step, collate · prefetch.py makes the next step's batch while the device
computes · columns.py HF dataset columns as numpy (token lists read in place) · vocab.py the tokenizer that made
the data, checked against the model's.

Not data_tools/ (the command-line tools that read raw data and write tokenized shards and plans). May import:
planning (the plan's types), common. Never torch.distributed, the model or the loop.
"""
