"""Measured against modelled peak memory of a training step, lever by lever, and the longest sample under a cap.

    python bench/bench_memory_levers.py [--tokens 8192] [--layers 4] [--cap-mib 1024] [--no-cap] [--json OUT]

For each memory lever (none; the tiled LM-head loss; every layer checkpointed; the tiled MLP; the tiled MLP with
checkpointing; checkpointing with activation offload; all of them) one fresh process runs one forward and backward
of the real model on one pack (a Llama of hidden 1024 whose activations dominate its states; the trainer's fused
LM-head loss, ``model/packed_lm.PackedCausalLM``; the levers as training installs them, ``model/levers.py``), and the bench
prints its measured peak beside the peak ``perf/memory.py`` predicts for it, and the error. Then, under a memory
cap, the longest pack without levers and with all of them, measured (each length its own process: the largest
length whose measured peak is under the cap, found from the model's prediction by measuring it and its neighbours)
beside the model's, and the factor the levers give each way.

What is measured (CPU, bf16): the bytes torch's CPU allocator holds at its highest during the step (the torch
profiler's memory events: live bytes allocated in the step, what ``torch.cuda.max_memory_allocated`` reads on a
GPU) plus the parameters and gradients that exist before it (made up front, as DeepSpeed's gradient buffers are).
The model is asked for the same job: no optimizer states (``offload_optimizer``: only the bf16 parameters), the
CPU's attention (``sdpa_block``: one SDPA per document, whose output is copied for o_proj, no fp32 dq accumulator)
and HF's eager norms and MLP (no Liger on the CPU). What a GPU adds is modelled, not measured here: the varlen
kernels' and Liger's buffers, the allocator's fragmentation (the profiler's headroom), ZeRO's buffers.

Offload on the CPU: DeepSpeed's offload moves nothing off a CPU (it has no device to free), so the bench makes its
engine copy each offloaded input into host memory outside torch's allocator (numpy) with the side stream off: the
measured peak is what stays on "the device", in the forward and in the backward (each input restored into torch's
allocator for its own layer, model/levers.py). The model is asked for inline copies too
(``JobSettings.offload_side_stream=False``: the newest input stays); the one more a GPU's side stream keeps
(``perf.memory.OFFLOAD_INPUTS_ON_DEVICE``) is modelled, not measured here.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

MIB = 2 ** 20


@dataclass(frozen=True)
class Config:
    """One measured step: the model's shape, the pack, the levers."""

    name: str
    tokens: int = 8192
    ckpt_layers: int = 0
    loss_chunk: int = 0
    """Tokens per LM-head loss chunk; 0 = the whole pack at once (no tiled loss)."""
    tiled_mlp: bool = False
    offload: bool = False
    hidden: int = 1024
    ffn: int = 4096
    heads: int = 16
    kv_heads: int = 4
    layers: int = 4
    vocab: int = 4096
    doc: int = 1024
    """Tokens per document of the pack (the last one shorter when it does not divide ``tokens``)."""

    def hf_config(self) -> dict:
        return {"hidden_size": self.hidden, "intermediate_size": self.ffn, "num_attention_heads": self.heads,
                "num_key_value_heads": self.kv_heads, "num_hidden_layers": self.layers, "vocab_size": self.vocab,
                "max_position_embeddings": max(self.tokens, 2048)}

    def chunk(self) -> int:
        return self.loss_chunk or self.tokens


def lever_configs(tokens: int, layers: int, chunk: int = 1024) -> list[Config]:
    """The configurations the bench and its test measure, every lever alone and all together."""
    every = layers
    return [Config("none", tokens, layers=layers), Config("tiled loss", tokens, loss_chunk=chunk, layers=layers),
            Config("checkpointing", tokens, every, layers=layers),
            Config("tiled MLP", tokens, tiled_mlp=True, layers=layers),
            Config("tiled MLP + checkpointing", tokens, every, tiled_mlp=True, layers=layers),
            Config("checkpointing + offload", tokens, every, offload=True, layers=layers),
            Config("all levers", tokens, every, chunk, True, True, layers=layers)]


