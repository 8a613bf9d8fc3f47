"""The GPU acceptance checks, one function each: ``check_<name>(ctx) -> dict`` with its figures and verdicts.

``ctx`` carries the run's settings (device, dtype, model shape, pack length, output folder, dry run), the seconds
this check is held to (``share_s``: bench/gpu_acceptance.py stops it there), what earlier checks found (the HF
implementation that ran, the measured peaks) and ``partial``: per check, a function returning what it measured so
far, for a check stopped at its budget (every check keeps one: what it wrote after each part, read back whole
because it is written atomically). A check plans its own parts within ``share_s`` (``inner_budget``) and lists what
it left out and why under "skipped". What a check runs lives in its own module: the trainer comparison in
bench/trainer/, the step profile in bench/gpu/step_profile.py, the backends in bench/gpu/backends_check.py, the
calibration in hbp_train/perf/calibrate/, the profiler in hbp_train/profiler/.
"""

from __future__ import annotations

import json
import time

from bench.gpu.backends_check import check_backends
from bench.gpu.report import verdict
from hbp_train.common.outputs import atomic_write

# The profiler's time budget counts its measurements only: its set-up (the model built on the GPU, the back-end's
# first compile) comes off its share first, and the last measurement it starts, its choice and its file after it.
PROFILER_SETUP_S = 30
PROFILER_TAIL_S = 20
# Seconds kept for ours while the HF path before it runs: our engine's build (DeepSpeed, Liger's probe) and a few
# steps of the 1B shape at 16K on one H100/H200 (bench_trainer --ours-reserve-s, step_profile --ours-reserve-s).
OURS_RESERVE_S = 60
PROFILE_OURS_RESERVE_S = 40

# In the order of their value: ours against the best HF path at 16K (the figure the work is judged by), where the
# step's time goes, the same at 64K, the memory model against the peaks just measured, the cost model, then every
# backend against the reference, the longest pack and the profiler.
CHECKS = ("trainer", "step_profile", "trainer_64k", "memory", "calibration", "backends", "longest_pack", "profiler")


def inner_budget(ctx) -> float:
    """Seconds a check plans its parts in: its share less a margin for freeing what it built, so that its planned
    parts end before the hard stop at ``share_s``."""
    return max(ctx.share_s - max(5.0, 0.05 * ctx.share_s), 1.0)


def check_step_profile(ctx) -> dict:
    """bench/gpu/step_profile.py: kernel time by category for the best HF path, ours, and ours with eager decoder kernels
    (when ours fuses them); written to step_profile.json/.md and shown in the report."""
    import bench.gpu.step_profile as gp

    budget = inner_budget(ctx)
    argv = ["--device", ctx.device.type, "--model-shape", ctx.shape_name, "--pack-len", str(ctx.pack_len),
            "--out", str(ctx.out), "--time-budget-s", str(budget),
            "--ours-reserve-s", str(min(PROFILE_OURS_RESERVE_S, 0.6 * budget))]
    baseline = hf_baseline(ctx)
    if baseline:
        argv += ["--baseline", baseline]
    if ctx.dry_run:
        argv += ["--steps", "1", "--warmup", "1"]
    path = ctx.out / "step_profile.json"
    path.unlink(missing_ok=True)

    def partial() -> dict:  # the paths profiled before the stop (step_profile writes them after each)
        profile = read_json(path)
        return _profile_result(ctx, profile, gp) if profile else {}

    keep_partial(ctx, "step_profile", partial)
    profile = gp.profile_paths(gp.resolve(gp.build_parser().parse_args(argv)),
                               on_path=lambda profile: write_json(path, profile))
    write_json(path, profile)
    return _profile_result(ctx, profile, gp)


def _profile_result(ctx, profile: dict, gp) -> dict:
    markdown = gp.to_markdown(profile)
    atomic_write(ctx.out / "step_profile.md", lambda tmp: tmp.write_text(markdown))
    ours = profile["paths"].get("ours", {})
    return {"profile": profile, "markdown": markdown, "skipped": profile.get("skipped", []),
            "verdict": verdict("loss_share", (ours.get("share") or {}).get("loss"), ctx.dry_run)}


