"""Speed measured, not simulated: raw wall-clock tokens/s of every strategy trained by the real trainer on this
machine's CPU at equal optimisation, at two step budgets, paired round by round against isf; the simulator's
absolute prediction for the same plans; held-out loss and time to quality per seed; and a replay of 8 and 32 ranks.

    python bench/speed/bench_speed.py            # the full run: 35-40 minutes on 2 idle cores (resumable: rerun it)
    python bench/speed/bench_speed.py --quick    # the same chain on a small set, 1 round (tests/test_bench_speed.py)

The full run writes its results file into the repository, bench/results/bench_speed.json (with the commit it ran on
and whether the tree had changes), and renders docs/benchmarks.md's measured table from it
(bench/speed/results_table.py): commit both. ``--quick`` writes only under WORK.

One command, the CPU: 2 processes (gloo, one torch thread each: 2 cores), the real trainer through
``hbp_train.launch`` with a real DeepSpeed engine (ZeRO-2, fp32). In order (bench/speed/chain.py; every stage prints
one line when it starts):

1. data: real text from the Python standard library (data_tools.make_code_data): a pool of samples, from which the
   measured runs' set and, apart from it, a calibration set are drawn; its held-out split (other modules) is
   packed for 2 ranks as the eval set (generated demo chats where the code data tool is missing);
2. calibrate: ``python -m hbp_train.perf.calibrate --device cpu --threads 1 --procs 2`` for the bench's model shape
   (reused from WORK when made for the same shape, threads and processes; ``--recalibrate`` makes it anew), and
   ``--validate``: the cost model's error on whole packs;
3. profile: ``python -m hbp_train.profiler profile.device=cpu`` (the real model; sp=2 measured by 2 ranks) picks the
   packing groups (``--quick``: its analytic back-end on the CPU calibration, which measures nothing);
4. step costs: a training run of the calibration set (hbp, samples no measured run trains on), then
   ``python -m hbp_train.perf.step_costs``: the simulator's per-pack, per-micro-batch, per-step and data costs on
   this machine, fitted there and never on the runs they predict;
5. runs, per budget (1 long pack per rank per step, and 4): every strategy (isf, sorted, bfd, kk, hbp; those this
   checkout has) planned by ``data_tools.pack --groups auto`` (hbp balancing the calibrated pack time; kk on
   veRL's workload, as veRL runs it) for every round, the plans checked for equal optimisation (the same step count
   and real tokens; every step within one slot of the target: the bench stops otherwise), then trained one epoch,
   round by round: in each round the other strategies in rotated order around isf in the middle, every run seeded
   with the round (model weights and plan). The one-pack budget evaluates held-out loss (time to quality, on the
   clock of the timed steps: the warm-up step counts zero seconds);
6. replay (bench/speed/replay.py): at W = 8 and 32 the same pool planned by every strategy, a few drawn steps' every
   rank's packs timed through the real model, each step's slowest rank plus the modelled rest;
7. report (bench/speed/report.py): per budget raw tokens/s, the paired speed-up over isf (median and spread over
   rounds), hbp over each baseline, the balance ratio, the simulator's predicted absolute tokens/s and step time
   and their errors, held-out loss and time to quality per seed; the replay beside the simulator; the issue's
   targets, met or missed in numbers. WORK/results.json and a plot; the full run also bench/results/bench_speed.json
   and docs/benchmarks.md's measured table (bench/speed/results_table.py: bold only beyond the runs' noise,
   bench/speed/verdicts.py).

Resumable: every finished run and the replay's times are kept under WORK with the settings that made them; a rerun
reuses them (``--fresh`` measures everything again). The model: a Llama of ``SETUPS[...].shape`` whose
one-document pack of the longest length costs several times a pack of short samples, as an 8B model's 128K pack
does on an H100 (``--validate``'s packs of 1 and of the most samples: printed). Figures are only worth reporting
from a run that had the machine to itself (``flock /tmp/hbp-cpu.lock`` on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import results_file  # noqa: E402
from bench.speed import chain  # noqa: E402
from bench.speed import replay  # noqa: E402
from bench.speed import results_table  # noqa: E402
from bench.speed import report  # noqa: E402

STRATEGIES = ("isf", "sorted", "bfd", "kk", "hbp")


@dataclass(frozen=True)
class Budget:
    """One step budget of the runs."""

    packs_per_rank: int
    """Real tokens per optimizer step: this many long packs (max_len) per rank, times the ranks."""
    samples: int
    """The measured runs' samples at this budget: enough for Setup.min_timed_steps optimizer steps after the first
    (warm-up) step at this step size (a smaller set is a subset of a larger one)."""
    rounds: int
    """Rounds of every strategy (round r: plan and model seed r)."""
    evaluate: bool
    """Held-out loss during the runs (time to quality)."""


@dataclass(frozen=True)
class Setup:
    """One size of the bench."""

    shape: chain.Shape
    """The trained Llama's shape."""
    max_len: int
    """Longest sample and the largest pack (the profiler's max_len)."""
    pool_samples: int
    """Training-split samples asked of the data tool: the replay plans them all."""
    calib_samples: int
    """The step-cost calibration run's samples, drawn from the pool apart from the runs'."""
    heldout_tokens: int
    """Tokens of the held-out eval set (the first held-out samples)."""
    budgets: tuple
    """The step budgets (Budget), the first one evaluated (time to quality)."""
    eval_every: int
    """Held-out loss every this many steps (and after the last)."""
    calib_iters: int
    calib_rounds: int
    """Timed iterations per calibration point, and rounds through all points (each point's median is kept)."""
    min_len: int
    """The profiler's shortest candidate pack length."""
    profile_dry_run: bool
    """The profiler's analytic back-end on the CPU calibration instead of measuring the real model."""
    replay_worlds: tuple
    """The replay's world sizes W (one long pack per rank per step)."""
    replay_budget_s: float
    """Seconds the replay's timing may take by the calibrated cost model: steps are drawn until it is spent."""
    replay_repeats: int
    """Times every replayed pack is run (its fastest kept): the budget pays for all of them."""
    min_timed_steps: int
    """The fewest optimizer steps a run times (after its warm-up step): fewer stops the bench."""
    wall_limit_s: int
    """The bench's own time target."""


