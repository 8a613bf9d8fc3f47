"""Building the HF causal LM for packed training and per-layer activation checkpointing (FLOPs: perf/flops.py).

The model is built from a local HF directory or from a config (no download), with `use_cache=False` (the
default cache silently disables packed-sample masking), the packed attention of attention.py and the decoder
kernels of kernels.py installed (`install_kernels`, which names both in the start-of-run log).
`forward_hidden` runs the decoder without the LM head so loss.py can apply the head chunk by chunk (the engine's
module, model/packed_lm.PackedCausalLM, does both).
"""

from __future__ import annotations

import re
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from hbp_train.model.attention import BACKENDS

from hbp_train.model.attention_setup import describe_backend, register_packed_attention, training_device
from hbp_train.distributed.groups import rank
from hbp_train.common.errors import UserError
from hbp_train.model.kernels import KERNELS, apply_kernels, select_kernels
from hbp_train.model.levers import join_tiles
from hbp_train.model.lora import LoraSettings, apply_lora
from hbp_train.model.rope import install_per_sample_rope, per_sample

SHIPPED_TOKENIZER = Path(__file__).resolve().parents[2] / "data_tools" / "assets" / "tokenizer"
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


# The attention implementation a model is loaded with before the packed one is registered: one every family accepts.
LOAD_ATTENTION = "eager"

# The files that make a folder a HF tokenizer (any one of them).
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")


