"""Equal optimisation: every strategy's plan cut into the same number of optimizer steps of (nearly) the same
real tokens.

Why: a step sized by pack capacity (m = round(G / (pack_len * R)) micro-batches per replica) holds more real
tokens when a strategy packs more densely, so that strategy trains the same data in FEWER, larger optimizer
steps, which costs held-out loss (#24: hbp made 108 steps where isf made 114 on the same data, and lost 0.03
nats; isf stopped at 108 steps lost the same). With ``PlanConfig.step_tokens="real"`` (the default) the step is
a budget of real (non-padding) tokens, the same for every strategy: the padding and imbalance a better plan
removes become time saved, never fewer updates.

The rule. With T the real tokens of all packed samples and G = ``global_tokens``, a plan has
N = max(1, round(T / G)) optimizer steps of target tau = T / N tokens (``step_budget``). A strategy's *units*
in run order are cut at the unit boundaries nearest to tau, 2 tau, ..., (N - 1) tau (``nearest_cuts``). Units are
the slots of a plan (the R packs its replicas run in lock-step; a tail step's empty packs lie in one slot, else
that step stays one unit, so they stay in one step), or, for the strategies that make steps from samples (kk,
bytescale), the samples. Every step then holds tau +- u real tokens, u the largest unit (R * pack_len for a slot,
the longest sample for kk and bytescale), whenever u < tau; with fewer units than N, every unit is a step. The
units of one group in an optimizer step form one plan step (``Plan.optimizer_step`` when a step spans groups; the
trainer switches the SP degree between them).

Smaller groups fill (``filled_cuts``): a plan whose units come in two sizes (hbp: the largest group's slots, R
long packs, and the smaller groups' slots) is cut finer than its big units allow. The big units, in run order, are
cut where the data's share of them says (step j ends nearest to j x their tokens / N, so the long samples stay
spread over the run), never past the step's cumulative target j tau by more than half a unit; then the small
units, in run order, fill the step to the boundary nearest to j tau. Each step then holds tau +- one small unit
while the small units last (tau +- one pack at the one-pack-per-rank budget, where a big unit is as large as tau
and nearest cuts alone allow a step anywhere in 0..2 tau); single-size plans (every baseline) are cut as before.

Curriculum (``curriculum_steps`` K): the units whose samples all fit the smallest group (GroupData level 0, or
the lowest level present), in run order, up to the boundary nearest K tau, move to the front, and a cut is forced
at their end: the first K optimizer steps hold only short samples. When the plan has fewer short tokens than K tau,
the steps before the forced cut share its tokens and the steps after it share the rest, each within one unit of
its side's own mean.

``equal_steps`` applies the rule to a finished plan (hbp, isf, sorted, bfd, wlb): its packs stay as they are, so
every slot keeps its balance (ABR, DBR) and padding (PR); only the steps are re-cut.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from hbp_train.planning.csr import gather_ranges, pack_tokens, segment_sums
from hbp_train.planning.curriculum import sample_levels

if TYPE_CHECKING:  # annotations only: plan.py's metrics need step_budget from here
    from hbp_train.planning.plan import Plan


# The step size data_tools.pack derives when --global-tokens is not given: enough optimizer steps to train
# (AUTO_STEPS), never more tokens per step than the planner's long-standing default (AUTO_MAX_TOKENS).
AUTO_STEPS = 100
AUTO_MAX_TOKENS = 4 * 1024 * 1024
# Fewer optimizer steps than this is too few updates to train on: data_tools.pack warns.
MIN_STEPS = 10


def auto_global_tokens(total_tokens: int, slot_tokens: int = 1) -> int:
    """Real tokens per optimizer step for T real tokens when none are given: T / AUTO_STEPS (so a small set still
    makes about AUTO_STEPS steps), at most AUTO_MAX_TOKENS (a large set makes more steps), and at least
    ``slot_tokens``, the capacity of one slot of every group (``slot_tokens()``), so that a step can mix the
    groups' lengths (hbp's step_mix="mixed") rather than hold one group's slot."""
    return int(max(1, slot_tokens, min(AUTO_MAX_TOKENS, total_tokens // AUTO_STEPS)))


def slot_tokens(world_size: int, groups) -> int:
    """The capacity of one slot of every group: sum over groups of (W / sp) replicas x pack_len."""
    return int(sum(world_size // g.sp * g.pack_len for g in groups))


def step_budget(total_tokens: int, global_tokens: int) -> tuple[int, float]:
    """(optimizer steps N = max(1, round(T / G)), target real tokens per step T / N) for T real tokens."""
    num_steps = max(1, int(round(total_tokens / global_tokens)))
    return num_steps, total_tokens / num_steps


def even_positions(total: float, num_steps: int) -> np.ndarray:
    """The inner cut positions of ``num_steps`` equal steps over ``total`` tokens: j * total / num_steps, j >= 1."""
    return np.arange(1, max(int(num_steps), 1)) * (total / max(int(num_steps), 1))


def nearest_cuts(unit_tokens: np.ndarray, positions: np.ndarray, forced: tuple[int, int] | None = None) -> np.ndarray:
    """Step pointer [n + 1] over the units: step j runs units ptr[j]..ptr[j+1]-1, n = min(len(positions) + 1,
    units). Each inner cut is the unit boundary nearest to its position (tokens from the start, ascending), moved
    only as far as needed to give every step at least one unit. ``forced`` = (units, j): the curriculum's end, a
    boundary that replaces the j-th inner cut (1-based)."""
    num_units = len(unit_tokens)
    n = min(len(positions) + 1, num_units)
    if num_units == 0:
        return np.zeros(1, np.int64)
    if n <= 1:
        return np.array([0, num_units], np.int64)
    cum = np.cumsum(unit_tokens, dtype=np.float64)
    pos = np.asarray(positions, np.float64)[:n - 1]
    i = np.minimum(np.searchsorted(cum, pos), num_units - 1)  # first unit reaching pos: cut before it or after it
    before = np.where(i > 0, cum[np.maximum(i - 1, 0)], 0.0)
    cut = np.where(pos - before <= cum[i] - pos, i, i + 1)
    if forced is not None and 1 <= forced[1] <= n - 1:
        cut[forced[1] - 1] = forced[0]
    # At least one unit per step: cut_j - j is non-decreasing and at most num_units - n.
    j = np.arange(1, n)
    shifted = np.minimum(np.maximum.accumulate(np.maximum(cut - j, 0)), num_units - n)
    return np.concatenate([[0], shifted + j, [num_units]]).astype(np.int64)


def filled_cuts(unit_tokens: np.ndarray, big: np.ndarray, num_steps: int) -> np.ndarray:
    """The step (0-based) of every unit, given in run order: ``num_steps`` steps of about T / num_steps tokens,
    the small units (``big`` False) filling around the big ones (module docstring, "Smaller groups fill"). Each
    class keeps its run order; a step's units are contiguous in each. Plans of one size, and any cut that would
    leave a step empty, are cut by ``nearest_cuts`` (the plain rule) instead."""
    unit_tokens = np.asarray(unit_tokens, np.float64)
    big = np.asarray(big, bool)

    def nearest_rule():
        bounds = nearest_cuts(unit_tokens, even_positions(unit_tokens.sum(), num_steps))
        return np.repeat(np.arange(len(bounds) - 1), np.diff(bounds))

    if num_steps <= 1 or big.all() or not big.any() or len(unit_tokens) < num_steps:
        return nearest_rule()
    big_cum = np.concatenate([[0.0], np.cumsum(unit_tokens[big])])
    small_cum = np.concatenate([[0.0], np.cumsum(unit_tokens[~big])])
    total_big, total_small = big_cum[-1], small_cum[-1]
    target = (big_cum[-1] + small_cum[-1]) / num_steps
    big_end, small_end = np.zeros(num_steps + 1, np.int64), np.zeros(num_steps + 1, np.int64)
    big_end[-1], small_end[-1] = len(big_cum) - 1, len(small_cum) - 1
    done = 0.0  # tokens in steps 0..j-1
    for j in range(1, num_steps):
        goal = j * target
        # The big units' share of the first j steps (at least what the small ones cannot make up), then no
        # further than half the last unit past the goal.
        start = big_end[j - 1]
        end = _nearest_index(big_cum, min(goal, max(j * total_big / num_steps, goal - total_small)), start)
        while end > start and done + big_cum[end] - big_cum[start] - goal > (big_cum[end] - big_cum[end - 1]) / 2:
            end -= 1
        done += big_cum[end] - big_cum[start]
        big_end[j] = end
        start_s = small_end[j - 1]
        small_end[j] = _nearest_index(small_cum, small_cum[start_s] + goal - done, start_s)
        done += small_cum[small_end[j]] - small_cum[start_s]
    if (np.diff(big_end) + np.diff(small_end) == 0).any():  # a step with no unit: too few units for the sizes
        return nearest_rule()
    step = np.empty(len(unit_tokens), np.int64)
    step[big] = np.repeat(np.arange(num_steps), np.diff(big_end))
    step[~big] = np.repeat(np.arange(num_steps), np.diff(small_end))
    return step


def _nearest_index(cum: np.ndarray, position: float, low: int) -> int:
    """The index i >= low of the prefix sum ``cum`` (cum[0] = 0, ascending) nearest to ``position``."""
    i = int(np.clip(np.searchsorted(cum, position), low, len(cum) - 1))
    if i > low and position - cum[i - 1] <= cum[i] - position:
        i -= 1
    return i


def plan_units(plan: Plan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The plan's units in run order: (unit_ptr into plan.step_packs, unit_group, unit_tokens). A unit is a slot
    (R packs), or a whole plan step when that step's empty packs (a tail step's) lie in more than one slot: a
    group's empty packs must stay in one step (Plan.validate). The tail rule puts them in one slot, its last."""
    reps = np.array([plan.config.replicas(g) for g in range(len(plan.config.groups))], np.int64)
    sizes = np.diff(plan.step_ptr)
    replicas = reps[plan.step_group]
    slots = sizes // replicas
    slot_ptr = np.concatenate([[0], np.cumsum(np.repeat(replicas, slots))]).astype(np.int64)
    empty = (np.diff(plan.pack_ptr)[plan.step_packs] == 0).astype(np.int64)
    slot_empty = (segment_sums(empty, slot_ptr) > 0).astype(np.int64)
    whole = segment_sums(slot_empty, np.concatenate([[0], np.cumsum(slots)]).astype(np.int64)) > 1
    per_step = np.where(whole, 1, slots)
    unit_len = np.repeat(np.where(whole, sizes, replicas), per_step)
    unit_ptr = np.concatenate([[0], np.cumsum(unit_len)]).astype(np.int64)
    tokens = pack_tokens(plan.lengths, plan.pack_ptr, plan.pack_samples)
    return unit_ptr, np.repeat(plan.step_group, per_step), segment_sums(tokens[plan.step_packs], unit_ptr, np.int64)


def curriculum_front(plan: Plan, unit_ptr: np.ndarray, unit_tokens: np.ndarray, tokens: float):
    """(unit order with the curriculum's units first, their count, their tokens): the units whose samples all
    have the lowest GroupData level present, in run order, up to the boundary nearest ``tokens``."""
    pack_lens = [g.pack_len for g in plan.config.groups]
    level = sample_levels(plan.lengths[plan.pack_samples], pack_lens).astype(np.int64)
    filled = np.diff(plan.pack_ptr) > 0
    pack_level = np.zeros(plan.num_packs, np.int64)
    if filled.any():
        pack_level[filled] = np.maximum.reduceat(level, plan.pack_ptr[:-1][filled])
    unit_level = np.maximum.reduceat(pack_level[plan.step_packs], unit_ptr[:-1])
    low = np.flatnonzero(unit_level == unit_level.min())
    cum = np.cumsum(unit_tokens[low])
    count = int(np.argmin(np.abs(cum - tokens))) + 1
    rest = np.ones(len(unit_tokens), bool)
    rest[low[:count]] = False
    return np.concatenate([low[:count], np.flatnonzero(rest)]), count, int(cum[count - 1])


def cut_steps(unit_ptr: np.ndarray, unit_group: np.ndarray, unit_step: np.ndarray, step_packs: np.ndarray,
              num_groups: int):
    """(step_ptr, step_packs, step_group, optimizer_step or None): units (given in run order with their optimizer
    step, non-decreasing) made into plan steps, one per group and optimizer step, groups ascending."""
    order = np.argsort(unit_step * num_groups + unit_group, kind="stable")
    key = (unit_step * num_groups + unit_group)[order]
    unit_len = np.diff(unit_ptr)[order]
    flat = step_packs[gather_ranges(unit_ptr[:-1][order], unit_len)]
    first = np.flatnonzero(np.r_[True, key[1:] != key[:-1]])
    sizes = np.add.reduceat(unit_len, first) if len(first) else np.zeros(0, np.int64)
    opt = unit_step[order][first].astype(np.int64)
    step_ptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    optimizer_step = None if len(opt) == 0 or np.all(np.diff(opt) > 0) else opt
    return step_ptr, flat.astype(np.int64), unit_group[order][first].astype(np.int32), optimizer_step


def equal_steps(plan: Plan, curriculum_steps: int = 0) -> Plan:
    """The plan with its steps re-cut to the real-token budget (module docstring): the same packs, N optimizer
    steps of tau +- one unit real tokens each, the first ``curriculum_steps`` of them holding only short samples."""
    if plan.num_steps == 0:
        return plan
    unit_ptr, unit_group, unit_tokens = plan_units(plan)
    num_steps, target = step_budget(int(unit_tokens.sum()), plan.config.global_tokens)
    order, forced = np.arange(len(unit_tokens)), None
    if curriculum_steps and num_steps > 1:
        order, count, tokens = curriculum_front(plan, unit_ptr, unit_tokens, min(curriculum_steps, num_steps) * target)
        forced = (count, int(round(tokens / target)))  # their end replaces the cut nearest to it
    total = float(unit_tokens.sum())
    positions = even_positions(total, num_steps)
    if forced is not None and 1 <= forced[1] <= num_steps - 1:
        # The curriculum's end moves one cut: the steps on each side of it share their own tokens evenly, so a
        # curriculum short of short samples makes its own steps smaller, never the first step after it larger.
        j = forced[1]
        positions = np.concatenate([even_positions(tokens, j), [tokens],
                                    tokens + even_positions(total - tokens, num_steps - j)])
    bounds = nearest_cuts(unit_tokens[order], positions, forced)
    unit_step = np.repeat(np.arange(len(bounds) - 1), np.diff(bounds))
    big = (unit_group == unit_group.max())[order]  # the largest group's slots; the smaller groups' fill
    head = forced[0] if forced is not None and 1 <= forced[1] <= num_steps - 1 else 0
    first = unit_step[head] if head < len(unit_step) else num_steps  # the steps after the curriculum's
    if big[head:].any() and not big[head:].all() and len(unit_step) - head >= num_steps - first:
        unit_step[head:] = first + filled_cuts(unit_tokens[order][head:], big[head:], num_steps - first)
    # Units in step order, each step's in run order.
    regroup = np.argsort(unit_step, kind="stable")
    order, unit_step = order[regroup], unit_step[regroup]
    # Units in their new run order as CSR over the old step_packs.
    sizes = np.diff(unit_ptr)[order]
    new_ptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    packs = plan.step_packs[gather_ranges(unit_ptr[:-1][order], sizes)]
    step_ptr, step_packs, step_group, optimizer_step = cut_steps(
        new_ptr, unit_group[order], unit_step, packs, len(plan.config.groups))
    return replace(plan, step_ptr=step_ptr, step_packs=step_packs, step_group=step_group,
                   optimizer_step=optimizer_step, metrics={}, step_metrics={})
