"""Packed variable-length causal attention: every sample of a pack attends only to itself, with the layer's sliding
window and soft-cap.

A pack is one sequence of T tokens that concatenates several samples. Attention must be causal *within* each
sample and must never cross a sample boundary; the boundaries are `cu_seqlens` (`[0, l1, l1+l2, ..., T]`).

Two features a layer may add, as transformers' own attention functions apply them (HF eager is the reference):
  window   HF's ``sliding_window`` W: a query sees itself and the W - 1 keys before it in its sample (the masks'
           ``kv_idx > q_idx - W``). The flash kernels take it as ``window_size=(W - 1, 0)`` (keys i - left .. i +
           right); a window at least as long as every sample is plain causal attention and is not passed on.
  softcap  attention logit soft-capping c (Gemma 2): each scaled score s becomes c·tanh(s/c) before the softmax.

Backends, in preference order (which are installed: attention_kernels.py; which runs: attention_setup.py):
  fa3           FlashAttention-3 varlen (Hopper)                           window, softcap
  fa4           FlashAttention-4 behind torch's ``varlen_attn``             window
  flash_varlen  FlashAttention-2 varlen (flash-attn >= 2.6 for softcap)    window, softcap
  torch_varlen  torch's ``varlen_attn``, bundled FA2 (torch >= 2.10)        window (torch >= 2.11)
  flex          FlexAttention with a document BlockMask (attention_flex.py) window, softcap
  sdpa_block    ``scaled_dot_product_attention`` per sample, exact everywhere (CPU and GPU); see `_sdpa_block`
`feature_problem` says which backend cannot apply a feature (the probe then skips it, or refuses it when named).

Shape legend: T tokens of the pack, H query heads, K key/value heads (H % K == 0, GQA), D head dim, L a sample's
tokens.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from hbp_train.model import attention_kernels as kernels
from hbp_train.model.attention_flex import flex_packed

BACKENDS = ("fa3", "fa4", "flash_varlen", "torch_varlen", "flex", "sdpa_block")
GPU_ONLY_BACKENDS = ("fa3", "fa4", "flash_varlen", "torch_varlen", "flex")
# The flash-style varlen kernels: CUDA, fp16/bf16 only, one head size for q/k and v.
VARLEN_KERNELS = ("fa3", "fa4", "flash_varlen", "torch_varlen")


def _flash_features(window, softcap) -> dict:
    """The FlashAttention keywords of a window and a soft-cap (only those in use: an older release lacks them)."""
    features = {}
    if window is not None:
        features["window_size"] = (window - 1, 0)
    if softcap is not None:
        features["softcap"] = float(softcap)
    return features


def _flash_varlen(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale, window=None, softcap=None):
    flash_attn_varlen_func = kernels.flash_attn_fn()  # GQA is native: K heads may divide H

    # HF hands over [H, T, D]-strided views; the varlen kernels expect packed [T, H, D] rows
    q_THD, k_TKD, v_TKD = q_THD.contiguous(), k_TKD.contiguous(), v_TKD.contiguous()
    return flash_attn_varlen_func(
        q_THD, k_TKD, v_TKD, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
        dropout_p=0.0, softmax_scale=scale, causal=True, **_flash_features(window, softcap),
    )


def _fa3(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale, window=None, softcap=None):
    flash_attn_varlen_func = kernels.fa3_fn()  # GQA is native, as in FA2
    q_THD, k_TKD, v_TKD = q_THD.contiguous(), k_TKD.contiguous(), v_TKD.contiguous()
    out = flash_attn_varlen_func(q_THD, k_TKD, v_TKD, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen,
                                 softmax_scale=scale, causal=True, **_flash_features(window, softcap))
    return out[0] if isinstance(out, tuple) else out  # FA3 betas returned (out, softmax_lse)


@functools.cache
def _torch_varlen_params() -> frozenset[str]:
    return kernels.keyword_names(kernels.torch_varlen_fn())


def _torch_varlen(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale, window=None, softcap=None):
    # The signature changed every release: 2.10 `is_causal=`, 2.11 `window_size=(-1, 0)`, 2.12+ adds `enable_gqa`.
    # A sliding window is `window_size=(W - 1, 0)` (2.10 has none: feature_problem keeps windowed layers away). No
    # soft-capping in any release. K/V keep their K heads: the flash kernel behind varlen_attn takes K dividing H in
    # every version (enable_gqa only says so where the flag exists). Repeating them first would multiply the KV
    # activations kept for backward by H/K. The flag is passed only for GQA, as torch's cuDNN path refuses it even
    # when K == H.
    if softcap is not None:
        raise ValueError("torch's varlen_attn has no attention logit soft-capping")
    varlen_attn = kernels.torch_varlen_fn()
    params = _torch_varlen_params()
    kwargs = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0) if window is None else (window - 1, 0)
    elif window is None:
        kwargs["is_causal"] = True
    else:
        raise ValueError("this torch's varlen_attn has no window_size (torch >= 2.11)")
    if "enable_gqa" in params and k_TKD.shape[1] != q_THD.shape[1]:
        kwargs["enable_gqa"] = True
    if "scale" in params:
        kwargs["scale"] = scale
    else:  # fold a custom scale into q, relative to the kernel's default 1/sqrt(D)
        q_THD = q_THD * (scale * math.sqrt(q_THD.shape[-1]))
    q_THD, k_TKD, v_TKD = q_THD.contiguous(), k_TKD.contiguous(), v_TKD.contiguous()
    out = varlen_attn(q_THD, k_TKD, v_TKD, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, **kwargs)
    return out[0] if isinstance(out, tuple) else out


def _flex(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale, window=None, softcap=None):
    return flex_packed(q_THD, k_TKD, v_TKD, cu_seqlens, scale, window, softcap)


def _causal_mask(length: int, window, device) -> torch.Tensor:
    """[L, L] bool: query i sees key j <= i, within ``window`` keys when given."""
    i = torch.arange(length, device=device)
    distance = i[:, None] - i[None, :]
    return (distance >= 0) & (distance < window) if window is not None else distance >= 0


def _eager_sample(q_HLD, k_KLD, v_KLD, scale, window, softcap):
    """One sample as HF's eager attention computes it: scores, soft-cap, mask, softmax in fp32, values."""
    groups = q_HLD.shape[0] // k_KLD.shape[0]
    k_HLD, v_HLD = k_KLD.repeat_interleave(groups, 0), v_KLD.repeat_interleave(groups, 0)
    scores = (q_HLD @ k_HLD.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~_causal_mask(q_HLD.shape[1], window, q_HLD.device), float("-inf"))
    return scores.float().softmax(-1).to(q_HLD.dtype) @ v_HLD


