"""The batches a rank reads: packed shards on disk, written from a plan and read back step by step.

shards.py writes packed shards (one row per pack, checksums last) from a plan and tokenized shards, or from the
packed shards of a plan being re-planned · loader.py reads them: PackedData, a rank's packs of an optimizer step ·
replanned.py serves a re-plan's shards after a resume on another number of ranks · collate.py makes a pack a
micro-batch (StepBatch) · prefetch.py makes the next step's batch while the device computes · columns.py HF
dataset columns as numpy (token lists read in place) · vocab.py the tokenizer that made the data, checked against
the model's.

Not data_tools/ (the command-line tools that read raw data and write tokenized shards and plans). May import:
planning (the plan's types) and common (torch.distributed directly, to share the checksum work among the ranks).
Never the model or the loop.
"""
