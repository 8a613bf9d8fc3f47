"""GPU acceptance: one command for a user's GPU node that checks the trainer end to end and writes one report.

    python bench/gpu_acceptance.py --out acceptance/            # a GPU node: fits --budget-s (default 8 minutes)
    python bench/gpu_acceptance.py --dry-run --out /tmp/acc     # CPU: the same checks on a tiny shape, seconds

It writes ``acceptance.json`` and ``acceptance.md`` into --out (the JSON after every check, so a run stopped by a
time limit keeps what it measured). Every figure is printed beside its target and a verdict (met / NOT met /
skipped / n/a: a CPU dry run judges nothing, it only proves the command still runs). The checks, in the order of
their value (each is given a share of --budget-s; one that no longer fits is skipped and reported as skipped, never
as met):

  step_profile  bench/gpu_profile.py: torch.profiler over a few steps of ours and of the best HF path, kernel time by
                category (GEMM, attention, elementwise, LM head + loss, optimizer, collectives, copies, idle); the
                table goes into the report. First: every later change is judged by it
  backends      every packed attention backend installed here (FA3, FA4, FA2, torch varlen, flex, sdpa_block) and
                our decoder kernels (model.kernels=auto: Liger where installed) against a reference (the same weights
                in fp32 with HF's eager attention, one forward per document): loss and every parameter's gradient;
                each backend's forward+backward time, and whether model.attention_backend=auto chose the fastest
  trainer       bench/bench_trainer.py in this process: our train_step against plain HF packed training of the
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

Over 500 lines because every check is one function here, beside the budget planning and the report they share;
what a check runs lives in its own module (bench_trainer, gpu_profile, calibrate, the profiler).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hbp_train.errors import EXIT_USER_ERROR, UserError  # noqa: E402
from hbp_train.train import set_cuda_allocator  # noqa: E402

TARGETS = {  # name -> (description, comparison, value)
    "tokens_per_s_ratio": ("ours / faster HF path tokens/s (16K packs)", ">=", 1.2),
    "tokens_per_s_ratio_64k": ("ours / faster HF path tokens/s (64K packs, all layers checkpointed)", ">=", 1.5),
    "auto_backend_fastest": ("attention_backend=auto chose the fastest backend measured here (its time / the "
                             "fastest's)", "<=", 1.05),
    "loss_share": ("LM head + loss, share of our step (profile; no target until a first GPU profile sets "
                   "today's)", "<=", None),
    "mfu": ("ours MFU (1B shape, 16K packs, bf16)", ">=", 0.45),
    "longest_pack": ("longest pack, 1B shape on 80 GB", ">=", 131072),
    "cost_model_error": ("cost model: largest error on measured packs", "<=", 0.10),
    "memory_model_error": ("memory model: largest error vs measured peaks", "<=", 0.10),
    "profiler_s": ("profiler wall time, s", "<=", 300.0),
    "backend_loss_rel_error": ("backend loss vs reference, relative error", "<=", None),  # set per dtype
    "backend_grad_cosine": ("backend grads vs reference, lowest cosine over parameters", ">=", None),
}
CHECKS = ("step_profile", "backends", "trainer", "trainer_64k", "calibration", "longest_pack", "memory", "profiler")
# Seconds a check needs at least (below that it is skipped), from runs on one H200 with the 1B shape
# (docs/gpu_results.md: the trainer check was mostly HF flex_attention's first-step compile, which step_profile now
# pays first: the compiled kernel stays in the process for the trainer check); a dry run on the CPU needs far less.
# step_profile and trainer_64k are not measured yet: their minimums are the compile plus a few steps. The search
# and the profiler take what is left of their share (their own budgets).
MIN_S = {"step_profile": 120, "backends": 30, "trainer": 90, "trainer_64k": 60, "calibration": 50,
         "longest_pack": 40, "memory": 0, "profiler": 60}
# The profiler's time budget counts its measurements only: its set-up (the model built on the GPU, the back-end's
# first compile) comes off its share first.
PROFILER_SETUP_S = 30
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


def verdict(name: str, value, dry_run: bool, target=None):
    """{"value", "target", "met"}: met is None (n/a) on a dry run or without a value."""
    desc, op, default = TARGETS[name]
    target = default if target is None else target
    met = None if (dry_run or value is None or target is None) else (value >= target if op == ">=" else value <= target)
    return {"what": desc, "value": value, "target": f"{op} {target}" if target is not None else "(none yet)",
            "met": met}


# ------------------------------------------------------------------------------------------------ the checks
def check_step_profile(ctx) -> dict:
    """bench/gpu_profile.py: kernel time by category for the best HF path, ours, and ours with eager decoder kernels
    (when ours fuses them); written to step_profile.json/.md and shown in the report."""
    import bench.gpu_profile as gp

    argv = ["--device", ctx.device.type, "--model-shape", ctx.shape_name, "--pack-len", str(ctx.pack_len),
            "--out", str(ctx.out)]
    if ctx.dry_run:
        argv += ["--steps", "1", "--warmup", "1"]
    profile = gp.profile_paths(gp.resolve(gp.build_parser().parse_args(argv)))
    (ctx.out / "step_profile.json").write_text(json.dumps(profile, indent=1) + "\n")
    markdown = gp.to_markdown(profile)
    (ctx.out / "step_profile.md").write_text(markdown)
    ours = profile["paths"].get("ours", {})
    return {"profile": profile, "markdown": markdown,
            "verdict": verdict("loss_share", (ours.get("share") or {}).get("loss"), ctx.dry_run)}


def _attention_ms(backend: str, shape, lengths: list[int], device, dtype, iters: int) -> float:
    """Forward + backward of one packed attention call of the model's head shape over the pack, ms (mean of
    ``iters`` after one untimed call: compiles and JIT builds happen there)."""
    import torch

    from hbp_train.attention import packed_attention

    gen = torch.Generator().manual_seed(0)
    num_tokens = sum(lengths)
    q, k, v = (torch.randn(num_tokens, heads, dim, generator=gen).to(device, dtype).requires_grad_()
               for heads, dim in ((shape.num_heads, shape.head_dim), (shape.num_kv_heads, shape.head_dim),
                                  (shape.num_kv_heads, shape.v_head_dim)))
    cu = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
    grad = torch.randn(num_tokens, shape.num_heads, shape.v_head_dim, generator=gen).to(device, dtype)
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

    from hbp_train.attention import HeadShape, available_backends, describe_backend, select_backend
    from hbp_train.kernels import restore_hf_modules
    from hbp_train.loss import chunked_token_losses
    from hbp_train.model import ModelConfig, build_model, forward_hidden
    from hbp_train.labels import IGNORE_INDEX

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
                                    cu_seq_lens_k=cu.to(dev), max_length_q=max(lengths), max_length_k=max(lengths))
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

    rows, times = {}, {}
    for backend in available_backends(device, dtype):
        rows[backend], _ = against_reference(backend, "none")
        if "error" not in rows[backend]:
            rows[backend]["kernel"] = describe_backend(backend, device)
            try:
                times[backend] = rows[backend]["attention_fwd_bwd_ms"] = _attention_ms(
                    backend, shape, lengths, device, dtype, iters=1 if ctx.dry_run else 5)
            except Exception as exc:  # noqa: BLE001 - reported beside its correctness figures
                rows[backend]["timing_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
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
            "verdict": verdict("auto_backend_fastest", ratio, ctx.dry_run)}


def _bench_trainer(ctx, argv: list[str]) -> dict:
    import bench.bench_trainer as bench

    argv = ["--device", ctx.device.type, "--model-shape", ctx.shape_name, *argv]
    return bench.run_bench(bench.resolve_args(bench.build_parser().parse_args(argv)))


PATH_FIELDS = ("label", "attention", "precision", "attention_kernel", "decoder_kernels", "tokens_per_s", "mfu",
               "peak_mem_gib", "step_time_s_mean", "optimizer_step_s_mean", "first_loss", "error")


def _comparison(results: dict) -> dict:
    """What the report keeps of a bench_trainer comparison: every path (both HF paths named as such), the faster
    HF path and our ratio to it."""
    ours = results["paths"].get("ours", {})
    return {"ours_tokens_per_s": ours.get("tokens_per_s"), "best_hf": results["ratios"].get("ours/best_hf", {}),
            "paths": {k: {f: v.get(f) for f in PATH_FIELDS} for k, v in results["paths"].items()},
            "settings": results["settings"]}


def _baselines(ctx) -> str:
    return "sdpa,sdpa:amp" if ctx.dry_run else ctx.args.baselines  # the CPU has no packed HF attention but sdpa


def check_trainer(ctx) -> dict:
    """bench_trainer's comparison: our step against both plain HF packed training paths, tokens/s and MFU."""
    argv = ["--pack-len", str(ctx.pack_len), "--max-pack-search", "0", "--baselines", _baselines(ctx)]
    if ctx.dry_run:
        argv += ["--steps", "1", "--warmup", "0"]
    results = _bench_trainer(ctx, argv)
    ctx.trainer_results = results
    ours = results["paths"].get("ours", {})
    ratio = results["ratios"].get("ours/best_hf", {}).get("tokens_per_s")
    return {**_comparison(results), "sp1_check": results.get("sp1_check"),
            "verdicts": {"tokens_per_s_ratio": verdict("tokens_per_s_ratio", ratio, ctx.dry_run),
                         "mfu": verdict("mfu", ours.get("mfu"), ctx.dry_run)}}


