"""bench/bench_speed.py's figures: measured against predicted per run and per strategy, time to quality, the table
and the plot. Pure numpy on the runs' metrics.jsonl rows and their plans (the simulator runs here, nothing else).

Definitions (the table's columns):
* measured tokens/s: the plan's tokens over the sum of the trainer's per-step wall times (``perf/step_time_s``:
  data, forward/backward of every micro-batch, the gradient collectives and the optimizer step; the held-out
  evaluation is outside it), over all seeds of a strategy;
* drift-corrected ("*"): a shared machine's speed drifts by 10-20% over minutes (the same plan trained three times
  took 51, 60 and 64 s), more than the differences being measured. Every strategy trains the same samples with the
  same model, so its ranks compute the same work per token (back to back, isf's and hbp's ranks computed within 1%
  of each other): a run's drift factor is its ranks' mean compute per token over the median of all runs', and its
  step times are divided by it. What a strategy changes (the waiting for the slowest rank, the collectives, the
  optimizer step, per-micro-batch costs outside compute) stays in the corrected time; a strategy whose packs cost
  more compute per token would be credited with it. The speed-ups, per-step errors and times to quality below use
  the corrected times; the raw ones are shown beside;
* predicted: the simulator (hbp_train/planning/simulator.py) on the same plan with the CPU calibration, compute
  only; its per-step times are compared with the measured ones step by step (one epoch: global step s runs the
  plan's optimizer step s);
* compute and wait of a rank: the trainer's ``time/compute_s/rank<r>`` (its own forward/backward, without the
  time spent inside the gradient collectives) and the rest of the step's wall time;
* balance bound: a strategy's step time over its ranks' mean compute: the most a better balance of the same work
  could gain;
* time to quality: training wall time (cumulative step time) at the first held-out evaluation whose loss is at or
  below isf's final held-out loss (mean over seeds).
"""

from __future__ import annotations

import numpy as np

BASELINES = ("sorted", "bfd", "kk")
TARGETS = {"speedup_over_isf": 1.25, "speedup_over_best_baseline": 1.05, "time_to_isf_loss": 0.8,
           "predicted_speedup_error": 0.10, "median_step_error": 0.10, "groups_within": 0.05}


def run_figures(plan, rows: list, model) -> dict:
    """One training run beside the simulator's prediction for its plan."""
    from hbp_train.planning.simulator import simulate

    train_rows = [r for r in rows if "perf/step_time_s" in r]
    measured = np.array([r["perf/step_time_s"] for r in train_rows])
    predicted = simulate(plan, model).step_seconds
    if len(measured) != len(predicted):
        raise SystemExit(f"bench_speed: the run has {len(measured)} steps, its plan {len(predicted)}")
    ranks = sorted(k for k in train_rows[0] if k.startswith("time/compute_s/rank"))
    compute = np.array([[r[k] for k in ranks] for r in train_rows])
    elapsed = np.cumsum(measured)
    evals = [(float(elapsed[i]), i + 1, r["loss/eval"]) for i, r in enumerate(train_rows) if "loss/eval" in r]
    return {
        "drift": 1.0,
        "tokens": int(plan.lengths[plan.pack_samples].sum()), "steps": len(measured),
        "micro_batches": int(plan.step_micro_batches().sum()),
        "measured_step_s": measured.tolist(), "predicted_step_s": predicted.tolist(),
        "compute_s": compute.sum(axis=0).tolist(), "wait_s": (measured[:, None] - compute).sum(axis=0).tolist(),
        "mean_compute_s": float(compute.mean(axis=1).sum()),
        "imbalance": float(np.mean([r["balance/imbalance"] for r in train_rows])),
        "plan_ABR": float(plan.metrics["ABR"]), "pad_ratio": float(plan.metrics["PR"]),
        "evals": evals,
    }


