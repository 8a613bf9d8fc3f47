"""The kk baseline (planning/baselines/kk.py): Karmarkar-Karp against a plain transcription of veRL's heap version
and against brute force, and the plan's defining properties (equal counts per replica, heaviest packs first,
workload balance). Conservation, capacity and the JSON round trip: tests/test_strategies.py; the equal-optimisation
rule: tests/test_equal_steps.py."""

from __future__ import annotations

import heapq
import itertools

import numpy as np
import pytest

from hbp_train.planning import GroupSpec, PlanConfig, make_plan
from hbp_train.planning.baselines.kk import LINEAR_WORKLOAD, karmarkar_karp
from tests.test_strategies import long_tailed


def reference_kk(weights: list[float], k: int) -> list[int]:
    """veRL's karmarkar_karp(equal_size=True) written plainly with heapq: items ascending, k at a time into one
    state; pop the two states of largest spread, merge the heaviest set of one with the lightest of the other."""
    items = sorted((w, i) for i, w in enumerate(weights))
    items = [(0.0, -1)] * (-len(items) % k) + items  # padding, as karmarkar_karp's zero-weight items
    heap, count = [], 0
    for start in range(0, len(items), k):
        sets = sorted(([w, [i]] for w, i in items[start:start + k]), key=lambda s: -s[0])
        heapq.heappush(heap, (-(sets[0][0] - sets[-1][0]), count, sets))
        count += 1
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = sorted(([a[j][0] + b[k - 1 - j][0], a[j][1] + b[k - 1 - j][1]] for j in range(k)), key=lambda s: -s[0])
        heapq.heappush(heap, (-(merged[0][0] - merged[-1][0]), count, merged))
        count += 1
    out = [0] * len(weights)
    for j, (_, ids) in enumerate(heap[0][2]):
        for i in ids:
            if i >= 0:
                out[i] = j
    return out


def set_sums(part, weights, k):
    return np.sort(np.bincount(part, weights, minlength=k))


def test_matches_the_heap_version_row_by_row():
    """Many rows of different lengths at once (zero padding) give every row the sets the heap version gives it
    (random real weights: no ties, so the merge order is the same)."""
    rng = np.random.default_rng(0)
    for k in (2, 3, 4, 7):
        counts = rng.integers(1, 120, 6)
        weights = np.zeros((len(counts), counts.max()))
        for r, n in enumerate(counts):
            weights[r, :n] = rng.random(n) * 100 + 0.1
        parts = karmarkar_karp(weights, k)
        for r, n in enumerate(counts):
            w = weights[r, :n]
            assert set_sums(parts[r, :n], w, k) == pytest.approx(set_sums(reference_kk(w.tolist(), k), w, k))
            sizes = np.bincount(parts[r, :n], minlength=k)
            assert sizes.max() - sizes.min() <= 1  # equal counts, up to one when k does not divide n


def test_known_cases():
    # {1, 2, 3, 4} in two: the pairs (1, 2) and (3, 4) merge into {1, 4} and {2, 3}, a perfect split.
    part = karmarkar_karp(np.array([[1.0, 2.0, 3.0, 4.0]]), 2)[0]
    assert part[0] == part[3] != part[1] == part[2]
    # Six equal items in three: two each, all sets equal.
    part = karmarkar_karp(np.full((1, 6), 5.0), 3)[0]
    assert np.bincount(part).tolist() == [2, 2, 2]
    # One set per item when k = n; k = 1 puts everything in set 0.
    assert sorted(karmarkar_karp(np.array([[3.0, 1.0, 2.0]]), 3)[0].tolist()) == [0, 1, 2]
    assert karmarkar_karp(np.array([[3.0, 1.0]]), 1).tolist() == [[0, 0]]


def test_balance_against_brute_force_on_tiny_inputs():
    """Against the best split with counts differing by at most one (brute force over all assignments): the
    heaviest set within 4/3 of the optimum, and the spread never above the largest item (a merge never widens the
    larger spread of the two states, and a starting state's spread is at most its largest item)."""
    rng = np.random.default_rng(1)
    worst = 1.0
    for _ in range(200):
        k = int(rng.integers(2, 4))
        n = int(rng.integers(k, 8))
        w = rng.integers(1, 100, n).astype(np.float64)
        sums = np.bincount(karmarkar_karp(w[None], k)[0], w, minlength=k)
        best = min(np.bincount(lab, w, minlength=k).max() for lab in itertools.product(range(k), repeat=n)
                   if np.ptp(np.bincount(lab, minlength=k)) <= 1)
        worst = max(worst, sums.max() / best)
        assert sums.max() - sums.min() <= w.max()
    assert worst <= 4 / 3, worst


