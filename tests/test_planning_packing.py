"""Packing pieces: GroupData, fill_bins (vectorised first-fit decreasing), GreedyFill, refine_slot, custom costs."""

from __future__ import annotations

import numpy as np

from hbp_train.planning import GroupSpec, PlanConfig, make_plan
from hbp_train.planning.balance import refine_slot
from hbp_train.planning.hbp import GroupPacks, fill_order, group_data, size_classes


def test_group_data_boundaries():
    lengths = np.array([1, 16, 17, 64, 65, 256])
    groups = group_data(lengths, np.arange(len(lengths)), [16, 64, 256])
    assert [g.tolist() for g in groups] == [[0, 1], [2, 3], [4, 5]]


def _fill(lengths, cap, gaps=(), allow_new=True, seed=0):
    """Place every sample of at most ``cap`` tokens in fill order; (pack of every sample or -1, gaps after)."""
    order, _ = fill_order(np.asarray(lengths), [cap], np.random.default_rng(seed))
    packs = GroupPacks(cap, gaps)
    for s in range(len(order.seg_ptr) - 1):
        packs.place(order.sizes, int(order.seg_ptr[s]), int(order.seg_ptr[s + 1]), allow_new)
    ptr, samples, sizes = packs.csr(order)
    assert np.array_equal(sizes, np.asarray(lengths)[samples])
    out = np.full(len(lengths), -1)
    out[samples] = np.repeat(np.arange(packs.num), np.diff(ptr))
    return out, packs.gaps[:packs.num]


def test_fill_respects_capacity_and_fills_tightly():
    rng = np.random.default_rng(0)
    lengths = np.clip(rng.lognormal(5, 1.2, 5000), 1, 1024).astype(np.int64)
    item_bin, gaps = _fill(lengths, 1024)
    assert np.all(item_bin >= 0)
    used = np.bincount(item_bin, weights=lengths, minlength=len(gaps))
    assert np.all(used <= 1024) and np.array_equal(1024 - used, gaps)
    # First-fit decreasing wastes far less than next-fit in random order (what one isf round does).
    from hbp_train.planning.baselines.isf import next_fit

    num_next_fit = len(next_fit(lengths[rng.permutation(len(lengths))], 1024))
    waste_nf = num_next_fit * 1024 - lengths.sum()
    assert gaps.sum() < waste_nf / 4


def test_greedy_fill_only_tops_up_existing_packs():
    lengths = np.array([10, 30, 5, 5, 200], np.int64)
    item_bin, gaps = _fill(lengths, 64, gaps=[40, 12], allow_new=False)
    assert len(gaps) == 2 and np.all(gaps >= 0)
    assert item_bin[4] == -1  # too big for any gap, stays in its own group
    placed = item_bin >= 0
    assert np.bincount(item_bin[placed], weights=lengths[placed], minlength=2).tolist() == [40 - gaps[0], 12 - gaps[1]]


def test_fill_order_groups_classes_and_spreads_every_run_over_the_dataset():
    """Segments of one group and size class, largest first, every sample once, dropped ones apart; within a
    segment a run of consecutive samples comes from across the dataset (not from one stretch of it), and the
    order depends on the seed."""
    rng = np.random.default_rng(1)
    lengths = np.r_[rng.integers(100, 128, 40000), rng.integers(200, 256, 200), [3000, 9000]]
    order, dropped = fill_order(lengths, [256, 4096], np.random.default_rng(0))
    assert dropped.tolist() == [len(lengths) - 1]  # 9000 > the largest pack_len
    assert np.array_equal(np.sort(order.samples), np.arange(len(lengths) - 1))
    assert np.array_equal(order.sizes, lengths[order.samples])
    assert order.seg_level.tolist() == [1, 0, 0]  # 3000; then 200..255; then 100..127
    big = order.samples[order.seg_ptr[2]:order.seg_ptr[3]]
    for start in range(0, len(big) - 50, 5000):  # 50 consecutive samples of the 40000 span most of them
        run = big[start:start + 50]
        assert run.max() - run.min() > 30000
    again, _ = fill_order(lengths, [256, 4096], np.random.default_rng(0))
    other, _ = fill_order(lengths, [256, 4096], np.random.default_rng(1))
    assert np.array_equal(again.samples, order.samples) and not np.array_equal(other.samples, order.samples)