SETUPS = {
    # 200 samples make 11-12 steps of one long pack per rank; four packs per rank need 760 for 11.
    "full": Setup(chain.Shape(hidden=64, layers=4, heads=4, kv_heads=2, ffn=176), max_len=8192, pool_samples=3000,
                  calib_samples=200, heldout_tokens=16384,
                  budgets=(Budget(1, 200, 3, True), Budget(4, 760, 3, False)), eval_every=2, calib_iters=2,
                  calib_rounds=3, min_len=512, profile_dry_run=False, replay_worlds=(8, 32), replay_budget_s=420,
                  replay_repeats=2, min_timed_steps=10, wall_limit_s=3600),
    "quick": Setup(chain.Shape(hidden=32, layers=2, heads=4, kv_heads=2, ffn=64), max_len=1024, pool_samples=600,
                   calib_samples=60, heldout_tokens=2048,
                   budgets=(Budget(1, 120, 1, True), Budget(4, 120, 1, False)), eval_every=2, calib_iters=1,
                   calib_rounds=1, min_len=256, profile_dry_run=True, replay_worlds=(8, 32), replay_budget_s=5,
                   replay_repeats=1, min_timed_steps=1, wall_limit_s=180),
}


def round_order(strategies: list, round_index: int) -> list:
    """The run order of one round: the other strategies rotated by the round, isf in the middle (each of them is
    then at most half a round from its isf run, and none is always the nearest)."""
    others = [s for s in strategies if s != "isf"]
    k = round_index % len(others) if others else 0
    others = others[k:] + others[:k]
    half = len(others) // 2
    return others[:half] + ["isf"] + others[half:]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the small setup: 1 round, a small set, the analytic profile")
    p.add_argument("--work", default=str(REPO / "bench" / "out" / "speed"),
                   help="data, calibration, runs and results (default bench/out/speed, ignored by git)")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"comma-separated (default {','.join(STRATEGIES)}; those this checkout lacks are skipped)")
    p.add_argument("--recalibrate", action="store_true", help="measure the calibration anew even if WORK holds one")
    p.add_argument("--no-page", action="store_true",
                   help="the full run: write bench/results/bench_speed.json but leave docs/benchmarks.md's table "
                        "as it is")
    p.add_argument("--fresh", action="store_true",
                   help="measure every run, the step costs and the replay anew (default: reuse what WORK holds "
                        "from an earlier bench with the same settings)")
    args = p.parse_args(argv)
    from hbp_train.planning import ALL_STRATEGIES

    strategies = [s for s in args.strategies.split(",") if s]
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        p.error(f"unknown strategy {unknown[0]!r} (of {', '.join(STRATEGIES)})")
    missing = [s for s in strategies if s not in ALL_STRATEGIES]
    strategies = [s for s in strategies if s in ALL_STRATEGIES]
    if "isf" not in strategies or "hbp" not in strategies:
        p.error("--strategies needs isf and hbp (the figures are ratios of hbp and the baselines over isf)")
    name = "quick" if args.quick else "full"
    setup = SETUPS[name]
    work = Path(args.work) / name
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    origin = results_file.provenance()  # before the run writes anything into the tree

    def stage(text):
        print(f"[{time.time() - t0:6.0f}s] {text}", flush=True)

    stage("data")
    data = chain.make_data(work / "data", setup.max_len, setup.pool_samples, [b.samples for b in setup.budgets],
                           setup.calib_samples, setup.heldout_tokens)
    shape_json = setup.shape.json(data.vocab())
    stage(f"calibrate ({'anew' if args.recalibrate else 'reused if made for this shape'})")
    calibration, validation = chain.calibrate(work, shape_json, setup.max_len, setup.calib_iters,
                                              setup.calib_rounds, reuse=not args.recalibrate)
    from hbp_train.perf.cost_model import CostModel
    from hbp_train.planning.simulator import SimConfig

    stage("profile")
    profile = chain.profile(work, data, setup.shape, calibration, setup.max_len, setup.min_len, setup.profile_dry_run,
                            reuse=not (args.fresh or args.recalibrate))
    stage("step costs: a training run of the calibration set, then the fit")
    costs_file = chain.fit_step_costs(work, data, setup.shape, calibration, work / "profile.json", setup.max_len,
                                      reuse=not (args.fresh or args.recalibrate))
    model = CostModel.from_calibration(costs_file)
    sim_config = SimConfig(zero_stage=chain.ZERO_STAGE)
    # What a finished run's figures depend on (the replay's settings are not among them: its times are stamped with
    # its own jobs, so changing the replay never re-measures the runs).
    run_setup = replace(setup, replay_worlds=(), replay_budget_s=0, replay_repeats=0)
    fingerprint = {"setup": repr(run_setup), "calibration": costs_file.read_text(), "groups": profile["groups"]}
    runs, steps = {}, {}
    total = sum(len(strategies) * b.rounds for b in setup.budgets)
    count = iter(range(1, total + 1))
    for budget in setup.budgets:
        key = budget.packs_per_rank
        stage(f"plans, {key} pack(s) per rank per step ({key * chain.NPROC * setup.max_len} tokens): "
              f"{budget.rounds} round(s) x {len(strategies)} strategies")
        runs[key], steps[key] = _measure_budget(work, data, setup, budget, strategies, calibration, model,
                                                sim_config, fingerprint, args.fresh, stage, (count, total))
    budgets = {key: report.budget_figures(r) for key, r in runs.items()}
    stage(f"replay: W={', '.join(map(str, setup.replay_worlds))}, steps drawn for about {setup.replay_budget_s:.0f}s "
          "of timing")
    replayed = _replay(work, data, setup, strategies, profile, model, sim_config, shape_json, fingerprint, args.fresh)
    replay_figs = report.replay_figures(replayed)
    first = setup.budgets[0].packs_per_rank
    wall = time.time() - t0
    results = {"setup": name, "provenance": origin, "describe": chain.describe(setup.shape, data),
               "strategies": strategies, "skipped_strategies": missing, "calibration": costs_file.name,
               "validation": _validation(validation),
               "step_costs": json.loads(costs_file.read_text())["step_costs"], "profile_groups": profile["groups"],
               "equal_steps": steps, "budgets": budgets, "replay": replay_figs, "runs": runs,
               "targets": [list(t) for t in report.targets(budgets, replay_figs, steps, first)], "wall_s": wall}
    (work / "results.json").write_text(json.dumps(results, indent=1, default=float))
    report.plot(budgets, runs, replay_figs, work / "speed.png")
    print(summary(results, setup, model))
    print(f"\nwrote {work / 'results.json'} and {work / 'speed.png'}; bench wall time {wall:.0f}s (target "
          f"{setup.wall_limit_s}s: {'met' if wall <= setup.wall_limit_s else 'MISSED'})")
    if name == "full":
        kept = results_file.write_results(results_table.NAME, results, {work: "WORK"})
        print(f"wrote {kept.relative_to(REPO)} (commit {origin['commit']}"
              + (", with uncommitted changes" if origin["dirty"] else "") + ")")
        if not args.no_page:
            results_table.main(["--write"])
        if origin["dirty"] or (origin["machine"]["load_1min"] or 0) > 0.5:
            print("note: the tree had uncommitted changes or the machine was busy when the run started "
                  f"(load {origin['machine']['load_1min']}): the page will say so; figures are worth committing "
                  "only from a clean tree on an idle machine")
    return 0


