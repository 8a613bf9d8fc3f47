"""Cost-model calibration: time one decoder layer's attention by document length and its linear part.

    python -m hbp_train.perf.calibrate --model-shape llama3.2-1b --out calib_1b.json
    python -m hbp_train.perf.calibrate --model-shape llama3.2-1b --calibration calib_1b.json --validate \\
        --validate-out validate_1b.json
    OMP_NUM_THREADS=1 python -m hbp_train.perf.calibrate --device cpu --threads 1 --procs 2 --model-shape S.json \\
        --tokens 8192 --doc-lens 64,256,1024,4096,8192 --out calib_cpu.json        # for training on this CPU

Calibrate (default): one decoder layer built with transformers from the shape's config (Llama architecture,
random weights, bf16 on a GPU, fp32 on the CPU). Attention: packs of ``--tokens`` tokens made of documents of one
length each, packed varlen causal attention from hbp_train.attention (best backend available), timed forward and
forward+backward. Linear part: the whole layer (norms, q/k/v/o projections, RoPE, gated MLP) fwd+bwd with the
attention core replaced by a cheap elementwise stand-in. LM head: the trainer's chunked LM-head loss fwd+bwd
over the shape's vocabulary (``time_head``). Times are medians over ``--iters`` after ``--warmup`` and
are written per 32768 tokens, the format of hbp_train/perf/calibration/h100_llama3_8b_layer.json (plus
"model_shape", and "device", "dtype", "threads", "procs").

On the CPU (``--device cpu``) the numbers are a calibration of this machine for CPU training (the trainer's fp32
and ``sdpa_block`` backend): measure with the torch threads one training rank gets (``--threads``: cores //
processes, what launch.sh sets as OMP_NUM_THREADS) and with ``--procs`` = the training processes, which measure the
same points at the same moment (a barrier before each), because ranks running side by side share caches and
memory bandwidth: a lone process on an idle machine runs faster than a training rank does.

Validate (``--validate``): builds the whole model (all layers + LM head), times fwd+bwd of packs holding
1 to ``--max-samples`` samples (random split of ``--tokens``) through the trainer's own program (the decoder, then
the chunked LM-head loss of hbp_train/loss.py, never T x vocab logits), compares with CostModel.pack_time from the
calibration, prints the error per pack and writes a JSON report (the acceptance target is within 10%). Its default
pack is the largest that fits the GPU (``validate_tokens``): 32768 tokens of an 8B shape do not fit 80 GB.

Without a GPU and without ``--device cpu`` this prints one line and exits 2.

The module is over 500 lines because calibrating, validating and measuring with several CPU processes are one
command: they share its timer (with the processes' barrier), the model builders, the rounds and the flags.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import platform
import statistics
import sys
import threading
import time
from datetime import date

import numpy as np

from hbp_train.cli import ArgumentParser, existing_file, nonneg_int, output_file, positive_int
from hbp_train.errors import EXIT_USER_ERROR, UserError
from hbp_train.outputs import check_output_file, write_output
from hbp_train.perf.cost_model import TABLE_TOKENS, CostModel
from hbp_train.perf.shape import ModelShape, parse_model_shape

DEFAULT_DOC_LENS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
NOOP_ATTENTION = "hbp_calibrate_noop"


def build_parser() -> argparse.ArgumentParser:
    from hbp_train.attention import BACKENDS  # imports torch: not at module level, like main's own torch import

    p = ArgumentParser(prog="python -m hbp_train.perf.calibrate", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-shape", default="llama3.2-1b",
                   help="preset (llama3-8b, llama3.2-1b, ...), JSON object or JSON/HF config.json file (default "
                        "llama3.2-1b)")
    p.add_argument("--tokens", type=positive_int, default=None,
                   help="tokens per timed pack (results are written per 32768 tokens). Default: 32768 to calibrate; "
                        "to validate, the largest of 32768, 16384, ... whose whole-model step fits the GPU "
                        "(validate_tokens)")
    p.add_argument("--doc-lens", default=",".join(map(str, DEFAULT_DOC_LENS)),
                   help="document lengths of the attention table, comma separated (each <= --tokens) (default "
                        f"{','.join(map(str, DEFAULT_DOC_LENS))})")
    p.add_argument("--iters", type=positive_int, default=10,
                   help="timed iterations per point; the median is kept (default 10)")
    p.add_argument("--warmup", type=nonneg_int, default=3, help="untimed warm-up iterations per point (default 3)")
    p.add_argument("--rounds", type=positive_int, default=1,
                   help="measure every point this many times, one round through all of them after the other, and "
                        "keep each point's median: a machine whose speed drifts (a shared CPU) then slows every "
                        "point alike (default 1)")
    p.add_argument("--backend", default="auto", choices=("auto", *BACKENDS),
                   help="attention backend (hbp_train.attention); auto picks the best one available here (default "
                        "auto)")
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


# Set in every process of a --procs measurement: all of them wait here before each point, so they time together.
_BARRIER = None


def _timer(device):
    """A function timing fn() -> milliseconds (CUDA events on GPU, perf_counter on CPU)."""
    import torch

    def run(fn, iters: int, warmup: int) -> float:
        if _BARRIER is not None:
            _BARRIER.wait()
        for _ in range(warmup):
            fn()
        if _BARRIER is not None:  # the warm-ups can differ in length between the processes
            _BARRIER.wait()
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return run


def device_name(device) -> str:
    """The GPU's name, or the CPU's model and the threads this process computes with."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {_cpu_model()}, {torch.get_num_threads()} thread(s)"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # not Linux
        pass
    return platform.processor() or platform.machine()


