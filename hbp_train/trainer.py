"""The training loop: ``train()`` builds everything and runs the plan's steps; ``train_step()`` runs one step.

A plan step has m micro-batches (packs) per replica, and m changes from step to step. DeepSpeed fixes
gradient_accumulation_steps at initialize, so we initialize it with 1 and drive the accumulation boundary
ourselves: ``engine.set_gradient_accumulation_boundary(k == m - 1)`` before micro-batch k, one ``engine.step()``
after the last one. With gradient_accumulation_steps=1, ``engine.backward`` does not divide the loss, and
DeepSpeed only averages gradients over its data-parallel ranks; ``loss.normalize_loss`` is told exactly that
(``num_micro_batches=1``, ``dp_world_size`` = the ranks DeepSpeed averages over), so every step's gradient is the
one the normalizer's formula defines, whatever m (tests/test_trainer_dist.py proves it against a reference).

Per step, in order: the group's activation-checkpointing depth, the SP degree (attention size switch), then per
micro-batch the SP split of the collated pack, forward, loss normalization (the SP loss reduction hooks in there),
backward; then the optimizer step and the metrics (one all-gather of a few floats per rank, which also carries the
stop and NaN flags every rank must agree on).
"""

from __future__ import annotations

import math
import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from hbp_train import checkpoint as ckpt
from hbp_train import heldout
from hbp_train.distributed import ulysses
from hbp_train.data import PackedData, StepBatch, to_device
from hbp_train.loss import chunked_token_losses, normalize_loss
from hbp_train.telemetry import MetricsLogger, all_gather_floats, peak_memory_gib, reset_peak_memory

ON_NAN = ("skip", "abort")
# DeepSpeed's ZeRO calls torch's deprecated all_gather_into_tensor; nothing a user can act on, so keep its
# FutureWarning out of every rank's training log.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                        category=FutureWarning)


