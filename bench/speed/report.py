"""bench/speed/bench_speed.py's figures: pure numpy on the runs' metrics.jsonl rows, their plans and the replay's times (the
simulator runs here, nothing else).

Definitions (the tables' columns), per budget (packs per rank per step):
* timed steps: every optimizer step but the first WARMUP_STEPS of a run (the first step pays one-time costs:
  allocator growth, caches, lazy initialisation); the bench plans enough steps that at least Setup.min_timed_steps
  are timed;
* raw tokens/s: a run's real tokens of its timed steps over the sum of the trainer's per-step wall times of those
  steps (``perf/step_time_s``: data, forward/backward of every micro-batch, the gradient collectives and the
  optimizer step; the held-out evaluation is outside it). Nothing is divided out. A strategy's figure is the median
  over its rounds (with the min-max), as its paired ratios are;
* paired speed-up: a shared machine's speed drifts by 10-20% over minutes, more than the differences measured. So
  every strategy is trained once per round, the rounds in rotated order with isf in the middle of each, and a
  strategy's ratio in round r is its raw tokens/s over isf's in round r (the run beside it in time, the same seed);
  the table shows the median over rounds and the spread (min-max). hbp over a baseline: the median over rounds
  of hbp's round-r tokens/s over the baseline's;
* balance ratio: isf's step time over its ranks' mean compute, divided by the strategy's (each summed over its
  rounds). It is what the speed-up would be if the strategies differed in balance only: the same compute per
  token, different waiting. It is NOT a throughput (the ratio the README published before #31, as "tokens/s");
* equal optimisation: every strategy's plan has the same optimizer steps (count) and the same real tokens; each step
  holds the target tau = T / N +- one slot of the long group (W packs: the most the equal-steps rule allows any
  strategy); the bench stops if not. At one long pack per rank a slot is as large as tau, so the check lets a step
  hold anywhere from 0 to 2 tau: the worst step of each strategy is published, in packs from the target and as its
  real tokens over tau (hbp's target: within one pack);
* predicted: the simulator (hbp_train/planning/simulator.py) on the same plan with this machine's calibration and
  its fitted step costs (per pack, per micro-batch, per step, data; fitted on a run of other samples) and ZeRO-2's
  collectives: absolute seconds, compared step by step with the measured ones (one epoch: global step s runs the
  plan's optimizer step s) and in total (tokens/s);
* time to quality, per seed: the training time at which a strategy's held-out loss first reaches isf's final
  held-out loss of the same seed (the same initial weights), interpolated linearly between its evaluations, over
  the time isf took to reach it (the same function on isf's own curve: isf's row is computed); the median over the
  seeds that reached it, always shown with how many did (k/n): a seed that never reaches it is stated as such, never
  folded into the median. Its clock is the speed figures' clock: the summed step times of the timed steps, the
  warm-up steps counted as zero seconds (``quality_evals``), so neither figure pays the one-time costs;
* held-out loss: mean and sample standard deviation (n - 1) over seeds;
* replay (bench/speed/replay.py): measured compute, modelled waiting at W ranks the machine does not have.
"""

from __future__ import annotations


import numpy as np

BASELINES = ("sorted", "bfd", "kk")
WARMUP_STEPS = 1  # a run's first optimizer steps, left out of every timed figure
TARGETS = {"raw_over_isf": 1.10, "over_every_baseline": 1.0, "time_to_isf_loss": 0.8, "predicted_error": 0.10,
           "median_step_error": 0.10, "replay_error": 0.10, "hbp_worst_step_packs": 1.0}


# ============================================================================================================= runs
def run_figures(plan, rows: list, sim) -> dict:
    """One training run: its measured steps beside the simulator's result ``sim`` for its plan."""
    train_rows = [r for r in rows if "perf/step_time_s" in r]
    measured = np.array([r["perf/step_time_s"] for r in train_rows])
    predicted = sim.step_seconds
    if len(measured) != len(predicted):
        raise SystemExit(f"bench_speed: the run has {len(measured)} steps, its plan {len(predicted)}")
    ranks = sorted(k for k in train_rows[0] if k.startswith("time/compute_s/rank"))
    compute = np.array([[r[k] for k in ranks] for r in train_rows])
    elapsed = np.cumsum(measured)
    evals = [(float(elapsed[i]), i + 1, r["loss/eval"]) for i, r in enumerate(train_rows) if "loss/eval" in r]
    return {
        "tokens": int(plan.lengths[plan.pack_samples].sum()), "steps": len(measured), "warmup_steps": WARMUP_STEPS,
        "micro_batches": int(plan.step_micro_batches().sum()),
        "step_tokens": step_tokens(plan).tolist(),
        "measured_step_s": measured.tolist(), "predicted_step_s": predicted.tolist(),
        "data_s": [r["perf/data_wait_pct"] / 100 * r["perf/step_time_s"] for r in train_rows],
        "compute_s": compute.sum(axis=0).tolist(), "wait_s": (measured[:, None] - compute).sum(axis=0).tolist(),
        "mean_compute_s": float(compute.mean(axis=1).sum()),
        "imbalance": float(np.mean([r["balance/imbalance"] for r in train_rows])),
        "plan_ABR": float(plan.metrics["ABR"]), "pad_ratio": float(plan.metrics["PR"]),
        "evals": evals,
    }


