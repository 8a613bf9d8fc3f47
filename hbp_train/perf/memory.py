"""Analytic memory model of one training rank: ZeRO model states, kept activations, a layer's backward, the loss.

Used by the profiler's dry run and its lever search (``hbp_train.profiler``), the "how long can I go?" ladder
(``hbp_train.profiler.max_context``), by the GPU backend to turn the measured model's states into the training
job's, and by the trainer's preflight (``memory_preflight``: one warning per packing group predicted not to fit,
before the engine allocates anything). It is an estimate to plan with, not a measurement; docs/profiler.md states
the model and bench/bench_memory_levers.py measures it against the real model on the CPU.

The peak of a step is the largest of four moments (``memory_breakdown``): the end of the forward while the LM-head
loss runs (every kept activation plus the loss's chunk), the backward of the first plain layer (all activations
still kept, plus that layer's backward buffers), the backward of the first checkpointed layer (the checkpointed
layers' inputs, one layer rebuilt, its backward buffers), and the optimizer step (model states only). The memory
levers of a packing group change these terms: checkpointed layers, the tiled MLP (a layer keeps no MLP
intermediate; its backward recomputes one tile at a time), activation offload (checkpointed layers' inputs in host
memory) and the tiled LM-head loss (always on in training; ``JobSettings.loss_chunk_tokens``).

Pure Python: the trainer imports it without the profiler.
"""

from __future__ import annotations

from dataclasses import dataclass

from hbp_train.perf.shape import ModelShape

# The attention backends whose kernel returns its output laid out per token (hbp_train/model/attention.py's varlen
# kernels): JobSettings.attention_out_shared and attention_fp32_dq.
VARLEN_BACKENDS = ("fa3", "fa4", "flash_varlen", "torch_varlen")
# Activation offload (DeepSpeed 0.19.8's CheckpointHiddenStatesOffload as hbp_train/model/levers.py runs it): the
# newest checkpointed layer's input stays on the device (keep_last_count=1) and one more waits there while its copy to
# the host runs on the side stream (max_fwd_stash_count=2): at most 2 inputs on the device at the end of the forward
# (1 when copied inline: JobSettings.offload_side_stream). In backward each input comes back for its own layer's
# recompute alone and is freed after that layer's backward: while a layer's backward runs, its own input lives in its
# rebuilt activations (its norm keeps it, or an fp32 copy of it) and the other of the 2 beside it: first the one left
# waiting, then the block of the input freed before, which the side stream (where restores allocate) reuses only once
# the compute stream is past it.
OFFLOAD_INPUTS_ON_DEVICE = 2
# ZeRO-3's parameter prefetch bucket (DeepSpeed's stage3_prefetch_bucket_size default, elements): gathered ahead of
# the module that runs.
ZERO3_PREFETCH_ELEMENTS = 50_000_000


