"""GPU acceptance: one command for a user's GPU node that checks the trainer end to end and writes one report.

    python bench/gpu_acceptance.py --out acceptance/            # a GPU node: fits --budget-s (default 8 minutes)
    python bench/gpu_acceptance.py --dry-run --out /tmp/acc     # CPU: the same checks on a tiny shape, seconds

It writes ``acceptance.json`` and ``acceptance.md`` into --out (the JSON after every check, so a run stopped by a
time limit keeps what it measured). Every figure is printed beside its target and a verdict (met / NOT met /
skipped / n/a: a CPU dry run judges nothing, it only proves the command still runs). The checks, in the order of
their value (each is given a share of --budget-s; one that no longer fits is skipped and reported as skipped, never
as met):

  step_profile  bench/gpu/step_profile.py: torch.profiler over a few steps of ours and of the best HF path, kernel time by
                category (GEMM, attention, elementwise, LM head + loss, optimizer, collectives, copies, idle); the
                table goes into the report. First: every later change is judged by it
  backends      every packed attention backend installed here (FA3, FA4, FA2, torch varlen, flex, sdpa_block) and
                our decoder kernels (model.kernels=auto: Liger where installed) against a reference (the same weights
                in fp32 with HF's eager attention, one forward per document): loss and every parameter's gradient;
                each backend's forward+backward time, and whether model.attention_backend=auto chose the fastest
  trainer       bench/trainer/bench_trainer.py in this process: our train_step against plain HF packed training of the
                same model on the same 16K packs, both HF paths: the speed path (bf16 parameters and AdamW states)
                and the accuracy path (fp32 master weights under bf16 autocast); the target is judged against the
                faster (tokens/s ratio >= 1.2, MFU >= 45% for the 1B shape at 16K bf16)
  trainer_64k   the same at 64K packs, every layer checkpointed on both sides (what fits one GPU for both; HF's
                activation_checkpointing_enable): tokens/s ratio >= 1.5
  calibration   hbp_train.perf.calibrate: a calibration on this GPU, then the cost model's error on whole packs
                timed through the trainer's chunked loss (<= 10%)
  longest_pack  the longest single-document pack our step trains, per checkpointing level (>= 128K tokens for the
                1B shape on 80 GB), in the time left to it
  memory        the analytic memory model (hbp_train/perf/memory.py) against the measured peaks of those packs
                (error <= 10%)
  profiler      hbp-profile end to end on the same shape (<= 5 minutes), in the time left to it

Between checks the GPU memory of the last one is freed (its engine dropped, the allocator's cache emptied).

On a CPU (--dry-run, implied there) the model is tiny, the figures mean nothing and every verdict is n/a; the test
suite runs it so that the command cannot rot before a GPU runs it. A check that raises is reported with its error
and the next one runs: the report is the product of this command, not a traceback.

This file plans the budget and runs the checks; each check is a function in bench/gpu/checks.py, the report's
verdicts and markdown are bench/gpu/report.py.
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

# Seconds a check needs at least (below that it is skipped), from runs on one H200 with the 1B shape
# (docs/gpu_results.md: the trainer check was mostly HF flex_attention's first-step compile, which step_profile now
# pays first: the compiled kernel stays in the process for the trainer check); a dry run on the CPU needs far less.
# step_profile and trainer_64k are not measured yet: their minimums are the compile plus a few steps. The search
# and the profiler take what is left of their share (their own budgets).
MIN_S = {"step_profile": 120, "backends": 30, "trainer": 90, "trainer_64k": 60, "calibration": 50,
         "longest_pack": 40, "memory": 0, "profiler": 60}
DRY_MIN_S = {"step_profile": 1, "backends": 1, "trainer": 3, "trainer_64k": 2, "calibration": 1, "longest_pack": 2,
             "memory": 0, "profiler": 1}
DEFAULT_BUDGET_S = 480.0  # fits an 8-minute slot on one H100, start-up of this process included


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/gpu_acceptance.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for acceptance.json and acceptance.md")
    p.add_argument("--dry-run", "--tiny", action="store_true", dest="dry_run",
                   help="tiny shape on the CPU: proves the command runs; the figures mean nothing (implied "
                        "without a GPU)")
    p.add_argument("--checks", default=",".join(CHECKS), help=f"comma separated subset of {','.join(CHECKS)}")
    p.add_argument("--model-shape", default=None, help="bench_trainer preset (default llama3.2-1b; tiny dry run)")
    p.add_argument("--pack-len", type=int, default=None, help="comparison pack length (default 16384; 256 dry run)")
    p.add_argument("--baselines", default="best,best:amp",
                   help="the trainer checks' HF baselines (bench_trainer --baselines; default best,best:amp: the best "
                        "HF attention present on the speed path and on the accuracy path; a dry run: sdpa,sdpa:amp)")
    p.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                   help=f"seconds the whole command may take, counted from its start (default {DEFAULT_BUDGET_S:.0f}): "
                        "a check runs when its minimum still fits and takes what is left after the later checks' "
                        "minimums; one that no longer fits is skipped and reported as skipped")
    p.add_argument("--search-budget-s", type=float, default=200.0,
                   help="longest-pack search: at most this many seconds, less if --budget-s leaves less (default 200)")
    p.add_argument("--profile-budget-s", type=float, default=240.0,
                   help="profiler: at most this many seconds, less if --budget-s leaves less (default 240)")
    return p


# Checks whose own time limit is the share the budget gives them (capped by their flag).
SHARE_CAPS = {"longest_pack": "search_budget_s", "profiler": "profile_budget_s"}


def plan_share(name: str, checks: list[str], left_s: float, mins: dict, args) -> float | None:
    """Seconds check ``name`` may take, or None to skip it: it runs when its own minimum fits in what is left (the
    checks come in the order of their value, so an earlier one never waits for a later one) and then takes what is
    left once the later checks' minimums are set aside, at least its own minimum; the search and the profiler at
    most their own flag's seconds."""
    if left_s <= 0 or left_s < mins[name]:
        return None
    later = checks[checks.index(name) + 1:]
    share = max(left_s - sum(mins[c] for c in later), mins[name])
    if name in SHARE_CAPS:
        share = min(share, getattr(args, SHARE_CAPS[name]))
    return share


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
    checks = [c.strip() for c in args.checks.split(",") if c.strip()]
    unknown = set(checks) - set(CHECKS)
    if unknown:
        raise UserError(f"--checks: unknown {', '.join(sorted(unknown))}; choose from {', '.join(CHECKS)}")
    shape_name = args.model_shape or ("tiny" if args.dry_run else "llama3.2-1b")
    _, _, hf_config = parse_shape(shape_name)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ctx = SimpleNamespace(args=args, dry_run=args.dry_run, device=device, out=out, shape_name=shape_name,
                          hf_config=hf_config, dtype=torch.bfloat16 if gpu else torch.float32,
                          pack_len=args.pack_len or (16384 if gpu else 256))
    report = {"acceptance": 1, "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "device": torch.cuda.get_device_name(device) if gpu else "CPU", "dry_run": args.dry_run,
              "model_shape": shape_name, "torch": torch.__version__, "budget_s": args.budget_s, "checks": {},
              "complete": False}
    checks = [c for c in CHECKS if c in checks]  # the order of value, whatever order --checks gave
    mins = DRY_MIN_S if args.dry_run else MIN_S
    for name in checks:
        left = args.budget_s - (time.monotonic() - started)
        ctx.share_s = plan_share(name, checks, left, mins, args)
        if ctx.share_s is None:
            why = f"{max(left, 0):.0f} s of the budget left, it needs at least {mins[name]} s"
            print(f"[acceptance] {name}: skipped ({why})", flush=True)
            report["checks"][name] = {"budget_skipped": why, "seconds": 0.0}
            write(report, out)
            continue
        t0 = time.monotonic()
        print(f"[acceptance] {name} ({ctx.share_s:.0f} s share of {left:.0f} s left) ...", flush=True)
        try:
            result = CHECK_FNS[name](ctx)
        except Exception as exc:  # noqa: BLE001 - reported in the report; the next check still runs
            traceback.print_exc()
            result = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
        result["seconds"] = round(time.monotonic() - t0, 2)
        report["checks"][name] = result
        report["elapsed_s"] = round(time.monotonic() - started, 1)
        free_device_memory(device)
        write(report, out)
    report["complete"] = True
    report["elapsed_s"] = round(time.monotonic() - started, 1)
    write(report, out)
    return report


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
        report = run(args, started)
    except UserError as exc:
        print(f"gpu_acceptance: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(to_markdown(report))
    print(f"wrote {Path(args.out) / 'acceptance.json'} and acceptance.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
