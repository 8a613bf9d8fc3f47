"""Packed variable-length causal attention: every sample of a pack attends only to itself.

A pack is one sequence of T tokens that concatenates several samples. Attention must be causal *within* each
sample and must never cross a sample boundary; the boundaries are `cu_seqlens` (`[0, l1, l1+l2, ..., T]`).

Backends, in preference order (`available_backends` lists those installed and usable on a device):
  fa3           FlashAttention-3 (Hopper, compute capability 9.x): `flash_attn_interface.flash_attn_varlen_func`
  fa4           FlashAttention-4 (Hopper and Blackwell, 9.x/10.x) plugged into torch's `varlen_attn` through
                `torch.nn.attention.activate_flash_attention_impl("FA4")` (torch's FA4 registry; the kernels come
                from the flash-attn-4 package, `flash_attn.cute.interface`)
  flash_varlen  FlashAttention-2: flash-attn's `flash_attn_varlen_func` (GPU, fp16/bf16)
  torch_varlen  torch's `torch.nn.attention.varlen.varlen_attn` with its bundled FA2 kernels (torch >= 2.10, GPU;
                signature by version)
  flex          FlexAttention with a document BlockMask (GPU; compiled once and cached)
  sdpa_block    `scaled_dot_product_attention`, exact everywhere (CPU and GPU); see `_sdpa_block`
Availability is decided by importing the kernel's module and by the device's compute capability, never by version
strings. "auto" then takes the first one that also passes `probe_backend` (a tiny forward and backward on the
device, checked against sdpa_block), so a kernel that imports but cannot run this model's head size is skipped
with one warning line instead of failing at the first step. `describe_backend` names the kernel for the log.

`hf_packed_attention` adapts `packed_attention` to transformers' AttentionInterface; `register_packed_attention`
installs it on a model under the name "hbp_packed". It finds the boundaries from `position_ids` when no
`cu_seq_lens_q` is given, which is what DeepSpeed's Ulysses wrapper hands over (it all-gathers position_ids).
Every attention function is registered wrapped in `torch.compiler.disable`: a decoder layer compiled by
hbp_train/kernels.py (model.kernels=compile) then breaks its graph around the attention call (host-side boundary
code, collectives under Ulysses) and compiles what is around it.

Shape legend: T tokens of the pack, H query heads, K key/value heads (H % K == 0, GQA), D head dim, B batch.

Over 500 lines because the backends, their detection and selection, and the transformers glue share the kernel
lookups and torch's FA4 switch: split apart, the probe (which runs the backends) and the backends (which the
selection lists) would import each other.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from hbp_train.errors import UserError

try:  # torch's registry of pluggable flash kernels (activate/current/restore_flash_attention_impl)
    import torch.nn.attention as _flash_impl_registry

    _flash_impl_registry.current_flash_attention_impl  # noqa: B018 - absent in a torch without the registry
except (ImportError, AttributeError):
    _flash_impl_registry = None

log = logging.getLogger(__name__)

BACKENDS = ("fa3", "fa4", "flash_varlen", "torch_varlen", "flex", "sdpa_block")
GPU_ONLY_BACKENDS = ("fa3", "fa4", "flash_varlen", "torch_varlen", "flex")
# The flash-style varlen kernels: CUDA, fp16/bf16 only, one head size for q/k and v.
VARLEN_KERNELS = ("fa3", "fa4", "flash_varlen", "torch_varlen")
# Compute capabilities (major) each FlashAttention generation has kernels for: FA3 is Hopper's, FA4 Hopper's and
# Blackwell's (the same sets torch's own FA3/FA4 registrations check).
FA3_CAPABILITIES = (9,)
FA4_CAPABILITIES = (9, 10)
ATTN_IMPLEMENTATION = "hbp_packed"
HALF_DTYPES = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------- availability
def _import_kernel(module: str, attr: str, what: str):
    """``module.attr`` or None. Availability is a real import, not a package lookup: a broken build (an ABI mismatch
    with the installed torch, the most common flash-attn failure) raises at import time, and must mean "fall back to
    the next backend" with one warning, not a crash at the first training step."""
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
def _flash_attn_fn():
    """flash-attn's (FA2) varlen kernel, or None."""
    return _import_kernel("flash_attn", "flash_attn_varlen_func", "flash-attn")