@dataclass
class TrainConfig:
    """The optimization, the schedule and the run's bookkeeping."""

    out_dir: str = "runs/hbp"
    """Run directory: resolved config, metrics.jsonl, TensorBoard events, checkpoints/. Also Hydra's run dir."""
    max_steps: Optional[int] = None
    """Stop after this many optimizer steps in total; None = every step of the plan, data.epochs times."""
    lr: float = 2e-5
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """The cosine decay ends at lr * min_lr_ratio."""
    warmup_steps: int = 10
    """Linear warm-up steps (starting at lr / warmup_steps); 0 = none."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = no clipping)."""
    seed: int = 0
    """Seed of python/numpy/torch RNGs on every rank (the model's initial weights use model.seed)."""
    ckpt_layers: Optional[list] = None
    """Activation-checkpointed layers per packing group, overriding the plan's groups[g].ckpt_layers: one value
    per group, or a single value for all groups. None = the plan's value (0 where the plan has none)."""
    save_every: int = 0
    """Save a checkpoint every this many steps (0 = only at the end and on SIGTERM/SIGINT)."""
    save_final: bool = True
    """Save a checkpoint when the run ends."""
    keep_last: int = 2
    """Keep only the newest this many checkpoints (0 = keep all)."""
    resume: Optional[str] = None
    """Resume from a checkpoint: 'auto' (the newest in out_dir/checkpoints, if any) or a checkpoint path."""
    on_nan: str = "skip"
    """A NaN/inf loss on any rank: 'skip' (drop the step's gradients, no optimizer step, counted in metrics) or
    'abort' (save nothing, exit with an error)."""
    exit_after_steps: Optional[int] = None
    """Stop (with a checkpoint) after this many steps in this invocation, e.g. for time-limited job slots;
    resume later with train.resume=auto."""
    eval_every: int = 0
    """With data.eval_shards: log the held-out loss (loss/eval, ppl/eval) every this many steps and after the last
    step (0 = after the last step only)."""

    def __post_init__(self):
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"train.max_steps={self.max_steps}: must be >= 1 (or null for the whole plan)")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ValueError(f"train.lr={self.lr}: must be a positive number")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"train.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        if self.warmup_steps < 0:
            raise ValueError(f"train.warmup_steps={self.warmup_steps}: must be >= 0")
        if self.weight_decay < 0:
            raise ValueError(f"train.weight_decay={self.weight_decay}: must be >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"train.betas={list(self.betas)}: must be two numbers in [0, 1)")
        if self.eps <= 0:
            raise ValueError(f"train.eps={self.eps}: must be > 0")
        if self.grad_clip < 0:
            raise ValueError(f"train.grad_clip={self.grad_clip}: must be >= 0 (0 = off)")
        if self.ckpt_layers is not None and (not self.ckpt_layers or any(int(k) < 0 for k in self.ckpt_layers)):
            raise ValueError(f"train.ckpt_layers={list(self.ckpt_layers)}: one value >= 0 per group, or null")
        if self.save_every < 0 or self.keep_last < 0:
            raise ValueError("train.save_every and train.keep_last must be >= 0")
        if self.on_nan not in ON_NAN:
            raise ValueError(f"train.on_nan={self.on_nan!r}: must be one of {', '.join(ON_NAN)}")
        if self.exit_after_steps is not None and self.exit_after_steps < 1:
            raise ValueError(f"train.exit_after_steps={self.exit_after_steps}: must be >= 1 (or null)")
        if self.eval_every < 0:
            raise ValueError(f"train.eval_every={self.eval_every}: must be >= 0 (0 = after the last step only)")


@dataclass
class DeepSpeedConfig:
    """How DeepSpeed shards and places the model state (precision follows model.dtype)."""

    zero_stage: int = 2
    """ZeRO stage: 1 (shard optimizer state; gradients reduced once per step, which plans with unequal micro-batch
    counts per replica, strategy bytescale, need), 2 (also gradients, reduced every micro-batch) or 3 (also
    parameters)."""
    offload_optimizer: bool = False
    """Keep optimizer state on the CPU (ZeRO-Offload); the optimizer step runs there (torch AdamW)."""
    offload_param: bool = False
    """Keep parameters on the CPU between uses (ZeRO-3 only)."""
    overlap_comm: bool = True
    """Overlap gradient reduction with backward (GPU only; always off on the CPU)."""
    reduce_bucket_size: int = 200_000_000
    """Elements per gradient-reduction bucket."""
    extra: dict = field(default_factory=dict)
    """Raw DeepSpeed config entries merged last (advanced; e.g. {"zero_optimization": {"stage3_max_live_parameters": 1e9}})."""

    def __post_init__(self):
        if self.zero_stage not in (1, 2, 3):
            raise ValueError(f"deepspeed.zero_stage={self.zero_stage}: must be 1, 2 or 3")
        if self.offload_param and self.zero_stage != 3:
            raise ValueError("deepspeed.offload_param: needs deepspeed.zero_stage=3")
        if self.reduce_bucket_size < 1:
            raise ValueError(f"deepspeed.reduce_bucket_size={self.reduce_bucket_size}: must be >= 1")


def deepspeed_config(ds: DeepSpeedConfig, train: TrainConfig, total_steps: int, world_size: int,
                     bf16: bool) -> dict:
    """The DeepSpeed JSON config: one pack per micro-batch, gradient_accumulation_steps=1 (see module doc)."""
    on_gpu = torch.cuda.is_available()
    zero = {"stage": ds.zero_stage, "overlap_comm": bool(ds.overlap_comm and on_gpu), "contiguous_gradients": True,
            "reduce_bucket_size": ds.reduce_bucket_size}
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    if ds.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    if ds.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    warmup = max(1, train.warmup_steps)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "gradient_clipping": train.grad_clip,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "zero_optimization": zero,
        # torch AdamW: DeepSpeed's FusedAdam is a JIT build that fails on some images and takes ~90 s on a CPU.
        "optimizer": {"type": "AdamW", "params": {"lr": train.lr, "betas": list(train.betas), "eps": train.eps,
                                                  "weight_decay": train.weight_decay, "torch_adam": True}},
        # Linear warm-up from lr/warmup_steps, then cosine down to lr * min_lr_ratio (build() starts it at step 0).
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": max(total_steps, warmup + 1), "warmup_num_steps": warmup,
            "warmup_min_ratio": 1.0 / warmup if train.warmup_steps > 0 else 1.0, "warmup_type": "linear",
            "cos_min_ratio": train.min_lr_ratio}},
        # A NaN/inf gradient makes ZeRO skip the update and clear the gradients (on_nan=skip relies on it).
        "bf16": {"enabled": bf16, **({"check_grad_overflow": True} if bf16 else {})},
    }
    if ds.offload_optimizer:
        config["zero_force_ds_cpu_optimizer"] = False
    return _merge(config, ds.extra)


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


