"""Sliding windows and soft-capping in every packed attention backend (hbp_train/model/attention_backends.py).

The reference is HF's definition, written out per sample: a query at i sees the keys j <= i with j > i - W (HF's
``sliding_window`` W: W keys, itself included; masking_utils.sliding_window_overlay), and soft-capping turns each
scaled score s into c·tanh(s/c) before the mask and the softmax (Gemma 2's eager attention). Every test checks
first that the feature changes that reference on its inputs (a window shorter than a sample, logits beyond the cap),
so that it could fail.

On the CPU: sdpa_block (forward and gradients) and flex (forward: FlexAttention has no CPU backward; its BlockMask
against create_block_mask). The GPU kernels cannot run here: their calls are checked against STAND-INS that compute
what each kernel documents for the arguments it is given (FlashAttention: a query at i sees keys i - left .. i +
right, soft-cap c·tanh(s/c)), with each release's keyword signature, so that the conversion of HF's window to the
kernels' ``window_size`` is what is tested. ``@pytest.mark.gpu`` runs the real kernels.
"""

from __future__ import annotations

import pytest
import torch

from hbp_train.model import attention_backends as backends
from hbp_train.model import attention_flex as flex
from hbp_train.model import attention_kernels as kernels
from hbp_train.model.attention_backends import feature_problem, packed_attention

LENGTHS = (5, 23, 3, 17)  # samples longer and shorter than the windows below
CPU = torch.device("cpu")


def _cu(lengths, device=CPU):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _qkv(num_heads, num_kv_heads, dim=16, lengths=LENGTHS, size=1.0, device=CPU, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda heads, s=1.0: (torch.randn(sum(lengths), heads, dim, generator=gen) * s).to(device, dtype)  # noqa
    return make(num_heads, size), make(num_kv_heads), make(num_kv_heads)


def reference(q_THD, k_TKD, v_TKD, lengths, scale, window=None, softcap=None):
    """HF's attention of each sample alone (plain math, kv heads repeated for their query group)."""
    groups = q_THD.shape[1] // k_TKD.shape[1]
    outs, start = [], 0
    for n in lengths:
        q = q_THD[start:start + n].transpose(0, 1)
        k = k_TKD[start:start + n].repeat_interleave(groups, dim=1).transpose(0, 1)
        v = v_TKD[start:start + n].repeat_interleave(groups, dim=1).transpose(0, 1)
        scores = (q @ k.transpose(1, 2)) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
        seen = (j <= i) & ((j > i - window) if window is not None else True)
        outs.append((scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v).transpose(0, 1))
        start += n
    return torch.cat(outs)


CASES = [(None, None), (1, None), (4, None), (7, None), (4, 0.7), (None, 0.7)]  # (window, softcap)


def _binds(q, k, v, window, softcap, scale=0.25):
    """The feature changes the reference on these inputs (else a test of it could not fail)."""
    plain = reference(q, k, v, LENGTHS, scale)
    return not torch.allclose(reference(q, k, v, LENGTHS, scale, window, softcap), plain, atol=1e-3)


@pytest.mark.parametrize("window, softcap", CASES)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 2), (6, 1)])
def test_sdpa_block_applies_the_window_and_softcap_with_grads(window, softcap, num_heads, num_kv_heads):
    q, k, v = (x.requires_grad_() for x in _qkv(num_heads, num_kv_heads, size=3.0))
    assert window is softcap is None or _binds(q.detach(), k.detach(), v.detach(), window, softcap)
    out = packed_attention(q, k, v, _cu(LENGTHS), max(LENGTHS), "sdpa_block", scale=0.25, window=window,
                           softcap=softcap)
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    ref = reference(q2, k2, v2, LENGTHS, 0.25, window, softcap)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grad = torch.randn_like(ref)
    for got, want in zip(torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(ref, (q2, k2, v2), grad)):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_a_window_at_least_as_long_as_every_sample_is_plain_causal_attention(monkeypatch):
    """sdpa_block then keeps SDPA's is_causal path (no mask), as before windows existed."""
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, attn_mask=None, is_causal=False, **kw: calls.append((attn_mask, is_causal))
                        or real(*a, attn_mask=attn_mask, is_causal=is_causal, **kw))
    q, k, v = _qkv(4, 2)
    out = packed_attention(q, k, v, _cu(LENGTHS), max(LENGTHS), "sdpa_block", window=max(LENGTHS))
    torch.testing.assert_close(out, reference(q, k, v, LENGTHS, 0.25))
    assert calls == [(None, True)] * len(LENGTHS)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window, softcap", CASES)
