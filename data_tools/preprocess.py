"""Raw SFT data -> tokenized, labelled HF dataset shards (the input of data_tools.pack).

Usage::

    python -m data_tools.preprocess --input data.jsonl [more ...] --output DIR --tokenizer TOKENIZER_DIR \\
        [--format auto|messages|sharegpt|alpaca|prompt_completion|text] [--max-len N] [--overlong drop|truncate] \\
        [--on-error fail|skip] [--num-proc N] [--num-shards N]

Library: ``preprocess(inputs, output, tokenizer, ...) -> report`` raising a ``UserError`` (one-line message):
``PreprocessError``, or ``chat_labels.TokenizerError`` for an unusable tokenizer.

The pipeline, one module per step: read the inputs (JSONL, JSON, CSV, each also ``.gz``; Parquet; a directory
saved with ``datasets.save_to_disk``; a folder of such files as a hub dataset ships; each sample's ``source`` is
``path:N``) with ``data_tools.sft_inputs``; detect each record's shape (OpenAI ``messages``, ShareGPT
``conversations``, Alpaca, TRL prompt/completion, plain text) and normalise it with ``data_tools.sft_formats``;
render the turns with the tokenizer's chat template (plain text with none) and label the trained tokens (``labels``
= ``input_ids`` there, ``-100`` elsewhere, not shifted) with ``data_tools.chat_labels``. This module runs them over
a worker pool, writes the dataset and the report, and is the CLI. docs/input_formats.md describes every shape.

Output DIR: the dataset (columns ``input_ids``, ``labels`` list<int32>; ``length``, ``num_loss_tokens`` int32;
``source`` string; ``num_loss_tokens`` = ``labels[1:] != -100`` counted, always >= 1), ``report.json`` (``read ==
kept + sum(dropped.values())``) and ``dropped.jsonl`` (one ``{"source", "reason", "detail"}`` per dropped sample).
It is built in a staging directory next to DIR and moved into place at the end; an existing DIR is replaced only if
it holds an earlier preprocess output (a ``report.json``).

Drops: ``overlong`` (with ``--overlong drop``), ``no_loss_tokens``, ``no_loss_tokens_after_truncation`` are policy
drops, always counted. Everything else (see ``ERROR_REASONS``) is bad input: with ``--on-error fail`` (default) the
run stops at the first one with one line naming ``file:line``, the problem and the fix (CLI exit code 2); with
``--on-error skip`` the record is dropped and counted by reason. An unreadable file counts as one dropped record.
Nothing else is left out unsaid: report.json counts the fields no shape uses (``ignored_fields``) and the assistant
turns kept as context only (``untrained_turns``: ``weight_0``, ``prompt``).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import shutil
import signal
import sys
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from data_tools.chat_labels import TEMPLATE_REASONS, ChatEncoder
from data_tools.preprocess_report import Counts, format_report
from data_tools.sft_formats import FORMATS, REASONS, FormatError, parse_record
from data_tools.sft_inputs import (FILE_REASONS, KINDS, input_kind, iter_records, jsonl_blocks, parse_jsonl_block,
                                   resolve_input)
from hbp_train.common.cli import ArgumentParser, existing_dir, int_range, output_dir, positive_int
from hbp_train.common.errors import EXIT_USER_ERROR, UserError
from hbp_train.common.labels import IGNORE_INDEX
from hbp_train.common.outputs import interrupted, replace_dir, staging_dir
from hbp_train.batches.vocab import data_record

POLICY_DROPS = ("overlong", "no_loss_tokens", "no_loss_tokens_after_truncation")
# Every drop that means bad input: record shapes, lines and files, conversations the template cannot label.
ERROR_REASONS = {**REASONS, **FILE_REASONS, **TEMPLATE_REASONS}
_SKIP_HINT = "or pass --on-error skip to drop and count such records"
_TASK_RECORDS = 2048  # parsed records per worker task (inputs other than JSONL, which go as blocks of lines)


class PreprocessError(UserError):
    """A user-facing failure; ``str(e)`` is one line naming the file/line, the problem and the fix. (An unusable
    --tokenizer is chat_labels.TokenizerError, also a UserError.)"""


# Per-process state of the tokenizing workers (forked workers inherit the parent's encoder, spawned ones load one).
_ENCODER: ChatEncoder | None = None
_LIMITS: tuple[int | None, str, str] = (None, "drop", "auto")


def _init_worker(tokenizer_dir: str, max_len: int | None, overlong: str, encoder: ChatEncoder | None = None,
                 fmt: str = "auto"):
    global _ENCODER, _LIMITS
    _ENCODER = encoder or ChatEncoder(tokenizer_dir)
    _LIMITS = (max_len, overlong, fmt)


def _init_pool_worker(*args):
    """_init_worker for a pool process, which leaves Ctrl-C to the parent: the terminal sends SIGINT to every
    process of the job, and each worker would print its own KeyboardInterrupt traceback. The tokenizer encodes
    each batch on this process's thread only: the workers already use the CPUs, and a thread pool per worker on top
    of them costs a quarter more CPU time for the same tokens."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _init_worker(*args)