def step_tokens(plan) -> np.ndarray:
    """Real tokens of every optimizer step of ``plan``."""
    from hbp_train.planning.csr import pack_tokens

    tokens = pack_tokens(plan.lengths, plan.pack_ptr, plan.pack_samples)
    per_plan_step = np.add.reduceat(tokens[plan.step_packs], plan.step_ptr[:-1]) if plan.num_steps else np.zeros(0)
    return np.bincount(plan.optimizer_steps(), per_plan_step, minlength=plan.num_optimizer_steps).astype(np.int64)


def check_equal_steps(step_tokens_of: dict, world: int, pack_len: int) -> dict:
    """Equal optimisation across strategies (module docstring) from every run's per-step real tokens
    (``{strategy: [tokens per step, per run]}``): the same step count and total; every step within one slot
    (W packs) of the target. Stops the bench (SystemExit) when not; returns per strategy the step count, the
    target, the worst distance from it (tokens and packs) and the smallest and largest step."""
    counts = {name: {len(t) for t in runs} for name, runs in step_tokens_of.items()}
    totals = {name: {int(np.sum(t)) for t in runs} for name, runs in step_tokens_of.items()}
    if len(set().union(*counts.values())) != 1:
        raise SystemExit(f"bench_speed: the strategies' plans have different optimizer step counts {counts}: not "
                         "equal optimisation")
    if len(set().union(*totals.values())) != 1:
        raise SystemExit(f"bench_speed: the strategies' plans train different real tokens {totals}")
    num_steps, total = next(iter(counts.values())).pop(), next(iter(totals.values())).pop()
    target = total / num_steps
    slot = world * pack_len
    out = {}
    for name, runs in step_tokens_of.items():
        tokens = np.concatenate([np.asarray(t, np.float64) for t in runs])
        worst = float(np.abs(tokens - target).max())
        if worst > slot:
            raise SystemExit(f"bench_speed: a {name} step holds {tokens[np.argmax(np.abs(tokens - target))]:.0f} "
                             f"real tokens, more than one slot ({slot}) from the target {target:.0f}")
        out[name] = {"steps": num_steps, "target": target, "worst_tokens": worst, "worst_packs": worst / pack_len,
                     "worst_over_target": float(tokens[np.argmax(np.abs(tokens - target))] / target),
                     "min": float(tokens.min()), "max": float(tokens.max()), "slot_tokens": slot}
    return out


def paired_ratios(runs: dict, baseline: str = "isf") -> dict:
    """Per strategy, its raw tokens/s over ``baseline``'s in the same round (``runs``: {strategy: [run per round]},
    each run with "round", "tokens", "measured_step_s"): {"ratios", "median", "min", "max"}."""
    base = {r["round"]: _tokens_per_s(r) for r in runs[baseline]}
    out = {}
    for name, rounds in runs.items():
        ratios = [_tokens_per_s(r) / base[r["round"]] for r in sorted(rounds, key=lambda r: r["round"])
                  if r["round"] in base]
        out[name] = _spread(ratios)
    return out


def timed(run: dict) -> tuple[float, float, float]:
    """(real tokens, measured seconds, predicted seconds) of a run's timed steps: all but its first warm-up steps
    (a run without per-step tokens counts all of its steps)."""
    skip = run.get("warmup_steps", 0) if "step_tokens" in run else 0
    tokens = float(np.sum(run["step_tokens"][skip:])) if "step_tokens" in run else float(run["tokens"])
    return tokens, float(np.sum(run["measured_step_s"][skip:])), float(np.sum(run["predicted_step_s"][skip:]))


def _tokens_per_s(run: dict) -> float:
    tokens, seconds, _ = timed(run)
    return tokens / seconds


