"""An empty CSV cell (or a null field) where a record needs its text: the column is there, the cell is empty. The
message says so, naming file:line and the column, and --on-error skip counts it under the drop reason 'empty'
(data_tools/preprocessing/inputs.py, data_tools/preprocessing/formats.py); it used to read as a record of unknown
shape, as if the header were wrong."""

from __future__ import annotations

import json

import pytest

from data_tools.preprocessing.pipeline import PreprocessError
from data_tools.preprocessing.formats import FormatError, parse_record
from tests.test_preprocess import run, write_jsonl


def test_an_empty_text_cell_names_the_cell_and_its_line(tmp_path):
    path = tmp_path / "c_text.csv"
    path.write_text("origin,text\nweb,Some plain text.\nforum,\nbook,More text.\n")
    with pytest.raises(PreprocessError) as info:
        run(tmp_path, [path])
    message = str(info.value)
    assert message.startswith(f"{path}:3: the cell of column 'text' is empty; fill it in or drop the row")
    assert "unrecognised record shape" not in message and "\n" not in message
    report, dataset = run(tmp_path, [path], on_error="skip")
    assert report["dropped"] == {"empty": 1} and report["kept"] == 2
    assert dataset["source"] == [f"{path}:2", f"{path}:4"]
    dropped = [json.loads(line) for line in (tmp_path / "out" / "dropped.jsonl").read_text().splitlines()]
    assert dropped == [{"source": f"{path}:3", "reason": "empty", "detail": "the cell of column 'text' is empty"}]


def test_an_empty_required_alpaca_cell_and_an_empty_row(tmp_path):
    path = tmp_path / "alpaca.csv"
    path.write_text("instruction,input,output\nSay hi.,,hi\nSay bye.,,\n,,\n")
    with pytest.raises(PreprocessError, match=rf"{path}:3: the cell of column 'output' is empty"):
        run(tmp_path, [path])
    report, _ = run(tmp_path, [path], on_error="skip")
    assert report["dropped"] == {"empty": 2} and report["kept"] == 1
    dropped = [json.loads(line) for line in (tmp_path / "out" / "dropped.jsonl").read_text().splitlines()]
    assert dropped[1]["detail"] == "the cells of columns 'instruction', 'output' are empty"  # line 4: all empty


def test_a_mixed_csv_whose_other_columns_are_empty_is_fine(tmp_path):
    """Empty cells of columns a row's shape does not need are absent fields, as before."""
    path = tmp_path / "mixed.csv"
    path.write_text("prompt,completion,text\nSay hi:, hi,\n,,Just text.\n")
    report, _ = run(tmp_path, [path])
    assert report["formats"] == {"prompt_completion": 1, "text": 1} and report["dropped"] == {}


def test_a_null_field_is_empty_too(tmp_path):
    with pytest.raises(FormatError, match=r"field 'text' is null") as info:
        parse_record({"origin": "web", "text": None})
    assert info.value.reason == "empty"
    data = write_jsonl(tmp_path / "d.jsonl", [{"text": "fine"}, {"id": 3, "text": None}])
    report, _ = run(tmp_path, [data], on_error="skip")
    assert report["dropped"] == {"empty": 1}
    # A record without the field at all is still of unknown shape.
    with pytest.raises(FormatError, match=r"unrecognised record shape \(keys: origin\)"):
        parse_record({"origin": "web"})
