"""Raw SFT data -> tokenized, labelled HF dataset shards (the input of data_tools.pack): ``preprocess()``, the work
of ``hbp-preprocess`` (data_tools/preprocess.py is its command line).

``preprocess(inputs, output, tokenizer, ...) -> report`` raises a ``UserError`` (one-line message):
``PreprocessError``, or ``chat_labels.TokenizerError`` for an unusable tokenizer.

The pipeline, one module per step in this folder: read the inputs (JSONL, JSON, CSV, each also ``.gz``; Parquet; a
directory saved with ``datasets.save_to_disk``; a folder of such files as a hub dataset ships; each sample's
``source`` is ``path:N``) with ``inputs.py``; detect each record's shape (OpenAI ``messages``, ShareGPT
``conversations``, Alpaca, TRL prompt/completion, plain text) and normalise it with ``formats.py``; render the turns
with the tokenizer's chat template (plain text with none) and label the trained tokens (``labels`` = ``input_ids``
there, ``-100`` elsewhere, not shifted) with ``chat_labels.py``; all three in the worker processes of
``workers.py``. This module hands them the input, applies the held-out split and the input weights
(``mixing.py``), and writes the dataset and the report (``report.py`` counts). docs/input_formats.md describes every
shape, and how to split and weight inputs.

Output DIR: the dataset (columns ``input_ids``, ``labels`` list<int32>; ``length``, ``num_loss_tokens`` int32;
``source`` string; ``num_loss_tokens`` = ``labels[1:] != -100`` counted, always >= 1), ``report.json`` (``read ==
kept + sum(dropped.values())``) and ``dropped.jsonl`` (one ``{"source", "reason", "detail"}`` per dropped sample).
It is built in a staging directory next to DIR and moved into place at the end; an existing DIR is replaced only if
it holds an earlier preprocess output (a ``report.json``). With ``--heldout-fraction``/``--heldout-count`` the
held-out samples go to a second dataset of the same format (``--heldout-output``, default DIR_heldout) with its own
report.json; a sample a weight below 1 leaves out is a line of dropped.jsonl with reason ``weight``.

Drops: ``overlong`` (with ``--overlong drop``), ``no_loss_tokens``, ``no_loss_tokens_after_truncation`` are policy
drops, always counted. Everything else (see ``ERROR_REASONS``) is bad input: with ``--on-error fail`` (default) the
run stops at the first one with one line naming ``file:line``, the problem and the fix (CLI exit code 2); with
``--on-error skip`` the record is dropped and counted by reason. An unreadable file counts as one dropped record.
Nothing else is left out unsaid: report.json counts the fields no shape uses (``ignored_fields``) and the assistant
turns kept as context only (``untrained_turns``: ``weight_0``, ``prompt``).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections import deque
from pathlib import Path

import numpy as np

from data_tools.preprocessing.chat_labels import TEMPLATE_REASONS, ChatEncoder
from data_tools.preprocessing.formats import FORMATS, REASONS, FormatError
from data_tools.preprocessing.inputs import FILE_REASONS, input_kind, iter_records, jsonl_blocks, resolve_input
from data_tools.preprocessing.mixing import Mix, apply_mix, parse_input
from data_tools.preprocessing.report import Counts
from data_tools.preprocessing.workers import Chunk, encode_task, init_worker, start_pool
from hbp_train.common.errors import UserError
from hbp_train.common.library_bars import datasets_bars_off
from hbp_train.common.outputs import replace_dir, staging_dir
from hbp_train.batches.vocab import data_record

POLICY_DROPS = ("overlong", "no_loss_tokens", "no_loss_tokens_after_truncation")
# Every drop that means bad input: record shapes, lines and files, conversations the template cannot label.
ERROR_REASONS = {**REASONS, **FILE_REASONS, **TEMPLATE_REASONS}
_SKIP_HINT = "or pass --on-error skip to drop and count such records"
_TASK_RECORDS = 2048  # parsed records per worker task (inputs other than JSONL, which go as blocks of lines)


class PreprocessError(UserError):
    """A user-facing failure; ``str(e)`` is one line naming the file/line, the problem and the fix. (An unusable
    --tokenizer is chat_labels.TokenizerError, also a UserError.)"""


# ------------------------------------------------------------------------------------------------------ output


def _features():
    from datasets import Features, Sequence, Value

    return Features({
        "input_ids": Sequence(Value("int32")),
        "labels": Sequence(Value("int32")),
        "length": Value("int32"),
        "num_loss_tokens": Value("int32"),
        "source": Value("string"),
    })


def _record_batch(chunk: Chunk, schema):
    """One Arrow record batch of a chunk's kept rows (no Python object per token)."""
    import pyarrow as pa

    offsets = pa.array(np.concatenate([[0], np.cumsum(chunk.lengths)]).astype(np.int32))
    return pa.RecordBatch.from_arrays(
        [pa.ListArray.from_arrays(offsets, pa.array(chunk.input_ids)),
         pa.ListArray.from_arrays(offsets, pa.array(chunk.labels)),
         pa.array(chunk.lengths), pa.array(chunk.num_loss_tokens), pa.array(chunk.sources, type=pa.string())],
        schema=schema,
    )


