"""GPU acceptance: one command for a user's GPU node that checks the trainer end to end and writes one report.

    python bench/gpu_acceptance.py --out acceptance/            # a GPU node: fits --budget-s (default 8 minutes)
    python bench/gpu_acceptance.py --plan-only --out acceptance/  # what a GPU run would run, in what order, how long
    python bench/gpu_acceptance.py --dry-run --out /tmp/acc     # CPU: the same checks on a tiny shape, seconds

It prints its plan first (the checks in order, each with the seconds it is held to), then runs them and writes
``acceptance.json`` and ``acceptance.md`` into --out (the JSON after every check, so a run stopped early keeps what
it measured). Every figure is printed beside its target and a verdict (met / NOT met / skipped / stopped / n/a: a CPU
dry run judges nothing, it only proves the command still runs). The checks, in the order of their value:

  trainer       bench/trainer/bench_trainer.py in this process: our train_step against plain HF packed training of
                the same model on the same 16K packs, on the best HF attention that trains here (FA4, FA3, FA2 through
                attn_implementation where they import, else flex_attention): the speed path (bf16 parameters and
                AdamW states) first, then ours, then the accuracy path (fp32 master weights under bf16 autocast) in
                the time left; tokens/s ratio >= 1.2 against the faster, MFU >= 45% for the 1B shape at 16K bf16
  step_profile  bench/gpu/step_profile.py: torch.profiler over a few steps of ours and of that HF path (compiled
                already by the trainer check), kernel time by category (GEMM, attention, elementwise, LM head +
                loss, optimizer, collectives, copies, idle); ours with eager decoder kernels when time is left
  trainer_64k   the comparison at 64K packs, every layer checkpointed on both sides (HF's
                activation_checkpointing_enable), the HF implementation that ran at 16K, speed path only: tokens/s
                ratio >= 1.5; HF's full logits may not fit (~120 GB for a 128K vocabulary), then there is no ratio
                and the report says why
  memory        the analytic memory model (hbp_train/perf/memory.py), with the run's settings (one micro-batch per
                step, its attention backend and decoder kernels), against the peaks ours measured (error <= 10%)
  calibration   hbp_train.perf.calibrate: a calibration on this GPU timing what training runs (the probed backend,
                the decoder kernels, the fused LM-head loss), then the cost model's error on whole packs (<= 10%)
  backends      every packed attention backend installed here and our decoder kernels against a reference (the same
                weights in fp32 with HF's eager attention, one forward per document): loss and every parameter's
                gradient, each backend's forward+backward time, whether auto chose the fastest; flex is skipped once
                a varlen kernel passed (auto never picks it then; its compile takes minutes)
  longest_pack  the longest single-document pack our step trains, per checkpointing level (>= 128K tokens for the
                1B shape on 80 GB), in its budget
  profiler      hbp-profile end to end on the same shape (<= 5 minutes), in its budget

Each check is held to its budget (``BUDGET_S``; a dry run's ``DRY_BUDGET_S``): it plans its own parts within it and
is stopped at it (what it measured until then is kept and the check is reported as stopped). A check runs only if
its budget fits in what is left of --budget-s; one that does not is skipped, and the plan says beforehand which
checks the budget leaves out. What a check left out inside (the accuracy path, ours with eager kernels, flex in the
backends check) is printed and listed in the report with the reason. Between checks the GPU memory of the last one
is freed (its engine dropped, the allocator's cache emptied).

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

# Seconds each check is held to on a GPU, for the 1B shape at 16K on one H100/H200 (docs/gpu_results.md): the
# trainer check is mostly the best HF path's first step when that is flex_attention (its compile took 100-150 s
# there), plus ours (build, 3 + 10 steps); the step profile reuses that compile (same process) and builds ours twice;
# the 64K comparison compiles HF's flex once more. The first four fit the default budget with the start-up; the rest
# run when --budget-s leaves room (or the first ones finish early).
BUDGET_S = {"trainer": 210, "step_profile": 90, "trainer_64k": 140, "memory": 5, "calibration": 60, "backends": 90,
            "longest_pack": 90, "profiler": 120}
DRY_BUDGET_S = {"trainer": 60, "step_profile": 60, "trainer_64k": 60, "memory": 5, "calibration": 30, "backends": 30,
                "longest_pack": 30, "profiler": 30}
STARTUP_S = 30  # this process's imports and CUDA start-up before the first check (counted in --budget-s)
DEFAULT_BUDGET_S = 480.0  # fits an 8-minute slot on one GPU, start-up of this process included
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
    return p


def check_budget(name: str, budgets: dict, args) -> float:
    """The seconds check ``name`` is held to: its budget, for the search and the profiler at most their flag's."""
    seconds = float(budgets[name])
    if name in SHARE_CAPS:
        seconds = min(seconds, getattr(args, SHARE_CAPS[name]))
    return seconds


def make_plan(checks: list[str], budgets: dict, args, spent_s: float) -> list[dict]:
    """Each check in the order of value with its budget and where it would start if every check before it took its
    whole budget; "fits" when it would end within --budget-s (one that does not may still run if earlier ones
    finish early)."""
    plan, start = [], spent_s
    for name in checks:
        seconds = check_budget(name, budgets, args)
        plan.append({"check": name, "budget_s": seconds, "starts_at_s": start, "fits": start + seconds <= args.budget_s})
        start += seconds
    return plan


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
    budgets = DRY_BUDGET_S if args.dry_run else BUDGET_S
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
            result = dict(ctx.partial.get(name, dict)(), over_budget=over)
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
            print_plan(make_plan(_checks(args), BUDGET_S, args, STARTUP_S), args,
                       f"a GPU run, {STARTUP_S} s of start-up assumed")
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