def device_fields(device, dtype, procs: int = 1) -> dict:
    """What a calibration file says about where it was measured ("gpu" is the field older files have)."""
    import torch

    fields = {"device": device.type, "dtype": str(dtype).removeprefix("torch."), "gpu": device_name(device)}
    if device.type == "cpu":
        fields.update(gpu=None, cpu=device_name(device), threads=torch.get_num_threads(), procs=procs)
    return fields


def llama_config(shape: ModelShape, attn_implementation: str = "sdpa"):
    """A transformers LlamaConfig with the shape (no dropout, no cache, RoPE theta of Llama 3)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=shape.hidden, num_hidden_layers=shape.num_layers,
                      num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                      head_dim=shape.head_dim, intermediate_size=shape.ffn, vocab_size=shape.vocab,
                      max_position_embeddings=max(131072, TABLE_TOKENS), rope_theta=500000.0,
                      attention_dropout=0.0, use_cache=False, tie_word_embeddings=shape.tie_word_embeddings)
    cfg._attn_implementation = attn_implementation
    return cfg


def _noop_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Stand-in for the attention core: elementwise, touches q, k and v so every projection gets a gradient."""
    groups = query.shape[1] // key.shape[1]
    mixed = query + (key + value).repeat_interleave(groups, dim=1)
    return mixed.transpose(1, 2), None


def parse_doc_lens(text: str, tokens: int) -> list[int]:
    """The --doc-lens list; UserError naming the flag."""
    try:
        doc_lens = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:  # int() of a piece that is not a number
        raise UserError(f"--doc-lens must be comma-separated integers, got {text!r}") from None
    if not doc_lens or any(l < 1 or l > tokens for l in doc_lens):
        raise UserError(f"--doc-lens must be positive and <= --tokens ({tokens}), got {text}")
    return doc_lens


def cu_seqlens_for(lengths, device):
    import torch

    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)


