"""Speed measured, not simulated: every strategy trained by the real trainer on this machine's CPU, over the same
samples, beside the simulator's prediction for the same plans; held-out loss and time to quality.

    python bench/bench_speed.py            # the full run (3 seeds, real text), about 25 minutes on 2 free cores
    python bench/bench_speed.py --quick    # the same chain on a small set, 1 seed (tests/test_bench_speed.py)

One command, one run, the CPU: 2 processes (gloo, one torch thread each: 2 cores), the real trainer through
``hbp_train.launch`` with a real DeepSpeed engine (ZeRO-2, fp32). In order (bench/speed_chain.py):

1. data: real text from the Python standard library (data_tools.make_code_data; its held-out split is other
   modules), or generated demo chats where that tool is missing; the held-out eval set is packed for 2 ranks;
2. calibrate: ``python -m hbp_train.perf.calibrate --device cpu --threads 1 --procs 2`` for the bench's model shape
   (reused from WORK when made for the same shape, threads and processes; ``--recalibrate`` makes it anew), and
   ``--validate``: the cost model's error on whole packs, measured on this CPU;
3. profile: ``python -m hbp_train.profiler profile.device=cpu`` (the real model; sp=2 measured by 2 ranks) picks the
   packing groups (``--quick``: its analytic back-end on the CPU calibration, which measures nothing);
4. plan every strategy (isf, sorted, bfd, kk, hbp; those this checkout has) with ``data_tools.pack --groups auto
   --profile ... --calibration ...`` (hbp balances calibrated pack time) and train each for one epoch of the same
   samples, every seed; hbp also under the other group configurations (speed only, seed 0);
5. report (bench/speed_report.py): per strategy measured tokens/s and speed-up over isf and over the best of
   sorted/bfd/kk, the simulator's prediction for the same plans with the CPU calibration and its error (overall and
   per step), each rank's compute and wait, the live imbalance, held-out loss (mean ± std over seeds) and the
   training time at which each strategy first reaches isf's final held-out loss; the profiler's groups against the
   fastest configuration; the issue's targets, met or missed in numbers. WORK/results.json and a plot.

The model: a Llama of ``SETUPS[...].shape`` whose one-document pack of the longest length costs several times a
pack of short samples, as an 8B model's 128K pack does on an H100; the ratio is measured (``--validate``'s packs
of 1 and of the most samples) and printed. Figures are only worth reporting from a run that had the machine to
itself (``flock /tmp/hbp-cpu.lock`` on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench import speed_chain as chain  # noqa: E402
from bench import speed_report as report  # noqa: E402

STRATEGIES = ("isf", "sorted", "bfd", "kk", "hbp")


@dataclass(frozen=True)
class Setup:
    """One size of the bench."""

    shape: chain.Shape
    max_len: int
    """Longest sample and the largest pack (the profiler's max_len)."""
    num_samples: int
    """Training samples asked of the data tool."""
    heldout_tokens: int
    """Tokens of the held-out eval set (the first held-out samples)."""
    step_tokens: int
    """Tokens per optimizer step (data_tools.pack --global-tokens)."""
    seeds: tuple
    eval_every: int
    """Held-out loss every this many steps (and after the last)."""
    calib_iters: int
    calib_rounds: int
    """Timed iterations per calibration point, and rounds through all points (each point's median is kept)."""
    min_len: int
    """The profiler's shortest candidate pack length."""
    profile_dry_run: bool
    group_configs: int
    """Group configurations timed with hbp (the profiler's first)."""


SETUPS = {
    "full": Setup(chain.Shape(hidden=64, layers=4, heads=4, kv_heads=2, ffn=176), max_len=8192, num_samples=340,
                  heldout_tokens=24576, step_tokens=16384, seeds=(0, 1, 2), eval_every=2, calib_iters=2,
                  calib_rounds=3, min_len=512, profile_dry_run=False, group_configs=3),
    "quick": Setup(chain.Shape(hidden=32, layers=2, heads=4, kv_heads=2, ffn=64), max_len=1024, num_samples=160,
                   heldout_tokens=2048, step_tokens=4096, seeds=(0,), eval_every=2, calib_iters=1, calib_rounds=1,
                   min_len=256, profile_dry_run=True, group_configs=2),
}


def group_configs(chosen: list, max_len: int, count: int) -> dict:
    """Up to ``count`` group configurations, the profiler's first (label -> --groups value): then one group of
    max_len (balance alone, no hierarchy) and short groups of max_len/4 and /16 under it."""
    def label(groups):
        return ",".join(f"{g['pack_len']}:{g['sp']}" for g in groups)

    configs = {label(chosen): "auto"}
    for short in (None, max_len // 4, max_len // 16, max_len // 2):
        groups = ([{"pack_len": short, "sp": 1}] if short else []) + [{"pack_len": max_len, "sp": 1}]
        configs.setdefault(label(groups), label(groups))
        if len(configs) == count:
            break
    return configs


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="the small setup: 1 seed, a small set, the analytic profile")
    p.add_argument("--work", default=str(REPO / "bench" / "out" / "speed"),
                   help="data, calibration, runs and results (default bench/out/speed, ignored by git)")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"comma-separated (default {','.join(STRATEGIES)}; those this checkout lacks are skipped)")
    p.add_argument("--seeds", default=None, help="comma-separated plan and model seeds (default: the setup's)")
    p.add_argument("--recalibrate", action="store_true", help="measure the calibration anew even if WORK holds one")
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
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else list(setup.seeds)
    work = Path(args.work) / name
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()

    def stage(text):
        print(f"[{time.time() - t0:6.0f}s] {text}", flush=True)

    stage("data")
    data = chain.make_data(work / "data", setup.max_len, setup.num_samples, setup.heldout_tokens)
    shape_json = setup.shape.json(data.vocab())
    stage(f"calibrate ({'reused if made for this shape' if not args.recalibrate else 'anew'})")
    calibration, validation = chain.calibrate(work, shape_json, setup.max_len, setup.calib_iters,
                                              setup.calib_rounds, reuse=not args.recalibrate)
    from hbp_train.perf.cost_model import CostModel

    model = CostModel.from_calibration(calibration)
    stage("profile")
    profile = chain.profile(work, data, setup.shape, calibration, setup.max_len, setup.min_len, setup.profile_dry_run)
    configs = group_configs(profile["groups"], setup.max_len, setup.group_configs)
    runs, group_runs = {s: [] for s in strategies}, {}
    for i, seed in enumerate(seeds):
        # Each seed starts with another strategy: a machine that slows down for a while (shared CPUs drift by
        # 10-20% over minutes) then does not always slow the same strategy.
        for strategy in strategies[i % len(strategies):] + strategies[:i % len(strategies)]:
            stage(f"{strategy} seed {seed}: plan, train")
            result = _plan_and_train(work, data, setup, calibration, strategy, seed, "auto", model)
            runs[strategy].append(result)
            if strategy == "hbp" and seed == seeds[0]:
                group_runs[next(iter(configs))] = result
    for label, groups in list(configs.items())[1:]:
        stage(f"hbp groups {label}: plan, train (speed only)")
        group_runs[label] = _plan_and_train(work, data, setup, calibration, "hbp", seeds[0], groups, model,
                                            evaluate=False)
    # every run's compute per token (the same work in every run) measures the machine's drift over the bench
    report.set_drift([r for seeds_ in runs.values() for r in seeds_] + list(group_runs.values()))
    figs = report.strategy_figures(runs)
    groups = report.group_figures(group_runs) if len(group_runs) > 1 else None
    wall = time.time() - t0
    results = {"setup": name, "describe": chain.describe(setup.shape, data), "seeds": seeds,
               "skipped_strategies": missing, "calibration": str(calibration), "validation": _validation(validation),
               "profile_groups": profile["groups"], "group_configs": groups, "strategies": figs,
               "targets": [list(t) for t in report.targets(figs, groups)], "runs": runs, "wall_s": wall}
    (work / "results.json").write_text(json.dumps(results, indent=1))
    report.plot(figs, runs, groups, work / "speed.png")
    print(summary(results, setup, model))
    print(f"\nwrote {work / 'results.json'} and {work / 'speed.png'}; bench wall time {wall:.0f}s")
    return 0


