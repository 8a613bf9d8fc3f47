"""Trainer benchmark (issue #5; the sp=1 no-regression check of issue #6): our training step against a plain HF
packed baseline, on the same packs, in the same process, on one device.

    python bench/trainer/bench_trainer.py --out runs/bench_trainer.json                     # a GPU (llama3.2-1b shape)
    python bench/trainer/bench_trainer.py --device cpu --model-shape tiny --pack-len 1024 --steps 2   # CPU smoke run

Paths, each trained for --warmup untimed and --steps timed steps of one pack per step (the same packs, in the
same order, from the same initial weights):
  ours      hbp_train's real step, ``trainer.train_step``: a DeepSpeed engine at world size 1 (ZeRO-2, bf16 with fp32
            master weights, torch AdamW, gradient clipping 1.0), our packed varlen attention (best backend of
            hbp_train.model.attention) and decoder kernels (--kernels, hbp_train/model/kernels.py), the LM-head loss
            training resolves (fused on a GPU, chunked on the CPU), --ckpt-layers checkpointed layers. The run is
            built by the trainer's own ``build.build_run`` (one sp=1 packing group, one micro-batch per step: bf16
            gradients accumulate in bf16 as in such a run), without packed shards on disk (no ``datasets`` needed):
            packs are made in memory and collated by ``data.collate_pack``.
  hf_sdpa   a plain transformers model, ``attn_implementation="sdpa"``, batches from transformers'
            ``DataCollatorWithFlattening`` (position_ids restart per sample, each sample's first label masked; HF
            then builds the block-diagonal mask from the position_ids), HF's own loss (full logits), a plain
            ``torch.optim.AdamW`` step (fused on GPU) with the same clipping. Two precisions, both named in the
            report: the speed path (``sdpa``: parameters and AdamW states in --dtype, bf16 on a GPU) and the
            accuracy path (``sdpa:amp`` -> hf_sdpa_amp: fp32 master weights under bf16 autocast, as HF Trainer
            with bf16=True and an fp32 load); --baseline-ckpt checkpoints every layer (long packs).
  hf_<best> the same with the best packed-capable HF attention that trains here, tried in order:
            flash_attention_4, _3, _2 where transformers offers them and their kernels import (handed the
            collator's cu_seq_lens), then flex_attention (GPU only; HF builds a document BlockMask from the
            position_ids); one that fails to build or to train gives way to the next ("tried" in the JSON), running
            out of memory ends the search. Which one ran is in the table and the JSON. A path whose full logits
            and model states alone cannot fit the GPU's free memory (a 64K pack of a 128K vocabulary on 80 GB) is
            not run: it "cannot fit", and the results say so.
With --time-budget-s the bench holds itself to that many seconds (bench/gpu_acceptance.py runs it so): the first HF
path (the speed path), stopped before it leaves ours less than --ours-reserve-s, then ours (fewer timed steps if need
be), so that the ratio is the first figure measured; the other HF paths (the accuracy path) after ours' engine is
gone, each only when as much time is left as the first HF path took (its first step compiles again); every path
left out is listed under "skipped" with the reason. The results are written (atomically) after every path.
Then the longest single pack our path trains (--pack-len, doubling up to --max-pack-search; --search-docs single
= one document of the whole length, the worst case for attention) with the fewest checkpointed layers that fit:
for each length the checkpoint levels (--ckpt-levels, default 0, L/4, L/2, 3L/4, L) are tried from the last one
that fitted; an out-of-memory error rebuilds the engine and tries the next level.

Figures: tokens/s and MFU over the timed steps (MFU = FLOPs / (time x peak); FLOPs from hbp_train.perf.flops.pack_flops
for every path: linear FLOPs per token plus causal attention FLOPs with sum of len^2 over the samples, never T^2;
recompute not counted), peak memory (CUDA max allocated; on a CPU the process's peak RSS, which only grows), the
first step's loss of each path (same weights and data: they must agree), and ours/baseline ratios. Targets
(issue #5): >= 1.2x the best HF baseline's tokens/s, >= 45% MFU, a 128K pack for a 1B shape. Every figure is
labelled with the device it was measured on; nothing is compared across devices.

The sp=1 check (issue #6): in a run whose plan also has SP groups, build.build_run installs the Ulysses dispatcher and
sp=1 steps go through it; an sp=1-only run (like ours here) keeps the plain packed attention. The same engine is
timed both ways, alternating step by step; the ratio should be ~1.0 (the rest of train_step's SP code runs in both).

This file is the command line, the run and the report; its parts: bench/trainer/workload.py (model shapes, packs),
bench/trainer/paths.py (ours, the HF baselines, the timing loop), bench/trainer/search.py (the longest pack).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# After the path set-up (noqa: E402). The parts: the workload, the timed paths, the pack search.
from bench.trainer.deadline import Deadline, run_limited  # noqa: E402
from bench.trainer.paths import (ZERO_STAGE, build_ours, destroy_ours, device_info, hf_cannot_fit,  # noqa: E402
                                 measure_hf_best, measure_ours, release, resolve_baselines, sp1_check)
from bench.trainer.report import TARGET_MFU, TARGET_RATIO, print_report  # noqa: E402
from bench.trainer.search import TARGET_PACK, ckpt_levels, pack_search  # noqa: E402
from bench.trainer.workload import PRESETS, describe_packs, make_packs, pack_row, parse_shape  # noqa: E402
from hbp_train.common.errors import EXIT_USER_ERROR, UserError  # noqa: E402
from hbp_train.common.outputs import atomic_write  # noqa: E402
from hbp_train.train import set_cuda_allocator  # noqa: E402

OURS_SHARE = 0.35  # of --time-budget-s kept for our path while the first HF path runs, unless --ours-reserve-s


# ------------------------------------------------------------------------------------------------ arguments
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/trainer/bench_trainer.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-shape", default=None,
                   help=f"preset ({', '.join(PRESETS)}), a JSON object of HF config fields, or a JSON / HF "
                        "config.json file; 'model_type' picks the architecture (default llama). Default: "
                        "llama3.2-1b on cuda, tiny on cpu")
    p.add_argument("--pack-len", type=int, default=None,
                   help="tokens per pack for the comparison (default 16384 on cuda, 1024 on cpu)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per path, one pack each (default 10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3 on cuda, 1 on cpu)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="parameter dtype of both paths (default bf16 on cuda, fp32 on cpu)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default) or cpu (a smoke run with a tiny shape: gloo, fp32, sdpa_block)")
    p.add_argument("--ckpt-layers", type=int, default=0,
                   help="activation-checkpointed layers of our path in the comparison (default 0; the baselines "
                        "use none)")
    p.add_argument("--backend", default="auto",
                   help="our packed attention backend (hbp_train.model.attention: auto, fa3, fa4, flash_varlen, "
                        "torch_varlen, flex, sdpa_block; default auto = the fastest installed that runs the model)")
    p.add_argument("--baselines", default="sdpa,best",
                   help="HF baselines, comma separated: sdpa, best (best packed-capable attention present), or an "
                        "attn_implementation name (flash_attention_2, flex_attention), each optionally with :amp "
                        "(the accuracy path: fp32 master weights under bf16 autocast) or :bf16 (the speed path: "
                        "parameters and AdamW states in --dtype); 'none' = skip (default sdpa,best)")
    p.add_argument("--baseline-precision", choices=("bf16", "amp"), default="bf16",
                   help="precision of the baselines named without :amp/:bf16: bf16 (default; the speed path) or "
                        "amp (the accuracy path)")
    p.add_argument("--baseline-ckpt", action="store_true",
                   help="HF baselines with gradient checkpointing on every layer (HF's "
                        "activation_checkpointing_enable, what HF users do for long packs; compare with --ckpt-layers "
                        "set to the layer count)")
    p.add_argument("--kernels", default="auto", choices=("auto", "liger", "compile", "none"),
                   help="our decoder kernels (model.kernels, hbp_train/model/kernels.py; default auto: liger on CUDA "
                        "when installed)")
    p.add_argument("--max-pack-search", type=int, default=None,
                   help="longest pack to try in the search (default 131072 on cuda, 2x --pack-len on cpu; 0 = no "
                        "search)")
    p.add_argument("--search-docs", choices=("single", "mix"), default="single",
                   help="search packs: one document of the whole length (default) or the realistic mix")
    p.add_argument("--ckpt-levels", default=None,
                   help="checkpointed-layer counts the search tries, comma separated (default 0,L/4,L/2,3L/4,L)")
    p.add_argument("--search-steps", type=int, default=1,
                   help="steps per search attempt; the last one is timed (default 1)")
    p.add_argument("--search-budget-s", type=float, default=300.0,
                   help="start no search attempt after this many seconds of searching (default 300)")
    p.add_argument("--no-sp1-check", action="store_true", help="skip the sp=1 dispatcher-vs-direct check")
    p.add_argument("--time-budget-s", type=float, default=None,
                   help="hold the whole bench to this many seconds (default: none): the first HF path runs first, "
                        "stopped when it would leave ours less than --ours-reserve-s (a first step compiling for "
                        "minutes); ours then times the steps that fit, the sp=1 check and the search run in what is "
                        "left, then the other HF paths when as much time is left as the first took. Every skip is in "
                        "the results")
    p.add_argument("--ours-reserve-s", type=float, default=None,
                   help=f"with --time-budget-s: seconds kept for ours while the first HF path runs (default "
                        f"{OURS_SHARE:.0%} of the budget)")
    p.add_argument("--hf-min-s", type=float, default=0.0,
                   help="with --time-budget-s: start the first HF path only when at least this many seconds are left "
                        "for it (its first step's compile: less would stop it half-way; default 0)")
    p.add_argument("--prompt-frac", type=float, default=0.0,
                   help="share of each sample's first tokens with label -100 (a prompt). 0 (default) trains every "
                        "token; > 0 lets our loss skip those LM-head rows while MFU still counts them")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate of all paths (default 1e-5)")
    p.add_argument("--loss-chunk", type=int, default=4096, help="our LM-head chunk in tokens (default 4096)")
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="peak TFLOP/s of the device for MFU (default 0 = look the GPU up; none on a CPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data and the initial weights (default 0)")
    p.add_argument("--out", default=None, metavar="JSON", help="write the results here")
    return p


def resolve_args(args) -> argparse.Namespace:
    """Fill device-dependent defaults and validate; UserError names the flag."""
    cpu = args.device == "cpu"
    args.model_shape = args.model_shape or ("tiny" if cpu else "llama3.2-1b")
    args.pack_len = args.pack_len or (1024 if cpu else 16384)
    args.warmup = args.warmup if args.warmup is not None else (1 if cpu else 3)
    args.dtype = args.dtype or ("fp32" if cpu else "bf16")
    if args.max_pack_search is None:
        args.max_pack_search = 2 * args.pack_len if cpu else TARGET_PACK
    if args.pack_len < 16:
        raise UserError(f"--pack-len {args.pack_len}: must be >= 16")
    if args.steps < 1 or args.warmup < 0 or args.search_steps < 1:
        raise UserError("--steps and --search-steps must be >= 1 and --warmup >= 0")
    if args.max_pack_search and args.max_pack_search < args.pack_len:
        raise UserError(f"--max-pack-search {args.max_pack_search}: must be 0 or >= --pack-len {args.pack_len}")
    if not 0 <= args.prompt_frac < 1:
        raise UserError(f"--prompt-frac {args.prompt_frac}: must be in [0, 1)")
    if args.time_budget_s is not None and args.time_budget_s <= 0:
        raise UserError(f"--time-budget-s {args.time_budget_s}: must be > 0")
    if args.ours_reserve_s is not None and not (args.time_budget_s and 0 <= args.ours_reserve_s <= args.time_budget_s):
        raise UserError(f"--ours-reserve-s {args.ours_reserve_s}: needs --time-budget-s and must be in [0, it]")
    if args.ckpt_layers < 0 or args.loss_chunk < 1 or args.lr <= 0 or args.peak_tflops < 0:
        raise UserError("--ckpt-layers, --peak-tflops must be >= 0; --loss-chunk, --lr must be > 0")
    if cpu and args.dtype == "bf16":
        raise UserError("--dtype bf16 with --device cpu: the CPU smoke run is fp32")
    args.baselines = [] if args.baselines.strip() in ("", "none") else [b.strip() for b in args.baselines.split(",")]
    return args


def _measure_baseline(args, architecture, hf_config, baseline, packs, device, peak_flops, seconds) -> dict:
    """One HF baseline (trying "best"'s fallbacks in turn) held to ``seconds`` (None: no limit): its summary with
    ran=True and the key of the implementation that ran, or ran=False and why; "tried" lists kernels that failed
    before it."""
    from hbp_train.observe.telemetry import is_oom

    try:
        done, over = run_limited(lambda: measure_hf_best(args, architecture, hf_config, baseline, packs, device),
                                 seconds if args.time_budget_s else None, baseline.key)
    except Exception as exc:  # noqa: BLE001 - a baseline that fails (OOM, missing kernel) is reported, not fatal
        return {"error": "out of memory" if is_oom(exc) else
                f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                "tried": getattr(exc, "hbp_tried", [])}
    if over:
        return {"error": f"{over} (its share of the bench's budget; a first step still compiling?)"}
    measured, ran, tried = done
    return {**measured.summary(peak_flops), "ran": True, "key": ran.key, "label": ran.label, "attention": ran.impl,
            "tried": tried}


def ratios(paths: dict) -> tuple[dict, str | None]:
    ours = paths.get("ours")
    out, best = {}, None
    if not ours or not ours.get("ran"):
        return out, None
    ran = {k: v for k, v in paths.items() if k != "ours" and v.get("ran")}
    for name, r in ran.items():
        out[f"ours/{name}"] = {"tokens_per_s": ours["tokens_per_s"] / r["tokens_per_s"],
                               "mfu": ours["mfu"] / r["mfu"] if ours["mfu"] and r["mfu"] else None,
                               "peak_mem": ours["peak_mem_gib"] / r["peak_mem_gib"] if r["peak_mem_gib"] else None}
    if ran:
        best = max(ran, key=lambda k: ran[k]["tokens_per_s"])
        out["ours/best_hf"] = dict(out[f"ours/{best}"], best_hf=best)
    return out, best


# ---------------------------------------------------------------------------------------------------- main
def save(results: dict, out) -> None:
    """Write the results so far (also after every phase: a run stopped by a time limit keeps what it measured), to a
    temporary file moved over the last one: a stop half-way through the write leaves the last results whole."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(results, indent=1, default=float) + "\n"
        atomic_write(out, lambda tmp: tmp.write_text(text))


def run_bench(args) -> dict:
    import torch

    from hbp_train.distributed.groups import init_distributed
    from hbp_train.observe.telemetry import resolve_peak_flops

    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device here; use --device cpu --model-shape tiny for a smoke run")
    name, architecture, hf_config = parse_shape(args.model_shape)
    hf_config.setdefault("max_position_embeddings", max(131072, args.max_pack_search or 0, args.pack_len))
    if args.ckpt_layers > int(hf_config["num_hidden_layers"]):
        raise UserError(f"--ckpt-layers {args.ckpt_layers}: the model has {hf_config['num_hidden_layers']} layers")
    ckpt_levels(args.ckpt_levels, int(hf_config["num_hidden_layers"]))  # a bad list fails now, not after the comparison
    if args.device == "cpu" and args.backend == "auto":
        args.backend = "sdpa_block"
    init_distributed("gloo" if args.device == "cpu" else "nccl")
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    peak_flops = resolve_peak_flops(args.peak_tflops * 1e12)
    packs = make_packs(args.pack_len, args.warmup + args.steps, hf_config["vocab_size"], args.seed, args.prompt_frac)
    results = {"bench": "bench_trainer", "version": 1, "complete": False, "command": " ".join(sys.argv),
               "device": device_info(device, peak_flops),
               "model": {"shape": name, "architecture": architecture, "config": hf_config},
               "data": describe_packs(packs),
               "settings": {"pack_len": args.pack_len, "steps": args.steps, "warmup": args.warmup, "dtype": args.dtype,
                            "ckpt_layers": args.ckpt_layers, "zero_stage": ZERO_STAGE, "loss_chunk": args.loss_chunk,
                            "lr": args.lr, "grad_clip": 1.0, "baseline_precision": args.baseline_precision,
                            "baseline_ckpt": args.baseline_ckpt, "kernels": args.kernels,
                            "prompt_frac": args.prompt_frac, "seed": args.seed,
                            "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")},
               "paths": {}, "notes": [], "ratios": {}}
    if device.type == "cpu":
        results["notes"].append("CPU smoke run: the figures only show that every path trains; they say nothing about "
                                "GPU speed, and CPU peak memory is the process's peak RSS")

    # 1. The first HF path (the speed path): plain torch frees cleanly, ours' DeepSpeed engine comes after it and stays
    # for the search. With a budget the other HF paths come after ours (step 3), so the ratio is measured first.
    deadline = args.deadline = Deadline(args.time_budget_s)
    baselines, notes = resolve_baselines(args.baselines, device, args.dtype, args.baseline_precision)
    results["notes"] += notes
    results["skipped"] = []
    early, late = (baselines[:1], baselines[1:]) if args.time_budget_s else (baselines, [])
    first_took = 0.0
    for baseline in early:
        first_took = max(first_took, _run_baseline(args, results, baseline, architecture, hf_config, packs, device,
                                                   peak_flops, reserve=ours_reserve_s(args), needs_s=args.hf_min_s))

    # 2. Ours, then the sp=1 check and the pack search on the same engine, freed whatever stops them.
    run = None
    try:
        run, backend = build_ours(args, architecture, hf_config, device)
        entry, first = _measure_ours_entry(args, results, run, backend, packs, device, peak_flops)
        if not entry["ran"]:  # outside the except block, whose traceback held the failed step's tensors
            destroy_ours(run)
            run = None  # drop the old engine before building the next one
            release(device)
            run = build_ours(args, architecture, hf_config, device)[0] if args.max_pack_search and deadline.left() > 0 \
                else None
        results["paths"] = {"ours": entry, **results["paths"]}
        _judge(results)
        save(results, args.out)
        if not args.no_sp1_check and entry["ran"]:
            if deadline.left() < 2 * args.steps * entry["step_time_s_mean"]:
                results["skipped"].append(f"sp1_check: {max(deadline.left(), 0):.0f} s of the budget left")
            else:
                try:
                    results["sp1_check"] = sp1_check(run, batches_of(packs), args)
                except Exception as exc:  # noqa: BLE001 - reported; the rest of the benchmark still counts
                    results["sp1_check"] = {"error": f"{type(exc).__name__}: "
                                                     f"{str(exc).splitlines()[0] if str(exc) else ''}"}
        if args.max_pack_search and args.time_budget_s:
            args.search_budget_s = min(args.search_budget_s, max(deadline.left(), 0.0))
        results["settings"]["search_budget_s"] = args.search_budget_s if args.max_pack_search else None
        if args.max_pack_search and run is not None:

            def on_attempt(partial):
                results["pack_search"] = partial
                save(results, args.out)

            # Hand the engine over with no reference left here: after an OOM the search drops it before building the
            # next one, and a reference held here would keep its weights, gradients and optimizer states (~20 GB
            # for the 1B shape) on the GPU for the rest of the search; a search that is stopped frees its own.
            handover, run = [run], None
            results["pack_search"], run = pack_search(
                args, handover.pop(), lambda: build_ours(args, architecture, hf_config, device)[0], hf_config,
                device, peak_flops, first, on_attempt)
    finally:  # an outer time limit too: the next check must not find ~20 GB left to the garbage collector
        destroy_ours(run)
        run = None
        release(device)

    # 3. With a budget, the other HF paths (the accuracy path) in the time left, each when as much is left as the
    # first HF path took (its first step compiles again).
    for baseline in late:
        _run_baseline(args, results, baseline, architecture, hf_config, packs, device, peak_flops, reserve=0.0,
                      needs_s=first_took)
    _judge(results)
    best, entry = results["targets"]["best_hf"], results["paths"]["ours"]
    best_ratio = results["ratios"].get("ours/best_hf", {}).get("tokens_per_s")
    search = results.get("pack_search")
    results["targets"].update(
        ratio_met=None if best_ratio is None else best_ratio >= TARGET_RATIO,
        mfu_met=None if entry.get("mfu") is None else entry["mfu"] >= TARGET_MFU,
        pack_met=None if not search else search["goal_met"])
    return results