# ----------------------------------------------------------------------------------------------- prediction
def predict(config: Config) -> dict:
    """The memory model's peak for ``config`` as the bench measures it: bf16 parameters and gradients (no optimizer
    states), the CPU's attention and HF's eager modules."""
    from hbp_train.perf.memory import JobSettings, memory_breakdown
    from hbp_train.perf.shape import parse_model_shape

    shape = parse_model_shape(config.hf_config())
    job = JobSettings(zero_stage=1, offload_optimizer=True, grad_accum_fp32=False, loss_chunk_tokens=config.chunk(),
                      attention_out_shared=False, attention_fp32_dq=False, offload_side_stream=False)
    br = memory_breakdown(shape, config.tokens, 1, config.ckpt_layers, 1, job, config.tiled_mlp, config.offload)
    params_and_grads = 4 * shape.num_params
    return {"bytes": params_and_grads + br.activations, "moment": br.moment, "params_and_grads": params_and_grads}


# ------------------------------------------------------------------------------------------------ measurement
def measure(config: Config) -> dict:
    """One forward and backward of ``config`` in this process; the peak as the module docstring says."""
    import numpy as np
    import torch
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    from hbp_train.model.packed_lm import PackedCausalLM
    from hbp_train.model.hf_model import ModelConfig, build_model, set_checkpointed_layers
    from hbp_train.model.levers import Levers, install_levers
    from hbp_train.model.loss import token_loss_weights
    from hbp_train.perf.shape import mlp_tiles

    torch.manual_seed(0)
    model = build_model(ModelConfig(config=config.hf_config(), dtype="bf16", attention_backend="sdpa_block"),
                        vocab_size=config.vocab)
    set_checkpointed_layers(model, config.ckpt_layers)
    levers = install_levers(model)
    levers.set(Levers(mlp_tiles=mlp_tiles(config.hidden, config.tokens, 1) if config.tiled_mlp else 1,
                      offload=config.offload))
    model.train()
    module = PackedCausalLM(model, chunk_size=config.chunk(), fused_loss=True)
    docs = [config.doc] * (config.tokens // config.doc) + ([config.tokens % config.doc] if config.tokens % config.doc
                                                            else [])
    ids = torch.randint(0, config.vocab, (1, config.tokens))
    positions = torch.cat([torch.arange(d) for d in docs])[None]
    labels = torch.randint(0, config.vocab, (1, config.tokens))
    cu_seqlens = torch.tensor(np.concatenate([[0], np.cumsum(docs)]), dtype=torch.int32)
    weights = token_loss_weights(labels, None, "sum")
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    for p in model.parameters():  # the gradients exist before the step, as DeepSpeed's buffers do
        p.grad = torch.zeros_like(p)
    context = levers.micro_batch()
    if config.offload:
        _offload_off_the_allocator(context.ctx)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        with context:
            objective, _ = module(ids, positions, labels, cu_seqlens, max(docs), loss_weights=weights,
                                  num_loss_tokens=config.tokens)
            objective.backward()
    peak = 0
    events = list(prof.profiler.kineto_results.experimental_event_tree())
    while events:
        event = events.pop()
        events.extend(event.children)
        if event.tag == _EventType.Allocation:
            peak = max(peak, event.extra_fields.total_allocated)
    stats = levers.offload_stats
    return {"bytes": 2 * params + peak, "offloaded_bytes": stats.offloaded_bytes if stats else 0}


def _offload_off_the_allocator(ctx) -> None:
    """Make DeepSpeed's offload engine (``ctx``) move inputs on the CPU: it skips every tensor there (no device), so
    it is told to skip only what it skips on a GPU (small tensors, parameters), to copy without a side stream into
    host buffers that torch's allocator does not count (numpy's), and so what it offloads leaves the measurement."""
    import types

    import numpy as np
    import torch

    ctx.use_streams, ctx.s1, ctx.use_pin_memory = False, None, False
    ctx._should_skip = lambda t: t.numel() * t.element_size() < ctx.min_offload_bytes or \
        isinstance(t, torch.nn.Parameter)

    def host_buffer(self, tensor):
        raw = np.empty(tensor.numel() * tensor.element_size(), np.uint8)
        return torch.from_numpy(raw).view(tensor.dtype).reshape(tensor.shape), self._buffer_key(tensor)

    ctx._empty_cpu_like = types.MethodType(host_buffer, ctx)


def measure_in_child(config: Config, timeout: float = 3600) -> dict:
    """``measure`` in a fresh process (one allocator, one model per configuration)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, __file__, "--worker", json.dumps(asdict(config))], capture_output=True,
                         text=True, timeout=timeout, env=env, cwd=str(ROOT))
    if out.returncode != 0:
        raise RuntimeError(f"measuring {config.name} at {config.tokens} tokens failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def compare(config: Config) -> dict:
    """Measured and predicted peaks of one configuration, and the prediction's error."""
    measured, predicted = measure_in_child(config), predict(config)
    return {"name": config.name, "tokens": config.tokens, "measured_mib": measured["bytes"] / MIB,
            "predicted_mib": predicted["bytes"] / MIB, "error": predicted["bytes"] / measured["bytes"] - 1,
            "moment": predicted["moment"], "offloaded_mib": measured["offloaded_bytes"] / MIB}


