"""Reading raw SFT inputs -> ``(source, record)`` pairs: JSONL, JSON, CSV (each also gzip-compressed, ``.gz``),
Parquet, saved HF datasets, and folders of such files as a dataset downloaded from the hub ships them.

``resolve_input`` turns one ``--input`` into the files to read: a file is itself; a directory written by
``datasets.save_to_disk`` is read as one input; any other folder is resolved as datasets resolves a hub dataset's
folder (``datasets.data_files.get_data_patterns``: ``data/train-00000-of-00002.parquet``, ``train/0000.parquet``,
or every file when no split is named), and the data files of its one split are read in order (a README.md and
other files are not data). A folder holding several splits is refused: which one to train on is the user's call.

Each record's ``source`` is ``path:N``: N is the 1-based line for JSONL, the line a record starts on for CSV (the
header is line 1), the 0-based row for JSON arrays, Parquet and HF datasets (``ds[N]``); a whole-file problem is
reported as ``path`` (or ``path:LINE`` for a JSON syntax error). A ``.json`` file holding JSON lines is read as
JSONL. A CSV's columns become the fields of its records, all strings, an empty cell an absent field (the record
lists the columns whose cell is empty, ``CsvRecord.empty_cells``, so a record that needed one says which cell is
empty): it carries the flat shapes (Alpaca, prompt/completion strings, text), not lists of turns. Nothing here
raises for bad input: a bad line, row, file or folder is yielded as a ``FormatError`` in place of the record, with
one of ``FILE_REASONS`` as its reason, so ``data_tools.preprocess`` can stop at it or count it (``--on-error``).

JSONL is streamed: ``jsonl_blocks`` reads a file (decompressing a ``.gz`` as it goes) in blocks of whole lines
(``BLOCK_BYTES`` each), which ``parse_jsonl_block`` turns into records; memory stays bounded however large the
file. CSV is streamed row by row, Parquet and HF datasets in row batches. (A ``.json`` array is one JSON value and is
read whole: use JSONL for large corpora.)
"""

from __future__ import annotations

import gzip
import json
import os
import zlib
from pathlib import Path
from typing import Iterator

from data_tools.preprocessing.formats import FormatError, one_line

# reason -> what it means, for the problems of whole lines and files (record shapes: formats.REASONS).
FILE_REASONS = {
    "malformed_json": "the line (or JSON file) is not valid JSON",
    "malformed_csv": "a CSV row does not parse or has another number of cells than the header",
    "invalid_utf8": "the line (or file) is not valid UTF-8",
    "missing_file": "an input path does not exist",
    "unreadable_file": "an input file or dataset could not be read",
    "unsupported_file_type": "an input is not .jsonl/.json/.csv(.gz)/.parquet, a saved HF dataset or a data folder",
    "several_splits": "an input folder holds several splits (e.g. train and test)",
}
# File name endings read, and the reader each means.
KINDS = {".jsonl": "jsonl", ".jsonl.gz": "jsonl", ".json": "json", ".json.gz": "json", ".csv": "csv",
         ".csv.gz": "csv", ".parquet": "parquet"}
_KINDS_TEXT = "/".join(KINDS)

# Bytes of JSONL read at a time: a few thousand typical chats, a unit of work for a preprocessing worker.
BLOCK_BYTES = 1 << 20
# Python's csv refuses cells over 128 KiB by default; a long-context sample's cell is longer.
_CSV_FIELD_LIMIT = 2**31 - 1
# A gzip file cut short or corrupt: what gzip and zlib raise.
_GZIP_ERRORS = (EOFError, zlib.error, gzip.BadGzipFile)


class CsvRecord(dict):
    """A CSV row's record: its non-empty cells by column, and ``empty_cells``, the columns whose cell is empty."""

    def __init__(self, header: list[str], cells: list[str]):
        super().__init__((name, cell) for name, cell in zip(header, cells) if cell != "")
        self.empty_cells = tuple(name for name, cell in zip(header, cells) if cell == "")


def input_kind(path: str) -> str | None:
    """``jsonl``, ``json``, ``csv`` or ``parquet`` as the file's name ends (``KINDS``), None for another file."""
    name = path.lower()
    return next((kind for ending, kind in KINDS.items() if name.endswith(ending)), None)