def _tasks(resolved: list[tuple[str, list[str] | FormatError]]):
    """``(task, input bytes it covers, index of its input)`` for every input file (``resolved``: each input with its
    files, or the FormatError that says why it has none): JSONL files as blocks of lines (parsed by the workers),
    other files as lists of parsed records (``_TASK_RECORDS`` each; their bytes counted when the file is done)."""
    for index, (path, files) in enumerate(resolved):
        if isinstance(files, FormatError):
            yield ("records", [(path, files)]), 0, index
            continue
        for file in files:
            if input_kind(file) == "jsonl" and Path(file).is_file():
                for head, block, size in jsonl_blocks(file):  # (first line, lines, bytes) or (path, error, 0)
                    if isinstance(block, FormatError):
                        yield ("records", [(head, block)]), 0, index
                    else:
                        yield ("lines", file, head, block), size, index
                continue
            records = []
            for item in iter_records(file):
                records.append(item)
                if len(records) == _TASK_RECORDS:
                    yield ("records", records), 0, index
                    records = []
            yield ("records", records), _input_bytes(file), index


def _input_bytes(path: str) -> int:
    """Size of an input file (0 for a directory), for the progress bar."""
    p = Path(path)
    return p.stat().st_size if p.is_file() else 0


def _check_output(output: Path, flag: str = "--output") -> None:
    if output.exists() and not output.is_dir():
        raise PreprocessError(f"{output}: output exists and is a file; pass a directory path to {flag}")
    if output.is_dir() and any(output.iterdir()) and not (output / "report.json").exists():
        raise PreprocessError(f"{output}: output directory is not empty and holds no earlier preprocess output; "
                              f"choose a new or empty {flag} directory")


# ------------------------------------------------------------------------------------------------------ driver


