"""docs/benchmarks.md's measured table, rendered from bench_speed's results file (bench/results/bench_speed.json).

    python bench/speed/results_table.py            # print the block the results file renders
    python bench/speed/results_table.py --write    # put it into docs/benchmarks.md (bench_speed.py's full run does)
    python bench/speed/results_table.py --check    # exit 1 when the page's block differs

Every figure comes from the results file's runs through the same arithmetic as the bench's report
(bench/speed/report.py), and the marks follow bench/speed/verdicts.py: bold only for a strategy ahead of every
other beyond the noise the runs measured (speed: paired by round, wholly above 1 in every round; quality: paired by
seed, a 95% t-interval), else the verdict column says parity or within seed noise. The block names the commit the
figures were measured on and whether the tree had changes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench import results_file  # noqa: E402
from bench.speed import report, verdicts  # noqa: E402

NAME = "bench_speed"


def _x(value: float, digits: int = 3) -> str:
    return f"{value:.{digits}f}×"


def _spread(s: dict) -> str:
    return f"{_x(s['median'])} [{s['min']:.3f}–{s['max']:.3f}]"


def _sign(value: float, digits: int = 1) -> str:
    return f"{100 * value:+.{digits}f}%".replace("-", "−")


def render(results: dict) -> str:
    """The block: the run's provenance and rules in one paragraph, the measured table, the replay."""
    names = results["strategies"]
    runs = {int(k): v for k, v in results["runs"].items()}
    figs = {k: report.budget_figures(v) for k, v in runs.items()}
    steps = {int(k): v for k, v in results["equal_steps"].items()}
    budgets = sorted(runs)
    first = budgets[0]
    prov = results.get("provenance", {})
    machine = prov.get("machine", {})
    d = results["describe"]
    rounds = figs[first]["isf"]["rounds"]
    timed = {k: figs[k]["isf"]["steps"] - report.WARMUP_STEPS for k in budgets}
    slot = next(iter(steps[first].values())).get("slot_tokens")
    counts = ", ".join(f"{next(iter(steps[k].values()))['steps']} at {_packs(k)}" for k in budgets)
    commit = prov.get("commit") or "unknown"
    where = (f"{results['wall_s'] / 60:.0f} minutes on {machine.get('cores', '?')} cores of {machine.get('cpu', 'a CPU')}"
             f", measured on commit {commit[:10]}" + (" with uncommitted changes" if prov.get("dirty") else "")
             + f", {prov.get('date', '')}"
             + (f"; the machine's load was {machine['load_1min']:.1f} when it started"
                if (machine.get("load_1min") or 0) > 0.5 else ""))
    text = [
        f"`python bench/speed/bench_speed.py` ({where}; every figure below is in bench/results/bench_speed.json): "
        f"the real trainer on {d['nproc']} gloo ranks (ZeRO-2, fp32) on {_data(d['data'])}. **Equal optimisation, "
        f"checked** before training: every strategy has the same optimizer steps "
        f"({counts}) and the same "
        f"total real tokens, and no step lies more than one slot ({d['nproc']} long packs"
        + (f", {slot:,.0f} tokens" if slot else "") + ") from the target τ = tokens / steps. At one long pack per "
        "rank a slot is as large as τ, so a step may hold from 0 to 2τ: each strategy's worst step is in the table. "
        f"Speed: raw wall-clock tokens/s of the timed steps ({' and '.join(str(timed[k]) for k in budgets)} a run: all "
        f"but the first, the warm-up), each round over isf's in the same round: median [min–max] of {rounds} "
        f"round{'s' if rounds != 1 else ''}. "
        "Time to quality runs on the same clock (the warm-up step counts zero seconds). **Bold** only where a "
        "strategy is ahead of every other beyond the runs' noise: paired by round, its tokens/s over each other's "
        "above 1 in every round; paired by seed, a 95% t-interval of the per-seed differences that excludes 0. "
        "Otherwise the last column says parity or within seed noise.",
        "",
        "| figure | " + " | ".join(names) + " | verdict |",
        "|---" * (len(names) + 2) + "|",
    ]
    for k in budgets:
        v = verdicts.speed_verdict(runs[k], report.timed)
        cells = []
        for n in names:
            p = figs[k][n]["paired"]
            cell = f"1.00× ({figs[k][n]['raw_tokens_per_s']:,.0f} tok/s)" if n == "isf" else _spread(p)
            cells.append(f"**{cell}**" if v["best"] == n else cell)
        text.append(f"| raw tokens/s over isf, {_packs(k)} per rank per step | " + " | ".join(cells)
                    + f" | {_speed_words(v)} |")
    arrow = " → ".join(_packs(k).split()[0] for k in budgets)
    text.append(f"| worst step, its real tokens over τ, {arrow} packs | "
                + " | ".join(" → ".join(_x(steps[k][n]["worst_over_target"], 2) for k in budgets) for n in names)
                + f" | each within one slot of τ (checked) |")
    text.append(f"| simulator's absolute tokens/s error, {arrow} packs | "
                + " | ".join(" → ".join(_sign(figs[k][n]["predicted_error"]) for k in budgets) for n in names)
                + " | a prediction, not a contest |")
    text += _quality_rows(runs[first], figs[first], names)
    if results.get("replay"):
        text += ["", _replay(results["replay"], names)]
    return "\n".join(text)


