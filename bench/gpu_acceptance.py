"""GPU acceptance: one command for a user's GPU node that checks the trainer end to end and writes one report.

    python bench/gpu_acceptance.py --out acceptance/            # a GPU node: fits --budget-s (default 7 minutes)
    python bench/gpu_acceptance.py --plan-only --out acceptance/  # a GPU run's window plan and its checks, how long
    python bench/gpu_acceptance.py --dry-run --out /tmp/acc     # CPU: the same checks on a tiny shape, seconds

It prints its plan first (the checks in order, each with the seconds it is held to), then runs them and writes
``acceptance.json`` and ``acceptance.md`` into --out (the JSON after every check, atomically, so a run stopped early
keeps what it measured). --plan-only also prints the window plan: the default run fits one 15-minute window on a
fresh GPU node with the machine's start and the wheels' installation (``WINDOW_PLAN_S``), and leaves room to rerun a
check alone. Every figure is printed beside its target and a verdict (met / NOT met / skipped / stopped / n/a: a CPU
dry run judges nothing, it only proves the command still runs). The checks, in the order of their value:

  trainer       bench/trainer/bench_trainer.py in this process: our train_step against plain HF packed training of
                the same model on the same 16K packs, on the best HF attention that trains here (FA4, FA3, FA2 through
                attn_implementation where they import, else flex_attention): the speed path (bf16 parameters and
                AdamW states) first, with the time its first step's compile needs, then ours (so the ratio is the
                first figure measured), then the accuracy path (fp32 master weights under bf16 autocast) in the
                time left; tokens/s ratio >= 1.2 against the faster, MFU >= 45% for the 1B shape at 16K bf16
  step_profile  bench/gpu/step_profile.py: torch.profiler over a few steps of ours and of that HF path (compiled
                already by the trainer check; none when no HF path finished there), kernel time by category (GEMM,
                attention, elementwise, LM head + loss, optimizer, collectives, copies, idle), a share of the
                budget kept for ours; ours with eager decoder kernels when time is left
  trainer_64k   the comparison at 64K packs, every layer checkpointed on both sides (HF's
                activation_checkpointing_enable), the HF implementation that ran at 16K, speed path only: tokens/s
                ratio >= 1.5. HF's full logits and model states cannot fit 80 GB (78 GiB of logits for a 128K
                vocabulary, 9 GiB of states for 1B parameters): the HF path is then not tried, the report says
                "cannot fit" in place of the ratio and ours runs alone; on a larger GPU it runs when its compile
                fits the budget (--check-budget trainer_64k=SECONDS)
  memory        the analytic memory model (hbp_train/perf/memory.py), with the run's settings (one micro-batch per
                step, its attention backend and decoder kernels), against the peaks ours measured (error <= 10%)
  calibration   hbp_train.perf.calibrate: a calibration on this GPU timing what training runs (the probed backend,
                the decoder kernels, the fused LM-head loss), then the cost model's error on whole packs (<= 10%)
  backends      every packed attention backend installed here and our decoder kernels against a reference (the same
                weights in fp32 with HF's eager attention, one forward per document): loss and every parameter's
                gradient, each backend's forward+backward time, whether auto chose the fastest; flex is skipped once
                a varlen kernel passed (auto never picks it then; its compile takes minutes)
  longest_pack  the longest single-document pack our step trains, per checkpointing level (>= 128K tokens for the
                1B shape on 80 GB), in its budget (its engine's build comes off it; stopped: the attempts made)
  profiler      hbp-profile end to end on the same shape (<= 5 minutes), in its budget (stopped: its measurements)

Each check is held to its budget (``BUDGET_S``, or --check-budget NAME=SECONDS; a dry run's ``DRY_BUDGET_S``): it
plans its own parts within it and is stopped at it (what it measured until then is kept, from what it wrote after
each part, and the check is reported as stopped). A check runs only if
its budget fits in what is left of --budget-s; one that does not is skipped, and the plan says beforehand which
checks the budget leaves out. What a check left out inside (the accuracy path, ours with eager kernels, flex in the
backends check) is printed and listed in the report with the reason. Between checks the GPU memory of the last one
is freed (its engine destroyed, also when it was stopped, the allocator's cache emptied).

On a CPU (--dry-run, implied there) the model is tiny, the figures mean nothing and every verdict is n/a; the test
suite runs it so that the command cannot rot before a GPU runs it. A check that raises is reported with its error
and the next one runs: the report is the product of this command, not a traceback.

This file plans the budget and runs the checks; each check is a function in bench/gpu/checks.py, the report's
verdicts and markdown are bench/gpu/report.py, the time limits bench/trainer/deadline.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hbp_train.common.errors import EXIT_USER_ERROR, UserError  # noqa: E402
from hbp_train.train import set_cuda_allocator  # noqa: E402

from bench.gpu.checks import CHECK_FNS, CHECKS  # noqa: E402
from bench.gpu.report import all_verdicts, to_markdown, verdict, write  # noqa: E402, F401
from bench.trainer.deadline import run_limited  # noqa: E402

# Seconds each check is held to on a GPU, for the 1B shape at 16K on one H100/H200 (docs/gpu_results.md). The
# trainer check holds the headline: the best HF path's first step when that is flex_attention (its compile took
# 100-150 s on an H200; its share is what is left of the 300 s less 60 s kept for ours: ~225 s), then ours (build,
# 3 + 10 steps). The step profile reuses that compile (same process), ours keeps 40 s of it. The 64K check runs ours
# alone on 80 GB (HF cannot fit there: its time went to the trainer check). The first two fit the default budget with
# the start-up; the 64K check and the memory model run as soon as the trainer check ends early, as it does when its
# accuracy path does not fit (the usual case); the rest run with a larger --budget-s.
BUDGET_S = {"trainer": 300, "step_profile": 75, "trainer_64k": 50, "memory": 5, "calibration": 60, "backends": 90,
            "longest_pack": 90, "profiler": 120}
DRY_BUDGET_S = {"trainer": 60, "step_profile": 60, "trainer_64k": 60, "memory": 5, "calibration": 30, "backends": 30,
                "longest_pack": 30, "profiler": 30}
STARTUP_S = 30  # this process's imports and CUDA start-up before the first check (counted in --budget-s)
DEFAULT_BUDGET_S = 420.0  # this command in one 15-minute window (WINDOW_PLAN_S), its start-up included
# One GPU window, as a lent or rented node gives it (seconds, assumed): a fresh machine's start and the repository's
# copy, the wheelhouse's installation (./launch.sh wheelhouse ... --node-has, pip --no-index), this command, the
# report's files back; what is left is room to rerun a check alone (--checks NAME).
WINDOW_S = 900
WINDOW_PLAN_S = {"machine start": 180, "wheels installed": 60, "this command": DEFAULT_BUDGET_S, "files back": 15}
# The search and the profiler have their own time flags: their budget is the smaller of the two.
SHARE_CAPS = {"longest_pack": "search_budget_s", "profiler": "profile_budget_s"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/gpu_acceptance.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for acceptance.json and acceptance.md")
    p.add_argument("--dry-run", "--tiny", action="store_true", dest="dry_run",
                   help="tiny shape on the CPU: proves the command runs; the figures mean nothing (implied "
                        "without a GPU)")
    p.add_argument("--plan-only", action="store_true",
                   help="print what a GPU run would run (the checks in order, each with its budget) and stop")
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma separated subset of {','.join(CHECKS)}")
    p.add_argument("--model-shape", default=None, help="bench_trainer preset (default llama3.2-1b; tiny dry run)")
    p.add_argument("--pack-len", type=int, default=None, help="comparison pack length (default 16384; 256 dry run)")
    p.add_argument("--baselines", default="best,best:amp",
                   help="the 16K comparison's HF baselines (bench_trainer --baselines; default best,best:amp: the "
                        "best HF attention that trains here, on the speed path and on the accuracy path; a dry run: "
                        "sdpa,sdpa:amp)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help=f"seconds the whole command may take, counted from its start (default {DEFAULT_BUDGET_S:.0f}): "
                        "a check runs when its budget fits in what is left, and is stopped at its budget")
    p.add_argument("--search-budget-s", type=float, default=200.0,
                   help="longest-pack search: at most this many seconds (default 200)")
    p.add_argument("--profile-budget-s", type=float, default=240.0,
                   help="profiler: at most this many seconds (default 240)")
    p.add_argument("--check-budget", action="append", default=[], metavar="NAME=SECONDS",
                   help="hold check NAME to SECONDS instead of its default (repeatable), e.g. trainer=600 to rerun "
                        "the comparison alone with more time for HF's compile")
    p.add_argument("--window-s", type=float, default=WINDOW_S,
                   help=f"--plan-only: the GPU window the window plan fits (default {WINDOW_S}: 15 minutes)")
    return p


def budgets_of(args, dry_run: bool) -> dict:
    """Each check's seconds: BUDGET_S (a dry run: DRY_BUDGET_S) with --check-budget's; UserError for a bad one."""
    budgets = dict(DRY_BUDGET_S if dry_run else BUDGET_S)
    for item in args.check_budget:
        name, _, seconds = item.partition("=")
        try:
            value = float(seconds)
        except ValueError:
            value = -1.0
        if name not in budgets or value <= 0:
            raise UserError(f"--check-budget {item}: give NAME=SECONDS with NAME one of {', '.join(CHECKS)} and "
                            "SECONDS > 0")
        budgets[name] = value
    return budgets


def check_budget(name: str, budgets: dict, args) -> float:
    """The seconds check ``name`` is held to: its budget, for the search and the profiler at most their flag's."""
    seconds = float(budgets[name])
    if name in SHARE_CAPS:
        seconds = min(seconds, getattr(args, SHARE_CAPS[name]))
    return seconds


