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
strings; which backend runs ("auto": the first available that passes a probe on the device) is decided in
hbp_train/model/attention_setup.py, which also names the kernel for the log and installs the backend on a model.
The probe's pack is small: the first real pack of each new largest size is tried once more before it runs
(`_backend_for_pack`), and a kernel that fails there gives way to auto's next choice instead of ending the run.

`hf_packed_attention` adapts `packed_attention` to transformers' AttentionInterface (installed under the name
"hbp_packed"). It finds the boundaries from `position_ids` when no `cu_seq_lens_q` is given, which is what
DeepSpeed's Ulysses wrapper hands over (it all-gathers position_ids). Every attention function is registered
wrapped in `torch.compiler.disable`: a decoder layer compiled by hbp_train/model/kernels.py (model.kernels=compile)
then breaks its graph around the attention call (host-side boundary code, collectives under Ulysses) and compiles
what is around it.

Shape legend: T tokens of the pack, H query heads, K key/value heads (H % K == 0, GQA), D head dim, B batch.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import math

import torch
import torch.nn.functional as F

from hbp_train.common.errors import UserError

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
    """flash-attn's (FA2) varlen kernel, or None. flash-attn-4 installs into the same flash_attn/ folder (its kernels
    under flash_attn/cute, run here as fa4): the folder is FA2's only if the flash-attn distribution installed it, so
    an FA4-only install is not mistaken for a broken FA2."""
    owners = importlib.metadata.packages_distributions().get("flash_attn")
    if owners is not None and "flash-attn" not in {o.lower().replace("_", "-") for o in owners}:
        return None
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


# One BlockMask per pack: every layer of a forward (and its recompute) sees the same boundaries. The layers after
# the first find it by the boundaries tensor itself and its version (no read back to the host: on a GPU a sync per
# layer); a new tensor is compared by its values once.
_flex_mask_cache: dict = {"key": None, "mask": None, "tensor": None, "version": None}


FLEX_BLOCK = 128  # FlexAttention's default block size


def _flex_block_mask(cu_seqlens: torch.Tensor, num_tokens: int):
    """The document-causal BlockMask of a pack, built from the sample boundaries block by block.

    create_block_mask would evaluate the mask for every token pair (T x T booleans: 16 GiB at 128K tokens).
    The block structure follows from the sample of each block's first and last token: a kv block j <= q block i
    is needed iff its last sample reaches i's first sample; it is *full* (no masking inside) iff j < i and both
    blocks lie in one and the same sample. Needed blocks that are not full run the mask_mod per element."""
    from torch.nn.attention.flex_attention import BlockMask

    cache = _flex_mask_cache
    if (cache["tensor"] is cu_seqlens and cache["version"] == cu_seqlens._version and cache["key"] is not None
            and cache["key"][1] == num_tokens):
        return cache["mask"]
    key = (str(cu_seqlens.device), num_tokens, tuple(cu_seqlens.tolist()))
    cache.update(tensor=cu_seqlens, version=cu_seqlens._version)
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


# ------------------------------------------------------------------------------- the first real pack of a size
# The probe (attention_setup.probe_backend) runs 128 tokens: a GPU kernel can still fail on a real pack (FA4 compiles
# per shape; a backward may not exist for this head shape at this length). The first pack of each new largest size
# is tried once on copies, forward and backward (forward only where no gradient is asked for), before the real call;
# if that fails, auto's next choice that passes its probe and the same trial runs from then on (one warning line),
# and a backend the user named is a UserError.
_trial: dict = {"tokens": 0, "forward_tokens": 0, "fallbacks": (), "check": None, "named": False}


def set_fallbacks(fallbacks, check=None, named: bool = False) -> None:
    """What the first pack of a new size does when the chosen backend fails on it (attention_setup sets this with
    the choice): try ``fallbacks`` in order, each taken when ``check(name)`` (its probe) returns None and it runs the
    pack; ``named``: the user asked for the chosen backend, so its failure is theirs to see."""
    _trial.update(tokens=0, forward_tokens=0, fallbacks=tuple(fallbacks), check=check, named=named)


def _runs_pack(name, q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale, backward: bool = True) -> str | None:
    """None if backend ``name`` runs forward (and backward) on copies of this pack, else why in one line. Identity
    saved-tensor hooks: inside a checkpointed layer the trial keeps its own tensors for its own backward."""
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            inputs = [x.detach().clone().requires_grad_(backward) for x in (q_THD, k_TKD, v_TKD)]
            out = packed_attention(*inputs, cu_seqlens, max_seqlen, name, scale=scale)
            if backward:
                torch.autograd.grad(out, inputs, torch.ones_like(out))
    except Exception as exc:  # noqa: BLE001 - any failure of the kernel on this pack: not this backend
        if "out of memory" in str(exc):  # not the kernel's doing: the real call would run out as well
            raise
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    return None


def _backend_for_pack(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale) -> str:
    """The backend to run this pack with: the chosen one, tried first on a pack larger than any before (see above)."""
    backend, tokens = get_backend(), q_THD.shape[0]
    backward = torch.is_grad_enabled() and any(x.requires_grad for x in (q_THD, k_TKD, v_TKD))
    tried = _trial["tokens"] if backward else max(_trial["tokens"], _trial["forward_tokens"])
    if backend not in GPU_ONLY_BACKENDS or tokens <= tried or q_THD.device.type == "meta":
        return backend
    args = (q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale, backward)
    why = _runs_pack(backend, *args)
    remaining = [b for b in _trial["fallbacks"] if b != backend]
    while why is not None:
        if _trial["named"] or not remaining:
            raise UserError(f"model.attention_backend={backend} fails on a pack of {tokens} tokens ({why}); choose "
                            f"another backend (auto falls back to the next one by itself)")
        failed, backend = backend, remaining.pop(0)
        log.warning("attention backend %s failed on the first pack of %d tokens (%s); falling back to %s",
                    failed, tokens, why, backend)
        check = _trial["check"]
        why = (check(backend) if check and backend != "sdpa_block" else None) or (
            _runs_pack(backend, *args) if backend in GPU_ONLY_BACKENDS else None)
    set_backend(backend)
    _trial["tokens" if backward else "forward_tokens"] = tokens
    return backend


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
    for feature in ("softcap", "s_aux"):  # hbp_train/model/compat.py refuses these before the model is built
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
    q_THD, k_TKD, v_TKD = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    backend = _backend_for_pack(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scaling)
    out_THD = packed_attention(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, backend, scale=scaling)
    # Contiguous as HF's own attention functions return it: some models .view() the output (JetMoE).
    return out_THD[None].contiguous(), None