def _has_flash_attn() -> bool:
    return _flash_attn_fn() is not None


@functools.cache
def _fa3_fn():
    """FlashAttention-3's varlen kernel (flash-attn's hopper/ build installs the module flash_attn_interface), or
    None."""
    return _import_kernel("flash_attn_interface", "flash_attn_varlen_func", "FlashAttention-3 (flash_attn_interface)")


@functools.cache
def _fa4_registered() -> bool:
    """torch can route varlen_attn to FlashAttention-4 (its registry lists "FA4") and the FA4 kernels import (the
    module and entry points torch's registration itself requires)."""
    if _flash_impl_registry is None or _torch_varlen_fn() is None:
        return False
    if "FA4" not in _flash_impl_registry.list_flash_attention_impls():
        return False
    fa4 = _import_kernel("flash_attn.cute.interface", "_flash_attn_bwd", "FlashAttention-4 (flash_attn.cute)")
    return fa4 is not None


def _torch_varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _has_flex() -> bool:
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def _capability_major(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


def available_backends(device: torch.device, dtype: torch.dtype | None = None) -> list[str]:
    """The backends installed and usable on `device`, in preference order (sdpa_block is always last and there).

    With a dtype, the flash kernels (fp16/bf16 only) are left out for other dtypes.
    """
    device = torch.device(device)
    found = []
    if device.type == "cuda":
        half = dtype is None or dtype in HALF_DTYPES
        major = _capability_major(device) if half and (_fa3_fn() is not None or _fa4_registered()) else None
        if major in FA3_CAPABILITIES and _fa3_fn() is not None:
            found.append("fa3")
        if major in FA4_CAPABILITIES and _fa4_registered():
            found.append("fa4")
        if half and _has_flash_attn():
            found.append("flash_varlen")
        if half and _torch_varlen_fn() is not None:
            found.append("torch_varlen")
        if _has_flex():
            found.append("flex")
    found.append("sdpa_block")
    return found


@dataclass(frozen=True)
class HeadShape:
    """What a probe call needs of the model's attention: query heads, key/value heads, q/k and v head dims."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int

    @classmethod
    def of(cls, hf_config) -> "HeadShape":
        """From an HF config: GQA heads, an explicit head_dim, or MLA's (qk_nope + qk_rope, v_head_dim)."""
        heads = int(hf_config.num_attention_heads)
        kv = int(getattr(hf_config, "num_key_value_heads", None) or heads)
        if getattr(hf_config, "qk_rope_head_dim", None) is not None:  # MLA
            qk = int(hf_config.qk_nope_head_dim) + int(hf_config.qk_rope_head_dim)
            return cls(heads, kv, qk, int(hf_config.v_head_dim))
        dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)
        return cls(heads, kv, dim, dim)


def probe_backend(backend: str, device: torch.device, dtype: torch.dtype, shape: HeadShape) -> str | None:
    """None if ``backend`` runs a small packed forward and backward of this head shape on ``device`` and matches
    sdpa_block on the same inputs (computed in fp32); else the reason, in one line. Leaves the backend chosen
    before the call active."""
    previous = get_backend()
    gen = torch.Generator().manual_seed(0)
    lengths = (48, 80)  # two samples: a boundary is crossed if the kernel ignores cu_seqlens
    num_tokens = sum(lengths)

    def make(heads, dim):
        return torch.randn(num_tokens, heads, dim, generator=gen).to(device, dtype).requires_grad_()

    q, k, v = make(shape.num_heads, shape.head_dim), make(shape.num_kv_heads, shape.head_dim), \
        make(shape.num_kv_heads, shape.v_head_dim)
    cu = torch.tensor([0, lengths[0], num_tokens], dtype=torch.int32, device=device)
    try:
        set_backend(backend)
        out = packed_attention(q, k, v, cu, max(lengths), backend)
        out.float().square().sum().backward()
        grads = [x.grad.float() for x in (q, k, v)]
        if not all(bool(torch.isfinite(g).all()) for g in grads):
            return "its backward gave non-finite gradients"
        ref = packed_attention(*(x.detach().float() for x in (q, k, v)), cu, max(lengths), "sdpa_block")
        error = float((out.detach().float() - ref).abs().max())
    except Exception as exc:  # noqa: BLE001 - any failure of the kernel means: not this backend
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    finally:
        set_backend(previous)
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2  # fp16/bf16 inputs, fp32 reference
    if error > tolerance:
        return f"its output differs from sdpa_block by {error:.3g} (> {tolerance})"
    return None