def set_drift(runs: list) -> float:
    """Every run's drift factor (module docstring): its ranks' mean compute per token over the median of all runs'.
    Returns that median (seconds per token)."""
    per_token = [r["mean_compute_s"] / r["tokens"] for r in runs]
    ref = float(np.median(per_token))
    for r, value in zip(runs, per_token):
        r["drift"] = value / ref
    return ref


def _corrected(run: dict) -> np.ndarray:
    return np.array(run["measured_step_s"]) / run["drift"]


def strategy_figures(runs: dict) -> dict:
    """Per strategy, over its seeds: measured (raw and drift-corrected) and predicted tokens/s, per-step error,
    compute/wait, balance bound, held-out loss and time to quality."""
    out = {}
    for name, seeds in runs.items():
        tokens = sum(r["tokens"] for r in seeds)
        raw = sum(sum(r["measured_step_s"]) for r in seeds)
        measured = float(sum(_corrected(r).sum() for r in seeds))
        predicted = sum(sum(r["predicted_step_s"]) for r in seeds)
        step_err = np.concatenate([np.array(r["predicted_step_s"]) / _corrected(r) - 1 for r in seeds])
        finals = [r["evals"][-1][2] for r in seeds if r["evals"]]
        out[name] = {
            "raw_tokens_per_s": tokens / raw, "measured_tokens_per_s": tokens / measured,
            "predicted_tokens_per_s": tokens / predicted, "drift": [r["drift"] for r in seeds],
            "train_s": measured / len(seeds), "steps": seeds[0]["steps"],
            "median_abs_step_error": float(np.median(np.abs(step_err))),
            "compute_s": np.mean([r["compute_s"] for r in seeds], axis=0).tolist(),
            "wait_s": np.mean([r["wait_s"] for r in seeds], axis=0).tolist(),
            "imbalance": float(np.mean([r["imbalance"] for r in seeds])),
            "plan_ABR": float(np.mean([r["plan_ABR"] for r in seeds])),
            "pad_ratio": float(np.mean([r["pad_ratio"] for r in seeds])),
            # The step time a plan of the same compute, perfectly balanced and with nothing else in the step, would
            # take: this plan's step time over it bounds what any better balance of its work can gain.
            "balance_bound": raw / sum(r["mean_compute_s"] for r in seeds),
            "heldout_final": finals, "heldout_mean": float(np.mean(finals)) if finals else None,
            "heldout_std": float(np.std(finals)) if finals else None,
        }
    isf = out.get("isf")
    for name, f in out.items():
        if isf is not None:
            f["raw_speedup"] = f["raw_tokens_per_s"] / isf["raw_tokens_per_s"]
            f["measured_speedup"] = f["measured_tokens_per_s"] / isf["measured_tokens_per_s"]
            f["predicted_speedup"] = f["predicted_tokens_per_s"] / isf["predicted_tokens_per_s"]
            f["speedup_error"] = f["predicted_speedup"] / f["measured_speedup"] - 1
        if isf is not None and isf["heldout_mean"] is not None:
            times = [_first_at_or_below(r["evals"], isf["heldout_mean"], r["drift"]) for r in runs[name]]
            reached = [t for t in times if t is not None]
            f["time_to_isf_loss_s"] = float(np.mean(reached)) if len(reached) == len(times) else None
            f["seeds_reaching_isf_loss"] = len(reached)
            f["time_to_isf_loss_over_isf_time"] = (f["time_to_isf_loss_s"] / isf["train_s"]
                                                   if f["time_to_isf_loss_s"] is not None else None)
    baselines = [b for b in BASELINES if b in out]
    if baselines:
        best = max(baselines, key=lambda b: out[b]["measured_tokens_per_s"])
        for f in out.values():
            f["best_baseline"] = best
            f["speedup_over_best_baseline"] = f["measured_tokens_per_s"] / out[best]["measured_tokens_per_s"]
    return out


