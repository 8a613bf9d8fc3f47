"""The attention kernels' imports: which one is installed and importable here, and torch's flash-kernel registry.

Availability is a real import, never a version string or a package lookup: a broken build (an ABI mismatch with the
installed torch, the most common flash-attn failure) raises at import time and must mean "use the next backend"
with one warning line, not a crash at the first step. Which backend runs, given these, is decided in
hbp_train/model/attention_setup.py; the backends themselves are in hbp_train/model/attention_backends.py.

  fa3           FlashAttention-3 (flash-attn's hopper/ build): ``flash_attn_interface.flash_attn_varlen_func``
  fa4           FlashAttention-4 (the flash-attn-4 package, ``flash_attn.cute``) run behind torch's ``varlen_attn``
                once torch's registry activates it (``torch.nn.attention.activate_flash_attention_impl("FA4")``)
  flash_varlen  FlashAttention-2: ``flash_attn.flash_attn_varlen_func``
  torch_varlen  ``torch.nn.attention.varlen.varlen_attn`` (torch >= 2.10) with its bundled FA2 kernels
  flex          ``torch.nn.attention.flex_attention``
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging

import torch

try:  # torch's registry of pluggable flash kernels (activate/current/restore_flash_attention_impl)
    import torch.nn.attention as _flash_impl_registry

    _flash_impl_registry.current_flash_attention_impl  # noqa: B018 - absent in a torch without the registry
except (ImportError, AttributeError):
    _flash_impl_registry = None

log = logging.getLogger(__name__)

# Compute capabilities (major) each FlashAttention generation has kernels for: FA3 is Hopper's, FA4 Hopper's and
# Blackwell's (the same sets torch's own FA3/FA4 registrations check).
FA3_CAPABILITIES = (9,)
FA4_CAPABILITIES = (9, 10)
HALF_DTYPES = (torch.float16, torch.bfloat16)


def import_kernel(module: str, attr: str, what: str):
    """``module.attr`` or None; a module that is installed but raises at import is None with one warning line."""
    try:
        if importlib.util.find_spec(module) is None:
            return None
    except (ImportError, ValueError):  # a parent package that is missing or broken
        return None
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception as exc:  # noqa: BLE001 - ImportError, OSError, RuntimeError, AttributeError: any broken build
        first = str(exc).splitlines()[0] if str(exc) else ""
        log.warning("%s is installed but does not import (%s: %s); using the next attention backend. "
                    "Reinstall it for this torch (docs/gpu.md)", what, type(exc).__name__, first)
        return None


@functools.cache
def flash_attn_fn():
    """flash-attn's (FA2) varlen kernel, or None. flash-attn-4 installs into the same flash_attn/ folder (its kernels
    under flash_attn/cute, run here as fa4): the folder is FA2's only if the flash-attn distribution installed it, so
    an FA4-only install is not mistaken for a broken FA2."""
    owners = importlib.metadata.packages_distributions().get("flash_attn")
    if owners is not None and "flash-attn" not in {o.lower().replace("_", "-") for o in owners}:
        return None
    return import_kernel("flash_attn", "flash_attn_varlen_func", "flash-attn")


def has_flash_attn() -> bool:
    return flash_attn_fn() is not None


@functools.cache
def fa3_fn():
    """FlashAttention-3's varlen kernel (flash-attn's hopper/ build installs the module flash_attn_interface), or
    None."""
    return import_kernel("flash_attn_interface", "flash_attn_varlen_func", "FlashAttention-3 (flash_attn_interface)")


@functools.cache
def fa4_registered() -> bool:
    """torch can route varlen_attn to FlashAttention-4 (its registry lists "FA4") and the FA4 kernels import (the
    module and entry points torch's registration itself requires)."""
    if _flash_impl_registry is None or torch_varlen_fn() is None:
        return False
    if "FA4" not in _flash_impl_registry.list_flash_attention_impls():
        return False
    fa4 = import_kernel("flash_attn.cute.interface", "_flash_attn_bwd", "FlashAttention-4 (flash_attn.cute)")
    return fa4 is not None


def torch_varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def has_flex() -> bool:
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def keyword_names(fn) -> frozenset:
    """The parameter names of a kernel's Python entry point (what it takes differs between releases), or none when
    its signature cannot be read (a C function)."""
    try:
        return frozenset(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return frozenset()


def use_torch_flash_impl(impl: str | None) -> None:
    """Activate torch's pluggable flash implementation ``impl`` ("FA4"), or restore torch's own with None; a no-op
    when it is so already (a dictionary lookup: cheap enough for every attention call)."""
    if _flash_impl_registry is None:  # a torch without the registry: nothing can have been activated
        return
    if _flash_impl_registry.current_flash_attention_impl() == impl:
        return
    if impl is None:
        _flash_impl_registry.restore_flash_attention_impl()
    else:
        _flash_impl_registry.activate_flash_attention_impl(impl)