def calibrate(shape: ModelShape, args, device, dtype) -> dict:
    """Measure the attention table and the linear part; returns the calibration dict."""
    import torch
    from transformers import AttentionInterface
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from hbp_train.attention import packed_attention, select_backend

    timed = _timer(device)
    backend = select_backend(args.backend, device, dtype)
    doc_lens = parse_doc_lens(args.doc_lens, args.tokens)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    fwdbwd, fwd = {}, {}
    for length in doc_lens:
        num_docs = args.tokens // length
        tokens = num_docs * length
        cu = cu_seqlens_for([length] * num_docs, device)

        def make(heads):
            return torch.randn(tokens, heads, shape.head_dim, generator=gen).to(device, dtype).requires_grad_()

        q, k, v = make(shape.num_heads), make(shape.num_kv_heads), make(shape.num_kv_heads)
        grad = torch.randn(tokens, shape.num_heads, shape.head_dim, generator=gen).to(device, dtype)

        def forward():
            with torch.no_grad():
                packed_attention(q, k, v, cu, length, backend)

        def forward_backward():
            out = packed_attention(q, k, v, cu, length, backend)
            torch.autograd.grad(out, (q, k, v), grad)

        scale = TABLE_TOKENS / tokens
        fwd[str(length)] = round(timed(forward, args.iters, args.warmup) * scale, 3)
        fwdbwd[str(length)] = round(timed(forward_backward, args.iters, args.warmup) * scale, 3)
        print(f"attention doc_len {length:>6}: fwd {fwd[str(length)]:.3f} ms, fwd+bwd {fwdbwd[str(length)]:.3f} ms "
              f"per {TABLE_TOKENS} tokens", flush=True)
        del q, k, v, grad
    # Linear part: one layer with the attention core replaced by an elementwise stand-in.
    AttentionInterface.register(NOOP_ATTENTION, _noop_attention)
    cfg = llama_config(shape, NOOP_ATTENTION)
    torch.manual_seed(args.seed)
    layer = LlamaDecoderLayer(cfg, layer_idx=0).to(device, dtype)
    rope = LlamaRotaryEmbedding(cfg).to(device)
    hidden = torch.randn(1, args.tokens, shape.hidden, generator=gen).to(device, dtype).requires_grad_()
    position_ids = torch.arange(args.tokens, device=device)[None]
    pos_emb = rope(hidden, position_ids)

    def layer_step():
        out = layer(hidden, position_ids=position_ids, position_embeddings=pos_emb)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))

    linear = round(timed(layer_step, args.iters, args.warmup) * TABLE_TOKENS / args.tokens, 3)
    print(f"linear part (layer without attention core): {linear:.3f} ms per {TABLE_TOKENS} tokens", flush=True)
    del layer, hidden, pos_emb
    head = round(time_head(shape, args, device, dtype, timed, gen) * TABLE_TOKENS / args.tokens, 3)
    print(f"LM head + chunked loss: {head:.3f} ms per {TABLE_TOKENS} tokens", flush=True)
    return {
        "what": f"One transformer layer shaped like {shape.name} (hidden {shape.hidden}, {shape.num_heads} q heads, "
                f"{shape.num_kv_heads} kv heads, head dim {shape.head_dim}, ffn {shape.ffn}), {str(dtype)[6:]}, "
                f"fwd+bwd, attention backend {backend} (causal, packed). T = tokens in the pack.",
        "measured": f"{date.today().isoformat()}, median of {args.iters} timed iterations after {args.warmup} "
                    f"warm-ups, {args.tokens} tokens per timed pack",
        **device_fields(device, dtype, args.procs),
        "torch": torch.__version__,
        "model_shape": {k: getattr(shape, k) for k in ("name", "hidden", "num_layers", "num_heads",
                                                        "num_kv_heads", "ffn", "vocab", "head_dim")},
        "linear_fwdbwd_ms_per_32768_tokens": linear,
        "head_fwdbwd_ms_per_32768_tokens": head,
        "head_loss_chunk": VALIDATE_LOSS_CHUNK,
        "attention_fwdbwd_ms_32768_tokens_by_doc_len": fwdbwd,
        "attention_fwd_ms_32768_tokens_by_doc_len": fwd,
    }


def calibrate_or_explain(shape: ModelShape, args, device, dtype) -> dict:
    """``calibrate``; running out of memory is one line naming the flag to lower (the free memory is in it)."""
    import torch

    from hbp_train.telemetry import is_oom

    try:
        return calibrate(shape, args, device, dtype)
    except (torch.cuda.OutOfMemoryError, RuntimeError) as exc:
        if not is_oom(exc):
            raise
    free = free_gpu_bytes()
    raise UserError(f"out of memory timing packs of --tokens {args.tokens} (the GPU has "
                    f"{'?' if free is None else f'{free / 2**30:.1f} GiB'} free): rerun with --tokens "
                    f"{max(args.tokens // 2, 1)} (results are written per {TABLE_TOKENS} tokens either way)")


VALIDATE_LOSS_CHUNK = 4096  # loss.chunk_size's default: the trainer's LM-head chunk
MEMORY_HEADROOM = 0.85  # share of the GPU the validation step may plan to use (allocator cache, CUDA context)


