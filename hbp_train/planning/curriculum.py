"""Step order: a seeded shuffle within each group, a short-first curriculum, then a smooth weighted interleave.

The paper (Sec. 5, Table 7) starts training on short data and then mixes long data in. Here:

1. the steps of every level (hbp: the group; isf: the group its longest sample belongs to) are shuffled;
2. the first ``curriculum_steps`` steps come from the lowest level only (all of them if it has fewer);
3. the remaining steps interleave the levels in proportion to their remaining counts: step j of a level with n
   remaining steps gets the key (j + u) / n with u ~ U(0, 1) from the seed, and steps run in key order. Every
   level is spread evenly over the run (no long stretch of one group), and the order is random but seeded.
"""

from __future__ import annotations

import numpy as np


def order_steps(step_level: np.ndarray, curriculum_steps: int, rng: np.random.Generator) -> np.ndarray:
    """Permutation of the steps (new position i runs old step ``order[i]``)."""
    step_level = np.asarray(step_level)
    if len(step_level) == 0:
        return np.zeros(0, np.int64)
    levels = np.unique(step_level)
    per_level = {int(v): rng.permutation(np.flatnonzero(step_level == v)) for v in levels}
    lowest = int(levels[0])
    num_first = min(int(curriculum_steps), len(per_level[lowest]))
    first = per_level[lowest][:num_first]
    per_level[lowest] = per_level[lowest][num_first:]
    ids, keys = [], []
    for v in levels:
        rest = per_level[int(v)]
        n = len(rest)
        if n == 0:
            continue
        ids.append(rest)
        keys.append((np.arange(n) + rng.random(n)) / n)
    if not ids:
        return first.astype(np.int64)
    ids_all, keys_all = np.concatenate(ids), np.concatenate(keys)
    return np.concatenate([first, ids_all[np.argsort(keys_all, kind="stable")]]).astype(np.int64)


def sample_levels(lengths: np.ndarray, pack_lens: np.ndarray) -> np.ndarray:
    """Group index of every sample (GroupData rule: group i holds l_{i-1} < len <= l_i), int8 for up to 127 groups.

    A few comparisons per sample instead of a binary search: with the handful of groups a plan has, this is ~10x
    faster on 10M samples and the int8 result is 8x smaller than searchsorted's int64."""
    bounds = np.asarray(pack_lens).tolist()
    lengths = np.asarray(lengths)
    if len(bounds) > 127:
        return np.searchsorted(np.asarray(bounds), lengths, side="left")
    level = np.zeros(lengths.shape, np.int8)
    for b in bounds[:-1]:
        level += lengths > b
    if bounds:  # lengths above the largest pack_len get level len(groups), as searchsorted gives
        level += lengths > bounds[-1]
    return level