def _start_pool(num_proc: int, tokenizer_dir: str, max_len: int | None, overlong: str, encoder: ChatEncoder,
                fmt: str = "auto"):
    """Worker pool. Fork where available (as datasets.map does): workers start in milliseconds with the parent's
    tokenizer instead of re-importing transformers/torch for seconds each. It is created before this process opens
    the Arrow writer or the progress bar, so no thread of ours holds a lock at fork time; the parent has not
    encoded yet, so the tokenizers library has no thread pool to warn about. Spawn elsewhere."""
    if "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork").Pool(
            num_proc, initializer=_init_pool_worker, initargs=(tokenizer_dir, max_len, overlong, encoder, fmt))
    return multiprocessing.get_context("spawn").Pool(
        num_proc, initializer=_init_pool_worker, initargs=(tokenizer_dir, max_len, overlong, None, fmt))


@dataclass
class _Chunk:
    """What a worker makes of one task: the kept rows as flat arrays, every drop in record order, counts."""

    read: int
    formats: dict
    ignored: dict  # field -> records (or turns) that hold it unused
    untrained: dict  # why -> assistant turns not trained on
    drops: list  # (source, reason, detail, fix), record order
    sources: list
    input_ids: np.ndarray  # all kept rows, one after the other (int32)
    labels: np.ndarray
    lengths: np.ndarray  # tokens of every kept row (int32)
    num_loss_tokens: np.ndarray
    truncated: int