@dataclass
class ModelConfig:
    """Which model to train and how to build it."""

    name_or_path: str | None = None
    """Local HF model directory (config + safetensors) to start from, with its own config.json; None builds a new
    model from `init_config` (and `config`)."""

    config: Any = None
    """HF config fields you set (a mapping; null = none): on top of init_config for a model built from scratch, or
    changes to a pretrained model's own config.json (e.g. rope_scaling, router_aux_loss_coef; one that changes a
    weight's shape is refused). Typed Any so that model.config={...} on the command line can name any field (a
    dict-typed field would refuse the keys it does not hold yet)."""

    init_config: dict = field(default_factory=dict)
    """The architecture of a model built from scratch (name_or_path null) as HF config fields (hidden_size,
    num_hidden_layers, ...): what a conf/model/ preset sets. Ignored with name_or_path: a pretrained model brings
    its own config.json."""

    architecture: str = "llama"
    """HF model_type used when building from scratch (llama, qwen2, mistral, ...); ignored with name_or_path."""

    dtype: str = "auto"
    """Parameter dtype: auto (bf16 on GPU, fp32 on CPU), bf16 or fp32."""

    attention_backend: str = "auto"
    """Packed attention backend: auto (the fastest installed kernel that runs this model: fa3, fa4, flash_varlen,
    torch_varlen, flex, then sdpa_block) or one of them by name (hbp_train/model/attention.py)."""

    kernels: str = "auto"
    """Decoder elementwise kernels (RMSNorm, RoPE, SwiGLU; hbp_train/model/kernels.py): auto (liger on CUDA when
    liger-kernel is installed and fits the family, else none), liger, compile (torch.compile of each decoder layer;
    not with ZeRO-3) or none."""

    tokenizer: str | None = None
    """Tokenizer directory; defaults to name_or_path, or the shipped data_tools/assets/tokenizer."""

    resize_vocab: bool = False
    """Grow a pretrained model's embeddings and LM head to the tokenizer's size, for tokens added to the tokenizer
    on purpose (the new rows start untrained). False refuses data holding token ids the model's vocabulary lacks
    (hbp_train/batches/vocab.py). A model built from scratch always gets the tokenizer's vocabulary."""

    seed: int = 0
    """Seed for the initial weights of a model built from scratch."""

    lora: LoraSettings = field(default_factory=LoraSettings)
    """LoRA/DoRA adapters (hbp_train/model/lora.py): r > 0 trains only the adapters."""

    def __post_init__(self):
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        if self.config is None:
            self.config = {}
        for name in ("config", "init_config"):
            if not isinstance(getattr(self, name), dict):
                raise UserError(f"model.{name}: must be a mapping of HF config fields, got "
                                f"{type(getattr(self, name)).__name__}")
        if self.name_or_path is not None:
            path = Path(self.name_or_path)
            if not (path / "config.json").is_file():
                raise UserError(f"model.name_or_path: {self.name_or_path!r} is not a local HF model dir (no config.json)")
        elif not self.hf_overrides():
            raise UserError("model.config: give the architecture (e.g. hidden_size, num_hidden_layers), a preset "
                            "(model=tiny_llama, model=qwen3_8b, ...) or model.name_or_path")
        if self.architecture not in CONFIG_MAPPING:
            raise UserError(f"model.architecture: {self.architecture!r} is not an HF model_type (e.g. llama, qwen2)")
        if self.dtype not in ("auto", *DTYPES):
            raise UserError(f"model.dtype: {self.dtype!r} is not one of auto, {', '.join(DTYPES)}")
        if self.attention_backend not in ("auto", *BACKENDS):
            raise UserError(f"model.attention_backend: {self.attention_backend!r} is not one of auto, {', '.join(BACKENDS)}")
        if self.kernels not in KERNELS:
            raise UserError(f"model.kernels: {self.kernels!r} is not one of {', '.join(KERNELS)}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise UserError(f"model.seed: must be an integer >= 0, got {self.seed!r}")
        if self.tokenizer is not None:  # set by the user: checked now (one taken from name_or_path: by build)
            check_tokenizer_dir(self.tokenizer)
        if self.tokenizer is None:
            self.tokenizer = self.name_or_path if self.name_or_path is not None else str(SHIPPED_TOKENIZER)
        hf_config(self)  # transformers' own checks of the values (e.g. heads dividing hidden_size), as one line
        if self.name_or_path is not None and self.config:
            check_weight_shapes_kept(self)

    def hf_overrides(self) -> dict:
        """The HF config fields laid over the model's config: init_config then config for a model built from
        scratch; config alone over a pretrained model's config.json (a preset's shape is not the checkpoint's)."""
        if self.name_or_path is None:
            return {**self.init_config, **self.config}
        return dict(self.config)

    def torch_dtype(self) -> torch.dtype:
        """The parameter dtype `dtype` resolves to on this machine."""
        if self.dtype == "auto":
            return torch.bfloat16 if torch.cuda.is_available() else torch.float32
        return DTYPES[self.dtype]


def check_tokenizer_dir(path: str) -> None:
    """UserError (one line naming model.tokenizer) unless ``path`` is a local folder holding a HF tokenizer."""
    folder = Path(path)
    if not folder.is_dir() or not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise UserError(f"model.tokenizer: {path!r} is not a tokenizer folder (one holding "
                        f"{' or '.join(TOKENIZER_FILES)}; models are read from local folders only)")


def check_weight_shapes_kept(cfg: ModelConfig) -> None:
    """UserError when model.config changes the shape of a pretrained model's weights (from_pretrained would print
    a report of every mismatched tensor and stop with a traceback on each rank). Both configs are built on the meta
    device: no memory, no weights read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    def shapes(config) -> dict:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return {name: tuple(p.shape) for name, p in model.state_dict().items()}

    own, changed = shapes(AutoConfig.from_pretrained(cfg.name_or_path)), shapes(hf_config(cfg))
    differ = sorted(name for name in own.keys() | changed.keys() if own.get(name) != changed.get(name))
    if differ:
        raise UserError(f"model.config ({', '.join(sorted(cfg.config))}) changes the shape of the weights in "
                        f"{cfg.name_or_path} (e.g. {differ[0]} {own.get(differ[0])} -> {changed.get(differ[0])}): a "
                        "checkpoint keeps its own shape; drop those fields, or build a new model with "
                        "model.name_or_path=null")


def transformers_error(exc: BaseException, field: str = "model.config") -> UserError:
    """A one-line UserError naming our field for an error transformers raised about the user's model settings:
    its first lines joined (a strict-dataclass error puts the reason on its second line), and the HF field when
    the error names one."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    named = re.search(r"for field '([A-Za-z0-9_]+)'", lines[0])
    where = f"{field}.{named.group(1)}" if named and field in ("model.config", "model.init_config") else field
    return UserError(f"{where}: transformers rejects it ({' '.join(lines[:2])[:300]})")


def hf_config(cfg: ModelConfig, overrides: dict | None = None):
    """The HF config of ``cfg`` (cfg.hf_overrides() over name_or_path's config.json, or over the architecture's
    defaults), with transformers' validation errors as one-line UserErrors naming model.config."""
    from transformers import AutoConfig

    overrides = cfg.hf_overrides() if overrides is None else overrides
    try:
        if cfg.name_or_path is not None:
            rope = {k: overrides[k] for k in ("rope_theta", "rope_scaling") if k in overrides}
            config = AutoConfig.from_pretrained(cfg.name_or_path, **{k: v for k, v in overrides.items()
                                                                      if k not in rope})
            return _fold_rope(config, rope) if rope else config
        return AutoConfig.for_model(cfg.architecture, **overrides)
    except (ValueError, TypeError, KeyError, OSError, AttributeError) as exc:  # strict-dataclass errors too
        raise transformers_error(exc, _fields_set(cfg, overrides)) from None
    except Exception as exc:  # noqa: BLE001 -- huggingface_hub's StrictDataclass*Error derive from Exception only
        if type(exc).__name__.startswith("StrictDataclass"):
            raise transformers_error(exc, _fields_set(cfg, overrides)) from None
        raise


def _fold_rope(config, rope: dict):
    """model.config's rope_theta / rope_scaling (the config.json keys Qwen's and others' long-context guides give)
    folded into the pretrained config's rope_parameters, which transformers 5 reads: passed as they are, a
    rope_theta is ignored and a rope_scaling replaces rope_parameters without the model's rope_theta."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise UserError(f"model.config: {', '.join(sorted(rope))}: this model keeps RoPE per layer type "
                        f"(rope_parameters: {params}); set ++model.config.rope_parameters={{...}} per layer type")
    scaling = dict(rope.get("rope_scaling") or {})
    if "type" in scaling:  # the older spelling of rope_type
        scaling.setdefault("rope_type", scaling.pop("type"))
    params.update(scaling)
    if "rope_theta" in rope:
        params["rope_theta"] = rope["rope_theta"]
    config.rope_parameters = params
    return config


def _fields_set(cfg: ModelConfig, overrides: dict) -> str:
    """The field an error about the HF config's values names: the user's model.config when it holds any, else the
    preset's model.init_config (a model built from scratch), else model.name_or_path (its config.json)."""
    if cfg.config:
        return "model.config"
    if cfg.name_or_path is None:
        return "model.init_config" if cfg.init_config else "model.config"
    return "model.config" if overrides else "model.name_or_path"


def build_model(cfg: ModelConfig, vocab_size: int | None = None, zero3_config: dict | None = None):
    """The causal LM of `cfg` with use_cache=False and packed attention registered; returns the HF model.

    vocab_size (the tokenizer's) is the least vocabulary: a model built from a config gets the larger of it and
    model.config.vocab_size (so a profile or benchmark can keep a real model's 128K vocabulary with a small
    tokenizer), and a pretrained one whose vocabulary is smaller grows its embeddings (never shrinks them). zero3_config (the run's DeepSpeed config, ZeRO
    stage 3; torch.distributed initialized) builds the model already partitioned across the ranks, so no rank ever
    holds all of its weights: the initial weights equal those of the unpartitioned build with the same seed.
    """
    from transformers import AutoModelForCausalLM

    dtype = cfg.torch_dtype()
    hf_config = hf_config_for(cfg, vocab_size)
    # Loaded with eager attention, which every family accepts (transformers refuses sdpa for some, e.g. Gemma 2 for
    # its soft-capping); the packed attention replaces it right after (install_kernels), so it never runs.
    if cfg.name_or_path is not None:
        with _hf_zero3(zero3_config):  # from_pretrained loads each rank's shards only; resizing gathers as needed
            model = AutoModelForCausalLM.from_pretrained(
                cfg.name_or_path, config=hf_config, dtype=dtype, attn_implementation=LOAD_ATTENTION,
                local_files_only=True
            )
            rows = model.get_input_embeddings().weight
            if vocab_size is not None and vocab_size > getattr(rows, "ds_shape", rows.shape)[0]:
                model.resize_token_embeddings(vocab_size)
                if zero3_config is not None:
                    # transformers builds the resized embeddings and head whole (the gathered old rows copied in):
                    # partition them now (rank 0's values) rather than keep them whole until deepspeed.initialize.
                    import deepspeed

                    deepspeed.zero.Init(module=model, config_dict_or_path=zero3_config)
    else:
        torch.manual_seed(cfg.seed)
        with _partitioned_init(zero3_config):
            try:
                model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, attn_implementation=LOAD_ATTENTION)
            except (ValueError, TypeError, KeyError) as exc:  # e.g. an unknown hidden_act, a str rope_theta
                raise transformers_error(exc, _fields_set(cfg, cfg.config)) from None
            except RuntimeError as exc:  # e.g. a negative size; a real out-of-memory is not the user's value
                if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc):
                    raise
                raise transformers_error(exc, _fields_set(cfg, cfg.config)) from None
    model.config.use_cache = False
    # under ZeRO-3, peft gathers a partitioned weight it reads (DoRA's column norms) when transformers reports ZeRO-3
    with _hf_zero3(zero3_config if cfg.lora.r else None):
        apply_lora(model, cfg.lora)  # r > 0: adapters injected, every other weight frozen
    # from_pretrained returns the model in eval mode, and HF decoder layers only checkpoint activations when
    # training: without this, per-group checkpointing would silently do nothing for a pretrained model.
    model.train()
    install_per_sample_rope(model)  # a length-dependent RoPE (longrope, dynamic): each sample's own (model/rope.py)
    install_kernels(model, cfg, zero3=zero3_config is not None)
    return model