def test_refine_slot_lowers_max_keeps_samples_and_capacity():
    lengths = np.array([600, 500, 100, 100, 100, 100, 100, 100, 300, 300], np.int64)
    packs = [np.array([0, 2, 3]), np.array([1, 4, 5]), np.array([8, 9, 6, 7])]
    cfg = PlanConfig(world_size=3, groups=[GroupSpec(1000, 1)])
    before = [float((lengths[p] ** 2).sum()) for p in packs]
    new = refine_slot(packs, lengths, cfg, 0)
    assert new is not None
    after = [float((lengths[p] ** 2).sum()) for p in new]
    assert max(after) < max(before) and np.isclose(sum(after), sum(before))
    assert sorted(np.concatenate(new).tolist()) == list(range(10))
    assert all(lengths[p].sum() <= 1000 and len(p) > 0 for p in new)


def test_custom_pack_cost_is_balanced():
    """With a pack_cost (as hbp_train.perf.cost_model supplies) the plan stays valid and evens that cost."""
    calls = []

    def cost(pack_lengths, pack_ptr, group):
        calls.append(group)
        tok = np.add.reduceat(np.r_[pack_lengths, 0].astype(float), pack_ptr[:-1])
        tok = np.where(np.diff(pack_ptr) > 0, tok, 0.0)
        sq = np.add.reduceat(np.r_[pack_lengths, 0].astype(float) ** 2, pack_ptr[:-1])
        return tok * 1e3 + np.where(np.diff(pack_ptr) > 0, sq, 0.0)

    rng = np.random.default_rng(3)
    lengths = np.clip(rng.lognormal(5, 1.3, 3000), 1, 4096).astype(np.int64)
    cfg = PlanConfig(world_size=8, groups=[GroupSpec(1024, 1), GroupSpec(4096, 2)], global_tokens=1 << 16,
                     pack_cost=cost)
    plan = make_plan(lengths, cfg)
    plan.validate()
    assert calls and all(isinstance(g, GroupSpec) for g in calls)
    from hbp_train.planning.metrics import cost_balance_ratio

    isf = make_plan(lengths, PlanConfig(world_size=8, groups=cfg.groups, global_tokens=1 << 16, strategy="isf"))
    assert cost_balance_ratio(plan, cost) < cost_balance_ratio(isf, cost) / 5


def test_size_classes_same_above_the_table_limit(monkeypatch):
    """Past SIZE_CLASS_TABLE_MAX the classes come from a float log2 per sample: same classes as the table."""
    import hbp_train.planning.hbp as hbp

    sizes = np.r_[1, 2, 3, 1000, 1 << 16, (1 << 16) + 1, np.random.default_rng(0).integers(1, 1 << 20, 500)]
    table = size_classes(sizes)
    monkeypatch.setattr(hbp, "SIZE_CLASS_TABLE_MAX", 8)
    assert np.array_equal(size_classes(sizes), table)
    assert np.array_equal(table, np.floor(np.log2(sizes) * 2).astype(np.int16))


def test_very_long_sample_plans_without_a_length_sized_table():
    """One sample of 2^26 tokens: planning must not allocate memory proportional to the longest length
    (a 3e9-token line once made a 24 GB lookup table)."""
    import tracemalloc

    lengths = np.r_[np.full(50, 100), 1 << 26]
    cfg = PlanConfig(world_size=2, groups=[GroupSpec(1024, 1), GroupSpec(1 << 27, 2)], global_tokens=1 << 27)
    tracemalloc.start()
    try:
        plan = make_plan(lengths, cfg)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    plan.validate()
    assert plan.num_samples == 51 and len(plan.dropped) == 0
    assert peak < 64 << 20, peak