class PackedCausalLM(torch.nn.Module):
    """The HF model plus the chunked LM-head loss: forward(batch) -> per-token losses [T] (0 where no label).

    Wrapping both in one module lets DeepSpeed see one forward; under ZeRO-3 the LM-head weight, used here outside
    its own module's forward, is registered as an external parameter so it is gathered for the loss.
    """

    def __init__(self, model, chunk_size: int):
        super().__init__()
        self.model = model
        self.chunk_size = chunk_size

    def forward(self, input_ids, position_ids, shift_labels, cu_seqlens=None, max_seqlen=None):
        from hbp_train.model import forward_hidden

        kwargs = {}
        if cu_seqlens is not None:
            kwargs = {"cu_seq_lens_q": cu_seqlens, "cu_seq_lens_k": cu_seqlens, "max_length_q": max_seqlen,
                      "max_length_k": max_seqlen}
        hidden = forward_hidden(self.model, input_ids, position_ids, **kwargs)
        head = self.model.get_output_embeddings()
        return chunked_token_losses(hidden, head.weight, shift_labels, self.chunk_size,
                                    lm_head_bias=getattr(head, "bias", None))


@dataclass
class Run:
    """Everything train_step needs, built once by :func:`build`."""

    cfg: object
    engine: object
    model: object
    """The HF model (engine.module.model)."""
    data: PackedData
    pstate: object
    device: torch.device
    tokenizer: object
    total_steps: int
    grad_divisor: int
    """How many ranks DeepSpeed averages gradients over (its data-parallel world: all ranks, no mpu)."""
    pad_token_id: int = 0
    config_yaml: str = ""
    eval_data: Optional[PackedData] = None
    """The held-out packed shards (data.eval_shards), or None."""


def ckpt_layers_for(run: Run, step_batch: StepBatch) -> int:
    """Activation-checkpointed layers for this step's group: config override, else the plan, else 0."""
    override = run.cfg.train.ckpt_layers
    if override is not None:
        return int(override[0] if len(override) == 1 else override[step_batch.group])
    return int(step_batch.ckpt_layers or 0)


def forward_backward(run: Run, step_batch: StepBatch) -> dict:
    """Forward and backward of all this rank's micro-batches of one step; gradients end up reduced and ready for
    ``engine.step()``. Returns this rank's sums (token-loss sum, loss tokens, tokens, flops, nonfinite flag)."""
    from hbp_train.model import pack_flops, set_checkpointed_layers

    engine = run.engine
    set_checkpointed_layers(run.model, ckpt_layers_for(run, step_batch))
    sp = step_batch.sp
    sp_rank = run.pstate.sp_rank(sp)
    ulysses.set_active_sp(sp)  # SP: the attention dispatcher switches to the step's degree
    num_micro = len(step_batch.micro_batches)
    loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)
    tokens = flops = loss_tokens = 0.0
    for k, micro_batch in enumerate(step_batch.micro_batches):
        if micro_batch["num_samples"]:
            # Under SP each rank of the group does 1/sp of the pack's work (its token slice, its share of heads).
            tokens += micro_batch["input_ids"].shape[1] / sp
            flops += pack_flops(run.model.config, micro_batch["seq_lens"]) / sp
        # One boundary per step, at its last micro-batch: ZeRO accumulates gradients until then.
        engine.set_gradient_accumulation_boundary(k == num_micro - 1)
        batch = to_device(ulysses.split_for_sp(micro_batch, sp, sp_rank), run.device)  # SP: the collate split
        # SP: live CR — the attention dispatcher books this slice's real tokens as SP tokens or not.
        ulysses.begin_micro_batch(batch["num_local_tokens"] if micro_batch["num_samples"] else 0)
        loss_tokens += micro_batch["num_loss_tokens"] if sp == 1 else float((batch["shift_labels"] != -100).sum())
        loss_T = engine(batch["input_ids"], batch["position_ids"], batch["shift_labels"],
                        batch["cu_seqlens"] if sp == 1 else None, batch["max_seqlen"] if sp == 1 else None)
        loss = _normalized_loss(run, loss_T, batch, step_batch)
        engine.backward(loss)
        loss_sum += loss_T.detach().double().sum()  # stays on the device: no sync per micro-batch
    # A NaN/inf token loss anywhere makes the sum NaN/inf.
    return {"loss_sum": float(loss_sum), "loss_tokens": loss_tokens, "tokens": tokens,
            "flops": flops, "nonfinite": float(not bool(torch.isfinite(loss_sum)))}


