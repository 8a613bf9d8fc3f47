"""The step-cost fit (hbp_train/perf/step_costs.py) on made-up runs: metrics rows generated from known costs are
fitted back to those costs; the calibration it writes loads into a CostModel whose simulation predicts the run;
bad input is one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hbp_train.perf.cost_model import CostModel, StepCosts
from hbp_train.perf.step_costs import fit_step_costs, main, nonneg_lstsq, rank_work
from hbp_train.planning import GroupSpec, PlanConfig, make_plan
from hbp_train.planning.simulator import SimConfig, plan_pack_seconds, simulate
from tests.cli_exit import exit_code

TRUE = StepCosts(compute_scale=1.3, pack_s=0.004, micro_batch_s=0.006, step_s=0.05, data_step_s=0.002,
                 data_micro_batch_s=0.001)


def plan_and_model():
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(5.5, 1.1, 300).astype(int) + 1, 4096)
    # hbp mixes its two groups: its steps have 1 to many micro-batches, which the fit needs to tell the per-step
    # from the per-micro-batch cost.
    plan = make_plan(lengths, PlanConfig(world_size=2, groups=[GroupSpec(512, 1), GroupSpec(4096, 1)],
                                         global_tokens=2 * 4096, seed=1))
    model = CostModel.analytic("llama3.2-1b", peak_tflops=50.0, efficiency=0.5)
    return plan, model


def rows_from(plan, model, costs: StepCosts, noise: float = 0.0, seed: int = 0) -> list:
    """metrics.jsonl rows of a run whose steps cost exactly what ``costs`` says (times (1 + noise·N(0,1)))."""
    rng = np.random.default_rng(seed)
    compute, packs, micro = rank_work(plan, plan_pack_seconds(plan, model, SimConfig()))
    step = simulate(plan, model, SimConfig(zero_stage=2, step_costs=costs)).step_seconds
    data = costs.data_step_s + costs.data_micro_batch_s * micro
    jitter = lambda x: x * (1 + noise * rng.standard_normal(np.shape(x)))  # noqa: E731
    rank = jitter(costs.compute_scale * compute + costs.pack_s * packs)
    rows = []
    for s in range(plan.num_optimizer_steps):
        t = float(jitter(step[s]))
        rows.append({"perf/step_time_s": t, "perf/data_wait_pct": 100 * float(jitter(data[s])) / t,
                     **{f"time/compute_s/rank{r}": float(rank[s, r]) for r in range(plan.config.world_size)}})
    return rows


def test_the_fit_recovers_the_costs_a_run_was_made_of():
    plan, model = plan_and_model()
    assert plan.num_optimizer_steps >= 10 and len(set(rank_work(plan, np.ones(plan.num_packs))[2])) > 2
    costs, record = fit_step_costs(plan, rows_from(plan, model, TRUE), model, zero_stage=2, skip_steps=1)
    for name in ("compute_scale", "pack_s", "micro_batch_s", "step_s", "data_step_s", "data_micro_batch_s"):
        assert getattr(costs, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert record["median_step_error"] == pytest.approx(0, abs=1e-9) and record["steps"] == plan.num_optimizer_steps - 1
    # With 3% noise on every measured time: the scale within 5%, the steps' total and each step within a few %.
    noisy, record = fit_step_costs(plan, rows_from(plan, model, TRUE, noise=0.03, seed=2), model, zero_stage=2)
    assert noisy.compute_scale == pytest.approx(1.3, rel=0.05)
    assert record["predicted_step_s"] == pytest.approx(record["measured_step_s"], rel=0.02)
    assert record["median_step_error"] < 0.05


def test_a_cost_that_is_not_there_is_fitted_as_zero_not_negative():
    assert nonneg_lstsq({"a": np.array([1.0, 1, 1]), "b": np.array([1.0, 2, 3])}, np.array([3.0, 2, 1])) == \
        {"a": pytest.approx(2.0), "b": 0.0}
    # Steps that all have 2 micro-batches: the per-micro-batch column is the per-step one twice; all goes to the first.
    assert nonneg_lstsq({"step_s": np.ones(3), "micro_batch_s": np.full(3, 2.0)}, np.array([5.0, 5, 5])) == \
        {"step_s": pytest.approx(5.0), "micro_batch_s": 0.0}
    plan, model = plan_and_model()
    # A run with no costs but compute, measured with 2% noise: every term >= 0 and tiny beside the steps.
    rows = rows_from(plan, model, StepCosts(), noise=0.02, seed=3)
    costs, _ = fit_step_costs(plan, rows, model, zero_stage=2)
    mean_step = np.mean([r["perf/step_time_s"] for r in rows])
    terms = [costs.pack_s, costs.micro_batch_s, costs.step_s, costs.data_step_s, costs.data_micro_batch_s]
    assert min(terms) >= 0 and max(terms) < 0.02 * mean_step, terms


def test_the_cli_writes_a_calibration_the_simulator_then_uses(tmp_path, capsys):
    plan, model = plan_and_model()
    calibration = tmp_path / "calib.json"
    calibration.write_text(json.dumps({"what": "analytic stand-in", "model_shape": "llama3.2-1b",
                                       **_analytic_tables(model)}))
    model = CostModel.from_calibration(calibration)
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows_from(plan, model, TRUE)))
    plan.to_json(tmp_path / "shards" / "plan.json")
    out = tmp_path / "calib_costs.json"
    assert main(["--run", str(run), "--plan", str(tmp_path / "shards"), "--calibration", str(calibration), "--out",
                 str(out), "--zero-stage", "2"]) == 0
    assert "whole step 0.0%" in capsys.readouterr().out
    written = json.loads(out.read_text())
    assert written["what"] == "analytic stand-in" and written["step_costs"]["fit"]["steps"] > 0
    fitted = CostModel.from_calibration(out)
    assert fitted.step_costs.step_s == pytest.approx(TRUE.step_s)
    assert f"fitted on {tmp_path.name}/run" in fitted.step_costs.source
    want = simulate(plan, model, SimConfig(zero_stage=2, step_costs=TRUE)).total_seconds
    assert simulate(plan, fitted, SimConfig(zero_stage=2)).total_seconds == pytest.approx(want)
    # Bad input: one line, exit 2.
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows_from(plan, model, TRUE)[:2]))
    assert exit_code(main, ["--run", str(run), "--plan", str(tmp_path / "shards"), "--calibration",
                            str(calibration), "--out", str(out)]) == 2
    assert "the fit needs at least 4" in capsys.readouterr().err
    (run / "metrics.jsonl").write_text('{"perf/step_time_s": 1}\nnot json\n')
    assert exit_code(main, ["--run", str(run), "--plan", str(tmp_path / "shards"), "--calibration",
                            str(calibration), "--out", str(out)]) == 2
    assert "metrics.jsonl:2: invalid JSON" in capsys.readouterr().err
    assert exit_code(main, ["--run", str(run), "--plan", str(tmp_path), "--calibration", str(calibration), "--out",
                            str(out)]) == 2
    assert "no plan.json or plan.npz" in capsys.readouterr().err
    notes = tmp_path / "notes.json"
    notes.write_text('{"mine": 1}')
    assert exit_code(main, ["--run", str(run), "--plan", str(tmp_path / "shards"), "--calibration",
                            str(calibration), "--out", str(notes)]) == 2
    assert "is not a calibration written by hbp-train" in capsys.readouterr().err


def _analytic_tables(model: CostModel) -> dict:
    """A calibration file's tables from an analytic model (per 32768 tokens)."""
    lens = [128, 1024, 8192]
    return {"linear_fwdbwd_ms_per_32768_tokens": model.linear_fb_per_token * 32768 * 1e3,
            "attention_fwdbwd_ms_32768_tokens_by_doc_len": {
                str(n): float(model.attention_fwdbwd([n])[0] * 32768 / n * 1e3) for n in lens}}
