"""Reading raw SFT inputs: JSONL, JSON, Parquet files and saved HF datasets -> ``(source, record)`` pairs.

Each record's ``source`` is ``path:N``: N is the 1-based line for JSONL, the 0-based row for JSON arrays, Parquet and
HF datasets (``ds[N]``); a whole-file problem is reported as ``path`` (or ``path:LINE`` for a JSON syntax error). A
``.json`` file holding JSON lines is read as JSONL. Nothing here raises for bad input: a bad line, file or
directory is yielded as a ``FormatError`` in place of the record, with one of ``FILE_REASONS`` as its reason, so
``data_tools.preprocess`` can stop at it or count it (``--on-error``).

JSONL is streamed: ``jsonl_blocks`` reads a file in blocks of whole lines (``BLOCK_BYTES`` each), which
``parse_jsonl_block`` turns into records; memory stays bounded however large the file. (A ``.json`` array is one
JSON value and is read whole: use JSONL for large corpora.) Parquet and HF datasets are read in row batches.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from data_tools.sft_formats import FormatError, one_line

# reason -> what it means, for the problems of whole lines and files (record shapes: sft_formats.REASONS).
FILE_REASONS = {
    "malformed_json": "the line (or JSON file) is not valid JSON",
    "invalid_utf8": "the line (or file) is not valid UTF-8",
    "missing_file": "an input path does not exist",
    "unreadable_file": "an input file or dataset could not be read",
    "unsupported_file_type": "an input is not .jsonl/.json/.parquet or a saved HF dataset directory",
}


# Bytes of JSONL read at a time: a few thousand typical chats, a unit of work for a preprocessing worker.
BLOCK_BYTES = 1 << 20


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


def iter_records(path: str) -> Iterator[tuple[str, object]]:
    """Yield ``(source, record)`` for every record of one input, or ``(source, FormatError)`` for a bad one."""
    p = Path(path)
    if not p.exists():
        yield path, FormatError("missing_file", "no such file or directory", "check the --input path")
        return
    if p.is_dir():
        if (p / "state.json").exists() or (p / "dataset_dict.json").exists():
            yield from _iter_hf_dir(path)
        else:
            yield path, FormatError("unsupported_file_type", "a directory that is not a saved HF dataset",
                                    "pass .jsonl/.json/.parquet files or a directory written by save_to_disk")
        return
    suffix = p.suffix.lower()
    if suffix == ".parquet":
        yield from _iter_parquet(path)
        return
    if suffix not in (".jsonl", ".json"):
        yield path, FormatError("unsupported_file_type", f"unsupported file type '{suffix or p.name}'",
                                "convert it to .jsonl, .json or .parquet (or a saved HF dataset directory)")
        return
    if suffix == ".jsonl":
        for item in jsonl_blocks(path):
            yield from ([item] if isinstance(item[1], FormatError) else parse_jsonl_block(path, item[1], item[0]))
        return
    try:
        data = p.read_bytes()
    except OSError as e:
        yield path, FormatError("unreadable_file", f"cannot read: {e.strerror}", "check the file's permissions")
        return
    yield from _iter_json(path, data)


def jsonl_blocks(path: str) -> Iterator[tuple[int, bytes] | tuple[str, FormatError]]:
    """``(first line number, bytes of whole lines)`` of a JSONL file, BLOCK_BYTES at a time, or one
    ``(path, FormatError)`` if it cannot be read."""
    try:
        f = open(path, "rb")
    except OSError as e:
        yield path, FormatError("unreadable_file", f"cannot read: {e.strerror}", "check the file's permissions")
        return
    with f:
        line, rest = 1, b""
        while True:
            try:
                chunk = f.read(BLOCK_BYTES)
            except OSError as e:
                yield path, FormatError("unreadable_file", f"cannot read: {e.strerror}", "check the file")
                return
            if not chunk:
                break
            cut = chunk.rfind(b"\n") + 1
            if not cut:  # no line ends in this chunk: a very long line, keep reading
                rest += chunk
                continue
            block, rest = rest + chunk[:cut], chunk[cut:]
            yield line, block
            line += block.count(b"\n")
        if rest:
            yield line, rest