def test_flex_applies_the_window_and_softcap_forward_on_cpu(window, softcap):
    q, k, v = _qkv(4, 2, size=3.0)
    out = packed_attention(q, k, v, _cu(LENGTHS), max(LENGTHS), "flex", scale=0.25, window=window, softcap=softcap)
    torch.testing.assert_close(out, reference(q, k, v, LENGTHS, 0.25, window, softcap), atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("window", [1, 129, 300])
def test_flex_window_block_mask_matches_create_block_mask_over_many_blocks(window):
    """The windowed BlockMask built from the boundaries needs the same blocks as create_block_mask with the same
    mask, runs no masked block as full, and gives the reference's attention."""
    from torch.nn.attention.flex_attention import create_block_mask

    for lengths in [(20, 400, 130, 1, 200), (725,), (1,) * 5 + (300, 97)]:
        cu, num_tokens = _cu(lengths), sum(lengths)
        doc = flex.document_ids(cu, num_tokens)
        ref = create_block_mask(lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv) & (q - kv < window), None,
                                None, num_tokens, num_tokens, device="cpu")
        ours = flex.block_mask(cu, num_tokens, window)
        assert torch.equal(ours.to_dense(), ref.to_dense()), (window, lengths)
        full = torch.zeros_like(ours.to_dense())
        ref_full = torch.zeros_like(full)
        for dense, mask in ((full, ours), (ref_full, ref)):
            for i, (n, idx) in enumerate(zip(mask.full_kv_num_blocks[0, 0], mask.full_kv_indices[0, 0])):
                dense[0, 0, i, idx[:n].long()] = 1
        assert bool((full <= ref_full).all()), (window, lengths)
        gen = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(num_tokens, heads, 8, generator=gen) for heads in (2, 1, 1))
        out = packed_attention(q, k, v, cu, max(lengths), "flex", window=window)
        torch.testing.assert_close(out, reference(q, k, v, lengths, 8**-0.5, window), atol=1e-5, rtol=1e-5)


def test_flex_keeps_one_mask_per_window_of_a_pack():
    """Gemma's sliding and full layers alternate on one pack: each kind finds its own mask, built once."""
    flex._mask_cache.update(key=None, masks={})
    cu = _cu([300, 212])
    windowed, full = flex.block_mask(cu, 512, 64), flex.block_mask(cu, 512)
    assert flex.block_mask(cu, 512, 64) is windowed and flex.block_mask(cu, 512) is full and windowed is not full


# ------------------------------------------------------------------------------------ the GPU kernels' calls
def _flash_semantics(q_THD, k_TKD, v_TKD, cu, scale, causal, window_size, softcap):
    """STAND-IN computation: what FlashAttention documents for these arguments (per sample: a query at i sees keys
    i - left .. i + right, -1 meaning unbounded; causal caps right at 0; softcap > 0 caps the scaled scores)."""
    left, right = window_size
    if causal:
        right = 0
    groups = q_THD.shape[1] // k_TKD.shape[1]
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        q = q_THD[a:b].transpose(0, 1)
        k, v = (x[a:b].repeat_interleave(groups, dim=1).transpose(0, 1) for x in (k_TKD, v_TKD))
        scores = (q @ k.transpose(1, 2)) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        i, j = torch.arange(b - a)[:, None], torch.arange(b - a)[None, :]
        seen = ((j >= i - left) if left >= 0 else True) & ((j <= i + right) if right >= 0 else True)
        outs.append((scores.masked_fill(~seen, float("-inf")).softmax(-1) @ v).transpose(0, 1))
    return torch.cat(outs)


