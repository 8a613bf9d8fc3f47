"""The calibration command's flags and flow: one process, or --procs processes measuring together, over --rounds.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import threading

import numpy as np

from hbp_train.common.cli import ArgumentParser, existing_file, nonneg_int, output_file, positive_int
from hbp_train.common.errors import EXIT_USER_ERROR, UserError
from hbp_train.common.outputs import check_output_file, write_output
from hbp_train.perf.calibrate import layer, timing, validation
from hbp_train.perf.cost_model import TABLE_TOKENS, CostModel
from hbp_train.perf.shape import ModelShape, parse_model_shape


def build_parser() -> argparse.ArgumentParser:
    from hbp_train.model.attention import BACKENDS  # imports torch: not at module level, like main's own torch import

    p = ArgumentParser(prog="python -m hbp_train.perf.calibrate", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-shape", default="llama3.2-1b",
                   help="preset (llama3-8b, llama3.2-1b, ...), JSON object or JSON/HF config.json file (default "
                        "llama3.2-1b)")
    p.add_argument("--tokens", type=positive_int, default=None,
                   help="tokens per timed pack (results are written per 32768 tokens). Default: 32768 to calibrate; "
                        "to validate, the largest of 32768, 16384, ... whose whole-model step fits the GPU "
                        "(validate_tokens)")
    p.add_argument("--doc-lens", default=",".join(map(str, layer.DEFAULT_DOC_LENS)),
                   help="document lengths of the attention table, comma separated (each <= --tokens) (default "
                        f"{','.join(map(str, layer.DEFAULT_DOC_LENS))})")
    p.add_argument("--iters", type=positive_int, default=10,
                   help="timed iterations per point; the median is kept (default 10)")
    p.add_argument("--warmup", type=nonneg_int, default=3, help="untimed warm-up iterations per point (default 3)")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="measure every point this many times, one round through all of them after the other, and "
                        "keep each point's median: a machine whose speed drifts (a shared CPU) then slows every "
                        "point alike (default 1)")
    p.add_argument("--backend", default="auto", choices=("auto", *BACKENDS),
                   help="attention backend (hbp_train.model.attention); auto picks the best one available here (default "
                        "auto)")
    p.add_argument("--kernels", default="auto", choices=("auto", "liger", "compile", "none"),
                   help="decoder kernels, as model.kernels resolves them in training (default auto: Liger on a GPU "
                        "where installed, else HF's modules)")
    p.add_argument("--loss-impl", default="auto", choices=("auto", "fused", "chunked"),
                   help="the LM head + loss, as loss.impl resolves it in training (default auto: fused on a GPU, "
                        "chunked on the CPU)")
    p.add_argument("--out", default=None, metavar="JSON", type=output_file,
                   help="calibrate: where to write the calibration JSON (required unless --validate)")
    p.add_argument("--validate", action="store_true",
                   help="measure whole-pack times of the full model for packs of 1..--max-samples samples and "
                        "report the cost model's prediction error")
    p.add_argument("--calibration", default=None, metavar="JSON", type=existing_file,
                   help="validate: the calibration to test (default: the shipped one, scaled to the shape)")
    p.add_argument("--max-samples", type=positive_int, default=100,
                   help="validate: most samples in a pack (default 100)")
    p.add_argument("--num-packs", type=positive_int, default=12, help="validate: packs to time (default 12)")
    p.add_argument("--validate-out", default=None, metavar="JSON", type=output_file,
                   help="validate: where to write the report (default: printed only)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed for weights and pack splits (default 0)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="where to measure: cuda (bf16, the GPU a training rank uses) or cpu (fp32: a calibration "
                        "of this machine for training on its CPU) (default cuda)")
    p.add_argument("--allow-cpu", dest="device", action="store_const", const="cpu", help="the same as --device cpu")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="cpu: torch threads of each measuring process, the threads one training rank gets (default: "
                        "cores // --procs, as launch.sh sets OMP_NUM_THREADS)")
    p.add_argument("--procs", type=positive_int, default=1,
                   help="cpu: processes measuring the same points at once, as many as the training's ranks on this "
                        "machine (they share its caches and memory bandwidth); the first one's times are written "
                        "(default 1)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    try:
        shape = parse_model_shape(args.model_shape)
        if args.device == "cuda" and (args.threads is not None or args.procs > 1):
            raise UserError("--threads and --procs are for --device cpu (a GPU rank computes on its GPU)")
        if args.tokens is None:
            args.tokens = (validation.validate_tokens(shape, timing.free_gpu_bytes() if args.device == "cuda" else None)
                           if args.validate else TABLE_TOKENS)
        if args.validate and args.max_samples > args.tokens:
            raise UserError(f"--max-samples ({args.max_samples}) cannot exceed --tokens ({args.tokens})")
        if not args.validate and not args.out:
            raise UserError("--out JSON is required to write the calibration")
        if not args.validate:
            layer.parse_doc_lens(args.doc_lens, args.tokens)
        out_path = args.out if args.out and not args.validate else None
        report_path = args.validate_out if args.validate and args.validate_out else None
        check_output_file("--out", out_path)  # before the measurements, which take minutes
        check_output_file("--validate-out", report_path)
        if args.device == "cuda" and not torch.cuda.is_available():  # after the flags: fix those on a CPU node first
            raise UserError("no CUDA GPU here; calibrate a GPU on a GPU node, or this machine's CPU with --device cpu")
        model = CostModel.from_calibration(args.calibration, shape) if args.validate else None
        if args.device == "cpu":
            args.threads = args.threads or max(1, (os.cpu_count() or 1) // args.procs)
        result = measure_together(shape, model, args) if args.procs > 1 else measure(shape, model, args)
        if args.validate:
            print(f"cost model ({model.source}) vs measured: mean |error| {100 * result['mean_abs_error']:.1f}%, "
                  f"max {100 * result['max_abs_error']:.1f}% (target within 10%)")
            if report_path:
                write_output("--validate-out", report_path, lambda p: p.write_text(json.dumps(result, indent=1)))
                print(f"wrote {report_path}")
        else:
            write_output("--out", out_path, lambda p: p.write_text(json.dumps(result, indent=1)))
            print(f"wrote {out_path}")
    except UserError as exc:
        print(f"calibrate: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    return 0


def measure(shape: ModelShape, model, args, quiet: bool = False) -> dict:
    """This process's calibration (``model`` None) or validation report, on the device ``args.device`` names."""
    import torch

    threads = torch.get_num_threads()
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
        device, dtype = torch.device("cpu"), torch.float32
    else:
        device, dtype = torch.device("cuda", torch.cuda.current_device()), torch.bfloat16
    if quiet:  # a companion of --procs: the first process prints
        sys.stdout = open(os.devnull, "w")
    try:
        if model is not None:
            return median_of_rounds([validation.validate_fitting(shape, model, args, device, dtype) for _ in range(args.rounds)])
        return median_of_rounds([layer.calibrate_or_explain(shape, args, device, dtype) for _ in range(args.rounds)])
    finally:
        torch.set_num_threads(threads)  # called in a process with other work (tests): leave it as it was


