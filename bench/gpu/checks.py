"""The GPU acceptance checks, one function each: ``check_<name>(ctx) -> dict`` with its figures and verdicts.

``ctx`` carries the run's settings (device, dtype, model shape, pack length, output folder, dry run), the seconds
this check is held to (``share_s``: bench/gpu_acceptance.py stops it there), what earlier checks found (the HF
implementation that ran, the measured peaks) and ``partial``: per check, a function returning what it measured so
far, for a check stopped at its budget. A check plans its own parts within ``share_s`` (``inner_budget``) and lists
what it left out and why under "skipped". What a check runs lives in its own module: the trainer comparison in
bench/trainer/, the step profile in bench/gpu/step_profile.py, the calibration in hbp_train/perf/calibrate/, the
profiler in hbp_train/profiler/.
"""

from __future__ import annotations

import json
import time

from bench.gpu.report import verdict

# The profiler's time budget counts its measurements only: its set-up (the model built on the GPU, the back-end's
# first compile) comes off its share first.
PROFILER_SETUP_S = 30

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

    argv = ["--device", ctx.device.type, "--model-shape", ctx.shape_name, "--pack-len", str(ctx.pack_len),
            "--out", str(ctx.out), "--time-budget-s", str(inner_budget(ctx))]
    if getattr(ctx, "best_hf_impl", None):  # the one the trainer check found trains here (and compiled it)
        argv += ["--baseline", ctx.best_hf_impl]
    if ctx.dry_run:
        argv += ["--steps", "1", "--warmup", "1"]
    profile = gp.profile_paths(gp.resolve(gp.build_parser().parse_args(argv)))
    (ctx.out / "step_profile.json").write_text(json.dumps(profile, indent=1) + "\n")
    markdown = gp.to_markdown(profile)
    (ctx.out / "step_profile.md").write_text(markdown)
    ours = profile["paths"].get("ours", {})
    return {"profile": profile, "markdown": markdown, "skipped": profile.get("skipped", []),
            "verdict": verdict("loss_share", (ours.get("share") or {}).get("loss"), ctx.dry_run)}


def _attention_ms(backend: str, shape, lengths: list[int], device, dtype, iters: int) -> float:
    """Forward + backward of one packed attention call of the model's head shape over the pack, ms (mean of
    ``iters`` after one untimed call: compiles and JIT builds happen there)."""
    import torch

    from hbp_train.model.attention import packed_attention

    gen = torch.Generator().manual_seed(0)
    num_tokens = sum(lengths)
    q, k, v = (torch.randn(num_tokens, heads, dim, generator=gen, device="cpu").to(device, dtype).requires_grad_()
               for heads, dim in ((shape.num_heads, shape.head_dim), (shape.num_kv_heads, shape.head_dim),
                                  (shape.num_kv_heads, shape.v_head_dim)))
    cu = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
    grad = torch.randn(num_tokens, shape.num_heads, shape.v_head_dim, generator=gen, device="cpu").to(device, dtype)
    times = []
    for i in range(iters + 1):
        sync_device(device)
        t0 = time.perf_counter()
        out = packed_attention(q, k, v, cu, max(lengths), backend)
        torch.autograd.grad(out, (q, k, v), grad)
        sync_device(device)
        if i:
            times.append(time.perf_counter() - t0)
    return 1e3 * sum(times) / len(times)


