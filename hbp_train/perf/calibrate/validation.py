"""--validate: the whole model's forward and backward timed on packs of 1 to --max-samples samples through the
trainer's own program (its attention backend, decoder kernels and LM-head loss, as training resolves them here),
against the cost model's prediction (the error per pack and its summary).
"""

from __future__ import annotations

import numpy as np

from hbp_train.perf.calibrate import timing
from hbp_train.perf.cost_model import TABLE_TOKENS, CostModel
from hbp_train.perf.shape import ModelShape

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
    fixed = 4 * shape.num_params + timing.VALIDATE_LOSS_CHUNK * shape.vocab * 10
    while tokens > 1024 and fixed + tokens * per_token > MEMORY_HEADROOM * memory_bytes:
        tokens //= 2
    return tokens


def validate_fitting(shape: ModelShape, model: CostModel, args, device, dtype) -> dict:
    """``validate``, halving ``args.tokens`` (down to 1024) each time a pack runs out of memory: the size
    estimate is a model, and a GPU's free memory can shrink while it runs. Other errors propagate."""
    import gc

    import torch

    from hbp_train.observe.telemetry import is_oom

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

    from hbp_train.common.labels import IGNORE_INDEX
    from hbp_train.model import kernels
    from hbp_train.model.attention_setup import register_packed_attention
    from hbp_train.model.hf_model import decoder_layers, forward_hidden
    from hbp_train.model.rope import PackSlice

    timed = timing.timer(device)
    torch.manual_seed(args.seed)
    with torch.device(device):  # built where it runs, in its dtype: a 1B model made in fp32 on the CPU takes minutes
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            net = LlamaForCausalLM(timing.llama_config(shape))
        finally:
            torch.set_default_dtype(previous)
    _, chosen, fused = timing.training_program(args, device, dtype, shape)
    backend = register_packed_attention(net, args.backend, device)
    phrase = kernels.apply_kernels(net, chosen, decoder_layers(net))
    rng = np.random.default_rng(args.seed)
    counts = np.unique(np.geomspace(1, args.max_samples, args.num_packs).round().astype(int))
    rows = []
    for count in counts.tolist():
        lengths = random_pack(rng, args.tokens, count)
        ids = torch.randint(0, shape.vocab, (1, args.tokens), device=device)
        pos = torch.cat([torch.arange(l, device=device) for l in lengths])[None]
        cu = timing.cu_seqlens_for(lengths, device)
        pack_slice = PackSlice.whole(np.concatenate([[0], np.cumsum(lengths)]))  # per-sample RoPE, as the trainer's

        # The trainer's program: decoder, then its LM-head loss; labels are the next token within a sample.
        shift = torch.cat([ids[0, 1:], ids[0, :1]]).masked_fill(torch.isin(
            torch.arange(args.tokens, device=device), cu[1:].long() - 1), IGNORE_INDEX)

        def step():
            hidden = forward_hidden(net, ids, pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                                    max_length_q=max(lengths), max_length_k=max(lengths), pack_slice=pack_slice)
            timing.head_loss(hidden, net.get_output_embeddings().weight, shift, fused).backward()

        measured = timed(step, args.iters, args.warmup) / 1e3
        net.zero_grad(set_to_none=True)
        predicted = model.pack_time(lengths)
        rows.append({"num_samples": count, "lengths": lengths, "measured_s": measured, "predicted_s": predicted,
                     "error": predicted / measured - 1.0})
        print(f"pack of {count:>3} samples (longest {max(lengths):>6}): measured {measured * 1e3:9.2f} ms, "
              f"predicted {predicted * 1e3:9.2f} ms, error {100 * rows[-1]['error']:+6.1f}%", flush=True)
    errors = np.abs([r["error"] for r in rows])
    return {"model_shape": shape.name, "cost_model": model.describe(), "backend": backend, "decoder_kernels": phrase,
            "loss_impl": "fused" if fused else "chunked", "tokens": args.tokens,
            "device": timing.device_name(device),
            "mean_abs_error": float(errors.mean()), "max_abs_error": float(errors.max()),
            "within_10_percent": bool(errors.max() <= 0.10), "packs": rows}
