"""Fused or compiled decoder elementwise work (RMSNorm, RoPE, SwiGLU): ``model.kernels``.

Outside its GEMMs and attention, a decoder layer runs a dozen memory-bound elementwise kernels (norms, rotary
embeddings, the gated activation, casts, residual adds). Two ways to fuse them, chosen at the start of a run:

  liger    Liger's Triton kernels (`liger_kernel.transformers.apply_liger_kernel_to_<family>` with RMSNorm, RoPE
           and SwiGLU only: the loss stays ours, loss.py). Needs CUDA, liger-kernel installed
           (requirements-liger.txt) and a family in LIGER_KERNELS: only the kernels that fit each family's modules
           are used (MoE experts and DeepSeek's interleaved RoPE stay HF's). The family's apply function is
           resolved before Liger is chosen: a release without one for the family, or whose import fails on this
           transformers, leaves the eager modules with one warning line (model.kernels=liger: one error line).
           Each kernel is then probed on the training device before the model uses it (model/liger_probe.py: a
           one-layer copy, forward and backward against HF's modules): one that fails stays eager, named in one
           warning line (model.kernels=liger: one error line), the others are used.
           Qwen3's per-head q/k norms, which Liger's apply function leaves eager, are patched too.
  compile  `torch.compile` of each decoder layer with a dynamic token count. The packed attention function is
           registered behind `torch.compiler.disable` (attention_setup.use_attention), so each layer compiles into the
           graphs around its attention call; Ulysses' all-to-all and the backends' host-side boundary code stay
           eager. Any device; the first step pays the compile, and its graphs serve every layer (they share
           code) and every later token count (tests/test_kernels.py counts them: no recompile over 12 layers and
           4 pack lengths).
  none     the HF modules as they are.
  auto     liger where it applies (CUDA, importable, the family listed), else none. compile stays opt-in: its first
           step compiles (30 s for the 2-layer tiny Llama with inductor on a 2-core CPU, cold cache) and it has
           been proven on the CPU only.

How each fits the rest of the step (docs/models.md, "Kernels", says what is tested): Liger replaces module
``forward``s of the model instance and the family's RoPE function (LoRA's wrapped Linear layers are still called
by them; ZeRO-3's hooks still gather each module's weights), and a compiled layer is called inside the same
per-layer activation checkpoint as an eager one (HF's GradientCheckpointingLayer wraps the compiled call).
ZeRO-3 with ``compile`` is refused: its parameter hooks run inside the compiled layer (dynamo would trace
DeepSpeed's gathering).

Liger's RoPE is the one process-wide change: Liger swaps the family's ``apply_rotary_pos_emb`` in transformers'
modeling module, which every model of that family in the process then uses. `restore_hf_modules` puts HF's own
back (bench/ calls it before building a plain HF baseline, and a model built with ``none`` or ``compile`` does it
for its own family); Liger's class swaps (RMSNorm, MLP classes) are undone at once, so models built later are HF's
unless they ask for Liger themselves.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging
import sys

import torch

from hbp_train.common.errors import UserError
from hbp_train.model import liger_probe
from hbp_train.model.attention_setup import training_device

log = logging.getLogger(__name__)

KERNELS = ("auto", "liger", "compile", "none")

# What each tested family (hbp_train/model/families.py) gets from Liger: the keyword arguments of its
# apply_liger_kernel_to_<family>. cross_entropy and fused_linear_cross_entropy are always off (our loss).
_DENSE = {"rope": True, "rms_norm": True, "swiglu": True}
LIGER_KERNELS: dict[str, dict] = {
    "llama": _DENSE,
    "qwen2": _DENSE,
    "qwen3": _DENSE,  # its q/k norms are RMSNorms too: patched here (QK_NORM_FAMILIES)
    "mistral": _DENSE,
    "phi3": _DENSE,  # fused gate_up_proj: Liger's Phi3 SwiGLU
    "gemma3_text": {"rope": True, "rms_norm": True, "geglu": False},  # a GELU-gated MLP, not SwiGLU: left eager
    # MoE: the fused experts stay HF's (Liger's expert kernel reads the 3-D weights directly, past the adapters
    # model.lora.target_parameters puts on them); norms and RoPE are fused.
    "mixtral": {"rope": True, "rms_norm": True, "swiglu": False},
    "qwen3_moe": {"rope": True, "rms_norm": True, "swiglu": False},
    "deepseek_v3": {"rope": False, "rms_norm": True, "swiglu": False},  # interleaved partial RoPE: not Liger's
    # Granite's multipliers (embedding, residual, attention, logits) sit in the decoder's and the head's forward,
    # outside the modules Liger replaces.
    "granite": _DENSE,
}
# Tested families Liger has no kernels for, and why: they run HF's modules.
EAGER_FAMILIES: dict[str, str] = {
    "cohere": "Cohere's bias-free LayerNorm and parallel attention/MLP block have no Liger apply function",
    "gemma2": "Liger's Gemma 2 kernels are not yet checked against HF's here (no GPU test has run them)",
}
_LIGER_OFF = {"cross_entropy": False, "fused_linear_cross_entropy": False}
_NAMES = {"rms_norm": "RMSNorm", "rope": "RoPE", "swiglu": "SwiGLU", "geglu": "GeGLU"}
# Families whose attention normalises q and k per head with the family's RMSNorm, which Liger's apply function
# leaves eager (it patches the decoder's norms only): patched here too (_patch_attention_norms).
QK_NORM_FAMILIES = ("qwen3", "qwen3_moe")

# Module-level names Liger replaced, per transformers modeling module: {module: {name: HF's original}}.
_replaced: dict = {}


def liger_module():
    """liger_kernel.transformers, or None when it is not installed or does not import (it needs Triton; one
    warning line for a broken install, as for a flash-attn build that does not import)."""
    try:
        if importlib.util.find_spec("liger_kernel") is None:
            return None
        return importlib.import_module("liger_kernel.transformers")
    except Exception as exc:  # noqa: BLE001 - any broken install means: no Liger
        first = str(exc).splitlines()[0] if str(exc) else ""
        log.warning("liger-kernel is installed but does not import (%s: %s); decoder kernels stay eager",
                    type(exc).__name__, first)
        return None


def select_kernels(requested: str, model_type: str, device: torch.device, zero_stage3: bool = False) -> str:
    """Resolve model.kernels to liger, compile or none; UserError (one line naming model.kernels) for a choice
    that cannot run here."""
    device = torch.device(device)
    if requested not in KERNELS:
        raise UserError(f"model.kernels: {requested!r} is not one of {', '.join(KERNELS)}")
    if requested == "compile" and zero_stage3:
        raise UserError("model.kernels=compile: not with ZeRO-3 (deepspeed.zero_stage=3), whose parameter hooks run "
                        "inside each compiled layer; use model.kernels=liger (CUDA) or none")
    if requested in ("compile", "none"):
        return requested
    why_not = _liger_missing(model_type, device)
    if requested == "liger" and why_not:
        raise UserError(f"model.kernels=liger: {why_not}; use model.kernels=auto, compile or none")
    if why_not and device.type == "cuda":  # a GPU run without the fused kernels it would get: said once, at start
        log.warning("model.kernels=auto: %s; the decoder kernels stay eager (HF's modules)", why_not)
    return "none" if why_not else "liger"


def _liger_missing(model_type: str, device: torch.device) -> str | None:
    """Why Liger cannot be used for this model on this device, or None. Liger's apply function is resolved here,
    so that a release without one for this family, or one whose lazy import fails on this transformers (releases
    older than 0.7 on transformers 5), means the eager modules rather than an error at the first model built."""
    if device.type != "cuda":
        return f"Liger's Triton kernels need a CUDA device (training runs on {device.type})"
    if model_type in EAGER_FAMILIES:
        return EAGER_FAMILIES[model_type]
    if model_type not in LIGER_KERNELS:
        return (f"no Liger kernels for model type {model_type!r} here (families: {', '.join(LIGER_KERNELS)}; "
                "docs/models.md)")
    liger = liger_module()
    if liger is None:
        return "liger-kernel is not installed (pip install -r requirements-liger.txt)"
    return _liger_apply_function(liger, model_type)[1]


def _liger_apply_function(liger, model_type: str):
    """(Liger's ``apply_liger_kernel_to_<model_type>``, None), or (None, why it cannot be had). Looking it up runs
    liger_kernel.transformers' lazy import of its monkey_patch module, which is where an incompatible release
    fails."""
    name = f"apply_liger_kernel_to_{model_type}"
    try:
        fn = getattr(liger, name, None)
    except Exception as exc:  # noqa: BLE001 - ImportError, AttributeError, ...: this release cannot patch it here
        first = str(exc).splitlines()[0] if str(exc) else ""
        return None, f"liger-kernel {_version('liger-kernel')} does not import {name} ({type(exc).__name__}: {first})"
    if fn is None:
        return None, f"liger-kernel {_version('liger-kernel')} has no {name}"
    return fn, None


def apply_kernels(model, chosen: str, layers, requested: str = "auto") -> str:
    """Apply the resolved choice (select_kernels) to ``model``, whose decoder blocks are ``layers``; returns the
    phrase the start-of-run log names it with. ``requested``: model.kernels as the user set it (liger: a kernel
    that fails its probe is an error rather than left eager)."""
    if chosen == "liger":
        return apply_liger(model, requested)
    if chosen == "compile":
        restore_hf_modules(type(model).__module__)  # HF's code is what is compiled (see "none" below)
        for layer in layers:
            # dynamic: every pack has its own token count; one graph set serves them all (see the module docstring)
            layer.compile(dynamic=True)
        return f"compile (torch.compile of each of {len(layers)} decoder layers, dynamic token count)"
    assert chosen == "none", chosen
    # Liger's RoPE of a model built before (bench/ builds ours with Liger, then ours_eager) would still be in
    # transformers' module: "none" means HF's own code
    restore_hf_modules(type(model).__module__)
    return "none (eager HF modules)"


def apply_liger(model, requested: str = "auto") -> str:
    """Liger's RMSNorm/RoPE/SwiGLU (as LIGER_KERNELS says for the family) on this model instance, each kernel first
    probed on the training device (model/liger_probe.py): one that fails stays eager with one warning line, or with
    ``requested`` "liger" is a one-line UserError."""
    model_type = model.config.model_type
    apply, why_not = _liger_apply_function(liger_module(), model_type)
    if apply is None:  # select_kernels resolved it already; a direct call gets the same one line
        raise UserError(f"model.kernels=liger: {why_not}")
    modeling = importlib.import_module(type(model).__module__)  # e.g. transformers.models.llama.modeling_llama
    restore_hf_modules(modeling.__name__)  # the probe's reference, and what Liger patches, are HF's own modules

    def patch(target, parts: dict) -> None:
        apply(model=target, **parts, **_LIGER_OFF)
        if parts.get("rms_norm") and model_type in QK_NORM_FAMILIES:
            _patch_attention_norms(target, apply)

    device = training_device(model)
    rejected = liger_probe.probe_liger(model.config, patch, LIGER_KERNELS[model_type], device, model.dtype)
    if rejected:
        failed = "; ".join(f"{_NAMES[k]}: {why}" for k, why in rejected.items())
        if requested == "liger":
            raise UserError(f"model.kernels=liger: Liger's kernels failed their check on {device} ({failed}); use "
                            "model.kernels=auto (leaves those eager) or none")
        log.warning("Liger's kernels failed their check on %s (%s); those stay eager (HF's modules)", device, failed)
    chosen = {k: bool(on) and k not in rejected for k, on in LIGER_KERNELS[model_type].items()}
    if not any(chosen.values()):
        return "none (eager HF modules: Liger's kernels failed their check here)"
    before = dict(vars(modeling))
    patch(model, chosen)
    changed = {name: old for name, old in before.items() if vars(modeling).get(name) is not old}
    originals = _replaced.setdefault(modeling.__name__, {})
    for name, old in changed.items():
        originals.setdefault(name, old)
        if isinstance(old, type):  # a class swap would make later models Liger's too: undone now (see docstring)
            setattr(modeling, name, old)
    used = [k for k in ("rms_norm", "rope", "swiglu") if chosen.get(k)]
    model._hbp_fused_kernels = tuple(used)  # what the memory model counts (perf/memory.py, JobSettings)
    eager = f"; {', '.join(_NAMES[k] for k in rejected)} eager: failed their check" if rejected else ""
    return f"liger (liger-kernel {_version('liger-kernel')}: {', '.join(_NAMES[k] for k in used)}{eager})"


def _patch_attention_norms(model, apply) -> None:
    """Liger's RMSNorm on each attention's q_norm and k_norm, with the module patcher of Liger's own apply functions
    (the one they use on the decoder's norms, so the attributes its forward reads are this release's). Not in
    place: Liger patches the q/k norms it does patch (Exaone4) so, as their input gradient is not theirs to reuse."""
    patch = getattr(sys.modules.get(getattr(apply, "__module__", "")), "_patch_rms_norm_module", None)
    if patch is None:  # a release without it: these norms stay eager (the rest is Liger's)
        log.warning("liger-kernel %s: no RMSNorm patcher found; the attention's q/k norms stay eager",
                    _version("liger-kernel"))
        return
    base = getattr(model, model.base_model_prefix, model)
    for layer in base.layers:
        for name in ("q_norm", "k_norm"):
            norm = getattr(layer.self_attn, name, None)
            if norm is not None:
                patch(norm, in_place=False)


def restore_hf_modules(module_name: str | None = None) -> None:
    """Put back what Liger replaced in transformers' modeling modules (the RoPE function), in all of them or in
    ``module_name`` only: models built or run after this use HF's code, models patched before keep their Liger
    module forwards but lose Liger's RoPE."""
    for name_of_module in [module_name] if module_name else list(_replaced):
        originals = _replaced.pop(name_of_module, {})
        module = importlib.import_module(name_of_module)
        for name, old in originals.items():
            setattr(module, name, old)


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"