def fa2_stand_in(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                 softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                 deterministic=False, return_attn_probs=False, block_table=None):
    """STAND-IN with flash-attn 2.8's flash_attn_varlen_func signature."""
    assert dropout_p == 0.0 and torch.equal(cu_seqlens_q, cu_seqlens_k) and max_seqlen_q == max_seqlen_k
    return _flash_semantics(q, k, v, cu_seqlens_q, softmax_scale, causal, window_size, softcap)


def fa3_stand_in(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, seqused_q=None, seqused_k=None,
                 softmax_scale=None, causal=False, qv=None, q_descale=None, k_descale=None, v_descale=None,
                 window_size=(-1, -1), attention_chunk=0, softcap=0.0, num_splits=1, pack_gqa=None,
                 deterministic=False, sm_margin=0, return_attn_probs=False):
    """STAND-IN with FlashAttention-3's (hopper/flash_attn_interface.py) flash_attn_varlen_func signature."""
    return _flash_semantics(q, k, v, cu_seqlens_q, softmax_scale, causal, window_size, softcap)


def fa2_before_softcap(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                       softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
                       deterministic=False, return_attn_probs=False):
    """STAND-IN with flash-attn 2.5's signature (windows, no soft-cap)."""
    return _flash_semantics(q, k, v, cu_seqlens_q, softmax_scale, causal, window_size, 0.0)


