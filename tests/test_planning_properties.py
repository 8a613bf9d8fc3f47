"""Property tests (hypothesis) of the isf and hbp planners: conservation, capacity, equal micro-batch counts,
W/sp replicas, determinism, step sizes (by capacity; by real tokens: tests/test_equal_steps.py), tail rule,
curriculum, JSON round trip."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from hbp_train.common.errors import UserError
from hbp_train.planning import DROP_TOO_LONG, GroupSpec, Plan, PlanConfig, make_plan, with_metrics
from hbp_train.planning.curriculum import sample_levels

GROUP_SETS = [
    [GroupSpec(64, 1)],
    [GroupSpec(32, 1), GroupSpec(128, 2)],
    [GroupSpec(16, 1), GroupSpec(64, 2), GroupSpec(256, 4)],
]


@st.composite
def cases(draw):
    groups = draw(st.sampled_from(GROUP_SETS))
    world = draw(st.sampled_from([1, 2, 4, 8]).filter(lambda w: all(w % g.sp == 0 for g in groups)))
    top = groups[-1].pack_len
    lengths = draw(st.lists(st.integers(1, top + top // 4), min_size=1, max_size=200))
    cfg = PlanConfig(
        world_size=world, groups=groups, strategy=draw(st.sampled_from(["hbp", "isf"])),
        global_tokens=draw(st.integers(1, 8 * top * world)), curriculum_steps=draw(st.integers(0, 3)),
        seed=draw(st.integers(0, 3)), balance=draw(st.sampled_from(["refine", "sort"])),
        step_tokens=draw(st.sampled_from(["real", "capacity"])),
    )
    return np.asarray(lengths, np.int64), cfg


SETTINGS = settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(cases())
def test_plan_invariants(case):
    lengths, cfg = case
    plan = make_plan(lengths, cfg)
    plan.validate()  # conservation, capacity, W/sp replicas with equal counts, empty-pack rule
    top = cfg.groups[-1].pack_len
    assert plan.dropped.tolist() == np.flatnonzero(lengths > top).tolist()
    assert set(plan.dropped_reason) <= {DROP_TOO_LONG}
    d = plan.to_dict()
    for step in d["steps"]:
        sp = cfg.groups[step["group"]].sp
        assert len(step["replicas"]) == cfg.world_size // sp
        assert len({len(r) for r in step["replicas"]}) == 1
        if cfg.strategy == "isf":
            assert step["group"] == len(cfg.groups) - 1
    if cfg.strategy == "hbp":
        # GroupData + GreedyFill: a sample runs in its own group or, as filler, in a larger one; never smaller.
        level = sample_levels(lengths[plan.pack_samples], [g.pack_len for g in cfg.groups])
        assert np.all(level <= np.repeat(plan.pack_group, np.diff(plan.pack_ptr)))
    # Every index exactly once in a pack or dropped (checked on the JSON too).
    seen = [i for s in d["steps"] for r in s["replicas"] for p in r for i in p] + [x["index"] for x in d["dropped"]]
    assert sorted(seen) == list(range(len(lengths)))


# Found by a random draw: with mixed steps, the tail's slot (one sample and an empty pack) is dealt into a step
# whose other slot holds two-sample packs.
TAIL_DEALT_INTO_A_FULL_STEP = (np.array([16, 16, 16, 16, 16, 16, 22, 43]),
                               PlanConfig(world_size=2, groups=[GroupSpec(64, 1)], global_tokens=192, max_len=64,
                                          step_tokens="capacity"))


@SETTINGS
@given(cases())
@example(TAIL_DEALT_INTO_A_FULL_STEP)
def test_steps_sized_to_global_tokens_and_tail(case):
    """step_tokens="capacity": the steps as the strategies build them (by real tokens they are then re-cut, which
    tests/test_equal_steps.py checks)."""
    lengths, cfg = case
    plan = make_plan(lengths, replace(cfg, step_tokens="capacity"))
    micro = plan.step_micro_batches()
    tokens = plan.step_metrics["tokens"]
    for g in np.unique(plan.step_group):
        steps = np.flatnonzero(plan.step_group == g)
        m, r, pack_len = cfg.micro_batches(g), cfg.replicas(g), cfg.groups[g].pack_len
        # m per replica rounds G / (pack_len * R): capacity within half a row of packs of G (or m = 1).
        assert m == 1 or abs(m * r * pack_len - cfg.global_tokens) <= r * pack_len / 2
        assert np.all(tokens[steps] <= micro[steps] * r * pack_len)
        # All steps are full except at most one smaller tail step per group.
        assert np.count_nonzero(micro[steps] != m) <= 1
        assert np.all(micro[steps] <= m)
    if plan.num_empty_packs:
        # Empty packs only when the tail could not split any pack further: every pack of a micro-batch slot that
        # holds an empty one has at most one sample. (Per slot, not per step: step_mix="mixed" deals the tail
        # step's slots among the other steps.)
        sizes = np.diff(plan.pack_ptr)
        for s in range(plan.num_steps):
            for slot in plan.step_matrix(s):  # step_matrix: [micro-batches, replicas]; a row is a slot
                if np.any(sizes[slot] == 0):
                    assert np.all(sizes[slot] <= 1)


@SETTINGS
@given(cases())
def test_deterministic_for_a_seed(case):
    lengths, cfg = case
    a, b = make_plan(lengths, cfg), make_plan(lengths, cfg)
    for name in ("pack_ptr", "pack_samples", "pack_group", "step_ptr", "step_packs", "step_group", "dropped"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    assert np.array_equal(a.optimizer_steps(), b.optimizer_steps())


@SETTINGS
@given(cases())
def test_curriculum_first_steps_shortest(case):
    """The first K optimizer steps hold only the shortest samples (the lowest GroupData level present; hbp by
    capacity: its lowest group). By real tokens only where a slot is at most half a step (else a step cannot be cut
    to its share: equal_steps.py)."""
    lengths, cfg = case
    plan = make_plan(lengths, cfg)
    if plan.num_steps == 0 or cfg.curriculum_steps == 0:
        return
    pack_lens = [g.pack_len for g in cfg.groups]
    opt = plan.optimizer_steps()
    if cfg.strategy == "hbp" and cfg.step_tokens == "capacity":
        level = plan.step_group[np.r_[True, np.diff(opt) > 0]]
    else:
        if cfg.step_tokens == "real" and 2 * max(cfg.replicas(g) * cfg.groups[g].pack_len
                                                 for g in range(len(cfg.groups))) > plan.metrics["step_tokens_target"]:
            return
        sample_level = np.zeros(plan.num_samples, np.int64)
        sample_level[plan.pack_samples] = sample_levels(plan.lengths[plan.pack_samples], pack_lens)
        level = np.array([sample_level[np.concatenate([plan.pack(p) for s in np.flatnonzero(opt == k)
                                                       for p in plan.step_matrix(s).ravel()])].max()
                          for k in range(plan.num_optimizer_steps)])
    k = min(cfg.curriculum_steps, int(np.count_nonzero(level == level.min())))
    assert np.all(level[:k] == level.min())


@SETTINGS
@given(case=cases())
def test_json_round_trip(tmp_path_factory, case):
    lengths, cfg = case
    plan = make_plan(lengths, cfg)
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.to_json(path)
    back = with_metrics(Plan.from_json(path))  # the metrics recomputed from the steps read back
    back.validate()
    assert back.to_dict()["steps"] == plan.to_dict()["steps"]
    for key in ("ABR", "DBR", "PR", "CR", "AveT"):
        assert np.isclose(back.metrics[key], plan.metrics[key])


def test_hbp_beats_isf_on_long_tail():
    """On a long-tailed mix hbp balances attention far better than isf and never communicates more."""
    rng = np.random.default_rng(0)
    lengths = np.r_[np.clip(rng.lognormal(np.log(300), 1.0, 3000), 8, 4096), rng.integers(2048, 16384, 150)]
    lengths = lengths.astype(np.int64)
    cfg = dict(world_size=8, groups=[GroupSpec(4096, 1), GroupSpec(16384, 4)], global_tokens=1 << 18)
    hbp = make_plan(lengths, PlanConfig(strategy="hbp", **cfg))
    isf = make_plan(lengths, PlanConfig(strategy="isf", **cfg))
    assert hbp.metrics["ABR"] < isf.metrics["ABR"] / 5
    assert hbp.metrics["CR"] < isf.metrics["CR"]
    assert hbp.metrics["CR"] >= hbp.metrics["sp_required_share"]


def test_zero_length_is_an_error():
    import pytest

    with pytest.raises(UserError, match="sample 1 has length 0"):
        make_plan([3, 0, 2], PlanConfig(world_size=1, groups=[GroupSpec(8, 1)]))


def test_tail_with_fewer_samples_than_replicas_gets_empty_packs():
    # 3 single samples, 8 replicas: splitting is impossible, so 5 replicas get an empty pack in the one step.
    plan = make_plan([5, 6, 7], PlanConfig(world_size=8, groups=[GroupSpec(16, 1)], global_tokens=1))
    plan.validate()
    assert plan.num_steps == 1 and plan.num_empty_packs == 5
    assert plan.to_dict()["empty_packs"] == 5


def test_tail_splits_multi_sample_packs_before_using_empty_packs():
    # 8 samples of 4 tokens pack into 2 packs of 16; 4 replicas need 4 packs: split, no empty pack.
    plan = make_plan([4] * 8, PlanConfig(world_size=4, groups=[GroupSpec(16, 1)], global_tokens=1))
    plan.validate()
    assert plan.num_empty_packs == 0 and plan.num_packs == 4


@settings(max_examples=30, deadline=None)
@given(counts=st.lists(st.integers(0, 40), min_size=1, max_size=4), curriculum=st.integers(0, 50),
       seed=st.integers(0, 5))
def test_curriculum_then_proportional_interleave(counts, curriculum, seed):
    """order_steps: a permutation; the first K steps from the lowest level; after them every prefix holds each
    level's steps in proportion to its remaining count (within L - 1 steps for L levels: each level's keys
    (j + u) / n put it within one step of its share); deterministic for a seed."""
    from hbp_train.planning.curriculum import order_steps

    level = np.repeat(np.arange(len(counts)), counts)
    order = order_steps(level, curriculum, np.random.default_rng(seed))
    assert np.array_equal(order, order_steps(level, curriculum, np.random.default_rng(seed)))
    assert sorted(order.tolist()) == list(range(len(level)))
    if len(level) == 0:
        return
    lowest = level.min()
    k = min(curriculum, int(np.count_nonzero(level == lowest)))
    assert np.all(level[order[:k]] == lowest)
    rest = level[order[k:]]
    num_levels = len(np.unique(rest))
    for v in np.unique(rest):
        share = np.count_nonzero(rest == v) / len(rest)
        seen = np.cumsum(rest == v)
        assert np.all(np.abs(seen - share * np.arange(1, len(rest) + 1)) <= max(1, num_levels - 1) + 1e-9)


@SETTINGS
@given(cases())
def test_refine_never_worse_than_paper_sort(case):
    """balance="refine" starts from the paper's cost-sorted slots and accepts only moves that lower a slot's
    maximum at equal total, so its ABR is never above balance="sort" on the same packs."""
    lengths, cfg = case
    if cfg.strategy != "hbp":
        return
    from dataclasses import replace

    sort = make_plan(lengths, replace(cfg, balance="sort"))
    refine = make_plan(lengths, replace(cfg, balance="refine"))
    assert refine.metrics["ABR"] <= sort.metrics["ABR"] + 1e-12
    assert refine.metrics["tokens"] == sort.metrics["tokens"]