def sync_device(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_backends(ctx) -> dict:
    """Every available backend and our decoder kernels vs fp32 eager attention, one forward per document: loss and
    parameter grads; every backend's attention time, and whether "auto" chose the fastest."""
    import torch

    from hbp_train.model.attention_setup import HeadShape, available_backends, describe_backend, select_backend
    from hbp_train.model.kernels import restore_hf_modules
    from hbp_train.model.loss import chunked_token_losses
    from hbp_train.model.hf_model import ModelConfig, build_model, forward_hidden
    from hbp_train.model.rope import PackSlice
    from hbp_train.common.labels import IGNORE_INDEX

    device, dtype = ctx.device, ctx.dtype
    cfg = dict(ctx.hf_config, num_hidden_layers=2)  # two layers of the shape: the attention is what is checked
    cfg.pop("model_type", None)
    lengths = [ctx.pack_len // 2, ctx.pack_len // 4, ctx.pack_len // 8, ctx.pack_len - ctx.pack_len // 2
               - ctx.pack_len // 4 - ctx.pack_len // 8]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (ctx.pack_len,), generator=gen)
    labels = torch.cat([torch.cat([ids[s + 1:s + n], torch.tensor([IGNORE_INDEX])])
                        for s, n in zip(torch.tensor([0, *lengths]).cumsum(0).tolist(), lengths)])
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)

    def run(model, packed: bool):
        model.zero_grad(set_to_none=True)
        dev = next(model.parameters()).device
        weight = model.get_output_embeddings().weight
        if packed:
            hidden = forward_hidden(model, ids[None].to(dev), position_ids[None].to(dev), cu_seq_lens_q=cu.to(dev),
                                    cu_seq_lens_k=cu.to(dev), max_length_q=max(lengths), max_length_k=max(lengths),
                                    pack_slice=PackSlice.whole(cu))  # each document's own RoPE, as the trainer's
        else:  # the reference: each document alone, HF's own causal mask
            hidden = torch.cat([forward_hidden(model, ids[None, s:s + n].to(dev), torch.arange(n)[None].to(dev))
                                for s, n in zip(cu[:-1].tolist(), lengths)], dim=1)
        loss = chunked_token_losses(hidden[0], weight, labels.to(dev)).float().sum() / (labels != IGNORE_INDEX).sum()
        loss.backward()
        return float(loss.detach()), {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()
                                      if p.grad is not None}

    restore_hf_modules()  # the reference is HF's own code, whatever an earlier check built
    torch.manual_seed(0)
    with torch.device(device):  # initialised on the device: the 128K-vocabulary embeddings take long on the host
        ref_model = build_model(ModelConfig(config=cfg, dtype="fp32", attention_backend="sdpa_block", kernels="none"),
                                vocab_size=cfg["vocab_size"])
    ref_model.set_attn_implementation("eager")
    ref_loss, ref_grads = run(ref_model, packed=False)
    state = {k: v.cpu() for k, v in ref_model.state_dict().items()}
    shape = HeadShape.of(ref_model.config)
    del ref_model
    tol, min_cos = (2e-2, 0.99) if dtype != torch.float32 else (1e-4, 0.99999)  # bf16 against an fp32 reference
    model_dtype = "bf16" if dtype == torch.bfloat16 else "fp32"

    def against_reference(backend: str, kernels: str) -> tuple[dict, object]:
        try:
            with torch.device(device):
                model = build_model(ModelConfig(config=cfg, dtype=model_dtype, attention_backend=backend,
                                                kernels=kernels), vocab_size=cfg["vocab_size"])
            model.load_state_dict(state)
            loss, grads = run(model, packed=True)
        except Exception as exc:  # noqa: BLE001 - a backend that fails here is the finding
            return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}, None
        phrase = model._hbp_kernels
        del model
        cos = min(float(torch.nn.functional.cosine_similarity(grads[n].flatten(), g.flatten(), dim=0))
                  for n, g in ref_grads.items())
        rel = max(float((grads[n] - g).norm() / g.norm().clamp_min(1e-12)) for n, g in ref_grads.items())
        return {"loss": loss, "loss_rel_error": abs(loss / ref_loss - 1), "grad_min_cosine": cos,
                "grad_max_rel_error": rel,
                "verdicts": {"loss": verdict("backend_loss_rel_error", abs(loss / ref_loss - 1), ctx.dry_run, tol),
                             "grads": verdict("backend_grad_cosine", cos, ctx.dry_run, min_cos)}}, phrase

    def check(backend):
        row, _ = against_reference(backend, "none")
        if "error" not in row:
            row["kernel"] = describe_backend(backend, device)
        return row

    rows, times, skipped = backend_rows(available_backends(device, dtype), check, lambda backend: _attention_ms(
        backend, shape, lengths, device, dtype, iters=1 if ctx.dry_run else 5))
    auto = select_backend("auto", device, dtype, shape)
    # The decoder kernels a run gets by default (model.kernels=auto: Liger on a GPU where installed; none on the
    # CPU, where the row still proves the path), on the backend auto chose.
    row, phrase = against_reference(auto, "auto" if not ctx.dry_run else "none")
    rows[f"kernels={(phrase or 'auto').split()[0]}"] = dict(row, decoder_kernels=phrase, backend=auto)
    restore_hf_modules()  # the later checks' HF baselines run HF's own RoPE
    fastest = min(times, key=times.get) if times else None
    ratio = times[auto] / times[fastest] if fastest and auto in times else None
    return {"reference": {"what": "fp32, HF eager attention, one forward per document", "loss": ref_loss},
            "pack_lengths": lengths, "dtype": str(dtype), "backends": rows, "auto": auto, "fastest": fastest,
            "skipped": skipped, "verdict": verdict("auto_backend_fastest", ratio, ctx.dry_run)}


