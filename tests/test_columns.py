"""hbp_train.batches.columns: whole columns read from the Arrow table, and list columns read in place from the memory-mapped
files, equal the rows datasets itself returns, for a dataset saved in several shards, one with an indices mapping
(select), one in memory and an empty one."""

from __future__ import annotations

import datasets
import numpy as np
import pytest

from hbp_train.batches.columns import InMemoryListColumns, MappedListColumns, int_column, list_column, open_list_columns


def _rows(n, seed=0):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 9, n)
    ids = [rng.integers(0, 1000, int(k)).astype(np.int32).tolist() for k in lengths]
    return {"input_ids": ids, "length": lengths.astype(np.int32).tolist()}


@pytest.fixture
def saved(tmp_path):
    datasets.disable_progress_bars()
    datasets.Dataset.from_dict(_rows(500)).save_to_disk(str(tmp_path / "ds"), num_shards=3)
    return datasets.load_from_disk(str(tmp_path / "ds"))


def _expected(ds):
    rows = [ds[i] for i in range(len(ds))]  # datasets' own row access: the reference
    return [r["length"] for r in rows], [r["input_ids"] for r in rows]


@pytest.mark.parametrize("view", ["whole", "selected", "empty"])
def test_columns_equal_what_datasets_returns_row_by_row(saved, view):
    ds = {"whole": saved, "selected": saved.select([7, 3, 499, 3, 0, 250]), "empty": saved.select([])}[view]
    lengths, ids = _expected(ds)
    got = int_column(ds, "length")
    assert got.dtype == np.int64 and got.tolist() == lengths
    offsets, values = list_column(ds, "input_ids")
    assert offsets.dtype == np.int64 and offsets[0] == 0 and len(offsets) == len(ds) + 1
    assert [values[offsets[i]:offsets[i + 1]].tolist() for i in range(len(ds))] == ids


def test_a_sliced_list_column_starts_at_its_first_row():
    # a dataset over a slice of a table: its Arrow list offsets start past 0 and the values hold the rows before it
    table = datasets.Dataset.from_dict(_rows(40, seed=1)).data.table.slice(10, 20)
    ds = datasets.Dataset(table)
    assert ds.with_format("arrow")[:]["input_ids"].chunk(0).offsets[0].as_py() > 0
    _, ids = _expected(ds)
    offsets, values = list_column(ds, "input_ids")
    assert [values[offsets[i]:offsets[i + 1]].tolist() for i in range(len(ds))] == ids


@pytest.mark.parametrize("view", ["saved", "selected", "in_memory"])
def test_list_columns_gather_any_rows_in_any_order(saved, view):
    ds = {"saved": saved, "selected": saved.select(range(499, -1, -1)),
          "in_memory": datasets.Dataset.from_dict(saved.to_dict())}[view]
    reader = open_list_columns(ds, ["input_ids", "length"][:1])
    # in place where the rows are the files' rows; a reordered or in-memory set is read whole
    assert isinstance(reader, MappedListColumns if view == "saved" else InMemoryListColumns)
    lengths, ids = _expected(ds)
    assert reader.lengths["input_ids"].tolist() == lengths
    rows = np.random.default_rng(3).integers(0, len(ds), 300)  # repeats, every file, any order
    got, = reader.gather(["input_ids"], rows, np.asarray(lengths)[rows])
    assert got.tolist() == [t for r in rows for t in ids[r]]
    assert reader.gather(["input_ids"], rows[:0], np.zeros(0, np.int64))[0].tolist() == []


def test_mapped_columns_read_no_column_whole(saved):
    """The in-place reader allocates nothing the size of a column in Arrow (reading a column whole, as combine_chunks
    or take do, is what made the shard writer's memory grow with the dataset): its values stay in the mapped files."""
    import pyarrow as pa

    lengths, ids = _expected(saved)
    column_bytes = sum(len(r) for r in ids) * saved.features["input_ids"].feature.pa_type.bit_width // 8
    before = pa.total_allocated_bytes()
    reader = MappedListColumns.open(saved, ["input_ids"])
    got, = reader.gather(["input_ids"], np.arange(len(saved)), np.asarray(lengths))
    assert pa.total_allocated_bytes() - before < column_bytes / 4
    assert got.tolist() == sum(ids, [])
    whole = list_column(saved, "input_ids")  # the reference: reading it whole does allocate the column
    assert pa.total_allocated_bytes() - before >= column_bytes and len(whole[1]) == len(got)


def test_a_file_of_empty_lists_opens_in_place(tmp_path):
    datasets.Dataset.from_dict({"input_ids": [[], []]}, features=datasets.Features(
        {"input_ids": datasets.Sequence(datasets.Value("int32"))})).save_to_disk(str(tmp_path / "empty"))
    reader = MappedListColumns.open(datasets.load_from_disk(str(tmp_path / "empty")), ["input_ids"])
    assert reader.lengths["input_ids"].tolist() == [0, 0]
    assert reader.gather(["input_ids"], np.array([1, 0]), np.zeros(2, np.int64))[0].tolist() == []