def select_backend(requested: str, device: torch.device, dtype: torch.dtype | None = None,
                   shape: HeadShape | None = None) -> str:
    """Resolve "auto" to the best available backend; raise UserError for an unknown or unusable name (the name comes
    from the user: model.attention_backend, a --backend flag).

    With the model's head ``shape`` (and a dtype), every GPU kernel considered is probed first (`probe_backend`):
    "auto" skips one that fails with a warning line naming why; a requested one that fails is a UserError.
    """
    available = available_backends(device, dtype)
    if requested == "auto":
        for name in available:
            why = _probe_if_needed(name, device, dtype, shape)
            if why is None:
                return name
            log.warning("attention backend %s is installed but failed its check here (%s); trying the next one",
                        name, why)
        raise AssertionError("sdpa_block is exact everywhere and never fails its probe")
    if requested not in available:
        why = "unknown" if requested not in BACKENDS else f"not available on {torch.device(device)}"
        if requested in BACKENDS and dtype is not None:
            why += f" with {dtype}"
        raise UserError(
            f"attention backend {requested!r} is {why}; available here: {', '.join(available)} (or 'auto')"
        )
    why = _probe_if_needed(requested, device, dtype, shape)
    if why is not None:
        raise UserError(f"attention backend {requested!r} is installed but fails on this model's attention shape "
                        f"({why}); available here: {', '.join(available)} (or 'auto')")
    return requested


def _probe_if_needed(name: str, device, dtype, shape) -> str | None:
    """The probe's verdict for a GPU kernel when the shape is known; sdpa_block (exact) and calls without a shape
    are not probed."""
    if shape is None or dtype is None or name == "sdpa_block" or torch.device(device).type != "cuda":
        return None
    return probe_backend(name, torch.device(device), dtype, shape)


def _distribution_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def describe_backend(name: str, device: torch.device) -> str:
    """One phrase for the start-of-run log: the backend, the library and version that provide its kernel, the
    device; e.g. ``fa3 (flash_attn_interface 3.0.0) on NVIDIA H100 80GB HBM3``."""
    device = torch.device(device)
    if name == "fa3":
        source = f"flash_attn_interface {_distribution_version('flash_attn_3', 'flash-attn-3') or '(version unknown)'}"
    elif name == "fa4":
        source = (f"flash-attn-4 {_distribution_version('flash-attn-4', 'flash_attn_4') or '(version unknown)'} "
                  f"through torch {torch.__version__} varlen_attn")
    elif name == "flash_varlen":
        source = f"flash_attn {_distribution_version('flash-attn', 'flash_attn') or '(version unknown)'}"
    elif name == "torch_varlen":
        source = f"torch {torch.__version__} varlen_attn, its bundled FA2 kernels"
    elif name == "flex":
        source = f"torch {torch.__version__} flex_attention"
    else:
        source = f"torch {torch.__version__} scaled_dot_product_attention per sample"
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return f"{name} ({source}) on {where}"


