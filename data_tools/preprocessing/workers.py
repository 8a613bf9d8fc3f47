"""The tokenizing workers of data_tools.preprocess: each turns one task (a block of JSONL lines, or a list of parsed
records) into a ``Chunk``: the kept rows as flat arrays, every drop with its reason in record order, and counts.

A worker parses and normalises each record (``inputs.py``, ``formats.py``), encodes the batch with the ``ChatEncoder``
(``chat_labels.py``), then applies ``--max-len`` (drop or truncate) and drops the samples left with no trained token,
all numpy over the batch. Run in a pool (``start_pool``) or in this process (``init_worker`` then ``encode_task``):
the result is the same.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from dataclasses import dataclass

import numpy as np

from data_tools.preprocessing.chat_labels import ChatEncoder
from data_tools.preprocessing.formats import FormatError, parse_record
from data_tools.preprocessing.inputs import parse_jsonl_block
from hbp_train.common.labels import IGNORE_INDEX

# Per-process state of the tokenizing workers (forked workers inherit the parent's encoder, spawned ones load one).
_ENCODER: ChatEncoder | None = None
_LIMITS: tuple[int | None, str, str] = (None, "drop", "auto")


def init_worker(tokenizer_dir: str, max_len: int | None, overlong: str, encoder: ChatEncoder | None = None,
                fmt: str = "auto"):
    """This process's encoder (``encoder``, else one loaded from ``tokenizer_dir``) and limits for ``encode_task``."""
    global _ENCODER, _LIMITS
    _ENCODER = encoder or ChatEncoder(tokenizer_dir)
    _LIMITS = (max_len, overlong, fmt)


def _init_pool_worker(*args):
    """init_worker for a pool process, which leaves Ctrl-C to the parent: the terminal sends SIGINT to every
    process of the job, and each worker would print its own KeyboardInterrupt traceback. The tokenizer encodes
    each batch on this process's thread only: the workers already use the CPUs, and a thread pool per worker on top
    of them costs a quarter more CPU time for the same tokens."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    init_worker(*args)


def start_pool(num_proc: int, tokenizer_dir: str, max_len: int | None, overlong: str, encoder: ChatEncoder,
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
class Chunk:
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
    plain: int  # kept rows of plain text (no chat template)


def encode_task(task: tuple) -> Chunk:
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
    return Chunk(read=read, formats=formats, ignored=ignored, untrained=untrained, drops=[d[1:] for d in drops],
                  sources=[src for src, k in zip(sources, keep.tolist()) if k], input_ids=ids[kept],
                  labels=labels[kept], lengths=lengths[keep].astype(np.int32), num_loss_tokens=num_loss[keep],
                  truncated=int(np.count_nonzero(truncated & keep)),
                  plain=sum(k and s.text is not None for s, k in zip(samples, keep.tolist())))
