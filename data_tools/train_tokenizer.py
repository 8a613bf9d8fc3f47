"""python -m data_tools.train_tokenizer: train the small byte-level BPE tokenizer shipped in
data_tools/assets/tokenizer/ (run once; the output is committed).

Usage: ``python -m data_tools.train_tokenizer [--out DIR] [--vocab-size 4096]``

The command line only; the tokenizer, its special tokens, chat template and training text are
data_tools/demo_data/bpe_tokenizer.py's.
"""

from __future__ import annotations

import argparse
import sys

from data_tools.demo_data.bpe_tokenizer import DEFAULT_OUT, MAX_VOCAB_SIZE, train
from hbp_train.common.cli import ArgumentParser, int_range, output_dir
from hbp_train.common.errors import EXIT_USER_ERROR


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m data_tools.train_tokenizer",
        description="Train the small byte-level BPE tokenizer shipped with hbp-train (deterministic).",
    )
    parser.add_argument("--out", type=output_dir.path, default=DEFAULT_OUT,
                        help=f"output tokenizer directory (default {DEFAULT_OUT})")
    # 300: the 256 bytes, the special tokens and some merges; the trainer allocates tables of the size up front.
    parser.add_argument("--vocab-size", type=int_range(300, MAX_VOCAB_SIZE), default=4096,
                        help=f"BPE vocabulary size incl. special tokens, 300..{MAX_VOCAB_SIZE} (default 4096)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = train(args.out, args.vocab_size)
    except OSError as e:  # the --out path: a file in the way, no permission, a full disk
        print(f"error: cannot write {args.out}: {e.strerror or e}; pass a writable --out directory", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"saved tokenizer to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
