"""The one build path: a training run's data, SP groups, model and DeepSpeed engine, from its config.

``build(cfg)`` is what the trainer runs: it opens the packed shards (and the held-out shards), checks them against
the run (world size, ZeRO stage), loads the tokenizer and hands the plan's packing groups to ``build_run``.
``build_run(cfg, groups, total_steps)`` is the part that needs no shards on disk (bench/trainer/bench_trainer.py calls it
with in-memory packs): the SP groups of every degree, the model (partitioned as it is built under ZeRO-3), the
run's ``SequenceParallel`` (Ulysses attention when a group uses sp > 1), the checkpointed-layer checks, the GPU
memory preflight, the groups' memory levers (model/levers.py), and the DeepSpeed engine around ``PackedCausalLM`` (model/packed_lm.py).
Every check of user input raises UserError before DeepSpeed allocates anything.

DeepSpeed is initialised with gradient_accumulation_steps=1 and one pack per micro-batch: the trainer drives the
accumulation boundary itself, because the number of micro-batches changes from step to step (trainer.py says why).
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Optional

import torch

from hbp_train.model import hf_model as modeling
from hbp_train.model.compat import check_model_support, check_positions
from hbp_train.batches.loader import PackedData
from hbp_train.distributed import groups as dist_groups
from hbp_train.model.ulysses import SequenceParallel, setup_sequence_parallel
from hbp_train.common.errors import UserError
from hbp_train.model.lora import zero3_external_parameters
from hbp_train.model.packed_lm import PackedCausalLM
from hbp_train.model.levers import MemoryLevers, setup_levers
from hbp_train.model.moe import RouterAux, records_router_logits, router_aux_of, router_loss_line
from hbp_train.batches.vocab import vocab_to_build

# DeepSpeed's ZeRO calls torch's deprecated all_gather_into_tensor; nothing a user can act on, so keep its
# FutureWarning out of every rank's training log.
warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
                        category=FutureWarning)


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
    grad_accum_dtype: str = "auto"
    """What bf16 gradients are summed in across a step's micro-batches: fp32, bf16, or auto (fp32 at ZeRO-2/3 when a
    step of the plan has several micro-batches per replica, else bf16). A bf16 sum rounds at every micro-batch, and
    hbp's steps of short packs have many; fp32 costs 2 more bytes per parameter / world size at ZeRO-2/3
    (DeepSpeed's data_types.grad_accum_dtype) and a zeroed fp32 partition filled every step. With one micro-batch
    per step there is no sum: both give the same update (DeepSpeed reduces in bf16 either way), so auto takes bf16.
    DeepSpeed fixes the dtype at initialize, so it is chosen per run from the plan, not per step. ZeRO-1 only
    sums in bf16: for fp32 DeepSpeed switches to its BF16_Optimizer, which keeps every gradient in fp32 on every
    GPU (4 bytes per parameter) and writes checkpoints its own zero_to_fp32 (our export) cannot read. fp32
    parameters (model.dtype=fp32) always sum in fp32."""
    extra: dict = field(default_factory=dict)
    """Raw DeepSpeed config entries merged last (advanced; e.g.
    {"zero_optimization": {"stage3_max_live_parameters": 1e9}})."""

    def __post_init__(self):
        if self.zero_stage not in (1, 2, 3):
            raise UserError(f"deepspeed.zero_stage={self.zero_stage}: must be 1, 2 or 3")
        if self.offload_param and self.zero_stage != 3:
            raise UserError("deepspeed.offload_param: needs deepspeed.zero_stage=3")
        if self.reduce_bucket_size < 1:
            raise UserError(f"deepspeed.reduce_bucket_size={self.reduce_bucket_size}: must be >= 1")
        if self.grad_accum_dtype not in ("auto", "fp32", "bf16"):
            raise UserError(f"deepspeed.grad_accum_dtype={self.grad_accum_dtype!r}: must be auto, fp32 or bf16")
        if self.grad_accum_dtype == "fp32" and self.zero_stage == 1:
            raise UserError("deepspeed.grad_accum_dtype=fp32 needs deepspeed.zero_stage 2 or 3: at ZeRO-1 DeepSpeed "
                            "would keep every gradient in fp32 on every GPU and write checkpoints our export "
                            "cannot read; use auto (bf16 at ZeRO-1)")

    def grad_accum_fp32(self, max_micro_batches: Optional[int] = None) -> bool:
        """Whether bf16 gradients are summed in fp32 across micro-batches (grad_accum_dtype resolved for a plan whose
        optimizer steps have at most ``max_micro_batches`` per replica; None = unknown, as if several)."""
        several = max_micro_batches is None or max_micro_batches > 1
        return self.grad_accum_dtype == "fp32" or (self.grad_accum_dtype == "auto" and self.zero_stage >= 2 and several)


def deepspeed_config(ds: DeepSpeedConfig, train, total_steps: int, world_size: int, bf16: bool,
                     max_micro_batches: Optional[int] = None, load_universal: bool = False) -> dict:
    """The DeepSpeed JSON config (``train``: a trainer.TrainConfig): one pack per micro-batch,
    gradient_accumulation_steps=1 (the trainer drives the accumulation boundary); ``max_micro_batches``: the most
    micro-batches a replica runs in one optimizer step (None = unknown; see grad_accum_dtype); ``load_universal``:
    the engine will load a universal checkpoint (a resume on another number of ranks, runtime/elastic.py).

    Nothing in it times or synchronises the step: DeepSpeed's throughput timer (on by default; it synchronises the
    device at every forward and step end) and its wall-clock breakdown are off, the trainer measures the step."""
    on_gpu = torch.cuda.is_available()
    zero = {"stage": ds.zero_stage, "overlap_comm": bool(ds.overlap_comm and on_gpu), "contiguous_gradients": True,
            "reduce_bucket_size": ds.reduce_bucket_size}
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    if ds.offload_param:
        zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    if ds.zero_stage == 3:
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    warmup_steps = train.warmup_for(total_steps)
    warmup = max(1, warmup_steps)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "train_batch_size": world_size,
        "gradient_clipping": train.grad_clip,
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
        "timers": {"throughput": {"enabled": False, "synchronized": False}},
        "zero_optimization": zero,
        # torch AdamW: DeepSpeed's FusedAdam is a JIT build that fails on some images and takes ~90 s on a CPU.
        # On a GPU torch's own fused kernel (one pass over the fp32 states instead of foreach's ~10); a CPU-offloaded
        # optimizer is DeepSpeed's CPU Adam and takes no such flag.
        "optimizer": {"type": "AdamW", "params": {"lr": train.lr, "betas": list(train.betas), "eps": train.eps,
                                                  "weight_decay": train.weight_decay, "torch_adam": True,
                                                  **({"fused": True} if on_gpu and not ds.offload_optimizer else {})}},
        # Linear warm-up from lr/warmup_steps, then cosine down to lr * min_lr_ratio. Made at iteration 0, not
        # DeepSpeed's default -1: at -1 its constructor reads the rate before the schedule starts, which logs
        # "Attempting to get learning rate from scheduler before it has started" on every rank; build_engine then
        # sets the rate of iteration 0.
        "scheduler": {"type": "WarmupCosineLR", "params": {
            "total_num_steps": max(total_steps, warmup + 1), "warmup_num_steps": warmup,
            "warmup_min_ratio": 1.0 / warmup if warmup_steps > 0 else 1.0, "warmup_type": "linear",
            "cos_min_ratio": train.min_lr_ratio, "last_batch_iteration": 0}},
        # on_nan=skip: a NaN/inf gradient makes ZeRO skip the update and clear the gradients. The check is a pass
        # over every gradient and a host sync per step; on_nan=abort instead stops on a NaN/inf loss or gradient
        # norm (trainer.train_step), so it goes without.
        "bf16": {"enabled": bf16, **({"check_grad_overflow": train.on_nan == "skip"} if bf16 else {})},
    }
    if bf16 and ds.grad_accum_fp32(max_micro_batches):  # micro-batch gradients summed in fp32 (see the field)
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    if ds.offload_optimizer:
        config["zero_force_ds_cpu_optimizer"] = False
    if load_universal:  # DeepSpeed reads the flag at load_checkpoint; it must be in the config it was made with
        config["checkpoint"] = {"load_universal": True}
    return _merge(config, ds.extra)


def _merge(base: dict, extra: dict) -> dict:
    out = dict(base)
    for key, value in extra.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


@dataclass
class Run:
    """Everything the training loop needs, built once by :func:`build` (or :func:`build_run`)."""

    cfg: object
    """The run config (config.HBPConfig; build_run reads its model, train, deepspeed and loss sections)."""
    engine: object
    """The DeepSpeed engine around PackedCausalLM."""
    model: object
    """The HF model (engine.module.model)."""
    sp: SequenceParallel
    """This rank's SP groups, the active SP degree, the Ulysses attention and the live CR counters."""
    total_steps: int
    """Optimizer steps of the whole run (every epoch, capped by train.max_steps)."""
    data: Optional[PackedData] = None
    """The packed training shards (None when built by build_run alone)."""
    eval_data: Optional[PackedData] = None
    """The held-out packed shards (data.eval_shards), or None."""
    tokenizer: object = None
    """Saved with every checkpoint, so that an export is a complete HF model directory."""
    pad_token_id: int = 0
    """The token id of empty (dummy) micro-batches."""
    config_yaml: str = ""
    """The resolved config, saved with every checkpoint."""
    router_aux: Optional[RouterAux] = None
    """The MoE router loss settings of the model's config (moe.py), or None."""
    levers: Optional[MemoryLevers] = None
    """The model's memory levers (model/levers.py), switched per packing group by the trainer."""

    @property
    def device(self) -> torch.device:
        return self.engine.device

    @property
    def grad_divisor(self) -> int:
        """How many ranks DeepSpeed averages gradients over (its data-parallel world: all ranks, no mpu)."""
        return self.engine.dp_world_size


