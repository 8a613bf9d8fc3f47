"""Fit the simulator's step costs (``cost_model.StepCosts``) from a training run of the real trainer: what its steps
took beyond what the cost model predicts for their packs.

    python -m hbp_train.perf.step_costs --run RUN_DIR --plan PLAN --calibration CAL --out CAL_WITH_COSTS \\
        [--zero-stage 2] [--skip-steps 1]

Input: the run's ``metrics.jsonl`` (per step the trainer writes ``perf/step_time_s``, ``perf/data_wait_pct`` and
every rank's own compute ``time/compute_s/rank<r>``, its forward/backward without its waits in collectives) and
the plan it trained (its first epoch: global step s ran optimizer step s). The first ``--skip-steps`` steps (the
warm-up: allocations, first calls) are left out. Three least-squares fits, each of its own measured quantity:

1. compute: rank r's compute in step s = compute_scale x (the cost model's time of the packs it ran) + pack_s x
   (the packs it ran, the trainer's dummies for empty ones included);
2. data: the data time of step s (rank 0's) = data_step_s + data_micro_batch_s x (its micro-batches);
3. the rest: step time - data time - the step's slots as the simulator takes them with fit 1's terms (each slot
   its slowest replica) - the collectives and optimizer step ``--zero-stage`` models = step_s + micro_batch_s x
   (micro-batches).

The per-micro-batch terms need steps of different micro-batch counts; a run whose steps all have the same count
cannot tell them from the per-step ones, and they are then 0 (the record says the range of counts).

A term that comes out negative (noise on a cost that is about 0) is set to 0 and its fit redone without it. The
output is the calibration with a ``"step_costs"`` entry: the terms, and the fit's record (run, plan, steps used,
the median error of each fit and of the whole step time predicted with them). Fit on a run the predictions are not
checked against: the terms are then a measurement of the machine, not of the runs they predict
(bench/speed/bench_speed.py fits them on a run of data its measured runs do not train on). docs/simulator.md, "Absolute
time".
"""

from __future__ import annotations

import argparse
import json
import sys
from datetime import date
from pathlib import Path

import numpy as np

from hbp_train.common.cli import ArgumentParser, existing_dir, existing_file, existing_path, nonneg_int, output_file
from hbp_train.common.errors import EXIT_USER_ERROR, UserError
from hbp_train.common.outputs import check_output_file, write_output
from hbp_train.perf.cost_model import CostModel, StepCosts
from hbp_train.planning.plan import Plan
from hbp_train.planning.simulator import SimConfig, plan_pack_seconds, simulate

RANK_COMPUTE = "time/compute_s/rank"


