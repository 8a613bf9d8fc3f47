"""Where a training step's time goes: torch.profiler over a few steps after warm-up, kernel time summed by category,
for our step and the best plain HF path on the same packs.

    python bench/gpu/step_profile.py --out runs/profile                      # a GPU: Llama-3.2-1B shape, 16K packs, bf16
    python bench/gpu/step_profile.py --device cpu --out /tmp/profile         # CPU: tiny shape; CPU ops, figures meaningless

Paths (built as bench/trainer/bench_trainer.py builds them, bench/trainer/paths.py):
  ours        hbp_train's real ``trainer.train_step`` on the engine ``build.build_run`` makes (the decoder kernels and
              attention backend it would train with: model.kernels, model.attention_backend)
  hf_<impl>   the best plain HF path (``--baseline``, default best: the best packed-capable HF attention present,
              bf16 parameters and AdamW states; ``best:amp`` for the accuracy path; ``none``: ours only), held with
              --time-budget-s to what is left less --ours-reserve-s: a first step compiling flex for minutes stops in
              time for ours
  ours_eager  with --compare-kernels (default on when our decoder kernels are not ``none``): ours again with
              model.kernels=none (HF's own modules, Liger's RoPE taken out of transformers first), so the table
              shows what the fused kernels remove; with --time-budget-s only when as much time as ours took is left
The best HF path is tried as bench_trainer tries it: FA4, FA3, FA2 through attn_implementation where they import,
then flex_attention, each giving way to the next when it fails to build or to train.

Each path runs --warmup untimed steps, then --steps steps under torch.profiler (CPU and, on a GPU, CUDA activity).
Every step starts and ends with a device synchronisation, so its wall time holds all of its kernels. Categories
(`CATEGORIES`): every device kernel (on the CPU: every op's self time) goes to exactly one, first by where it was
launched from, then by its name (`kernel_category`):
  optimizer   inside the optimizer step (ours: ``engine.step``: clipping, DeepSpeed's bf16 optimizer, AdamW; HF: the
              gradient clipping, ``optimizer.step`` and ``zero_grad``), or a multi-tensor/Adam kernel anywhere
  loss        the LM head and the loss: launched inside the model's forward but outside its decoder, or by the
              backward of such an op
  attention   inside the attention function (its forward, or the backward of an op it ran), or a kernel named so
              (flash, fmha, flex, cuDNN SDPA)
  collective  NCCL/gloo kernels; memcpy: the runtime's memcpy/memset (host<->device and device copies)
  gemm        cuBLAS/CUTLASS/nvjet matrix products (on the CPU: aten::mm, addmm, bmm, ...)
  elementwise every other kernel: norms, RoPE, activations, casts, reductions, fused Triton kernels
  idle        the steps' wall time with no kernel running (host overhead, syncs, launch gaps)
Kernels on several streams may overlap (NCCL beside compute): ``overlap_ms`` is the kernel time that ran while
another kernel did, so the categories plus idle exceed the wall time by exactly that.

Writes --out/profile.json (every figure, the top kernels per category) and --out/profile.md (the table), each
atomically; with --trace, one Chrome trace per path. `profile_paths` is what bench/gpu_acceptance.py's step_profile
check runs (it writes the figures after each path, so a profile stopped from outside keeps the paths it had).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.trainer.deadline import Deadline, run_limited  # noqa: E402
from bench.trainer.paths import OPTIMIZER_SCOPE  # noqa: E402
from hbp_train.common.errors import EXIT_USER_ERROR, UserError  # noqa: E402
from hbp_train.common.outputs import atomic_write  # noqa: E402

CATEGORIES = ("gemm", "attention", "elementwise", "loss", "optimizer", "collective", "memcpy", "idle")
STEP_SCOPE, MODEL_SCOPE, DECODER_SCOPE, ATTENTION_SCOPE = "hbp/step", "hbp/model", "hbp/decoder", "hbp/attention"
BACKWARD_PREFIX = "autograd::engine::evaluate_function"

# Name patterns, checked in this order (the first hit wins: FA3's kernels are CUTLASS kernels named flash).
_NAME_RULES = (
    ("collective", ("nccl", "gloo", "c10d::", "record_param_comms", "allreduce", "all_reduce", "allgather",
                    "all_gather", "reduce_scatter", "alltoall", "all_to_all")),
    ("memcpy", ("memcpy", "memset")),
    ("optimizer", ("multi_tensor_apply", "adam", "_foreach_", "lamb_")),
    ("attention", ("flash", "fmha", "attention", "attn", "sdpa", "flex")),
    ("loss", ("nll_loss", "cross_entropy", "log_softmax", "logsoftmax", "logsumexp")),
    ("gemm", ("gemm", "cutlass", "cublas", "nvjet", "xmma", "aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm",
              "aten::matmul", "aten::linear", "aten::addmv", "aten::mv", "aten::dot")),
)


def kernel_category(name: str) -> str:
    """The category of a kernel (or CPU op) by its name alone; anything unnamed here is elementwise."""
    lowered = name.lower()
    for category, patterns in _NAME_RULES:
        if any(p in lowered for p in patterns):
            return category
    return "elementwise"


def categorise(work: list[dict], wall_us: float, busy_us: float) -> dict:
    """The table of one path: ``work`` items {name, dur_us, scope} (scope: optimizer, loss, attention or None),
    the steps' wall time and the time at least one item ran. Pure: tests feed it real and made-up traces."""
    totals = {c: 0.0 for c in CATEGORIES}
    top: dict[str, dict[str, float]] = {c: {} for c in CATEGORIES}
    for item in work:
        category = kernel_category(item["name"])
        if item.get("scope") and category not in ("collective", "memcpy"):
            category = item["scope"]
        totals[category] += item["dur_us"]
        top[category][item["name"]] = top[category].get(item["name"], 0.0) + item["dur_us"]
    kernel_us = sum(item["dur_us"] for item in work)
    totals["idle"] = max(wall_us - busy_us, 0.0)
    return {"wall_ms": wall_us / 1e3, "kernel_ms": kernel_us / 1e3, "busy_ms": busy_us / 1e3,
            "overlap_ms": max(kernel_us - busy_us, 0.0) / 1e3,
            "ms": {c: totals[c] / 1e3 for c in CATEGORIES},
            "share": {c: (totals[c] / wall_us if wall_us else 0.0) for c in CATEGORIES},
            "top_kernels": {c: [{"name": n[:160], "ms": t / 1e3} for n, t in
                                sorted(top[c].items(), key=lambda kv: -kv[1])[:5]] for c in CATEGORIES if top[c]}}


