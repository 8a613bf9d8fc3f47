"""Analytic memory model of one training rank: ZeRO model states + kept activations + one loss chunk.

Used by the profiler's dry run (``hbp_train.profiler.backends.AnalyticBackend``), by its GPU backend to turn
the measured model's states into the training job's, and by the trainer's preflight (``memory_preflight``: one
warning per packing group predicted not to fit, before the engine allocates anything). It is an estimate to plan
with, not a measurement; docs/profiler.md states the model.

Pure Python: the trainer imports it without the profiler.
"""

from __future__ import annotations

from dataclasses import dataclass

from hbp_train.perf.shape import ModelShape


@dataclass
class JobSettings:
    """What the memory model takes from the training job's config (it must match the job being planned for)."""

    zero_stage: int = 2
    """deepspeed.zero_stage: which model states are sharded over the world size."""
    offload_optimizer: bool = False
    """deepspeed.offload_optimizer: optimizer states live on the CPU (not counted on the GPU)."""
    loss_chunk_tokens: int = 4096
    """loss.chunk_size: tokens per chunk of the chunked LM-head loss."""
    grad_accum_fp32: bool = True
    """DeepSpeed sums gradients in fp32 across micro-batches (deepspeed.grad_accum_dtype, fp32 by default at
    ZeRO-2/3 when a step has several micro-batches): 4 B per gradient element instead of bf16's 2 B, held from a
    step's first backward to its optimizer step."""
    attention_out_shared: bool = True
    """The attention kernel's output is the o_proj input itself (flash_varlen, torch_varlen: they return it laid out
    per token), rather than a per-token copy of it (flex, sdpa_block): one activation of the output's width less
    per token and layer (model.attention_backend; auto on a GPU picks a varlen kernel)."""
    fused_rms_norm: bool = False
    """Liger's RMSNorm (model.kernels=auto or liger on a GPU): a norm keeps its input in the activation dtype and one
    fp32 value per token, not HF's fp32 copy of its input (4h bytes per token and norm less)."""
    fused_swiglu: bool = False
    """Liger's SwiGLU: the gated MLP keeps gate and up, not also act(gate) (one ffn-wide activation less)."""

    @classmethod
    def of_run(cls, cfg, max_micro_batches=None, fused_kernels=()) -> "JobSettings":
        """The settings of a composed run config (its ``deepspeed`` and ``loss`` sections) for a plan whose steps
        have at most ``max_micro_batches`` per replica (None = unknown). ``fused_kernels``: the decoder kernels the
        built model runs (its ``_hbp_fused_kernels``: "rms_norm", "rope", "swiglu"); none known counts HF's modules,
        which keep more (an estimate on the safe side)."""
        backend = getattr(getattr(cfg, "model", None), "attention_backend", "auto")
        return cls(zero_stage=cfg.deepspeed.zero_stage, offload_optimizer=cfg.deepspeed.offload_optimizer,
                   loss_chunk_tokens=cfg.loss.chunk_size,
                   grad_accum_fp32=cfg.deepspeed.grad_accum_fp32(max_micro_batches),
                   attention_out_shared=backend in ("auto", *VARLEN_BACKENDS),
                   fused_rms_norm="rms_norm" in fused_kernels, fused_swiglu="swiglu" in fused_kernels)


# The attention backends whose kernel returns its output laid out per token (hbp_train/model/attention.py's varlen
# kernels): JobSettings.attention_out_shared.
VARLEN_BACKENDS = ("fa3", "fa4", "flash_varlen", "torch_varlen")