def make_plan(checks: list[str], budgets: dict, args, spent_s: float) -> list[dict]:
    """Each check in the order of value with its budget and where it would start if every check before it that fits
    took its whole budget; "fits" when it would end within --budget-s (one that does not may still run if earlier
    ones finish early; the ones after it are planned as if it were skipped, as it would be)."""
    plan, start = [], spent_s
    for name in checks:
        seconds = check_budget(name, budgets, args)
        fits = start + seconds <= args.budget_s
        plan.append({"check": name, "budget_s": seconds, "starts_at_s": start, "fits": fits})
        start += seconds if fits else 0.0
    return plan


def window_plan(plan: list[dict], args) -> list[tuple[str, float, str]]:
    """(step, seconds, note) of one GPU window: the machine's start, the wheels, this command, the files back, and
    what is left, with the checks a rerun of one alone (its start-up included) fits in."""
    steps = [(name, float(args.budget_s if name == "this command" else seconds), "")
             for name, seconds in WINDOW_PLAN_S.items()]
    left = args.window_s - sum(seconds for _, seconds, _ in steps)
    rerun = [row["check"] for row in plan if STARTUP_S + row["budget_s"] <= left]
    steps.append(("left", left, f"a rerun of one check alone fits: {', '.join(rerun)}" if rerun and left > 0 else
                  "no room for a rerun" if left >= 0 else "over the window: lower --budget-s"))
    return steps