def _spread(values: list) -> dict:
    values = [float(v) for v in values]
    if not values:
        return {"ratios": [], "median": None, "min": None, "max": None}
    return {"ratios": values, "median": float(np.median(values)), "min": min(values), "max": max(values)}


def time_to_loss(evals: list, target: float) -> float | None:
    """Training seconds at which the loss curve ``evals`` ([(seconds, step, loss), ...]) first reaches ``target``,
    linear between the evaluation before and the first at or below it (the first itself if it is the first
    evaluation); None if it never does."""
    previous = None
    for seconds, _step, loss in evals:
        if loss <= target:
            if previous is None:
                return float(seconds)
            t0, l0 = previous
            return float(t0 + (l0 - target) / (l0 - loss) * (seconds - t0))
        previous = (seconds, loss)
    return None


def quality_evals(run: dict) -> list:
    """A run's evaluations [(seconds, step, loss), ...] on the speed figures' clock: the summed times of its timed
    steps up to the evaluation, the first ``warmup_steps`` steps counted as zero seconds (the evaluation after
    global step k follows k steps). A run recorded without per-step tokens keeps its own clock."""
    if "step_tokens" not in run:
        return [tuple(e) for e in run["evals"]]
    skip = run.get("warmup_steps", 0)
    clock = np.concatenate([[0.0], np.cumsum(run["measured_step_s"])])
    return [(float(clock[step] - clock[min(skip, step)]), step, loss) for _seconds, step, loss in run["evals"]]


def time_to_quality(runs: dict, baseline: str = "isf") -> dict:
    """Per strategy, seed by seed: the time its held-out loss reaches ``baseline``'s final loss of the same seed,
    over the time ``baseline`` took to reach it (time_to_loss on both curves, quality_evals' clock). {"ratios"
    (None: never), "median" (over the seeds that reached it; None when none did), "reached", "seeds"}."""
    base = {r["seed"]: r for r in runs[baseline] if r["evals"]}
    out = {}
    for name, seeds in runs.items():
        ratios = []
        for r in sorted(seeds, key=lambda r: r["seed"]):
            if r["seed"] not in base or not r["evals"]:
                continue
            ref = base[r["seed"]]
            target = ref["evals"][-1][2]
            t, t_ref = time_to_loss(quality_evals(r), target), time_to_loss(quality_evals(ref), target)
            ratios.append(None if t is None else t / t_ref)
        reached = [x for x in ratios if x is not None]
        out[name] = {"ratios": ratios, "median": float(np.median(reached)) if reached else None,
                     "reached": len(reached), "seeds": len(ratios)}
    return out


def budget_figures(runs: dict) -> dict:
    """Per strategy, over its rounds at one budget: raw and predicted tokens/s, their error, the per-step error, the
    paired speed-up over isf, hbp over each baseline, the balance ratio, the steps' composition, held-out loss and
    time to quality."""
    paired = paired_ratios(runs)
    ttq = time_to_quality(runs) if any(r["evals"] for r in runs["isf"]) else {}
    out = {}
    for name, rounds in runs.items():
        tokens, measured, predicted = (sum(t) for t in zip(*(timed(r) for r in rounds)))
        timed_steps = sum(r["steps"] - (r.get("warmup_steps", 0) if "step_tokens" in r else 0) for r in rounds)
        step_err = np.concatenate([(np.array(r["predicted_step_s"]) / np.array(r["measured_step_s"]) - 1)
                                   [r.get("warmup_steps", 0) if "step_tokens" in r else 0:] for r in rounds])
        finals = [r["evals"][-1][2] for r in rounds if r["evals"]]
        out[name] = {
            "rounds": len(rounds), "steps": rounds[0]["steps"],
            "micro_batches": float(np.mean([r["micro_batches"] for r in rounds])),
            "raw": _spread([_tokens_per_s(r) for r in sorted(rounds, key=lambda r: r["round"])]),
            "raw_tokens_per_s": float(np.median([_tokens_per_s(r) for r in rounds])),  # per round, as the ratios
            "pooled_tokens_per_s": tokens / measured, "predicted_tokens_per_s": tokens / predicted,
            "predicted_error": measured / predicted - 1,  # = predicted tokens/s over measured - 1
            "measured_step_mean_s": measured / timed_steps, "predicted_step_mean_s": predicted / timed_steps,
            "median_abs_step_error": float(np.median(np.abs(step_err))),
            "data_share": sum(sum(r["data_s"]) for r in rounds) / measured,
            "paired": paired[name],
            "balance_factor": measured / sum(r["mean_compute_s"] for r in rounds),
            "compute_s": np.mean([r["compute_s"] for r in rounds], axis=0).tolist(),
            "wait_s": np.mean([r["wait_s"] for r in rounds], axis=0).tolist(),
            "imbalance": float(np.mean([r["imbalance"] for r in rounds])),
            "plan_ABR": float(np.mean([r["plan_ABR"] for r in rounds])),
            "pad_ratio": float(np.mean([r["pad_ratio"] for r in rounds])),
            "heldout_final": finals, "heldout_mean": float(np.mean(finals)) if finals else None,
            "heldout_std": float(np.std(finals, ddof=1)) if len(finals) > 1 else None,
            "time_to_quality": ttq.get(name),
        }
    isf = out["isf"]
    for f in out.values():
        f["balance_ratio"] = isf["balance_factor"] / f["balance_factor"]
        f["predicted_speedup"] = f["predicted_tokens_per_s"] / isf["predicted_tokens_per_s"]
    if "hbp" in runs:
        for name in BASELINES:
            if name in runs:
                out["hbp"][f"over_{name}"] = _spread(list(_round_ratios(runs["hbp"], runs[name])))
        present = [b for b in BASELINES if b in out]
        if present:
            out["hbp"]["best_baseline"] = max(present, key=lambda b: out[b]["paired"]["median"])
    return out


