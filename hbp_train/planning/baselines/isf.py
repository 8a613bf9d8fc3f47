"""The naive packing baseline: OmniBal's iterative shuffle-and-fill (ISF) into one pack length.

All samples are packed to the largest group's pack_len and every step runs at that group's SP degree:

1. shuffle the pool (seeded) and next-fit it into packs;
2. keep the packs holding at least pack_len - threshold tokens, return the other packs' samples to the pool;
3. repeat for ``isf_rounds`` rounds, then next-fit whatever is left (kept as it comes).

Steps take packs in packed order (no balancing): R = W / sp replicas x m micro-batches each, replica r running
the packs at positions k * R + r. The tail rule is the one of balance.build_steps. With ``curriculum_steps`` K,
the first K steps whose longest sample fits the smallest group move to the front (the paper applies its
curriculum to ISF too); otherwise packed order is kept.
"""

from __future__ import annotations

import time
from bisect import bisect_right

import numpy as np

from hbp_train.planning.balance import build_steps, reorder_steps
from hbp_train.planning.curriculum import sample_levels
from hbp_train.planning.hbp import progress_bar
from hbp_train.planning.plan import DROP_TOO_LONG, Plan, PlanConfig


def next_fit(sizes: np.ndarray, cap: int) -> np.ndarray:
    """Start position of every pack when ``sizes`` (each <= cap) are next-fit in order into packs of ``cap``."""
    cs = np.cumsum(sizes).tolist()
    starts, i, base, n = [], 0, 0, len(cs)
    # bisect on a Python list: one O(log n) call per pack, not per sample.
    while i < n:
        starts.append(i)
        j = bisect_right(cs, base + cap, i)
        base = cs[j - 1]
        i = j
    return np.asarray(starts, np.int64)


def isf_pack(items: np.ndarray, lengths: np.ndarray, cap: int, threshold: int, rounds: int,
             rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Iterative shuffle-and-fill. Returns (pack_ptr, pack_samples) in packed order."""
    pool = np.asarray(items, np.int64)
    kept_flat, kept_sizes = [], []
    for final in [False] * rounds + [True]:
        if len(pool) == 0:
            break
        pool = pool[rng.permutation(len(pool))]
        sizes = lengths[pool]
        starts = next_fit(sizes, cap)
        ends = np.r_[starts[1:], len(pool)]
        cs = np.concatenate([[0], np.cumsum(sizes)])
        fill = cs[ends] - cs[starts]
        keep = np.ones(len(starts), bool) if final else fill >= cap - threshold
        counts = ends - starts
        in_kept = np.repeat(keep, counts)
        kept_flat.append(pool[in_kept])
        kept_sizes.append(counts[keep])
        pool = pool[~in_kept]
    flat = np.concatenate(kept_flat) if kept_flat else np.zeros(0, np.int64)
    sizes = np.concatenate(kept_sizes) if kept_sizes else np.zeros(0, np.int64)
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64), flat.astype(np.int64)


def plan_isf(lengths: np.ndarray, config: PlanConfig) -> Plan:
    """The isf strategy (see the module docstring). ``lengths`` already checked (int64, all >= 1)."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(config.seed)
    last = len(config.groups) - 1
    cap = config.groups[last].pack_len
    threshold = cap // 64 if config.isf_threshold is None else int(config.isf_threshold)
    too_long = lengths > cap
    kept, dropped = np.flatnonzero(~too_long), np.flatnonzero(too_long)
    bar = progress_bar(config, len(lengths), total=2, desc="isf planning")
    pack_ptr, pack_samples = isf_pack(kept, lengths, cap, threshold, config.isf_rounds, rng)
    bar.update()
    pack_group = np.full(len(pack_ptr) - 1, last, np.int32)
    pack_ptr, pack_samples, pack_group, step_ptr, step_packs, step_group = build_steps(
        lengths, pack_ptr, pack_samples, pack_group, config, balance=False
    )
    bar.update()
    bar.close()
    if config.curriculum_steps > 0 and len(step_group):
        # Level of a step = the group its longest sample belongs to; short-only steps first, rest in order.
        # Pad with a 0 so reduceat stays in range for an empty last pack.
        pack_max = np.maximum.reduceat(np.r_[lengths[pack_samples], 0], pack_ptr[:-1])
        pack_max = np.where(np.diff(pack_ptr) > 0, pack_max, 0)
        step_max = np.maximum.reduceat(pack_max[step_packs], step_ptr[:-1])
        level = sample_levels(step_max, [g.pack_len for g in config.groups])
        first = np.flatnonzero(level == level.min())[:config.curriculum_steps]
        rest = np.setdiff1d(np.arange(len(step_group)), first)
        step_ptr, step_packs, step_group = reorder_steps(step_ptr, step_packs, step_group, np.r_[first, rest])
    return Plan(
        config=config, lengths=lengths, pack_ptr=pack_ptr, pack_samples=pack_samples, pack_group=pack_group,
        step_ptr=step_ptr, step_packs=step_packs, step_group=step_group, dropped=dropped,
        dropped_reason=[DROP_TOO_LONG] * len(dropped), extra={"planning_seconds": time.perf_counter() - t0},
    )