def hf_baseline(ctx) -> str | None:
    """The HF path later checks run: the one the trainer check found trains here (its first step compiled already,
    in this process); "none" when the trainer check ran and no HF path finished there (a "best" would compile flex
    again for the whole budget and leave ours nothing); None (each check's default, "best") without a trainer check."""
    if getattr(ctx, "best_hf_impl", None):
        return ctx.best_hf_impl
    if getattr(ctx, "trainer_results", None) is not None and not ctx.dry_run:
        return "none"
    return None


def keep_partial(ctx, name: str, partial) -> None:
    """Register ``partial()``: what check ``name`` measured so far, read if it is stopped at its budget."""
    ctx.partial = getattr(ctx, "partial", {})
    ctx.partial[name] = partial


def read_json(path) -> dict | None:
    """A JSON file a stopped check wrote, or None: missing, or (not written by this command) not whole."""
    try:
        return json.loads(path.read_text()) if path.exists() else None
    except (OSError, ValueError):
        return None


def write_json(path, data: dict) -> None:
    text = json.dumps(data, indent=1, default=str) + "\n"
    atomic_write(path, lambda tmp: tmp.write_text(text))


def _bench_trainer(ctx, argv: list[str]) -> dict:
    import bench.trainer.bench_trainer as bench

    argv = ["--device", ctx.device.type, "--model-shape", ctx.shape_name, *argv]
    return bench.run_bench(bench.resolve_args(bench.build_parser().parse_args(argv)))


PATH_FIELDS = ("label", "attention", "precision", "attention_kernel", "decoder_kernels", "tokens_per_s", "mfu",
               "peak_mem_gib", "step_time_s_mean", "optimizer_step_s_mean", "first_loss", "error", "tried")


def _comparison(results: dict) -> dict:
    """What the report keeps of a bench_trainer comparison: every path (both HF paths named as such), the faster
    HF path and our ratio to it, what was skipped and why."""
    ours = results["paths"].get("ours", {})
    return {"ours_tokens_per_s": ours.get("tokens_per_s"), "best_hf": results["ratios"].get("ours/best_hf", {}),
            "paths": {k: {f: v.get(f) for f in PATH_FIELDS} for k, v in results["paths"].items()},
            "settings": results["settings"], "skipped": results.get("skipped", [])}


def _bench_json(ctx, name: str, argv: list[str]) -> list[str]:
    """argv plus bench_trainer's --out (it writes its results after every path), and ctx.partial[name]: what it
    measured, read back if the check is stopped at its budget."""
    out = getattr(ctx, "out", None)
    if out is None:
        return argv
    path = out / f"{name}.json"
    path.unlink(missing_ok=True)

    def partial() -> dict:
        results = read_json(path)
        if not results or "ratios" not in results:
            return {}
        _remember(ctx, name, results)  # what ran before the stop still serves the later checks
        return _comparison(results)

    if name not in getattr(ctx, "partial", {}):
        keep_partial(ctx, name, partial)
    return [*argv, "--out", str(path)]


def _remember(ctx, name: str, results: dict) -> None:
    """What later checks take from a comparison: its results (the memory check's peaks) and, from the 16K one, the
    HF implementation that trained on the speed path (the profile and 64K run it rather than try again)."""
    setattr(ctx, f"{name}_results", results)
    if name == "trainer":
        speed = next((v for k, v in results["paths"].items()
                      if k != "ours" and v.get("ran") and v.get("precision") == "bf16"), {})
        ctx.best_hf_impl, ctx.best_hf_wall_s = speed.get("attention"), speed.get("wall_s")


def _baselines(ctx) -> str:
    return "sdpa,sdpa:amp" if ctx.dry_run else ctx.args.baselines  # the CPU has no packed HF attention but sdpa


def _ratio_verdict(name: str, results: dict, dry_run: bool) -> dict:
    """The ratio's verdict; without a ratio, why (no HF path ran: out of memory at 64K, say) in place of the figure's
    description, so the report says it rather than leaving an unexplained n/a."""
    ratio = results["ratios"].get("ours/best_hf", {}).get("tokens_per_s")
    judged = verdict(name, ratio, dry_run)
    if ratio is None and results.get("no_ratio"):
        judged["what"] = f"no ratio: {results['no_ratio']}"
    elif ratio is None:
        errors = [f"{k}: {v.get('error')}" for k, v in results["paths"].items() if k != "ours" and not v.get("ran")]
        if errors:
            judged["what"] = "no ratio: no HF path ran: " + "; ".join(errors)
    return judged