def build(cfg, config_yaml: str = "", data: Optional[PackedData] = None, eval_data: Optional[PackedData] = None,
          load_universal: bool = False) -> Run:
    """The trainer's run: open the data (and held-out data), load the tokenizer, then :func:`build_run`.

    ``data`` / ``eval_data``: shards already opened instead of data.shards / data.eval_shards, and
    ``load_universal``: the engine will load a universal checkpoint (both for a resume on another number of ranks,
    runtime/elastic.py)."""
    from transformers import AutoTokenizer

    world_size = dist_groups.world_size()
    if data is None:
        data = _open_packed(cfg.data.shards, cfg, world_size, shuffle=True)
    else:
        _check_packed(data, data.path, cfg, world_size)
    if eval_data is None and cfg.data.eval_shards:
        eval_data = _open_packed(cfg.data.eval_shards, cfg, world_size, shuffle=False)
    total_steps = data.run_steps(cfg.data.epochs)
    if cfg.train.max_steps is not None:
        total_steps = min(total_steps, cfg.train.max_steps)
    modeling.check_tokenizer_dir(cfg.model.tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer)
    # Before any weight is read: the data's token ids are the model's (the tokenizer that made them, vocab.py).
    records = {"data.shards": data.plan.get("tokenizer")}
    if eval_data is not None:
        records["data.eval_shards"] = eval_data.plan.get("tokenizer")
    vocab_size, line = vocab_to_build(cfg.model, tokenizer, modeling.hf_config_for(cfg.model).vocab_size, records)
    if line and dist_groups.rank() == 0:
        print(line, flush=True)
    # SP: the groups of every degree either plan uses, built once, up front
    sp_degrees = set(data.sp_degrees()) | set(eval_data.sp_degrees() if eval_data else [])
    longest = [n for n in (_longest_sample(data.plan), eval_data and _longest_sample(eval_data.plan)) if n]
    run = build_run(cfg, data.groups, total_steps, sp_degrees=sorted(sp_degrees), vocab_size=vocab_size,
                    plan=f"{cfg.data.shards}/plan.json", longest_sample=max(longest) if longest else None,
                    max_micro_batches=data.max_micro_batches(), load_universal=load_universal)
    run.data, run.eval_data, run.tokenizer, run.config_yaml = data, eval_data, tokenizer, config_yaml
    run.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return run