def _round_ratios(runs_a: list, runs_b: list):
    b = {r["round"]: _tokens_per_s(r) for r in runs_b}
    for r in runs_a:
        if r["round"] in b:
            yield _tokens_per_s(r) / b[r["round"]]


# ============================================================================================================ replay
def replay_figures(replayed: dict) -> dict:
    """Per W and strategy, from ``{W: {strategy: {"tokens", "replayed_s", "simulated_s", "plan_simulated_tokens_per_s",
    ...}}}`` (per drawn step): the measured over simulated time of its drawn steps (``measured_over_simulated``),
    the whole plan's replayed tokens/s as the simulator's whole plan scaled by it (a ratio estimate: the drawn steps
    differ between strategies, so their own tokens/s say nothing about a strategy), the speed-ups over isf of that
    and of the simulator's whole plan, and the simulator's error against the replay (which is the ratio of the two
    strategies' measured over simulated times; the drawn steps' own tokens/s are kept for the JSON)."""
    out = {}
    for world, strategies in replayed.items():
        rows = {}
        for name, r in strategies.items():
            tokens = float(np.sum(r["tokens"]))
            ratio = float(np.sum(r["replayed_s"])) / float(np.sum(r["simulated_s"]))
            rows[name] = {"steps": len(r["tokens"]), "plan_steps": r["plan_steps"],
                          "drawn_replayed_tokens_per_s": tokens / float(np.sum(r["replayed_s"])),
                          "drawn_simulated_tokens_per_s": tokens / float(np.sum(r["simulated_s"])),
                          "measured_over_simulated": ratio,
                          "plan_simulated_tokens_per_s": r["plan_simulated_tokens_per_s"],
                          "replayed_tokens_per_s": r["plan_simulated_tokens_per_s"] / ratio}
        isf = rows["isf"]
        for f in rows.values():
            f["replayed_speedup"] = f["replayed_tokens_per_s"] / isf["replayed_tokens_per_s"]
            f["plan_simulated_speedup"] = f["plan_simulated_tokens_per_s"] / isf["plan_simulated_tokens_per_s"]
            f["speedup_error"] = f["plan_simulated_speedup"] / f["replayed_speedup"] - 1
        out[world] = rows
    return out


