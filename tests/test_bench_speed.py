"""bench/speed/bench_speed.py works (it does NOT check speed: the script prints the measured figures). The report's
arithmetic on made-up runs (paired ratios, the equal-steps check at both budgets, time to quality per seed, the
replay, the targets), the round order, and ``--quick``: the whole chain (CPU calibration, profile, step costs,
plans, real trainer runs at both budgets, replay, simulator) with figures consistent with each other."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "speed" / "bench_speed.py"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load("bench_speed", SCRIPT)  # puts the repository on sys.path, so its parts import as bench.speed.*
from bench.speed import replay  # noqa: E402
from bench.speed import report  # noqa: E402


def _run(round_, measured, predicted=None, tokens=1000, evals=(), compute=None, seed=None):
    measured = list(measured)
    compute = compute or [[0.8 * m, 0.7 * m] for m in measured]
    return {"round": round_, "seed": round_ if seed is None else seed, "tokens": tokens, "steps": len(measured),
            "micro_batches": 2 * len(measured), "measured_step_s": measured,
            "predicted_step_s": list(predicted or measured), "data_s": [0.01 * m for m in measured],
            "compute_s": np.sum(compute, axis=0).tolist(),
            "wait_s": (np.array(measured)[:, None] - np.array(compute)).sum(axis=0).tolist(),
            "mean_compute_s": float(np.mean(compute, axis=1).sum()), "imbalance": 1.1, "plan_ABR": 0.1,
            "pad_ratio": 0.0, "evals": list(evals)}


def test_each_round_is_paired_with_the_isf_run_beside_it():
    """The machine ran at full speed in round 0 and at half speed in round 1: the raw tokens/s halve, the paired
    ratio does not move; hbp over a baseline is paired the same way; the median and spread are over rounds."""
    runs = {"isf": [_run(0, [5, 5]), _run(1, [10, 10]), _run(2, [6, 6])],
            "hbp": [_run(0, [4, 4]), _run(1, [8, 8]), _run(2, [4, 4])],
            "kk": [_run(0, [5, 5]), _run(1, [12.5, 7.5]), _run(2, [5, 5])]}
    paired = report.paired_ratios(runs)
    assert paired["isf"]["ratios"] == [1.0, 1.0, 1.0]
    assert paired["hbp"]["ratios"] == pytest.approx([1.25, 1.25, 1.5])
    assert (paired["hbp"]["median"], paired["hbp"]["min"], paired["hbp"]["max"]) == pytest.approx((1.25, 1.25, 1.5))
    figs = report.budget_figures(runs)
    # Raw: each round's tokens over its time, nothing divided out; the median over rounds (as the paired ratios),
    # the pooled figure beside it.
    assert figs["hbp"]["raw"]["ratios"] == pytest.approx([125, 62.5, 125])
    assert figs["hbp"]["raw_tokens_per_s"] == pytest.approx(125) and figs["hbp"]["pooled_tokens_per_s"] == \
        pytest.approx(3000 / 32)
    assert figs["hbp"]["over_kk"]["ratios"] == pytest.approx([1.25, 1.25, 1.25])
    assert figs["hbp"]["best_baseline"] == "kk" and figs["kk"]["paired"]["ratios"] == pytest.approx([1.0, 1.0, 1.2])
    # The balance ratio: isf's step time over its ranks' mean compute (1/0.75 for every run here) over hbp's.
    assert figs["hbp"]["balance_ratio"] == pytest.approx(1.0) and figs["isf"]["balance_factor"] == pytest.approx(4 / 3)


def test_predicted_figures_are_absolute_and_compared_step_by_step():
    runs = {"isf": [_run(0, [4, 6], predicted=[4.4, 5.4])], "hbp": [_run(0, [4, 4], predicted=[5, 4])]}
    figs = report.budget_figures(runs)
    assert figs["isf"]["predicted_tokens_per_s"] == pytest.approx(1000 / 9.8)
    assert figs["isf"]["predicted_error"] == pytest.approx(10 / 9.8 - 1)
    assert figs["isf"]["median_abs_step_error"] == pytest.approx(0.1)  # +10% and -10%
    assert figs["hbp"]["median_abs_step_error"] == pytest.approx(0.125)  # +25% and 0
    assert figs["hbp"]["predicted_speedup"] == pytest.approx(9.8 / 9)
    assert (figs["hbp"]["measured_step_mean_s"], figs["hbp"]["predicted_step_mean_s"]) == pytest.approx((4, 4.5))


def test_time_to_quality_per_seed_interpolates_and_computes_isfs_own_row():
    # isf seed 0 ends at 5.0 (first reached at 10 s); seed 1 dips to 4.9 at 8 s and ends at 5.2: its own time to
    # 5.2 is interpolated between 4 s (5.6) and 8 s (4.9).
    isf = [_run(0, [5, 5], evals=[(5, 1, 5.5), (10, 2, 5.0)]),
           _run(1, [4, 4, 4], evals=[(4, 1, 5.6), (8, 2, 4.9), (12, 3, 5.2)])]
    hbp = [_run(0, [4, 4], evals=[(4, 1, 5.2), (8, 2, 4.8)]),  # reaches 5.0 between 4 s and 8 s: at 6 s
           _run(1, [4, 4], evals=[(3, 1, 5.1), (6, 2, 5.3)])]  # reaches 5.2 at its first evaluation: 3 s
    bfd = [_run(0, [5, 5], evals=[(5, 1, 5.4), (10, 2, 5.3)]), _run(1, [5], evals=[(5, 1, 5.3)])]  # never
    ttq = report.time_to_quality({"isf": isf, "hbp": hbp, "bfd": bfd})
    isf_1 = 4 + (5.6 - 5.2) / (5.6 - 4.9) * 4
    assert ttq["isf"]["ratios"] == [1.0, 1.0] and ttq["isf"]["reached"] == 2
    assert ttq["hbp"]["ratios"] == pytest.approx([6 / 10, 3 / isf_1])
    assert ttq["hbp"]["median"] == pytest.approx((0.6 + 3 / isf_1) / 2)
    assert ttq["bfd"] == {"ratios": [None, None], "median": None, "reached": 0, "seeds": 2}
    # One never of three seeds: the median is over the two that reached it, and the never is stated (2 of 3).
    one_never = report.time_to_quality({"isf": isf + [_run(2, [1], evals=[(1, 1, 5.0)])],
                                        "hbp": hbp + [_run(2, [1], evals=[(1, 1, 5.5)])]})
    assert one_never["hbp"]["median"] == pytest.approx((0.6 + 3 / isf_1) / 2)
    assert (one_never["hbp"]["reached"], one_never["hbp"]["seeds"], one_never["hbp"]["ratios"][2]) == (2, 3, None)
    assert report.time_to_loss([], 1.0) is None and report.time_to_loss([(2, 1, 0.5)], 1.0) == 2.0


def test_the_equal_steps_check_at_both_budgets():
    """The bench stops unless every strategy has the same steps and tokens, each step within one slot (W packs) of
    the target; it reports the worst step in packs. On real plans at the bench's two budgets every strategy passes
    and hbp's worst step is within one long pack."""
    ok = report.check_equal_steps({"isf": [[10, 14, 12]], "hbp": [[12, 12, 12], [11, 13, 12]]}, world=2, pack_len=4)
    assert ok["isf"]["target"] == 12 and ok["isf"]["worst_packs"] == pytest.approx(0.5)
    assert ok["hbp"]["worst_tokens"] == 1
    with pytest.raises(SystemExit, match="different optimizer step counts"):
        report.check_equal_steps({"isf": [[18, 18]], "kk": [[12, 12, 12]]}, world=2, pack_len=4)
    with pytest.raises(SystemExit, match="different real tokens"):
        report.check_equal_steps({"isf": [[12, 12]], "kk": [[12, 13]]}, world=2, pack_len=4)
    with pytest.raises(SystemExit, match="more than one slot"):
        report.check_equal_steps({"isf": [[3, 21]]}, world=2, pack_len=4)
    from hbp_train.planning import GroupSpec, PlanConfig, make_plan
    from tests.test_equal_steps import long_tailed

    lengths = long_tailed(1200, 2048, 7)
    for packs_per_rank in (1, 4):
        tokens = {}
        for strategy in bench.STRATEGIES:
            groups = [GroupSpec(128, 1), GroupSpec(2048, 1)]
            plans = [make_plan(lengths, PlanConfig(world_size=2, groups=groups, strategy=strategy, seed=seed,
                                                   global_tokens=packs_per_rank * 2 * 2048)) for seed in range(2)]
            tokens[strategy] = [report.step_tokens(p) for p in plans]
        checked = report.check_equal_steps(tokens, world=2, pack_len=2048)
        assert checked["hbp"]["worst_packs"] <= 1.0, checked["hbp"]