# ------------------------------------------------------------------------------------------------- kernels
def install_kernels(model, cfg: ModelConfig, zero3: bool = False) -> tuple[str, str]:
    """The packed attention backend (model.attention_backend) and the decoder kernels (model.kernels) on the device
    training will run on, each named in one start-of-run line on rank 0. Returns (backend, kernels phrase)."""
    device = training_device(model)
    backend = register_packed_attention(model, cfg.attention_backend, device)
    chosen = select_kernels(cfg.kernels, model.config.model_type, device, zero3)
    kernels = apply_kernels(model, chosen, decoder_layers(model), cfg.kernels)
    model._hbp_kernels = kernels  # for reports (bench/): what this model runs with
    if rank() == 0:
        print(f"[model] attention: {describe_backend(backend, device)}", flush=True)
        print(f"[model] decoder kernels: {kernels}", flush=True)
    return backend, kernels


def _drop_pad_token_outside_vocab(hf_config) -> None:
    """Unset a pad_token_id the vocabulary does not hold (e.g. Phi-3's default 32000 in a smaller vocabulary).

    The embedding's padding_idx must lie inside it or the model cannot be built; packs have no padding, so the
    only effect of padding_idx (a zero, never-updated row) is not needed: the tokenizer's pad id fills dummy packs.
    """
    pad = getattr(hf_config, "pad_token_id", None)
    if isinstance(pad, int) and not 0 <= pad < hf_config.vocab_size:
        hf_config.pad_token_id = None