# =========================================================================================================== targets
def targets(budgets: dict, replay: dict | None, steps: dict, first: int) -> list:
    """(target, value, met) rows of the issue's targets these figures can judge; value None = not measured.
    ``budgets``: {packs per rank: budget_figures}; ``steps``: {packs per rank: check_equal_steps}; ``first``: the
    one-pack budget's key."""
    rows = []
    one = budgets[first]
    hbp, isf = one.get("hbp"), one["isf"]
    if hbp:
        p = hbp["paired"]
        rows.append((f"hbp raw tokens/s >= {TARGETS['raw_over_isf']:.2f}x isf, {first} pack(s)/rank (median "
                     f"[{p['min']:.3f}-{p['max']:.3f}] of {len(p['ratios'])} rounds)", p["median"],
                     p["median"] >= TARGETS["raw_over_isf"]))
        for key, figs in budgets.items():
            h = figs["hbp"]
            over = [(b, h[f"over_{b}"]) for b in BASELINES if f"over_{b}" in h]
            if over:
                name, worst = min(over, key=lambda o: o[1]["median"])
                rows.append((f"hbp >= every baseline, {key} pack(s)/rank (lowest over {name}; best baseline "
                             f"{h['best_baseline']})", worst["median"],
                             worst["median"] >= TARGETS["over_every_baseline"]))
        if hbp["heldout_mean"] is not None and isf["heldout_std"] is not None:
            bound = isf["heldout_mean"] + isf["heldout_std"]
            rows.append(("hbp held-out loss <= isf mean + sample SD (value: hbp - bound)", hbp["heldout_mean"] - bound,
                         hbp["heldout_mean"] <= bound))
        ttq = hbp["time_to_quality"]
        if ttq:
            rows.append((f"hbp reaches isf's final loss, per seed, in <= 0.8x isf's time (median; {ttq['reached']}/"
                         f"{ttq['seeds']} seeds reached it)", ttq["median"],
                         ttq["median"] is not None and ttq["median"] <= TARGETS["time_to_isf_loss"]))
    for key, figs in budgets.items():
        worst = max(figs, key=lambda n: abs(figs[n]["predicted_error"]))
        rows.append((f"predicted tokens/s within 10% of measured, {key} pack(s)/rank (worst: {worst})",
                     figs[worst]["predicted_error"], abs(figs[worst]["predicted_error"]) <= TARGETS["predicted_error"]))
        step = float(np.median([f["median_abs_step_error"] for f in figs.values()]))
        rows.append((f"median per-step error <= 10%, {key} pack(s)/rank", step, step <= TARGETS["median_step_error"]))
        if "hbp" in steps[key]:
            packs = steps[key]["hbp"]["worst_packs"]
            rows.append((f"hbp's worst step within one pack of the target, {key} pack(s)/rank", packs,
                         packs <= TARGETS["hbp_worst_step_packs"]))
    if replay:
        world = max(replay)
        figs = replay[world]
        worst = max(figs, key=lambda n: abs(figs[n]["speedup_error"]))
        rows.append((f"replay W={world}: simulated speed-up within 10% of the replayed one (worst: {worst})",
                     figs[worst]["speedup_error"], abs(figs[worst]["speedup_error"]) <= TARGETS["replay_error"]))
    return [(what, None if value is None else float(value), bool(met)) for what, value, met in rows]


# ============================================================================================================ tables
def budget_table(figs: dict, steps: dict) -> str:
    """One line per strategy at one budget."""
    lines = [f"{'strategy':<8}{'steps':>6}{'worst':>7}{'mb':>6}{'raw tok/s':>10}{'x isf (paired)':>23}"
             f"{'balance':>8}{'pred tok/s':>11}{'err':>7}{'step err':>9}{'s/step':>8}{'pred':>7}{'data':>6}"
             f"{'ABR':>7}{'PR':>6}  {'held-out loss':<18}{'t to isf loss':>16}"]
    for name, f in figs.items():
        p = f["paired"]
        paired = f"{p['median']:.3f} [{p['min']:.3f}-{p['max']:.3f}]" if p["median"] is not None else "n/a"
        loss = "n/a" if f["heldout_mean"] is None else f"{f['heldout_mean']:.4f}" + (
            f" ± {f['heldout_std']:.4f}" if f["heldout_std"] is not None else "")
        ttq = f["time_to_quality"]
        ttq_text = "n/a" if not ttq else (f"{ttq['median']:.2f}x" if ttq["median"] is not None else "never") + \
            f" ({ttq['reached']}/{ttq['seeds']} reached)"
        lines.append(f"{name:<8}{f['steps']:>6}{steps[name]['worst_packs']:>6.2f}p{f['micro_batches']:>6.0f}"
                     f"{f['raw_tokens_per_s']:>10.0f}{paired:>23}{f['balance_ratio']:>7.3f}x"
                     f"{f['predicted_tokens_per_s']:>11.0f}{100 * f['predicted_error']:>+6.1f}%"
                     f"{100 * f['median_abs_step_error']:>8.1f}%{f['measured_step_mean_s']:>8.3f}"
                     f"{f['predicted_step_mean_s']:>7.3f}{100 * f['data_share']:>5.1f}%{f['plan_ABR']:>7.3f}"
                     f"{f['pad_ratio']:>6.3f}  {loss:<18}{ttq_text:>16}")
    return "\n".join(lines)


