"""Output files of the long-running CLIs (pack, simulate, compare, calibrate): checked before the work, written
with one-line errors.

A run that plans a million samples should not fail at its last line because ``--plot`` names a folder or an image
type matplotlib cannot write; ``check_output_file`` catches that up front. Errors are ValueError naming the flag.
"""

from __future__ import annotations

import os
from pathlib import Path


def check_output_file(flag: str, path: str | None, image: bool = False) -> None:
    """ValueError (one line, naming ``flag``) for an output file that could not be written after the work."""
    if not path:
        return
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; pass a file path")
    if image:
        from matplotlib.backend_bases import FigureCanvasBase

        kinds = FigureCanvasBase.get_supported_filetypes()
        if p.suffix.lower().lstrip(".") not in kinds:
            raise ValueError(f"{flag} {path}: unknown image type {p.suffix or '(no suffix)'}; end it in .png "
                             f"(or .{', .'.join(k for k in ('svg', 'pdf', 'jpg') if k in kinds)})")
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent  # the folders below it are created when the file is written
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise ValueError(f"{flag} {path}: cannot create it ({parent} is not a writable folder)")


def write_output(flag: str, path_text: str, write) -> None:
    """Call write(path) (creating its folder), turning an OSError into a one-line ValueError naming ``flag``."""
    path = Path(path_text)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(path)
    except OSError as exc:
        raise ValueError(f"{flag} {path_text}: cannot write ({exc.strerror})") from None
