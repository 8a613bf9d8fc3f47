"""``exit_code(main, argv)``: a CLI's exit code, whether ``main`` returns it or its parser ends with SystemExit
(a bad flag is refused by argparse, hbp_train.common.cli.ArgumentParser, before ``main`` gets to return)."""

from __future__ import annotations


def exit_code(main, argv: list) -> int:
    try:
        return main(argv)
    except SystemExit as exc:
        return exc.code