def _normalized_loss(run: Run, loss_T, batch: dict, step_batch: StepBatch):
    """The micro-batch's scalar for backward.

    SP: each rank holds the token losses of its slice only. Its partial loss is scaled for the W/sp data-parallel
    replicas and summed over the SP group with a differentiable all-reduce, so every rank back-propagates its
    group's loss; DeepSpeed's average over all W ranks then gives the exact step gradient (docs/sequence_parallel.md).
    """
    return ulysses.reduce_sp_loss(normalize_loss(
        loss_T, batch["shift_labels"], batch["sample_ids"], run.cfg.loss.normalizer,
        # max(.., 1): a replica (or step) may hold only empty packs; its token sum is 0 anyway.
        global_loss_tokens=max(step_batch.global_loss_tokens, 1), rank_loss_tokens=max(step_batch.rank_loss_tokens, 1),
        global_num_samples=max(step_batch.global_num_samples, 1), rank_num_samples=step_batch.rank_num_samples,
        dp_world_size=run.grad_divisor // step_batch.sp,  # SP: W/sp replicas, see above
        num_micro_batches=1,  # gradient_accumulation_steps=1: no 1/m from DeepSpeed
        sample_loss_tokens_T=batch["sample_loss_tokens"],
    ))


STAT_COLUMNS = ["compute_time", "loss_sum", "loss_tokens", "tokens", "flops", "nonfinite", "stop", "peak_mem_gib",
                "booked_tokens", "sp_tokens"]  # SP: live CR (tokens booked by the attention dispatcher)


def train_step(run: Run, step_batch: StepBatch, stop_requested=lambda: False) -> tuple:
    """One optimizer step. Returns (gathered per-rank stats [W, len(STAT_COLUMNS)], skipped: bool, lr used).

    The stats all-gather happens before the optimizer step so that every rank decides the same about a NaN/inf
    loss (and about stopping: ``stop_requested()`` is read just before it) from the same numbers.
    """
    reset_peak_memory()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    local = forward_backward(run, step_batch)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    compute_time = time.perf_counter() - start
    values = [compute_time, local["loss_sum"], local["loss_tokens"], local["tokens"], local["flops"],
              local["nonfinite"], float(stop_requested()), peak_memory_gib(), *ulysses.stats().take_step_counts()]
    gathered = all_gather_floats(values, run.device)
    any_nonfinite = bool(gathered[:, STAT_COLUMNS.index("nonfinite")].max() > 0)
    if any_nonfinite and run.cfg.train.on_nan == "abort":
        raise FloatingPointError(
            f"step {step_batch.step}: the loss is NaN/inf (train.on_nan=abort); set train.on_nan=skip to skip such "
            "steps, or lower train.lr")
    lr = run.engine.get_lr()[0]  # the rate this step's update uses (the scheduler moves on inside step())
    # A NaN/inf loss gives NaN/inf gradients: ZeRO then skips the update and clears them (see deepspeed_config).
    run.engine.step()
    skipped = any_nonfinite or not run.engine.was_step_applied()
    return gathered, skipped, lr


def _check_attention_backend(model_cfg) -> None:
    """model.attention_backend must be usable on this machine (e.g. flash_varlen needs a GPU and bf16/fp16)."""
    from hbp_train.attention import select_backend

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    try:
        select_backend(model_cfg.attention_backend, device, model_cfg.torch_dtype())
    except ValueError as e:
        raise ValueError(f"model.attention_backend={model_cfg.attention_backend}: {e}") from None