# -------------------------------------------------------------------------------------------- longest under cap
def predicted_longest(config: Config, cap: int, granule: int) -> int:
    """The longest pack (a multiple of ``granule`` tokens) the model says fits under ``cap`` bytes."""
    lo, hi = 0, 1
    while predict(replace(config, tokens=hi * granule))["bytes"] <= cap:
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if predict(replace(config, tokens=mid * granule))["bytes"] <= cap else (lo, mid)
    return lo * granule


def measured_longest(config: Config, cap: int, granule: int, start: int, log=print) -> tuple[int, list]:
    """The longest pack (a multiple of ``granule``) whose measured peak is under ``cap``: measured at ``start`` (the
    model's answer), then one granule up or down until the answer is bracketed by a length that fits and the next
    one that does not. Returns it and every (tokens, measured bytes)."""
    seen: dict[int, int] = {}

    def fits(tokens: int) -> bool:
        if tokens not in seen:
            seen[tokens] = measure_in_child(replace(config, tokens=tokens))["bytes"]
            log(f"  {config.name}: {tokens} tokens -> {seen[tokens] / MIB:.1f} MiB "
                f"({'fits' if seen[tokens] <= cap else 'over'} {cap / MIB:.0f} MiB)")
        return seen[tokens] <= cap

    tokens = max(granule, start)
    if fits(tokens):
        while fits(tokens + granule):
            tokens += granule
    else:
        while tokens > granule and not fits(tokens - granule):
            tokens -= granule
        tokens = tokens - granule if tokens > granule else 0
    return tokens, sorted(seen.items())


def cap_experiment(base: Config, levers: Config, cap: int, granule: int, log=print) -> dict:
    """The longest pack under ``cap`` without and with the levers, measured and modelled, and their factors."""
    out = {"cap_mib": cap / MIB, "granule": granule}
    for key, config in (("without", base), ("with", levers)):
        model = predicted_longest(config, cap, granule)
        measured, points = measured_longest(config, cap, granule, model, log)
        out[key] = {"config": config.name, "predicted_tokens": model, "measured_tokens": measured,
                    "points": [[t, b / MIB] for t, b in points]}
    out["predicted_factor"] = out["with"]["predicted_tokens"] / max(out["without"]["predicted_tokens"], 1)
    out["measured_factor"] = out["with"]["measured_tokens"] / max(out["without"]["measured_tokens"], 1)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="tokens of the measured pack (default 8192)")
    p.add_argument("--layers", type=int, default=4, help="decoder layers (default 4)")
    p.add_argument("--cap-mib", type=float, default=1024, help="memory cap of the longest-pack search (default 1024)")
    p.add_argument("--no-cap", action="store_true", help="skip the longest-pack search under the cap")
    p.add_argument("--json", default=None, help="write the results as JSON")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(measure(Config(**json.loads(args.worker)))))
        return 0
    rows = []
    print(f"{'levers':<28} {'tokens':>7} {'measured MiB':>13} {'predicted MiB':>14} {'error':>7}  peak moment")
    for config in lever_configs(args.tokens, args.layers):
        row = compare(config)
        rows.append(row)
        print(f"{row['name']:<28} {row['tokens']:>7} {row['measured_mib']:>13.1f} {row['predicted_mib']:>14.1f} "
              f"{row['error']:>+7.1%}  {row['moment']}", flush=True)
    worst = max(abs(r["error"]) for r in rows)
    print(f"largest error: {worst:.1%} (the bound the test holds: 10%)")
    results = {"rows": rows, "worst_error": worst}
    if not args.no_cap:
        configs = lever_configs(args.tokens, args.layers)
        cap = cap_experiment(configs[0], configs[-1], int(args.cap_mib * MIB), 1024)
        results["cap"] = cap
        for key in ("without", "with"):
            c = cap[key]
            print(f"under {cap['cap_mib']:.0f} MiB, {c['config']}: longest pack measured {c['measured_tokens']:,} "
                  f"tokens, modelled {c['predicted_tokens']:,}")
        print(f"the levers' factor: measured {cap['measured_factor']:.2f}x, modelled {cap['predicted_factor']:.2f}x "
              f"({cap['predicted_factor'] / cap['measured_factor'] - 1:+.1%})")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
