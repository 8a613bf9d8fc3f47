"""Packed variable-length causal attention: every sample of a pack attends only to itself.

A pack is one sequence of T tokens that concatenates several samples. Attention must be causal *within* each
sample and must never cross a sample boundary; the boundaries are `cu_seqlens` (`[0, l1, l1+l2, ..., T]`).

Backends, in preference order (`available_backends` lists those usable on a device):
  flash_varlen  flash-attn's `flash_attn_varlen_func` (GPU, fp16/bf16, when the package is importable)
  torch_varlen  torch's `torch.nn.attention.varlen.varlen_attn` (torch >= 2.10, GPU only; signature by version)
  flex          FlexAttention with a document BlockMask (GPU; compiled once and cached)
  sdpa_block    `scaled_dot_product_attention`, exact everywhere (CPU and GPU); see `_sdpa_block`

`hf_packed_attention` adapts `packed_attention` to transformers' AttentionInterface; `register_packed_attention`
installs it on a model under the name "hbp_packed". It finds the boundaries from `position_ids` when no
`cu_seq_lens_q` is given, which is what DeepSpeed's Ulysses wrapper hands over (it all-gathers position_ids).

Shape legend: T tokens of the pack, H query heads, K key/value heads (H % K == 0, GQA), D head dim, B batch.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import logging
import math

import torch
import torch.nn.functional as F

from hbp_train.errors import UserError

log = logging.getLogger(__name__)

BACKENDS = ("flash_varlen", "torch_varlen", "flex", "sdpa_block")
GPU_ONLY_BACKENDS = ("flash_varlen", "torch_varlen", "flex")
ATTN_IMPLEMENTATION = "hbp_packed"
HALF_DTYPES = (torch.float16, torch.bfloat16)


# ----------------------------------------------------------------------------------------------- availability
@functools.cache
def _flash_attn_fn():
    """flash-attn's varlen kernel, or None. Availability is a real import, not a package lookup: a broken build (an
    ABI mismatch with the installed torch, the most common flash-attn failure) raises at import time, and must mean
    "fall back to the next backend" with one warning, not a crash at the first training step."""
    if importlib.util.find_spec("flash_attn") is None:
        return None
    try:
        from flash_attn import flash_attn_varlen_func
    except Exception as exc:  # noqa: BLE001 - ImportError, OSError, RuntimeError: any broken build falls back
        first = str(exc).splitlines()[0] if str(exc) else ""
        log.warning("flash-attn is installed but does not import (%s: %s); using the next attention backend. "
                    "Reinstall it for this torch (docs/gpu.md)", type(exc).__name__, first)
        return None
    return flash_attn_varlen_func


def _has_flash_attn() -> bool:
    return _flash_attn_fn() is not None


def _torch_varlen_fn():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _has_flex() -> bool:
    return importlib.util.find_spec("torch.nn.attention.flex_attention") is not None


def available_backends(device: torch.device, dtype: torch.dtype | None = None) -> list[str]:
    """The backends usable on `device`, in preference order (sdpa_block is always last and always there).

    With a dtype, the flash kernels (fp16/bf16 only) are left out for other dtypes.
    """
    device = torch.device(device)
    found = []
    if device.type == "cuda":
        half = dtype is None or dtype in HALF_DTYPES
        if half and _has_flash_attn():
            found.append("flash_varlen")
        if half and _torch_varlen_fn() is not None:
            found.append("torch_varlen")
        if _has_flex():
            found.append("flex")
    found.append("sdpa_block")
    return found


def select_backend(requested: str, device: torch.device, dtype: torch.dtype | None = None) -> str:
    """Resolve "auto" to the best available backend; raise UserError for an unknown or unusable name (the name comes
    from the user: model.attention_backend, a --backend flag)."""
    available = available_backends(device, dtype)
    if requested == "auto":
        return available[0]
    if requested not in available:
        why = "unknown" if requested not in BACKENDS else f"not available on {torch.device(device)}"
        if requested in BACKENDS and dtype is not None:
            why += f" with {dtype}"
        raise UserError(
            f"attention backend {requested!r} is {why}; available here: {', '.join(available)} (or 'auto')"
        )
    return requested


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


_BACKEND_FNS = {"flash_varlen": _flash_varlen, "torch_varlen": _torch_varlen, "flex": _flex, "sdpa_block": _sdpa_block}


def packed_attention(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, backend, scale=None) -> torch.Tensor:
    """Causal attention within each sample of a pack, never across samples. Returns out [T, H, Dv].

    q and k [T, H|K, D], v [T, K, Dv] (Dv may be smaller than D: MLA) with K dividing H (GQA); cu_seqlens int32 [n+1] with cu_seqlens[-1] == T;
    scale defaults to 1/sqrt(D); backend is a concrete name from BACKENDS (see `select_backend`).
    """
    if backend not in _BACKEND_FNS:
        raise ValueError(f"attention backend {backend!r} is unknown; choose one of {', '.join(BACKENDS)}")
    # flex also runs eagerly (forward only) off-GPU, which the tests use to check its mask on CPU
    if backend in ("flash_varlen", "torch_varlen"):
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
    v_head_dim = v_TKD.shape[-1]
    if backend in ("flash_varlen", "torch_varlen") and v_head_dim != q_THD.shape[-1]:
        # MLA (v narrower than q/k): the varlen kernels take one head size; zero columns of v give zero outputs.
        v_TKD = F.pad(v_TKD, (0, q_THD.shape[-1] - v_head_dim))
    out_THD = _BACKEND_FNS[backend](q_THD, k_TKD, v_TKD, cu_seqlens, int(max_seqlen), scale)
    return out_THD[..., :v_head_dim]


# ------------------------------------------------------------------------------------------ transformers glue
_state = {"backend": "sdpa_block"}


def set_backend(name: str) -> None:
    """Choose the backend `hf_packed_attention` uses (a concrete name; resolve "auto" with `select_backend`)."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is unknown; choose one of {', '.join(BACKENDS)}")
    _state["backend"] = name


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


def _training_device(model) -> torch.device:
    """The device the model will run on: its own if already on an accelerator, else the current GPU if any."""
    param = next(model.parameters(), None)
    if param is not None and param.device.type != "cpu":
        return param.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def register_packed_attention(model, backend: str = "auto", device: torch.device | None = None) -> str:
    """Install `hf_packed_attention` as the model's attention ("hbp_packed") and return the backend chosen.

    `device` is where training will run (default: see `_training_device`); "auto" picks its best backend for
    that device and the model's dtype.
    """
    device = device if device is not None else _training_device(model)
    chosen = select_backend(backend, device, getattr(model, "dtype", None))
    set_backend(chosen)
    use_attention(model, ATTN_IMPLEMENTATION, hf_packed_attention)
    return chosen


def use_attention(model, name: str, fn=None) -> None:
    """Point the model's attention layers at the implementation `name`, registering `fn` under it first if given.

    transformers 5 has a public setter; older versions only read config._attn_implementation.
    """
    if fn is not None:
        from transformers import AttentionInterface

        AttentionInterface.register(name, fn)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name