def check_trainer(ctx) -> dict:
    """bench_trainer's comparison: our step against the best HF path (speed path first; the accuracy path in the time
    left after it and ours), tokens/s and MFU, held to the check's budget, no sp=1 parity steps (bench_trainer's
    own run checks those)."""
    budget = inner_budget(ctx)
    argv = ["--pack-len", str(ctx.pack_len), "--max-pack-search", "0", "--baselines", _baselines(ctx),
            "--no-sp1-check", "--time-budget-s", f"{budget:.1f}",
            "--ours-reserve-s", f"{min(OURS_RESERVE_S, 0.5 * budget):.1f}"]
    if ctx.dry_run:
        argv += ["--steps", "1", "--warmup", "0"]
    results = _bench_trainer(ctx, _bench_json(ctx, "trainer", argv))
    _remember(ctx, "trainer", results)
    ours = results["paths"].get("ours", {})
    return {**_comparison(results),
            "verdicts": {"tokens_per_s_ratio": _ratio_verdict("tokens_per_s_ratio", results, ctx.dry_run),
                         "mfu": verdict("mfu", ours.get("mfu"), ctx.dry_run)}}


def check_trainer_64k(ctx) -> dict:
    """The comparison at 4x the pack length (64K for the 1B shape), every layer checkpointed on both sides, against
    the HF implementation that ran at 16K (its speed path only), held to the check's budget. HF's full logits and
    model states cannot fit 80 GB at 64K: the HF path is then not tried, ours runs alone and the report says "cannot
    fit" in place of the ratio; where it fits (a larger GPU), it runs when its compile fits the time left."""
    layers = int(ctx.hf_config["num_hidden_layers"])
    baseline = "sdpa" if ctx.dry_run else (hf_baseline(ctx) or "best")
    budget = inner_budget(ctx)
    argv = ["--pack-len", str(4 * ctx.pack_len), "--max-pack-search", "0", "--no-sp1-check",
            "--baselines", baseline, "--ckpt-layers", str(layers), "--baseline-ckpt",
            "--time-budget-s", f"{budget:.1f}", "--ours-reserve-s", f"{min(OURS_RESERVE_S, 0.8 * budget):.1f}",
            # the HF path's first step compiles again for the new length: as long as it took at 16K (on a GPU)
            "--hf-min-s", f"{0.0 if ctx.dry_run else getattr(ctx, 'best_hf_wall_s', 0.0) or 0.0:.1f}"]
    argv += ["--steps", "1", "--warmup", "0"] if ctx.dry_run else ["--steps", "3", "--warmup", "1"]
    results = _bench_trainer(ctx, _bench_json(ctx, "trainer_64k", argv))
    _remember(ctx, "trainer_64k", results)
    return {**_comparison(results),
            "verdicts": {"tokens_per_s_ratio": _ratio_verdict("tokens_per_s_ratio_64k", results, ctx.dry_run)}}


def check_longest_pack(ctx) -> dict:
    """bench_trainer's search within the check's budget (its engine's build and first step come off it first): the
    longest single-document pack per checkpointing level; stopped, what it wrote after each attempt."""
    start = 2 * ctx.pack_len  # the comparison trained --pack-len already
    argv = ["--pack-len", str(start), "--baselines", "none", "--no-sp1-check", "--steps", "1", "--warmup", "0",
            "--time-budget-s", f"{inner_budget(ctx):.1f}"]
    if ctx.dry_run:
        argv += ["--max-pack-search", str(2 * start), "--ckpt-levels", "0,2"]
    path = ctx.out / "longest_pack.json"

    def partial() -> dict:
        results = read_json(path)
        return _longest_pack_result(ctx, results) if results and results.get("pack_search") else {}

    keep_partial(ctx, "longest_pack", partial)
    return _longest_pack_result(ctx, _bench_trainer(ctx, _bench_json(ctx, "longest_pack", argv)))


def _longest_pack_result(ctx, results: dict) -> dict:
    search = results.get("pack_search") or {}
    ctx.search_results = results
    per_level = {}
    for a in search.get("attempts", []):
        if a and a.get("ok"):
            per_level[a["ckpt_layers"]] = max(per_level.get(a["ckpt_layers"], 0), a["pack_len"])
    return {"search_budget_s": results["settings"].get("search_budget_s"), "longest_pack_by_ckpt_layers": per_level,
            "attempts": [{k: a.get(k) for k in ("pack_len", "ckpt_layers", "ok", "oom", "step_time_s", "peak_mem_gib")}
                         for a in search.get("attempts", []) if a],
            "not_tried": search.get("skipped", []),
            "verdict": verdict("longest_pack", search.get("longest_ok"), ctx.dry_run)}