def hf_config_for(cfg: ModelConfig, vocab_size: int | None = None):
    """The HF config build_model builds from (no weights read): use_cache=False, cfg.hf_overrides(), and for a
    model built from a config the larger of the tokenizer's and the config's vocabulary."""
    overrides = cfg.hf_overrides()
    overrides["use_cache"] = False
    if cfg.name_or_path is not None:
        return hf_config(cfg, overrides)
    if vocab_size is not None:  # as for a pretrained model: the config's vocabulary may be larger, never smaller
        overrides["vocab_size"] = max(vocab_size, int(overrides.get("vocab_size") or 0))
    config = hf_config(cfg, overrides)
    _drop_pad_token_outside_vocab(config)
    return config


@contextmanager
def _hf_zero3(ds_config: dict | None):
    """Within it, transformers' DeepSpeed integration sees ZeRO-3 (no-op for None).

    from_pretrained then builds inside deepspeed.zero.Init and loads the checkpoint straight into the partitions,
    and resize_token_embeddings gathers the partitioned embeddings. transformers keeps only a weak reference to the
    HfDeepSpeedConfig, hence the local one; it is unset on exit so that a later build in this process (e.g. a
    ZeRO-2 run) is not partitioned.
    """
    if ds_config is None:
        yield
        return
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    hf_ds_config = HfDeepSpeedConfig(ds_config)  # noqa: F841 (held alive for the weak reference)
    try:
        yield
    finally:
        unset_hf_deepspeed_config()