def _packs(k: int) -> str:
    return f"{k} long pack" + ("s" if k > 1 else "")


def _data(kind: str) -> str:
    return {"code": "real text (Python standard library modules as chats, `data_tools.make_code_data`)",
            "demo": "generated demo chats"}.get(kind, kind)


def _speed_words(v: dict) -> str:
    if not v["judged"]:
        return "one round: no spread, not judged"
    if v["best"]:
        low = min(v["against"].items(), key=lambda kv: kv[1]["min"])
        return f"{v['best']} best: above every other in every round (lowest: over {low[0]} {_spread(low[1])})"
    rest = ", ".join(f"{v['leader']} over {n} {_spread(v['against'][n])}" for n in v["parity"][1:])
    return f"parity: {', '.join(v['parity'])} ({rest})"


def _quality_rows(runs: dict, figs: dict, names: list) -> list:
    rows = []
    if not any(r["evals"] for r in runs["isf"]):
        return rows
    losses = {n: verdicts.final_losses_by_seed(runs[n]) for n in names}
    seeds = sorted(losses["isf"])
    lv = verdicts.loss_verdict(runs)
    cells = []
    for n in names:
        cell = f"{np.mean(list(losses[n].values())):.3f} ({' / '.join(f'{losses[n][s]:.3f}' for s in seeds)})"
        cells.append(f"**{cell}**" if lv["best"] == n else cell)
    rows.append(f"| held-out loss, mean (seeds {', '.join(map(str, seeds))}) | " + " | ".join(cells)
                + f" | {_quality_words(lv, 'lower')} |")
    ttq = {n: figs[n]["time_to_quality"] for n in names}
    tv = verdicts.time_verdict(ttq)
    cells = []
    for n in names:
        t = ttq[n]
        per_seed = " / ".join("never" if r is None else f"{r:.2f}" for r in t["ratios"])
        med = "never" if t["median"] is None else _x(t["median"], 2)
        cell = f"{med} ({per_seed}; {t['reached']}/{t['seeds']} reached)"
        cells.append(f"**{cell}**" if tv and tv["best"] == n else cell)
    rows.append("| time to isf's final held-out loss over isf's time, median (per seed) | " + " | ".join(cells)
                + f" | {_quality_words(tv, 'faster') if tv else 'no strategy reached it'} |")
    return rows


def _quality_words(v: dict, better: str) -> str:
    if not v["judged"]:
        return f"not judged: some comparison has fewer than 2 seeds (pairs: {v['pairs']})"
    n = v["pairs"]
    if v["best"]:
        return f"{v['best']} {better} than every other beyond seed noise (n = {n})"
    beaten = [name for name in v["against"] if name not in v["within_noise"]]
    if not beaten:
        return f"within seed noise (n = {n})"
    return (f"{v['leader']} {better} than {', '.join(beaten)} beyond seed noise; within seed noise of "
            f"{', '.join(v['within_noise'])} (n = {n})")


def _replay(replay: dict, names: list) -> str:
    worlds = sorted(replay, key=int)
    arrow = " → ".join(str(w) for w in worlds)
    lines = [f"Replay at W = {arrow} (bench/speed/replay.py; measured compute, modelled waiting, not a cluster run: "
             "[simulator.md](simulator.md)); one timing of each drawn pack's best of its repeats, so no "
             "spread and no bold:", "",
             "| speed-up over isf, W = " + arrow + " | " + " | ".join(names) + " |",
             "|---" * (len(names) + 1) + "|"]
    for key, label in (("replayed_speedup", "replayed (drawn steps' measured over simulated time, whole plan)"),
                       ("plan_simulated_speedup", "simulator")):
        lines.append(f"| {label} | " + " | ".join(" → ".join(_x(replay[w][n][key], 2) for w in worlds)
                                                 for n in names) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="write the block into docs/benchmarks.md")
    mode.add_argument("--check", action="store_true",
                      help="exit 1 when docs/benchmarks.md's block differs from the render")
    args = p.parse_args(argv)
    results = results_file.read_results(NAME)
    if results is None:
        print(f"no bench/results/{NAME}.json: run python bench/speed/bench_speed.py first", file=sys.stderr)
        return 2
    block = render(results)
    if args.write:
        results_file.write_block(NAME, block)
        print(f"docs/benchmarks.md: block {NAME} rendered from bench/results/{NAME}.json")
    elif args.check:
        if results_file.read_block(NAME) != block:
            print(f"docs/benchmarks.md's block {NAME} differs from what bench/results/{NAME}.json renders: "
                  "python bench/speed/results_table.py --write", file=sys.stderr)
            return 1
    else:
        print(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
