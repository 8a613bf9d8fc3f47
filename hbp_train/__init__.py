"""hbp-train: Hierarchical Balance Packing for long-context supervised fine-tuning with DeepSpeed."""

__version__ = "0.1.0"