def _plan_and_train(work, data, setup, calibration, strategy, seed, groups, model, evaluate=True) -> dict:
    # Hydra reads a comma in a path as a list: the groups' folder name has none.
    name = f"{strategy}-s{seed}" if groups == "auto" else "hbp-groups-" + groups.replace(":", "x").replace(",", "_")
    run = work / "runs" / name
    plan = chain.plan(data, run / "shards", strategy, seed, groups, calibration, work / "profile.json",
                      setup.step_tokens)
    rows = chain.train(run / "shards", data, setup.shape, run / "train", seed, setup.eval_every if evaluate else 0)
    shutil.rmtree(run / "shards", ignore_errors=True)  # the plan is in the results; shards are re-made
    return report.run_figures(plan, rows, model)


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
    val, d = results["validation"], results["describe"]
    lines = [f"\nMEASURED on this CPU ({d['nproc']} gloo ranks x {d['threads']} thread, real trainer, ZeRO-2 fp32) "
             f"beside PREDICTED (simulator, CPU calibration {model.note}); data: {d['data']}, seeds "
             f"{','.join(map(str, results['seeds']))}",
             f"model {model.shape.name}: a one-document {setup.max_len}-token pack costs "
             f"{val['one_doc_over_short_docs']:.2f}x a pack of {val['short_docs']} short samples (measured); "
             f"calibration vs whole packs: mean |error| {100 * val['mean_abs_error']:.1f}%, max "
             f"{100 * val['max_abs_error']:.1f}%"
             + (f" (the same pack's rounds lay up to {val['rounds']['max_spread']:.2f}x apart: this machine's timing "
                "noise)" if val.get("rounds") else ""),
             "groups (profiler): " + ", ".join(f"{g['pack_len']}:{g['sp']}" for g in results["profile_groups"]),
             "", report.table(results["strategies"])]
    drift = [r["drift"] for seeds_ in results["runs"].values() for r in seeds_]
    lines.append(f"drift: the runs' compute per token ranged {min(drift):.2f}x to {max(drift):.2f}x its median (the "
                 "machine's speed over the bench; the same work in every run); * = times divided by that factor")
    isf = results["strategies"]["isf"]
    lines.append(f"isf's step time is {isf['balance_bound']:.3f}x its ranks' mean compute: the most a better balance "
                 f"of the same work can gain over isf (hbp: {results['strategies']['hbp']['measured_speedup']:.3f}x)")
    if results["skipped_strategies"]:
        lines.append(f"not in this checkout: {', '.join(results['skipped_strategies'])}")
    groups = results["group_configs"]
    if groups:
        lines.append("hbp under group configurations (tokens/s): " + ", ".join(
            f"{k} {v:.0f}" for k, v in groups["tokens_per_s"].items())
                     + f"; the profiler's choice is {groups['chosen_over_fastest']:.3f}x the fastest")
    lines.append("\ntargets:")
    for what, value, met in results["targets"]:
        shown = "n/a" if value is None else f"{value:.3f}"
        lines.append(f"  {'met   ' if met else 'MISSED'} {what}: {shown}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
