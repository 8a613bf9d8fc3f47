"""The extra strategies (bfd, sorted, wlb, bytescale, kk): conservation, capacity, their defining properties, the
contract (kk's own properties: tests/test_kk.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hbp_train.common.errors import UserError
from hbp_train.perf.cost_model import DEFAULT_CALIBRATION, CostModel
from hbp_train.planning import ALL_STRATEGIES, GroupSpec, Plan, PlanConfig, make_plan
from hbp_train.planning.baselines.bytescale import check_zero_stage
from hbp_train.planning.simulator import simulate
from tests.cli_exit import exit_code

EXTRA = ("bfd", "sorted", "wlb", "bytescale", "kk")


@st.composite
def planning_inputs(draw):
    world = draw(st.sampled_from([1, 2, 4]))
    small = draw(st.integers(8, 64))
    big = small * draw(st.sampled_from([2, 4]))
    sp_big = draw(st.sampled_from([s for s in (1, 2, 4) if world % s == 0]))
    groups = [GroupSpec(small, 1), GroupSpec(big, sp_big, draw(st.sampled_from([None, 0, 1])))]
    lengths = draw(st.lists(st.integers(1, int(big * 1.2)), min_size=1, max_size=120))
    global_tokens = draw(st.integers(big, 6 * big * world))
    return lengths, PlanConfig(world_size=world, groups=groups, global_tokens=global_tokens,
                               seed=draw(st.integers(0, 3)))


def check_conservation_and_capacity(plan: Plan, lengths) -> None:
    lengths = np.asarray(lengths)
    plan.validate()
    seen = np.concatenate([plan.pack_samples, plan.dropped])
    assert np.array_equal(np.sort(seen), np.arange(len(lengths)))
    cap = plan.config.groups[-1].pack_len
    assert np.array_equal(plan.dropped, np.flatnonzero(lengths > cap))
    caps = np.array([g.pack_len for g in plan.config.groups])[plan.pack_group]
    assert np.all(plan.pack_tokens <= caps)


@pytest.mark.parametrize("strategy", EXTRA)
@settings(max_examples=25, deadline=None)
@given(inputs=planning_inputs())
def test_conservation_and_capacity(strategy, inputs):
    lengths, cfg = inputs
    cfg.strategy = strategy
    plan = make_plan(lengths, cfg)
    check_conservation_and_capacity(plan, lengths)
    # The JSON round trip keeps every pack (bytescale's unequal replicas included).
    back = Plan.from_dict(json.loads(json.dumps(plan.to_dict())))
    back.validate()
    assert sorted(map(tuple, (back.pack(p).tolist() for p in range(back.num_packs)))) == \
        sorted(map(tuple, (plan.pack(p).tolist() for p in range(plan.num_packs))))


def long_tailed(n=3000, seed=0):
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.lognormal(6.0, 1.1, n).astype(np.int64) + 1, 8192)
    longs = rng.random(n) < 0.05
    lengths[longs] = rng.integers(1024, 16384, longs.sum())
    return lengths


CFG = dict(world_size=8, groups=[GroupSpec(2048, 1), GroupSpec(16384, 4)], global_tokens=16384 * 2 * 4)


def test_all_strategies_are_deterministic_and_registered():
    lengths = long_tailed(800)
    for strategy in ALL_STRATEGIES:
        a = make_plan(lengths, PlanConfig(strategy=strategy, **CFG))
        b = make_plan(lengths, PlanConfig(strategy=strategy, **CFG))
        assert np.array_equal(a.pack_samples, b.pack_samples) and np.array_equal(a.step_packs, b.step_packs)
    with pytest.raises(UserError, match="bytescale"):
        make_plan(lengths, PlanConfig(strategy="nope", **CFG))


def test_sorted_packs_hold_contiguous_length_ranges():
    lengths = long_tailed()
    plan = make_plan(lengths, PlanConfig(strategy="sorted", **CFG))
    ranges = sorted((lengths[plan.pack(p)].min(), lengths[plan.pack(p)].max())
                    for p in range(plan.num_packs) if len(plan.pack(p)))
    # Sorted order: a pack's length range never overlaps the next one's (ties may touch).
    assert all(hi <= nxt_lo for (_, hi), (nxt_lo, _) in zip(ranges, ranges[1:]))


def test_wlb_defers_outliers_and_reports_waits():
    lengths = long_tailed(4000)
    plan = make_plan(lengths, PlanConfig(strategy="wlb", **CFG))
    check_conservation_and_capacity(plan, lengths)
    assert plan.deferred, "a long tail must delay some outliers"
    idx = [d["index"] for d in plan.deferred]
    waits = np.array([d["waited_steps"] for d in plan.deferred])
    assert len(set(idx)) == len(idx) and np.all(waits >= 1)
    assert plan.metrics["num_deferred"] == len(idx)
    assert plan.metrics["mean_deferred_wait_steps"] == pytest.approx(waits.mean())
    # Outliers (>= pack_len / 4) are delayed far more often than short samples.
    outlier = lengths[idx] >= 16384 // 4
    share_outliers = outlier.sum() / np.count_nonzero(lengths >= 16384 // 4)
    share_short = (~outlier).sum() / np.count_nonzero(lengths < 16384 // 4)
    assert share_outliers > 3 * share_short
    # The trained step of a deferred sample is its draw step + wait, so it is a real step of the plan.
    step_of_pack = np.repeat(np.arange(plan.num_steps), np.diff(plan.step_ptr))[np.argsort(plan.step_packs)]
    sample_step = np.empty(len(lengths), np.int64)
    sample_step[plan.pack_samples] = np.repeat(step_of_pack, np.diff(plan.pack_ptr))
    assert np.all(sample_step[idx] >= waits)


def test_bytescale_unequal_micro_batches_balance_step_time():
    lengths = long_tailed(4000)
    plan = make_plan(lengths, PlanConfig(strategy="bytescale", **CFG))
    check_conservation_and_capacity(plan, lengths)
    d = plan.to_dict()
    assert d["unequal_micro_batches"] is True and d["requires_zero_stage"] == [0, 1]
    counts = [[len(r) for r in s["replicas"]] for s in d["steps"]]
    assert any(len(set(c)) > 1 for c in counts), "lighter replicas should run more micro-batches"
    assert all(all(len(pk) > 0 for r in s["replicas"] for pk in r) for s in d["steps"])
    # LPT: per step, replica loads differ by at most the largest single sample cost.
    model = CostModel.from_calibration()
    res = simulate(plan, model)
    assert res.sync == "step"
    for s in range(plan.num_steps):
        mat = plan.step_matrix(s)
        loads = res.pack_seconds[mat].sum(axis=0)
        heaviest = max(model.pack_time([l], 4) for l in lengths[np.concatenate([plan.pack(p) for p in mat.ravel()])])
        assert loads.max() - loads.min() <= heaviest * (1 + 1e-9)
    # ZeRO stages that reduce every micro-batch are refused; other strategies may not claim unequal counts.
    check_zero_stage(d, 1)
    check_zero_stage(d, 0)
    for stage in (2, 3):
        with pytest.raises(UserError, match="ZeRO stage"):
            check_zero_stage(plan, stage)
    isf = make_plan(lengths, PlanConfig(strategy="isf", **CFG))
    check_zero_stage(isf, 3)
    isf.extra["unequal_micro_batches"] = True
    with pytest.raises(ValueError, match="only valid for strategy 'bytescale'"):
        isf.validate()


def test_pack_cli_strategies_and_zero_stage(tmp_path, capsys):
    from data_tools import pack

    lengths_file = tmp_path / "lengths.txt"
    lengths_file.write_text("\n".join(map(str, long_tailed(600))))
    base = ["--lengths", str(lengths_file), "--world-size", "8", "--groups", "2048:1,16384:4",
            "--global-tokens", str(16384 * 8), "--quiet"]
    out = tmp_path / "p.json"
    assert pack.main(base + ["--strategy", "bytescale", "--zero-stage", "3", "--out", str(out)]) == 2
    assert "ZeRO stage" in capsys.readouterr().err
    assert pack.main(base + ["--strategy", "bytescale", "--zero-stage", "1", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["requires_zero_stage"] == [0, 1]
    # hbp balancing predicted pack time from a calibration; a missing calibration is a one-line error.
    assert pack.main(base + ["--strategy", "hbp", "--no-baseline", "--calibration", str(DEFAULT_CALIBRATION),
                             "--out", str(out)]) == 0
    assert exit_code(pack.main, base + ["--strategy", "wlb", "--calibration", str(tmp_path / "none.json"),
                                        "--out", str(out)]) == 2
    assert "--calibration: " in capsys.readouterr().err


# ------------------------------------------------- strategy choices against brute force and direct rebuilds
def _brute_makespan(costs, machines):
    """Optimal makespan of `costs` on `machines` by trying every assignment (small inputs only)."""
    import itertools

    best = float("inf")
    for assign in itertools.product(range(machines), repeat=len(costs)):
        loads = [0.0] * machines
        for c, m in zip(costs, assign):
            loads[m] += c
        best = min(best, max(loads))
    return best


@settings(max_examples=40, deadline=None)
@given(costs=st.lists(st.integers(1, 50), min_size=1, max_size=7), machines=st.sampled_from([2, 3]))
def test_heaviest_first_greedy_meets_grahams_lpt_bound(costs, machines):
    """bytescale's deal and wlb's pack greedy are LPT (heaviest first, least loaded): makespan <= (4/3 - 1/(3m)) OPT
    (Graham 1969). Greedy in any other order only guarantees 2 - 1/m."""
    from hbp_train.planning.baselines.bytescale import deal_to_replicas
    from hbp_train.planning.baselines.wlb import balance_into_packs

    cost = np.asarray(costs, np.float64)
    items = np.arange(len(costs))
    bound = (4 / 3 - 1 / (3 * machines)) * _brute_makespan(costs, machines) + 1e-9
    dealt = deal_to_replicas(items, cost, machines)
    assert sorted(i for r in dealt for i in r) == items.tolist()
    assert max(cost[r].sum() if r else 0.0 for r in dealt) <= bound
    packs, work, left = balance_into_packs(items.tolist(), cost, np.ones(len(costs), np.int64), machines, 10 ** 6)
    assert not left and max(work) <= bound


# WLB's own steps (by capacity: by real tokens they are re-cut, equal_steps.py), N = 8 packs each.
WLB_CFG = dict(world_size=8, groups=[GroupSpec(2048, 1), GroupSpec(16384, 4)], global_tokens=16384 * 2 * 4,
               step_tokens="capacity")


def test_wlb_outlier_threshold_is_inclusive():
    """A sample of exactly L_1 = pack_len/4 tokens is an outlier (len >= L_1): it waits in its queue, here until the
    flush (fewer than N of them); one token shorter is packed in the step it is drawn in."""
    cap = 16384
    lengths = np.array([100] * 20 + [cap // 4] * 3 + [cap // 4 - 1] * 2, np.int64)
    plan = make_plan(lengths, PlanConfig(strategy="wlb", **WLB_CFG))
    check_conservation_and_capacity(plan, lengths)
    assert plan.extra["wlb"]["outlier_thresholds"][0] == cap // 4
    assert sorted(d["index"] for d in plan.deferred) == np.flatnonzero(lengths >= cap // 4).tolist()


def _sample_steps(plan):
    step_of_pack = np.repeat(np.arange(plan.num_steps), np.diff(plan.step_ptr))[np.argsort(plan.step_packs)]
    out = np.full(len(plan.lengths), -1)
    out[plan.pack_samples] = np.repeat(step_of_pack, np.diff(plan.pack_ptr))
    return out


def test_wlb_full_queue_pops_together_one_per_pack():
    """Exactly N outliers of one queue: when the queue holds N they pop together at the next step, one per pack,
    in a regular (not a flush) step."""
    rng = np.random.default_rng(0)
    n = 8
    lengths = np.concatenate([rng.integers(50, 400, 6000), np.full(n, 5000)]).astype(np.int64)
    plan = make_plan(lengths, PlanConfig(strategy="wlb", **WLB_CFG))
    outliers = np.flatnonzero(lengths == 5000)
    steps = _sample_steps(plan)[outliers]
    num_main = plan.num_steps - plan.extra["wlb"]["flush_steps"]
    assert len(set(steps.tolist())) == 1 and steps[0] < num_main
    pack_of = np.repeat(np.arange(plan.num_packs), np.diff(plan.pack_ptr))[np.argsort(plan.pack_samples)]
    assert len(set(pack_of[outliers].tolist())) == n


def test_wlb_step_packs_are_ordered_by_workload():
    """The N packs of a step are sorted by workload (heaviest first) before they are cut into slots of R."""
    def cost(lengths, ptr, group):
        return np.add.reduceat(np.r_[lengths.astype(np.float64) ** 2, 0], ptr[:-1])[: len(ptr) - 1] * (np.diff(ptr) > 0)
    lengths = long_tailed(3000)
    plan = make_plan(lengths, PlanConfig(strategy="wlb", pack_cost=cost, **WLB_CFG))
    num_main = plan.num_steps - plan.extra["wlb"]["flush_steps"]
    assert num_main > 3
    for s in range(num_main):
        packs = plan.step_packs[plan.step_ptr[s]:plan.step_ptr[s + 1]]
        work = [float((lengths[plan.pack(p)].astype(np.float64) ** 2).sum()) for p in packs]
        assert work == sorted(work, reverse=True), s


def test_sorted_steps_are_shuffled_after_the_curriculum():
    """LongAlign shuffles its batches: steps are not in length order; the first K come from the lowest level."""
    from hbp_train.planning.curriculum import sample_levels

    lengths = long_tailed()
    plan = make_plan(lengths, PlanConfig(strategy="sorted", curriculum_steps=3, **CFG))
    step_max = np.array([lengths[np.concatenate([plan.pack(p) for p in plan.step_matrix(s).ravel()])].max()
                         for s in range(plan.num_steps)])
    assert plan.num_steps > 10 and not np.all(np.diff(step_max) >= 0)
    level = sample_levels(step_max, [g.pack_len for g in CFG["groups"]])
    assert np.all(level[:3] == level.min())


def test_isf_curriculum_moves_only_the_first_k_short_steps():
    """isf's own steps (by capacity): the first K steps whose longest sample fits the smallest group move to the
    front, in packed order; every other step keeps its packed order."""
    from hbp_train.planning.curriculum import sample_levels

    rng = np.random.default_rng(3)
    lengths = rng.integers(50, 2000, 3000)
    lengths[rng.random(3000) < 0.004] = 12000  # a long sample in about every other step
    base = make_plan(lengths, PlanConfig(strategy="isf", step_tokens="capacity", **CFG))
    k = 3
    cur = make_plan(lengths, PlanConfig(strategy="isf", curriculum_steps=k, step_tokens="capacity", **CFG))

    def step_key(plan, s):
        return tuple(tuple(plan.pack(p).tolist()) for p in plan.step_matrix(s).ravel())
    old = [step_key(base, s) for s in range(base.num_steps)]
    step_max = [lengths[np.concatenate([np.asarray(p, np.int64) for p in st_ if p] or [[0]])].max() for st_ in old]
    level = sample_levels(np.asarray(step_max), [g.pack_len for g in CFG["groups"]])
    first = [s for s in range(len(old)) if level[s] == level.min()][:k]
    assert len(first) == k and first != list(range(k)), "the data must make the curriculum move steps"
    want = [old[s] for s in first] + [old[s] for s in range(len(old)) if s not in first]
    assert [step_key(cur, s) for s in range(cur.num_steps)] == want


def _reference_bfd(sizes, cap):
    """Best-fit decreasing, written the obvious way (a scan over all packs per sample): the pack of every item."""
    gaps, out = [], []
    for size in sizes:
        fits = [(g, b) for b, g in enumerate(gaps) if g >= size]
        if fits:
            g, b = min(fits)
            gaps[b] -= size
        else:
            b = len(gaps)
            gaps.append(cap - size)
        out.append(b)
    return out


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.sampled_from([1, 2, 3, 5, 8, 13, 21, 30, 40]), min_size=1, max_size=80),
       cap=st.sampled_from([40, 64, 100]))
def test_bfd_places_every_sample_like_the_reference_best_fit(sizes, cap):
    """The fast placement (one sorted key list, same-length runs in one slice) equals a plain best-fit scan: the
    same packs, sample for sample, ties broken by the lower pack id in both."""
    from hbp_train.planning.baselines.bfd import best_fit_decreasing

    sizes = sorted(sizes, reverse=True)
    lengths = np.asarray(sizes, np.int64)
    got = best_fit_decreasing(np.arange(len(sizes)), lengths, cap)
    assert got.tolist() == _reference_bfd(sizes, cap)


def test_bfd_pads_far_less_than_isf_on_the_bench_mix():
    """On bench_planner's long-tailed mix best fit leaves almost no padding: far below isf's next-fit (and below
    sorted's), with every sample packed once in the largest group."""
    from bench.bench_planner import long_tailed_lengths

    lengths = long_tailed_lengths(40_000)
    cfg = dict(world_size=32, groups=[GroupSpec(16384, 1), GroupSpec(131072, 8)], global_tokens=32 * 131072,
               max_len=131072)
    pr = {}
    for strategy in ("isf", "bfd", "sorted"):
        plan = make_plan(lengths, PlanConfig(strategy=strategy, **cfg))
        check_conservation_and_capacity(plan, lengths)
        pr[strategy] = plan.metrics["PR"]
    bfd = make_plan(lengths, PlanConfig(strategy="bfd", **cfg))
    assert set(bfd.pack_group.tolist()) == {1}
    assert pr["bfd"] < pr["isf"] / 10 and pr["bfd"] < pr["sorted"], pr