def _encode_task(task: tuple) -> _Chunk:
    """Parse, normalise and encode one task: ``("lines", path, first_line, bytes)`` (a block of JSONL lines) or
    ``("records", [(source, record or FormatError), ...])``. The whole batch is encoded at once
    (``ChatEncoder.encode_batch``); length limits and loss-token checks are numpy over the batch."""
    max_len, overlong, fmt = _LIMITS
    records = parse_jsonl_block(task[1], task[3], task[2]) if task[0] == "lines" else task[1]
    drops, formats, ignored, untrained, sources, samples, ordinal = [], {}, {}, {}, [], [], []
    read = 0
    for source, record in records:
        read += 1
        if isinstance(record, FormatError):
            drops.append((read, source, record.reason, record.detail, record.fix))
            continue
        try:
            sample = parse_record(record, fmt)
        except FormatError as e:
            drops.append((read, source, e.reason, e.detail, e.fix))
            continue
        formats[sample.shape] = formats.get(sample.shape, 0) + 1
        for name in sample.ignored:
            ignored[name] = ignored.get(name, 0) + 1
        for why in sample.untrained.values():
            untrained[why] = untrained.get(why, 0) + 1
        sources.append(source)
        samples.append(sample)
        ordinal.append(read)
    ids, labels, row_ptr, errors = _ENCODER.encode_batch(samples)
    lengths = np.diff(row_ptr)
    keep = np.ones(len(lengths), bool)
    for i, e in errors.items():
        keep[i] = False
        drops.append((ordinal[i], sources[i], e.reason, e.detail, e.fix))
    truncated = np.zeros(len(lengths), bool)
    if max_len is not None and np.any(lengths > max_len):
        over = np.flatnonzero(lengths > max_len)
        if overlong == "drop":
            keep[over] = False
            drops += [(ordinal[i], sources[i], "overlong", f"{int(lengths[i])} tokens > --max-len {max_len}", "")
                      for i in over.tolist()]
        else:
            truncated[over] = True
            position = np.arange(len(ids)) - np.repeat(row_ptr[:-1], lengths)
            short = position < max_len
            ids, labels = ids[short], labels[short]
            lengths = np.minimum(lengths, max_len)
            row_ptr = np.concatenate([[0], np.cumsum(lengths)])
    # Trainable targets after the shift: labelled tokens that are not their row's first.
    counted = labels != IGNORE_INDEX
    counted[row_ptr[:-1][lengths > 0]] = False
    row = np.repeat(np.arange(len(lengths)), lengths)
    num_loss = np.bincount(row, weights=counted, minlength=len(lengths)).astype(np.int32)
    for i in np.flatnonzero(keep & (num_loss == 0)).tolist():
        keep[i] = False
        reason = "no_loss_tokens_after_truncation" if truncated[i] else "no_loss_tokens"
        drops.append((ordinal[i], sources[i], reason, "no token left to train on", ""))
    drops.sort(key=lambda d: d[0])
    kept = np.repeat(keep, lengths)
    return _Chunk(read=read, formats=formats, ignored=ignored, untrained=untrained, drops=[d[1:] for d in drops],
                  sources=[src for src, k in zip(sources, keep.tolist()) if k], input_ids=ids[kept],
                  labels=labels[kept], lengths=lengths[keep].astype(np.int32), num_loss_tokens=num_loss[keep],
                  truncated=int(np.count_nonzero(truncated & keep)))


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


def _record_batch(chunk: _Chunk, schema):
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
    """``(task, input bytes it covers)`` for every input file (``resolved``: each input with its files, or the
    FormatError that says why it has none): JSONL files as blocks of lines (parsed by the workers), other files as
    lists of parsed records (``_TASK_RECORDS`` each; their bytes counted when the file is done)."""
    for path, files in resolved:
        if isinstance(files, FormatError):
            yield ("records", [(path, files)]), 0
            continue
        for file in files:
            if input_kind(file) == "jsonl" and Path(file).is_file():
                for head, block, size in jsonl_blocks(file):  # (first line, lines, bytes) or (path, error, 0)
                    if isinstance(block, FormatError):
                        yield ("records", [(head, block)]), 0
                    else:
                        yield ("lines", file, head, block), size
                continue
            records = []
            for item in iter_records(file):
                records.append(item)
                if len(records) == _TASK_RECORDS:
                    yield ("records", records), 0
                    records = []
            yield ("records", records), _input_bytes(file)


def _input_bytes(path: str) -> int:
    """Size of an input file (0 for a directory), for the progress bar."""
    p = Path(path)
    return p.stat().st_size if p.is_file() else 0


def _check_output(output: Path) -> None:
    if output.exists() and not output.is_dir():
        raise PreprocessError(f"{output}: output exists and is a file; pass a directory path to --output")
    if output.is_dir() and any(output.iterdir()) and not (output / "report.json").exists():
        raise PreprocessError(f"{output}: output directory is not empty and holds no earlier preprocess output; "
                              f"choose a new or empty --output directory")


# ------------------------------------------------------------------------------------------------------ driver


