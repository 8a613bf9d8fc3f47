"""python -m data_tools.make_code_data (hbp-make-code-data): real-text SFT chats made from the Python standard library
of this interpreter, nothing downloaded; split by module, capped in tokens of a BPE tokenizer trained on the train
split.

Usage::

    python -m data_tools.make_code_data --out DIR [--seed 0] [--heldout-fraction 0.1] [--max-tokens 16384] \\
        [--max-samples 5000] [--long-per-module 1] [--short-per-module 6] [--vocab-size 4096] \\
        [--modules json,email] [--source-dir DIR] [--tokenize]

The command line only; the steps, the output folder and the report are data_tools/demo_data/code_data.py's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from data_tools.demo_data.bpe_tokenizer import MAX_VOCAB_SIZE
from data_tools.demo_data.code_data import format_report, make_code_data
from hbp_train.common.cli import ArgumentParser, existing_dir, float_range, int_range, nonneg_int, output_dir, positive_int
from hbp_train.common.errors import EXIT_USER_ERROR, UserError
from hbp_train.common.outputs import interrupted


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m data_tools.make_code_data",
        description="Make SFT chats from the Python standard library of this interpreter (nothing downloaded): "
                    "long samples ask for a function's body removed from its module, short ones for a function "
                    "from its docstring, a one-line summary, a class's methods. Split by module, capped in tokens "
                    "of a BPE tokenizer trained on the train split. Same interpreter and flags, same files.",
        epilog="Output DIR: train.jsonl, heldout.jsonl (OpenAI messages + meta), tokenizer/, report.json, "
               "dropped.jsonl; with --tokenize also tokenized/train and tokenized/heldout. Exit codes: 0 ok; 2 bad "
               "flags or output (one line); 130 interrupted (an existing DIR is left as it was).",
    )
    parser.add_argument("--out", required=True, type=output_dir,
                        help="output folder, built beside it and swapped in when complete; an existing one is "
                             "replaced only if it holds an earlier make_code_data output (required)")
    parser.add_argument("--seed", type=nonneg_int, default=0,
                        help="seed of the split, the task draw and the order; same seed, same files (default 0)")
    parser.add_argument("--heldout-fraction", type=float_range(0.0, 0.5), default=0.1,
                        help="share of the modules held out, 0..0.5 (default 0.1)")
    parser.add_argument("--max-tokens", type=int_range(256), default=16384,
                        help="longest sample in tokens of the trained tokenizer with its chat template; longer "
                             "modules are cut to a window around the function (default 16384)")
    parser.add_argument("--max-samples", type=positive_int, default=5000,
                        help="most samples over both splits; a seeded draw keeps each split's share (default 5000)")
    parser.add_argument("--long-per-module", type=nonneg_int, default=1,
                        help="fill-the-body samples per module, each the module with one body removed (default 1)")
    parser.add_argument("--short-per-module", type=nonneg_int, default=6,
                        help="short samples per module: docstring -> function, function -> summary, class -> "
                             "methods (default 6)")
    parser.add_argument("--vocab-size", type=int_range(300, MAX_VOCAB_SIZE), default=4096,
                        help=f"BPE vocabulary size incl. special tokens, 300..{MAX_VOCAB_SIZE} "
                             f"(default 4096)")
    parser.add_argument("--modules", default=None, metavar="A,B",
                        help="comma-separated module names to use, each with its submodules, e.g. json,email "
                             "(default: every module)")
    parser.add_argument("--source-dir", type=existing_dir, default=None, metavar="DIR",
                        help="a folder of Python files to use instead (default: this interpreter's standard library)")
    parser.add_argument("--tokenize", action="store_true",
                        help="also write tokenized/train and tokenized/heldout with data_tools.preprocess")
    return parser


def main(argv: list[str] | None = None) -> int:
    import time

    args = build_parser().parse_args(argv)
    modules = None if args.modules is None else [m.strip() for m in args.modules.split(",") if m.strip()]
    start = time.perf_counter()
    try:
        if modules == []:
            raise UserError(f"--modules {args.modules!r}: no module name given; pass names such as json,email")
        report = make_code_data(args.out, seed=args.seed, heldout_fraction=args.heldout_fraction,
                                max_tokens=args.max_tokens, max_samples=args.max_samples,
                                long_per_module=args.long_per_module, short_per_module=args.short_per_module,
                                vocab_size=args.vocab_size, modules=modules, source_dir=args.source_dir,
                                tokenize=args.tokenize)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        return interrupted("make_code_data", f"--out {args.out} was left as it was")
    print(format_report(report, Path(args.out)))
    print(f"took {time.perf_counter() - start:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