def check_trainer_64k(ctx) -> dict:
    """The comparison at 4x the pack length (64K for the 1B shape), every layer checkpointed on both sides."""
    layers = int(ctx.hf_config["num_hidden_layers"])
    argv = ["--pack-len", str(4 * ctx.pack_len), "--max-pack-search", "0", "--no-sp1-check",
            "--baselines", _baselines(ctx), "--ckpt-layers", str(layers), "--baseline-ckpt"]
    argv += ["--steps", "1", "--warmup", "0"] if ctx.dry_run else ["--steps", "3", "--warmup", "1"]
    results = _bench_trainer(ctx, argv)
    ratio = results["ratios"].get("ours/best_hf", {}).get("tokens_per_s")
    return {**_comparison(results),
            "verdicts": {"tokens_per_s_ratio": verdict("tokens_per_s_ratio_64k", ratio, ctx.dry_run)}}


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


def check_memory(ctx) -> dict:
    """The analytic memory model against the peaks the trainer check measured (comparison and pack search)."""
    from hbp_train.perf.memory import JobSettings, analytic_memory_bytes
    from hbp_train.perf.shape import parse_model_shape

    trainer, search = getattr(ctx, "trainer_results", None), getattr(ctx, "search_results", None)
    if trainer is None and search is None:
        return {"skipped": "needs the trainer or longest_pack check's measured peaks"}
    results = trainer or search
    shape = parse_model_shape(results["model"]["config"])
    job = JobSettings(zero_stage=2, loss_chunk_tokens=results["settings"]["loss_chunk"])
    attempts = []
    if trainer and trainer["paths"].get("ours", {}).get("ran"):  # the comparison's packs (a mix of documents)
        attempts.append({"pack_len": trainer["settings"]["pack_len"], "ckpt_layers": trainer["settings"]["ckpt_layers"],
                         "ok": True, "peak_mem_gib": trainer["paths"]["ours"]["peak_mem_gib"]})
    if search:  # one document per pack, each checkpointing level tried
        attempts += (search.get("pack_search") or {}).get("attempts", [])
    rows = []
    for a in attempts:
        if a and a.get("ok") and a.get("peak_mem_gib"):
            predicted = analytic_memory_bytes(shape, a["pack_len"], 1, a["ckpt_layers"], 1, job) / 2**30
            rows.append({"pack_len": a["pack_len"], "ckpt_layers": a["ckpt_layers"], "measured_gib": a["peak_mem_gib"],
                         "predicted_gib": predicted, "error": predicted / a["peak_mem_gib"] - 1})
    worst = max((abs(r["error"]) for r in rows), default=None)
    note = "CPU: the measured peak is the process's RSS, not comparable" if ctx.device.type == "cpu" else ""
    return {"packs": rows, "note": note, "verdict": verdict("memory_model_error", worst, ctx.dry_run)}