@dataclass
class JobSettings:
    """What the memory model takes from the training job's config (it must match the job being planned for)."""

    zero_stage: int = 2
    """deepspeed.zero_stage: which model states are sharded over the world size."""
    offload_optimizer: bool = False
    """deepspeed.offload_optimizer: optimizer states live on the CPU (not counted on the GPU)."""
    loss_chunk_tokens: int = 4096
    """loss.chunk_size: tokens per chunk of the chunked LM-head loss (the tiled loss); as many as a rank's tokens =
    one chunk, the whole pack's logits at once (no tiling)."""
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
    """Liger's SwiGLU: the gated MLP keeps gate and up, not also act(gate) (one ffn-wide activation less), and its
    backward writes the gradients of gate and up over them (one ffn-wide buffer in backward, not two)."""
    offload_param: bool = False
    """deepspeed.offload_param (ZeRO-3): each rank's bf16 parameter partition lives on the CPU; the GPU holds only the
    parameters gathered for the module that runs (``zero3_working_bytes``)."""
    attention_fp32_dq: bool = True
    """The attention kernel's backward sums the query gradient in an fp32 buffer of the query's width (FlashAttention
    2/3's dq_accum, behind the varlen kernels): 4 B x heads x head_dim per token while a layer's attention runs
    backward. False for the CPU's SDPA (sdpa_block)."""
    grad_bucket_bytes: int = 0
    """DeepSpeed's gradient reduction buckets on the GPU (deepspeed.reduce_bucket_size elements in bf16, two of them
    with overlap_comm at stage 1/2, one at stage 3), held from the first backward on; 0 = not counted."""
    offload_side_stream: bool = True
    """Activation offload copies on a side stream, as on a GPU: one input more waits on the device while its copy
    runs (``OFFLOAD_INPUTS_ON_DEVICE``); False: copied inline (bench/bench_memory_levers.py's CPU engine), only the
    newest input stays."""

    @classmethod
    def of_run(cls, cfg, max_micro_batches=None, fused_kernels=()) -> "JobSettings":
        """The settings of a composed run config (its ``deepspeed`` and ``loss`` sections) for a plan whose steps
        have at most ``max_micro_batches`` per replica (None = unknown). ``fused_kernels``: the decoder kernels the
        built model runs (its ``_hbp_fused_kernels``: "rms_norm", "rope", "swiglu"); none known counts HF's modules,
        which keep more (an estimate on the safe side)."""
        backend = getattr(getattr(cfg, "model", None), "attention_backend", "auto")
        varlen = backend in ("auto", *VARLEN_BACKENDS)
        ds = cfg.deepspeed
        return cls(zero_stage=ds.zero_stage, offload_optimizer=ds.offload_optimizer,
                   grad_bucket_bytes=grad_bucket_bytes(getattr(ds, "reduce_bucket_size", 0), ds.zero_stage,
                                                       getattr(ds, "overlap_comm", False)),
                   loss_chunk_tokens=cfg.loss.chunk_size,
                   grad_accum_fp32=cfg.deepspeed.grad_accum_fp32(max_micro_batches),
                   attention_out_shared=varlen, attention_fp32_dq=varlen,
                   fused_rms_norm="rms_norm" in fused_kernels, fused_swiglu="swiglu" in fused_kernels,
                   offload_param=bool(getattr(ds, "offload_param", False)))

    def describe(self) -> str:
        """The ZeRO stage and what it offloads, for tables: "ZeRO-3 + optimizer & parameter offload"."""
        parts = [name for name, on in (("optimizer", self.offload_optimizer), ("parameter", self.offload_param)) if on]
        return f"ZeRO-{self.zero_stage}" + (f" + {' & '.join(parts)} offload" if parts else "")


def grad_bucket_bytes(reduce_bucket_size: int, zero_stage: int, overlap_comm: bool) -> int:
    """Bytes of DeepSpeed 0.19's gradient reduction buckets on a GPU: ``reduce_bucket_size`` bf16 elements, doubled
    with overlap_comm at stage 1/2 (stage_1_and_2.py's ipg buffers), one at stage 3."""
    return 2 * int(reduce_bucket_size) * (2 if overlap_comm and zero_stage < 3 else 1)


def model_state_bytes(params: int, world_size: int, job: JobSettings, in_step: bool = False) -> int:
    """Per-GPU bytes of model states in bf16 mixed precision under ZeRO over ``world_size`` ranks, as DeepSpeed
    0.19 allocates them (measured on the CPU in tests/test_memory.py).

    Through forward and backward: bf16 params 2 B (sharded at stage 3; on the CPU with parameter offload);
    gradients 2 B in bf16 or 4 B with fp32 accumulation (sharded at stage >= 2; at stage 1 DeepSpeed keeps them
    whole); fp32 master weights and Adam m and v 12 B (sharded at stage >= 1). ``in_step`` (inside ``step()``, the
    activations gone): the optimizer needs this rank's gradient partition in fp32 (4 B). With fp32 accumulation at
    stage 1/2 that is the accumulated gradient itself; with bf16 accumulation step() converts the bf16 partition to
    a new fp32 one and frees the bf16 gradients; stage 3 copies its gradient partition (kept) into a new fp32 one
    either way. Optimizer offload keeps the optimizer state and the gradient partitions on the CPU: the GPU keeps
    only the reduction buckets (``JobSettings.grad_bucket_bytes``, counted at every stage). The parameters ZeRO-3
    gathers for the module that runs are ``zero3_working_bytes``."""
    w, stage = world_size, job.zero_stage
    shard = {k: (w if stage >= k else 1) for k in (1, 2, 3)}
    weights = 0 if (job.offload_param and stage == 3) else 2 * params / shard[3]
    grads = (4 if job.grad_accum_fp32 else 2) * params / shard[2]
    if job.offload_optimizer:
        return int(weights + job.grad_bucket_bytes)
    weights += job.grad_bucket_bytes
    optimizer = 12 * params / shard[1]
    if not in_step:
        return int(weights + grads + optimizer)
    if stage == 3:
        fp32_grads = grads + 4 * params / shard[1]
    else:
        fp32_grads = grads if job.grad_accum_fp32 else 4 * params / shard[1]
    return int(weights + optimizer + fp32_grads)


