"""Data tools for hbp-train: demo data, the shipped tokenizer, preprocessing (raw chats -> tokenized shards),
packing and simulation CLIs."""