def build_run(cfg, groups: list, total_steps: int, sp_degrees=None, vocab_size: Optional[int] = None,
              init_device=None, plan: str = "the plan", longest_sample: Optional[int] = None,
              max_micro_batches: Optional[int] = None, load_universal: bool = False) -> Run:
    """SP groups, model, SP attention and DeepSpeed engine for a plan's packing ``groups`` (dicts with pack_len,
    sp, ckpt_layers); no data. ``sp_degrees``: the SP groups to build (default: the groups' degrees);
    ``vocab_size``: grow the model's vocabulary to the tokenizer's; ``init_device``: build the weights directly on
    this device (default: the host; deepspeed.initialize moves them); ``plan``: where ``groups`` came from, for
    error messages; ``longest_sample``: the longest sample a pack may hold (default: the longest pack_len);
    ``max_micro_batches``: the most micro-batches a replica runs in one optimizer step (None = unknown; one lets
    bf16 gradients accumulate in bf16, see DeepSpeedConfig.grad_accum_dtype); ``load_universal``: see build."""
    world_size = dist_groups.world_size()
    ckpt_override = cfg.train.ckpt_layers
    if ckpt_override is not None and len(ckpt_override) not in (1, len(groups)):
        raise UserError(f"train.ckpt_layers has {len(ckpt_override)} values but the plan has {len(groups)} "
                        "groups: give one per group or a single one")
    _check_attention_backend(cfg.model)  # a GPU-only backend on a CPU: fail before building the model
    check_deepspeed_config(cfg, total_steps, world_size, max_micro_batches)
    warmup = cfg.train.warmup_for(total_steps)
    if warmup != cfg.train.warmup_steps and dist_groups.rank() == 0:
        print(f"[train] warning: train.warmup_steps={cfg.train.warmup_steps} is not shorter than the run's "
              f"{total_steps} optimizer steps: the warm-up is capped at {warmup} (a tenth of the run), so the learning "
              "rate reaches train.lr; set train.warmup_steps below the run's steps to choose", flush=True)
    if sp_degrees is None:
        sp_degrees = sorted({int(g.get("sp", 1)) for g in groups})
    # Before any weight is loaded: a feature the packed path cannot honour is refused in one line, and so are
    # samples longer than the model's positions (a data set's record of its samples; pack lengths do not count).
    hf_config = modeling.hf_config_for(cfg.model, vocab_size)
    calls = check_model_support(hf_config, longest_sample or max(int(g["pack_len"]) for g in groups), sp_degrees,
                                cfg.model.attention_backend)
    positions_line = check_positions(hf_config, longest_sample) if longest_sample else None
    if positions_line and dist_groups.rank() == 0:
        print(positions_line, flush=True)
    pstate = dist_groups.build_parallel_state(sp_degrees)
    # Under ZeRO-3 the model is partitioned as it is built (no rank ever holds all of it, which a 70B model would not
    # fit); the config equals the one build_engine gives deepspeed.initialize.
    zero3_config = None
    if cfg.deepspeed.zero_stage == 3:
        zero3_config = deepspeed_config(cfg.deepspeed, cfg.train, total_steps, world_size, _bf16(cfg),
                                        max_micro_batches)
    with torch.device(init_device) if init_device is not None else nullcontext():
        model = modeling.build_model(cfg.model, vocab_size=vocab_size, zero3_config=zero3_config)
    # SP: Ulysses attention when a degree > 1 is used, sized by the heads the layers hand their attention
    sp = setup_sequence_parallel(model, pstate, calls.heads)
    # an MoE model: the router loss it trains with, or that it trains with none and how to add one
    moe_line = router_loss_line(model.config, records_router_logits(model))
    if moe_line and dist_groups.rank() == 0:
        print(moe_line, flush=True)
    ckpt_layers = [ckpt_layers_for(ckpt_override, g, group.get("ckpt_layers")) for g, group in enumerate(groups)]
    num_layers = len(modeling.decoder_layers(model))
    if any(k > num_layers for k in ckpt_layers):
        source = (f"train.ckpt_layers={list(ckpt_override)}" if ckpt_override is not None
                  else f"{plan} groups[].ckpt_layers={[g.get('ckpt_layers') for g in groups]}")
        raise UserError(f"{source}: the model has only {num_layers} decoder layers")
    _warn_if_groups_may_not_fit(cfg, groups, model, world_size, ckpt_layers, max_micro_batches)
    levers = setup_levers(model, groups, ckpt_layers, cfg.model.kernels, plan)  # tiled MLP, offload (levers.py)
    engine = build_engine(cfg, model, total_steps, world_size, max_micro_batches, load_universal)
    return Run(cfg=cfg, engine=engine, model=model, sp=sp, total_steps=total_steps,
               router_aux=router_aux_of(model.config), levers=levers)


