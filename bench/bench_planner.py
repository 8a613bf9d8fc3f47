"""Planner benchmark: isf, bfd, sorted, kk and hbp on a seeded long-tailed mix (1M samples by default), in one process.

    .venv/bin/python bench/bench_planner.py [--samples 1000000] [--repeats 3] [--world-size 32]
    .venv/bin/python bench/bench_planner.py --samples 10000000 --repeats 1 --strategies isf --no-cost-model  # 10M
    .venv/bin/python bench/bench_planner.py --samples 10000000 --cli  # the pack CLI on three mixes (MIXES)

``--cli`` runs ``python -m data_tools.pack --lengths L.npy --out plan.npz`` (hbp, no isf baseline) in a child process
for each mix of MIXES and prints, beside the targets (<= 1 s CPU, <= 1 GB peak RSS, plan.npz <= 40 MB at 10M
samples), the CPU seconds the CLI reports for reading the lengths, planning (metrics included) and writing the
plan, the child's whole CPU time (interpreter start and imports included), its peak RSS, the file size and the
plan's ABR / DBR / PR.

Mix: 95% chat-like samples (lognormal, median 600 tokens, sigma 1.2, clipped to [16, 32768]) and 5% long
documents (log-uniform 8K..128K). max_len 131072, W = 32 (--world-size), groups 16384:1,131072:8, W x 128K global
tokens (4M at W=32).
Prints hbp's planning time first (best of N: wall clock and process CPU seconds, compute only; the CPU figure is
the one to read on a shared machine), the process's peak RSS right after it (resource.getrusage: interpreter,
the mix and the plan included), the plan written as JSON and as the binary .npz (write time, size, and the time
to open it again: the .npz is memory-mapped), then the metrics of every strategy side by side with the
hbp/isf ratio and padding (PR) of the baselines, hbp with the paper's plain sort balancing for comparison, and
CR beside the share of tokens that must use SP. Targets: hbp plans 1M samples in <= 1 s, ABR <= 0.005,
DBR <= 0.01, PR <= 0.03; at 10M samples <= 1 s compute and <= 1 GB peak RSS.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from dataclasses import replace

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hbp_train.common.errors import EXIT_USER_ERROR, UserError  # noqa: E402
from hbp_train.planning import GroupSpec, PlanConfig, make_plan  # noqa: E402


def long_tailed_lengths(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    num_long = int(n * 0.05)
    chat = np.clip(np.round(rng.lognormal(np.log(600), 1.2, n - num_long)), 16, 32768)
    docs = np.round(np.exp(rng.uniform(np.log(8192), np.log(131072), num_long)))
    lengths = np.concatenate([chat, docs]).astype(np.int64)
    rng.shuffle(lengths)
    return lengths


def docs_lengths(n: int, seed: int = 0) -> np.ndarray:
    """95% chats (lognormal, median 300 tokens, sigma 1.0, clipped to [8, 16384]) and 5% documents of 8K..128K
    tokens (uniform)."""
    rng = np.random.default_rng(seed)
    num_docs = int(n * 0.05)
    chat = np.clip(np.round(rng.lognormal(np.log(300), 1.0, n - num_docs)), 8, 16384)
    lengths = np.concatenate([chat, rng.integers(8192, 131073, num_docs)]).astype(np.int64)
    rng.shuffle(lengths)
    return lengths


def pareto_lengths(n: int, seed: int = 0) -> np.ndarray:
    """One heavy tail, no separate documents: 64 x Pareto(alpha 1.1), clipped to 128K tokens."""
    rng = np.random.default_rng(seed)
    return np.minimum(np.round(64 * (1 + rng.pareto(1.1, n))), 131072).astype(np.int64)


# name -> (lengths(n, seed), world size, --groups): three differently shaped long tails for --cli.
MIXES = {
    "chat": (long_tailed_lengths, 32, "16384:1,131072:8"),
    "docs": (docs_lengths, 32, "16384:1,131072:8"),
    "pareto": (pareto_lengths, 64, "8192:1,32768:4,131072:8"),
}


def run_cli(lengths_path: str, plan_path: str, world_size: int, groups: str, seed: int) -> dict:
    """Run the pack CLI in a child process: its CPU line, whole CPU time (user + sys) and peak RSS (os.wait4)."""
    import subprocess

    cmd = [sys.executable, "-m", "data_tools.pack", "--lengths", lengths_path, "--out", plan_path, "--world-size",
           str(world_size), "--groups", groups, "--global-tokens", str(world_size * 131072), "--seed", str(seed),
           "--no-baseline", "--quiet"]
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    child = subprocess.Popen(cmd, cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = child.stdout.read()
    _, status, usage = os.wait4(child.pid, 0)
    if status:
        raise SystemExit(f"bench_planner: the pack CLI failed:\n{out}")
    line = next(x for x in out.splitlines() if x.startswith("CPU seconds"))
    phases = dict((k, float(v)) for k, v in (part.split()[-2:] for part in line.split(": ", 1)[1].split(", ")))
    return {"phases": phases, "process_cpu": usage.ru_utime + usage.ru_stime, "peak_rss_mb": usage.ru_maxrss / 1e3,
            "output": out}


def cli_main(args) -> None:
    """--cli: the pack CLI on every mix of MIXES (module docstring)."""
    from hbp_train.planning.plan_npz import open_npz

    print(f"python -m data_tools.pack --out plan.npz (hbp, --no-baseline), {args.samples} samples per mix, "
          f"seed {args.seed}; CPU seconds as the CLI reports them (read = np.load + checks, plan = planning and "
          "metrics, write = plan.npz)")
    with tempfile.TemporaryDirectory() as tmp:
        for name, (draw, world_size, groups) in MIXES.items():
            lengths_path, plan_path = os.path.join(tmp, f"{name}.npy"), os.path.join(tmp, f"{name}.npz")
            lengths = draw(args.samples, args.seed)
            np.save(lengths_path, lengths)
            del lengths
            res = run_cli(lengths_path, plan_path, world_size, groups, args.seed)
            header, _ = open_npz(plan_path)
            m, size = header["metrics"], os.path.getsize(plan_path) / 1e6
            cpu = res["phases"]["together"]
            print(f"\n{name}: W={world_size}, groups {groups}, {m['tokens'] / 1e9:.2f}G tokens, {m['num_packs']} packs")
            print(f"  CLI CPU: read {res['phases']['read']:.2f} s + plan {res['phases']['plan']:.2f} s + write "
                  f"{res['phases']['write']:.2f} s = {cpu:.2f} s [target <= 1 s: {'ok' if cpu <= 1 else 'MISSED'}]; "
                  f"whole process {res['process_cpu']:.2f} s CPU (interpreter and imports included)")
            print(f"  peak RSS {res['peak_rss_mb']:.0f} MB [target <= 1000 MB: "
                  f"{'ok' if res['peak_rss_mb'] <= 1000 else 'MISSED'}]; plan.npz {size:.1f} MB [target <= 40 MB: "
                  f"{'ok' if size <= 40 else 'MISSED'}]")
            print(f"  ABR {m['ABR']:.5f}  DBR {m['DBR']:.5f}  PR {m['PR']:.5f}  CR {m['CR']:.4f}  mix_TV "
                  f"{m['mix_TV']:.4f}  steps {m['num_steps']}")


def best_of(fn, repeats):
    """(best wall seconds, result) over ``repeats`` calls."""
    best, out = float("inf"), None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def best_cpu_of(fn, repeats):
    """(best wall seconds, best process CPU seconds, result): CPU time is what the planner itself used, unlike
    wall time, which other processes on a shared machine stretch."""
    wall, cpu, out = float("inf"), float("inf"), None
    for _ in range(repeats):
        t0, c0 = time.perf_counter(), time.process_time()
        out = fn()
        wall, cpu = min(wall, time.perf_counter() - t0), min(cpu, time.process_time() - c0)
    return wall, cpu, out


def peak_rss_mb() -> float:
    """Peak resident memory of this process so far, MB (ru_maxrss is KB on Linux, bytes on macOS)."""
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return rss / 1e6 if sys.platform == "darwin" else rss / 1e3


def plan_files(plan, tmp: str) -> list[tuple[str, float, float, float]]:
    """Write ``plan`` as JSON and as .npz: [(form, write s, MB, open s)] (the .npz opened memory-mapped; the JSON
    parsed only below 2M samples, where it takes seconds, not minutes)."""
    from hbp_train.planning.plan_npz import load_plan, save_plan

    from hbp_train.planning.plan_npz import open_npz

    out = []
    for form in ("json", "npz"):
        path = os.path.join(tmp, f"plan.{form}")
        t0 = time.perf_counter()
        save_plan(plan, path)
        written = time.perf_counter() - t0
        opened = float("nan")
        if form == "npz" or plan.num_samples < 2_000_000:
            t0 = time.perf_counter()
            load_plan(path)
            opened = time.perf_counter() - t0
        out.append((form, written, os.path.getsize(path) / 1e6, opened))
        if form == "npz":  # what the loader does (hbp_train/batches/loader.py): map the arrays, parse only the header
            t0 = time.perf_counter()
            open_npz(path)
            out.append(("npz, mapped", 0.0, os.path.getsize(path) / 1e6, time.perf_counter() - t0))
    return out


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=1_000_000, help="number of samples in the mix (default 1000000)")
    ap.add_argument("--repeats", type=int, default=3, help="timing repeats, the best is reported (default 3)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the mix and the planners (default 0)")
    ap.add_argument("--world-size", type=int, default=32, help="GPUs (W) the plan is made for (default 32)")
    ap.add_argument("--strategies", default="isf,bfd,sorted,kk,hbp-sort",
                    help="comma-separated strategies planned besides hbp (isf, bfd, sorted, kk, hbp-sort; isf is "
                         "always planned, as the reference of the ratios) (default isf,bfd,sorted,kk,hbp-sort)")
    ap.add_argument("--no-cost-model", action="store_true",
                    help="skip the extra hbp plan balanced with the cost model (default: plan it)")
    ap.add_argument("--global-tokens", type=int, default=None,
                    help="tokens per optimizer step (default W x 131072: one 128K pack's worth per GPU)")
    ap.add_argument("--cli", action="store_true",
                    help="time the pack CLI (plan.npz) on the three MIXES instead (ignores --strategies, --repeats, "
                    "--world-size, --global-tokens)")
    return ap


def main():
    ap = build_parser()
    args = ap.parse_args()
    if args.world_size < 8 or args.world_size % 8:
        ap.error("--world-size must be a multiple of 8 (the 131072:8 group needs W/8 replicas)")
    if args.samples < 1 or args.repeats < 1 or args.seed < 0:
        ap.error("--samples and --repeats must be >= 1, --seed >= 0")
    if args.cli:
        cli_main(args)
        return
    global_tokens = args.global_tokens or args.world_size * 131072
    lengths = long_tailed_lengths(args.samples, args.seed)
    groups = [GroupSpec(16384, 1), GroupSpec(131072, 8)]

    def cfg(strategy, balance="refine"):
        return PlanConfig(world_size=args.world_size, groups=groups, strategy=strategy, global_tokens=global_tokens,
                          max_len=131072,
                          seed=args.seed, balance=balance)

    print(f"{args.samples} samples, {lengths.sum() / 1e9:.2f}G tokens, W={args.world_size}, {global_tokens} tokens "
          f"per step, groups 16384:1,131072:8, best of {args.repeats}")
    known = {"isf": cfg("isf"), "bfd": cfg("bfd"), "sorted": cfg("sorted"), "kk": cfg("kk"),
             "hbp-sort": cfg("hbp", "sort")}
    others = ["isf"] + [n.strip() for n in args.strategies.split(",") if n.strip() and n.strip() != "isf"]
    bad = [n for n in others if n not in known]
    if bad:
        ap.error(f"--strategies: unknown {', '.join(bad)}; choose from {', '.join(known)}")
    # hbp first, so the peak RSS read right after it is the mix plus hbp's planning, nothing else.
    wall, cpu, hbp_plan = best_cpu_of(lambda: make_plan(lengths, cfg("hbp")), args.repeats)
    rss = peak_rss_mb()
    print(f"hbp planning: {cpu:.2f} s CPU ({wall:.2f} s wall) [target <= 1 s], peak RSS {rss:.0f} MB "
          f"[target <= 1000 MB] ({'ok' if cpu <= 1.0 else 'MISSED'} / {'ok' if rss <= 1000 else 'MISSED'})")
    with tempfile.TemporaryDirectory() as tmp:
        for form, written, size, opened in plan_files(hbp_plan, tmp):
            if form == "npz, mapped":
                print(f"plan.npz memory-mapped as the trainer's loader opens it: {opened * 1e3:.1f} ms")
                continue
            note = (f", read back as a Plan in {opened * 1e3:.0f} ms" if opened == opened
                    else ", not re-read (>= 2M samples)")
            print(f"plan.{form}: written in {written:.2f}s, {size:.1f} MB{note}")
    runs = {}
    for name in others:
        runs[name] = best_of(lambda c=known[name]: make_plan(lengths, c), args.repeats)
    runs["hbp"] = (wall, hbp_plan)
    names = list(runs)
    print(f"\n{'':<20}" + "".join(f"{n:>12}" for n in names) + f"{'hbp/isf':>12}")
    print(f"{'planning seconds':<20}" + "".join(f"{runs[n][0]:>12.3f}" for n in names)
          + f"{runs['hbp'][0] / runs['isf'][0]:>12.2f}")
    for key, fmt in (("ABR", ".5f"), ("DBR", ".5f"), ("PR", ".5f"), ("CR", ".4f"), ("sp_required_share", ".4f"),
                     ("AveT", ".0f"), ("num_steps", "d"), ("num_packs", "d"), ("empty_packs", "d")):
        vals = [runs[n][1].metrics[key] for n in names]
        isf_val = runs["isf"][1].metrics[key]
        ratio = runs["hbp"][1].metrics[key] / isf_val if isf_val else float("nan")
        print(f"{key:<20}" + "".join(f"{v:>12{fmt}}" for v in vals) + f"{ratio:>12.3f}")
    hbp = runs["hbp"][1].metrics
    print(f"\nhbp CR {hbp['CR']:.4f} vs tokens that must use SP {hbp['sp_required_share']:.4f} "
          f"(extra {hbp['CR'] - hbp['sp_required_share']:+.4f}: GreedyFill's short fillers in SP packs)")
    pr = {n: runs[n][1].metrics["PR"] for n in names if n in ("isf", "bfd", "sorted")}
    print("padding (PR) of the baselines: " + ", ".join(f"{n} {v:.5f}" for n, v in pr.items())
          + f"; hbp {hbp['PR']:.5f}")
    checks = [("time <= 1 s", cpu <= 1.0), ("ABR <= 0.005", hbp["ABR"] <= 0.005),
              ("DBR <= 0.01", hbp["DBR"] <= 0.01), ("PR <= 0.03", hbp["PR"] <= 0.03)]
    if args.no_cost_model:
        print("targets: " + ", ".join(f"{k}: {'ok' if v else 'MISSED'}" for k, v in checks))
        return
    # The balancer equalises a per-pack cost; with the cost model it balances predicted time instead of sum len^2.
    from hbp_train.perf.cost_model import CostModel, pack_cost_fn
    from hbp_train.planning.metrics import cost_balance_ratio

    cost_fn = pack_cost_fn(CostModel.from_calibration())
    timed, with_model = best_of(lambda: make_plan(lengths, replace(cfg("hbp"), pack_cost=cost_fn)), 1)
    print(f"\ntime balance (shipped cost model, mean slot imbalance of predicted pack seconds): "
          f"isf {cost_balance_ratio(runs['isf'][1], cost_fn):.5f}, hbp (sum len^2) "
          f"{cost_balance_ratio(runs['hbp'][1], cost_fn):.5f}, hbp (cost model) {cost_balance_ratio(with_model, cost_fn):.5f} "
          f"[ABR {with_model.metrics['ABR']:.5f}, planned in {timed:.2f}s]")
    print("targets: " + ", ".join(f"{k}: {'ok' if v else 'MISSED'}" for k, v in checks))


if __name__ == "__main__":
    try:
        main()
    except UserError as exc:  # a setting the planner refuses, named in one line
        print(f"bench_planner: error: {exc}", file=sys.stderr)
        sys.exit(EXIT_USER_ERROR)