def build_engine(cfg, model, total_steps: int, world_size: int):
    """The DeepSpeed engine that trains ``model`` (an HF causal LM from model.build_model) with the chunked loss.

    Needs cfg.model (precision), cfg.train (optimizer, schedule), cfg.deepspeed and cfg.loss (chunk size). Wraps
    the model in PackedCausalLM, registers the LM head as a ZeRO-3 external parameter, initializes DeepSpeed with
    ``deepspeed_config`` and starts the LR schedule at step 0. SP attention, if any, must already be installed.
    """
    import deepspeed

    bf16 = cfg.model.torch_dtype() == torch.bfloat16
    ds_config = deepspeed_config(cfg.deepspeed, cfg.train, total_steps, world_size, bf16)
    wrapper = PackedCausalLM(model, cfg.loss.chunk_size)
    if cfg.deepspeed.zero_stage == 3:
        head = model.get_output_embeddings()
        deepspeed.zero.register_external_parameter(wrapper, head.weight)
        if getattr(head, "bias", None) is not None:
            deepspeed.zero.register_external_parameter(wrapper, head.bias)
    engine, _, _, _ = deepspeed.initialize(
        model=wrapper, model_parameters=[p for p in wrapper.parameters() if p.requires_grad], config=ds_config)
    if engine.lr_scheduler is not None:
        # DeepSpeed's WarmupCosineLR starts at iteration -1 (lr 0), which would waste the first step: start at 0.
        # A resumed run overwrites this with the checkpoint's scheduler state.
        engine.lr_scheduler.step(0)
    return engine


def build(cfg, config_yaml: str = "") -> Run:
    """Open the data, build the parallel state, the model and the DeepSpeed engine."""
    from transformers import AutoTokenizer

    from hbp_train.model import build_model
    from hbp_train.distributed.groups import build_parallel_state

    from hbp_train.planning.baselines.bytescale import check_zero_stage

    world_size = dist.get_world_size() if dist.is_initialized() else 1
    data = PackedData(cfg.data.shards, cfg.data.check_counts, cfg.data.shuffle_epochs, cfg.train.seed)
    eval_data = PackedData(cfg.data.eval_shards, cfg.data.check_counts) if cfg.data.eval_shards else None
    for shards, packed in ((cfg.data.shards, data), (cfg.data.eval_shards, eval_data)):
        if packed is None:
            continue
        if packed.world_size != world_size:
            raise ValueError(f"{shards}/plan.json was planned for world size {packed.world_size}, but this run has "
                             f"{world_size} ranks: launch {packed.world_size} processes (NPROC={packed.world_size} "
                             f"./launch.sh train ...), or re-plan with data_tools.pack --world-size {world_size}")
        try:  # bytescale plans (unequal micro-batch counts per replica) need ZeRO-1
            check_zero_stage(packed.plan, cfg.deepspeed.zero_stage)
        except ValueError as e:
            raise ValueError(f"{shards}/plan.json: {e} (deepspeed.zero_stage=1)") from None
    if cfg.train.ckpt_layers is not None and len(cfg.train.ckpt_layers) not in (1, len(data.groups)):
        raise ValueError(f"train.ckpt_layers has {len(cfg.train.ckpt_layers)} values but the plan has "
                         f"{len(data.groups)} groups: give one per group or a single one")
    # SP: the groups of every degree either plan uses, built once, up front
    pstate = build_parallel_state(sorted(set(data.sp_degrees()) | set(eval_data.sp_degrees() if eval_data else [])))
    ulysses.set_active_sp(1)  # SP: a previous build in this process may have left another degree active
    total_steps = data.num_steps * cfg.data.epochs
    if cfg.train.max_steps is not None:
        total_steps = min(total_steps, cfg.train.max_steps)
    _check_attention_backend(cfg.model)  # a GPU-only backend on a CPU: fail before building the model
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer)
    pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    # Under ZeRO-3 the model is partitioned as it is built (no rank ever holds all of it, which a 70B model would not
    # fit); the config equals the one build_engine gives deepspeed.initialize.
    zero3_config = None
    if cfg.deepspeed.zero_stage == 3:
        zero3_config = deepspeed_config(cfg.deepspeed, cfg.train, total_steps, world_size,
                                        cfg.model.torch_dtype() == torch.bfloat16)
    model = build_model(cfg.model, vocab_size=len(tokenizer), zero3_config=zero3_config)
    if max(pstate.sp_degrees) > 1:  # SP: one Ulysses attention per degree; sp=1 keeps the plain packed attention
        ulysses.setup_sequence_parallel(model, pstate)
    else:
        ulysses.teardown_sequence_parallel()
    from hbp_train.model import decoder_layers

    num_layers = len(decoder_layers(model))
    wanted = cfg.train.ckpt_layers or [g.get("ckpt_layers") or 0 for g in data.groups]
    if any(int(k) > num_layers for k in wanted):
        source = "train.ckpt_layers" if cfg.train.ckpt_layers else f"{cfg.data.shards}/plan.json groups[].ckpt_layers"
        raise ValueError(f"{source}={list(wanted)}: the model has only {num_layers} decoder layers")
    _warn_if_groups_may_not_fit(cfg, data, model, world_size, wanted)
    engine = build_engine(cfg, model, total_steps, world_size)
    return Run(cfg=cfg, engine=engine, model=model, data=data, pstate=pstate, device=engine.device,
               tokenizer=tokenizer, total_steps=total_steps, grad_divisor=engine.dp_world_size,
               pad_token_id=pad_token_id, config_yaml=config_yaml, eval_data=eval_data)