def test_lpt_repack_deals_every_sample_once_within_capacity_and_evens_the_cost():
    from hbp_train.planning.balance import _lpt_repack

    lengths = np.array([8, 7, 6, 5, 4, 3, 2, 1])
    bins = _lpt_repack(np.arange(8), lengths, 2, cap=20)
    assert sorted(np.concatenate(bins).tolist()) == list(range(8))
    assert [int((lengths[b] ** 2).sum()) for b in bins] == [102, 102]  # longest first into the cheapest pack
    assert all(lengths[b].sum() <= 20 for b in bins)
    # capacity beats cost: with cap 19, no pack takes all its cheapest-first picks
    assert all(lengths[b].sum() <= 19 for b in _lpt_repack(np.arange(8), lengths, 2, cap=19))
    assert _lpt_repack(np.arange(8), lengths, 2, cap=7) is None  # the 8-token sample fits nowhere


def test_tail_steps_are_balanced_like_full_steps():
    # A group's last, partial step used to be made of the packer's least-filled packs (ABR up to ~0.25 on this
    # mix); its samples are now dealt afresh by attention cost. (Steps of one group each, to find the tails; with
    # step_mix="mixed" the same slots are dealt to steps that mix the groups: tests/test_planning_mix.py; by
    # capacity, the steps as build_steps makes them.) A tail of one or two slots of two 128K packs is coarser
    # than a full step (its ABR reaches a few percent on some seeds), never the old leftovers' ~0.25.
    from bench.bench_planner import long_tailed_lengths

    lengths = long_tailed_lengths(20000, 1)
    plan = make_plan(lengths, PlanConfig(world_size=16, groups=[GroupSpec(16384, 1), GroupSpec(131072, 8)],
                                         strategy="hbp", global_tokens=16 * 131072, max_len=131072, seed=0,
                                         step_mix="stratified", step_tokens="capacity"))
    steps = plan.to_dict()["step_metrics"]
    full = max(s["micro_batches"] for s in steps)
    tails = [s for s in steps if s["micro_batches"] != full]
    assert tails and all(s["ABR"] < 0.05 for s in tails), [(s["group"], s["ABR"]) for s in tails]
    dropped = [d["index"] for d in plan.to_dict()["dropped"]]
    every = np.sort(np.concatenate([plan.pack_samples, np.asarray(dropped, np.int64)]))
    assert np.array_equal(every, np.arange(len(lengths)))  # every sample packed once, or dropped