def zero3_working_bytes(shape: ModelShape, job: JobSettings, loss: bool = False) -> int:
    """Bytes of parameters ZeRO-3 holds gathered while a module runs (0 at stage 1/2, where every rank holds them
    all in ``model_state_bytes``): in bf16, the largest matrix of a decoder layer (each linear layer is gathered as
    it runs) plus DeepSpeed's prefetch bucket (``ZERO3_PREFETCH_ELEMENTS``); during the LM-head loss (``loss``) the
    whole vocab x hidden head and its bf16 gradient before the reduce-scatter. Read from DeepSpeed 0.19's defaults
    (stage3_prefetch_bucket_size), not measured here."""
    if job.zero_stage != 3:
        return 0
    h = shape.hidden
    widest = max(shape.attn_width, shape.out_width, shape.active_ffn if not shape.num_experts else shape.moe_ffn,
                 shape.ffn if not shape.num_experts or shape.dense_layers else 0)
    layers = 2 * (h * widest + ZERO3_PREFETCH_ELEMENTS)
    return max(layers, 2 * 2 * shape.vocab * h) if loss else layers


def activation_bytes_per_token_layer(shape: ModelShape, dtype_bytes: int = 2, attention_out_shared: bool = True,
                                     fused_rms_norm: bool = False, fused_swiglu: bool = False) -> int:
    """Bytes one non-checkpointed decoder layer keeps per (rank-local) token for backward, as autograd saves them
    (counted with saved-tensor hooks in tests/test_memory.py, exactly, for each term): in the activation dtype
    (``dtype_bytes``, bf16 = 2) each RMSNorm's normalised input and its output (2 x 2h), q (heads*head_dim), k and
    v (2 x kv width), the attention output (heads*v_head_dim; a second copy of it as the o_proj input unless the
    kernel's output is that input, ``attention_out_shared``: the varlen kernels), and the gated MLP's gate, up,
    act(gate) and product (``mlp_bytes_per_token``); in fp32, whatever the dtype, each RMSNorm's fp32 input (2 x 4h:
    HF norms compute in fp32), the attention's log-sum-exp (4 per head) and each norm's 1/rms (2 x 4). Ulysses moves
    heads, not tokens, so per rank it is the same count at any SP degree. Model states count every expert
    (``num_params``). For the Llama-3.2-1B shape in bf16: 108,680 B (106.1 KiB) with a varlen kernel, 112,776 B with
    flex/sdpa_block.

    Liger's kernels (model.kernels=auto on a GPU) keep less: its RMSNorm (``fused_rms_norm``) keeps the norm's input
    in the dtype and 1/rms in fp32, where HF's keeps the fp32 input and the normalised input (the same count in the
    dtype, 4h less in fp32 per norm); its SwiGLU (``fused_swiglu``) keeps gate and up but not act(gate). For the
    1B shape: 32,768 B less (75,912 B)."""
    outputs = 1 if attention_out_shared else 2
    width = 4 * shape.hidden + shape.attn_width + outputs * shape.out_width + 2 * shape.kv_width
    fp32_inputs = 0 if fused_rms_norm else 8 * shape.hidden
    return (dtype_bytes * width + mlp_bytes_per_token(shape, dtype_bytes, fused_swiglu) + fp32_inputs
            + 4 * shape.num_heads + 8)


def mlp_bytes_per_token(shape: ModelShape, dtype_bytes: int = 2, fused_swiglu: bool = False) -> int:
    """What a layer's gated MLP keeps per token for backward beyond its input (which the norm before it counts):
    gate, up, act(gate) and their product (4 x the width a token goes through: ffn, or an MoE layer's top-k experts
    plus shared experts, ``active_ffn``), 3 with Liger's SwiGLU. The tiled MLP keeps none of it."""
    return dtype_bytes * (3 if fused_swiglu else 4) * shape.active_ffn