def varlen_2_13_stand_in(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                         window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """STAND-IN with torch 2.13's varlen_attn signature; like torch, causal only when window_size == (-1, 0), and
    any other window is FlashAttention's local window (FA2 bundled, or FA4 once activated)."""
    assert enable_gqa == (key.shape[1] != query.shape[1])
    causal = tuple(window_size) == (-1, 0)
    return _flash_semantics(query, key, value, cu_seq_q, scale or query.shape[-1] ** -0.5, causal,
                            tuple(window_size), 0.0)


def varlen_2_10_stand_in(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, is_causal=False):
    """STAND-IN with torch 2.10's varlen_attn signature: causal or not, no window."""
    return _flash_semantics(query, key, value, cu_seq_q, query.shape[-1] ** -0.5, is_causal, (-1, -1), 0.0)


@pytest.fixture
def installed(monkeypatch):
    """Install a stand-in as the entry point of a backend ("flash_varlen", "fa3", "torch_varlen")."""
    def install(backend, fn):
        name = {"flash_varlen": "flash_attn_fn", "fa3": "fa3_fn", "torch_varlen": "torch_varlen_fn"}[backend]
        monkeypatch.setattr(kernels, name, lambda: fn)
        backends._torch_varlen_params.cache_clear()
    yield install
    backends._torch_varlen_params.cache_clear()


@pytest.mark.parametrize("backend, stand_in", [("flash_varlen", fa2_stand_in), ("fa3", fa3_stand_in),
                                               ("torch_varlen", varlen_2_13_stand_in)])
@pytest.mark.parametrize("window, softcap", CASES)
def test_each_gpu_kernel_is_given_hfs_window_and_softcap(backend, stand_in, window, softcap, installed):
    """HF's window W reaches FlashAttention as window_size=(W - 1, 0), the soft-cap as softcap (STAND-INS computing
    the kernels' documented semantics); torch's varlen_attn (torch_varlen, and fa4 behind it) takes no soft-cap."""
    installed(backend, stand_in)
    if softcap is not None and backend == "torch_varlen":
        assert feature_problem(backend, False, True) == "torch's varlen_attn has no attention logit soft-capping"
        return
    assert feature_problem(backend, window is not None, softcap is not None) is None
    q, k, v = _qkv(4, 2, size=3.0)
    assert window is softcap is None or _binds(q, k, v, window, softcap)
    out = backends._BACKEND_FNS[backend](q, k, v, _cu(LENGTHS), max(LENGTHS), 0.25,
                                         **{n: x for n, x in (("window", window), ("softcap", softcap)) if x})
    torch.testing.assert_close(out, reference(q, k, v, LENGTHS, 0.25, window, softcap), atol=1e-5, rtol=1e-5)


def test_kernels_whose_release_lacks_a_feature_say_so(installed):
    """A flash-attn before soft-capping (2.6), a torch before varlen_attn's window (2.11): the backend cannot apply
    the feature, which the probe then skips (and a named backend is refused); the others take both."""
    installed("flash_varlen", fa2_before_softcap)
    assert feature_problem("flash_varlen", True, False) is None
    assert feature_problem("flash_varlen", True, True) == "its flash_attn_varlen_func takes no softcap"
    installed("torch_varlen", varlen_2_10_stand_in)
    assert feature_problem("torch_varlen", True, False) == "this torch's varlen_attn takes no window (2.11+)"
    assert feature_problem("fa4", False, False) is None
    q, k, v = _qkv(4, 2)
    out = backends._torch_varlen(q, k, v, _cu(LENGTHS), max(LENGTHS), 16**-0.5)  # no window: is_causal
    torch.testing.assert_close(out, reference(q, k, v, LENGTHS, 16**-0.5), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="no window_size"):
        backends._torch_varlen(q, k, v, _cu(LENGTHS), max(LENGTHS), 0.25, window=4)
    for backend in ("flex", "sdpa_block"):
        assert feature_problem(backend, True, True) is None


def test_packed_attention_refuses_windows_and_caps_that_are_not_positive():
    q, k, v = _qkv(2, 2)
    for bad in ({"window": 0}, {"softcap": 0.0}, {"softcap": -1.0}):
        with pytest.raises(ValueError, match="sliding window must be >= 1 and a soft-cap > 0"):
            packed_attention(q, k, v, _cu(LENGTHS), max(LENGTHS), "sdpa_block", **bad)


# ---------------------------------------------------------------------------------------------------- GPU
def _skip_unless(backend, window, softcap):
    from hbp_train.model.attention_setup import available_backends

    if backend not in available_backends(torch.device("cuda"), torch.bfloat16):
        pytest.skip(f"{backend} is not available on this GPU machine")
    if feature_problem(backend, window is not None, softcap is not None):
        pytest.skip(f"{backend}: {feature_problem(backend, window is not None, softcap is not None)}")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", list(backends.BACKENDS))
@pytest.mark.parametrize("window, softcap", [(4, None), (7, 0.7), (None, 0.7), (200, None)])
def test_gpu_kernel_applies_the_window_and_softcap_with_grads(backend, window, softcap):
    _skip_unless(backend, window, softcap)
    from hbp_train.model.attention import set_backend

    cuda = torch.device("cuda")
    lengths = (5, 300, 3, 170)
    q, k, v = (x.requires_grad_() for x in _qkv(8, 2, dim=64, lengths=lengths, size=3.0, device=cuda,
                                                  dtype=torch.bfloat16))
    set_backend(backend)
    try:
        out = packed_attention(q, k, v, _cu(lengths, cuda), max(lengths), backend, scale=0.125, window=window,
                               softcap=softcap)
    finally:
        set_backend("sdpa_block")
    q32, k32, v32 = (x.detach().float().cpu().requires_grad_() for x in (q, k, v))
    ref = reference(q32, k32, v32, lengths, 0.125, window, softcap)
    torch.testing.assert_close(out.float().cpu(), ref, atol=3e-2, rtol=3e-2)
    grad = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (q, k, v), grad.to(cuda, torch.bfloat16))
    for got, want in zip(grads, torch.autograd.grad(ref, (q32, k32, v32), grad)):
        torch.testing.assert_close(got.float().cpu(), want, atol=6e-2, rtol=6e-2)