def test_full_slots_pair_cost_neighbours_when_the_tail_takes_packs_that_are_all_about_as_full():
    # A group of 22 long packs, each one document topped up to about 8K (what GreedyFill makes of a small set),
    # in steps of 2 replicas x 4 micro-batches: 6 packs go to the tail step. Taken one by one as the least-filled,
    # they were any 6 packs, and the full slots around the holes they left paired packs up to 40% apart in cost
    # (bench_speed at 4 packs a rank). Now the tail takes whole slots of cost neighbours: every full slot is two
    # neighbours of the group's cost order, and the tail is the slots with the fewest tokens.
    from hbp_train.planning.balance import default_pack_cost, split_tail

    rng = np.random.default_rng(3)
    docs = np.sort(rng.integers(2000, 8100, 22))[::-1]
    tokens = 8192 - rng.integers(0, 200, 22)  # every pack about full: fill says nothing
    cost = docs.astype(np.float64) ** 2 + (tokens - docs).astype(np.float64) * 500
    ids = rng.permutation(22)
    tail, full = split_tail(ids, tokens, cost, r=2, num_tail=6)
    assert sorted(np.concatenate([tail, full]).tolist()) == list(range(22)) and len(tail) == 6
    rank = np.empty(22, np.int64)
    rank[np.argsort(-cost, kind="stable")] = np.arange(22)  # position of every pack in the cost order
    pairs = rank[full].reshape(-1, 2)
    assert np.all(pairs[:, 1] - pairs[:, 0] == 1) and np.all(np.diff(pairs[:, 0]) > 0)
    slot_tokens = {int(tokens[a] + tokens[b]) for a, b in tail.reshape(-1, 2)}
    full_tokens = tokens[full].reshape(-1, 2).sum(axis=1)
    assert max(slot_tokens) <= full_tokens.min()
    # An odd tail: its odd pack is the least-filled of all, the rest are whole slots.
    tail, full = split_tail(ids[:21], tokens, cost, r=2, num_tail=5)
    assert tail[0] == ids[:21][np.argmin(tokens[ids[:21]])] and len(tail) == 5 and len(full) == 16
    # Through the planner: 22 documents of 2K-8K and fillers that top each up to about 8K, steps by capacity so
    # that the tail is as build_steps makes it. The full slots' time lost to waiting (1 - mean/max, summed over
    # slots) was 6-11% on these seeds with the tail taken pack by pack; it is 2-6% now.
    lost = []
    for seed in range(6):
        rng = np.random.default_rng(seed)
        docs = rng.integers(2000, 8000, 22)
        room = int((8192 - docs).sum()) - 22 * 150
        fill = rng.integers(50, 300, room // 100)
        lengths = np.concatenate([docs, fill[np.cumsum(fill) <= room]])
        plan = make_plan(lengths, PlanConfig(world_size=2, groups=[GroupSpec(8192, 1)], strategy="hbp",
                                             global_tokens=4 * 2 * 8192, step_tokens="capacity", seed=0))
        assert plan.step_micro_batches().tolist() == [4, 4, 3]  # 22 packs: two full steps and a tail of 6
        pack_cost = default_pack_cost(plan.lengths[plan.pack_samples], plan.pack_ptr)
        slots = pack_cost[plan.step_packs[:plan.step_ptr[2]]].reshape(-1, 2)
        lost.append(1 - slots.mean(axis=1).sum() / slots.max(axis=1).sum())
    assert np.mean(lost) < 0.05, np.round(lost, 3)


def test_samples_of_exactly_a_pack_length_are_packed_not_dropped():
    # Boundaries: len == l_i belongs to group i; only len > l_max is dropped (random lengths rarely hit these).
    lengths = np.array([32, 33, 128, 128, 1, 129], np.int64)
    plan = make_plan(lengths, PlanConfig(world_size=2, groups=[GroupSpec(32, 1), GroupSpec(128, 2)],
                                         strategy="hbp", global_tokens=256))
    assert plan.dropped.tolist() == np.flatnonzero(lengths > 128).tolist()
    assert sorted(plan.pack_samples.tolist()) == np.flatnonzero(lengths <= 128).tolist()


def test_greedy_fill_leaves_no_gap_a_lower_group_sample_would_fit():
    # After GreedyFill, no pack of group i has room for a sample of a lower level that stayed below group i:
    # a sample is offered to every pack with room for the largest sample of its size class, which is < sqrt(2) x
    # its own length, so every gap left is < sqrt(2) x each such sample.
    from hbp_train.planning.curriculum import sample_levels
    from hbp_train.planning.hbp import pack_hierarchical

    rng = np.random.default_rng(0)  # mostly short samples, so that many stay in the lower groups
    lengths = np.concatenate([rng.integers(1, 33, 1400), rng.integers(33, 129, 400), rng.integers(129, 513, 200)])
    pack_lens = [32, 128, 512]
    config = PlanConfig(world_size=4, groups=[GroupSpec(n, 1) for n in pack_lens], strategy="hbp",
                        global_tokens=2048)
    ptr, flat, pack_group = pack_hierarchical(lengths, np.arange(len(lengths)), config, np.random.default_rng(0))
    gaps = np.array(pack_lens)[pack_group] - np.add.reduceat(lengths[flat], ptr[:-1])
    sample_group = np.repeat(pack_group, np.diff(ptr))
    level = sample_levels(lengths[flat], pack_lens)
    assert np.array_equal(np.sort(flat), np.arange(len(lengths)))
    for i in (1, 2):
        below = lengths[flat][(level < i) & (sample_group < i)]  # lower-level samples that GreedyFill left below
        assert len(below) and gaps[pack_group == i].max() < np.sqrt(2) * below.min()


def test_partial_tail_step_has_as_many_micro_batches_as_its_packs_need():
    # isf, every sample a full pack: 2 full steps of 2 replicas x 3 micro-batches, then 2 packs -> 1 micro-batch.
    lengths = np.full(2 * 3 * 2 + 2, 64, np.int64)
    plan = make_plan(lengths, PlanConfig(world_size=2, groups=[GroupSpec(64, 1)], strategy="isf",
                                         global_tokens=64 * 2 * 3, step_tokens="capacity"))
    assert sorted(plan.step_micro_batches().tolist()) == [1, 3, 3]
    assert plan.num_empty_packs == 0