def print_window(steps: list, args) -> None:
    print(f"[acceptance] window plan (one {args.window_s:.0f} s GPU window on a fresh node; seconds assumed but this "
          "command's):", flush=True)
    for name, seconds, note in steps:
        print(f"  {name:<17}{seconds:>5.0f} s{'  ' + note if note else ''}", flush=True)


def print_plan(plan: list[dict], args, what: str) -> None:
    print(f"[acceptance] plan ({what}; --budget-s {args.budget_s:.0f} counted from the start):", flush=True)
    for i, row in enumerate(plan, 1):
        when = "" if row["fits"] else ("  skipped unless earlier checks finish early (the budget ends before it "
                                      f"would: planned from {row['starts_at_s']:.0f} s)")
        print(f"  {i}. {row['check']} {row['budget_s']:.0f} s{when}", flush=True)


def free_device_memory(device) -> None:
    """Drop what the last check left (engines, models, cached blocks) before the next one measures memory."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def run(args, started: float) -> dict:
    import torch

    from bench.trainer.workload import parse_shape

    gpu = torch.cuda.is_available() and not args.dry_run
    args.dry_run = not gpu
    device = torch.device("cuda", torch.cuda.current_device()) if gpu else torch.device("cpu")
    checks = _checks(args)
    shape_name = args.model_shape or ("tiny" if args.dry_run else "llama3.2-1b")
    _, _, hf_config = parse_shape(shape_name)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = SimpleNamespace(args=args, dry_run=args.dry_run, device=device, out=out, shape_name=shape_name,
                          hf_config=hf_config, dtype=torch.bfloat16 if gpu else torch.float32,
                          pack_len=args.pack_len or (16384 if gpu else 256), partial={})
    budgets = budgets_of(args, args.dry_run)
    plan = make_plan(checks, budgets, args, time.monotonic() - started)
    print_plan(plan, args, "a dry run on the CPU: tiny shape" if args.dry_run else f"on {torch.cuda.get_device_name(device)}")
    report = {"acceptance": 1, "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(device) if gpu else "CPU", "dry_run": args.dry_run,
              "model_shape": shape_name, "torch": torch.__version__, "budget_s": args.budget_s,
              "plan": plan, "checks": {}, "complete": False}
    for name in checks:
        left = args.budget_s - (time.monotonic() - started)
        ctx.share_s = check_budget(name, budgets, args)
        if ctx.share_s > left:
            why = f"{max(left, 0):.0f} s of the command's budget left, its budget is {ctx.share_s:.0f} s"
            print(f"[acceptance] {name}: skipped ({why})", flush=True)
            report["checks"][name] = {"budget_skipped": why, "seconds": 0.0}
            write(report, out)
            continue
        t0 = time.monotonic()
        print(f"[acceptance] {name} (held to {ctx.share_s:.0f} s; {left:.0f} s of the budget left) ...", flush=True)
        try:
            result, over = run_limited(lambda: CHECK_FNS[name](ctx), ctx.share_s, name)
        except Exception as exc:  # noqa: BLE001 - reported in the report; the next check still runs
            traceback.print_exc()
            result, over = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}, None
        if over:  # stopped at its budget: what it had measured, and that it was stopped
            print(f"[acceptance] {name}: {over}", flush=True)
            result = dict(_partial(ctx, name), over_budget=over)
        for skipped in result.get("skipped") or []:
            print(f"[acceptance] {name}: skipped {skipped}", flush=True)
        if result.get("skipped_check"):
            print(f"[acceptance] {name}: skipped ({result['skipped_check']})", flush=True)
        result["seconds"] = round(time.monotonic() - t0, 2)
        report["checks"][name] = result
        report["elapsed_s"] = round(time.monotonic() - started, 1)
        free_device_memory(device)
        write(report, out)
    report["complete"] = True
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    write(report, out)
    return report


def _partial(ctx, name: str) -> dict:
    """What a stopped check measured (``ctx.partial[name]()``); a failure to read it is reported in it, never raised:
    the report is this command's product."""
    try:
        return ctx.partial.get(name, dict)()
    except Exception as exc:  # noqa: BLE001 - the report must still be written
        return {"partial_error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}


def _checks(args) -> list[str]:
    """The checks asked for, in the order of value whatever order --checks gave; UserError for an unknown one."""
    asked = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = set(asked) - set(CHECKS)
    if unknown:
        raise UserError(f"--checks: unknown {', '.join(sorted(unknown))}; choose from {', '.join(CHECKS)}")
    return [c for c in CHECKS if c in asked]


def main(argv=None) -> int:
    started = time.monotonic()
    args = build_parser().parse_args(argv)
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(key, "1")
    set_cuda_allocator()  # the trainer's allocator setting (hbp_train/train.py)
    if args.dry_run:  # keep torch and DeepSpeed off any GPU (before the first CUDA query)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        if args.plan_only:  # a GPU run's plan, wherever this runs
            plan = make_plan(_checks(args), budgets_of(args, dry_run=False), args, STARTUP_S)
            print_window(window_plan(plan, args), args)
            print_plan(plan, args, f"a GPU run, {STARTUP_S} s of start-up assumed")
            return 0
        report = run(args, started)
    except UserError as exc:
        print(f"gpu_acceptance: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(to_markdown(report))
    print(f"wrote {Path(args.out) / 'acceptance.json'} and acceptance.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