def test_replay_puts_measured_pack_times_where_the_simulator_puts_the_cost_models():
    from hbp_train.perf.cost_model import CostModel, StepCosts
    from hbp_train.planning import GroupSpec, PlanConfig, make_plan
    from hbp_train.planning.simulator import SimConfig, plan_pack_seconds, simulate
    from tests.test_equal_steps import long_tailed

    model = CostModel.analytic("llama3.2-1b", peak_tflops=50.0)
    costs = StepCosts(compute_scale=1.2, pack_s=0.01, micro_batch_s=0.02, step_s=0.1, data_step_s=0.01)
    plans = {8: {s: make_plan(long_tailed(800, 2048, 2), PlanConfig(world_size=8, strategy=s, global_tokens=8 * 2048,
                                                                     groups=[GroupSpec(256, 1), GroupSpec(2048, 1)]))
                 for s in ("isf", "hbp")}}
    cfg = SimConfig(zero_stage=2, step_costs=costs)
    seconds = {8: {s: plan_pack_seconds(p, model, cfg) for s, p in plans[8].items()}}
    drawn = replay.draw_steps(plans, seconds, budget_s=1e9, nproc=2, seed=0)
    assert len(drawn[8]["isf"]) == len(drawn[8]["hbp"]) == plans[8]["isf"].num_optimizer_steps  # all fit the budget
    few = replay.draw_steps(plans, seconds, budget_s=0.0, nproc=2, seed=0)
    assert len(few[8]["isf"]) == len(few[8]["hbp"]) == 1  # one step each, whatever the budget
    for name, plan in plans[8].items():
        sim = simulate(plan, model, cfg)
        steps = drawn[8][name]
        # Measured = the cost model's times: the replay is the simulation.
        same = replay.replay_step_seconds(plan, sim, steps, seconds[8][name], costs)
        np.testing.assert_allclose(same, sim.step_seconds[steps], rtol=1e-12)
        # Measured = twice the model: every slot's slowest replica doubles its compute, the rest stays.
        twice = replay.replay_step_seconds(plan, sim, steps, 2 * seconds[8][name], costs)
        extra = np.bincount(sim.slot_step, sim.slot_seconds - costs.pack_s, minlength=len(sim.step_seconds))
        np.testing.assert_allclose(twice, sim.step_seconds[steps] + extra[steps], rtol=1e-9)
        jobs = replay.jobs_for({name: plan}, {name: steps[:1]})
        assert jobs and all(job["key"] == replay.pack_key(job["samples"]) and job["samples"] for job in jobs)
        # Measured times are found again under each pack's samples; a pack timed for no drawn step stays NaN.
        times = {job["key"]: 1.5 for job in jobs}
        got = replay.measured_pack_seconds(plan, times)
        drawn_packs = replay.step_packs(plan, int(steps[0]))
        assert np.all(np.isin(got[drawn_packs], [0.0, 1.5]))
        assert np.isnan(got).sum() == sum(1 for p in range(plan.num_packs) if len(plan.pack(p))
                                          and replay.pack_key(plan.pack(p)) not in times)
        unmeasured = np.full(plan.num_packs, np.nan)
        with pytest.raises(ValueError, match="not measured"):
            replay.replay_step_seconds(plan, sim, steps[:1], unmeasured, costs)
    figs = report.replay_figures({8: {"isf": {"tokens": [100, 100], "replayed_s": [2, 2], "simulated_s": [1.5, 2.5],
                                              "plan_steps": 9, "plan_simulated_tokens_per_s": 40.0},
                                      "hbp": {"tokens": [100, 100], "replayed_s": [1, 1], "simulated_s": [1, 1.5],
                                              "plan_steps": 9, "plan_simulated_tokens_per_s": 50.0}}})
    hbp, isf = figs[8]["hbp"], figs[8]["isf"]
    # measured over simulated on the drawn steps: isf 4/4 = 1, hbp 2/2.5 = 0.8; the whole plans scaled by it
    assert (isf["measured_over_simulated"], hbp["measured_over_simulated"]) == pytest.approx((1.0, 0.8))
    assert (isf["replayed_tokens_per_s"], hbp["replayed_tokens_per_s"]) == pytest.approx((40.0, 62.5))
    assert (hbp["replayed_speedup"], hbp["plan_simulated_speedup"]) == pytest.approx((62.5 / 40, 1.25))
    # the error is the two strategies' measured over simulated ratios, whatever the drawn steps' own tokens/s
    assert hbp["speedup_error"] == pytest.approx(0.8 / 1.0 - 1)
    assert hbp["drawn_replayed_tokens_per_s"] == pytest.approx(100.0)


