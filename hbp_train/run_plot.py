"""Redraw a run's RUN_DIR/metrics.png from its metrics.jsonl, at any time, also while the run is going on.

    python -m hbp_train.run_plot RUN_DIR [--out PNG]

The panels are drawn by hbp_train/observe/metrics_plot.py (the trainer calls it when a run ends); this is only
the command line.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hbp_train.common.cli import ArgumentParser, existing_dir, output_file
from hbp_train.common.errors import EXIT_USER_ERROR, UserError
from hbp_train.observe.metrics_plot import plot_run


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog="python -m hbp_train.run_plot", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=existing_dir, help="a run directory (train.out_dir) holding metrics.jsonl")
    parser.add_argument("--out", default=None, type=output_file, help="output PNG (default RUN_DIR/metrics.png)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from hbp_train.common.outputs import check_output_file

    try:
        if not (Path(args.run_dir) / "metrics.jsonl").is_file():
            raise UserError(f"{args.run_dir}: no metrics.jsonl (is it a train.out_dir with logging.jsonl on?)")
        check_output_file("--out", args.out, image=True)
        out = plot_run(args.run_dir, args.out)
    except UserError as exc:
        print(f"run_plot: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