def outside_layers_bytes_per_token(shape: ModelShape, dtype_bytes: int = 2, fused_rms_norm: bool = False) -> int:
    """Bytes per (rank-local) token kept from the forward to the backward outside the decoder layers (counted in
    tests/test_memory.py): the final RMSNorm's fp32 input (4h), 1/rms (4) and normalised input (h in the dtype),
    RoPE's cos and sin (2 x head_dim in the dtype), the input ids (8), and the LM-head loss's (d) hidden rows (h in
    the dtype; chunked saves the rows, fused the gradient it made in forward) with their row index (8), every token
    taken as trained. The final norm's output is not kept: the loss copies the rows it trains on. Liger's RMSNorm
    (``fused_rms_norm``) keeps the norm's input in the dtype instead of the fp32 one and the normalised input."""
    fp32_input = 0 if fused_rms_norm else 4 * shape.hidden
    return fp32_input + 4 + dtype_bytes * (2 * shape.hidden + 2 * shape.head_dim) + 8 + 8


def layer_backward_bytes(shape: ModelShape, tokens: int, job: JobSettings, tiled_mlp: bool,
                         dtype_bytes: int = 2) -> int:
    """Bytes a decoder layer's backward allocates beyond the activations it kept, at its worst moment, for a rank's
    ``tokens``: the gradient arriving from the layer above and the one it sums for its input (2 x h per token)
    plus the largest of its phases (each counted as the eager modules and the kernels allocate them, and measured
    with the torch profiler on the CPU in bench/bench_memory_levers.py):

    * the MLP, first: an untiled MLP's product gradient and the two gradients of act(gate) and up it gives (the
      product itself freed by then: 2 x ffn per token over what it kept; Liger's SwiGLU writes them over gate and
      up: 1); a tiled MLP's input gradient (h per token, made whole) plus one tile's recomputed intermediates and
      their gradients (``mlp_tiles``: about hidden tokens a tile) and, with several tiles, the MLP weights'
      gradients of the tiles done so far (model/levers.py runs each tile as a checkpoint, so autograd sums a
      weight's gradient over the tiles before it reaches the parameter's: one bf16 copy of the layer's MLP
      weights);
    * then, the MLP's activations freed, each RMSNorm's backward (HF's computes in fp32: four fp32 buffers of the
      hidden width, 16h per token; Liger's only its input gradient) and the attention's: the output gradient, dq,
      dk, dv, and with a varlen kernel FlashAttention's fp32 dq accumulator (``JobSettings.attention_fp32_dq``)."""
    b, h, ffn = dtype_bytes, shape.hidden, shape.active_ffn
    grads = 1 if job.fused_swiglu else 2
    residual = 2 * b * h * tokens
    attention = tokens * (b * (shape.out_width + shape.attn_width + 2 * shape.kv_width)
                          + (4 * shape.attn_width if job.attention_fp32_dq else 0))
    norm = tokens * (b * h if job.fused_rms_norm else 16 * h)
    if tiled_mlp:
        tile = min(tokens, _tile_tokens(shape, tokens))
        weight_grads = b * shape.mlp_params(bool(shape.num_experts), active=False) if tile < tokens else 0
        mlp = (b * h * tokens + tile * (mlp_bytes_per_token(shape, b, job.fused_swiglu) + grads * b * ffn)
               + weight_grads)
        return residual + max(mlp, attention, norm)
    mlp_kept = mlp_bytes_per_token(shape, b, job.fused_swiglu) * tokens
    return residual + max(grads * b * ffn * tokens, max(attention, norm) - mlp_kept)