def _first_at_or_below(evals: list, target: float, drift: float):
    for elapsed, _step, loss in evals:
        if loss <= target:
            return elapsed / drift
    return None


def group_figures(configs: dict) -> dict:
    """Measured tokens/s of hbp under each group configuration, and how far the profiler's choice is from the best."""
    speed = {name: float(r["tokens"] / _corrected(r).sum()) for name, r in configs.items()}
    best = max(speed, key=speed.get)
    chosen = next(iter(configs))  # the profiler's groups come first
    return {"tokens_per_s": speed, "fastest": best, "chosen": chosen,
            "chosen_over_fastest": speed[chosen] / speed[best]}


def targets(figs: dict, groups: dict | None) -> list:
    """(target, value, met) rows of the issue's targets that these figures can judge; value None = not measured."""
    hbp, isf = figs.get("hbp"), figs.get("isf")
    rows = []
    if hbp and isf:
        rows.append(("hbp tokens/s >= 1.25x isf", hbp["measured_speedup"], hbp["measured_speedup"] >= 1.25))
        if "speedup_over_best_baseline" in hbp:
            rows.append((f"hbp tokens/s >= 1.05x best baseline ({hbp['best_baseline']})",
                         hbp["speedup_over_best_baseline"], hbp["speedup_over_best_baseline"] >= 1.05))
        if hbp["heldout_mean"] is not None and isf["heldout_mean"] is not None:
            bound = isf["heldout_mean"] + isf["heldout_std"]
            rows.append(("hbp held-out loss <= isf mean + std", hbp["heldout_mean"] - bound,
                         hbp["heldout_mean"] <= bound))
            ratio = hbp.get("time_to_isf_loss_over_isf_time")
            rows.append(("hbp reaches isf's final loss in <= 0.8x isf's time", ratio,
                         ratio is not None and ratio <= 0.8))
    errors = {n: f["speedup_error"] for n, f in figs.items() if "speedup_error" in f}
    if errors:
        worst = max(errors, key=lambda n: abs(errors[n]))
        rows.append((f"predicted speed-up within 10% of measured (worst: {worst})", errors[worst],
                     abs(errors[worst]) <= 0.10))
    step = float(np.median([f["median_abs_step_error"] for f in figs.values()]))
    rows.append(("median per-step time error <= 10%", step, step <= 0.10))
    if groups is not None:
        rows.append((f"profiler's groups within 5% of the fastest of {len(groups['tokens_per_s'])}",
                     groups["chosen_over_fastest"], groups["chosen_over_fastest"] >= 0.95))
    return [(what, None if value is None else float(value), bool(met)) for what, value, met in rows]


def table(figs: dict) -> str:
    """One line per strategy; "*": drift-corrected (module docstring)."""
    lines = [f"{'strategy':<8}{'steps':>6}{'raw tok/s':>10}{'x isf':>7}{'tok/s*':>8}{'x isf*':>8}{'x best*':>8}"
             f"{'pred tok/s':>11}{'pred x isf':>11}{'err':>7}{'step err':>9}{'imb':>6}{'bound':>7}{'ABR':>7}"
             f"{'PR':>6}  {'compute/wait s per rank':<24}{'held-out loss':>18}{'t to isf loss':>14}"]
    for name, f in figs.items():
        rank = " ".join(f"{c:.0f}/{w:.0f}" for c, w in zip(f["compute_s"], f["wait_s"]))
        loss = f"{f['heldout_mean']:.4f} ± {f['heldout_std']:.4f}" if f["heldout_mean"] is not None else "n/a"
        ttq = f.get("time_to_isf_loss_over_isf_time")
        ttq = "never" if f.get("time_to_isf_loss_s", 0) is None else ("n/a" if ttq is None else f"{ttq:.2f}x")
        lines.append(f"{name:<8}{f['steps']:>6}{f['raw_tokens_per_s']:>10.0f}{f.get('raw_speedup', 1):>6.3f}x"
                     f"{f['measured_tokens_per_s']:>8.0f}{f.get('measured_speedup', 1):>7.3f}x"
                     f"{f.get('speedup_over_best_baseline', 1):>7.3f}x{f['predicted_tokens_per_s']:>11.0f}"
                     f"{f.get('predicted_speedup', 1):>10.3f}x{100 * f.get('speedup_error', 0):>+6.1f}%"
                     f"{100 * f['median_abs_step_error']:>8.1f}%{f['imbalance']:>6.3f}{f['balance_bound']:>6.3f}x"
                     f"{f['plan_ABR']:>7.3f}{f['pad_ratio']:>6.3f}  {rank:<24}{loss:>18}{ttq:>14}")
    return "\n".join(lines)