def model_state_bytes(params: int, world_size: int, job: JobSettings, in_step: bool = False) -> int:
    """Per-GPU bytes of model states in bf16 mixed precision under ZeRO over ``world_size`` ranks, as DeepSpeed
    0.19 allocates them (measured on the CPU in tests/test_memory.py).

    Through forward and backward: bf16 params 2 B (sharded at stage 3); gradients 2 B in bf16 or 4 B with fp32
    accumulation (sharded at stage >= 2; at stage 1 DeepSpeed keeps them whole); fp32 master weights and Adam m
    and v 12 B (sharded at stage >= 1). ``in_step`` (inside ``step()``, the activations gone): the optimizer
    needs this rank's gradient partition in fp32 (4 B). With fp32 accumulation at stage 1/2 that is the
    accumulated gradient itself; with bf16 accumulation step() converts the bf16 partition to a new fp32 one and
    frees the bf16 gradients; stage 3 copies its gradient partition (kept) into a new fp32 one either way.
    Optimizer offload keeps the optimizer state and the fp32 gradients on the CPU."""
    w, stage = world_size, job.zero_stage
    shard = {k: (w if stage >= k else 1) for k in (1, 2, 3)}
    weights = 2 * params / shard[3]
    grads = (4 if job.grad_accum_fp32 else 2) * params / shard[2]
    if job.offload_optimizer:
        return int(weights + grads)
    optimizer = 12 * params / shard[1]
    if not in_step:
        return int(weights + grads + optimizer)
    if stage == 3:
        fp32_grads = grads + 4 * params / shard[1]
    else:
        fp32_grads = grads if job.grad_accum_fp32 else 4 * params / shard[1]
    return int(weights + optimizer + fp32_grads)


def activation_bytes_per_token_layer(shape: ModelShape, dtype_bytes: int = 2, attention_out_shared: bool = True,
                                     fused_rms_norm: bool = False, fused_swiglu: bool = False) -> int:
    """Bytes one non-checkpointed decoder layer keeps per (rank-local) token for backward, as autograd saves them
    (counted with saved-tensor hooks in tests/test_memory.py, exactly, for each term): in the activation dtype
    (``dtype_bytes``, bf16 = 2) each RMSNorm's normalised input and its output (2 x 2h), q (heads*head_dim), k and
    v (2 x kv width), the attention output (heads*v_head_dim; a second copy of it as the o_proj input unless the
    kernel's output is that input, ``attention_out_shared``: the varlen kernels), and the gated MLP's gate, up,
    act(gate) and product (4 x the width a token goes through: ffn, or an MoE layer's top-k experts plus shared
    experts, ``active_ffn``); in fp32, whatever the dtype, each RMSNorm's fp32 input (2 x 4h: HF norms compute in
    fp32), the attention's log-sum-exp (4 per head) and each norm's 1/rms (2 x 4). Ulysses moves heads, not tokens,
    so per rank it is the same count at any SP degree. Model states count every expert (``num_params``).
    For the Llama-3.2-1B shape in bf16: 108,680 B (106.1 KiB) with a varlen kernel, 112,776 B with flex/sdpa_block.

    Liger's kernels (model.kernels=auto on a GPU) keep less: its RMSNorm (``fused_rms_norm``) keeps the norm's input
    in the dtype and 1/rms in fp32, where HF's keeps the fp32 input and the normalised input (the same count in the
    dtype, 4h less in fp32 per norm); its SwiGLU (``fused_swiglu``) keeps gate and up but not act(gate). For the
    1B shape: 32,768 B less (75,912 B)."""
    outputs = 1 if attention_out_shared else 2
    mlp = (3 if fused_swiglu else 4) * shape.active_ffn
    width = 4 * shape.hidden + shape.attn_width + outputs * shape.out_width + 2 * shape.kv_width + mlp
    fp32_inputs = 0 if fused_rms_norm else 8 * shape.hidden
    return dtype_bytes * width + fp32_inputs + 4 * shape.num_heads + 8