def _measure_budget(work, data, setup, budget, strategies, calibration, model, sim_config, fingerprint, fresh,
                    stage, progress) -> tuple[dict, dict]:
    """Every strategy's plan of every round at one budget, checked for equal optimisation, then trained round by
    round (round_order); a run an earlier bench made with the same settings is reused. ``progress``: (the runs'
    counter, their number). Returns ({strategy: [figures per round]}, the equal-steps check)."""
    from hbp_train.planning.simulator import simulate

    key = budget.packs_per_rank
    shards = {(s, r): work / "shards" / f"b{key}-{s}-r{r}" for r in range(budget.rounds) for s in strategies}
    plans = {(s, r): chain.plan(data.train_set(budget.samples), shards[s, r], s, r, "auto", calibration,
                                work / "profile.json", key * chain.NPROC * setup.max_len) for s, r in shards}
    steps = report.check_equal_steps(
        {s: [report.step_tokens(plans[s, r]) for r in range(budget.rounds)] for s in strategies},
        chain.NPROC, setup.max_len)
    timed_steps = next(iter(steps.values()))["steps"] - report.WARMUP_STEPS
    if timed_steps < setup.min_timed_steps:
        raise SystemExit(f"bench_speed: {key} pack(s) per rank make {timed_steps} timed optimizer steps of "
                         f"{budget.samples} samples, fewer than {setup.min_timed_steps}: raise Budget.samples")
    runs = {s: [] for s in strategies}
    for r in range(budget.rounds):
        for s in round_order(strategies, r):
            done = next(progress[0])
            run_dir = work / "runs" / f"b{key}-{s}-r{r}"
            stamp = {**fingerprint, "packs_per_rank": key, "strategy": s, "round": r, "evaluate": budget.evaluate}
            figures = None if fresh else _reused(run_dir, stamp)
            stage(f"run {done}/{progress[1]}: {key} pack(s)/rank, round {r + 1}/{budget.rounds}, {s}"
                  + (" (reused from an earlier bench)" if figures else ""))
            if figures is None:
                rows = chain.train(shards[s, r], data, setup.shape, run_dir / "train", r,
                                   setup.eval_every if budget.evaluate else 0)
                figures = {**report.run_figures(plans[s, r], rows, simulate(plans[s, r], model, sim_config)),
                           "strategy": s, "round": r, "seed": r, "order": done}
                (run_dir / "figures.json").write_text(json.dumps({"stamp": stamp, "figures": figures}))
            shutil.rmtree(shards[s, r], ignore_errors=True)
            runs[s].append(figures)
    return runs, steps


