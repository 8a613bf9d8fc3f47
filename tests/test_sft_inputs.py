"""Tests for data_tools/preprocessing/inputs.py through the real preprocess: compressed JSON lines and JSON, CSV, and
a folder of data files laid out as a hub dataset ships them. Each file type must give the very rows the same records
give as plain JSONL, with sources that point at the record in that file."""

from __future__ import annotations

import gzip
import json

import pytest

from data_tools.preprocessing.pipeline import PreprocessError
from tests.test_preprocess import ASSETS, run, write_jsonl

MESSAGES = [json.loads(line) for line in (ASSETS / "messages.jsonl").read_text().splitlines() if line.strip()]
ALPACA = json.loads((ASSETS / "alpaca.json").read_text())


def rows(dataset) -> list[tuple[list[int], list[int]]]:
    return list(zip(dataset["input_ids"], dataset["labels"]))


def test_gzip_compressed_jsonl_and_json(tmp_path, monkeypatch):
    from data_tools.preprocessing import inputs as sft_inputs

    monkeypatch.setattr(sft_inputs, "BLOCK_BYTES", 100)  # several blocks, a line across a block boundary
    jsonl_gz = tmp_path / "chats.jsonl.gz"
    jsonl_gz.write_bytes(gzip.compress((ASSETS / "messages.jsonl").read_bytes()))
    json_gz = tmp_path / "alpaca.json.gz"
    json_gz.write_bytes(gzip.compress((ASSETS / "alpaca.json").read_bytes()))
    report, dataset = run(tmp_path, [jsonl_gz, json_gz])
    _, plain = run(tmp_path, [ASSETS / "messages.jsonl", ASSETS / "alpaca.json"], "plain")
    assert rows(dataset) == rows(plain)
    assert report["formats"] == {"alpaca": 3, "messages": 4} and report["dropped"] == {}
    # line 3 of messages.jsonl is blank: JSONL sources are 1-based lines, JSON ones 0-based array rows
    assert dataset["source"] == [f"{jsonl_gz}:{n}" for n in (1, 2, 4, 5)] + [f"{json_gz}:{n}" for n in range(3)]


def test_a_corrupt_gzip_file_is_one_counted_unreadable_file(tmp_path):
    broken = tmp_path / "broken.jsonl.gz"
    broken.write_bytes(gzip.compress((ASSETS / "messages.jsonl").read_bytes())[:40])  # cut short
    with pytest.raises(PreprocessError, match=rf"{broken}: cannot read: .*gzip"):
        run(tmp_path, [broken])
    report, _ = run(tmp_path, [broken, ASSETS / "alpaca.json"], on_error="skip")
    assert report["dropped"] == {"unreadable_file": 1} and report["kept"] == 3


CSV = ('instruction,input,output,system,meta\n'
       'Repeat these words.,babo kas,babo kas,,x\n'
       '"Reverse these words: tiko ves",,ves tiko,,y\n'
       '"Sort these words.",zed abo,"abo zed",Be exact.,\n')


def test_csv_columns_become_fields(tmp_path):
    """An Alpaca CSV gives the rows the same records give as JSON; an empty cell is an absent field, a column no
    shape uses is counted; the source is the line the record starts on (the header is line 1)."""
    path = tmp_path / "alpaca.csv"
    path.write_text(CSV)
    report, dataset = run(tmp_path, [path])
    _, plain = run(tmp_path, [ASSETS / "alpaca.json"], "plain")
    assert rows(dataset) == rows(plain)
    assert report["formats"] == {"alpaca": 3} and report["ignored_fields"] == {"meta": 2}
    assert dataset["source"] == [f"{path}:{n}" for n in (2, 3, 4)]


def test_csv_prompt_completion_text_and_a_cell_over_several_lines(tmp_path):
    path = tmp_path / "mixed.csv"
    path.write_text('prompt,completion,text\n"Say\nhi:", hi,\n,,Just text.\n')
    report, dataset = run(tmp_path, [path])
    _, plain = run(tmp_path, [write_jsonl(tmp_path / "same.jsonl", [
        {"prompt": "Say\nhi:", "completion": " hi"}, {"text": "Just text."}])], "plain")
    assert rows(dataset) == rows(plain)
    assert report["formats"] == {"prompt_completion": 1, "text": 1}
    assert dataset["source"] == [f"{path}:2", f"{path}:4"]  # the first record spans lines 2-3


def test_a_csv_row_with_more_cells_than_the_header_is_bad_input(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text('instruction,output\nq,a\nq,a,stray\nq,a\n')
    with pytest.raises(PreprocessError, match=rf"{path}:3: the row has 3 cells, the header 2"):
        run(tmp_path, [path])
    report, _ = run(tmp_path, [path], on_error="skip")
    assert report["dropped"] == {"malformed_csv": 1} and report["kept"] == 2


def write_parquet(path, records) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(records), path)


def test_a_folder_of_parquet_files_as_a_hub_dataset_ships(tmp_path):
    """``--input DIR`` of a dataset downloaded from the hub: its split's files, in order; README.md is no data."""
    records = [r for r in MESSAGES if all(isinstance(m["content"], str) for m in r["messages"])]
    hub = tmp_path / "hub"
    write_parquet(hub / "data" / "train-00000-of-00002.parquet", records[:2])
    write_parquet(hub / "data" / "train-00001-of-00002.parquet", records[2:])
    (hub / "README.md").write_text("---\nlicense: mit\n---\n# A dataset\n")
    report, dataset = run(tmp_path, [hub])
    _, plain = run(tmp_path, [write_jsonl(tmp_path / "same.jsonl", records)], "plain")
    assert rows(dataset) == rows(plain) and report["kept"] == len(records) == 3
    first, second = (hub / "data" / f"train-0000{i}-of-00002.parquet" for i in (0, 1))
    assert dataset["source"] == [f"{first}:0", f"{first}:1", f"{second}:0"]


def test_a_folder_with_several_splits_is_refused_naming_the_fix(tmp_path):
    hub = tmp_path / "hub"
    write_parquet(hub / "data" / "train-00000-of-00001.parquet", MESSAGES[:1])
    write_parquet(hub / "data" / "test-00000-of-00001.parquet", MESSAGES[:1])
    with pytest.raises(PreprocessError, match=rf"{hub}: holds the splits test, train; pass one split's files, "
                                              rf"e.g. --input {hub}/data/train-\*"):
        run(tmp_path, [hub])