@contextmanager
def _partitioned_init(ds_config: dict | None):
    """Within it, new modules are partitioned by deepspeed.zero.Init as each one is built (no-op for None).

    Not transformers' own ZeRO-3 path for from_config: that skips torch's construction-time initialisation and
    re-initialises on rank 0 in another order, so the weights would differ from the unpartitioned build with the
    same seed. Here every rank builds each module in full, in the same order and from the same seed (consuming the
    random stream exactly as the unpartitioned build), then keeps its partition; HF's own weight initialisation
    (post_init, which runs after the submodules were partitioned) gets each module's parameters gathered first,
    and every rank runs it so that the random streams stay in step.
    """
    if ds_config is None:
        yield
        return
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import DeepSpeedTensorOverride
    from transformers import PreTrainedModel
    from transformers.integrations.deepspeed import prevent_arange_dtype_change

    plain_init = PreTrainedModel._initialize_weights

    def gathered_init(self, module, *args, **kwargs):
        if getattr(module, "_is_hf_initialized", False):
            return plain_init(self, module, *args, **kwargs)
        # _init_weights may also set direct children's parameters (e.g. module.q_proj.weight)
        params = list(module.parameters(recurse=False))
        params += [p for child in module.children() if not isinstance(child, PreTrainedModel)
                   for p in child.parameters(recurse=False)]
        with deepspeed.zero.GatheredParameters(params, modifier_rank=0):
            # On the host, as the unpartitioned build does: a GPU's random generator would draw other weights.
            gathered = [p.data for p in params]
            for p in params:
                p.data = p.data.cpu()
            try:
                return plain_init(self, module, *args, **kwargs)
            finally:
                for p, data in zip(params, gathered):
                    data.copy_(p.data)
                    p.data = data

    PreTrainedModel._initialize_weights = gathered_init
    try:
        # Only the dtype override: new tensors are made (and randomly initialised) on the host like in the
        # unpartitioned build, then zero.Init moves each module's parameters to the device and partitions them.
        # prevent_arange_dtype_change keeps RoPE's int arange (inv_freq) out of zero.Init's bf16 cast.
        with prevent_arange_dtype_change(), deepspeed.zero.Init(
                config_dict_or_path=ds_config, tensor_overrides=[DeepSpeedTensorOverride.dtype]):
            yield
    finally:
        PreTrainedModel._initialize_weights = plain_init


