"""LongAlign-style sorted batching: sort samples by length, batch consecutive ones, shuffle the batches.

All samples go to the largest group (like isf). They are sorted by length (ties in a seeded random order) and
next-fit in that order into packs of pack_len tokens, so a pack holds samples of nearly the same length. Steps
take consecutive packs (balance.build_steps with balance=False and its tail rule), so the replicas of a slot run
packs of similar length and attention cost — the balance comes from the sort, not from a cost model. The steps
are then shuffled (seeded; LongAlign shuffles its batches) with the shared curriculum order
(curriculum.order_steps, level = the group of a step's longest sample). The price: every batch is homogeneous in
length, which skews the data distribution per step (LongAlign's loss-weighting discussion; HBP paper Table 3).
"""

from __future__ import annotations

import time

import numpy as np

from hbp_train.planning.balance import build_steps, reorder_steps
from hbp_train.planning.curriculum import order_steps, sample_levels
from hbp_train.planning.baselines.isf import next_fit
from hbp_train.planning.plan import DROP_TOO_LONG, Plan, PlanConfig


def plan_sorted(lengths: np.ndarray, config: PlanConfig) -> Plan:
    """The sorted strategy (see the module docstring). ``lengths`` already checked (int64, all >= 1)."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(config.seed)
    last = len(config.groups) - 1
    order, dropped = length_sorted(lengths, config, rng)
    starts = next_fit(lengths[order], config.groups[last].pack_len)
    pack_ptr = np.r_[starts, len(order)].astype(np.int64)
    pack_group = np.full(len(starts), last, np.int32)
    pack_ptr, pack_samples, pack_group, step_ptr, step_packs, step_group = build_steps(
        lengths, pack_ptr, order.astype(np.int64), pack_group, config, balance=False
    )
    return single_group_plan(config, lengths, pack_ptr, pack_samples, pack_group, step_ptr, step_packs,
                             step_group, dropped, rng, t0)


def length_sorted(lengths: np.ndarray, config: PlanConfig, rng: np.random.Generator,
                  descending: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(the samples that fit the largest group's pack_len, sorted by length with ties in a seeded random order;
    the samples longer than that, which are dropped): the start of every single-group length-sorted baseline."""
    too_long = lengths > config.groups[-1].pack_len
    kept, dropped = np.flatnonzero(~too_long), np.flatnonzero(too_long)
    # Random order first, then a stable sort: equal lengths stay in a seeded random order.
    kept = kept[rng.permutation(len(kept))]
    key = -lengths[kept] if descending else lengths[kept]
    return kept[np.argsort(key, kind="stable")], dropped


def single_group_plan(config: PlanConfig, lengths, pack_ptr, pack_samples, pack_group, step_ptr, step_packs,
                      step_group, dropped, rng, t0: float) -> Plan:
    """The Plan of a one-group baseline (sorted, bfd): its steps put in curriculum order by the group level of
    each step's longest sample (curriculum.order_steps), as hbp orders its steps."""
    if len(step_group):
        pack_max = np.maximum.reduceat(np.r_[lengths[pack_samples], 0], pack_ptr[:-1])
        pack_max = np.where(np.diff(pack_ptr) > 0, pack_max, 0)
        step_max = np.maximum.reduceat(pack_max[step_packs], step_ptr[:-1])
        level = sample_levels(step_max, [g.pack_len for g in config.groups])
        step_ptr, step_packs, step_group = reorder_steps(
            step_ptr, step_packs, step_group, order_steps(level, config.curriculum_steps, rng))
    return Plan(
        config=config, lengths=lengths, pack_ptr=pack_ptr, pack_samples=pack_samples, pack_group=pack_group,
        step_ptr=step_ptr, step_packs=step_packs, step_group=step_group, dropped=dropped,
        dropped_reason=[DROP_TOO_LONG] * len(dropped), extra={"planning_seconds": time.perf_counter() - t0},
    )