def resolve_input(path: str) -> list[str] | FormatError:
    """The files (or saved HF dataset directory) one ``--input`` stands for, in reading order, or the FormatError
    that says why it cannot be read (see the module docstring)."""
    p = Path(path)
    if not p.exists():
        return FormatError("missing_file", "no such file or directory", "check the --input path")
    if not p.is_dir() or (p / "state.json").exists() or (p / "dataset_dict.json").exists():
        return [path]
    from datasets.data_files import DataFilesDict, EmptyDatasetError, get_data_patterns

    try:
        found = DataFilesDict.from_patterns(get_data_patterns(path), base_path=path)
    except EmptyDatasetError:
        found = {}
    root = os.path.abspath(path)
    splits = {str(split): [os.path.join(path, os.path.relpath(f, root)) for f in files if input_kind(f)]
              for split, files in found.items()}
    splits = {split: files for split, files in splits.items() if files}
    if not splits:
        return FormatError("unsupported_file_type", f"a folder with no {_KINDS_TEXT} file and no saved HF dataset",
                           "pass data files, a folder of them, or a directory written by save_to_disk")
    if len(splits) > 1:
        split = "train" if "train" in splits else sorted(splits)[0]
        first = Path(splits[split][0])
        example = f"{first.parent}/{split}-*" if first.name.startswith(split) else str(first.parent)
        return FormatError("several_splits", f"holds the splits {', '.join(sorted(splits))}",
                           f"pass one split's files, e.g. --input {example}")
    return next(iter(splits.values()))


def iter_records(path: str) -> Iterator[tuple[str, object]]:
    """Yield ``(source, record)`` for every record of one file or saved HF dataset, ``(source, FormatError)`` for a
    bad one."""
    if Path(path).is_dir():
        yield from _iter_hf_dir(path)
        return
    kind = input_kind(path)
    if kind is None:
        yield path, FormatError("unsupported_file_type", f"unsupported file type '{Path(path).suffix or path}'",
                                f"convert it to one of {_KINDS_TEXT} (or a saved HF dataset directory)")
    elif kind == "parquet":
        yield from _iter_parquet(path)
    elif kind == "csv":
        yield from _iter_csv(path)
    elif kind == "jsonl":
        for head, block, _ in jsonl_blocks(path):
            yield from ([(head, block)] if isinstance(block, FormatError) else parse_jsonl_block(path, block, head))
    else:
        try:
            data = Path(path).read_bytes()
            data = gzip.decompress(data) if path.lower().endswith(".gz") else data
        except _GZIP_ERRORS as e:
            yield path, _bad_gzip(e)
            return
        except OSError as e:
            yield path, FormatError("unreadable_file", f"cannot read: {e.strerror}", "check the file's permissions")
            return
        yield from _iter_json(path, data)


def _bad_gzip(e: Exception) -> FormatError:
    return FormatError("unreadable_file", f"cannot read: not a complete gzip file ({one_line(e, 150)})",
                       "check that the file was copied whole, or decompress it and pass the result")


def parse_jsonl_block(path: str, data: bytes, first_line: int = 1) -> Iterator[tuple[str, object]]:
    """``(source, record or FormatError)`` of every non-blank line of ``data``, whose first line is ``first_line``
    of ``path`` (1-based)."""
    for line_no, raw in enumerate(data.split(b"\n"), start=first_line):
        if not raw.strip():
            continue  # blank lines (and the final newline) are not records
        source = f"{path}:{line_no}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            yield source, FormatError("invalid_utf8", f"invalid UTF-8 at byte {e.start} of the line",
                                      "re-encode the file as UTF-8")
            continue
        if line_no == 1:
            text = text.lstrip("\ufeff")
        try:
            yield source, json.loads(text)
        except json.JSONDecodeError as e:
            yield source, FormatError("malformed_json", f"malformed JSON ({e.msg} at column {e.colno})",
                                      "fix the line so it is one JSON object")


def jsonl_blocks(path: str) -> Iterator[tuple[int, bytes, int] | tuple[str, FormatError, int]]:
    """``(first line number, bytes of whole lines, bytes of the file read for them)`` of a JSONL file (``.gz``
    decompressed), BLOCK_BYTES at a time, or one ``(path, FormatError, 0)`` if it cannot be read (after the blocks
    read before the problem)."""
    try:
        raw = open(path, "rb")
    except OSError as e:
        yield path, FormatError("unreadable_file", f"cannot read: {e.strerror}", "check the file's permissions"), 0
        return
    with raw, (gzip.GzipFile(fileobj=raw) if path.lower().endswith(".gz") else raw) as f:
        line, rest, consumed = 1, b"", 0
        while True:
            try:
                chunk = f.read(BLOCK_BYTES)
            except _GZIP_ERRORS as e:
                yield path, _bad_gzip(e), 0
                return
            except OSError as e:
                yield path, FormatError("unreadable_file", f"cannot read: {e.strerror}", "check the file"), 0
                return
            if not chunk:
                break
            cut = chunk.rfind(b"\n") + 1
            if not cut:  # no line ends in this chunk: a very long line, keep reading
                rest += chunk
                continue
            block, rest = rest + chunk[:cut], chunk[cut:]
            position = raw.tell()
            yield line, block, position - consumed
            consumed = position
            line += block.count(b"\n")
        if rest:
            yield line, rest, raw.tell() - consumed