def validate_tokens(shape: ModelShape, memory_bytes: int | None) -> int:
    """The largest pack of 32768, 16384, ... (at least 1024) tokens whose validation step fits ``memory_bytes``
    (the GPU's free memory, ``free_gpu_bytes``): bf16 parameters and gradients, every layer's activations (no
    checkpointing: the cost model times a plain step) and one chunk of the chunked loss (perf/memory.py's
    accounting). 32768 without a memory size."""
    from hbp_train.perf.memory import activation_bytes_per_token_layer

    tokens = TABLE_TOKENS
    if not memory_bytes:
        return tokens
    per_token = shape.num_layers * activation_bytes_per_token_layer(shape) + 6 * shape.hidden
    fixed = 4 * shape.num_params + VALIDATE_LOSS_CHUNK * shape.vocab * 10
    while tokens > 1024 and fixed + tokens * per_token > MEMORY_HEADROOM * memory_bytes:
        tokens //= 2
    return tokens


def time_head(shape: ModelShape, args, device, dtype, timed, gen) -> float:
    """Milliseconds of the LM head with the trainer's chunked loss (hbp_train/loss.py), fwd+bwd, for --tokens
    tokens: four vocab x hidden matmuls plus fp32 passes over every chunk's logits, which the layer's FLOP rate
    does not predict (the cost model's head term)."""
    import torch

    from hbp_train.loss import chunked_token_losses

    hidden = torch.randn(args.tokens, shape.hidden, generator=gen).to(device, dtype).requires_grad_()
    weight = (torch.randn(shape.vocab, shape.hidden, generator=gen) * 0.02).to(device, dtype).requires_grad_()
    labels = torch.randint(0, shape.vocab, (args.tokens,), generator=gen).to(device)

    def head_step():
        loss = chunked_token_losses(hidden, weight, labels, VALIDATE_LOSS_CHUNK).sum()
        torch.autograd.grad(loss, (hidden, weight))

    return timed(head_step, args.iters, args.warmup)
def free_gpu_bytes() -> int | None:
    """Free memory of the current GPU now (what other processes, this one and the CUDA context leave), or None
    without a GPU. The total would overstate it on a shared or busy GPU."""
    import torch

    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None


def validate_fitting(shape: ModelShape, model: CostModel, args, device, dtype) -> dict:
    """``validate``, halving ``args.tokens`` (down to 1024) each time a pack runs out of memory: the size
    estimate is a model, and a GPU's free memory can shrink while it runs. Other errors propagate."""
    import gc

    import torch

    from hbp_train.telemetry import is_oom

    while True:
        try:
            return validate(shape, model, args, device, dtype)
        except (torch.cuda.OutOfMemoryError, RuntimeError) as exc:
            if not is_oom(exc) or args.tokens // 2 < max(1024, args.max_samples):
                raise
        gc.collect()  # out of the except block: the traceback's frames (and their tensors) are gone
        if device.type == "cuda":
            torch.cuda.empty_cache()
        args.tokens //= 2
        print(f"out of memory: validating with packs of {args.tokens} tokens", flush=True)


def random_pack(rng: np.random.Generator, tokens: int, num_samples: int) -> list[int]:
    """``num_samples`` lengths (>= 1) summing to ``tokens``, long-tailed (a Dirichlet split with alpha 0.5)."""
    share = rng.dirichlet(np.full(num_samples, 0.5))
    lengths = np.maximum(1, np.floor(share * (tokens - num_samples)).astype(np.int64) + 1)
    lengths[np.argmax(lengths)] += tokens - lengths.sum()
    return lengths.tolist()