def preprocess(inputs: list[str], output: str, tokenizer: str, fmt: str = "auto", max_len: int | None = None,
               overlong: str = "drop", on_error: str = "fail", num_proc: int = 1, num_shards: int | None = None,
               progress: bool | None = None, heldout_fraction: float | None = None, heldout_count: int | None = None,
               heldout_output: str | None = None, seed: int = 0) -> dict:
    """Tokenize ``inputs`` into the dataset directory ``output`` and return the report (also in report.json).

    An input may end in ``:<weight>``; ``heldout_fraction`` or ``heldout_count`` hold kept samples out into
    ``heldout_output`` (default OUTPUT_heldout); ``seed`` draws both (data_tools/preprocessing/mixing.py).
    Raises ``PreprocessError`` (one-line message) for bad arguments, the first bad record when
    ``on_error == "fail"``, or when no sample is kept; ``TokenizerError`` for an unusable tokenizer; ``UserError``
    for a bad weight or held-out size. ``progress=None`` shows a bar only on a terminal.
    """
    import datasets
    import pyarrow as pa
    from tqdm import tqdm

    if not inputs:
        raise PreprocessError("no --input given; pass one or more data files, folders of them or HF dataset dirs")
    if fmt not in ("auto", *FORMATS):
        raise PreprocessError(f"--format {fmt!r} is unknown; use auto, {', '.join(FORMATS)}")
    if overlong not in ("drop", "truncate"):
        raise PreprocessError(f"--overlong {overlong!r} is unknown; use drop or truncate")
    if on_error not in ("fail", "skip"):
        raise PreprocessError(f"--on-error {on_error!r} is unknown; use fail or skip")
    if max_len is not None and max_len < 2:
        raise PreprocessError(f"--max-len {max_len} is too small; it must be >= 2 (one input and one target)")
    if num_proc < 1:
        raise PreprocessError(f"--num-proc {num_proc} must be >= 1")
    num_cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    if num_proc > num_cpus:
        # More tokenizer workers than CPUs only adds memory (each holds a tokenizer); a huge N would fork-bomb.
        print(f"warning: --num-proc {num_proc} > {num_cpus} CPUs available; using {num_cpus}", file=sys.stderr)
        num_proc = num_cpus
    if num_shards is not None and num_shards < 1:
        raise PreprocessError(f"--num-shards {num_shards} must be >= 1")
    parsed = [parse_input(str(p)) for p in inputs]
    inputs = [path for path, _ in parsed]
    mix = Mix([weight for _, weight in parsed], heldout_fraction, heldout_count, heldout_output, seed)
    resolved = [(path, resolve_input(path)) for path in inputs]
    output_dir = Path(output)
    _check_output(output_dir)
    heldout_dir = mix.heldout_dir(output) if mix.heldout else None
    if heldout_dir is not None:
        if heldout_dir.resolve() == output_dir.resolve():
            raise PreprocessError(f"--heldout-output {heldout_dir}: the same folder as --output; choose another")
        _check_output(heldout_dir, "--heldout-output")

    encoder = ChatEncoder(str(tokenizer))
    features = _features()
    try:
        work = staging_dir(output_dir)
    except OSError as e:
        raise PreprocessError(f"{output_dir}: cannot create the output directory ({e.strerror}); pass a writable "
                              f"--output path") from None
    pool = dropped_file = writer = bar = heldout_staged = None
    try:
        if num_proc > 1:
            pool = start_pool(num_proc, str(tokenizer), max_len, overlong, encoder, fmt)
        else:
            init_worker(str(tokenizer), max_len, overlong, encoder, fmt)
        counts = Counts()
        read_per_input = [0] * len(inputs)
        row_input = []  # the input of each kept row, chunk by chunk
        dropped_file = open(work / "dropped.jsonl", "w", encoding="utf-8")
        schema = features.arrow_schema
        writer = pa.ipc.new_stream(str(work / "rows.arrow"), schema)
        bar = tqdm(total=sum(_input_bytes(f) for _, files in resolved if isinstance(files, list) for f in files),
                   unit="B", unit_scale=True, desc="preprocess",
                   dynamic_ncols=True, disable=(None if progress is None else not progress))

        def take(index: int, chunk: Chunk) -> None:
            for source, reason, detail, fix in chunk.drops:
                if reason not in POLICY_DROPS and on_error == "fail":
                    raise PreprocessError(f"{source}: {detail}; {fix} ({_SKIP_HINT})")
                counts.drop(reason)
                dropped_file.write(json.dumps({"source": source, "reason": reason, "detail": detail},
                                              ensure_ascii=False) + "\n")
            if len(chunk.lengths):
                writer.write_batch(_record_batch(chunk, schema))
            counts.add(chunk)
            read_per_input[index] += chunk.read
            row_input.append(np.full(len(chunk.lengths), index, np.int32))

        # Tasks go to the workers in order and come back in order, at most a few per worker in flight: the output
        # is the same for any --num-proc and memory stays bounded however large the input.
        in_flight: deque = deque()
        for task, size, index in _tasks(resolved):
            if pool is None:
                take(index, encode_task(task))
            else:
                in_flight.append((index, pool.apply_async(encode_task, (task,))))
                if len(in_flight) >= 2 * num_proc:
                    index, result = in_flight.popleft()
                    take(index, result.get())
            bar.update(size)
        while in_flight:
            index, result = in_flight.popleft()
            take(index, result.get())
        bar.close()
        writer.close()
        writer = None
        report = counts.report()
        report.update({
            "inputs": inputs, "output": str(output_dir), "tokenizer": str(tokenizer), "format": fmt,
            "chat_template": encoder.template_source, "label_mode": encoder.label_mode, "max_len": max_len,
            "overlong": overlong, "on_error": on_error,
        })
        assert report["read"] == report["kept"] + sum(report["dropped"].values()), report
        if report["kept"] == 0:
            reasons = ", ".join(f"{k}: {v}" for k, v in report["dropped"].items()) or "no records in the inputs"
            raise PreprocessError(f"no sample kept out of {report['read']} read ({reasons}); check the inputs, "
                                  f"--format and --max-len")

        dataset = datasets.Dataset.from_file(str(work / "rows.arrow"))
        # The held-out split and the weights (report: where the kept samples went; dropped.jsonl: what a weight
        # left out); without them the rows are written as they are.
        dataset, heldout = apply_mix(dataset, np.concatenate(row_input), mix, inputs, read_per_input, report,
                                     dropped_file, heldout_dir)
        dropped_file.close()
        with datasets_bars_off(when=bar.disable):  # datasets' own bar: off whenever ours is (a log file)
            staged, heldout_staged = work / "dataset", None
            report["num_shards"] = _save(dataset, staged, num_shards)
            report.update(_data_record(encoder, tokenizer, staged))  # checked by the trainer (vocab.py)
            if heldout is not None:
                heldout_staged = staging_dir(heldout_dir)
                held = report["heldout"]
                held["num_shards"] = _save(heldout, heldout_staged, num_shards)
                held.update(_data_record(encoder, tokenizer, heldout_staged))
        del dataset, heldout
        (staged / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        shutil.move(str(work / "dropped.jsonl"), str(staged / "dropped.jsonl"))
        if heldout_staged is not None:
            held_report = {**report["heldout"], "heldout_of": str(output_dir), "inputs": inputs,
                           "tokenizer": str(tokenizer), "chat_template": encoder.template_source,
                           "label_mode": encoder.label_mode, "max_len": max_len, "overlong": overlong}
            (heldout_staged / "report.json").write_text(json.dumps(held_report, indent=2) + "\n")
            replace_dir(heldout_staged, heldout_dir)
            heldout_staged = None
        replace_dir(staged, output_dir)
        return report
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
        for handle in (writer, dropped_file, bar):
            if handle is not None and not getattr(handle, "closed", False):
                handle.close()
        shutil.rmtree(work, ignore_errors=True)
        if heldout_staged is not None:  # interrupted between the two folders' writes
            shutil.rmtree(heldout_staged, ignore_errors=True)


def _save(dataset, folder: Path, num_shards: int | None) -> int | None:
    """``dataset.save_to_disk(folder)`` in ``num_shards`` files (at most one per row); returns that count."""
    shards = min(num_shards, len(dataset)) if num_shards else None
    dataset.save_to_disk(str(folder), num_shards=shards)
    return shards


def _data_record(encoder: ChatEncoder, tokenizer: str, folder: Path) -> dict:
    """The tokenizer record of the dataset saved in ``folder`` (hbp_train/batches/vocab.py)."""
    import datasets

    return data_record(encoder.tokenizer, str(tokenizer), datasets.load_from_disk(str(folder)))