def test_rounds_put_isf_in_the_middle_and_rotate_the_others():
    strategies = ["isf", "sorted", "bfd", "kk", "hbp"]
    orders = [bench.round_order(strategies, r) for r in range(4)]
    assert orders[0] == ["sorted", "bfd", "isf", "kk", "hbp"]
    assert orders[1] == ["bfd", "kk", "isf", "hbp", "sorted"]
    assert all(o[2] == "isf" and sorted(o) == sorted(strategies) for o in orders)
    assert len({o[1] for o in orders}) == 4  # no strategy always runs next to isf
    assert bench.round_order(["isf", "hbp"], 0) == ["isf", "hbp"]


def test_a_run_is_reused_only_when_made_with_the_same_settings(tmp_path):
    """Resumable: a run's figures come back from WORK only if they were made with the same stamp (setup,
    calibration and step costs, groups, budget, strategy, round)."""
    stamp = {"setup": "Setup(...)", "strategy": "hbp", "round": 1}
    (tmp_path / "figures.json").write_text(json.dumps({"stamp": stamp, "figures": {"tokens": 7}}))
    assert bench._reused(tmp_path, stamp) == {"tokens": 7}
    assert bench._reused(tmp_path, {**stamp, "round": 2}) is None
    assert bench._reused(tmp_path / "missing", stamp) is None


