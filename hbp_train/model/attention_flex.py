"""FlexAttention over a pack: the document-causal BlockMask (with a sliding window), soft-capping as a score_mod.

`flex_packed` is the ``flex`` backend of hbp_train/model/attention_backends.py. Its mask keeps every sample to
itself, causal, and within ``window`` keys when a layer has a sliding window (a query sees itself and the
``window - 1`` keys before it: HF's ``sliding_window``); a soft-cap ``c`` turns each scaled score s into
c·tanh(s/c) before the softmax, as HF's eager attention does. The BlockMask is built from the sample boundaries
block by block (`block_mask`), never as a T x T mask, and cached per pack and window: every layer of a forward (and
its recompute) finds it without reading the boundaries back to the host. On a GPU flex runs compiled, once for
dynamic shapes; elsewhere eagerly, forward only (its backward has no CPU kernel), which the tests use to check the
mask and the score_mod on the CPU.
"""

from __future__ import annotations

import functools

import torch

FLEX_BLOCK = 128  # FlexAttention's default block size

# Every pack has its own length and boundaries: compiled for dynamic shapes, the kernel is compiled once for the
# first pack and at most once more (when a BlockMask dimension first changes) instead of once per pack layout until
# torch's recompile limit, after which it would silently run eagerly. tests/test_attention.py counts the graphs.
FLEX_COMPILE_OPTIONS = {"dynamic": True}


@functools.cache
def compiled_flex(backend: str = "inductor"):
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, backend=backend, **FLEX_COMPILE_OPTIONS)


def document_ids(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sample index of every token ([T] int64)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths,
                                   output_size=num_tokens)


# The masks of the last pack seen, one per window (a model may alternate windowed and full layers). The layers after
# the first find them by the boundaries tensor itself and its version (no read back to the host: on a GPU a sync per
# layer); a new tensor is compared by its values once.
_mask_cache: dict = {"key": None, "tensor": None, "version": None, "masks": {}}


def block_mask(cu_seqlens: torch.Tensor, num_tokens: int, window: int | None = None):
    """The BlockMask of a pack: each sample causal on itself, within ``window`` keys per query if given.

    create_block_mask would evaluate the mask for every token pair (T x T booleans: 16 GiB at 128K tokens).
    The block structure follows from the sample of each block's first and last token: a kv block j <= q block i
    is needed iff its last sample reaches i's first sample (and, with a window, i's first token is less than
    ``window`` tokens after j's last); it is *full* (no masking inside) iff j < i, both blocks lie in one and the
    same sample (and i's last token is less than ``window`` after j's first). Needed blocks that are not full run
    the mask_mod per element."""
    from torch.nn.attention.flex_attention import BlockMask

    cache = _mask_cache
    same = (cache["tensor"] is cu_seqlens and cache["version"] == cu_seqlens._version and cache["key"] is not None
            and cache["key"][1] == num_tokens)
    if not same:
        key = (str(cu_seqlens.device), num_tokens, tuple(cu_seqlens.tolist()))
        cache.update(tensor=cu_seqlens, version=cu_seqlens._version)
        if cache["key"] != key:
            cache.update(key=key, masks={})
    if window in cache["masks"]:
        return cache["masks"][window]

    doc_T = document_ids(cu_seqlens, num_tokens)
    if window is None:
        def mask_mod(b, h, q_idx, kv_idx):
            return (doc_T[q_idx] == doc_T[kv_idx]) & (q_idx >= kv_idx)
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return (doc_T[q_idx] == doc_T[kv_idx]) & (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    device = cu_seqlens.device
    starts = torch.arange(0, num_tokens, FLEX_BLOCK, device=device)
    ends = torch.clamp(starts + FLEX_BLOCK, max=num_tokens) - 1
    first, last = doc_T[starts], doc_T[ends]
    single = (first == last) & (ends - starts + 1 == FLEX_BLOCK)  # a whole block inside one sample
    q_blk = torch.arange(len(starts), device=device)[:, None]
    kv_blk = q_blk.T
    needed = (kv_blk <= q_blk) & (last[None, :] >= first[:, None])
    full = (kv_blk < q_blk) & single[:, None] & single[None, :] & (first[:, None] == first[None, :])
    if window is not None:
        needed &= starts[:, None] - ends[None, :] < window
        full &= ends[:, None] - starts[None, :] < window

    def as_blocks(m):  # [Q, KV] bool -> per q block: how many kv blocks, and which (listed first)
        order = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return m.sum(-1).to(torch.int32)[None, None], order[None, None]

    mask = BlockMask.from_kv_blocks(*as_blocks(needed & ~full), *as_blocks(full), FLEX_BLOCK, mask_mod,
                                    seq_lengths=(num_tokens, num_tokens))
    cache["masks"][window] = mask
    return mask


@functools.cache
def softcap_score_mod(softcap: float):
    """The score_mod of attention logit soft-capping at ``softcap`` (one function per value, so a compiled flex
    sees the same function in every layer and call)."""
    def score_mod(score, b, h, q_idx, kv_idx):
        return softcap * torch.tanh(score / softcap)

    return score_mod


def flex_packed(q_THD, k_TKD, v_TKD, cu_seqlens, scale, window=None, softcap=None):
    """FlexAttention over the pack: q [T, H, D], k/v [T, K, D] -> [T, H, D]."""
    from torch.nn.attention.flex_attention import flex_attention

    num_tokens = q_THD.shape[0]
    mask = block_mask(cu_seqlens, num_tokens, window)
    # Compiled on GPU (fused kernel); eager elsewhere, which is forward-only and only used to test the mask on CPU.
    fn = compiled_flex() if q_THD.is_cuda else flex_attention
    out_1HTD = fn(
        q_THD.transpose(0, 1)[None], k_TKD.transpose(0, 1)[None], v_TKD.transpose(0, 1)[None],
        block_mask=mask, scale=scale, enable_gqa=k_TKD.shape[1] != q_THD.shape[1],
        score_mod=softcap_score_mod(float(softcap)) if softcap is not None else None,
    )
    return out_1HTD[0].transpose(0, 1)