# ------------------------------------------------------------------------------------------------ boundaries
def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sample boundaries of a pack from its position_ids ([T] or [1, T]).

    A new sample starts at token 0 and wherever the position does not continue the previous one (in particular
    at every reset to 0). Returns (cu_seqlens int32 [n+1] on the same device, max_seqlen).
    """
    if position_ids.dim() == 2:
        if position_ids.shape[0] != 1:
            raise ValueError(f"packed position_ids must have batch size 1, got shape {tuple(position_ids.shape)}")
        position_ids = position_ids[0]
    if position_ids.dim() != 1 or position_ids.numel() == 0:
        raise ValueError(f"position_ids must be a non-empty [T] or [1, T] tensor, got {tuple(position_ids.shape)}")
    num_tokens = position_ids.numel()
    is_start = torch.ones(num_tokens, dtype=torch.bool, device=position_ids.device)
    is_start[1:] = position_ids[1:] != position_ids[:-1] + 1
    starts = torch.nonzero(is_start, as_tuple=False).flatten()
    end = torch.tensor([num_tokens], device=position_ids.device, dtype=starts.dtype)
    cu_seqlens = torch.cat([starts, end]).to(torch.int32)
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())
    return cu_seqlens, max_seqlen


def _document_ids(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sample index of every token ([T] int64)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths, output_size=num_tokens)


# -------------------------------------------------------------------------------------------------- backends
def _flash_varlen(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale):
    flash_attn_varlen_func = _flash_attn_fn()  # GQA is native: K heads may divide H

    # HF hands over [H, T, D]-strided views; the varlen kernels expect packed [T, H, D] rows
    q_THD, k_TKD, v_TKD = q_THD.contiguous(), k_TKD.contiguous(), v_TKD.contiguous()
    return flash_attn_varlen_func(
        q_THD, k_TKD, v_TKD, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
        dropout_p=0.0, softmax_scale=scale, causal=True,
    )


def _fa3(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale):
    flash_attn_varlen_func = _fa3_fn()  # GQA is native, as in FA2
    q_THD, k_TKD, v_TKD = q_THD.contiguous(), k_TKD.contiguous(), v_TKD.contiguous()
    out = flash_attn_varlen_func(q_THD, k_TKD, v_TKD, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                 softmax_scale=scale, causal=True)
    return out[0] if isinstance(out, tuple) else out  # FA3 betas returned (out, softmax_lse)


@functools.cache
def _torch_varlen_params() -> frozenset[str]:
    return frozenset(inspect.signature(_torch_varlen_fn()).parameters)


def _torch_varlen(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale):
    # The signature changed every release: 2.10 `is_causal=`, 2.11 `window_size=(-1, 0)`, 2.12+ adds `enable_gqa`.
    # K/V keep their K heads: the flash kernel behind varlen_attn takes K dividing H in every version (enable_gqa
    # only says so where the flag exists). Repeating them first would multiply the KV activations kept for backward
    # by H/K. The flag is passed only for GQA, as torch's cuDNN path refuses it even when K == H.
    varlen_attn = _torch_varlen_fn()
    params = _torch_varlen_params()
    kwargs = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    if "enable_gqa" in params and k_TKD.shape[1] != q_THD.shape[1]:
        kwargs["enable_gqa"] = True
    if "scale" in params:
        kwargs["scale"] = scale
    else:  # fold a custom scale into q, relative to the kernel's default 1/sqrt(D)
        q_THD = q_THD * (scale * math.sqrt(q_THD.shape[-1]))
    q_THD, k_TKD, v_TKD = q_THD.contiguous(), k_TKD.contiguous(), v_TKD.contiguous()
    out = varlen_attn(q_THD, k_TKD, v_TKD, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)
    return out[0] if isinstance(out, tuple) else out


# Every pack has its own length and boundaries: compiled for dynamic shapes, the kernel is compiled once for the
# first pack and at most once more (when a BlockMask dimension first changes) instead of once per pack layout until
# torch's recompile limit, after which it would silently run eagerly. tests/test_attention.py counts the graphs.
FLEX_COMPILE_OPTIONS = {"dynamic": True}


@functools.cache
def _compiled_flex(backend: str = "inductor"):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, backend=backend, **FLEX_COMPILE_OPTIONS)


# One BlockMask per pack: every layer of a forward (and its recompute) sees the same boundaries.
_flex_mask_cache: dict = {"key": None, "mask": None}


FLEX_BLOCK = 128  # FlexAttention's default block size


def _flex_block_mask(cu_seqlens: torch.Tensor, num_tokens: int):
    """The document-causal BlockMask of a pack, built from the sample boundaries block by block.

    create_block_mask would evaluate the mask for every token pair (T x T booleans: 16 GiB at 128K tokens).
    The block structure follows from the sample of each block's first and last token: a kv block j <= q block i
    is needed iff its last sample reaches i's first sample; it is *full* (no masking inside) iff j < i and both
    blocks lie in one and the same sample. Needed blocks that are not full run the mask_mod per element."""
    from torch.nn.attention.flex_attention import BlockMask

    key = (str(cu_seqlens.device), num_tokens, tuple(cu_seqlens.tolist()))
    if _flex_mask_cache["key"] != key:
        doc_T = _document_ids(cu_seqlens, num_tokens)

        def same_sample_causal(b, h, q_idx, kv_idx):
            return (doc_T[q_idx] == doc_T[kv_idx]) & (q_idx >= kv_idx)

        device = cu_seqlens.device
        starts = torch.arange(0, num_tokens, FLEX_BLOCK, device=device)
        ends = torch.clamp(starts + FLEX_BLOCK, max=num_tokens) - 1
        first, last = doc_T[starts], doc_T[ends]
        single = (first == last) & (ends - starts + 1 == FLEX_BLOCK)  # a whole block inside one sample
        q_blk = torch.arange(len(starts), device=device)[:, None]
        kv_blk = q_blk.T
        needed = (kv_blk <= q_blk) & (last[None, :] >= first[:, None])
        full = (kv_blk < q_blk) & single[:, None] & single[None, :] & (first[:, None] == first[None, :])

        def as_blocks(m):  # [Q, KV] bool -> per q block: how many kv blocks, and which (listed first)
            order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)
            return m.sum(-1).to(torch.int32)[None, None], order[None, None]

        _flex_mask_cache["mask"] = BlockMask.from_kv_blocks(
            *as_blocks(needed & ~full), *as_blocks(full), FLEX_BLOCK, same_sample_causal,
            seq_lengths=(num_tokens, num_tokens))
        _flex_mask_cache["key"] = key
    return _flex_mask_cache["mask"]


def _flex(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale):
    from torch.nn.attention.flex_attention import flex_attention

    num_tokens = q_THD.shape[0]
    block_mask = _flex_block_mask(cu_seqlens, num_tokens)
    # Compiled on GPU (fused kernel); eager elsewhere, which is forward-only and only used to test the mask on CPU.
    fn = _compiled_flex() if q_THD.is_cuda else flex_attention
    out_1HTD = fn(
        q_THD.transpose(0, 1)[None], k_TKD.transpose(0, 1)[None], v_TKD.transpose(0, 1)[None],
        block_mask=block_mask, scale=scale, enable_gqa=k_TKD.shape[1] != q_THD.shape[1],
    )
    return out_1HTD[0].transpose(0, 1)


def _sdpa_block(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale):
    """Exact SDPA, one is_causal call per sample (O(max_len^2) memory).

    Not one call with a block-diagonal T x T mask: that mask costs O(T^2) memory and compute over pairs that are
    masked anyway, and with a mask (and GQA) SDPA leaves its flash/efficient kernels for the math kernel on GPUs.
    bench/bench_sdpa_block.py times both. The samples are cut out with one ``split``, not a slice each: the
    backward of a slice writes a zero tensor of the whole pack, so n slices cost O(n·T) (4x slower fwd+bwd for an
    8K-token CPU pack of 64-token samples), where the split's backward is one concatenation."""
    gqa = k_TKD.shape[1] != q_THD.shape[1]
    lengths = torch.diff(cu_seqlens).tolist()
    q_HLD, k_KLD, v_KLD = (x.transpose(0, 1).split(lengths, dim=1) for x in (q_THD, k_TKD, v_TKD))
    outs = [F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale,
                                           enable_gqa=gqa)[0] for q, k, v in zip(q_HLD, k_KLD, v_KLD)]
    return torch.cat(outs, dim=1).transpose(0, 1)