def decoder_layers(model) -> torch.nn.ModuleList:
    """The repeated decoder blocks (model.model.layers for Llama/Qwen/Mistral-style models)."""
    return model.base_model.layers


def set_checkpointed_layers(model, num_layers: int) -> None:
    """Activation checkpointing on the FIRST num_layers decoder layers only (0 = none); may change every step.

    Checkpointing the first layers and keeping the last ones lets a packing group trade exactly as much
    recompute for memory as its pack length needs. Uses non-reentrant torch.utils.checkpoint.
    """
    layers = decoder_layers(model)
    if not 0 <= num_layers <= len(layers):
        raise ValueError(f"checkpointed layers must be in [0, {len(layers)}], got {num_layers}")
    if num_layers > 0 and not getattr(model, "_hbp_checkpointing_enabled", False):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model._hbp_checkpointing_enabled = True
    for index, layer in enumerate(layers):
        layer.gradient_checkpointing = index < num_layers


def forward_hidden(model, input_ids, position_ids, router_logits: list | None = None,
                   router_choices: list | None = None, pack_slice=None, **attn_kwargs) -> torch.Tensor:
    """Final hidden states [B, T, H] of the decoder (the model without its LM head).

    attn_kwargs go to the attention function (e.g. cu_seq_lens_q / max_length_q); position_ids restart per sample.
    router_logits (a list) receives an MoE model's router logits, one [T, E] tensor per MoE layer (moe.py);
    router_choices the experts its router chose, one [T, k] tensor per MoE layer (DeepSeek's router loss).
    pack_slice (rope.PackSlice: where these tokens lie in their pack) gives each sample its own RoPE where the
    model's depends on the sequence length (rope.py); None: HF's RoPE of the whole input.
    """
    if router_logits is not None:
        attn_kwargs["output_router_logits"] = True
    # tiled MLP (levers.py): each MoE layer's router ran once per tile; its records are joined back per layer
    tiles = getattr(model, "_hbp_mlp_tiles", 1)
    chosen = [] if router_choices is not None else None
    with _chosen_experts(model, chosen), per_sample(pack_slice):
        out = model.base_model(input_ids=input_ids, position_ids=position_ids, use_cache=False, **attn_kwargs)
    if router_logits is not None:
        router_logits.extend(join_tiles(out.router_logits, tiles))
    if router_choices is not None:
        router_choices.extend(join_tiles(chosen, tiles))
    return out.last_hidden_state


@contextmanager
def _chosen_experts(model, into: list | None):
    """Within it, each forward of the model's routers (the modules transformers records router_logits from, whose
    output is (logits, weights, chosen experts)) appends its chosen experts to ``into``. The hooks live for this
    forward only, so a checkpointed layer's recompute in backward appends nothing."""
    if into is None:
        yield
        return
    spec = (getattr(model.base_model, "_can_record_outputs", None) or {}).get("router_logits")
    router_class = getattr(spec, "target_class", spec)
    routers = [m for m in model.modules() if isinstance(router_class, type) and isinstance(m, router_class)]
    if not routers:
        raise UserError(f"{getattr(model.config, 'model_type', 'this model')}: no router module to read the chosen "
                        "experts from (DeepSeek's router loss, model.config.aux_loss_alpha); set "
                        "model.config.router_aux_loss_coef instead, or aux_loss_alpha=0")

    def record(module, args, output):
        outputs = output if isinstance(output, (tuple, list)) else (output,)
        chosen = [t for t in outputs if isinstance(t, torch.Tensor) and not t.is_floating_point()]
        if not chosen:
            raise UserError(f"{type(module).__name__} returns no chosen experts (DeepSeek's router loss, "
                            "model.config.aux_loss_alpha); set model.config.router_aux_loss_coef instead")
        into.append(chosen[0])

    handles = [m.register_forward_hook(record) for m in routers]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def num_params(model) -> int:
    """Number of parameters (tied weights counted once)."""
    return sum(p.numel() for p in model.parameters())