def _warn_if_groups_may_not_fit(cfg, data: PackedData, model, world_size: int, ckpt_layers: list) -> None:
    """On a GPU: a one-line warning per packing group the profiler's memory model says will not fit (before the
    engine allocates anything). Advice only; models whose config is not Llama-like are not checked."""
    if not torch.cuda.is_available():
        return
    from hbp_train.perf.cost_model import parse_model_shape
    from hbp_train.profiler.search import JobSettings, memory_preflight

    try:
        shape = parse_model_shape(model.config.to_dict())
    except (ValueError, TypeError):
        return
    job = JobSettings(cfg.deepspeed.zero_stage, cfg.deepspeed.offload_optimizer, cfg.loss.chunk_size)
    groups = [{**g, "ckpt_layers": int(ckpt_layers[0] if len(ckpt_layers) == 1 else ckpt_layers[i])}
              for i, g in enumerate(data.groups)]
    if (dist.get_rank() if dist.is_initialized() else 0) != 0:
        return
    device_bytes = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
    for message in memory_preflight(groups, shape, world_size, job, device_bytes):
        print(f"[train] warning: {message}", flush=True)


def train(cfg, config_yaml: str = "") -> dict:
    """Run (or resume) the whole training; returns a summary (steps run, last loss, how it ended)."""
    ckpt_root = os.path.join(cfg.train.out_dir, "checkpoints")
    try:  # before building anything: a wrong path, or a checkpoint of another world size or plan, is one line
        resume = ckpt.find_resume(cfg.train.resume, ckpt_root)
        if resume is not None:
            ckpt.check_resumable(*resume, dist.get_world_size() if dist.is_initialized() else 1, cfg.data.shards)
    except ValueError as e:
        raise ValueError(f"train.resume={cfg.train.resume}: {e}") from None
    ckpt.check_fresh_root(ckpt_root, resume)
    run = build(cfg, config_yaml)
    rank = dist.get_rank() if dist.is_initialized() else 0
    start_step, num_skipped, sp_totals = 0, 0, None
    if resume is not None:
        resumed = ckpt.load(run.engine, *resume)
        start_step = resumed.next_step
        num_skipped = int(resumed.counters.get("num_skipped", 0))
        sp_totals = resumed.counters.get("sp_token_totals")
    ulysses.stats().start_run(sp_totals)  # live CR counts the whole run, across resumes
    metrics = MetricsLogger(cfg.logging, cfg.train.out_dir, rank, run.total_steps, start_step)
    if resume is not None and resumed.total_steps not in (None, run.total_steps):
        # The cosine schedule is laid out over the run's length: a changed length bends it from here on.
        metrics.message(f"[train] warning: this run has {run.total_steps} steps but the checkpoint was saved by a run "
                        f"of {resumed.total_steps} (data.epochs / train.max_steps changed): the LR schedule changes")
    if resume is not None:
        metrics.message(f"[train] resumed from {os.path.join(*resume)} at step {start_step}")
    elif cfg.train.resume == "auto":
        metrics.message(f"[train] train.resume=auto: no checkpoint in {ckpt_root}, starting fresh")
    stop = ckpt.StopSignal().install()
    history = []
    step = start_step
    ended = "finished"
    saved_at = None

    def save(next_step):
        nonlocal saved_at
        if saved_at == next_step:
            return
        counters = {"num_skipped": num_skipped, "sp_token_totals": ulysses.stats().totals()}
        ckpt.save(run.engine, ckpt_root, next_step, run.config_yaml, run.model, run.tokenizer, cfg.train.keep_last,
                  run.total_steps, counters, cfg.data.shards)
        saved_at = next_step
        metrics.message(f"[train] checkpoint saved: {os.path.join(ckpt_root, ckpt.tag_for(next_step))}")

    try:
        while step < run.total_steps:
            t0 = time.perf_counter()
            # Below ZeRO-2 ranks meet only at the step's end: a replica with fewer packs runs only those.
            step_batch = run.data.step_batch(step, rank, run.pad_token_id, equal_counts=cfg.deepspeed.zero_stage >= 2)
            data_time = time.perf_counter() - t0
            gathered, skipped, lr = train_step(run, step_batch, lambda: stop.requested)
            num_skipped += int(skipped)
            step_time = time.perf_counter() - t0
            m = metrics.step_metrics(
                step=step, total_steps=run.total_steps, gathered=gathered, columns=STAT_COLUMNS,
                lr=lr, grad_norm=None if skipped else _grad_norm(run.engine),
                step_time=step_time, data_time=data_time, group=step_batch.group, sp=step_batch.sp,
                num_micro_batches=len(step_batch.micro_batches), plan_metrics=step_batch.plan_metrics,
                skipped=skipped, num_skipped=num_skipped, pack_len=int(run.data.groups[step_batch.group]["pack_len"]),
                num_packs=step_batch.dp_size * len(step_batch.micro_batches))
            m.update(ulysses.stats().step_metrics(  # SP: live CR and per-rank compute times
                *(gathered[:, STAT_COLUMNS.index(c)].tolist() for c in ("compute_time", "booked_tokens", "sp_tokens"))))
            if run.eval_data is not None and _eval_due(step, run.total_steps, cfg.train.eval_every):
                m.update(heldout.evaluate(run, run.eval_data))  # every rank: it is collective
            metrics.log(m)
            if skipped:
                metrics.message(f"[train] step {step}: NaN/inf loss or gradient, step skipped (train.on_nan=skip)")
            history.append(m["loss/train"])
            step += 1
            if bool(gathered[:, STAT_COLUMNS.index("stop")].max() > 0):
                ended = f"stopped by {stop.received or 'a signal on another rank'}"
                break
            if cfg.train.exit_after_steps is not None and step - start_step >= cfg.train.exit_after_steps:
                ended = f"stopped after train.exit_after_steps={cfg.train.exit_after_steps}"
                break
            if cfg.train.save_every and step % cfg.train.save_every == 0 and step < run.total_steps:
                save(step)
        if ended != "finished" or cfg.train.save_final:
            save(step)
        if ended != "finished":
            metrics.message(f"[train] {ended} at step {step}/{run.total_steps}; resume with train.resume=auto")
    finally:
        stop.uninstall()
        metrics.close()
    return {"start_step": start_step, "end_step": step, "losses": history, "ended": ended,
            "skipped": num_skipped, "run": run}


def _eval_due(step: int, total_steps: int, eval_every: int) -> bool:
    """Held-out loss after this step: every eval_every steps, and after the run's last step."""
    return step + 1 == total_steps or (eval_every > 0 and (step + 1) % eval_every == 0)


def _grad_norm(engine) -> Optional[float]:
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    return float(norm.item() if isinstance(norm, torch.Tensor) else norm)
