"""CSR helpers of the planner: packs as ``pack_samples[pack_ptr[p]:pack_ptr[p + 1]]`` (and steps over packs alike).

Pure numpy, no planner types: the plan, the balancer, the metrics and the shard writer all build on these.
"""

from __future__ import annotations

import numpy as np


def gather_ranges(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Indices start[i] .. start[i]+size[i]-1 for all i, concatenated (vectorised): the rows of CSR segments."""
    total = int(sizes.sum())
    if total == 0:
        return np.zeros(0, np.int64)
    offs = np.repeat(starts - np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes)
    return np.arange(total, dtype=np.int64) + offs


def segment_sums(values: np.ndarray, ptr: np.ndarray, dtype=None) -> np.ndarray:
    """[len(ptr) - 1]: the sum of ``values[ptr[i]:ptr[i + 1]]`` for every segment (0 for an empty one). Each segment
    is summed on its own: differences of one running sum would lose a small segment's digits once it passes 2^53."""
    dtype = dtype or values.dtype
    out = np.zeros(len(ptr) - 1, dtype)
    filled = ptr[1:] > ptr[:-1]  # reduceat would give an empty segment the next value
    if filled.any():
        out[filled] = np.add.reduceat(values, ptr[:-1][filled], dtype=dtype)
    return out


def pack_tokens(lengths: np.ndarray, pack_ptr: np.ndarray, pack_samples: np.ndarray,
                pack_lengths: np.ndarray | None = None) -> np.ndarray:
    """int64 [num_packs]: tokens in every pack of a CSR pack list (``pack_lengths``: ``lengths[pack_samples]``
    when the caller has it)."""
    flat = lengths[pack_samples] if pack_lengths is None else pack_lengths
    return segment_sums(flat, pack_ptr, np.int64)


def pack_csr(packs: list[np.ndarray] | list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(pack_ptr, pack_samples) from a list of per-pack sample-index lists (small inputs / tests)."""
    sizes = np.array([len(p) for p in packs], np.int64)
    ptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    flat = np.concatenate([np.asarray(p, np.int64) for p in packs]) if packs else np.zeros(0, np.int64)
    return ptr, flat.astype(np.int64)