# fa4 is torch's varlen_attn with FlashAttention-4 activated in torch's dispatcher (see set_backend).
_BACKEND_FNS = {"fa3": _fa3, "fa4": _torch_varlen, "flash_varlen": _flash_varlen, "torch_varlen": _torch_varlen,
                "flex": _flex, "sdpa_block": _sdpa_block}


def packed_attention(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, backend, scale=None) -> torch.Tensor:
    """Causal attention within each sample of a pack, never across samples. Returns out [T, H, Dv].

    q and k [T, H|K, D], v [T, K, Dv] (Dv may be smaller than D: MLA) with K dividing H (GQA); cu_seqlens int32 [n+1] with cu_seqlens[-1] == T;
    scale defaults to 1/sqrt(D); backend is a concrete name from BACKENDS (see `select_backend`).
    """
    if backend not in _BACKEND_FNS:
        raise ValueError(f"attention backend {backend!r} is unknown; choose one of {', '.join(BACKENDS)}")
    # flex also runs eagerly (forward only) off-GPU, which the tests use to check its mask on CPU
    if backend in VARLEN_KERNELS:
        if not q_THD.is_cuda:
            raise ValueError(f"attention backend {backend!r} needs a CUDA tensor, got one on {q_THD.device}")
        if q_THD.dtype not in HALF_DTYPES:
            raise ValueError(f"attention backend {backend!r} needs bf16/fp16, got {q_THD.dtype}; use flex or sdpa_block")
    num_heads, num_kv_heads = q_THD.shape[1], k_TKD.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of key/value heads ({num_kv_heads})")
    if not q_THD.is_cuda:  # on GPU this check would cost a host sync per layer
        assert int(cu_seqlens[-1]) == q_THD.shape[0], "cu_seqlens[-1] must equal the number of tokens"
    if scale is None:
        scale = q_THD.shape[-1] ** -0.5
    cu_seqlens = cu_seqlens.to(device=q_THD.device, dtype=torch.int32)
    if backend in ("fa4", "torch_varlen"):  # one varlen_attn, two kernels: the name says which one runs
        _use_torch_flash_impl("FA4" if backend == "fa4" else None)
    v_head_dim = v_TKD.shape[-1]
    if backend in VARLEN_KERNELS and v_head_dim != q_THD.shape[-1]:
        # MLA (v narrower than q/k): the varlen kernels take one head size; zero columns of v give zero outputs.
        v_TKD = F.pad(v_TKD, (0, q_THD.shape[-1] - v_head_dim))
    out_THD = _BACKEND_FNS[backend](q_THD, k_TKD, v_TKD, cu_seqlens, int(max_seqlen), scale)
    return out_THD[..., :v_head_dim]


