"""hbp-preprocess: raw SFT data -> tokenized, labelled HF dataset shards (the input of data_tools.pack).

Usage::

    python -m data_tools.preprocess --input data.jsonl [more ...] --output DIR --tokenizer TOKENIZER_DIR \\
        [--format auto|messages|sharegpt|alpaca|prompt_completion|text] [--max-len N] [--overlong drop|truncate] \\
        [--on-error fail|skip] [--num-proc N] [--num-shards N]

The command line only: the flags, the one-line error (exit 2) and the printed report. The work is
``data_tools.preprocessing.pipeline.preprocess`` (its docstring describes the pipeline, the output and the drops).
"""

from __future__ import annotations

import argparse
import sys

from data_tools.preprocessing.formats import FORMATS
from data_tools.preprocessing.inputs import KINDS
from data_tools.preprocessing.pipeline import ERROR_REASONS, preprocess
from data_tools.preprocessing.report import format_report
from hbp_train.common.cli import ArgumentParser, existing_dir, float_range, int_range, output_dir, positive_int
from hbp_train.common.errors import EXIT_USER_ERROR, UserError
from hbp_train.common.outputs import interrupted


def build_parser() -> argparse.ArgumentParser:
    reasons = "".join(f"\n  {k}: {v}" for k, v in ERROR_REASONS.items())
    parser = ArgumentParser(
        prog="python -m data_tools.preprocess",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Tokenize raw SFT data into a labelled HF dataset (input of data_tools.pack).\n\n"
                    "Labels are -100 except on assistant tokens of every trained assistant turn (not weight 0, not in\n"
                    "a TRL prompt), found with the template's {% generation %} markers or, without them, by rendering\n"
                    "each turn's prefix. A tokenizer with no chat template gets the default ChatML template\n"
                    "(<|im_start|>role\\ncontent<|im_end|>\\n, bos first if the tokenizer has one, assistant\n"
                    "content<|im_end|> trained). Plain text (text, prompt/completion strings): no template, the eos\n"
                    "after it, the text (the completion) trained. Shapes with examples: docs/input_formats.md.",
        epilog="Output DIR: the dataset (input_ids, labels, length, num_loss_tokens, source='path:N' with N the\n"
               "1-based JSONL line, CSV line or 0-based row), report.json (with ignored_fields, untrained_turns,\n"
               "per_input counts before and after weighting, heldout), dropped.jsonl (with the samples a weight\n"
               "below 1 left out, reason 'weight'). An existing DIR is replaced only if it holds an earlier\n"
               "preprocess output. How to split and weight inputs: docs/input_formats.md.\n"
               "Policy drops (always counted): overlong, no_loss_tokens, no_loss_tokens_after_truncation.\n"
               f"Bad-input reasons (fail or skip per --on-error):{reasons}\n"
               "Exit codes: 0 ok; 2 bad input, tokenizer, output or flags (one line on stderr);\n"
               "130 interrupted (Ctrl-C; an existing DIR is left as it was).",
    )
    # No path check here: a missing input file is a bad-input reason like the others (--on-error skip drops it).
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH[:WEIGHT]",
                        help=f"input files ({', '.join(KINDS)}), folders of them as a hub dataset ships them (one "
                             "split), or saved HF dataset directories (required). A trailing :WEIGHT (> 0) weights "
                             "an input: its samples taken floor(WEIGHT) times plus a seeded fraction once more, e.g. "
                             "a.jsonl:2 b.parquet:0.5 (a path that exists as given is never split at ':')")
    parser.add_argument("--output", required=True, metavar="DIR", type=output_dir,
                        help="output dataset directory, built beside DIR and moved into "
                        "place when complete (required)")
    parser.add_argument("--tokenizer", required=True, metavar="DIR", type=existing_dir,
                        help="local HF tokenizer directory (loaded offline), e.g. data_tools/assets/tokenizer "
                             "(required)")
    parser.add_argument("--format", default="auto", choices=("auto", *FORMATS),
                        help="record shape; auto detects it per record: 'messages' -> OpenAI, 'conversations' -> "
                             "ShareGPT, 'instruction'/'output' -> Alpaca, 'prompt'/'completion' -> TRL, 'text' -> "
                             "plain text (default auto)")
    parser.add_argument("--max-len", type=int_range(2), default=None, metavar="N",
                        help="longest sample in tokens; longer ones follow --overlong (default: no limit)")
    parser.add_argument("--overlong", default="drop", choices=("drop", "truncate"),
                        help="samples longer than --max-len: drop them (reason 'overlong') or keep the first N "
                             "tokens (counted in 'truncated'; dropped if no trained token is left) (default drop)")
    parser.add_argument("--on-error", default="fail", choices=("fail", "skip"),
                        help="bad input: fail stops at the first bad record with one line naming file:line and "
                             "exit code 2; skip drops it and counts it by reason in report.json/dropped.jsonl "
                             "(default fail)")
    parser.add_argument("--num-proc", type=positive_int, default=1, metavar="N",
                        help="tokenizer worker processes, at most the number of CPUs; the output is identical for "
                             "any N (default 1)")
    parser.add_argument("--num-shards", type=positive_int, default=None, metavar="N",
                        help="number of dataset shard files (default: datasets' choice, ~500 MB each)")
    held = parser.add_mutually_exclusive_group()
    held.add_argument("--heldout-fraction", type=float_range(0.0, 1.0, low_open=True), default=None, metavar="F",
                      help="hold out this fraction (0 < F < 1) of the kept samples, drawn with --seed from all "
                           "inputs before weighting, whole samples only, into --heldout-output (default: none held out)")
    held.add_argument("--heldout-count", type=positive_int, default=None, metavar="N",
                      help="hold out N kept samples (as --heldout-fraction; default: none held out)")
    parser.add_argument("--heldout-output", default=None, metavar="DIR", type=output_dir,
                        help="the held-out dataset, in the output's format: pack it for data.eval_shards, or give "
                             "it to hbp-eval offline --dataset (default: OUTPUT_heldout beside OUTPUT)")
    parser.add_argument("--seed", type=int_range(0), default=0, metavar="S",
                        help="seed of the held-out draw and of the weights' fractions (default 0)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        report = preprocess(args.input, args.output, args.tokenizer, fmt=args.format, max_len=args.max_len,
                            overlong=args.overlong, on_error=args.on_error, num_proc=args.num_proc,
                            num_shards=args.num_shards, heldout_fraction=args.heldout_fraction,
                            heldout_count=args.heldout_count, heldout_output=args.heldout_output, seed=args.seed)
    except UserError as e:  # PreprocessError: bad flags, an unusable tokenizer or output, a bad record
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:  # the staging folder is removed; the swap into --output happens only at the end
        return interrupted("preprocess", f"--output {args.output} was left as it was")
    print(format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
