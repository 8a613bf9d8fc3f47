"""The synthetic packs the profiler times: one document of the pack's length, or documents drawn from the training
data's sample lengths (``profile.docs``), and a pack shrunk to one SP rank's slice for an estimated degree."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import numpy as np

from hbp_train.common.errors import UserError


def load_doc_lengths(spec: str) -> Optional[np.ndarray]:
    """Sample lengths to draw synthetic documents from (None for "single"); UserError names the file."""
    if spec == "single":
        return None
    path = Path(spec)
    try:
        if path.is_dir():
            from datasets import load_from_disk

            from hbp_train.batches.columns import int_column

            lengths = int_column(load_from_disk(str(path)), "length")
        elif path.suffix == ".npy":
            lengths = np.load(path)
        elif path.suffix == ".json":
            data = json.loads(path.read_text())
            lengths = np.asarray(data["lengths"] if isinstance(data, dict) else data)
        else:
            lengths = np.loadtxt(path, ndmin=1)
    except (OSError, ValueError, KeyError) as exc:  # unreadable file, not numbers, a JSON object without "lengths"
        raise UserError(f"profile.docs={spec}: cannot read sample lengths ({exc}); give a tokenized dataset dir "
                        "or a .npy/.json/.txt list of lengths") from None
    lengths = np.asarray(lengths, dtype=np.float64).ravel()
    if lengths.size == 0 or (lengths < 1).any() or (lengths != np.round(lengths)).any():
        raise UserError(f"profile.docs={spec}: sample lengths must be a non-empty list of positive integers")
    return lengths.astype(np.int64)


def synthetic_docs(pack_len: int, pool: Optional[np.ndarray], seed: int = 0) -> list[int]:
    """Document lengths of a full synthetic pack: one document, or draws from `pool` (the last one cut to fit)."""
    if pool is None:
        return [int(pack_len)]
    rng = np.random.default_rng([seed, pack_len])
    docs, left = [], int(pack_len)
    while left > 0:
        length = min(int(pool[rng.integers(len(pool))]), left)
        docs.append(length)
        left -= length
    return docs


def slice_docs(docs: list[int], sp: int) -> list[int]:
    """Documents of a pack shrunk by sp (each at least 1 token) summing to sum(docs)//sp: the per-rank stand-in
    used to estimate an SP degree that cannot be measured."""
    target = max(1, sum(docs) // sp)
    if target < len(docs):  # more documents than the slice has tokens: as many 1-token documents as it has
        return [1] * target
    out = [max(1, d // sp) for d in docs]
    # Fix the rounding on the longest documents so the slice has exactly `target` tokens.
    order = np.argsort(out)[::-1]
    diff, i = target - sum(out), 0
    while diff != 0:
        j = order[i % len(order)]
        if diff > 0:
            out[j] += 1
            diff -= 1
        elif out[j] > 1:
            out[j] -= 1
            diff += 1
        i += 1
    return [d for d in out if d > 0]