CALIBRATION_TIMES = ("attention_fwdbwd_ms_32768_tokens_by_doc_len", "attention_fwd_ms_32768_tokens_by_doc_len")


def median_of_rounds(rounds: list) -> dict:
    """One result from --rounds measurements of the same points: every time is the median over the rounds, and
    "rounds" records how many there were and how far apart the rounds of a point lay (the largest max/min ratio:
    the timing noise of this machine). A calibration's tables and linear part; a validation's whole packs, with
    their errors and the summary computed anew."""
    out = rounds[0]
    if len(rounds) == 1:
        return out
    if "packs" in out:  # a validation report: the same packs (seeded) in every round
        times = np.array([[p["measured_s"] for p in r["packs"]] for r in rounds])
        for pack, measured in zip(out["packs"], np.median(times, axis=0)):
            pack.update(measured_s=float(measured), error=pack["predicted_s"] / float(measured) - 1.0)
        errors = np.abs([p["error"] for p in out["packs"]])
        out.update(mean_abs_error=float(errors.mean()), max_abs_error=float(errors.max()),
                   within_10_percent=bool(errors.max() <= 0.10))
    else:
        keys = ("linear_fwdbwd_ms_per_32768_tokens", "head_fwdbwd_ms_per_32768_tokens")
        times = np.array([[r[k] for k in keys] + [v for t in CALIBRATION_TIMES for v in r[t].values()]
                          for r in rounds])
        medians = np.round(np.median(times, axis=0), 3).tolist()
        for k in keys:
            out[k] = medians.pop(0)
        for table in CALIBRATION_TIMES:
            for length in out[table]:
                out[table][length] = medians.pop(0)
        out["measured"] += f", median of {len(rounds)} rounds"
    out["rounds"] = {"count": len(rounds), "max_spread": float((times.max(axis=0) / times.min(axis=0)).max())}
    return out


def measure_together(shape: ModelShape, model, args) -> dict:
    """--procs N on the CPU: N processes (this one and N-1 spawned) measure the same points at the same moments,
    as N training ranks compute side by side; this process's times are the result."""
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that has torch's thread pools
    timing.barrier = ctx.Barrier(args.procs)
    others = [ctx.Process(target=_companion, args=(shape, model, args, timing.barrier), daemon=True)
              for _ in range(args.procs - 1)]
    for proc in others:
        proc.start()
    try:
        return measure(shape, model, args)
    except threading.BrokenBarrierError:  # a companion failed and broke the barrier; its traceback is above
        raise RuntimeError("a --procs process stopped; its traceback is above") from None
    except BaseException:
        timing.barrier.abort()  # the companions stop at their next wait instead of waiting for this process forever
        raise
    finally:
        for proc in others:
            proc.join(timeout=60)
        timing.barrier = None


def _companion(shape, model, args, barrier) -> None:
    """A spawned --procs process: the same measurements, in step with the first process; its times are dropped."""
    timing.barrier = barrier
    try:
        measure(shape, model, args, quiet=True)
    except threading.BrokenBarrierError:  # the first process stopped: nothing left to keep in step with
        return
    except BaseException:
        barrier.abort()
        raise