def backend_rows(available: list, check, time_it) -> tuple[dict, dict, list]:
    """(rows, times, skipped) over the ``available`` backends in preference order: ``check(backend)`` -> its row
    (with "error" when it failed), ``time_it(backend)`` -> ms for each that passed. flex is skipped once a varlen
    kernel passed: auto never picks it over one, and its compile (minutes on a GPU) would eat the budget."""
    from hbp_train.model.attention import VARLEN_KERNELS

    rows, times, skipped = {}, {}, []
    for backend in available:
        passed = [b for b, row in rows.items() if b in VARLEN_KERNELS and "error" not in row]
        if backend == "flex" and passed:
            skipped.append(f"flex: {passed[0]} passed, which auto picks first; flex's compile is not worth the budget")
            continue
        rows[backend] = check(backend)
        if "error" in rows[backend]:
            continue
        try:
            times[backend] = rows[backend]["attention_fwd_bwd_ms"] = time_it(backend)
        except Exception as exc:  # noqa: BLE001 - reported beside its correctness figures
            rows[backend]["timing_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return rows, times, skipped


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
        results = json.loads(path.read_text()) if path.exists() else None
        if not results or "ratios" not in results:
            return {}
        _remember(ctx, name, results)  # what ran before the stop still serves the later checks
        return _comparison(results)

    ctx.partial = getattr(ctx, "partial", {})
    ctx.partial[name] = partial
    return [*argv, "--out", str(path)]


def _remember(ctx, name: str, results: dict) -> None:
    """What later checks take from a comparison: its results (the memory check's peaks) and, from the 16K one, the
    HF implementation that trained on the speed path (the profile and 64K run it rather than try again)."""
    setattr(ctx, f"{name}_results", results)
    if name == "trainer":
        ctx.best_hf_impl = next((v["attention"] for k, v in results["paths"].items()
                                 if k != "ours" and v.get("ran") and v.get("precision") == "bf16"), None)


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
    argv = ["--pack-len", str(ctx.pack_len), "--max-pack-search", "0", "--baselines", _baselines(ctx),
            "--no-sp1-check", "--time-budget-s", f"{inner_budget(ctx):.1f}"]
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
    the HF implementation that ran at 16K (its speed path only: a second compile would not fit), held to the check's
    budget; HF's full logits may not fit at 64K, which is reported as why there is no ratio."""
    layers = int(ctx.hf_config["num_hidden_layers"])
    baseline = "sdpa" if ctx.dry_run else (getattr(ctx, "best_hf_impl", None) or "best")
    argv = ["--pack-len", str(4 * ctx.pack_len), "--max-pack-search", "0", "--no-sp1-check",
            "--baselines", baseline, "--ckpt-layers", str(layers), "--baseline-ckpt",
            "--time-budget-s", f"{inner_budget(ctx):.1f}"]
    argv += ["--steps", "1", "--warmup", "0"] if ctx.dry_run else ["--steps", "3", "--warmup", "1"]
    results = _bench_trainer(ctx, _bench_json(ctx, "trainer_64k", argv))
    _remember(ctx, "trainer_64k", results)
    return {**_comparison(results),
            "verdicts": {"tokens_per_s_ratio": _ratio_verdict("tokens_per_s_ratio_64k", results, ctx.dry_run)}}


def check_longest_pack(ctx) -> dict:
    """bench_trainer's search in the time left: the longest single-document pack per checkpointing level."""
    start = 2 * ctx.pack_len  # the comparison trained --pack-len already
    argv = ["--pack-len", str(start), "--baselines", "none", "--no-sp1-check", "--steps", "1", "--warmup", "0",
            "--search-budget-s", str(ctx.share_s)]
    if ctx.dry_run:
        argv += ["--max-pack-search", str(2 * start), "--ckpt-levels", "0,2"]
    results = _bench_trainer(ctx, argv)
    search = results.get("pack_search") or {}
    ctx.search_results = results
    per_level = {}
    for a in search.get("attempts", []):
        if a and a.get("ok"):
            per_level[a["ckpt_layers"]] = max(per_level.get(a["ckpt_layers"], 0), a["pack_len"])
    return {"search_budget_s": ctx.share_s, "longest_pack_by_ckpt_layers": per_level,
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
    args = build_parser().parse_args(argv + ["--out", str(path)])
    calibration = layer.calibrate(shape, args, ctx.device, ctx.dtype)
    path.write_text(json.dumps(calibration, indent=1))
    vargs = build_parser().parse_args(val + ["--validate", "--calibration", str(path)])
    report = validation.validate(shape, CostModel.from_calibration(path, shape), vargs, ctx.device, ctx.dtype)
    return {"calibration": str(path.name), "linear_ms_per_32768": calibration["linear_fwdbwd_ms_per_32768_tokens"],
            "head_ms_per_32768": calibration["head_fwdbwd_ms_per_32768_tokens"],
            "validation": {k: report[k] for k in ("tokens", "mean_abs_error", "max_abs_error", "backend",
                                                  "decoder_kernels", "loss_impl")},
            "packs": [{k: r[k] for k in ("num_samples", "measured_s", "predicted_s", "error")} for r in report["packs"]],
            "verdict": verdict("cost_model_error", report["max_abs_error"], ctx.dry_run)}


def check_profiler(ctx) -> dict:
    """hbp-profile end to end on the shape (a dry run: the analytic back-end), timed."""
    from hbp_train.profiler.cli import main as profile_main

    c = ctx.hf_config
    out = ctx.out / "profile.json"
    argv = ["model=tiny_llama", f"model.init_config.hidden_size={c['hidden_size']}",
            f"model.init_config.intermediate_size={c['intermediate_size']}",
            f"model.init_config.num_hidden_layers={c['num_hidden_layers']}",
            f"model.init_config.num_attention_heads={c['num_attention_heads']}",
            f"model.init_config.num_key_value_heads={c.get('num_key_value_heads', c['num_attention_heads'])}",
            f"+model.init_config.vocab_size={c['vocab_size']}", f"profile.output={out}",
            f"profile.time_budget_s={max(ctx.share_s - (0 if ctx.dry_run else PROFILER_SETUP_S), 1.0)}"]
    if ctx.dry_run:
        argv += ["profile.dry_run=true", "profile.min_len=256", "profile.max_len=1024", "profile.world_size=2"]
    else:
        argv += ["profile.min_len=4096", "profile.max_len=65536", "profile.world_size=8",
                 "model.init_config.max_position_embeddings=131072"]
    t0 = time.monotonic()
    rc = profile_main(argv)
    wall = time.monotonic() - t0
    profile = json.loads(out.read_text()) if rc == 0 and out.exists() else {}
    return {"exit_code": rc, "wall_s": wall, "time_budget_s": ctx.share_s, "groups": profile.get("groups"),
            "profiler_total_s": (profile.get("profiler") or {}).get("total_s"),
            "verdict": verdict("profiler_s", wall if rc == 0 else None, ctx.dry_run)}


CHECK_FNS = {"step_profile": check_step_profile, "backends": check_backends, "trainer": check_trainer,
             "trainer_64k": check_trainer_64k, "calibration": check_calibration, "longest_pack": check_longest_pack,
             "memory": check_memory, "profiler": check_profiler}