def outside_layers_bytes_per_token(shape: ModelShape, dtype_bytes: int = 2, fused_rms_norm: bool = False) -> int:
    """Bytes per (rank-local) token kept from the forward to the backward outside the decoder layers (counted in
    tests/test_memory.py): the final RMSNorm's fp32 input (4h), 1/rms (4) and normalised input (h in the dtype),
    RoPE's cos and sin (2 x head_dim in the dtype), the input ids (8), and the LM-head loss's (d) hidden rows (h in
    the dtype; chunked saves the rows, fused the gradient it made in forward) with their row index (8), every token
    taken as trained. The final norm's output is not kept: the loss copies the rows it trains on. Liger's RMSNorm
    (``fused_rms_norm``) keeps the norm's input in the dtype instead of the fp32 one and the normalised input."""
    fp32_input = 0 if fused_rms_norm else 4 * shape.hidden
    return fp32_input + 4 + dtype_bytes * (2 * shape.hidden + 2 * shape.head_dim) + 8 + 8


def analytic_memory_bytes(shape: ModelShape, pack_len: int, sp: int, ckpt_layers: int, world_size: int,
                          job: JobSettings) -> int:
    """Modelled peak memory of one rank: the larger of forward/backward (model states + kept activations + one
    recomputed layer + loss chunk) and the optimizer step (model states in ``step()``, no activations).

    A checkpointed layer keeps only its bf16 input (2h bytes per token); in backward one checkpointed layer at a
    time is rebuilt in full. The LM-head loss holds one chunk of fp32 logits and their gradient (plus a bf16 copy),
    and when the tokens span several chunks it sums the LM-head weight gradient in an fp32 vocab x hidden buffer.
    """
    tokens = -(-pack_len // sp)
    full = activation_bytes_per_token_layer(shape, attention_out_shared=job.attention_out_shared,
                                            fused_rms_norm=job.fused_rms_norm, fused_swiglu=job.fused_swiglu)
    kept = 2 * shape.hidden
    layers = shape.num_layers
    acts = tokens * ((layers - ckpt_layers) * full + ckpt_layers * kept)
    recompute = tokens * full if ckpt_layers > 0 else 0
    outside = tokens * outside_layers_bytes_per_token(shape, fused_rms_norm=job.fused_rms_norm)
    chunk = min(job.loss_chunk_tokens, tokens)
    loss = chunk * shape.vocab * (4 + 4 + 2) + (4 * shape.vocab * shape.hidden if tokens > chunk else 0)
    states = model_state_bytes(shape.num_params, world_size, job)
    in_step = model_state_bytes(shape.num_params, world_size, job, in_step=True)
    return int(max(states + acts + recompute + outside + loss, in_step))


def memory_preflight(groups: list[dict], shape: ModelShape, world_size: int, job: JobSettings,
                     device_bytes: int, headroom: float = 0.05) -> list[str]:
    """Warnings for the packing groups that the memory model predicts will not fit in ``device_bytes``: what the
    run can use of its GPU (the trainer passes the free memory once the process groups' NCCL communicators exist,
    plus what torch already holds: the CUDA context, the communicators' buffers and other processes are left out
    by measurement; ``headroom`` is for the allocator's fragmentation).

    The trainer runs this before it builds the engine (a 128K group that cannot fit should not cost the minutes
    of initialising a large model first); it is advice from analytic_memory_bytes, not a measurement."""
    warnings = []
    for g, group in enumerate(groups):
        pack_len, sp, ckpt = int(group["pack_len"]), int(group.get("sp", 1)), int(group.get("ckpt_layers") or 0)
        need = analytic_memory_bytes(shape, pack_len, sp, ckpt, world_size, job)
        if need > (1.0 - headroom) * device_bytes:
            warnings.append(
                f"group {g} ({pack_len} tokens, sp={sp}, {ckpt} checkpointed layers) is predicted to need "
                f"{need / 2**30:.1f} GiB of the {device_bytes / 2**30:.1f} GiB the GPU has for it: raise its "
                f"ckpt_layers (train.ckpt_layers) or sp, or let python -m hbp_train.profiler choose")
    return warnings