# ------------------------------------------------------------------------------------------ transformers glue
_state = {"backend": "sdpa_block"}


def set_backend(name: str) -> None:
    """Choose the backend `hf_packed_attention` uses (a concrete name; resolve "auto" with `select_backend`).

    fa4 activates FlashAttention-4 in torch's dispatcher, for the whole process (torch's flash kernels behind
    varlen_attn and SDPA become FA4's); choosing any other backend restores torch's own kernels, so that a
    torch_varlen chosen later really runs the bundled FA2."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is unknown; choose one of {', '.join(BACKENDS)}")
    _use_torch_flash_impl("FA4" if name == "fa4" else None)
    _state["backend"] = name


def _use_torch_flash_impl(impl: str | None) -> None:
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


def get_backend() -> str:
    """The backend `hf_packed_attention` uses now."""
    return _state["backend"]


# Boundaries are the same for every layer of a forward (and its checkpoint recompute): remember the last
# position_ids tensor seen, with its version counter so an in-place refill of a reused buffer is noticed.
# The trainer hands cu_seqlens to every layer (at sp=1 through the model's kwargs, under Ulysses from
# SequenceParallel.split), so this is for callers that give position_ids only.
_boundary_cache: dict = {"key": None, "result": None}


def _boundaries_from_kwargs(kwargs: dict) -> tuple[torch.Tensor, int]:
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is not None:
        max_seqlen = kwargs.get("max_length_q")
        if max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())
        return cu_seqlens, int(max_seqlen)
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise ValueError("hbp_packed attention needs position_ids (restarting per sample) or cu_seq_lens_q")
    key = _boundary_cache["key"]
    if key is None or key[0] is not position_ids or key[1] != position_ids._version:
        _boundary_cache["result"] = cu_seqlens_from_position_ids(position_ids)
        _boundary_cache["key"] = (position_ids, position_ids._version)
    return _boundary_cache["result"]


def hf_packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers AttentionInterface function: query [1, H, T, D], key/value [1, K, T, D] -> ([1, T, H, D], None).

    The attention_mask is ignored (transformers builds none for a custom implementation): sample boundaries come
    from kwargs["cu_seq_lens_q"] when given, else from kwargs["position_ids"]. Under Ulysses the core sees the
    whole pack (all-to-all over heads), so a cu_seq_lens_q passed through must describe the whole padded pack,
    not this rank's slice; position_ids are all-gathered by DeepSpeed's wrapper and are always right.
    """
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects batch size 1 (one pack per micro-batch), got {query.shape[0]}")
    if dropout:  # the model's config (attention_dropout), so the user's to fix
        raise UserError(
            f"packed attention does not implement attention dropout; set attention_dropout=0 (got {dropout})")
    for feature in ("softcap", "s_aux"):  # hbp_train/compat.py refuses these before the model is built
        if kwargs.get(feature) is not None:
            raise UserError(f"packed attention does not implement {feature} (attention logit soft-capping or sinks)")
    cu_seqlens, max_seqlen = _boundaries_from_kwargs(kwargs)
    # A window at least as long as every sample is plain causal attention (e.g. Mistral's 4096 on short packs).
    window = kwargs.get("sliding_window")
    if window is not None and max_seqlen > window:  # the model's config against the user's data
        raise UserError(
            f"packed attention does not implement sliding windows: a sample of {max_seqlen} tokens exceeds the "
            f"model's sliding_window={window}; disable it in the model config or use shorter samples"
        )
    out_THD = packed_attention(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1),
        cu_seqlens, max_seqlen, get_backend(), scale=scaling,
    )
    # Contiguous as HF's own attention functions return it: some models .view() the output (JetMoE).
    return out_THD[None].contiguous(), None