def _reused(run_dir: Path, stamp: dict):
    """An earlier bench's figures of this run, if it was made with the same settings; else None."""
    path = run_dir / "figures.json"
    if path.is_file():
        saved = json.loads(path.read_text())
        if saved.get("stamp") == stamp:
            return saved["figures"]
    return None


def _replay(work, data, setup, strategies, profile, model, sim_config, shape_json, fingerprint, fresh) -> dict:
    """Per W and strategy, the drawn steps' tokens, replayed and simulated seconds (bench/speed/replay.py)."""
    from hbp_train.perf.cost_model import CostModel
    from hbp_train.planning.simulator import simulate

    from hbp_train.planning.simulator import plan_pack_seconds

    lengths = data.lengths("pool")
    layer_model = CostModel.from_calibration(work / "calibration.json")  # the planner's cost, as in the runs
    plans = {w: replay.plan_all(lengths, strategies, w, profile["groups"], layer_model, 1, seed=0)
             for w in setup.replay_worlds}
    seconds = {w: {s: plan_pack_seconds(p, layer_model, sim_config) for s, p in by.items()} for w, by in plans.items()}
    drawn = replay.draw_steps(plans, seconds, setup.replay_budget_s / setup.replay_repeats, chain.NPROC, seed=0)
    jobs = list({job["key"]: job for w in plans for job in replay.jobs_for(plans[w], drawn[w])}.values())
    stamp = {**fingerprint, "repeats": setup.replay_repeats, "jobs": [j["key"] for j in jobs]}
    saved = work / "replay" / "times.json"
    times = None
    if not fresh and saved.is_file() and json.loads(saved.read_text()).get("stamp") == stamp:
        times = json.loads(saved.read_text())["times"]
    if times is None:
        times = replay.time_jobs(jobs, data.pool, shape_json, work / "replay", chain.NPROC, chain.env(),
                                 setup.replay_repeats)
        saved.write_text(json.dumps({"stamp": stamp, "times": times}))
    out = {}
    for world, by_strategy in plans.items():
        out[world] = {}
        for s, plan in by_strategy.items():
            measured = replay.measured_pack_seconds(plan, times)
            sim = simulate(plan, model, sim_config)
            steps = drawn[world][s]
            out[world][s] = {"tokens": report.step_tokens(plan)[steps].tolist(), "plan_steps": plan.num_optimizer_steps,
                             "replayed_s": replay.replay_step_seconds(plan, sim, steps, measured,
                                                                      model.step_costs).tolist(),
                             "simulated_s": sim.step_seconds[steps].tolist(),
                             "plan_simulated_tokens_per_s": sim.summary()["simulated_tokens_per_second"]}
    return out


