"""bench/bench_speed.py works (it does NOT check speed: the script prints the measured figures): ``--quick`` runs the
whole chain (CPU calibration, profile, plans, real trainer runs of every strategy, simulator) and its figures are
consistent with each other; the report's arithmetic (speed-ups, per-step error, time to quality, group choice,
targets) on made-up runs."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "bench_speed.py"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _load("bench_speed", SCRIPT)  # puts the repository on sys.path, so its parts import as bench.speed_*
from bench import speed_report as report  # noqa: E402


def _run(tokens, measured, predicted, evals=(), compute=None):
    measured = list(measured)
    compute = compute or [[0.8 * m, 0.7 * m] for m in measured]
    return {"tokens": tokens, "steps": len(measured), "micro_batches": 2 * len(measured),
            "measured_step_s": measured, "predicted_step_s": list(predicted),
            "compute_s": np.sum(compute, axis=0).tolist(),
            "wait_s": (np.array(measured)[:, None] - np.array(compute)).sum(axis=0).tolist(),
            "mean_compute_s": float(np.mean(compute, axis=1).sum()),
            "imbalance": 1.1, "plan_ABR": 0.1, "pad_ratio": 0.0, "evals": list(evals), "drift": 1.0}


def test_speedups_errors_and_time_to_quality_follow_their_definitions():
    runs = {
        # isf: 1000 tokens in 10 s; prediction 8 s; final held-out loss 5.0 and 5.2 (mean 5.1)
        "isf": [_run(1000, [5, 5], [4, 4], [(5, 1, 5.5), (10, 2, 5.0)]),
                _run(1000, [5, 5], [4, 4], [(5, 1, 5.6), (10, 2, 5.2)])],
        # hbp: the same tokens in 8 s (1.25x), predicted 6 s (1.333x: +6.7% error); reaches 5.1 at 4 s, then 8 s
        "hbp": [_run(1000, [4, 4], [3, 3], [(4, 1, 5.05), (8, 2, 4.9)]),
                _run(1000, [4, 4], [3, 3], [(4, 1, 5.3), (8, 2, 5.0)])],
        "bfd": [_run(1000, [6, 4], [4, 4], [(6, 1, 5.4), (10, 2, 5.3)])] * 2,  # never reaches 5.1
    }
    figs = report.strategy_figures(runs)
    assert figs["isf"]["measured_speedup"] == pytest.approx(1.0)
    assert figs["hbp"]["measured_speedup"] == pytest.approx(1.25)
    assert figs["hbp"]["predicted_speedup"] == pytest.approx(8 / 6)
    assert figs["hbp"]["speedup_error"] == pytest.approx((8 / 6) / 1.25 - 1)
    assert figs["hbp"]["median_abs_step_error"] == pytest.approx(0.25)
    assert figs["isf"]["balance_bound"] == pytest.approx(1 / 0.75)  # ranks computing 0.8 and 0.7 of each step
    assert figs["hbp"]["best_baseline"] == "bfd" and figs["hbp"]["speedup_over_best_baseline"] == pytest.approx(1.25)
    assert figs["isf"]["heldout_mean"] == pytest.approx(5.1) and figs["isf"]["heldout_std"] == pytest.approx(0.1)
    # mean over seeds of the first evaluation at or below 5.1: (4 + 8) / 2 = 6 s, over isf's 10 s
    assert figs["hbp"]["time_to_isf_loss_s"] == pytest.approx(6.0)
    assert figs["hbp"]["time_to_isf_loss_over_isf_time"] == pytest.approx(0.6)
    assert figs["bfd"]["time_to_isf_loss_s"] is None and figs["bfd"]["seeds_reaching_isf_loss"] == 0
    rows = {what.split(" (")[0]: (value, met) for what, value, met in report.targets(figs, None)}
    assert rows["hbp tokens/s >= 1.25x isf"] == (pytest.approx(1.25), True)
    assert rows["hbp reaches isf's final loss in <= 0.8x isf's time"] == (pytest.approx(0.6), True)
    assert rows["hbp held-out loss <= isf mean + std"][1] is True  # 4.95 <= 5.2
    text = report.table(figs)
    assert "never" in text and all(name in text for name in runs)


def test_drift_correction_scales_each_run_by_its_compute_per_token():
    """The same plan measured while the machine ran at 0.8x and 1.2x its median speed: its ranks' compute per token
    says so, and the corrected step times agree; what the plan itself adds to its steps (waiting) stays."""
    base = _run(1000, [4, 4], [4, 4], compute=[[3, 3], [3, 3]])
    slow = _run(1000, [4.8, 4.8], [4, 4], compute=[[3.6, 3.6], [3.6, 3.6]])
    fast = _run(1000, [3.2, 3.2], [4, 4], compute=[[2.4, 2.4], [2.4, 2.4]])
    assert report.set_drift([base, slow, fast]) == pytest.approx(6 / 1000)
    assert [r["drift"] for r in (base, slow, fast)] == pytest.approx([1.0, 1.2, 0.8])
    figs = report.strategy_figures({"isf": [base], "hbp": [slow, fast]})
    assert figs["hbp"]["measured_speedup"] == pytest.approx(1.0) and figs["hbp"]["drift"] == pytest.approx([1.2, 0.8])
    assert figs["hbp"]["raw_tokens_per_s"] == pytest.approx(2000 / 16) and figs["hbp"]["balance_bound"] == \
        pytest.approx(16 / 12)


def test_the_profilers_groups_are_judged_against_the_fastest_configuration():
    configs = {"1024:1,8192:1": _run(1000, [4, 4], [1, 1]), "8192:1": _run(1000, [5, 3], [1, 1]),
               "512:1,8192:1": _run(1000, [3, 4], [1, 1])}
    groups = report.group_figures(configs)
    assert groups["chosen"] == "1024:1,8192:1" and groups["fastest"] == "512:1,8192:1"
    assert groups["chosen_over_fastest"] == pytest.approx(7 / 8)
    figs = report.strategy_figures({"isf": [configs["8192:1"]], "hbp": [configs["1024:1,8192:1"]]})
    rows = report.targets(figs, groups)
    assert rows[-1][0].startswith("profiler's groups within 5% of the fastest of 3") and rows[-1][2] is False


def test_group_configurations_start_with_the_profilers_and_never_repeat():
    chosen = [{"pack_len": 2048, "sp": 1}, {"pack_len": 8192, "sp": 1}]
    configs = bench.group_configs(chosen, 8192, 3)
    assert list(configs) == ["2048:1,8192:1", "8192:1", "512:1,8192:1"]  # 8192/4 is the profiler's: skipped
    assert configs["2048:1,8192:1"] == "auto" and configs["8192:1"] == "8192:1"
    assert list(bench.group_configs([{"pack_len": 8192, "sp": 1}], 8192, 3)) == ["8192:1", "2048:1,8192:1",
                                                                                 "512:1,8192:1"]


@pytest.mark.slow
@pytest.mark.full
def test_quick_run_trains_every_strategy_on_the_same_samples_and_its_figures_agree(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(REPO))
    # Three of the five strategies keep the suite's time down; each of them trains, the others plan in their tests.
    strategies = ["isf", "kk", "hbp"]
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--work", str(tmp_path), "--strategies",
                           ",".join(strategies)], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "quick" / "results.json").read_text())
    figs, runs = results["strategies"], results["runs"]
    from hbp_train.planning import ALL_STRATEGIES

    assert set(figs) == set(strategies) and set(strategies) <= set(ALL_STRATEGIES)
    tokens = {r["tokens"] for seeds in runs.values() for r in seeds}
    assert len(tokens) == 1  # every strategy trained the same samples
    for name, seeds in runs.items():
        for r in seeds:
            assert len(r["measured_step_s"]) == len(r["predicted_step_s"]) == r["steps"] > 0
            assert all(t > 0 for t in r["measured_step_s"] + r["predicted_step_s"])
            assert len(r["compute_s"]) == len(r["wait_s"]) == 2 and r["evals"]  # two ranks; held-out evaluated
        f = figs[name]
        raw = sum(sum(r["measured_step_s"]) for r in seeds)
        corrected = sum(sum(s / r["drift"] for s in r["measured_step_s"]) for r in seeds)  # the machine's drift out
        assert f["raw_tokens_per_s"] == pytest.approx(sum(r["tokens"] for r in seeds) / raw)
        assert f["measured_tokens_per_s"] == pytest.approx(sum(r["tokens"] for r in seeds) / corrected)
        assert f["measured_speedup"] == pytest.approx(f["measured_tokens_per_s"] / figs["isf"]["measured_tokens_per_s"])
    assert figs["isf"]["measured_speedup"] == pytest.approx(1.0)
    groups = results["group_configs"]
    assert len(groups["tokens_per_s"]) == bench.SETUPS["quick"].group_configs
    assert groups["chosen"] == next(iter(groups["tokens_per_s"]))
    assert results["validation"]["one_doc_over_short_docs"] > 0 and results["profile_groups"]
    assert (tmp_path / "quick" / "speed.png").stat().st_size > 0
    for name in figs:
        assert f"\n{name:<8}" in proc.stdout
    assert "targets:" in proc.stdout and "MEASURED on this CPU" in proc.stdout