def build_engine(cfg, model, total_steps: int, world_size: int, max_micro_batches: Optional[int] = None,
                 load_universal: bool = False):
    """The DeepSpeed engine that trains ``model`` (an HF causal LM from model.build_model) with the chunked loss.

    Needs cfg.model (precision), cfg.train (optimizer, schedule), cfg.deepspeed and cfg.loss (chunk size). Wraps
    the model in PackedCausalLM, registers the LM head as a ZeRO-3 external parameter, initializes DeepSpeed with
    ``deepspeed_config`` and starts the LR schedule at step 0. SP attention, if any, must already be installed.
    The loss is the fused head + loss where cfg.loss resolves to it on this device (loss.LossConfig.impl).
    """
    import deepspeed

    ds_config = deepspeed_config(cfg.deepspeed, cfg.train, total_steps, world_size, _bf16(cfg), max_micro_batches,
                                 load_universal)
    router_aux = router_aux_of(model.config)
    wrapper = PackedCausalLM(model, cfg.loss.chunk_size, router_aux=router_aux is not None,
                             router_choices=router_aux is not None and router_aux.deepseek,
                             fused_loss=cfg.loss.fused_on(_device()))
    if cfg.deepspeed.zero_stage == 3:
        head = model.get_output_embeddings()
        deepspeed.zero.register_external_parameter(wrapper, head.weight)
        if getattr(head, "bias", None) is not None:
            deepspeed.zero.register_external_parameter(wrapper, head.bias)
    engine, _, _, _ = deepspeed.initialize(
        model=wrapper, model_parameters=[p for p in wrapper.parameters() if p.requires_grad], config=ds_config)
    if cfg.deepspeed.zero_stage == 3:  # after initialize: the adapters' weights are partitioned only now
        for module, param in zero3_external_parameters(model):
            deepspeed.zero.register_external_parameter(module, param)
    if engine.lr_scheduler is not None:
        # The schedule is made at iteration 0 without setting the rate (deepspeed_config): set iteration 0's rate,
        # which the first step uses. A resumed run overwrites this with the checkpoint's scheduler state.
        engine.lr_scheduler.step(0)
    return engine


