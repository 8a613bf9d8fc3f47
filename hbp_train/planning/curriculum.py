"""Step order: a seeded shuffle within each group, a short-first curriculum, then a smooth weighted interleave;
or (``mix_group_steps``) optimizer steps that hold slots of every group.

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


# The golden ratio's fractional part: i * GOLDEN mod 1 (i = 0, 1, ...) fills [0, 1) evenly for any run of i.
GOLDEN = (5 ** 0.5 - 1) / 2


def spread_order(n: int, rng: np.random.Generator) -> np.ndarray:
    """A permutation of 0..n-1 whose every run of consecutive entries is spread evenly over 0..n-1: rank r goes to
    the position of frac(r * GOLDEN + u) among all ranks (u ~ U(0, 1)). Dealt in this order, the slots of a group
    sorted by cost give any optimizer step that takes k consecutive ones k slots from across the cost range."""
    return np.argsort((np.arange(n) * GOLDEN + rng.random()) % 1.0, kind="stable")


def mix_group_steps(step_ptr: np.ndarray, step_packs: np.ndarray, step_group: np.ndarray, config,
                    rng: np.random.Generator, empty_pack: np.ndarray | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Optimizer steps that hold slots of every group in proportion to the group's slots (hbp step_mix="mixed").

    A step of one group only trains on that group's lengths: the short group's steps never see a long sample and
    the long group's are mostly long ones, a length skew that costs held-out quality (#16, bench_quality.py).
    Input: build_steps' steps with the sorted dealing (every group's full steps in cost order, then its tail). Each
    group's slots are put in ``spread_order`` (any run of them spans the group's cost range, hence its lengths);
    a step holding empty packs (a tail) stays one unit. The groups' sequences are interleaved like ``order_steps``
    interleaves steps: unit j of a group with n units gets the key (j + u) / n, u ~ U(0, 1). Walking the keys, an
    optimizer step takes units while its capacity (pack_len x replicas per slot) stays within half a slot of
    ``config.global_tokens``; its slots of each group form one plan step (the trainer runs them one after the
    other, each at its group's SP degree, and makes one update); with ``step_tokens="real"`` every unit is left a
    step of its own, for equal_steps.py to cut by real tokens. Slots are kept as they are, so the balance (ABR,
    DBR) and the simulated compute time are those of the input steps. With ``curriculum_steps`` K, the first K
    optimizer steps are made of the lowest group's first K x m slots of its sequence. ``empty_pack``: bool per
    pack id.

    Returns (step_ptr, step_packs, step_group, optimizer_step) of the plan steps, in run order."""
    step_group = np.asarray(step_group)
    if len(step_group) == 0:
        return step_ptr, step_packs, step_group, np.zeros(0, np.int64)
    groups = [int(g) for g in np.unique(step_group)]
    replicas = {g: config.replicas(g) for g in groups}
    slot_cap = {g: config.groups[g].pack_len * replicas[g] for g in groups}
    sequences = {}
    for g in groups:
        units = []
        for s in np.flatnonzero(step_group == g).tolist():
            packs = step_packs[step_ptr[s]:step_ptr[s + 1]]
            if empty_pack is not None and empty_pack[packs].any():
                units.append(packs)  # a tail step with empty packs stays whole (at most one per group)
            else:
                units.extend(packs.reshape(-1, replicas[g]))
        sequences[g] = [units[i] for i in spread_order(len(units), rng)]
    opt_steps: list[list[tuple[int, np.ndarray]]] = []
    lowest = groups[0]
    m = config.micro_batches(lowest)
    for _ in range(int(config.curriculum_steps)):
        if not sequences[lowest]:
            break
        opt_steps.append([(lowest, u) for u in sequences[lowest][:m]])
        sequences[lowest] = sequences[lowest][m:]
    units, keys = [], []
    for g in groups:
        n = len(sequences[g])
        units += [(g, u) for u in sequences[g]]
        keys.append((np.arange(n) + rng.random(n)) / max(n, 1))
    current: list[tuple[int, np.ndarray]] = []
    capacity = 0.0
    # By real tokens (step_tokens="real") every unit stays a step of its own, in key order: equal_steps.py cuts them.
    by_capacity = config.step_tokens == "capacity"
    for i in np.argsort(np.concatenate(keys), kind="stable").tolist():
        g, packs = units[i]
        cap = slot_cap[g] * (len(packs) // replicas[g])
        if current and (not by_capacity or capacity + cap / 2 > config.global_tokens):
            opt_steps.append(current)
            current, capacity = [], 0.0
        current.append((g, packs))
        capacity += cap
    if current:
        opt_steps.append(current)
    sizes, flat, new_group, opt = [], [], [], []
    for k, parts in enumerate(opt_steps):
        for g in sorted({g for g, _ in parts}):
            packs = np.concatenate([p for h, p in parts if h == g])
            sizes.append(len(packs))
            flat.append(packs)
            new_group.append(g)
            opt.append(k)
    return (np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64), np.concatenate(flat).astype(np.int64),
            np.asarray(new_group, np.int32), np.asarray(opt, np.int64))