def test_targets_judge_the_issues_figures():
    runs = {"isf": [_run(0, [5, 5], evals=[(10, 2, 5.0)])],
            "hbp": [_run(0, [4, 4], predicted=[4.2, 4.2], evals=[(8, 2, 4.9)])],
            "sorted": [_run(0, [4.5, 4.5], evals=[(9, 2, 5.1)])]}
    budgets = {1: report.budget_figures(runs), 4: report.budget_figures(runs)}
    steps = {k: {"hbp": {"worst_packs": 0.5}} for k in budgets}
    replayed = {32: {"isf": {"replayed_speedup": 1.0, "speedup_error": 0.0},
                     "hbp": {"replayed_speedup": 1.4, "speedup_error": -0.12}}}
    rows = {what.split(" (")[0].split(",")[0]: (value, met)
            for what, value, met in report.targets(budgets, replayed, steps, 1)}
    assert rows["hbp raw tokens/s >= 1.10x isf"] == (pytest.approx(1.25), True)
    assert rows["hbp >= every baseline"] == (pytest.approx(9 / 8), True)
    assert rows["hbp reaches isf's final loss"] == (pytest.approx(0.8), True)
    assert rows["predicted tokens/s within 10% of measured"] == (pytest.approx(8 / 8.4 - 1), True)
    assert rows["replay W=32: simulated speed-up within 10% of the replayed one"] == (pytest.approx(-0.12), False)
    assert rows["hbp's worst step within one pack of the target"] == (0.5, True)
    text = report.budget_table(budgets[1], {n: {"worst_packs": 0.5} for n in runs})
    assert all(f"\n{name:<8}" in text for name in runs) and "1.250 [1.250-1.250]" in text


@pytest.mark.slow
@pytest.mark.full
def test_quick_run_trains_every_strategy_at_both_budgets_and_its_figures_agree(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    # Two strategies keep the suite's time down; the others plan in their own tests.
    strategies = ["isf", "hbp"]
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--work", str(tmp_path), "--strategies",
                           ",".join(strategies)], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "quick" / "results.json").read_text())
    setup = bench.SETUPS["quick"]
    assert list(results["budgets"]) == [str(b.packs_per_rank) for b in setup.budgets]
    for key, runs in results["runs"].items():
        figs = results["budgets"][key]
        assert set(figs) == set(strategies)
        assert len({r["tokens"] for rounds in runs.values() for r in rounds}) == 1  # the same samples
        assert len({r["steps"] for rounds in runs.values() for r in rounds}) == 1  # the same optimizer steps
        for name, rounds in runs.items():
            for r in rounds:
                assert len(r["measured_step_s"]) == len(r["predicted_step_s"]) == r["steps"] > 0
                assert all(t > 0 for t in r["measured_step_s"] + r["predicted_step_s"])
            f = figs[name]
            # the timed steps: every step but the first (the warm-up), their real tokens over their time
            assert all(r["warmup_steps"] == report.WARMUP_STEPS for r in rounds)
            tokens, seconds, _ = report.timed(rounds[0])
            assert tokens == sum(rounds[0]["step_tokens"][1:]) and seconds == pytest.approx(
                sum(rounds[0]["measured_step_s"][1:]))
            assert f["raw_tokens_per_s"] == pytest.approx(tokens / seconds)  # one round: its own figure
            assert f["paired"]["median"] == pytest.approx(f["raw_tokens_per_s"] / figs["isf"]["raw_tokens_per_s"])
        assert all(r["evals"] for rounds in runs.values() for r in rounds) == (key == "1")
    ttq = results["budgets"]["1"]["isf"]["time_to_quality"]
    assert ttq["ratios"] == [1.0]  # isf against itself, computed
    costs = results["step_costs"]
    assert costs["fit"]["steps"] >= 3 and costs["compute_scale"] > 0 and "fitted on step_costs_run" in costs["source"]
    for world in ("8", "32"):
        rows = results["replay"][world]
        assert set(rows) == set(strategies) and rows["isf"]["replayed_speedup"] == 1.0
        assert all(math.isfinite(r["replayed_tokens_per_s"]) and r["steps"] >= 1 for r in rows.values())
    assert (tmp_path / "quick" / "speed.png").stat().st_size > 0
    assert "targets:" in proc.stdout and "MEASURED on this CPU" in proc.stdout and "REPLAY: measured compute" in \
        proc.stdout