def _validation(val: dict) -> dict:
    """The calibration's whole-pack check and the cost ratio it measured: a pack of one max-length document over
    the pack of the most samples."""
    packs = val["packs"]
    one = next(p for p in packs if p["num_samples"] == 1)
    most = max(packs, key=lambda p: p["num_samples"])
    return {"mean_abs_error": val["mean_abs_error"], "max_abs_error": val["max_abs_error"],
            "rounds": val.get("rounds"),
            "packs": [{k: p[k] for k in ("num_samples", "measured_s", "predicted_s", "error")} for p in packs],
            "one_doc_over_short_docs": one["measured_s"] / most["measured_s"], "short_docs": most["num_samples"]}


def summary(results: dict, setup: Setup, model) -> str:
    val, d, costs = results["validation"], results["describe"], results["step_costs"]
    fit = costs.get("fit", {})
    lines = [f"\nMEASURED on this CPU ({d['nproc']} gloo ranks x {d['threads']} thread, real trainer, ZeRO-2 fp32, "
             f"data: {d['data']}) beside PREDICTED (simulator: CPU calibration, its step costs, ZeRO-2 collectives)",
             f"model {model.shape.name}: a one-document {setup.max_len}-token pack costs "
             f"{val['one_doc_over_short_docs']:.2f}x a pack of {val['short_docs']} short samples (measured); "
             f"calibration vs whole packs: mean |error| {100 * val['mean_abs_error']:.1f}%, max "
             f"{100 * val['max_abs_error']:.1f}%"
             + (f" (the same pack's rounds lay up to {val['rounds']['max_spread']:.2f}x apart: this machine's timing "
                "noise)" if val.get("rounds") else ""),
             f"{model.step_costs.note()}; fit on {fit.get('steps')} steps of a run of other samples: median error "
             f"{100 * fit.get('median_step_error', float('nan')):.1f}% per step there",
             "groups (profiler): " + ", ".join(f"{g['pack_len']}:{g['sp']}" for g in results["profile_groups"])]
    for key, figs in results["budgets"].items():
        steps = results["equal_steps"][key]
        one = next(iter(steps.values()))
        worst = ", ".join(f"{n} {s['worst_over_target']:.2f}" for n, s in steps.items())
        lines += ["", f"{key} long pack(s) per rank per step: {one['steps']} optimizer steps, target {one['target']:.0f} "
                      f"real tokens a step (checked: the same step count and total for every strategy, every step "
                      f"within one slot, {d['nproc'] * setup.max_len} tokens, of the target; worst step's tokens over "
                      f"the target: {worst}); {figs['isf']['rounds']} round(s)",
                  report.budget_table(figs, steps)]
        hbp = figs.get("hbp", {})
        over = [f"{b} {hbp[f'over_{b}']['median']:.3f}x [{hbp[f'over_{b}']['min']:.3f}-{hbp[f'over_{b}']['max']:.3f}]"
                for b in report.BASELINES if f"over_{b}" in hbp]
        if over:
            lines.append("hbp over each baseline (raw tokens/s, paired by round): " + ", ".join(over)
                         + f"; the best baseline: {hbp['best_baseline']}")
    lines += ["", "columns: worst = the step farthest from the target, in long packs; mb = micro-batches (slots) of "
                  "a run; raw tok/s = real tokens of the timed steps (every step but the first, the warm-up) over the "
                  "trainer's summed step times (nothing divided out), median over rounds; "
                  "x isf (paired) = median [min-max] over rounds of the round's tokens/s over isf's in the same "
                  "round; balance = isf's step time over its ranks' mean compute, over this strategy's (how much "
                  "less it waits; not a throughput); pred = the simulator's absolute prediction; err = measured "
                  "time over predicted - 1; step err = median per-step |error|; s/step = mean measured and "
                  "predicted seconds; data = share of step time loading data; t to isf loss = per seed, the time "
                  "to reach isf's final loss of that seed over isf's own (median of the seeds that reached it; k/n reached: "
                  "the others never did); held-out loss = mean ± sample SD over seeds"]
    if results["replay"]:
        lines += ["", "REPLAY: measured compute, modelled waiting (not a cluster run): every rank's packs of the drawn "
                      "steps timed one after another on this CPU through the real model; a step = its slots' slowest "
                      "rank + the step costs and ZeRO-2 collectives at W as the simulator models them",
                  report.replay_table(results["replay"])]
    if results["skipped_strategies"]:
        lines.append(f"not in this checkout: {', '.join(results['skipped_strategies'])}")
    lines.append("\ntargets:")
    for what, value, met in results["targets"]:
        shown = "n/a" if value is None else f"{value:.3f}"
        lines.append(f"  {'met   ' if met else 'MISSED'} {what}: {shown}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