# -------------------------------------------------------------------------------------------- reading a trace
def _union_us(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


def _range_scope(name: str) -> str | None:
    """The scope a range of that name sets ("decoder": by name inside it), or None for any other op."""
    if name == ATTENTION_SCOPE:
        return "attention"
    if name == DECODER_SCOPE:
        return "decoder"
    if name == MODEL_SCOPE:
        return "loss"  # in the model's forward, outside its decoder: the LM head and the loss
    if name == OPTIMIZER_SCOPE or name.startswith(("Optimizer.step", "Optimizer.zero_grad")):
        return "optimizer"
    return None


def work_from_profile(prof, device_type: str) -> tuple[list[dict], float, float]:
    """(work items, wall µs, busy µs) of the STEP_SCOPE ranges in a finished torch.profiler run: device kernels on a
    GPU, ops' self times on the CPU (single-threaded steps: busy = their sum)."""
    from torch.autograd import DeviceType

    events = list(prof.events())
    steps = [(e.time_range.start, e.time_range.end) for e in events if e.name == STEP_SCOPE]
    if not steps:
        raise RuntimeError(f"no {STEP_SCOPE} range in the profile")
    wall = sum(end - start for start, end in steps)
    inside = lambda t: any(start <= t <= end for start, end in steps)  # noqa: E731
    cpu_ops = [e for e in events if e.device_type == DeviceType.CPU]
    # The forward op that made each autograd node, by (thread, sequence number): a backward op inherits its scope.
    forward_op = {}
    for e in cpu_ops:
        if e.sequence_nr >= 0 and not e.name.startswith(BACKWARD_PREFIX):
            forward_op.setdefault((e.thread, e.sequence_nr), e)
    memo: dict[int, str | None] = {}

    def scope_of(event) -> str | None:
        """The innermost range around the op decides; a backward op takes its forward op's scope (which, for a
        checkpointed layer's recompute, is again a backward op's)."""
        if event is None:
            return None
        if id(event) not in memo:
            memo[id(event)] = None  # (a cycle cannot happen; this only guards the recursion)
            if event.name.startswith(BACKWARD_PREFIX):
                verdict = scope_of(forward_op.get((event.fwd_thread, event.sequence_nr)))
            else:
                verdict = _range_scope(event.name)
                if verdict is None:
                    verdict = scope_of(event.cpu_parent)
            memo[id(event)] = verdict
        return memo[id(event)]

    def scope(event):
        verdict = scope_of(event)
        return None if verdict == "decoder" else verdict

    work = []
    if device_type == "cuda":
        # A kernel links to the op that launched it by the op's id; the runtime's launch events (linked themselves,
        # with ids of another numbering) are left out so that the two numberings cannot collide.
        by_id = {e.id: e for e in cpu_ops if not getattr(e, "linked_correlation_id", 0)}
        kernels = [e for e in events if e.device_type == DeviceType.CUDA and inside(e.time_range.start)]
        for k in kernels:
            op = by_id.get(getattr(k, "linked_correlation_id", 0))
            work.append({"name": k.name, "dur_us": k.time_range.end - k.time_range.start, "scope": scope(op)})
        busy = _union_us([(k.time_range.start, k.time_range.end) for k in kernels])
    else:
        for e in cpu_ops:
            if e.is_user_annotation or e.is_async or not inside(e.time_range.start) or e.self_cpu_time_total <= 0:
                continue
            work.append({"name": e.name, "dur_us": float(e.self_cpu_time_total), "scope": scope(e)})
        busy = min(sum(item["dur_us"] for item in work), wall)
    return work, wall, busy


# ------------------------------------------------------------------------------------------------ the paths
@contextlib.contextmanager
def _ranges(model_module, decoder_module, attention_name: str):
    """Profiler ranges around the model's forward (MODEL_SCOPE), its decoder's (DECODER_SCOPE) and every call of
    the attention function registered under ``attention_name`` (ATTENTION_SCOPE), for the time this is open."""
    import torch
    from transformers import AttentionInterface

    open_ranges, handles = [], []

    def enter(name):
        def hook(*_):
            ctx = torch.profiler.record_function(name)
            ctx.__enter__()
            open_ranges.append(ctx)
        return hook

    def leave(*_):
        open_ranges.pop().__exit__(None, None, None)

    for module, name in ((model_module, MODEL_SCOPE), (decoder_module, DECODER_SCOPE)):
        handles += [module.register_forward_pre_hook(enter(name)), module.register_forward_hook(leave)]
    mapping = AttentionInterface._global_mapping
    attention = mapping[attention_name]

    def scoped_attention(*args, **kwargs):
        with torch.profiler.record_function(ATTENTION_SCOPE):
            return attention(*args, **kwargs)

    mapping[attention_name] = scoped_attention
    try:
        yield
    finally:
        mapping[attention_name] = attention
        for handle in handles:
            handle.remove()


def profile_steps(step, batches: list, args, device) -> dict:
    """--warmup unprofiled calls of ``step(batch, i)``, then --steps profiled ones; returns the category table."""
    import torch
    from torch.profiler import ProfilerActivity

    for i in range(args.warmup):
        step(batches[i % len(batches)], i)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    t0 = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        for i in range(args.warmup, args.warmup + args.steps):
            with torch.profiler.record_function(STEP_SCOPE):
                step(batches[i % len(batches)], i)  # synchronises at its start and end (bench/trainer/paths.py)
    seconds = time.perf_counter() - t0
    work, wall, busy = work_from_profile(prof, device.type)
    table = categorise(work, wall, busy)
    table.update(steps=args.steps, profiled_wall_s=seconds, step_ms=wall / 1e3 / args.steps)
    if args.trace_dir:
        prof.export_chrome_trace(str(Path(args.trace_dir) / f"trace_{args.current_path}.json"))
    return table


def _profile_ours(args, architecture, hf_config, batches, device, kernels: str) -> dict:
    import bench.trainer.paths as paths
    from hbp_train.model.attention import ATTN_IMPLEMENTATION
    from hbp_train.model.attention_setup import describe_backend

    args.kernels = kernels
    run, backend = paths.build_ours(args, architecture, hf_config, device)
    engine_step = run.engine.step

    def scoped_step(*a, **kw):
        import torch

        with torch.profiler.record_function(OPTIMIZER_SCOPE):
            return engine_step(*a, **kw)

    run.engine.step = scoped_step
    try:
        with _ranges(run.engine.module, run.model.base_model, ATTN_IMPLEMENTATION):
            table = profile_steps(lambda batch, i: paths.ours_step(run, batch, i, args.ckpt_layers), batches, args,
                                  device)
    finally:
        del run.engine.step
        paths.destroy_ours(run)
        paths.release(device)
    return dict(table, attention=describe_backend(backend, device), decoder_kernels=run.model._hbp_kernels)


def _profile_hf(args, architecture, hf_config, baseline, packs, device) -> dict:
    import bench.trainer.paths as paths

    model, optimizer, amp = paths.build_hf(args, architecture, hf_config, baseline.impl, device, baseline.precision)
    try:
        params = [p for p in model.parameters() if p.requires_grad]
        batches = [paths.hf_batch(p, baseline.impl.startswith("flash_attention")) for p in packs]
        with _ranges(model, model.base_model, model.config._attn_implementation):
            table = profile_steps(lambda batch, i: paths.hf_step(model, optimizer, params, batch, device, amp),
                                  batches, args, device)
    finally:
        del model, optimizer
        paths.release(device)
    return dict(table, attention=baseline.impl, precision=baseline.precision, label=baseline.label)


def profile_paths(args, on_path=lambda result: None) -> dict:
    """Profile the HF baseline first (plain torch frees cleanly and sees no Liger RoPE), held to what is left less
    ``args.ours_reserve_s``, then ours, then ours with eager decoder kernels when asked; returns {"settings", "paths":
    {name: table}, "notes", "skipped"}; ``on_path(result so far)`` after each path."""
    import torch

    import bench.trainer.paths as paths
    from bench.trainer.workload import make_packs, pack_row, parse_shape
    from hbp_train.batches.collate import collate_pack
    from hbp_train.distributed.groups import init_distributed

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device here; use --device cpu for the CPU run")
    name, architecture, hf_config = parse_shape(args.model_shape)
    hf_config.setdefault("max_position_embeddings", max(131072, args.pack_len))
    init_distributed("gloo" if args.device == "cpu" else "nccl")
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    packs = make_packs(args.pack_len, args.warmup + args.steps, hf_config["vocab_size"], args.seed, 0.0)
    result = {"settings": {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU",
                           "model_shape": name, "pack_len": args.pack_len, "dtype": args.dtype,
                           "warmup": args.warmup, "steps": args.steps, "torch": torch.__version__},
              "paths": {}, "notes": [], "skipped": []}
    baselines, notes = ([], []) if args.baseline == "none" else \
        paths.resolve_baselines([args.baseline], device, args.dtype)
    result["notes"] += notes
    if args.baseline == "none":
        result["skipped"].append("hf: --baseline none (no HF path finished in the trainer check: its first step "
                                 "would compile for the whole budget)")
    deadline = Deadline(args.time_budget_s)
    reserve = getattr(args, "ours_reserve_s", None) or 0.0
    for baseline in baselines:  # "best": its fallbacks in turn, until one profiles
        args.current_path = baseline.key
        hf_deadline = Deadline(deadline.left() - reserve if deadline.seconds else None)
        profiled = _run_path(lambda: paths.measure_hf_best(args, architecture, hf_config, baseline, packs, device,
                                                           measure=_profile_hf), hf_deadline, "hf")
        if isinstance(profiled, tuple):
            table, ran, tried = profiled
            result["paths"][ran.key] = dict(table, tried=tried)
        else:
            result["paths"][baseline.key] = profiled
        on_path(result)
    batches = [collate_pack(pack_row(p), check_counts=False) for p in packs]
    args.current_path = "ours"
    started = time.monotonic()
    result["paths"]["ours"] = _run_path(lambda: _profile_ours(args, architecture, hf_config, batches, device,
                                                              args.kernels), deadline, "ours")
    on_path(result)
    took = time.monotonic() - started
    ours_kernels = result["paths"]["ours"].get("decoder_kernels", "")
    if args.compare_kernels and ours_kernels and not ours_kernels.startswith("none"):
        if deadline.left() < took:  # the same engine built and profiled again: as long as ours took
            result["skipped"].append(f"ours_eager: {max(deadline.left(), 0):.0f} s of the budget left, ours took "
                                     f"{took:.0f} s")
        else:
            args.current_path = "ours_eager"
            result["paths"]["ours_eager"] = _run_path(lambda: _profile_ours(args, architecture, hf_config, batches,
                                                                            device, "none"), deadline, "ours_eager")
            on_path(result)
    if device.type == "cpu":
        result["notes"].append("CPU run: ops' self times on the CPU; the figures say nothing about a GPU")
    return result


def _run_path(fn, deadline: Deadline, what: str):
    """fn()'s result, held to what is left of ``deadline``, or {"error": why} when it failed or ran out of time."""
    if deadline.seconds is not None and deadline.left() <= 0:
        return {"error": f"{what}: no time left (the profile's budget)"}
    try:
        result, over = run_limited(fn, deadline.left() if deadline.seconds is not None else None, what)
    except Exception as exc:  # noqa: BLE001 - one path failing (OOM, a missing kernel) is reported, not fatal
        from hbp_train.observe.telemetry import is_oom

        return {"error": "out of memory" if is_oom(exc) else
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    return {"error": f"{over} (the profile's budget)"} if over else result


# ----------------------------------------------------------------------------------------------------- report
def to_markdown(result: dict) -> str:
    s = result["settings"]
    paths = {k: v for k, v in result["paths"].items() if "error" not in v}
    lines = [f"Step profile on {s['device']}: {s['model_shape']}, {s['pack_len']}-token packs, {s['dtype']}, "
             f"{s['steps']} profiled steps after {s['warmup']} warm-up (ms per step)", "",
             "| category | " + " | ".join(paths) + " |", "|---|" + "---|" * len(paths)]
    for c in CATEGORIES:
        cells = [f"{v['ms'][c] / v['steps']:.1f} ({100 * v['share'][c]:.0f}%)" for v in paths.values()]
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines.append("| **step** | " + " | ".join(f"**{v['step_ms']:.1f}**" for v in paths.values()) + " |")
    lines.append("| overlap | " + " | ".join(f"{v['overlap_ms'] / v['steps']:.1f}" for v in paths.values()) + " |")
    lines.append("")
    for name, v in result["paths"].items():
        if "error" in v:
            lines.append(f"- {name}: did not run ({v['error']})")
        else:
            extra = f"; decoder kernels: {v['decoder_kernels']}" if "decoder_kernels" in v else \
                f" ({v.get('label', '')})"
            lines.append(f"- {name}: attention {v['attention']}{extra}")
    lines += [f"- note: {n}" for n in result["notes"]]
    lines += [f"- skipped {n}" for n in result.get("skipped", [])]
    for name, v in result["paths"].items():
        lines += [f"- {name} ran after {t}" for t in v.get("tried") or []]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    from hbp_train.common.cli import ArgumentParser

    p = ArgumentParser(prog="python bench/gpu/step_profile.py", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda", help="cuda (default) or cpu")
    p.add_argument("--model-shape", default=None, help="bench_trainer preset or JSON (default llama3.2-1b; cpu: tiny)")
    p.add_argument("--pack-len", type=int, default=None, help="tokens per pack (default 16384; cpu: 512)")
    p.add_argument("--warmup", type=int, default=2, help="unprofiled steps first (default 2)")
    p.add_argument("--steps", type=int, default=3, help="profiled steps per path (default 3)")
    p.add_argument("--baseline", default="best",
                   help="the HF path (bench_trainer --baselines syntax, one entry; default best; cpu: sdpa)")
    p.add_argument("--kernels", default="auto", help="our model.kernels (default auto)")
    p.add_argument("--backend", default="auto", help="our model.attention_backend (default auto)")
    p.add_argument("--compare-kernels", action=argparse.BooleanOptionalAction, default=True,
                   help="also profile ours with model.kernels=none when ours uses fused kernels (default on)")
    p.add_argument("--trace", action="store_true", help="also write a Chrome trace per path into --out")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="hold the profile to this many seconds (default: none): a path past it is stopped and "
                        "reported; ours_eager runs only when as much time as ours took is left")
    p.add_argument("--ours-reserve-s", type=float, default=0.0,
                   help="with --time-budget-s: seconds the HF path leaves for ours (default 0)")
    p.add_argument("--out", required=True, help="folder for profile.json and profile.md")
    return p


def resolve(args) -> argparse.Namespace:
    """The trainer benchmark's settings for these flags (one set of defaults: bench_trainer.resolve_args)."""
    import bench.trainer.bench_trainer as bench

    cpu = args.device == "cpu"
    argv = ["--device", args.device, "--model-shape", args.model_shape or ("tiny" if cpu else "llama3.2-1b"),
            "--pack-len", str(args.pack_len or (512 if cpu else 16384)), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--backend", args.backend, "--kernels", args.kernels,
            "--baselines", "none", "--max-pack-search", "0"]
    resolved = bench.resolve_args(bench.build_parser().parse_args(argv))
    if cpu and resolved.backend == "auto":
        resolved.backend = "sdpa_block"  # as bench_trainer: flex has no backward on the CPU
    resolved.baseline = args.baseline if not (cpu and args.baseline == "best") else "sdpa"
    resolved.ours_reserve_s = args.ours_reserve_s
    resolved.compare_kernels, resolved.trace_dir, resolved.current_path = args.compare_kernels, None, None
    resolved.time_budget_s = args.time_budget_s
    return resolved


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if args.device == "cpu":  # keep torch and DeepSpeed off any GPU (before the first CUDA query)
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        os.environ.setdefault(key, "1")
    try:
        resolved = resolve(args)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        resolved.trace_dir = str(out) if args.trace else None
        result = profile_paths(resolved)
    except UserError as exc:
        print(f"step_profile: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    text, markdown = json.dumps(result, indent=1) + "\n", to_markdown(result)
    atomic_write(out / "profile.json", lambda tmp: tmp.write_text(text))
    atomic_write(out / "profile.md", lambda tmp: tmp.write_text(markdown))
    print(to_markdown(result))
    print(f"wrote {out / 'profile.json'} and profile.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