def rank_work(plan: Plan, pack_seconds: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per optimizer step and rank, what the plan gives it: (predicted compute seconds [S, W], packs it runs
    [S, W]: every pack of its replica, an empty one too (the trainer's dummy), but under unequal micro-batch counts
    only its own), and the micro-batches (slots) of every optimizer step [S]. Rank r runs replica r // sp."""
    world = plan.config.world_size
    opt = plan.optimizer_steps()
    steps = plan.num_optimizer_steps
    compute, packs, micro = np.zeros((steps, world)), np.zeros((steps, world)), np.zeros(steps)
    rank = np.arange(world)
    runs = np.diff(plan.pack_ptr) > 0 if plan.unequal_micro_batches else np.ones(plan.num_packs, bool)
    for p in range(plan.num_steps):
        group = plan.config.groups[plan.step_group[p]]
        slots = plan.step_packs[plan.step_ptr[p]:plan.step_ptr[p + 1]].reshape(-1, plan.config.replicas(
            int(plan.step_group[p])))
        compute[opt[p]] += pack_seconds[slots].sum(axis=0)[rank // group.sp]
        packs[opt[p]] += runs[slots].sum(axis=0)[rank // group.sp]
        micro[opt[p]] += len(slots)
    return compute, packs, micro


def nonneg_lstsq(columns: dict, target: np.ndarray) -> dict:
    """Least squares of ``target`` on the named ``columns``, every coefficient >= 0: a negative one is set to 0 and
    the rest fitted again. Columns the run cannot tell apart (a micro-batch count that never varies is the per-step
    constant again) keep the first of them, the later ones 0. Returns {name: coefficient}."""
    names = list(columns)
    while names and np.linalg.matrix_rank(np.column_stack([columns[n] for n in names])) < len(names):
        names.pop()
    while True:
        matrix = np.column_stack([columns[n] for n in names]) if names else np.zeros((len(target), 0))
        coef = np.linalg.lstsq(matrix, target, rcond=None)[0] if names else np.zeros(0)
        if not names or (coef >= 0).all():
            return {**{n: 0.0 for n in columns}, **dict(zip(names, map(float, coef)))}
        names.pop(int(np.argmin(coef)))


def fit_step_costs(plan: Plan, rows: list, model: CostModel, zero_stage: int | None = None,
                   skip_steps: int = 1, source: str = "fit") -> tuple[StepCosts, dict]:
    """The step costs of the run whose metrics rows are ``rows`` (module docstring) and the fit's record."""
    base = SimConfig(zero_stage=zero_stage, step_costs=StepCosts())
    pack_s = plan_pack_seconds(plan, model, base)
    compute, packs, micro = rank_work(plan, pack_s)
    rows = [r for r in rows if "perf/step_time_s" in r][:plan.num_optimizer_steps]  # the first epoch
    keep = np.arange(skip_steps, len(rows))
    if len(keep) < 3:
        raise UserError(f"the run has {len(rows)} steps: the fit needs at least {skip_steps + 3} (--skip-steps "
                        f"{skip_steps} and 3 more); train more steps of the plan")
    world = plan.config.world_size
    step_time = np.array([rows[i]["perf/step_time_s"] for i in keep], np.float64)
    data_time = np.array([rows[i]["perf/data_wait_pct"] for i in keep], np.float64) / 100 * step_time
    measured = np.array([[rows[i].get(f"{RANK_COMPUTE}{r}") for r in range(world)] for i in keep], np.float64)
    if np.isnan(measured).all():
        raise UserError(f"the run's metrics have no per-rank compute ({RANK_COMPUTE}<r>): on a GPU set "
                        "logging.comm_wait_every=1 for the run the fit reads")
    timed = ~np.isnan(measured)  # a GPU times a rank's compute on sampled steps only
    fit1 = nonneg_lstsq({"compute_scale": compute[keep][timed], "pack_s": packs[keep][timed]}, measured[timed])
    if not fit1["compute_scale"] > 0:
        raise UserError("the run's compute does not grow with the cost model's prediction of its packs: was the "
                        "calibration made for this model and machine?")
    m = micro[keep]
    fit2 = nonneg_lstsq({"data_step_s": np.ones(len(keep)), "data_micro_batch_s": m}, data_time)
    slots = simulate(plan, model, SimConfig(zero_stage=zero_stage, step_costs=StepCosts(
        compute_scale=fit1["compute_scale"], pack_s=fit1["pack_s"]))).step_seconds[keep]
    fit3 = nonneg_lstsq({"step_s": np.ones(len(keep)), "micro_batch_s": m}, step_time - data_time - slots)
    costs = StepCosts(**fit1, **fit2, **fit3, source=source)
    predicted = simulate(plan, model, SimConfig(zero_stage=zero_stage, step_costs=costs)).step_seconds[keep]
    fitted_compute = fit1["compute_scale"] * compute[keep] + fit1["pack_s"] * packs[keep]
    data_fit = fit2["data_step_s"] + fit2["data_micro_batch_s"] * m

    def median_error(got, want):
        return float(np.median(np.abs(got / np.maximum(want, 1e-12) - 1)))

    record = {"steps": int(len(keep)), "skipped_steps": int(skip_steps), "zero_stage": zero_stage,
              "micro_batches": [int(m.min()), int(m.max())],
              "world_size": world, "median_compute_error": median_error(fitted_compute[timed], measured[timed]),
              "median_data_error": median_error(data_fit, data_time),
              "median_step_error": median_error(predicted, step_time),
              "measured_step_s": float(step_time.sum()), "predicted_step_s": float(predicted.sum())}
    return costs, record


def read_metrics(run_dir: Path) -> list:
    """The run's metrics.jsonl rows; UserError naming the file."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise UserError(f"{run_dir}: no metrics.jsonl (the trainer writes it into train.out_dir)")
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise UserError(f"{path}:{n}: invalid JSON ({exc.msg})") from None
    return rows


def read_plan(path: str) -> Plan:
    """A plan file (JSON or .npz) or a --shards folder holding one; UserError naming the path."""
    from hbp_train.planning.plan_npz import load_plan

    p = Path(path)
    if p.is_dir():
        found = [p / name for name in ("plan.json", "plan.npz") if (p / name).is_file()]
        if not found:
            raise UserError(f"{path}: a folder with no plan.json or plan.npz; pass the --shards folder the run trained")
        p = found[0]
    try:
        return load_plan(p)
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{p}: not a plan this code reads ({type(exc).__name__}: {exc})") from None


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m hbp_train.perf.step_costs", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, type=existing_dir, metavar="RUN_DIR",
                   help="the run's train.out_dir (its metrics.jsonl) (required)")
    p.add_argument("--plan", required=True, type=existing_path, metavar="PLAN",
                   help="the plan the run trained: plan.json, plan.npz or its --shards folder (required)")
    p.add_argument("--calibration", required=True, type=existing_file, metavar="JSON",
                   help="the calibration of the machine the run ran on (hbp_train.perf.calibrate) (required)")
    p.add_argument("--out", required=True, type=output_file, metavar="JSON",
                   help="the calibration with its step_costs entry (may be --calibration itself) (required)")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None,
                   help="the run's ZeRO stage: the collectives and optimizer step the simulator models for it are "
                        "taken out of the fitted costs, so simulating with --zero-stage counts them once (default: "
                        "none modelled, the fitted costs hold them)")
    p.add_argument("--skip-steps", type=nonneg_int, default=1,
                   help="the run's first steps to leave out (warm-up) (default 1)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_output_file("--out", args.out, json_key="what", kind="calibration")
        model = CostModel.from_calibration(args.calibration)
        plan = read_plan(args.plan)
        costs, record = fit_step_costs(plan, read_metrics(Path(args.run)), model, args.zero_stage, args.skip_steps,
                                       source=f"fitted on {'/'.join(Path(args.run).resolve().parts[-2:])}, "
                                              f"{date.today().isoformat()}")
        data = json.loads(Path(args.calibration).read_text())
        data["step_costs"] = {**costs.to_dict(), "fit": {"run": str(args.run), "plan": str(args.plan), **record}}
        write_output("--out", args.out, lambda path: path.write_text(json.dumps(data, indent=1)))
    except UserError as exc:
        print(f"step_costs: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(costs.note())
    print(f"fit on {record['steps']} steps: median error compute {100 * record['median_compute_error']:.1f}% (per "
          f"rank and step), data {100 * record['median_data_error']:.1f}%, whole step "
          f"{100 * record['median_step_error']:.1f}%; wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
