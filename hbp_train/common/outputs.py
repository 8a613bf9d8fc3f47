"""Output files and folders of the long-running CLIs (pack, preprocess, simulate, compare, calibrate): checked
before the work, written so that an interrupt or error never destroys an earlier good output, with one-line errors.

A run that plans a million samples should not fail at its last line because ``--plot`` names a folder or an image
type matplotlib cannot write; ``check_output_file`` catches that up front, and refuses to replace a file the tool
did not write (a raw .jsonl passed as ``--out`` by mistake). Files are written to a temporary name beside the target
and moved over it (``atomic_write``); folders are built in a staging folder beside the target and swapped in at the
end (``staging_dir`` + ``replace_dir``): Ctrl-C half-way leaves the earlier output as it was. Errors are
UserError naming the flag; ``interrupted`` is the one-line Ctrl-C exit of every CLI.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import sys
from pathlib import Path

from hbp_train.common.errors import UserError

INTERRUPTED_EXIT_CODE = 130  # 128 + SIGINT: what a shell reports for a command stopped with Ctrl-C


def check_output_file(flag: str, path: str | None, image: bool = False, json_key: str | None = None,
                      kind: str = "") -> None:
    """UserError (one line, naming ``flag``) for an output file that could not be written after the work.

    With ``json_key``, an existing non-empty file is replaced only if it is JSON whose first key is ``json_key``
    (a ``kind`` file this project wrote): anything else may be someone's data.
    """
    if not path:
        return
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{flag} {path}: is a directory; pass a file path")
    if image:
        from matplotlib.backend_bases import FigureCanvasBase

        kinds = FigureCanvasBase.get_supported_filetypes()
        if p.suffix.lower().lstrip(".") not in kinds:
            raise UserError(f"{flag} {path}: unknown image type {p.suffix or '(no suffix)'}; end it in .png "
                            f"(or .{', .'.join(k for k in ('svg', 'pdf', 'jpg') if k in kinds)})")
    if json_key and p.is_file() and p.stat().st_size and not _starts_with_key(p, json_key):
        raise UserError(f"{flag} {path}: exists and is not a {kind} written by hbp-train (JSON starting with "
                        f"\"{json_key}\"); choose another {flag} or delete the file")
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent  # the folders below it are created when the file is written
    if not parent.is_dir() or not os.access(parent, os.W_OK):
        raise UserError(f"{flag} {path}: cannot create it ({parent} is not a writable folder)")


def _starts_with_key(path: Path, key: str) -> bool:
    """Whether the file starts like a JSON object whose first key is ``key`` (reads 4 KB, not a whole plan)."""
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    return re.match(rb'\s*\{\s*"' + re.escape(key.encode()) + rb'"\s*:', head) is not None


def atomic_write(path: str | Path, write) -> None:
    """Call write(tmp) for a temporary file beside ``path``, then move it over ``path``.

    An interrupt or error half-way leaves the earlier file whole (never empty or cut short) and no temporary file.
    The temporary name keeps ``path``'s suffix: matplotlib picks the image format from it."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.tmp-{os.getpid()}{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)  # atomic on one file system, hence the same folder
    finally:
        tmp.unlink(missing_ok=True)  # gone after a successful os.replace


def write_output(flag: str, path_text: str, write) -> None:
    """atomic_write(path, write), creating its folder; an OSError becomes a one-line UserError naming ``flag``."""
    path = Path(path_text)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, write)
    except OSError as exc:
        raise UserError(f"{flag} {path_text}: cannot write ({exc.strerror})") from None


def staging_dir(target: str | Path) -> Path:
    """A new empty folder beside ``target`` (the same file system, so ``replace_dir`` can rename it into place)."""
    target = Path(os.path.abspath(target))  # "." or "out/.." name a folder with a parent too
    target.parent.mkdir(parents=True, exist_ok=True)
    # Not tempfile.mkdtemp: its folder is private (0700), and this one becomes the output, readable like others.
    staged = target.parent / f".{target.name}.staging-{os.getpid()}-{secrets.token_hex(4)}"
    staged.mkdir()
    return staged


def replace_dir(staged: str | Path, target: str | Path) -> None:
    """Move the complete folder ``staged`` to ``target``, replacing an earlier ``target``.

    The earlier folder is renamed aside and deleted only once the new one is in place, so an interrupt leaves
    either the old output or the new one, never a half-deleted or mixed folder."""
    staged, target = Path(staged), Path(os.path.abspath(target))
    if not target.exists():
        os.replace(staged, target)
        return
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    if old.exists():
        shutil.rmtree(old)
    os.replace(target, old)
    try:
        os.replace(staged, target)
    except BaseException:
        if not target.exists():
            os.replace(old, target)  # put the earlier output back
        raise
    shutil.rmtree(old, ignore_errors=True)


def interrupted(prog: str, untouched: str) -> int:
    """Ctrl-C in a CLI: one line on stderr saying what was left as it was (no traceback); returns the exit code.

    Progress bars the interrupt left open are closed first, so the line starts on a line of its own and no bar is
    drawn again after it when the interpreter exits."""
    tqdm = sys.modules.get("tqdm")
    for bar in list(getattr(getattr(tqdm, "tqdm", None), "_instances", ())):
        bar.close()
    print(f"{prog}: interrupted; {untouched}", file=sys.stderr)
    return INTERRUPTED_EXIT_CODE