def _sdpa_block(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale, window=None, softcap=None):
    """Exact SDPA, one is_causal call per sample (O(max_len^2) memory).

    Not one call with a block-diagonal T x T mask: that mask costs O(T^2) memory and compute over pairs that are
    masked anyway, and with a mask (and GQA) SDPA leaves its flash/efficient kernels for the math kernel on GPUs.
    bench/bench_sdpa_block.py times both. The samples are cut out with one ``split``, not a slice each: the
    backward of a slice writes a zero tensor of the whole pack, so n slices cost O(n·T) (4x slower fwd+bwd for an
    8K-token CPU pack of 64-token samples), where the split's backward is one concatenation. A sample longer than
    the layer's window gets an [L, L] band mask instead of is_causal; with a soft-cap (which SDPA lacks) the sample
    is computed as HF's eager attention does (an [H, L, L] score matrix: the CPU's path; on a GPU flex or the flash
    kernels cap without it)."""
    gqa = k_TKD.shape[1] != q_THD.shape[1]
    lengths = torch.diff(cu_seqlens).tolist()
    q_HLD, k_KLD, v_KLD = (x.transpose(0, 1).split(lengths, dim=1) for x in (q_THD, k_TKD, v_TKD))
    outs = []
    for q, k, v in zip(q_HLD, k_KLD, v_KLD):
        length = q.shape[1]
        sample_window = window if window is not None and window < length else None
        if softcap is not None:
            outs.append(_eager_sample(q, k, v, scale, sample_window, softcap))
        elif sample_window is not None:
            mask = _causal_mask(length, sample_window, q.device)
            outs.append(F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, scale=scale,
                                                       enable_gqa=gqa)[0])
        else:
            outs.append(F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=True, scale=scale,
                                                       enable_gqa=gqa)[0])
    return torch.cat(outs, dim=1).transpose(0, 1)


# fa4 is torch's varlen_attn with FlashAttention-4 activated in torch's dispatcher (see attention.set_backend).
_BACKEND_FNS = {"fa3": _fa3, "fa4": _torch_varlen, "flash_varlen": _flash_varlen, "torch_varlen": _torch_varlen,
                "flex": _flex, "sdpa_block": _sdpa_block}