def replay_table(replay: dict) -> str:
    """One line per W and strategy: its drawn steps' measured over simulated time, and the whole plan's speed-up over
    isf replayed (the simulator's plan scaled by that ratio) beside the simulator's."""
    lines = [f"{'W':>3} {'strategy':<8}{'drawn':>6}{'of':>5}{'meas/sim':>9}{'replayed tok/s':>15}{'sim tok/s':>10}"
             f"{'replayed x isf':>15}{'sim x isf':>10}{'err':>7}"]
    for world, figs in replay.items():
        for name, f in figs.items():
            lines.append(f"{world:>3} {name:<8}{f['steps']:>6}{f['plan_steps']:>5}{f['measured_over_simulated']:>9.3f}"
                         f"{f['replayed_tokens_per_s']:>15.0f}{f['plan_simulated_tokens_per_s']:>10.0f}"
                         f"{f['replayed_speedup']:>14.3f}x{f['plan_simulated_speedup']:>9.3f}x"
                         f"{100 * f['speedup_error']:>+6.1f}%")
    return "\n".join(lines)


def plot(budgets: dict, runs: dict, replay: dict | None, path) -> None:
    """Paired speed-ups per budget (median and spread), measured against predicted step times, held-out loss over
    time, and the replay beside the simulator."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(22, 4.8))
    width = 0.8 / max(len(budgets), 1)
    for j, (key, figs) in enumerate(budgets.items()):
        names = list(figs)
        x = np.arange(len(names)) + j * width
        med = np.array([figs[n]["paired"]["median"] for n in names])
        lo = med - np.array([figs[n]["paired"]["min"] for n in names])
        hi = np.array([figs[n]["paired"]["max"] for n in names]) - med
        axes[0].bar(x, med, width, yerr=[lo, hi], capsize=3, label=f"{key} pack(s)/rank")
        axes[0].set_xticks(np.arange(len(names)) + width * (len(budgets) - 1) / 2, names)
    axes[0].axhline(1.0, color="0.4", lw=0.8)
    axes[0].set_ylabel("raw tokens/s over isf (paired by round)")
    axes[0].set_title("measured speed-up: median and min-max over rounds")
    axes[0].legend(fontsize=8)
    top = 0.0
    for i, (key, strategies) in enumerate(runs.items()):
        for n, rounds in strategies.items():
            meas = np.concatenate([r["measured_step_s"] for r in rounds])
            pred = np.concatenate([r["predicted_step_s"] for r in rounds])
            axes[1].scatter(meas, pred, s=8, marker="o" if i == 0 else "x",
                            color=f"C{list(strategies).index(n)}", label=f"{n} ({key}/rank)")
            top = max(top, meas.max(), pred.max())
    axes[1].plot([0, top], [0, top], color="0.5", lw=0.8)
    axes[1].set_xlabel("measured step time (s)")
    axes[1].set_ylabel("predicted step time (s)")
    axes[1].set_title("per optimizer step: predicted (absolute) vs measured")
    axes[1].legend(fontsize=6, ncol=2)
    first = next(iter(runs.values()))
    for i, (n, rounds) in enumerate(first.items()):
        for j, r in enumerate(rounds):
            if r["evals"]:
                t, _, loss = zip(*quality_evals(r))
                axes[2].plot(t, loss, color=f"C{i}", lw=1, alpha=0.8, label=n if j == 0 else None)
    axes[2].set_xlabel("training time (s, timed steps: warm-up and evaluation excluded)")
    axes[2].set_ylabel("held-out loss")
    axes[2].set_title("held-out loss over time (every seed)")
    axes[2].legend(fontsize=8)
    if replay:
        for j, (world, figs) in enumerate(replay.items()):
            names = list(figs)
            x = np.arange(len(names)) + j * 0.4
            axes[3].bar(x, [figs[n]["replayed_speedup"] for n in names], 0.2, label=f"W={world} replayed")
            axes[3].bar(x + 0.2, [figs[n]["plan_simulated_speedup"] for n in names], 0.2, label=f"W={world} simulated")
            axes[3].set_xticks(np.arange(len(names)) + 0.3, names)
        axes[3].axhline(1.0, color="0.4", lw=0.8)
        axes[3].set_ylabel("speed-up over isf")
        axes[3].set_title("replay (whole plans, ratio estimate): measured compute, modelled waiting")
        axes[3].legend(fontsize=8)
    fig.suptitle("MEASURED on this CPU (2 gloo ranks, real trainer) beside the simulator's absolute prediction")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