def job_of(results: dict):
    """The memory model's settings of the run bench_trainer measured: ZeRO-2, its loss chunk, one micro-batch per step
    (bf16 gradient accumulation), the attention backend and the decoder kernels ours ran."""
    from hbp_train.perf.memory import VARLEN_BACKENDS, JobSettings

    settings, ours = results["settings"], results["paths"].get("ours", {})
    fused = ours.get("fused_kernels") or ()
    return JobSettings(zero_stage=2, loss_chunk_tokens=settings["loss_chunk"],
                       grad_accum_fp32=bool(settings.get("grad_accum_fp32", False)),
                       attention_out_shared=ours.get("backend") in VARLEN_BACKENDS,
                       fused_rms_norm="rms_norm" in fused, fused_swiglu="swiglu" in fused)


def check_memory(ctx) -> dict:
    """The analytic memory model, with the measured run's settings (``job_of``), against the peaks the trainer checks
    and the longest-pack search measured."""
    from hbp_train.perf.memory import analytic_memory_bytes
    from hbp_train.perf.shape import parse_model_shape

    measured = [r for r in (getattr(ctx, "trainer_results", None), getattr(ctx, "trainer_64k_results", None))
                if r and r["paths"].get("ours", {}).get("ran")]
    search = getattr(ctx, "search_results", None)
    if not measured and search is None:
        return {"skipped_check": "needs the trainer, trainer_64k or longest_pack check's measured peaks"}
    rows = []
    for results in measured + ([search] if search else []):
        shape, job = parse_model_shape(results["model"]["config"]), job_of(results)
        attempts = []
        if results is not search:  # the comparison's packs (a mix of documents)
            attempts.append({"pack_len": results["settings"]["pack_len"], "ok": True,
                             "ckpt_layers": results["settings"]["ckpt_layers"],
                             "peak_mem_gib": results["paths"]["ours"]["peak_mem_gib"]})
        else:  # one document per pack, each checkpointing level tried
            attempts += (search.get("pack_search") or {}).get("attempts", [])
        for a in attempts:
            if a and a.get("ok") and a.get("peak_mem_gib"):
                predicted = analytic_memory_bytes(shape, a["pack_len"], 1, a["ckpt_layers"], 1, job) / 2**30
                rows.append({"pack_len": a["pack_len"], "ckpt_layers": a["ckpt_layers"],
                             "measured_gib": a["peak_mem_gib"], "predicted_gib": predicted,
                             "error": predicted / a["peak_mem_gib"] - 1})
    worst = max((abs(r["error"]) for r in rows), default=None)
    note = "CPU: the measured peak is the process's RSS, not comparable" if ctx.device.type == "cpu" else ""
    return {"packs": rows, "note": note, "verdict": verdict("memory_model_error", worst, ctx.dry_run)}