def feature_problem(backend: str, window: bool, softcap: bool) -> str | None:
    """Why ``backend`` cannot apply a sliding window (``window``) or soft-capping (``softcap``), in a few words; None
    when it can (or when its entry point's signature cannot be read: then its probe decides). A FlashAttention
    release whose entry point lacks the keyword cannot; torch's varlen_attn (and FA4 behind it) has no soft-cap."""
    if backend in ("flex", "sdpa_block") or not (window or softcap):
        return None
    if backend in ("torch_varlen", "fa4"):
        if softcap:
            return "torch's varlen_attn has no attention logit soft-capping"
        params = _torch_varlen_params() if kernels.torch_varlen_fn() is not None else frozenset()
        return None if not params or "window_size" in params else "this torch's varlen_attn takes no window (2.11+)"
    fn = kernels.fa3_fn() if backend == "fa3" else kernels.flash_attn_fn()
    params = kernels.keyword_names(fn) if fn is not None else frozenset()
    missing = [name for name, used in (("window_size", window), ("softcap", softcap)) if used and name not in params]
    return f"its flash_attn_varlen_func takes no {' or '.join(missing)}" if params and missing else None


def packed_attention(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, backend, scale=None, window=None,
                     softcap=None) -> torch.Tensor:
    """Causal attention within each sample of a pack, never across samples. Returns out [T, H, Dv].

    q and k [T, H|K, D], v [T, K, Dv] (Dv may be smaller than D: MLA) with K dividing H (GQA); cu_seqlens int32 [n+1]
    with cu_seqlens[-1] == T; scale defaults to 1/sqrt(D); ``window``: HF's sliding_window (a query sees itself and
    the window - 1 keys before it), None for none; ``softcap``: attention logit soft-capping, None for none; backend
    is a concrete name from BACKENDS (see `attention_setup.select_backend`).
    """
    if backend not in _BACKEND_FNS:
        raise ValueError(f"attention backend {backend!r} is unknown; choose one of {', '.join(BACKENDS)}")
    # flex also runs eagerly (forward only) off-GPU, which the tests use to check its mask on CPU
    if backend in VARLEN_KERNELS:
        if not q_THD.is_cuda:
            raise ValueError(f"attention backend {backend!r} needs a CUDA tensor, got one on {q_THD.device}")
        if q_THD.dtype not in kernels.HALF_DTYPES:
            raise ValueError(f"attention backend {backend!r} needs bf16/fp16, got {q_THD.dtype}; use flex or "
                             "sdpa_block")
    num_heads, num_kv_heads = q_THD.shape[1], k_TKD.shape[1]
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"query heads ({num_heads}) must be a multiple of key/value heads ({num_kv_heads})")
    if window is not None and window < 1 or softcap is not None and not softcap > 0:
        raise ValueError(f"a sliding window must be >= 1 and a soft-cap > 0, got {window} and {softcap}")
    if not q_THD.is_cuda:  # on GPU this check would cost a host sync per layer
        assert int(cu_seqlens[-1]) == q_THD.shape[0], "cu_seqlens[-1] must equal the number of tokens"
    if scale is None:
        scale = q_THD.shape[-1] ** -0.5
    max_seqlen = int(max_seqlen)
    if window is not None and window >= max_seqlen:  # no sample is longer: plain causal attention
        window = None
    cu_seqlens = cu_seqlens.to(device=q_THD.device, dtype=torch.int32)
    if backend in ("fa4", "torch_varlen"):  # one varlen_attn, two kernels: the name says which one runs
        kernels.use_torch_flash_impl("FA4" if backend == "fa4" else None)
    v_head_dim = v_TKD.shape[-1]
    if backend in VARLEN_KERNELS and v_head_dim != q_THD.shape[-1]:
        # MLA (v narrower than q/k): the varlen kernels take one head size; zero columns of v give zero outputs.
        v_TKD = F.pad(v_TKD, (0, q_THD.shape[-1] - v_head_dim))
    # window and softcap are passed only when in use: a kernel stand-in (tests) may not take them
    features = {name: value for name, value in (("window", window), ("softcap", softcap)) if value is not None}
    out_THD = _BACKEND_FNS[backend](q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale, **features)
    return out_THD[..., :v_head_dim]