def plot(figs: dict, runs: dict, groups: dict | None, path) -> None:
    """Measured against predicted: tokens/s per strategy, per-step times, held-out loss over training time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(figs)
    fig, axes = plt.subplots(1, 4 if groups else 3, figsize=(22 if groups else 17, 4.8))
    x = np.arange(len(names))
    axes[0].bar(x - 0.2, [figs[n]["measured_tokens_per_s"] for n in names], 0.4,
                label="measured (CPU, 2 ranks, drift-corrected)")
    axes[0].bar(x + 0.2, [figs[n]["predicted_tokens_per_s"] for n in names], 0.4,
                label="predicted (simulator, CPU calibration)")
    for i, n in enumerate(names):
        axes[0].annotate(f"{figs[n].get('measured_speedup', 1):.2f}x", (i - 0.2, figs[n]["measured_tokens_per_s"]),
                         ha="center", va="bottom", fontsize=8)
    axes[0].set_xticks(x, names)
    axes[0].set_ylabel("tokens/s")
    axes[0].set_title("throughput (label: measured speed-up over isf)")
    axes[0].legend(fontsize=8)
    top = 0.0
    for i, n in enumerate(names):
        meas = np.concatenate([_corrected(r) for r in runs[n]])
        pred = np.concatenate([r["predicted_step_s"] for r in runs[n]])
        axes[1].scatter(meas, pred, s=8, label=n, color=f"C{i}")
        top = max(top, meas.max(), pred.max())
    axes[1].plot([0, top], [0, top], color="0.5", lw=0.8)
    axes[1].set_xlabel("measured step time (s, drift-corrected)")
    axes[1].set_ylabel("predicted step time (s)")
    axes[1].set_title("per optimizer step: predicted vs measured")
    axes[1].legend(fontsize=8)
    for i, n in enumerate(names):
        for j, r in enumerate(runs[n]):
            if r["evals"]:
                t, _, loss = zip(*r["evals"])
                axes[2].plot(np.array(t) / r["drift"], loss, color=f"C{i}", lw=1, alpha=0.8,
                             label=n if j == 0 else None)
    if figs.get("isf", {}).get("heldout_mean") is not None:
        axes[2].axhline(figs["isf"]["heldout_mean"], color="0.4", ls="--", lw=0.8, label="isf final (mean)")
    axes[2].set_xlabel("training wall time (s, drift-corrected, evaluation excluded)")
    axes[2].set_ylabel("held-out loss")
    axes[2].set_title("held-out loss over time (every seed)")
    axes[2].legend(fontsize=8)
    if groups:
        labels = list(groups["tokens_per_s"])
        axes[3].bar(range(len(labels)), [groups["tokens_per_s"][k] for k in labels],
                    color=["C3" if k == groups["chosen"] else "C7" for k in labels])
        axes[3].set_xticks(range(len(labels)), labels, rotation=15, fontsize=7)
        axes[3].set_ylabel("hbp tokens/s")
        axes[3].set_title("group configurations (red: the profiler's)")
    fig.suptitle("MEASURED on this CPU (2 gloo ranks, real trainer) beside the simulator's prediction")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
