"""How long can I go? The longest sample a number of GPUs trains, each memory lever added in turn.

    hbp-profile --max-context --model llama3-8b --gpus 8 [--gpu-memory-gb 80] [--headroom 0.9] [--json OUT]

For a model (a preset shape name, an HF config.json or a folder holding one, or a JSON shape), a number of GPUs and
their memory, the ladder below adds one lever per row; each row is the longest single sample (one document, one
pack) whose modelled peak memory (``perf.memory.memory_breakdown``) fits ``headroom`` x the GPU's memory, under the
ZeRO setup that trains the longest sample at that row (then the fastest), with the step time the cost model
predicts for it (one pack per SP group per step; the ZeRO collectives and optimizer step included):

    baseline           one GPU per sample (no SP), no checkpointing, the LM-head loss over the whole sample at once
    + SP               Ulysses over all GPUs (the largest degree perf.shape's heads rule allows)
    + checkpointing    every decoder layer checkpointed
    + tiled loss       the LM-head loss one chunk at a time (--loss-chunk tokens)
    + tiled MLP        each MLP over sequence tiles
    + offload          the checkpointed layers' inputs in host memory

Everything is modelled, nothing runs: a row says which moment of the step bounds it (docs/profiler.md), and
``--target-tokens N`` prints the last row's memory terms at N tokens (what prevents it). The figures assume a GPU
run's kernels (a varlen attention kernel; Liger's RMSNorm and SwiGLU unless ``--kernels eager``).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from hbp_train.common.cli import ArgumentParser, output_file, positive_float, positive_int
from hbp_train.common.errors import EXIT_USER_ERROR, UserError
from hbp_train.common.outputs import write_output
from hbp_train.perf.cost_model import DEFAULT_PCIE_GBPS, CostModel
from hbp_train.perf.memory import JobSettings, grad_bucket_bytes, memory_breakdown
from hbp_train.perf.shape import ModelShape, parse_model_shape, sp_heads_problem
from hbp_train.profiler.zero_choice import ZeroSetup

GIB = 2 ** 30
# Sample lengths are searched in steps of this many tokens (a multiple of every SP degree).
GRANULE = 1024
ZERO_SETUPS = (ZeroSetup(1), ZeroSetup(2), ZeroSetup(3), ZeroSetup(1, True), ZeroSetup(2, True), ZeroSetup(3, True),
               ZeroSetup(3, True, True))


@dataclass(frozen=True)
class Rung:
    """One row of the ladder: the levers on at that row."""

    name: str
    sp_all: bool = False
    ckpt_all: bool = False
    tiled_loss: bool = False
    tiled_mlp: bool = False
    offload: bool = False


LADDER = (Rung("baseline"), Rung("+ SP over all GPUs", True), Rung("+ checkpointing", True, True),
          Rung("+ tiled loss", True, True, True), Rung("+ tiled MLP", True, True, True, True),
          Rung("+ offload", True, True, True, True, True))


def read_model(spec: str) -> ModelShape:
    """A preset shape name, a JSON shape, an HF config.json, or a model folder holding one (UserError otherwise)."""
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UserError(f"--model {spec}: a folder without config.json; give the model's folder, its "
                            "config.json, or a preset shape name")
        path = path / "config.json"
        spec = str(path)
    shape = parse_model_shape(spec)
    return replace(shape, name=path.parent.name if path.is_file() and shape.name == "custom" else shape.name)


def largest_sp(shape: ModelShape, gpus: int) -> tuple[int, str]:
    """The largest power-of-two SP degree up to ``gpus`` that Ulysses can split the model's heads by, and the one
    line saying why the next one up (within ``gpus``) is refused ("" when none is)."""
    degrees = [1 << i for i in range(gpus.bit_length()) if gpus % (1 << i) == 0]
    usable = [sp for sp in degrees if sp_heads_problem(shape.num_heads, shape.num_kv_heads, sp) is None]
    refused = [sp for sp in degrees if sp > max(usable)]
    note = sp_heads_problem(shape.num_heads, shape.num_kv_heads, refused[0]) if refused else ""
    return max(usable), note or ""


def base_job(args, setup: ZeroSetup, chunk: int) -> JobSettings:
    """The job a row runs: one micro-batch per step (bf16 gradient sums), a varlen kernel, the kernels asked for, the
    loss in ``chunk`` tokens, the default DeepSpeed buckets (overlap_comm on)."""
    liger = args.kernels == "liger"
    job = JobSettings(loss_chunk_tokens=chunk, grad_accum_fp32=False, attention_out_shared=True,
                      attention_fp32_dq=True, fused_rms_norm=liger, fused_swiglu=liger)
    job = setup.job(job)
    return replace(job, grad_bucket_bytes=grad_bucket_bytes(args.reduce_bucket_size, setup.stage, True))


def longest_fitting(fits) -> int:
    """The largest multiple of GRANULE tokens for which ``fits(tokens)`` holds (0 when even GRANULE does not):
    memory grows with the length, so double, then bisect."""
    if not fits(GRANULE):
        return 0
    lo, hi = 1, 2
    while fits(hi * GRANULE):
        lo, hi = hi, hi * 2
        if hi > 1 << 24:  # 17 billion tokens: nothing here is bounded by memory any more
            return lo * GRANULE
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid * GRANULE) else (lo, mid)
    return lo * GRANULE


def ladder(args, shape: ModelShape, cost_model: CostModel) -> tuple[list[dict], str]:
    """Every row of the ladder for ``args`` (the CLI's options), and the SP refusal note."""
    budget = args.headroom * args.gpu_memory_gb * GIB
    sp_max, note = largest_sp(shape, args.gpus)
    rows = []
    for rung in LADDER:
        sp = sp_max if rung.sp_all else 1
        ckpt = shape.num_layers if rung.ckpt_all else 0
        best = None
        for setup in ZERO_SETUPS:
            def breakdown(tokens, setup=setup):
                job = base_job(args, setup, args.loss_chunk if rung.tiled_loss else tokens)
                return memory_breakdown(shape, tokens, sp, ckpt, args.gpus, job, rung.tiled_mlp, rung.offload)
            tokens = longest_fitting(lambda t: breakdown(t).peak <= budget)
            if not tokens:
                continue
            time_s = step_seconds(args, shape, cost_model, tokens, sp, ckpt, rung, setup)
            if best is None or (tokens, -time_s) > (best["tokens"], -best["step_s"]):
                br = breakdown(tokens)
                best = {"rung": rung.name, "tokens": tokens, "sp": sp, "ckpt_layers": ckpt,
                        "loss_chunk": args.loss_chunk if rung.tiled_loss else None, "tiled_mlp": rung.tiled_mlp,
                        "offload_activations": rung.offload, "zero": setup.describe(), **setup.as_dict(),
                        "step_s": time_s, "tokens_per_s_per_gpu": tokens / (time_s * sp),
                        "peak_gib": br.peak / GIB, "bound_by": br.moment,
                        "host_gib_per_gpu": host_bytes(shape, args.gpus, setup, br.host) / GIB}
        rows.append(best or {"rung": rung.name, "tokens": 0, "sp": sp, "ckpt_layers": ckpt, "zero": "-"})
    return rows, note


def step_seconds(args, shape, cost_model: CostModel, tokens: int, sp: int, ckpt: int, rung: Rung,
                 setup: ZeroSetup) -> float:
    """Predicted seconds of one step: one sample of ``tokens`` on each SP group (its pack time with the row's levers)
    plus ZeRO's collectives and optimizer step for one micro-batch (planning.simulator.zero_comm_seconds)."""
    from hbp_train.planning.simulator import SimConfig, zero_comm_seconds

    pack = cost_model.pack_time([tokens], sp, ckpt, gpus_per_node=args.gpus_per_node, tiled_mlp=rung.tiled_mlp,
                                offload_activations=rung.offload, pcie_gbps=args.pcie_gbps)
    comm = zero_comm_seconds(shape.num_params, args.gpus, SimConfig(
        gpus_per_node=args.gpus_per_node, zero_stage=setup.stage, pcie_gbps=args.pcie_gbps,
        offload_optimizer=setup.offload_optimizer, offload_param=setup.offload_param))
    return pack + comm["micro"] + comm["step"] + comm["optimizer"]


def host_bytes(shape: ModelShape, gpus: int, setup: ZeroSetup, offloaded_activations: int) -> int:
    """Host memory one GPU's rank uses for the offloads: the activations' copies, and with optimizer offload its fp32
    master weights, Adam moments and fp32 gradients (16 B per parameter of its partition), with parameter offload
    its bf16 partition (2 B)."""
    per_param = (16 if setup.offload_optimizer else 0) + (2 if setup.offload_param else 0)
    return int(offloaded_activations + per_param * shape.num_params / gpus)


def target_terms(args, shape: ModelShape, tokens: int) -> dict:
    """The last row's memory at ``tokens``: its moments, and the terms of the one that bounds the peak, under the
    ZeRO setup that holds the least."""
    rung = LADDER[-1]
    sp, _ = largest_sp(shape, args.gpus)
    options = [(memory_breakdown(shape, tokens, sp, shape.num_layers, args.gpus, base_job(args, s, args.loss_chunk),
                                 rung.tiled_mlp, rung.offload), s) for s in ZERO_SETUPS]
    best, setup = min(options, key=lambda o: o[0].peak)
    moment = best.moment if best.moment != "step" else "loss"
    return {"tokens": tokens, "sp": sp, "zero": setup.describe(), "peak_gib": best.peak / GIB,
            "budget_gib": args.headroom * args.gpu_memory_gb, "bound_by": best.moment,
            "terms_gib": {k: v / GIB for k, v in sorted(best.terms[moment].items(), key=lambda kv: -kv[1])}}


def format_rows(rows: list[dict], args, shape: ModelShape, note: str) -> str:
    """The ladder as a text table, labelled MODELLED."""
    head = (f"MODELLED (nothing runs): {shape.name} on {args.gpus} GPU(s) of {args.gpu_memory_gb:g} GiB, peak within "
            f"{args.headroom:g} of it; kernels: {args.kernels}; loss chunk {args.loss_chunk} tokens")
    lines = [head, f"{'levers':<20} {'longest sample':>15} {'sp':>3} {'ckpt':>4} {'ZeRO':<36} {'bound by':<15} "
                   f"{'step s':>9} {'tok/s/GPU':>10} {'host GiB/GPU':>12}"]
    for r in rows:
        if not r["tokens"]:
            lines.append(f"{r['rung']:<20} {'does not fit':>15}")
            continue
        lines.append(f"{r['rung']:<20} {r['tokens']:>15,} {r['sp']:>3} {r['ckpt_layers']:>4} {r['zero']:<36} "
                     f"{r['bound_by']:<15} {r['step_s']:>9.3g} {r['tokens_per_s_per_gpu']:>10,.0f} "
                     f"{r['host_gib_per_gpu']:>12.1f}")
    if note:
        lines.append(f"SP over all {args.gpus} GPUs refused: {note}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="hbp-profile --max-context", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, metavar="MODEL",
                   help="a preset shape name (llama3-8b, ...), a JSON shape, an HF config.json or the model's folder")
    p.add_argument("--gpus", type=positive_int, required=True, help="GPUs of the job (required)")
    p.add_argument("--gpu-memory-gb", type=positive_float, default=80.0,
                   help="memory of one GPU as sold (80 for an H100 80GB), read as GiB (default 80)")
    p.add_argument("--headroom", type=positive_float, default=0.9,
                   help="share of the GPU memory the modelled peak may use (default 0.9)")
    p.add_argument("--gpus-per-node", type=positive_int, default=8, help="GPUs per node (default 8)")
    p.add_argument("--loss-chunk", type=positive_int, default=8192,
                   help="tokens per chunk of the tiled LM-head loss (loss.chunk_size; default 8192)")
    p.add_argument("--kernels", choices=["liger", "eager"], default="liger",
                   help="the decoder kernels: Liger's RMSNorm and SwiGLU (model.kernels=auto on a GPU) or HF's "
                        "eager modules (default liger)")
    p.add_argument("--reduce-bucket-size", type=positive_int, default=200_000_000,
                   help="deepspeed.reduce_bucket_size, elements (default 2e8)")
    p.add_argument("--pcie-gbps", type=positive_float, default=DEFAULT_PCIE_GBPS,
                   help=f"host <-> GPU GB/s per GPU for the offloads (default {DEFAULT_PCIE_GBPS:g})")
    p.add_argument("--calibration", default=None, metavar="FILE",
                   help="cost-model calibration JSON (default: the shipped H100 Llama-3-8B layer)")
    p.add_argument("--target-tokens", type=positive_int, default=None, metavar="N",
                   help="also print the last row's memory terms at N tokens (what prevents that length)")
    p.add_argument("--json", default=None, metavar="OUT", type=output_file, help="write the rows as JSON")
    return p


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
        if not 0 < args.headroom <= 1:
            raise UserError(f"--headroom must be in (0, 1], got {args.headroom}")
        shape = read_model(args.model)
        cost_model = CostModel.from_calibration(args.calibration, model_shape=shape)
        rows, note = ladder(args, shape, cost_model)
        print(format_rows(rows, args, shape, note))
        out = {"modelled": True, "model": shape.name, "gpus": args.gpus, "gpu_memory_gb": args.gpu_memory_gb,
               "headroom": args.headroom, "kernels": args.kernels, "rows": rows, "sp_note": note,
               "cost_model": cost_model.describe()["note"]}
        if args.target_tokens:
            out["target"] = target_terms(args, shape, args.target_tokens)
            t = out["target"]
            print(f"at {t['tokens']:,} tokens (sp={t['sp']}, {t['zero']}): peak {t['peak_gib']:.1f} GiB of "
                  f"{t['budget_gib']:.1f}, bound by {t['bound_by']}: " +
                  ", ".join(f"{k} {v:.1f}" for k, v in t["terms_gib"].items() if v > 0.05) + " GiB")
        if args.json:
            write_output("--json", args.json, lambda p: p.write_text(json.dumps(out, indent=1) + "\n"))
        return 0
    except UserError as e:
        print(f"max-context: {str(e).splitlines()[0]}", file=sys.stderr)
        return EXIT_USER_ERROR