def validate(shape: ModelShape, model: CostModel, args, device, dtype) -> dict:
    """Time fwd+bwd of the full model on packs of 1..max_samples samples; compare with model.pack_time."""
    import torch
    from transformers import LlamaForCausalLM

    from hbp_train.attention import register_packed_attention
    from hbp_train.labels import IGNORE_INDEX
    from hbp_train.loss import chunked_token_losses
    from hbp_train.model import forward_hidden

    timed = _timer(device)
    torch.manual_seed(args.seed)
    with torch.device(device):  # built where it runs, in its dtype: a 1B model made in fp32 on the CPU takes minutes
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            net = LlamaForCausalLM(llama_config(shape))
        finally:
            torch.set_default_dtype(previous)
    backend = register_packed_attention(net, args.backend, device)
    rng = np.random.default_rng(args.seed)
    counts = np.unique(np.geomspace(1, args.max_samples, args.num_packs).round().astype(int))
    rows = []
    for count in counts.tolist():
        lengths = random_pack(rng, args.tokens, count)
        ids = torch.randint(0, shape.vocab, (1, args.tokens), device=device)
        pos = torch.cat([torch.arange(l, device=device) for l in lengths])[None]
        cu = cu_seqlens_for(lengths, device)

        # The trainer's program: decoder, then the chunked LM-head loss; labels are the next token within a sample.
        shift = torch.cat([ids[0, 1:], ids[0, :1]]).masked_fill(torch.isin(
            torch.arange(args.tokens, device=device), cu[1:].long() - 1), IGNORE_INDEX)

        def step():
            hidden = forward_hidden(net, ids, pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                    max_length_q=max(lengths), max_length_k=max(lengths))
            loss_T = chunked_token_losses(hidden, net.get_output_embeddings().weight, shift, VALIDATE_LOSS_CHUNK)
            loss_T.sum().backward()

        measured = timed(step, args.iters, args.warmup) / 1e3
        net.zero_grad(set_to_none=True)
        predicted = model.pack_time(lengths)
        rows.append({"num_samples": count, "lengths": lengths, "measured_s": measured, "predicted_s": predicted,
                     "error": predicted / measured - 1.0})
        print(f"pack of {count:>3} samples (longest {max(lengths):>6}): measured {measured * 1e3:9.2f} ms, "
              f"predicted {predicted * 1e3:9.2f} ms, error {100 * rows[-1]['error']:+6.1f}%", flush=True)
    errors = np.abs([r["error"] for r in rows])
    return {"model_shape": shape.name, "cost_model": model.describe(), "backend": backend, "tokens": args.tokens,
            "device": device_name(device),
            "mean_abs_error": float(errors.mean()), "max_abs_error": float(errors.max()),
            "within_10_percent": bool(errors.max() <= 0.10), "packs": rows}


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    import torch

    try:
        shape = parse_model_shape(args.model_shape)
        if args.device == "cuda" and (args.threads is not None or args.procs > 1):
            raise UserError("--threads and --procs are for --device cpu (a GPU rank computes on its GPU)")
        if args.tokens is None:
            args.tokens = (validate_tokens(shape, free_gpu_bytes() if args.device == "cuda" else None)
                           if args.validate else TABLE_TOKENS)
        if args.validate and args.max_samples > args.tokens:
            raise UserError(f"--max-samples ({args.max_samples}) cannot exceed --tokens ({args.tokens})")
        if not args.validate and not args.out:
            raise UserError("--out JSON is required to write the calibration")
        if not args.validate:
            parse_doc_lens(args.doc_lens, args.tokens)
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
            return median_of_rounds([validate_fitting(shape, model, args, device, dtype) for _ in range(args.rounds)])
        return median_of_rounds([calibrate_or_explain(shape, args, device, dtype) for _ in range(args.rounds)])
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
    global _BARRIER
    ctx = multiprocessing.get_context("spawn")  # no fork of a process that has torch's thread pools
    _BARRIER = ctx.Barrier(args.procs)
    others = [ctx.Process(target=_companion, args=(shape, model, args, _BARRIER), daemon=True)
              for _ in range(args.procs - 1)]
    for proc in others:
        proc.start()
    try:
        return measure(shape, model, args)
    except threading.BrokenBarrierError:  # a companion failed and broke the barrier; its traceback is above
        raise RuntimeError("a --procs process stopped; its traceback is above") from None
    except BaseException:
        _BARRIER.abort()  # the companions stop at their next wait instead of waiting for this process forever
        raise
    finally:
        for proc in others:
            proc.join(timeout=60)
        _BARRIER = None


def _companion(shape, model, args, barrier) -> None:
    """A spawned --procs process: the same measurements, in step with the first process; its times are dropped."""
    global _BARRIER
    _BARRIER = barrier
    try:
        measure(shape, model, args, quiet=True)
    except threading.BrokenBarrierError:  # the first process stopped: nothing left to keep in step with
        return
    except BaseException:
        barrier.abort()
        raise


if __name__ == "__main__":
    sys.exit(main())
