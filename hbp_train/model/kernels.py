"""Fused or compiled decoder elementwise work (RMSNorm, RoPE, SwiGLU): ``model.kernels``.

Outside its GEMMs and attention, a decoder layer runs a dozen memory-bound elementwise kernels (norms, rotary
embeddings, the gated activation, casts, residual adds). Two ways to fuse them, chosen at the start of a run:

  liger    Liger's Triton kernels (`liger_kernel.transformers.apply_liger_kernel_to_<family>` with RMSNorm, RoPE
           and SwiGLU only: the loss stays ours, loss.py). Needs CUDA, liger-kernel installed
           (requirements-liger.txt) and a family in LIGER_KERNELS: only the kernels that fit each family's modules
           are used (MoE experts and DeepSeek's interleaved RoPE stay HF's).
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
back (bench/ calls it before building a plain HF baseline); Liger's class swaps (RMSNorm, MLP classes) are undone
at once, so models built later are HF's unless they ask for Liger themselves.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import logging

import torch

from hbp_train.common.errors import UserError

log = logging.getLogger(__name__)

KERNELS = ("auto", "liger", "compile", "none")

# What each tested family (hbp_train/model/families.py) gets from Liger: the keyword arguments of its
# apply_liger_kernel_to_<family>. cross_entropy and fused_linear_cross_entropy are always off (our loss).
_DENSE = {"rope": True, "rms_norm": True, "swiglu": True}
LIGER_KERNELS: dict[str, dict] = {
    "llama": _DENSE,
    "qwen2": _DENSE,
    "qwen3": _DENSE,  # its q/k norms are RMSNorms too
    "mistral": _DENSE,
    "phi3": _DENSE,  # fused gate_up_proj: Liger's Phi3 SwiGLU
    "gemma3_text": {"rope": True, "rms_norm": True, "geglu": False},  # a GELU-gated MLP, not SwiGLU: left eager
    # MoE: the fused experts stay HF's (Liger's expert kernel reads the 3-D weights directly, past the adapters
    # model.lora.target_parameters puts on them); norms and RoPE are fused.
    "mixtral": {"rope": True, "rms_norm": True, "swiglu": False},
    "qwen3_moe": {"rope": True, "rms_norm": True, "swiglu": False},
    "deepseek_v3": {"rope": False, "rms_norm": True, "swiglu": False},  # interleaved partial RoPE: not Liger's
}
_LIGER_OFF = {"cross_entropy": False, "fused_linear_cross_entropy": False}

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
    return "none" if why_not else "liger"


def _liger_missing(model_type: str, device: torch.device) -> str | None:
    """Why Liger cannot be used for this model on this device, or None."""
    if device.type != "cuda":
        return f"Liger's Triton kernels need a CUDA device (training runs on {device.type})"
    if model_type not in LIGER_KERNELS:
        return (f"no Liger kernels for model type {model_type!r} here (families: {', '.join(LIGER_KERNELS)}; "
                "docs/models.md)")
    if liger_module() is None:
        return "liger-kernel is not installed (pip install -r requirements-liger.txt)"
    return None


def apply_kernels(model, chosen: str, layers) -> str:
    """Apply the resolved choice (select_kernels) to ``model``, whose decoder blocks are ``layers``; returns the
    phrase the start-of-run log names it with."""
    if chosen == "liger":
        return apply_liger(model)
    if chosen == "compile":
        for layer in layers:
            # dynamic: every pack has its own token count; one graph set serves them all (see the module docstring)
            layer.compile(dynamic=True)
        return f"compile (torch.compile of each of {len(layers)} decoder layers, dynamic token count)"
    assert chosen == "none", chosen
    return "none (eager HF modules)"


def apply_liger(model) -> str:
    """Liger's RMSNorm/RoPE/SwiGLU (as LIGER_KERNELS says for the family) on this model instance."""
    liger = liger_module()
    model_type = model.config.model_type
    chosen = LIGER_KERNELS[model_type]
    modeling = importlib.import_module(type(model).__module__)  # e.g. transformers.models.llama.modeling_llama
    before = dict(vars(modeling))
    getattr(liger, f"apply_liger_kernel_to_{model_type}")(model=model, **chosen, **_LIGER_OFF)
    changed = {name: old for name, old in before.items() if vars(modeling).get(name) is not old}
    originals = _replaced.setdefault(modeling.__name__, {})
    for name, old in changed.items():
        originals.setdefault(name, old)
        if isinstance(old, type):  # a class swap would make later models Liger's too: undone now (see docstring)
            setattr(modeling, name, old)
    used = [k for k in ("rms_norm", "rope", "swiglu") if chosen.get(k)]
    names = {"rms_norm": "RMSNorm", "rope": "RoPE", "swiglu": "SwiGLU"}
    return f"liger (liger-kernel {_version('liger-kernel')}: {', '.join(names[k] for k in used)})"


def restore_hf_modules() -> None:
    """Put back what Liger replaced in transformers' modeling modules (the RoPE function): models built or run
    after this use HF's code, models patched before keep their Liger module forwards but lose Liger's RoPE."""
    for module_name, originals in _replaced.items():
        module = importlib.import_module(module_name)
        for name, old in originals.items():
            setattr(module, name, old)
    _replaced.clear()


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "(version unknown)"