def training_device(model) -> torch.device:
    """The device the model will run on: its own if already on an accelerator, else the current GPU if any."""
    param = next(model.parameters(), None)
    if param is not None and param.device.type != "cpu":
        return param.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def register_packed_attention(model, backend: str = "auto", device: torch.device | None = None) -> str:
    """Install `hf_packed_attention` as the model's attention ("hbp_packed") and return the backend chosen.

    `device` is where training will run (default: see `training_device`); "auto" picks its best backend for
    that device and the model's dtype, probing the GPU kernels with the model's head shape (`select_backend`).
    """
    device = device if device is not None else training_device(model)
    shape = HeadShape.of(model.config) if hasattr(model, "config") else None
    chosen = select_backend(backend, device, getattr(model, "dtype", None), shape)
    set_backend(chosen)
    use_attention(model, ATTN_IMPLEMENTATION, hf_packed_attention)
    return chosen


def use_attention(model, name: str, fn=None) -> None:
    """Point the model's attention layers at the implementation `name`, registering `fn` under it first if given.

    transformers 5 has a public setter; older versions only read config._attn_implementation. ``fn`` is registered
    behind `torch.compiler.disable`: a compiled decoder layer (hbp_train/kernels.py) runs it eagerly, between graphs.
    """
    if fn is not None:
        from transformers import AttentionInterface

        AttentionInterface.register(name, torch.compiler.disable(fn))
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name
