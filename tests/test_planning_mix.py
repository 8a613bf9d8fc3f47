"""Length mix of hbp's steps (#16): the stratified dealing of slots to steps, and the mix metrics.

hbp cuts every group's packs into cost-sorted slots (the balance). With step_mix="sorted" a step took m consecutive
slots, so a step held only short samples or only long ones, which costs held-out quality (bench/bench_quality.py).
With "stratified" (default) every full step takes one slot of each of m cost strata: the same packs and slots
(so the same balance), steps that span the group's length range."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from hbp_train.planning import GroupSpec, Plan, PlanConfig, make_plan
from hbp_train.planning.balance import build_steps, stratify_slots
from hbp_train.planning.hbp import pack_hierarchical
from hbp_train.planning.metrics import mix_distance, mix_edges, step_mix, token_mix
from tests.test_planning_properties import GROUP_SETS, SETTINGS


@st.composite
def cases(draw):
    """hbp plans with several full steps of several micro-batches in their groups (where the dealing matters):
    a long-tailed mix, W in 1..8, m = 2..5 micro-batches in the smallest group and samples for several steps."""
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
                     balance=draw(st.sampled_from(["refine", "sort"])))
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
    cfg = PlanConfig(world_size=4, groups=[GroupSpec(1024, 1), GroupSpec(2048, 2)], global_tokens=1 << 15, seed=seed)
    mixed, plain = make_plan(lengths, cfg), make_plan(lengths, replace(cfg, step_mix="sorted"))
    isf = make_plan(lengths, replace(cfg, strategy="isf"))
    assert mixed.metrics["mix_TV"] < 0.8 * plain.metrics["mix_TV"]
    assert isf.metrics["mix_TV"] < mixed.metrics["mix_TV"]  # the hierarchy still keeps long samples in SP steps
    assert mixed.metrics["ABR"] == pytest.approx(plain.metrics["ABR"])
    # Within the sp=1 group, where stratification acts alone, every step's token share of samples up to 256
    # tokens is far more even.
    assert mix_edges([1024, 2048])[4] == 256

    def short_share_spread(plan):
        return float(step_mix(plan)[0][plan.step_group == 0][:, :5].sum(axis=1).std())

    assert short_share_spread(mixed) < 0.5 * short_share_spread(plain)


def test_step_mix_sorted_is_refused_when_misspelt():
    from hbp_train.errors import UserError

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
    plan = make_plan(np.array([900, 900, 100, 100], np.int64), replace(cfg, global_tokens=1800,
                                                                      groups=[GroupSpec(1800, 1)]))
    tv = plan.step_metrics["mix_TV"]
    assert sorted(tv.tolist()) == pytest.approx([0.1, 0.9])
    assert plan.metrics["mix_TV"] == pytest.approx(0.5)
    d = plan.to_dict()
    assert [s["mix_TV"] for s in d["step_metrics"]] == pytest.approx(tv.tolist())
    assert d["metrics"]["mix_TV"] == pytest.approx(0.5)