CFG = dict(world_size=8, groups=[GroupSpec(2048, 1), GroupSpec(16384, 2)], global_tokens=1 << 18)


def replica_samples(plan, s):
    """Per replica of step s: its packs (heaviest first as run), each a sample-index array."""
    return [[plan.pack(p) for p in column] for column in plan.step_matrix(s).T]


def test_plan_partitions_each_step_by_workload_with_equal_counts():
    """Every step: the replicas' sample counts differ by at most one, their workloads (24576 s + s^2) by at most
    the heaviest sample (the Karmarkar-Karp spread bound), each replica runs its packs heaviest first, all
    replicas run the same number of packs; far better balanced than isf on the same lengths."""
    lengths = long_tailed()
    plan = make_plan(lengths, PlanConfig(strategy="kk", **CFG))
    plan.validate()
    work = LINEAR_WORKLOAD * lengths.astype(np.float64) + lengths.astype(np.float64) ** 2
    for s in range(plan.num_steps):
        replicas = replica_samples(plan, s)
        counts = [sum(len(p) for p in packs) for packs in replicas]
        loads = [sum(work[p].sum() for p in packs) for packs in replicas]
        samples = np.concatenate([p for packs in replicas for p in packs])
        assert max(counts) - min(counts) <= 1
        assert max(loads) - min(loads) <= work[samples].max() * (1 + 1e-12)
        for packs in replicas:
            pack_work = [work[p].sum() for p in packs]
            assert pack_work == sorted(pack_work, reverse=True) and all(len(p) for p in packs)
    isf = make_plan(lengths, PlanConfig(strategy="isf", **CFG))
    assert plan.metrics["ABR"] < 0.5 * isf.metrics["ABR"]


def test_calibrated_cost_is_the_workload_when_given():
    """With config.pack_cost (a calibrated cost model) the partition balances that cost: here the token count, so
    every step's replica token sums differ by at most its longest sample."""
    def tokens(pack_lengths, ptr, group):
        return np.add.reduceat(np.r_[pack_lengths, 0].astype(np.float64), ptr[:-1])[:len(ptr) - 1] * (np.diff(ptr) > 0)

    lengths = long_tailed(seed=1)
    plan = make_plan(lengths, PlanConfig(strategy="kk", pack_cost=tokens, **CFG))
    for s in range(plan.num_steps):
        loads = [sum(int(lengths[p].sum()) for p in packs) for packs in replica_samples(plan, s)]
        longest = max(int(lengths[p].max()) for packs in replica_samples(plan, s) for p in packs)
        assert max(loads) - min(loads) <= longest


def test_data_too_small_for_one_step_is_planned_like_isf():
    """Three samples near pack_len for two replicas: no split gives both replicas two non-empty packs, so the data
    is planned as isf plans it (its tail rule: an empty pack in the one step)."""
    plan = make_plan([60, 60, 60], PlanConfig(world_size=2, groups=[GroupSpec(64, 1)], strategy="kk",
                                              global_tokens=1000))
    plan.validate()
    assert plan.config.strategy == "kk" and plan.num_steps == 1 and plan.num_empty_packs == 1


def test_a_step_short_of_samples_borrows_them_and_the_step_count_stays():
    """A step whose replicas cannot all get m non-empty packs takes the samples it lacks from the next step (the last
    from the one before), instead of being merged (which made kk train fewer optimizer steps than the others at the
    one-pack-per-rank budget); two steps pulling one cut both ways merge."""
    from hbp_train.planning.baselines.kk import borrow_samples
    from hbp_train.planning.equal_steps import step_budget

    moved = {}
    # Step 0 (3 samples) needs 2 x 2: one more from step 1; step 2 (the last, 4 samples) needs 2 x 3: two from step 1.
    assert borrow_samples(np.array([0, 3, 8, 12]), np.array([0, 2]), np.array([2, 3]), 2, moved).tolist() == \
        [0, 4, 6, 12]
    assert moved == {1: 1, 2: -1}
    # Step 1 now lacks samples and would pull cut 2 back the other way: the two steps merge.
    assert borrow_samples(np.array([0, 4, 6, 12]), np.array([1]), np.array([2]), 2, moved).tolist() == [0, 4, 12]
    # Long-tailed samples up to the pack length, one pack per rank per step: the plain rule's step count.
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(3.2, 1.0, int(rng.integers(20, 200))).astype(int) + 1, 64)
    plan = make_plan(lengths, PlanConfig(world_size=2, groups=[GroupSpec(64, 1)], strategy="kk", global_tokens=128))
    plan.validate()
    assert plan.num_optimizer_steps == step_budget(int(lengths.sum()), 128)[0] == 43  # merging left 34
