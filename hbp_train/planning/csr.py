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


def pack_tokens(lengths: np.ndarray, pack_ptr: np.ndarray, pack_samples: np.ndarray) -> np.ndarray:
    """int64 [num_packs]: tokens in every pack of a CSR pack list."""
    csum = np.concatenate([[0], np.cumsum(lengths[pack_samples])])
    return csum[pack_ptr[1:]] - csum[pack_ptr[:-1]]


def pack_csr(packs: list[np.ndarray] | list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    """(pack_ptr, pack_samples) from a list of per-pack sample-index lists (small inputs / tests)."""
    sizes = np.array([len(p) for p in packs], np.int64)
    ptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    flat = np.concatenate([np.asarray(p, np.int64) for p in packs]) if packs else np.zeros(0, np.int64)
    return ptr, flat.astype(np.int64)