def check_calibration(ctx) -> dict:
    """A calibration on this device, then the cost model's error on whole packs (the trainer's chunked loss)."""
    from hbp_train.perf import calibrate as cal
    from hbp_train.perf.cost_model import CostModel
    from hbp_train.perf.shape import parse_model_shape

    shape = parse_model_shape(ctx.hf_config)
    if ctx.dry_run:
        argv = ["--tokens", "512", "--doc-lens", "64,128,512", "--iters", "1", "--warmup", "0"]
        val = ["--tokens", "512", "--max-samples", "8", "--num-packs", "3", "--iters", "1", "--warmup", "0"]
    else:
        import torch

        free, _ = torch.cuda.mem_get_info(ctx.device)  # what the earlier checks left, not the card's total
        fits = cal.validate_tokens(shape, free)
        argv = ["--tokens", str(cal.TABLE_TOKENS), "--iters", "5", "--warmup", "2"]
        val = ["--tokens", str(fits), "--max-samples", "100", "--num-packs", "8", "--iters", "2", "--warmup", "1"]
    path = ctx.out / "calibration.json"
    args = cal.build_parser().parse_args(argv + ["--out", str(path)])
    calibration = cal.calibrate(shape, args, ctx.device, ctx.dtype)
    path.write_text(json.dumps(calibration, indent=1))
    vargs = cal.build_parser().parse_args(val + ["--validate", "--calibration", str(path)])
    report = cal.validate(shape, CostModel.from_calibration(path, shape), vargs, ctx.device, ctx.dtype)
    return {"calibration": str(path.name), "linear_ms_per_32768": calibration["linear_fwdbwd_ms_per_32768_tokens"],
            "validation": {k: report[k] for k in ("tokens", "mean_abs_error", "max_abs_error", "backend")},
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


# ---------------------------------------------------------------------------------------------------- report
def all_verdicts(report: dict) -> list[tuple[str, dict]]:
    """(label, verdict) for every judged figure of the report, in check order; a skipped check is one row."""
    found = []
    for name in CHECKS:
        result = report["checks"].get(name) or {}
        if result.get("budget_skipped"):
            found.append((name, {"what": "skipped: " + result["budget_skipped"], "value": None, "target": "",
                                 "met": "skipped"}))
            continue
        if "verdict" in result:
            found.append((name, result["verdict"]))
        for key, v in (result.get("verdicts") or {}).items():
            found.append((f"{name}/{key}", v))
        for backend, row in (result.get("backends") or {}).items():
            if "error" in row:  # a backend installed here that failed: the finding, in the table
                found.append((f"{name}/{backend}", {"what": f"failed: {row['error'][:200]}", "value": None,
                                                    "target": "", "met": None if report["dry_run"] else False}))
            for key, v in (row.get("verdicts") or {}).items():
                found.append((f"{name}/{backend}/{key}", v))
    return found


def to_markdown(report: dict) -> str:
    met = {True: "met", False: "**NOT met**", None: "n/a", "skipped": "**skipped**"}
    lines = [f"# GPU acceptance report", "", f"{report['started']} on {report['device']}"
             f"{' (dry run: the figures mean nothing, no verdicts)' if report['dry_run'] else ''}", "",
             f"Budget {report['budget_s']:.0f} s, used {report.get('elapsed_s', 0):.0f} s.", "",
             "| check | figure | value | target | verdict |", "|---|---|---|---|---|"]
    for label, v in all_verdicts(report):
        value = v["value"]
        shown = "n/a" if value is None else (f"{value:.4g}" if isinstance(value, float) else str(value))
        lines.append(f"| {label} | {v['what']} | {shown} | {v['target']} | {met[v['met']]} |")
    lines.append("")
    for name in ("trainer", "trainer_64k"):
        paths = (report["checks"].get(name) or {}).get("paths")
        if paths:
            lines += [f"{name}: the paths compared (tokens/s; the target is judged against the faster HF path)", "",
                      "| path | what | attention | tokens/s | MFU | peak GiB |", "|---|---|---|---|---|---|"]
            for key, r in paths.items():
                what = r.get("label") or ""
                attention = r.get("attention_kernel") or r.get("attention") or ""
                if r.get("decoder_kernels"):
                    attention += f"; decoder kernels: {r['decoder_kernels']}"
                cells = ["n/a" if r.get(f) is None else f"{r[f]:.4g}" for f in ("tokens_per_s", "mfu", "peak_mem_gib")]
                if r.get("error"):
                    cells = [f"did not run: {r['error']}", "", ""]
                lines.append(f"| {key} | {what} | {attention} | " + " | ".join(cells) + " |")
            lines.append("")
    profile = report["checks"].get("step_profile") or {}
    if profile.get("markdown"):
        lines += [profile["markdown"]]
    for name in CHECKS:
        result = report["checks"].get(name)
        if result is None:
            continue
        if "error" in result:
            lines.append(f"- **{name} failed**: {result['error']}")
        elif "seconds" in result and not result.get("budget_skipped"):
            lines.append(f"- {name}: {result['seconds']:.0f} s")
    lines += ["", "Details: acceptance.json. What to do when a check fails: docs/gpu.md.", ""]
    return "\n".join(lines)


def run(args, started: float) -> dict:
    import torch

    from bench.trainer_workload import parse_shape

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


def write(report: dict, out: Path) -> None:
    (out / "acceptance.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "acceptance.md").write_text(to_markdown(report))


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
