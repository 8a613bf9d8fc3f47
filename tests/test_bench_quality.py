"""bench/bench_quality.py works (it does NOT check quality: the script prints the held-out losses): every strategy
and ablation makes a valid plan, the plan figures and the run cache's fingerprint mean what they say, bad names
are refused. No training here (a run is a minute of both cores; the script does that)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "bench_quality.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_quality", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _lengths(seed=0, n=1500):
    rng = np.random.default_rng(seed)
    return np.r_[np.clip(rng.lognormal(np.log(100), 0.8, n), 16, 1024), rng.uniform(512, 2000, n // 20)].astype(np.int64)


def test_every_variant_plans_every_sample_once_and_the_cache_key_tells_them_apart(bench):
    lengths = _lengths()
    loss_tokens = np.maximum(1, lengths // 4)
    prints = {}
    for name, (make, overrides) in bench.VARIANTS.items():
        plan = make(lengths, 0)
        plan.validate()
        stats = bench.plan_stats(plan, loss_tokens)
        assert stats["num_steps"] == plan.num_optimizer_steps and 0 <= stats["mix_TV"] <= 1
        prints.setdefault(bench.plan_fingerprint(plan), set()).add(name)
        assert isinstance(overrides, list)
    # the same plan trained another way (a diagnostic's overrides) shares a fingerprint; different plans do not
    same = {frozenset(v) for v in prints.values() if len(v) > 1}
    assert all(group <= {"isf", "isf-sum", "hbp-stratified", "hbp-noshuffle", "hbp-sum"}
               or group == {"isf-capacity", "isf-120"} for group in same)
    assert not any({"hbp", "hbp-stratified"} <= group for group in same)  # optimizer steps are part of the key


def test_the_compared_strategies_make_equal_optimizer_steps(bench):
    """The default comparison is at equal optimisation: every default strategy makes the same optimizer steps;
    by capacity (before #24) hbp's denser packs made fewer."""
    lengths = _lengths(3)
    steps = {name: bench.VARIANTS[name][0](lengths, 0).num_optimizer_steps
             for name in bench.DEFAULT_VARIANTS.split(",") + ["hbp-capacity", "isf-capacity"]}
    assert len({steps[name] for name in bench.DEFAULT_VARIANTS.split(",")}) == 1, steps
    assert steps["hbp-capacity"] < steps["isf-capacity"], steps


def test_isf_split_ablation_separates_long_and_short_packs(bench):
    lengths = _lengths(1)
    plan = bench.VARIANTS["isf-split"][0](lengths, 1)
    limit = bench.GROUPS[0].pack_len
    long_step = [bool(np.any(plan.lengths[np.concatenate([plan.pack(p) for p in plan.step_matrix(s).ravel()])] > limit))
                 for s in range(plan.num_steps)]
    has_long = [bool(np.any(plan.lengths[plan.pack(p)] > limit)) for p in range(plan.num_packs)]
    mixed = [s for s in range(plan.num_steps)
             if len({has_long[p] for p in plan.step_matrix(s).ravel()}) > 1]
    assert len(mixed) <= 1 and any(long_step) and not all(long_step)  # at most the step where the two runs meet


def test_plan_stats_long_loss_weight_is_one_for_equal_steps(bench):
    """ave_token weighs a loss token 1 / (its step's loss tokens): with every step holding the same loss tokens the
    weight of every bucket is 1."""
    from hbp_train.planning import GroupSpec, PlanConfig, make_plan

    lengths = np.array([100, 900] * 4, np.int64)
    plan = make_plan(lengths, PlanConfig(world_size=1, groups=[GroupSpec(1000, 1)], global_tokens=1000))
    stats = bench.plan_stats(plan, np.full(len(lengths), 10))
    assert stats["long_loss_weight"] == pytest.approx(1.0) and stats["loss_tokens_cv"] == pytest.approx(0.0)


def test_unknown_names_are_refused(bench, capsys):
    with pytest.raises(SystemExit):
        bench.main(["--strategies", "isf,nope"])
    assert "unknown dataset or strategy 'nope'" in capsys.readouterr().err


def test_dynsp_bound_is_reported_beside_the_trained_strategies(bench, tmp_path):
    """The SP-per-sample bound rides with hbp (it is hbp's plan at other SP degrees: the same loss), is at least
    hbp's speed-up, and the table and the plot show the trained strategies with it."""
    lengths = _lengths(2)
    plans = {s: bench.VARIANTS[s][0](lengths, 0) for s in ("isf", "bfd", "hbp")}
    speed = bench.simulated_speedups(plans)
    assert speed["isf"] == pytest.approx(1.0) and speed["dynsp bound"] >= speed["hbp"] > 0
    stats = bench.plan_stats(plans["hbp"], np.maximum(1, lengths // 4))
    res = {s: {"loss": [5.0, 5.1], "speedup": [speed[s]] * 2, "stats": [stats, stats]} for s in plans}
    res["dynsp bound"] = [speed["dynsp bound"]] * 2
    table = bench.summary_table("demo", res, [0, 1])
    assert "bfd" in table and f"{speed['dynsp bound']:.3f}x" in table and "dynsp bound" in res
    bench.plot({"demo": res}, tmp_path / "q.png")
    assert (tmp_path / "q.png").stat().st_size > 0
