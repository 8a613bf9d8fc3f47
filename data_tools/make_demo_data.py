"""python -m data_tools.make_demo_data: write the deterministic, long-tailed synthetic chat dataset of the demo, the
tests and the CPU smoke run to a JSONL file (OpenAI ``messages`` records).

Usage::

    python -m data_tools.make_demo_data --out demo.jsonl [--num-samples 2000] [--max-tokens 2048] [--seed 0] \
        [--long-fraction 0.04]

The command line only; the chats, their tasks and their lengths are data_tools/demo_data/synthetic_chats.py's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from data_tools.demo_data.synthetic_chats import LONG_FRACTION, generate
from hbp_train.common.cli import ArgumentParser, fraction, int_range, nonneg_int, output_file, positive_int
from hbp_train.common.errors import EXIT_USER_ERROR, UserError
from hbp_train.common.outputs import atomic_write, interrupted


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m data_tools.make_demo_data",
        description="Write a deterministic, long-tailed synthetic chat SFT dataset (OpenAI 'messages' JSONL). The "
                    "file is written to a temporary name and moved over --out when complete: Ctrl-C (exit code 130) "
                    "leaves an earlier --out as it was.",
    )
    parser.add_argument("--out", required=True, type=output_file,
                        help="output JSONL file (parent folders are created; an existing file is replaced) (required)")
    parser.add_argument("--num-samples", type=positive_int, default=2000, help="number of conversations (default 2000)")
    parser.add_argument("--max-tokens", type=int_range(64), default=2048,
                        help="longest sample, in tokens of the shipped tokenizer with its chat template; the long "
                             "tail reaches almost this (default 2048, sized for the CPU demo)")
    parser.add_argument("--seed", type=nonneg_int, default=0,
                        help="random seed (>= 0); same seed, same file (default 0)")
    parser.add_argument("--long-fraction", type=fraction, default=LONG_FRACTION,
                        help=f"share of long samples (a quarter of to almost --max-tokens), 0..1 (default {LONG_FRACTION})")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return write(args)
    except KeyboardInterrupt:  # the file is written to a temporary name and moved into place when complete
        return interrupted("make_demo_data", f"--out {args.out} was left as it was")


def write(args: argparse.Namespace) -> int:
    """Generate and write the file the parsed arguments ask for; exit code 2 with one line on bad input."""
    try:
        records = generate(args.num_samples, args.max_tokens, args.seed, args.long_fraction)
    except UserError as e:  # name the flag, not the function argument
        print(f"error: --{str(e).replace('_', '-', 1)}", file=sys.stderr)
        return EXIT_USER_ERROR
    out = Path(args.out)

    def write_lines(path: Path) -> None:
        with open(path, "w", encoding="utf-8") as f:
            for record in records:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")

    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out, write_lines)
    except OSError as e:  # the --out path: a folder, no permission, a full disk
        print(f"error: cannot write {out}: {e.strerror}; pass a writable --out path", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"wrote {len(records)} samples to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