def preprocess(inputs: list[str], output: str, tokenizer: str, fmt: str = "auto", max_len: int | None = None,
               overlong: str = "drop", on_error: str = "fail", num_proc: int = 1, num_shards: int | None = None,
               progress: bool | None = None) -> dict:
    """Tokenize ``inputs`` into the dataset directory ``output`` and return the report (also in report.json).

    Raises ``PreprocessError`` (one-line message) for bad arguments, the first bad record when
    ``on_error == "fail"``, or when no sample is kept; ``TokenizerError`` for an unusable tokenizer.
    ``progress=None`` shows a bar only on a terminal.
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
    inputs = [str(p) for p in inputs]
    resolved = [(path, resolve_input(path)) for path in inputs]
    output_dir = Path(output)
    _check_output(output_dir)

    encoder = ChatEncoder(str(tokenizer))
    features = _features()
    try:
        work = staging_dir(output_dir)
    except OSError as e:
        raise PreprocessError(f"{output_dir}: cannot create the output directory ({e.strerror}); pass a writable "
                              f"--output path") from None
    pool = dropped_file = writer = bar = None
    try:
        if num_proc > 1:
            pool = _start_pool(num_proc, str(tokenizer), max_len, overlong, encoder, fmt)
        else:
            _init_worker(str(tokenizer), max_len, overlong, encoder, fmt)
        counts = Counts()
        dropped_file = open(work / "dropped.jsonl", "w", encoding="utf-8")
        schema = features.arrow_schema
        writer = pa.ipc.new_stream(str(work / "rows.arrow"), schema)
        bar = tqdm(total=sum(_input_bytes(f) for _, files in resolved if isinstance(files, list) for f in files),
                   unit="B", unit_scale=True, desc="preprocess",
                   dynamic_ncols=True, disable=(None if progress is None else not progress))

        def take(chunk: _Chunk) -> None:
            for source, reason, detail, fix in chunk.drops:
                if reason not in POLICY_DROPS and on_error == "fail":
                    raise PreprocessError(f"{source}: {detail}; {fix} ({_SKIP_HINT})")
                counts.drop(reason)
                dropped_file.write(json.dumps({"source": source, "reason": reason, "detail": detail},
                                              ensure_ascii=False) + "\n")
            if len(chunk.lengths):
                writer.write_batch(_record_batch(chunk, schema))
            counts.add(chunk)

        # Tasks go to the workers in order and come back in order, at most a few per worker in flight: the output
        # is the same for any --num-proc and memory stays bounded however large the input.
        in_flight: deque = deque()
        for task, size in _tasks(resolved):
            if pool is None:
                take(_encode_task(task))
            else:
                in_flight.append(pool.apply_async(_encode_task, (task,)))
                if len(in_flight) >= 2 * num_proc:
                    take(in_flight.popleft().get())
            bar.update(size)
        while in_flight:
            take(in_flight.popleft().get())
        bar.close()
        writer.close()
        writer = None
        dropped_file.close()

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
        report.update(data_record(encoder.tokenizer, str(tokenizer), dataset))  # checked by the trainer (vocab.py)
        shards = min(num_shards, len(dataset)) if num_shards else None
        report["num_shards"] = shards
        staged = work / "dataset"
        # datasets has its own bar: silence it whenever ours is off (non-terminal runs stay quiet), then restore.
        silence = bar.disable and not datasets.utils.are_progress_bars_disabled()
        if silence:
            datasets.disable_progress_bars()
        try:
            dataset.save_to_disk(str(staged), num_shards=shards)
        finally:
            if silence:
                datasets.enable_progress_bars()
        del dataset
        (staged / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        shutil.move(str(work / "dropped.jsonl"), str(staged / "dropped.jsonl"))
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


def build_parser() -> argparse.ArgumentParser:
    reasons = "".join(f"\n  {k}: {v}" for k, v in ERROR_REASONS.items())
    parser = ArgumentParser(
        prog="python -m data_tools.preprocess",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Tokenize raw SFT data into a labelled HF dataset (input of data_tools.pack).\n\n"
                    "Labels are -100 except on assistant tokens of every trained assistant turn (not weight 0, not in\n"
                    "a TRL prompt), found with the template's {% generation %} markers or, without them, by rendering\n"
                    "each turn's prefix. A tokenizer with no chat template gets the default ChatML template\n"
                    "(<|im_start|>role\\ncontent<|im_end|>\\n, bos first if the tokenizer has one, assistant\n"
                    "content<|im_end|> trained). Plain text (text, prompt/completion strings): no template, the eos\n"
                    "after it, the text (the completion) trained. Shapes with examples: docs/input_formats.md.",
        epilog="Output DIR: the dataset (input_ids, labels, length, num_loss_tokens, source='path:N' with N the\n"
               "1-based JSONL line, CSV line or 0-based row), report.json (with ignored_fields, untrained_turns),\n"
               "dropped.jsonl. An existing DIR is replaced only if it holds an earlier preprocess output.\n"
               "Policy drops (always counted): overlong, no_loss_tokens, no_loss_tokens_after_truncation.\n"
               f"Bad-input reasons (fail or skip per --on-error):{reasons}\n"
               "Exit codes: 0 ok; 2 bad input, tokenizer, output or flags (one line on stderr);\n"
               "130 interrupted (Ctrl-C; an existing DIR is left as it was).",
    )
    # No path check here: a missing input file is a bad-input reason like the others (--on-error skip drops it).
    parser.add_argument("--input", nargs="+", required=True, metavar="PATH",
                        help=f"input files ({', '.join(KINDS)}), folders of them as a hub dataset ships them (one "
                             "split), or saved HF dataset directories (required)")
    parser.add_argument("--output", required=True, metavar="DIR", type=output_dir,
                        help="output dataset directory, built beside DIR and moved into "
                        "place when complete (required)")
    parser.add_argument("--tokenizer", required=True, metavar="DIR", type=existing_dir,
                        help="local HF tokenizer directory (loaded offline), e.g. data_tools/assets/tokenizer "
                             "(required)")
    parser.add_argument("--format", default="auto", choices=("auto", *FORMATS),
                        help="record shape; auto detects it per record: 'messages' -> OpenAI, 'conversations' -> "
                             "ShareGPT, 'instruction'/'output' -> Alpaca, 'prompt'/'completion' -> TRL, 'text' -> "
                             "plain text (default auto)")
    parser.add_argument("--max-len", type=int_range(2), default=None, metavar="N",
                        help="longest sample in tokens; longer ones follow --overlong (default: no limit)")
    parser.add_argument("--overlong", default="drop", choices=("drop", "truncate"),
                        help="samples longer than --max-len: drop them (reason 'overlong') or keep the first N "
                             "tokens (counted in 'truncated'; dropped if no trained token is left) (default drop)")
    parser.add_argument("--on-error", default="fail", choices=("fail", "skip"),
                        help="bad input: fail stops at the first bad record with one line naming file:line and "
                             "exit code 2; skip drops it and counts it by reason in report.json/dropped.jsonl "
                             "(default fail)")
    parser.add_argument("--num-proc", type=positive_int, default=1, metavar="N",
                        help="tokenizer worker processes, at most the number of CPUs; the output is identical for "
                             "any N (default 1)")
    parser.add_argument("--num-shards", type=positive_int, default=None, metavar="N",
                        help="number of dataset shard files (default: datasets' choice, ~500 MB each)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        report = preprocess(args.input, args.output, args.tokenizer, fmt=args.format, max_len=args.max_len,
                            overlong=args.overlong, on_error=args.on_error, num_proc=args.num_proc,
                            num_shards=args.num_shards)
    except UserError as e:  # PreprocessError: bad flags, an unusable tokenizer or output, a bad record
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:  # the staging folder is removed; the swap into --output happens only at the end
        return interrupted("preprocess", f"--output {args.output} was left as it was")
    print(format_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