def _iter_json(path: str, data: bytes) -> Iterator[tuple[str, object]]:
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        yield f"{path}:{line}", FormatError("invalid_utf8", f"invalid UTF-8 at byte {e.start} of the file",
                                            "re-encode the file as UTF-8")
        return
    try:
        records = json.loads(text)
    except json.JSONDecodeError as e:
        if e.msg == "Extra data":  # several JSON values: a JSON-lines file named .json
            yield from parse_jsonl_block(path, data)
            return
        yield f"{path}:{e.lineno}", FormatError("malformed_json", f"malformed JSON ({e.msg} at column {e.colno})",
                                                "fix the file so it is one JSON array of records (or use JSONL)")
        return
    if not isinstance(records, list):
        yield path, FormatError("malformed_json", f"top level is a {type(records).__name__}, not an array",
                                "put the records in a JSON array [...] or write one per line as JSONL")
        return
    for row, record in enumerate(records):
        yield f"{path}:{row}", record


def _iter_csv(path: str) -> Iterator[tuple[str, object]]:
    """Rows of a CSV as records ``{column: cell}``, empty cells left out; ``source`` is the line the row starts on."""
    import csv

    csv.field_size_limit(_CSV_FIELD_LIMIT)
    line = 1
    try:
        opener = gzip.open if path.lower().endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8-sig", newline="") as f:
            reader = csv.reader(f)
            header = next(reader, [])
            line = reader.line_num + 1
            for cells in reader:
                if len(cells) == len(header):
                    yield f"{path}:{line}", CsvRecord(header, cells)
                elif cells:  # a blank line is no record
                    yield f"{path}:{line}", FormatError(
                        "malformed_csv", f"the row has {len(cells)} cells, the header {len(header)}",
                        "quote the cells that hold commas, quotes or line breaks (\"...\", a quote doubled)")
                line = reader.line_num + 1
    except csv.Error as e:
        yield f"{path}:{line}", FormatError("malformed_csv", f"cannot parse CSV ({one_line(e, 150)})",
                                            "check the quoting from this line on")
    except UnicodeDecodeError as e:
        yield f"{path}:{line}", FormatError("invalid_utf8", f"invalid UTF-8 ({one_line(e, 100)})",
                                            "re-encode the file as UTF-8")
    except _GZIP_ERRORS as e:
        yield path, _bad_gzip(e)
    except OSError as e:
        yield path, FormatError("unreadable_file", f"cannot read: {e.strerror}", "check the file's permissions")


def _iter_parquet(path: str) -> Iterator[tuple[str, object]]:
    import pyarrow.parquet as pq

    try:
        batches = pq.ParquetFile(path).iter_batches(batch_size=1024)
        row = 0
        for batch in batches:
            for record in batch.to_pylist():
                yield f"{path}:{row}", record
                row += 1
    except (OSError, ValueError) as e:  # pyarrow raises ArrowInvalid (a ValueError) / ArrowIOError (an OSError)
        yield path, FormatError("unreadable_file", f"cannot read Parquet: {one_line(e, 150)}",
                                "check that the file is a complete Parquet file")


def _iter_hf_dir(path: str) -> Iterator[tuple[str, object]]:
    import datasets

    try:
        dataset = datasets.load_from_disk(path)
    except Exception as e:  # noqa: BLE001 -- any load failure is a per-input error, reported with its cause
        yield path, FormatError("unreadable_file", f"cannot load saved HF dataset: {one_line(e, 150)}",
                                "pass a directory written by datasets' save_to_disk")
        return
    if isinstance(dataset, datasets.DatasetDict):
        if len(dataset) != 1:
            yield path, FormatError("unreadable_file", f"a DatasetDict with splits {sorted(dataset)}",
                                    f"pass one split's directory, e.g. {path}/{sorted(dataset)[0]}")
            return
        dataset = next(iter(dataset.values()))
    row = 0
    for batch in dataset.iter(batch_size=1024):
        columns = list(batch)
        for i in range(len(batch[columns[0]]) if columns else 0):
            yield f"{path}:{row}", {c: batch[c][i] for c in columns}
            row += 1
