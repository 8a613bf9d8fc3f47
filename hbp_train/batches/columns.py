"""Whole columns of an HF dataset as numpy arrays, read from its Arrow table in one call.

``dataset["name"]`` looks like the way to do this but is not: since datasets 4 it returns a lazy ``Column`` that
numpy reads row by row through Python (300,000 rows took 52 s on a 2-core CPU; a 10M-sample plan's packed shards
took each rank half a minute to open). The table read here costs milliseconds and no copy for plain columns.
Every reader of whole columns goes through this module.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from hbp_train.planning.csr import gather_ranges


def _table_column(dataset, name: str) -> pa.ChunkedArray:
    """Column ``name`` of ``dataset`` as Arrow, in the dataset's row order (an indices mapping left by ``select`` or
    ``shuffle`` is applied, which only such datasets pay for)."""
    return dataset.with_format("arrow")[:][name]


def int_column(dataset, name: str, dtype=np.int64) -> np.ndarray:
    """An integer column (``length``, ``num_loss_tokens``, ...) as a numpy array of ``dtype``."""
    col = _table_column(dataset, name)
    return np.asarray(col.to_numpy() if len(col) else np.zeros(0, dtype), dtype)


def list_column(dataset, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A list column (``input_ids``, ``labels``) as (row offsets int64 [rows + 1], values), without a Python loop."""
    col = _table_column(dataset, name)
    col = col.combine_chunks() if col.num_chunks else pa.array([], pa.list_(pa.int32()))
    col = col.cast(pa.large_list(col.type.value_type))
    offsets = np.asarray(col.offsets.to_numpy(zero_copy_only=False), np.int64)
    # a sliced array's offsets start past 0 and its .values hold the rows outside the slice: flatten() does not
    return offsets - offsets[0], col.flatten().to_numpy(zero_copy_only=False)


class MappedListColumns:
    """Integer list columns of a dataset saved with ``save_to_disk``, read in place from its memory-mapped Arrow
    files: ``gather(names, rows, lengths)`` returns the rows' values concatenated, one numpy gather per file, without
    ever reading a whole column into memory (the packed-shard writer takes every sample of a 10M-sample set this
    way; its memory stays that of one batch of packs, whatever the dataset's size). Arrow's own ``take`` would not
    do: on a chunked list column it first concatenates the whole column, on every call.

    Each file is mapped once as one numpy array; every row is addressed by its file and the position of its first
    value there. ``open`` returns None where that layout does not hold (a dataset in memory, an indices mapping
    left by ``select``/``shuffle``, nulls, compressed buffers): the caller then reads the columns whole
    (``list_column``)."""

    def __init__(self, files: list, file_of: np.ndarray, starts: dict, lengths: dict, dtype):
        self._files, self._file_of, self._starts, self.dtype = files, file_of, starts, dtype
        self.lengths = lengths
        """{name: every row's list length}, to check against the dataset's ``length`` column."""

    @classmethod
    def open(cls, dataset, names: list[str]) -> "MappedListColumns | None":
        paths = [f["filename"] for f in dataset.cache_files]
        if not paths or getattr(dataset, "_indices", None) is not None:  # in memory, or rows reordered by select
            return None
        files, file_of, dtype = [], [], None
        starts, lengths = {n: [] for n in names}, {n: [] for n in names}
        for i, path in enumerate(paths):
            whole = pa.memory_map(path).read_buffer()  # zero-copy: the mapping itself
            rows = 0
            for batch in pa.ipc.open_stream(whole):
                for name in names:
                    col = batch.column(name)
                    values = col.values
                    if (col.null_count or not pa.types.is_integer(values.type)
                            or (dtype is not None and values.type != dtype)):
                        return None
                    dtype = values.type
                    width = dtype.bit_width // 8
                    data = values.buffers()[1]  # none, or empty at address 0, for a batch of empty lists only
                    at = 0 if data is None or data.size == 0 else data.address - whole.address
                    if at % width or not 0 <= at <= whole.size:  # not a slice of the mapping (e.g. decompressed)
                        return None
                    offsets = np.asarray(col.offsets.to_numpy(zero_copy_only=False), np.int64)
                    starts[name].append(at // width + values.offset + offsets[:-1])
                    lengths[name].append(np.diff(offsets))
                rows += batch.num_rows
            files.append(np.frombuffer(whole, np.uint8))
            file_of.append(np.full(rows, i, np.int32))
        file_of = np.concatenate(file_of) if file_of else np.zeros(0, np.int32)
        if len(file_of) != len(dataset):  # the files' rows are not the dataset's
            return None
        np_dtype = np.dtype(dtype.to_pandas_dtype()) if dtype is not None else np.dtype(np.int32)
        files = [f[:len(f) // np_dtype.itemsize * np_dtype.itemsize].view(np_dtype) for f in files]
        return cls(files, file_of, _joined(starts), _joined(lengths), np_dtype)

    def gather(self, names: list[str], rows: np.ndarray, lengths: np.ndarray, offsets=0) -> list[np.ndarray]:
        """For each column of ``names``: the values of ``rows`` (dataset row indices, ``lengths`` their list
        lengths), concatenated in order. The columns share where each row's values go, computed once.
        ``offsets``: take each row's values from that position in the row on (``lengths`` of them): a slice of a
        row, e.g. one sample of a packed row."""
        file_of = self._file_of[rows]
        if len(self._files) == 1:
            return [self._files[0][gather_ranges(self._starts[n][rows] + offsets, lengths)] for n in names]
        outs = [np.empty(int(lengths.sum()), self.dtype) for _ in names]
        dest = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        for f in np.unique(file_of).tolist():  # a few files (shards of ~GBs), never a loop per row or batch
            sel = np.flatnonzero(file_of == f)
            at = gather_ranges(dest[sel], lengths[sel])
            start = np.broadcast_to(offsets, rows.shape)[sel]
            for out, n in zip(outs, names):
                out[at] = self._files[f][gather_ranges(self._starts[n][rows[sel]] + start, lengths[sel])]
        return outs


def _joined(parts: dict) -> dict:
    """{name: list of per-batch arrays} -> {name: one array}."""
    return {n: np.concatenate(p) if p else np.zeros(0, np.int64) for n, p in parts.items()}


class InMemoryListColumns:
    """``MappedListColumns``' interface over columns read whole into memory (``list_column``): for datasets that are
    not laid out in memory-mapped files (in memory, or reordered by an indices mapping)."""

    def __init__(self, dataset, names: list[str]):
        self._columns = {n: list_column(dataset, n) for n in names}
        self.lengths = {n: np.diff(offsets) for n, (offsets, _) in self._columns.items()}

    def gather(self, names: list[str], rows: np.ndarray, lengths: np.ndarray, offsets=0) -> list[np.ndarray]:
        return [self._columns[n][1][gather_ranges(self._columns[n][0][rows] + offsets, lengths)] for n in names]


def open_list_columns(dataset, names: list[str]):
    """A reader of ``dataset``'s integer list columns ``names``: in place in its files where it can
    (``MappedListColumns``), else whole in memory (``InMemoryListColumns``)."""
    return MappedListColumns.open(dataset, names) or InMemoryListColumns(dataset, names)