def check_deepspeed_config(cfg, total_steps: int, world_size: int, max_micro_batches: Optional[int] = None) -> None:
    """DeepSpeed's own validation of the config we give it (pydantic), before any model is built: a bad value in
    deepspeed.extra becomes one UserError line naming the field instead of a traceback from initialize."""
    from deepspeed.runtime.config import DeepSpeedConfig as DSConfig
    from deepspeed.runtime.config import DeepSpeedConfigError
    from pydantic import ValidationError

    try:
        DSConfig(deepspeed_config(cfg.deepspeed, cfg.train, total_steps, world_size, _bf16(cfg), max_micro_batches))
    except (ValidationError, DeepSpeedConfigError) as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        field = "deepspeed.extra" if cfg.deepspeed.extra else "deepspeed"
        raise UserError(f"{field}: DeepSpeed rejects the config ({'; '.join(lines[:3])[:300]})") from None


def ckpt_layers_for(override: Optional[list], group: int, plan_value: Optional[int]) -> int:
    """Activation-checkpointed layers of packing group ``group``: train.ckpt_layers (one value per group, or a
    single one for all), else the plan's groups[g].ckpt_layers, else 0."""
    if override is not None:
        return int(override[0] if len(override) == 1 else override[group])
    return int(plan_value or 0)


def _longest_sample(plan: dict) -> Optional[int]:
    """The longest sample a plan packs: its samples' lengths (dropped ones excluded) or its max_len, if recorded."""
    dropped = {d.get("index") for d in plan.get("dropped") or []}
    lengths = [n for i, n in enumerate(plan.get("lengths") or []) if i not in dropped]
    if lengths:
        return int(max(lengths))
    return int(plan["max_len"]) if plan.get("max_len") else None


