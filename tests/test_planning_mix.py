"""Length mix of hbp's steps (#16): stratified dealing of slots to steps, optimizer steps that mix the groups, and
the mix metrics.

hbp cuts every group's packs into cost-sorted slots (the balance). With step_mix="sorted" a step took m consecutive
slots, so a step held only short samples or only long ones, which costs held-out quality (bench/bench_quality.py).
With "stratified" every full step takes one slot of each of m cost strata: the same packs and slots (so the same
balance), steps that span the group's length range. With "mixed" (default) every optimizer step also holds slots of
every group in proportion (one plan step per group, Plan.optimizer_step), the same slots again."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hbp_train.planning import GroupSpec, Plan, PlanConfig, make_plan, with_metrics
from hbp_train.planning.balance import build_steps, stratify_slots
from hbp_train.planning.hbp import pack_hierarchical
from hbp_train.planning.metrics import mix_distance, mix_edges, step_mix, token_mix
from tests.test_planning_properties import GROUP_SETS, SETTINGS


@st.composite
def cases(draw):
    """hbp plans with several full steps of several micro-batches in their groups (where the dealing matters):
    a long-tailed mix, W in 1..8, m = 2..5 micro-batches in the smallest group and samples for several steps. By
    capacity: the steps hbp deals (by real tokens they are re-cut from the same slots: tests/test_equal_steps.py)."""
    groups = draw(st.sampled_from(GROUP_SETS))
    world = draw(st.sampled_from([1, 2, 4, 8]).filter(lambda w: all(w % g.sp == 0 for g in groups)))
    top, small = groups[-1].pack_len, groups[0].pack_len
    m, replicas = draw(st.integers(2, 5)), world // groups[0].sp
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    n = 60 * m * replicas + draw(st.integers(0, 600))  # enough short samples for several full steps of group 0
    short = np.clip(rng.lognormal(np.log(small / 4), 0.8, n), 1, small)
    long = rng.integers(1, top + top // 4, n // 20)
    lengths = rng.permutation(np.r_[short, long]).astype(np.int64)
    cfg = PlanConfig(world_size=world, groups=groups, strategy="hbp", global_tokens=m * small * replicas,
                     curriculum_steps=draw(st.integers(0, 3)), seed=draw(st.integers(0, 3)),
                     balance=draw(st.sampled_from(["refine", "sort"])), step_tokens="capacity")
    return lengths, cfg


def _dealing_matters(plan: Plan) -> bool:
    """Some group has two or more full steps of two or more micro-batches."""
    micro = plan.step_micro_batches()
    return any(np.count_nonzero(micro[plan.step_group == g] == plan.config.micro_batches(int(g))) >= 2
               and plan.config.micro_batches(int(g)) >= 2 for g in np.unique(plan.step_group))


def _slots(plan: Plan) -> list:
    """Every slot as a sorted tuple of its packs (each a tuple of sample indices), with its group."""
    out = []
    for s in range(plan.num_steps):
        for row in plan.step_matrix(s):
            out.append((int(plan.step_group[s]), tuple(sorted(tuple(plan.pack(p).tolist()) for p in row))))
    return sorted(out)


@SETTINGS
@given(cases())
def test_stratified_steps_keep_every_pack_slot_and_the_balance(case):
    """Same packs, same slots, so the same ABR/DBR/PR/CR as the sorted dealing; every sample once within capacity."""
    lengths, cfg = case
    cfg = replace(cfg, strategy="hbp")
    mixed = make_plan(lengths, replace(cfg, step_mix="stratified"))
    plain = make_plan(lengths, replace(cfg, step_mix="sorted"))
    assert _dealing_matters(mixed)
    mixed.validate()  # every sample once in a pack or dropped, capacity, W/sp replicas, equal micro-batch counts
    assert _slots(mixed) == _slots(plain)
    for key in ("ABR", "DBR", "PR", "CR", "AveT", "num_steps"):
        assert mixed.metrics[key] == pytest.approx(plain.metrics[key], abs=1e-12), key
    assert sorted(mixed.step_micro_batches().tolist()) == sorted(plain.step_micro_batches().tolist())


@SETTINGS
@given(cases())
def test_every_full_step_takes_one_slot_of_each_cost_stratum(case):
    """The guarantee: cut a group's cost-sorted slots into m strata of n (the number of full steps); then the k-th
    slot of every full step comes from stratum k, each slot once. Checked on build_steps' output (before the step
    order), against the sorted dealing of the same packs."""
    lengths, cfg = case
    cfg = replace(cfg, strategy="hbp")
    kept = np.flatnonzero(lengths <= cfg.groups[-1].pack_len)
    packs = pack_hierarchical(lengths, kept, cfg, np.random.default_rng(cfg.seed))
    layout = {}
    for mix in (False, True):
        ptr, flat, _, s_ptr, s_packs, s_group = build_steps(lengths, *packs, cfg, mix_steps=mix,
                                                            rng=np.random.default_rng(cfg.seed))
        content = [tuple(sorted(flat[ptr[p]:ptr[p + 1]].tolist())) for p in s_packs]
        layout[mix] = (content, s_ptr, s_group)
    (plain, s_ptr, s_group), (mixed, _, _) = layout[False], layout[True]
    checked = 0
    for g in np.unique(s_group):
        r, m = cfg.replicas(int(g)), cfg.micro_batches(int(g))
        n = int(np.count_nonzero(packs[2] == g)) // (r * m)  # full steps (a tail step may be as large: not one)
        if n == 0:
            continue
        start = s_ptr[np.flatnonzero(s_group == g)[0]]  # the full steps come first within their group
        slot = lambda seq, i: tuple(seq[start + i * r:start + (i + 1) * r])  # noqa: E731
        sorted_slots = [slot(plain, i) for i in range(n * m)]
        for k in range(m):
            stratum = sorted(sorted_slots[k * n:(k + 1) * n])
            assert sorted(slot(mixed, j * m + k) for j in range(n)) == stratum
        checked += n >= 2 and m >= 2
    assert checked

def test_stratify_slots_deals_one_slot_per_stratum_and_is_seeded():
    layout = np.arange(4 * 3 * 2)  # 4 steps x 3 slots of 2 packs, slot-major, heaviest first
    out = stratify_slots(layout, r=2, m=3, rng=np.random.default_rng(7))
    assert sorted(out.tolist()) == layout.tolist()
    steps = out.reshape(4, 3, 2)
    for k in range(3):  # slot k of every step lies in stratum k (slots 4k..4k+3, packs 8k..8k+7)
        assert sorted(steps[:, k].ravel().tolist()) == list(range(8 * k, 8 * k + 8))
    assert np.all(steps[:, :, 1] == steps[:, :, 0] + 1)  # a slot's packs stay together
    assert np.array_equal(out, stratify_slots(layout, 2, 3, np.random.default_rng(7)))


def _long_tailed(seed: int, n: int = 4000) -> np.ndarray:
    rng = np.random.default_rng(seed)
    short = np.clip(rng.lognormal(np.log(100), 0.8, n), 16, 1024)
    long = rng.uniform(512, 2000, n // 20)
    return np.r_[short, long].astype(np.int64)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_stratified_steps_follow_the_data_mix_closer_than_sorted_ones(seed):
    """On a long-tailed mix, sorted dealing gives steps of only the shortest samples (mix_TV near isf's double);
    stratified dealing brings the mean step closer to the data's length mix, at the same balance."""
    lengths = _long_tailed(seed)
    cfg = PlanConfig(world_size=4, groups=[GroupSpec(1024, 1), GroupSpec(2048, 2)], global_tokens=1 << 15, seed=seed,
                     step_mix="stratified", step_tokens="capacity")
    mixed, plain = make_plan(lengths, cfg), make_plan(lengths, replace(cfg, step_mix="sorted"))
    isf = make_plan(lengths, replace(cfg, strategy="isf"))
    assert mixed.metrics["mix_TV"] < 0.8 * plain.metrics["mix_TV"]
    assert isf.metrics["mix_TV"] < mixed.metrics["mix_TV"]  # steps of one group: long samples only in SP steps
    assert mixed.metrics["ABR"] == pytest.approx(plain.metrics["ABR"])
    # Within the sp=1 group, where stratification acts alone, every step's token share of samples up to 256
    # tokens is far more even.
    assert mix_edges([1024, 2048])[4] == 256

    def short_share_spread(plan):
        return float(step_mix(plan)[0][plan.step_group == 0][:, :5].sum(axis=1).std())

    assert short_share_spread(mixed) < 0.5 * short_share_spread(plain)


def _optimizer_step_slots(plan: Plan) -> list:
    """Per optimizer step: [(group, slots of it)], in plan order."""
    out: list = []
    for s, k in enumerate(plan.optimizer_steps().tolist()):
        if k == len(out):
            out.append([])
        out[k].append((int(plan.step_group[s]), int(plan.step_micro_batches()[s])))
    return out


@SETTINGS
@given(cases())
def test_mixed_optimizer_steps_hold_every_group_in_proportion_with_the_same_slots(case):
    """step_mix="mixed": the same slots as stratified (so the same ABR/DBR/PR/CR), every sample once; an optimizer step
    holds one plan step per group; its capacity is within half a slot of global_tokens (but the curriculum's and the
    last); after the curriculum every group's slots are spread in proportion over the run (its share of any prefix
    of the slots within a few slots); the first K optimizer steps are whole steps of the lowest group; plan.json and
    plan.npz keep the optimizer steps."""
    lengths, cfg = case
    mixed = make_plan(lengths, replace(cfg, step_mix="mixed"))
    strat = make_plan(lengths, replace(cfg, step_mix="stratified"))
    mixed.validate()
    assert _slots(mixed) == _slots(strat)
    for key in ("ABR", "DBR", "PR", "CR", "tokens", "num_packs", "num_slots"):
        assert mixed.metrics[key] == pytest.approx(strat.metrics[key], abs=1e-12), key
    per_opt = _optimizer_step_slots(mixed)
    assert mixed.num_optimizer_steps == len(per_opt) == mixed.metrics["num_steps"]
    groups = {g for g in np.unique(mixed.step_group).tolist()}
    slot_cap = {g: cfg.groups[g].pack_len * cfg.replicas(g) for g in groups}
    lowest = min(groups)
    k = min(cfg.curriculum_steps, int(np.count_nonzero(strat.step_group == lowest)))
    assert all(len(p) == 1 and p[0][0] == lowest for p in per_opt[:k])
    if len(groups) == 1:
        assert mixed.optimizer_step is None  # nothing to mix: one plan step per optimizer step
        return
    big = max(slot_cap.values())
    for parts in per_opt[k:-1]:
        capacity = sum(slot_cap[g] * n for g, n in parts)
        assert abs(capacity - cfg.global_tokens) <= big / 2 + 1e-9 or capacity <= cfg.global_tokens + big / 2
        assert capacity >= cfg.global_tokens - big / 2 - max(slot_cap.values()), parts
    rest = [g for parts in per_opt[k:] for g, n in parts for _ in range(n)]
    slot_order = np.asarray(rest)
    for g in groups:
        share = np.mean(slot_order == g)
        seen = np.cumsum(slot_order == g)
        # one tail step per group may move as a whole (up to m slots)
        slack = len(groups) + max(cfg.micro_batches(h) for h in groups)
        assert np.all(np.abs(seen - share * np.arange(1, len(slot_order) + 1)) <= slack)
    back = with_metrics(Plan.from_dict(mixed.to_dict()))
    assert np.array_equal(back.optimizer_step, mixed.optimizer_step)
    assert back.metrics["mix_TV"] == pytest.approx(mixed.metrics["mix_TV"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixed_steps_hold_the_datas_length_mix(seed):
    """With optimizer steps that mix the groups, the steps' length mix is about as close to the data's as a random
    fill (isf) gets (mix_TV; hbp's steps take whole slots, ~8 a step here, isf's mix at the sample level: measured
    1.1-1.24x isf's at equal real tokens per step) and far closer than steps of one group; the balance is the same."""
    lengths = _long_tailed(seed)
    cfg = PlanConfig(world_size=4, groups=[GroupSpec(1024, 1), GroupSpec(2048, 2)], global_tokens=1 << 15, seed=seed)
    # stratified by capacity: steps of one group each (by real tokens they are re-cut across the groups too)
    mixed, strat = make_plan(lengths, cfg), make_plan(lengths, replace(cfg, step_mix="stratified", step_tokens="capacity"))
    isf = make_plan(lengths, replace(cfg, strategy="isf"))
    assert mixed.metrics["mix_TV"] < 0.6 * strat.metrics["mix_TV"]
    assert mixed.metrics["mix_TV"] < 1.3 * isf.metrics["mix_TV"]
    assert mixed.metrics["ABR"] == pytest.approx(strat.metrics["ABR"])


def test_binary_plan_keeps_the_optimizer_steps(tmp_path):
    from hbp_train.planning.plan_npz import read_npz, write_npz

    plan = make_plan(_long_tailed(0, 600), PlanConfig(world_size=2, groups=[GroupSpec(1024, 1), GroupSpec(2048, 2)],
                                                      global_tokens=8192))
    assert plan.optimizer_step is not None and plan.num_optimizer_steps < plan.num_steps
    write_npz(plan, tmp_path / "p.npz")
    back = read_npz(tmp_path / "p.npz")
    back.validate()
    assert np.array_equal(back.optimizer_step, plan.optimizer_step)
    assert back.metrics["num_steps"] == plan.num_optimizer_steps


def test_validate_rejects_broken_optimizer_steps():
    plan = make_plan(_long_tailed(0, 600), PlanConfig(world_size=2, groups=[GroupSpec(1024, 1), GroupSpec(2048, 2)],
                                                      global_tokens=8192))
    good = plan.optimizer_step.copy()
    for bad in (good + 1, np.r_[good[:-1], good[-1] + 2]):
        plan.optimizer_step = bad
        with pytest.raises(ValueError, match="optimizer_step must number"):
            plan.validate()
    plan.optimizer_step = np.zeros(plan.num_steps, np.int64)  # one optimizer step of all plan steps
    with pytest.raises(ValueError, match="two plan steps of the same group"):
        plan.validate()


def test_step_mix_sorted_is_refused_when_misspelt():
    from hbp_train.common.errors import UserError

    with pytest.raises(UserError, match="step_mix must be one of"):
        PlanConfig(world_size=1, groups=[GroupSpec(8, 1)], step_mix="random")


def test_mix_edges_token_mix_and_distance():
    assert mix_edges([1024, 2048]).tolist() == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert mix_edges([4]).tolist() == [1, 2, 4]  # no bucket narrower than a token, none twice
    edges = np.array([10, 100])
    assert token_mix(np.array([10, 30, 60]), edges).tolist() == pytest.approx([0.1, 0.9])  # 10 <= 10: bucket 0
    rows = token_mix(np.array([10, 30, 60, 5]), edges, np.array([0, 0, 1, 2]), 4)
    np.testing.assert_allclose(rows, [[0.25, 0.75], [0.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    assert mix_distance(rows[:3], np.array([0.25, 0.75])).tolist() == pytest.approx([0.0, 0.25, 0.75])


def test_plan_mix_metrics():
    """step_mix: each step's token share per bucket; mix_TV: 0 when every step holds the data's mix."""
    lengths = np.array([100, 900, 100, 900], np.int64)  # two equal steps: each one short and one long sample
    cfg = PlanConfig(world_size=1, groups=[GroupSpec(1000, 1)], global_tokens=1000)
    plan = make_plan(lengths, cfg)
    assert plan.num_steps == 2
    assert plan.metrics["mix_TV"] == pytest.approx(0.0)
    assert step_mix(plan)[0].sum(axis=1) == pytest.approx([1.0, 1.0])
    edges = plan.metrics["mix_edges"]
    assert plan.metrics["data_mix"][int(np.searchsorted(edges, 900))] == pytest.approx(0.9)
    # One step of the long samples, one of the short ones: each step is far from the data's 10/90 mix.
    plan = make_plan(np.array([900, 900, 100, 100], np.int64), replace(cfg, global_tokens=1800, step_tokens="capacity",
                                                                      groups=[GroupSpec(1800, 1)]))
    tv = plan.step_metrics["mix_TV"]
    assert sorted(tv.tolist()) == pytest.approx([0.1, 0.9])
    assert plan.metrics["mix_TV"] == pytest.approx(0.5)
    d = plan.to_dict()
    assert [s["mix_TV"] for s in d["step_metrics"]] == pytest.approx(tv.tolist())
    assert d["metrics"]["mix_TV"] == pytest.approx(0.5)


def test_simulated_time_of_mixed_steps():
    """Mixing groups moves whole slots: the simulated compute time (ZeRO-2/3: sum of slot times) is the stratified
    plan's; with ZeRO's collectives, the per-step collectives and the optimizer count once per optimizer step."""
    from hbp_train.perf.cost_model import CostModel
    from hbp_train.planning.simulator import SimConfig, simulate, zero_comm_seconds

    cfg = PlanConfig(world_size=8, groups=[GroupSpec(1024, 1), GroupSpec(2048, 4)], global_tokens=1 << 14, seed=1)
    lengths = _long_tailed(1)
    mixed, strat = make_plan(lengths, cfg), make_plan(lengths, replace(cfg, step_mix="stratified"))
    assert mixed.num_optimizer_steps < mixed.num_steps
    model = CostModel.from_calibration()
    a, b = simulate(mixed, model), simulate(strat, model)
    assert a.total_seconds == pytest.approx(b.total_seconds, rel=1e-12)
    assert len(a.step_seconds) == mixed.num_optimizer_steps
    zero = SimConfig(zero_stage=2)
    c = simulate(mixed, model, zero)
    assert len(c.step_seconds) == mixed.num_optimizer_steps
    assert c.optimizer_seconds == pytest.approx(c.optimizer_seconds_per_step * mixed.num_optimizer_steps)
    # ZeRO-2: collectives per micro-batch (slot) and per step, and the optimizer, once per OPTIMIZER step
    comm = zero_comm_seconds(model.shape.num_params, cfg.world_size, zero)
    slots = int(mixed.metrics["num_slots"])
    expected = slots * comm["micro"] + mixed.num_optimizer_steps * (comm["step"] + comm["optimizer"])
    assert c.total_seconds - a.total_seconds == pytest.approx(expected, rel=1e-9)