def ours_reserve_s(args) -> float:
    """Seconds kept for ours while the first HF path runs (0 without a budget)."""
    if not args.time_budget_s:
        return 0.0
    return args.ours_reserve_s if args.ours_reserve_s is not None else OURS_SHARE * args.time_budget_s


def batches_of(packs: list) -> list:
    from hbp_train.batches.collate import collate_pack

    return [collate_pack(pack_row(p), check_counts=False) for p in packs]


def _run_baseline(args, results, baseline, architecture, hf_config, packs, device, peak_flops, reserve: float,
                  needs_s: float = 0.0) -> float:
    """One HF path into results["paths"] (saved at once): not run when it cannot fit the GPU or when less than
    ``needs_s`` (and a tenth of the budget) is left after ``reserve``; else measured, held to what is left less
    ``reserve``. Returns the seconds it took."""
    import time

    from hbp_train.perf.shape import parse_model_shape

    deadline = args.deadline
    key, entry = baseline.key, {"label": baseline.label, "attention": baseline.impl, "precision": baseline.precision,
                                "device": results["device"]["name"], "ran": False}
    why_not = hf_cannot_fit(args.pack_len, int(hf_config["vocab_size"]), parse_model_shape(hf_config).num_params,
                            baseline.precision, device)
    share = deadline.left() - reserve
    if why_not is None and share < max(0.1 * (args.time_budget_s or 0), needs_s):
        why_not = (f"{max(deadline.left(), 0):.0f} s of the bench's budget left"
                   + (f", {reserve:.0f} s of it kept for ours" if reserve else "")
                   + (f"; it needs {needs_s:.0f} s (what the first HF path took)" if needs_s else ""))
    started = time.monotonic()
    if why_not:
        entry["error"] = f"not run: {why_not}"
        results["skipped"].append(f"{key}: {why_not}")
    else:
        args.deadline = Deadline(share if args.time_budget_s else None)  # its steps stop in time for ours
        try:
            entry.update(_measure_baseline(args, architecture, hf_config, baseline, packs, device, peak_flops, share))
        finally:
            args.deadline = deadline
        key = entry.pop("key", key)
    took = time.monotonic() - started
    entry["wall_s"] = round(took, 1)
    release(device)  # after the except block: its traceback held the failed step's tensors
    results["paths"][key] = entry
    save(results, args.out)
    return took