def _tile_tokens(shape: ModelShape, tokens: int) -> int:
    """Tokens of one tiled-MLP tile for a rank's ``tokens``: tiles of about hidden tokens each (DeepSpeed's ALST
    rule, the tile count perf.shape.mlp_tiles gives a packing group)."""
    tiles = max(1, -(-tokens // shape.hidden))
    return -(-tokens // tiles)


@dataclass(frozen=True)
class MemoryBreakdown:
    """One rank's modelled memory in bytes at each moment that can set the step's peak (``memory_breakdown``)."""

    states: int
    """Model states through forward and backward (``model_state_bytes``)."""
    step: int
    """Model states inside the optimizer step (no activations)."""
    loss: int
    """Activations at the end of the forward, while the LM-head loss runs (plus its chunk), and ZeRO-3's gathered
    LM head."""
    backward_plain: int
    """Activations at the backward of the first plain (not checkpointed) layer: every kept activation plus its
    backward buffers; 0 when every layer is checkpointed."""
    backward_ckpt: int
    """Activations at the backward of the first checkpointed layer to run backward: the checkpointed layers'
    inputs, that layer rebuilt, its backward buffers; 0 without checkpointing."""
    host: int
    """Bytes the activation offload holds in host memory at the end of the forward (not on the GPU)."""
    terms: dict = None
    """Each moment's terms by name, in bytes (``{"loss": {"plain layers": ..., ...}, ...}``): what fills it."""

    @property
    def activations(self) -> int:
        """The largest of the three activation moments."""
        return max(self.loss, self.backward_plain, self.backward_ckpt)

    @property
    def peak(self) -> int:
        """The step's modelled peak: the larger of forward/backward (states + activations) and the optimizer step."""
        return max(self.states + self.activations, self.step)

    @property
    def moment(self) -> str:
        """Which moment sets the peak: "loss", "backward_plain", "backward_ckpt" or "step"."""
        if self.step >= self.states + self.activations:
            return "step"
        return max(("loss", "backward_plain", "backward_ckpt"), key=lambda k: getattr(self, k))


def memory_breakdown(shape: ModelShape, pack_len: int, sp: int, ckpt_layers: int, world_size: int,
                     job: JobSettings, tiled_mlp: bool = False, offload_activations: bool = False,
                     dtype_bytes: int = 2) -> MemoryBreakdown:
    """Modelled memory of one rank running a pack of ``pack_len`` tokens at SP degree ``sp`` (``T = pack_len/sp``
    tokens per rank) with its first ``ckpt_layers`` decoder layers checkpointed and the group's levers.

    * loss (end of forward): plain layers' activations (``activation_bytes_per_token_layer``, less the MLP's with the
      tiled MLP), each checkpointed layer's bf16 input (h per token; with activation offload only
      ``OFFLOAD_INPUTS_ON_DEVICE`` of them stay on the device), what a token keeps outside the layers, and the fused
      loss's working set: one chunk's fp32 logits, their log-sum-exp's fp32 temporary and the bf16 gradient
      (10 B x chunk x vocab), the LM-head weight gradient it sums (bf16, or fp32 when a rank's tokens span several
      chunks: 4 B x vocab x h) and, while it runs, the final norm's output and the rows it copies (2 x h per token);
    * backward of the first plain layer: every kept activation (the loss's gone) plus ``layer_backward_bytes``;
    * backward of the first checkpointed layer: the plain layers' activations are freed by then; the checkpointed
      layers' inputs (with offload, each restored for its own layer alone: those beside the rebuilt layer's own,
      which its norm keeps inside the rebuilt layer's activations, Liger's as it is, HF's as an fp32 copy), one layer
      rebuilt in full and its backward buffers.
    ZeRO-3 adds the parameters it gathers (``zero3_working_bytes``) to each moment. Outside the layers only RoPE's
    cos/sin and the ids (2 x head_dim + 8 B per token) live through the layers' backward."""
    b = dtype_bytes
    tokens = -(-pack_len // sp)
    layers, c = shape.num_layers, ckpt_layers
    plain = layers - c
    full = activation_bytes_per_token_layer(shape, b, job.attention_out_shared, job.fused_rms_norm, job.fused_swiglu)
    kept = full - (mlp_bytes_per_token(shape, b, job.fused_swiglu) if tiled_mlp else 0)
    ckpt_input = b * shape.hidden
    on_device = min(c, OFFLOAD_INPUTS_ON_DEVICE if job.offload_side_stream else 1) if offload_activations else c
    # in a checkpointed layer's backward: with offload the others on the device; without, the checkpoints keep all
    beside_rebuilt = on_device - 1 if offload_activations else c
    outside = outside_layers_bytes_per_token(shape, b, job.fused_rms_norm)
    through_backward = b * 2 * shape.head_dim + 8
    chunk = min(job.loss_chunk_tokens, tokens)
    head_grad = (4 if tokens > chunk else b) * shape.vocab * shape.hidden
    loss_chunk = chunk * shape.vocab * (4 + 4 + 2) + head_grad + 2 * b * shape.hidden * tokens
    work = zero3_working_bytes(shape, job)
    backward = layer_backward_bytes(shape, tokens, job, tiled_mlp, b)
    terms = {
        "loss": {"plain layers' activations": tokens * plain * kept,
                 "checkpointed layers' inputs": tokens * on_device * ckpt_input,
                 "outside the layers": tokens * outside, "LM-head loss working set": loss_chunk,
                 "ZeRO-3 gathered LM head": zero3_working_bytes(shape, job, loss=True)},
        "backward_plain": {"plain layers' activations": tokens * plain * kept,
                           "checkpointed layers' inputs": tokens * on_device * ckpt_input,
                           "RoPE tables and ids": tokens * through_backward, "a layer's backward buffers": backward,
                           "ZeRO-3 gathered parameters": work} if plain else {},
        "backward_ckpt": {"checkpointed layers' inputs": tokens * beside_rebuilt * ckpt_input,
                          "the rebuilt layer": tokens * kept, "RoPE tables and ids": tokens * through_backward,
                          "a layer's backward buffers": backward, "ZeRO-3 gathered parameters": work} if c else {},
    }
    states = model_state_bytes(shape.num_params, world_size, job)
    for moment in terms.values():
        if moment:
            moment["model states"] = states
    return MemoryBreakdown(
        states=states, step=model_state_bytes(shape.num_params, world_size, job, in_step=True),
        loss=int(sum(terms["loss"].values()) - states), backward_plain=int(sum(terms["backward_plain"].values())
                                                                           - (states if plain else 0)),
        backward_ckpt=int(sum(terms["backward_ckpt"].values()) - (states if c else 0)),
        host=int(tokens * (c - on_device) * ckpt_input) if offload_activations else 0,
        terms={k: {name: int(v) for name, v in moment.items()} for k, moment in terms.items()})


def analytic_memory_bytes(shape: ModelShape, pack_len: int, sp: int, ckpt_layers: int, world_size: int,
                          job: JobSettings, tiled_mlp: bool = False, offload_activations: bool = False) -> int:
    """Modelled peak memory of one rank (``memory_breakdown(...).peak``): the larger of forward/backward and the
    optimizer step."""
    return memory_breakdown(shape, pack_len, sp, ckpt_layers, world_size, job, tiled_mlp, offload_activations).peak


def memory_preflight(groups: list[dict], shape: ModelShape, world_size: int, job: JobSettings,
                     device_bytes: int, headroom: float = 0.05) -> list[str]:
    """Warnings for the packing groups that the memory model predicts will not fit in ``device_bytes``: what the
    run can use of its GPU (the trainer passes the free memory once the process groups' NCCL communicators exist,
    plus what torch already holds: the CUDA context, the communicators' buffers and other processes are left out
    by measurement; ``headroom`` is for the allocator's fragmentation). A group's levers (``tiled_mlp``,
    ``offload_activations``) are counted.

    The trainer runs this before it builds the engine (a 128K group that cannot fit should not cost the minutes
    of initialising a large model first); it is advice from analytic_memory_bytes, not a measurement."""
    warnings = []
    for g, group in enumerate(groups):
        pack_len, sp, ckpt = int(group["pack_len"]), int(group.get("sp", 1)), int(group.get("ckpt_layers") or 0)
        tiled, offload = bool(group.get("tiled_mlp")), bool(group.get("offload_activations"))
        need = analytic_memory_bytes(shape, pack_len, sp, ckpt, world_size, job, tiled, offload)
        if need > (1.0 - headroom) * device_bytes:
            levers = "".join(f", {name}" for name, on in (("tiled_mlp", tiled), ("offload", offload)) if on)
            warnings.append(
                f"group {g} ({pack_len} tokens, sp={sp}, {ckpt} checkpointed layers{levers}) is predicted to need "
                f"{need / 2**30:.1f} GiB of the {device_bytes / 2**30:.1f} GiB the GPU has for it: raise its "
                f"ckpt_layers (train.ckpt_layers) or sp, or let python -m hbp_train.profiler choose")
    return warnings
