"""The sample lengths a plan is made of: a lengths file (text or .npy) or a tokenized dataset's ``length`` column,
each read with one-line errors naming the file and line (``CliError``), and the warning when the data is longer
than the ``--max-len`` preprocessing was told. Read by data_tools.pack and data_tools.compare."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

from data_tools.packing.groups import CliError
from hbp_train.batches.columns import int_column


def read_lengths(path: str) -> np.ndarray:
    """Lengths from a text file (one integer per line) or a .npy file; CliError naming FILE:line on bad input."""
    f = Path(path)
    if f.is_dir():
        raise CliError(f"--lengths {path}: is a directory; pass a lengths file, or a tokenized dataset with --dataset")
    if not f.is_file():
        raise CliError(f"--lengths {path}: no such file")
    if f.suffix == ".npy":
        try:
            arr = np.load(f, allow_pickle=False)
        except Exception as e:  # noqa: BLE001 - any unreadable file is a user error here
            raise CliError(f"{path}: not a readable .npy array ({type(e).__name__}: {e})") from None
        if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
            raise CliError(f"{path}: must hold a 1-D integer array, got shape {arr.shape} dtype {arr.dtype}")
        arr = arr.astype(np.int64, copy=False)
        bad = np.flatnonzero(arr <= 0)
        if len(bad):
            raise CliError(f"{path}[{int(bad[0])}]: length {int(arr[bad[0]])}; every sample needs >= 1 token")
        return arr
    try:
        data = f.read_bytes()
    except OSError as e:
        raise CliError(f"--lengths {path}: cannot read ({e.strerror}); check the path and its permissions") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line_no = data[:e.start].count(b"\n") + 1
        raise CliError(f"{path}:{line_no}: not UTF-8 text; give one integer per line or a .npy file") from None
    lines = text.split("\n")
    while lines and not lines[-1].strip():
        lines.pop()
    try:
        arr = np.array(lines, dtype=np.int64) if lines else np.zeros(0, np.int64)
    except (ValueError, OverflowError):
        for no, line in enumerate(lines, 1):
            try:
                value = int(line.strip())
            except ValueError:
                raise CliError(f"{path}:{no}: {line.strip()[:40]!r} is not an integer token length") from None
            if not -(1 << 63) <= value < 1 << 63:
                raise CliError(f"{path}:{no}: length {line.strip()[:40]} is too large for a token length") from None
        raise CliError(f"{path}: could not read the lengths") from None
    bad = np.flatnonzero(arr <= 0)
    if len(bad):
        raise CliError(f"{path}:{int(bad[0]) + 1}: length {int(arr[bad[0]])}; every sample needs >= 1 token")
    return arr


def read_dataset_lengths(path: str) -> np.ndarray:
    """The 'length' column of a tokenized dataset (data_tools.preprocess's output); CliError naming --dataset."""
    if not Path(path).is_dir():
        raise CliError(f"--dataset {path}: no such directory; pass the output directory of data_tools.preprocess")
    if not Path(path, "dataset_info.json").is_file() and not Path(path, "state.json").is_file():
        raise CliError(f"--dataset {path}: not a dataset saved with save_to_disk (no state.json)")
    import datasets

    try:
        ds = datasets.load_from_disk(path)
    except Exception as e:  # noqa: BLE001 - a damaged dataset dir is a user error; say why in one line
        raise CliError(f"--dataset {path}: cannot load ({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None
    if "length" not in ds.column_names:
        raise CliError(f"--dataset {path}: no 'length' column (columns: {', '.join(ds.column_names)})")
    arr = int_column(ds, "length")
    bad = np.flatnonzero(arr <= 0)
    if len(bad):
        raise CliError(f"--dataset {path}: row {int(bad[0])} has length {int(arr[bad[0]])}; every sample needs >= 1 token")
    return arr


def warn_if_longer_than_max_len(lengths: np.ndarray, max_len: int | None, largest_pack_len: int) -> None:
    """--max-len states what preprocessing guaranteed; samples beyond it mean the two disagree. Say on stderr what
    happens to them: those longer than the largest pack_len are dropped (the plan's dropped list), the others are
    planned into the largest group; and how to make the two agree."""
    if max_len is None or int(lengths.max()) <= max_len:
        return
    longest = int(lengths.max())
    num_over = int(np.count_nonzero(lengths > max_len))
    num_dropped = int(np.count_nonzero(lengths > largest_pack_len))
    fates = []
    if num_dropped:
        fates.append(f"{num_dropped} are longer than the largest pack_len {largest_pack_len} and are dropped (reason "
                     "longer_than_max_pack_len, listed in the plan)")
    if num_over > num_dropped:
        fates.append(f"{num_over - num_dropped} fit the largest pack_len and are planned")
    print(f"warning: {num_over} samples are longer than --max-len {max_len} (longest {longest}): {'; '.join(fates)}; "
          f"to keep them cut to {max_len} tokens re-run data_tools.preprocess --max-len {max_len} --overlong truncate, "
          f"or raise --max-len with a group of pack_len >= {longest}", file=sys.stderr)