def _measure_ours_entry(args, results, run, backend, packs, device, peak_flops) -> tuple[dict, dict]:
    """Ours' timed steps on ``run``: (its path entry, the search's first attempt). Out of memory or out of time is
    recorded in the entry (ran=False); any other failure is raised."""
    from hbp_train.model import attention
    from hbp_train.model.attention_setup import describe_backend
    from hbp_train.model.hf_model import num_params
    from hbp_train.observe.telemetry import is_oom

    label, deadline = results["device"]["name"], args.deadline
    results["model"]["num_params"] = num_params(run.model)
    fused_loss = run.cfg.loss.fused_on(device)
    results["settings"].update(grad_accum_fp32=run.cfg.deepspeed.grad_accum_fp32(1),
                               loss_impl="fused" if fused_loss else "chunked")
    entry = {"label": f"hbp_train train_step: DeepSpeed ZeRO-2 + packed varlen attention + "
                      f"{'fused' if fused_loss else 'chunked'} LM-head loss",
             "attention": f"hbp_packed/{backend}", "backend": backend, "device": label, "ran": False,
             "attention_kernel": describe_backend(backend, device),
             "decoder_kernels": getattr(run.model, "_hbp_kernels", "n/a"),
             "fused_kernels": list(getattr(run.model, "_hbp_fused_kernels", ())),
             "ckpt_layers": args.ckpt_layers}
    first = {"pack_len": args.pack_len, "ckpt_layers": args.ckpt_layers, "docs": "mix", "ok": False, "oom": False,
             "device": label, "from": "comparison"}
    try:
        measured, over = run_limited(lambda: measure_ours(run, batches_of(packs), args, run.model.config, "ours"),
                                     deadline.left() if args.time_budget_s else None, "ours")
        if over:
            raise TimeoutError(over)
    except Exception as exc:  # noqa: BLE001
        if not (is_oom(exc) or isinstance(exc, TimeoutError)):
            raise
        entry["error"] = "out of memory" if is_oom(exc) else str(exc)
        first["oom"] = is_oom(exc)
        return entry, first
    entry.update(measured.summary(peak_flops), ran=True)
    ran_with = attention.get_backend()
    if ran_with != backend:  # the chosen kernel failed on the first real pack and gave way (attention.py)
        results["notes"].append(f"ours: attention backend {backend} failed on the first pack; {ran_with} ran")
        entry.update(attention=f"hbp_packed/{ran_with}", backend=ran_with,
                     attention_kernel=describe_backend(ran_with, device))
    if len(measured.step_times) < args.steps:
        results["skipped"].append(f"ours: timed {len(measured.step_times)} of {args.steps} steps (the budget)")
    first.update(ok=True, step_time_s=entry["step_time_s_mean"], tokens_per_s=entry["tokens_per_s"],
                 mfu=entry["mfu"], peak_mem_gib=entry["peak_mem_gib"])
    return entry, first


def _judge(results: dict) -> None:
    """The ratios to the HF paths that ran, the faster one as best_hf, and why there is no ratio when none ran."""
    results["ratios"], best = ratios(results["paths"])
    results.setdefault("targets", {}).update(tokens_per_s_ratio=TARGET_RATIO, mfu=TARGET_MFU, pack_len=TARGET_PACK,
                                             best_hf=best)
    hf_errors = [f"{k}: {v.get('error')}" for k, v in results["paths"].items() if k != "ours"]
    results.pop("no_ratio", None)
    if best is None and results["paths"].get("ours", {}).get("ran") and hf_errors:  # e.g. HF cannot fit at 64K
        results["no_ratio"] = "no HF path ran: " + "; ".join(hf_errors)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args = resolve_args(args)
        if args.device == "cpu":
            # Keep torch and DeepSpeed off any GPU for the smoke run (must precede the first CUDA query).
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        else:
            set_cuda_allocator()  # the trainer's allocator setting: long packs fragment less
        for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            os.environ.setdefault(key, "1")
        results = run_bench(args)
    except UserError as exc:
        print(f"bench_trainer: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    results["complete"] = True
    save(results, args.out)
    print_report(results)
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
