"""Command-line flags: the one parser class and the ``type=`` checks every CLI uses, so a bad flag is one line.

argparse prints its usage and then the error, and a ``type=int`` accepts any integer, so a count of 0 or a
fraction of 1.5 reaches the tool's code and fails there, late or with a traceback. Every CLI builds its parser
with ``ArgumentParser`` below and states each flag's range as its ``type=`` (``positive_int``, ``fraction``,
``existing_dir``, ...), so a bad flag ends before any work as

    <prog>: error: --flag: <what is wrong> (<what fixes it>)

and exit code 2 (``EXIT_USER_ERROR``, argparse's own code for bad flags). The checks carry what they accept as
attributes (``low``/``high`` of a number, ``path_kind`` of a path): tests/test_cli_walk.py reads them off every
parser and tries a value outside each, so a new flag cannot escape the walk.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from pathlib import Path
from typing import Callable, Optional

from hbp_train.common.errors import EXIT_USER_ERROR


class ArgumentParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line, ``<prog>: error: --flag: <what> (<fix>)``, and exit 2.
    Sub-commands (``add_subparsers``) are parsers of this class too (argparse makes them of the parent's type)."""

    def error(self, message: str):
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {one_line(message)}\n")


def one_line(message: str) -> str:
    """argparse's message as one line naming the flag first and ending with the fix in brackets."""
    message = " ".join(str(message).split())
    # "argument --nproc-per-node/--nproc_per_node: ..." -> "--nproc-per-node: ..."
    match = re.match(r"argument (\S+?)(?:/\S+)?: (.*)", message)
    if match:
        message = f"{match.group(1)}: {match.group(2)}"
    return message if message.endswith(")") else f"{message} (see --help)"


def _number(kind: type, low, high, low_open: bool, what: str) -> Callable[[str], object]:
    """A ``type=`` check: ``kind`` (int or float) within [low, high] (``low_open``: low itself excluded)."""
    def show(v) -> str:
        return str(v) if kind is int else f"{v:g}"

    if low is not None and high is not None:
        expect = f"{what} in {'(' if low_open else '['}{show(low)}, {show(high)}]"
    elif low is not None:
        expect = f"{what} {'>' if low_open else '>='} {show(low)}"
    elif high is not None:
        expect = f"{what} <= {show(high)}"
    else:
        expect = what

    def check(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not {what} (give {expect})") from None
        if kind is float and not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r} is not a finite number (give {expect})")
        if low is not None and (value < low or low_open and value == low) or high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{text} is out of range (give {expect})")
        return value

    check.__name__ = expect
    check.low, check.high, check.low_open, check.kind = low, high, low_open, kind
    return check


def int_range(low: Optional[int] = None, high: Optional[int] = None) -> Callable[[str], int]:
    """A whole number in [low, high] (either end may be open-ended: None)."""
    return _number(int, low, high, False, "a whole number")


def float_range(low: Optional[float] = None, high: Optional[float] = None,
                low_open: bool = False) -> Callable[[str], float]:
    """A finite number in [low, high], or (low, high] with ``low_open``."""
    return _number(float, low, high, low_open, "a number")


positive_int = int_range(1)
"""A count: 1, 2, ... (steps, samples, processes, a world size)."""
nonneg_int = int_range(0)
"""0, 1, 2, ... (a seed, a number of warm-up iterations, an optional count where 0 means none)."""
positive_float = float_range(0.0, low_open=True)
"""A rate or size > 0 (bandwidths, TFLOP/s)."""
fraction = float_range(0.0, 1.0)
"""A share in [0, 1]."""


def int_list(low: int) -> Callable[[str], list]:
    """Comma-separated whole numbers, each >= low (e.g. context lengths ``256,512,1024``)."""
    one = int_range(low)

    def check(text: str) -> list:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"{text!r} is empty (give comma-separated whole numbers >= {low})")
        try:
            return [one(t) for t in items]
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a list of whole numbers >= {low} (give e.g. "
                                             f"{','.join(str(low * 2 ** i) for i in range(3))})") from None

    check.__name__ = f"list of whole numbers >= {low}"
    check.low, check.high, check.low_open, check.kind, check.is_list = low, None, False, int, True
    return check


def fraction_list(text: str) -> list:
    """Comma-separated shares in [0, 1] (e.g. needle depths ``0,0.5,1``)."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    try:
        if not items:
            raise argparse.ArgumentTypeError("")
        return [fraction(t) for t in items]
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of numbers in [0, 1] (give e.g. 0,0.5,1)") from None


fraction_list.__name__ = "list of numbers in [0, 1]"
fraction_list.low, fraction_list.high, fraction_list.low_open, fraction_list.kind = 0.0, 1.0, False, float
fraction_list.is_list = True


def _path(kind: str, as_path: bool = False) -> Callable[[str], str]:
    """A path ``type=`` check; ``kind``: file / dir / file_or_dir (must exist), out_file / out_dir (may be new,
    but not the other kind of thing). It returns the text; its ``.path`` twin a ``pathlib.Path``."""

    def check(text: str) -> str:
        if not text:
            raise argparse.ArgumentTypeError("empty path (give a path)")
        exists, is_dir = os.path.exists(text), os.path.isdir(text)
        if kind in ("file", "dir", "file_or_dir") and not exists:
            want = {"file": "an existing file", "dir": "an existing folder"}.get(kind, "an existing file or folder")
            raise argparse.ArgumentTypeError(f"{text}: no such {'folder' if kind == 'dir' else 'file'} "
                                             f"(give {want})")
        if kind in ("file", "out_file") and is_dir:
            raise argparse.ArgumentTypeError(f"{text}: is a folder (give a file path)")
        if kind in ("dir", "out_dir") and exists and not is_dir:
            raise argparse.ArgumentTypeError(f"{text}: is a file, not a folder (give a folder path)")
        return Path(text) if as_path else text

    check.__name__ = kind.replace("_", " ") + " path"
    check.path_kind = kind
    if not as_path:
        check.path = _path(kind, as_path=True)
    return check


existing_file = _path("file")
"""An input file that must exist (not a folder)."""
existing_dir = _path("dir")
"""An input folder that must exist (not a file)."""
existing_path = _path("file_or_dir")
"""An input that is a file or a folder (e.g. a plan file or a --shards folder holding one)."""
output_file = _path("out_file")
"""A file to write: new or existing, never an existing folder."""
output_dir = _path("out_dir")
"""A folder to write into: new or existing, never an existing file."""