def check_calibration(ctx) -> dict:
    """A calibration on this device of the program training runs here (probed backend, decoder kernels, fused
    LM-head loss on a GPU), then the cost model's error on whole packs run the same way."""
    from hbp_train.perf.calibrate import build_parser, layer, validation
    from hbp_train.perf.cost_model import TABLE_TOKENS, CostModel
    from hbp_train.perf.shape import parse_model_shape

    shape = parse_model_shape(ctx.hf_config)
    if ctx.dry_run:
        argv = ["--tokens", "512", "--doc-lens", "64,128,512", "--iters", "1", "--warmup", "0"]
        val = ["--tokens", "512", "--max-samples", "8", "--num-packs", "3", "--iters", "1", "--warmup", "0"]
    else:
        import torch

        free, _ = torch.cuda.mem_get_info(ctx.device)  # what the earlier checks left, not the card's total
        fits = validation.validate_tokens(shape, free)
        argv = ["--tokens", str(TABLE_TOKENS), "--iters", "5", "--warmup", "2"]
        val = ["--tokens", str(fits), "--max-samples", "100", "--num-packs", "8", "--iters", "2", "--warmup", "1"]
    path = ctx.out / "calibration.json"
    path.unlink(missing_ok=True)
    args = build_parser().parse_args(argv + ["--out", str(path)])
    calibration = layer.calibrate(shape, args, ctx.device, ctx.dtype)
    write_json(path, calibration)
    measured = {"calibration": str(path.name),
                "linear_ms_per_32768": calibration["linear_fwdbwd_ms_per_32768_tokens"],
                "head_ms_per_32768": calibration["head_fwdbwd_ms_per_32768_tokens"]}
    # stopped in the validation: the calibration made (the cost model of this GPU) is kept, its error is not known
    keep_partial(ctx, "calibration", lambda: dict(measured, validation="stopped before it ended"))
    vargs = build_parser().parse_args(val + ["--validate", "--calibration", str(path)])
    report = validation.validate(shape, CostModel.from_calibration(path, shape), vargs, ctx.device, ctx.dtype)
    return {**measured,
            "validation": {k: report[k] for k in ("tokens", "mean_abs_error", "max_abs_error", "backend",
                                                  "decoder_kernels", "loss_impl")},
            "packs": [{k: r[k] for k in ("num_samples", "measured_s", "predicted_s", "error")} for r in report["packs"]],
            "verdict": verdict("cost_model_error", report["max_abs_error"], ctx.dry_run)}


def check_profiler(ctx) -> dict:
    """hbp-profile end to end on the shape (a dry run: the analytic back-end), timed; its own time budget ends before
    the check's (its set-up and the tail after its last measurement come off the share), and stopped, the check keeps
    the measurements it had made."""
    from dataclasses import asdict

    from hbp_train.profiler.cli import main as profile_main

    c = ctx.hf_config
    out = ctx.out / "profile.json"
    argv = ["model=tiny_llama", f"model.init_config.hidden_size={c['hidden_size']}",
            f"model.init_config.intermediate_size={c['intermediate_size']}",
            f"model.init_config.num_hidden_layers={c['num_hidden_layers']}",
            f"model.init_config.num_attention_heads={c['num_attention_heads']}",
            f"model.init_config.num_key_value_heads={c.get('num_key_value_heads', c['num_attention_heads'])}",
            f"+model.init_config.vocab_size={c['vocab_size']}", f"profile.output={out}",
            f"profile.time_budget_s={profiler_time_budget_s(ctx):.1f}"]
    if ctx.dry_run:
        argv += ["profile.dry_run=true", "profile.min_len=256", "profile.max_len=1024", "profile.world_size=2"]
    else:
        argv += ["profile.min_len=4096", "profile.max_len=65536", "profile.world_size=8",
                 "model.init_config.max_position_embeddings=131072"]
    t0 = time.monotonic()
    out.unlink(missing_ok=True)
    measured = []
    keep_partial(ctx, "profiler", lambda: {"exit_code": None, "measurements": measured,
                                           "time_budget_s": ctx.share_s, "wall_s": time.monotonic() - t0})
    rc = profile_main(argv, on_measurement=lambda m: measured.append(
        {k: v for k, v in asdict(m).items() if k in ("pack_len", "sp", "ckpt_layers", "time_s", "oom")}))
    wall = time.monotonic() - t0
    profile = read_json(out) if rc == 0 else None
    profile = profile or {}
    return {"exit_code": rc, "wall_s": wall, "time_budget_s": ctx.share_s, "groups": profile.get("groups"),
            "measurements": measured,
            "profiler_total_s": (profile.get("profiler") or {}).get("total_s"),
            "verdict": verdict("profiler_s", wall if rc == 0 else None, ctx.dry_run)}


def profiler_time_budget_s(ctx) -> float:
    """The profiler's own budget: the check's share less its set-up and the tail after its last measurement (on a
    GPU; a dry run measures nothing), so that it stops itself and writes its file before the check is stopped."""
    overhead = 0.0 if ctx.dry_run else PROFILER_SETUP_S + PROFILER_TAIL_S
    return max(inner_budget(ctx) - overhead, 1.0)


CHECK_FNS = {"step_profile": check_step_profile, "backends": check_backends, "trainer": check_trainer,
             "trainer_64k": check_trainer_64k, "calibration": check_calibration, "longest_pack": check_longest_pack,
             "memory": check_memory, "profiler": check_profiler}
