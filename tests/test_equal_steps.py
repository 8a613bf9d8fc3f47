"""Equal optimisation (planning/equal_steps.py, #24): by real tokens, every strategy makes the same number of
optimizer steps, each within one unit of the target; the packs and slots are the strategy's own."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hbp_train.common.errors import UserError
from hbp_train.planning import ALL_STRATEGIES, GroupSpec, Plan, PlanConfig, make_plan
from hbp_train.planning.equal_steps import even_positions, filled_cuts, nearest_cuts, step_budget


def largest_unit(cfg: PlanConfig) -> int:
    """A bound on any unit's real tokens: a slot of the group with the largest R * pack_len (every sample, a kk or
    bytescale unit, is at most the largest pack_len, hence at most that too)."""
    return max(cfg.replicas(g) * cfg.groups[g].pack_len for g in range(len(cfg.groups)))


def optimizer_step_tokens(plan: Plan) -> np.ndarray:
    return np.bincount(plan.optimizer_steps(), plan.step_metrics["tokens"], minlength=plan.num_optimizer_steps)


def check_equal_steps(plan: Plan) -> None:
    """N = round(T / G) optimizer steps, each within the largest unit of the target T / N; metrics say so."""
    cfg = plan.config
    total = int(plan.pack_tokens.sum())
    num_steps, target = step_budget(total, cfg.global_tokens)
    tokens = optimizer_step_tokens(plan)
    assert plan.num_optimizer_steps == num_steps == plan.metrics["num_steps"], cfg.strategy
    unit = largest_unit(cfg)
    # A curriculum short of short samples ends early (equal_steps.py): the steps after it share the rest evenly.
    first = next((k for k in range(1, num_steps) if abs(tokens[:k].sum() - k * target) > unit), 0) \
        if cfg.curriculum_steps else 0
    if first:
        rest = tokens[first:].mean()
        assert tokens[:first].sum() < first * target and np.all(np.abs(tokens[first:] - rest) <= unit), cfg.strategy
    else:
        assert np.all(np.abs(tokens - target) <= unit), (cfg.strategy, tokens.min(), tokens.max(), target)
    assert plan.metrics["step_tokens_target"] == pytest.approx(target)
    assert (plan.metrics["step_tokens_min"], plan.metrics["step_tokens_max"]) == (tokens.min(), tokens.max())
    assert plan.metrics["step_tokens_mean"] == pytest.approx(target)


def long_tailed(n: int, top: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    short = np.clip(rng.lognormal(np.log(top / 16), 1.0, n), 1, top)
    long = rng.integers(top // 2, top + 1, n // 25)
    return rng.permutation(np.r_[short, long]).astype(np.int64)


# The quality bench's demo setting (W=2, 1024:1 and 2048:2, 8192 tokens a step) and a larger one.
SETTINGS = [
    dict(world_size=2, groups=[GroupSpec(1024, 1), GroupSpec(2048, 2)], global_tokens=8192, curriculum_steps=4),
    dict(world_size=8, groups=[GroupSpec(2048, 1), GroupSpec(16384, 4)], global_tokens=1 << 17),
]


@pytest.mark.parametrize("setting", range(len(SETTINGS)))
def test_every_strategy_makes_the_same_optimizer_steps(setting):
    """The equal-optimisation rule for every strategy on the same lengths: the same number of optimizer steps
    (exactly round(T / G)), each within one unit (a slot, or a sample for kk and bytescale) of the target; by
    capacity the counts differ (denser packs, fewer steps: the issue #24 measured)."""
    kwargs = SETTINGS[setting]
    lengths = long_tailed(2000, kwargs["groups"][-1].pack_len, setting)
    counts = {}
    for strategy in ALL_STRATEGIES:
        plan = make_plan(lengths, PlanConfig(strategy=strategy, **kwargs))
        plan.validate()
        check_equal_steps(plan)
        counts[strategy] = plan.num_optimizer_steps
        by_capacity = make_plan(lengths, PlanConfig(strategy=strategy, step_tokens="capacity", **kwargs))
        counts[strategy + " by capacity"] = by_capacity.num_optimizer_steps
    assert len({counts[s] for s in ALL_STRATEGIES}) == 1, counts
    assert counts["hbp by capacity"] < counts["isf by capacity"], counts


@st.composite
def cases(draw):
    world = draw(st.sampled_from([1, 2, 4, 8]))
    small = draw(st.integers(8, 64))
    big = small * draw(st.sampled_from([2, 4]))
    sp = draw(st.sampled_from([s for s in (1, 2, 4) if world % s == 0]))
    groups = [GroupSpec(small, 1), GroupSpec(big, sp)]
    lengths = draw(st.lists(st.integers(1, int(big * 1.2)), min_size=1, max_size=300))
    unit = max(world * small, world // sp * big)
    # A step of at least two units: a slot is the finest a step can be cut (equal_steps.py).
    strategy = draw(st.sampled_from(ALL_STRATEGIES))
    cfg = PlanConfig(world_size=world, groups=groups, global_tokens=draw(st.integers(2 * unit, 6 * unit)),
                     seed=draw(st.integers(0, 3)), strategy=strategy,
                     curriculum_steps=0 if strategy == "wlb" else draw(st.integers(0, 3)))  # wlb ignores it
    return np.asarray(lengths, np.int64), cfg


@settings(max_examples=60, deadline=None)
@given(cases())
def test_real_token_steps_for_any_lengths(case):
    """Any lengths, any strategy: round(T / G) optimizer steps, each within one unit of the target; every sample
    once."""
    lengths, cfg = case
    plan = make_plan(lengths, cfg)
    plan.validate()
    if plan.num_samples > len(plan.dropped):
        check_equal_steps(plan)


@pytest.mark.parametrize("strategy", ["hbp", "isf", "sorted", "bfd"])
def test_the_recut_keeps_the_strategys_packs_and_slots(strategy):
    """By real tokens the steps are re-cut from the same slots: packs, slot balance (ABR, DBR) and padding (PR)
    are those of the strategy's own steps."""
    cfg = PlanConfig(strategy=strategy, **SETTINGS[1])
    lengths = long_tailed(2000, 16384, 3)
    real, capacity = make_plan(lengths, cfg), make_plan(lengths, replace(cfg, step_tokens="capacity"))

    def slots(plan):
        return sorted(tuple(sorted(tuple(plan.pack(p).tolist()) for p in row))
                      for s in range(plan.num_steps) for row in plan.step_matrix(s))
    assert slots(real) == slots(capacity)
    for key in ("ABR", "DBR", "PR", "CR", "tokens", "num_slots"):
        assert real.metrics[key] == pytest.approx(capacity.metrics[key], abs=1e-12), key


def test_curriculum_steps_hold_only_short_samples():
    """The first K optimizer steps hold only samples that fit the smallest group (as many of them as the plan has
    steps of only such samples: K for hbp, sorted and bfd, whose packs of short samples are plenty; isf's and
    kk's random fills of 16K packs rarely hold only short ones), for every strategy but wlb (which keeps data
    order); the step count stays round(T / G)."""
    kwargs = dict(SETTINGS[1], curriculum_steps=3)
    lengths = long_tailed(2000, 16384, 4)
    for strategy in ALL_STRATEGIES:
        if strategy == "wlb":
            continue
        plan = make_plan(lengths, PlanConfig(strategy=strategy, **kwargs))
        check_equal_steps(plan)
        opt = plan.optimizer_steps()
        longest = np.array([lengths[np.concatenate([plan.pack(p) for s in np.flatnonzero(opt == k)
                                                    for p in plan.step_matrix(s).ravel()])].max()
                            for k in range(plan.num_optimizer_steps)])
        short = longest <= 2048
        k = min(3, int(short.sum()))
        assert np.all(short[:k]), strategy
        if strategy in ("hbp", "sorted", "bfd"):
            assert k == 3, strategy


def test_wlb_counts_its_waits_in_optimizer_steps():
    """wlb, re-cut by real tokens: a deferred sample's wait is counted in the optimizer steps of the plan, so the
    step it trains in is at least its wait."""
    lengths = long_tailed(3000, 16384, 5)
    plan = make_plan(lengths, PlanConfig(strategy="wlb", **SETTINGS[1]))
    check_equal_steps(plan)
    assert plan.deferred
    step_of_pack = np.empty(plan.num_packs, np.int64)
    step_of_pack[plan.step_packs] = np.repeat(plan.optimizer_steps(), np.diff(plan.step_ptr))
    sample_step = np.empty(len(lengths), np.int64)
    sample_step[plan.pack_samples] = np.repeat(step_of_pack, np.diff(plan.pack_ptr))
    for d in plan.deferred:
        assert 1 <= d["waited_steps"] <= sample_step[d["index"]]


def test_nearest_cuts():
    """Cuts at the unit boundary nearest each position; at least one unit a step; n = min(steps, units)."""
    tokens = np.array([3, 3, 3, 3, 3, 3])
    assert nearest_cuts(tokens, even_positions(18, 3)).tolist() == [0, 2, 4, 6]
    assert nearest_cuts(tokens, np.array([7.4, 7.6])).tolist() == [0, 2, 3, 6]  # 7.4 -> 6, 7.6 -> 9
    assert nearest_cuts(np.array([10, 1, 1]), even_positions(12, 3)).tolist() == [0, 1, 2, 3]
    assert nearest_cuts(np.array([5, 5]), even_positions(10, 5)).tolist() == [0, 1, 2]
    assert nearest_cuts(np.zeros(0, np.int64), even_positions(0, 3)).tolist() == [0]
    assert nearest_cuts(tokens, even_positions(18, 3), forced=(1, 1)).tolist() == [0, 1, 4, 6]
    assert step_budget(100, 30) == (3, 100 / 3) and step_budget(5, 100) == (1, 5.0)


def test_filled_cuts():
    """Big units cut by their share of the data, small ones fill each step to its target; one size: nearest cuts."""
    # 2 big units of 10 and 8 small units of 2 (36 tokens), 3 steps of 12. The bigs' share is 20/3 a step: by the
    # end of step 1 the nearest is one big (6.7 -> 10), by the end of step 2 still one (13.3 -> 10), so the second
    # waits for step 3; the smalls, in order, fill each step to 12.
    tokens = np.array([10, 10, 2, 2, 2, 2, 2, 2, 2, 2])
    big = tokens == 10
    steps = filled_cuts(tokens, big, 3)
    assert np.bincount(steps, tokens).tolist() == [12, 12, 12]
    assert steps.tolist() == [0, 2, 0, 1, 1, 1, 1, 1, 1, 2]
    # Nearest cuts alone, in run order: 10 | 10 + 2 + 2 | the rest.
    bounds = nearest_cuts(tokens, even_positions(36, 3))
    assert np.add.reduceat(tokens, bounds[:-1]).tolist() == [10, 14, 12]
    assert filled_cuts(tokens, np.ones(10, bool), 3).tolist() == np.repeat([0, 1, 2], np.diff(bounds)).tolist()
    assert filled_cuts(np.array([5, 1]), np.array([True, False]), 3).tolist() == [0, 1]  # fewer units than steps


@pytest.mark.parametrize("slots_per_rank", [1, 4])
def test_hbp_steps_stay_within_one_pack_of_the_target_at_both_budgets(slots_per_rank):
    """The bench's two budgets (one long pack per rank per step, and four): a slot of the long group is W packs, as
    large as the whole step at the first budget, yet every hbp step holds the target +- one long pack, because its
    short group's slots fill around the long ones (equal_steps.filled_cuts). isf, whose slots are all long, cannot."""
    world, long_len = 2, 8192
    lengths = long_tailed(1500, long_len, 5)
    for seed in range(3):
        cfg = PlanConfig(world_size=world, groups=[GroupSpec(512, 1), GroupSpec(long_len, 1)], strategy="hbp",
                         global_tokens=slots_per_rank * world * long_len, seed=seed)
        plan = make_plan(lengths, cfg)
        plan.validate()
        check_equal_steps(plan)
        tokens = optimizer_step_tokens(plan)
        assert np.abs(tokens - plan.metrics["step_tokens_target"]).max() <= long_len, (seed, tokens)


def test_plan_files_record_how_steps_are_counted(tmp_path):
    """plan.json and plan.npz say step_tokens; a plan written before it (no key) reads back as "capacity"."""
    from hbp_train.planning.plan_npz import load_plan, save_plan

    plan = make_plan(long_tailed(500, 2048), PlanConfig(strategy="hbp", **SETTINGS[0]))
    for name in ("plan.json", "plan.npz"):
        save_plan(plan, tmp_path / name)
        back = load_plan(tmp_path / name)
        assert back.config.step_tokens == "real"
        assert back.metrics["num_steps"] == plan.metrics["num_steps"]
    old = plan.to_dict()
    del old["step_tokens"]
    assert Plan.from_dict(old).config.step_tokens == "capacity"
    with pytest.raises(UserError, match="step_tokens must be one of"):
        PlanConfig(world_size=2, groups=[GroupSpec(64, 1)], step_tokens="samples")