def step_ckpt_layers(cfg, group: int, plan_value: Optional[int], groups: Optional[list] = None) -> int:
    """Checkpointed layers of a step of packing group ``group`` (``ckpt_layers_for``), except under ZeRO-3 with the
    plan's ``groups`` known: there every step checkpoints the most layers any group does. ZeRO-3 prefetches
    parameters by the module order it traced; a checkpointed layer's recompute changes that order, so a step with
    another count invalidates the trace and prefetching stops for the rest of the run. A fixed count keeps one
    order, for the cost of recomputing layers the shorter groups would have kept (tests/test_model.py counts the
    invalidations)."""
    if cfg.deepspeed.zero_stage < 3 or not groups:
        return ckpt_layers_for(cfg.train.ckpt_layers, group, plan_value)
    return max(ckpt_layers_for(cfg.train.ckpt_layers, g, groups[g].get("ckpt_layers")) for g in range(len(groups)))


def _device() -> torch.device:
    """The device this rank trains on."""
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def _bf16(cfg) -> bool:
    return cfg.model.torch_dtype() == torch.bfloat16


def _open_packed(shards: str, cfg, world_size: int, shuffle: bool) -> PackedData:
    """The packed shards of a directory, checked against this run: its world size and its ZeRO stage."""
    if shuffle:
        packed = PackedData(shards, cfg.data.check_counts, cfg.data.shuffle_epochs, cfg.train.seed)
    else:
        try:
            packed = PackedData(shards, cfg.data.check_counts)
        except UserError as e:  # the loader's message names data.shards: here it is the held-out folder
            raise UserError(str(e).replace("data.shards", "data.eval_shards")) from None
    _check_packed(packed, shards, cfg, world_size)
    return packed


def _check_packed(packed: PackedData, shards: str, cfg, world_size: int) -> None:
    """Packed shards checked against this run: its world size and its ZeRO stage."""
    from hbp_train.planning.baselines.bytescale import check_zero_stage

    if packed.world_size != world_size:
        raise UserError(f"{shards}/plan.json was planned for world size {packed.world_size}, but this run has "
                        f"{world_size} ranks: launch {packed.world_size} processes (NPROC={packed.world_size} "
                        f"./launch.sh train ...), or re-plan with data_tools.pack --world-size {world_size}")
    try:  # bytescale plans (unequal micro-batch counts per replica) need ZeRO-1
        check_zero_stage(packed.plan, cfg.deepspeed.zero_stage)
    except UserError as e:
        raise UserError(f"{shards}/plan.json: {e} (deepspeed.zero_stage=1)") from None


def _check_attention_backend(model_cfg) -> None:
    """model.attention_backend must be usable on this machine (e.g. flash_varlen needs a GPU and bf16/fp16)."""
    from hbp_train.model.attention_setup import select_backend

    try:
        select_backend(model_cfg.attention_backend, _device(), model_cfg.torch_dtype())
    except UserError as e:
        raise UserError(f"model.attention_backend={model_cfg.attention_backend}: {e}") from None


def _warn_if_groups_may_not_fit(cfg, groups: list, model, world_size: int, ckpt_layers: list,
                                max_micro_batches: Optional[int] = None) -> None:
    """On a GPU: a one-line warning per packing group the profiler's memory model says will not fit in the memory
    left for the run (before the engine allocates anything). Advice only; models whose config is not Llama-like
    are not checked. ``ckpt_layers``: the checkpointed layers of each group (ckpt_layers_for)."""
    if not torch.cuda.is_available():
        return
    from hbp_train.perf.memory import JobSettings, memory_preflight
    from hbp_train.perf.shape import parse_model_shape

    try:
        shape = parse_model_shape(model.config)
    except UserError:  # not a Llama-like config: no memory model for it
        return
    # the decoder kernels this model runs (Liger's keep less for backward than HF's modules)
    job = JobSettings.of_run(cfg, max_micro_batches, getattr(model, "_hbp_fused_kernels", ()))
    groups = [{**g, "ckpt_layers": k} for g, k in zip(groups, ckpt_layers)]
    if dist_groups.rank() != 0:
        return
    # What the run can use: the free memory plus what torch's allocator holds already (the memory model counts
    # that as model states). The rest is held by the CUDA context, NCCL's communicators (DeepSpeed binds the GPU, so
    # the world's and one per SP group were made with the process groups, buffers included) and other processes:
    # measured here, not assumed.
    free, _ = torch.cuda.mem_get_info()
    for message in memory_preflight(groups, shape, world_size, job, free + torch.cuda.memory_reserved()):
        print(f"[train] warning: {message}", flush=True)
