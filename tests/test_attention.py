"""Packed attention: every backend equals per-sample causal attention, on raw tensors and inside a tiny Llama."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

from hbp_train.model import attention, attention_setup
from hbp_train.model import attention_backends as backends
from hbp_train.model import attention_flex as flex
from hbp_train.model import attention_kernels as kernels
from hbp_train.model.attention import cu_seqlens_from_position_ids, get_backend, hf_packed_attention, packed_attention, set_backend
from hbp_train.model.attention_setup import available_backends, register_packed_attention, select_backend
from hbp_train.common.errors import UserError

LENGTHS = (5, 11, 8)
CPU = torch.device("cpu")


def _reference(q_THD, k_TKD, v_TKD, lengths, scale):
    """Plain-math causal attention run separately on each sample, kv heads repeated for their query group."""
    groups = q_THD.shape[1] // k_TKD.shape[1]
    outs, start = [], 0
    for length in lengths:
        q = q_THD[start : start + length].transpose(0, 1)
        k = k_TKD[start : start + length].repeat_interleave(groups, dim=1).transpose(0, 1)
        v = v_TKD[start : start + length].repeat_interleave(groups, dim=1).transpose(0, 1)
        scores = (q @ k.transpose(1, 2)) * scale
        future = torch.ones(length, length, dtype=torch.bool).triu(1)
        probs = scores.masked_fill(future, float("-inf")).softmax(-1)
        outs.append((probs @ v).transpose(0, 1))
        start += length
    return torch.cat(outs)


def _cu(lengths, device=CPU):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _qkv(num_heads, num_kv_heads, dim=16, device=CPU, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_tokens = sum(LENGTHS)
    make = lambda heads: torch.randn(num_tokens, heads, dim, generator=gen).to(device, dtype)  # noqa: E731
    return make(num_heads), make(num_kv_heads), make(num_kv_heads)


def test_sdpa_block_runs_one_causal_call_per_sample_and_builds_no_mask(monkeypatch):
    """No T x T mask (O(T^2), and SDPA's math kernel on GPUs with a mask): one is_causal call per sample."""
    calls = []
    real = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kwargs):
        calls.append((attn_mask, is_causal, q.shape[2]))
        return real(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kwargs)

    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", spy)
    q, k, v = _qkv(4, 2)
    packed_attention(q, k, v, _cu(LENGTHS), max(LENGTHS), "sdpa_block")
    assert calls == [(None, True, n) for n in LENGTHS]


# ------------------------------------------------------------------------------------------------ boundaries
@pytest.mark.parametrize(
    "position_ids, cu, max_len",
    [
        ([0, 1, 2, 0, 1, 0], [0, 3, 5, 6], 3),
        ([[0, 1, 2, 3]], [0, 4], 4),
        ([0, 0, 0], [0, 1, 2, 3], 1),  # e.g. SP padding tokens, one per "sample"
        ([3, 4, 5, 0, 1], [0, 3, 5], 3),  # a pack may start mid-sample (its first token still starts a sample)
        ([0, 1, 7, 8, 9], [0, 2, 5], 3),  # a jump that is not a reset to 0 also starts a sample
    ],
)
def test_cu_seqlens_from_position_ids(position_ids, cu, max_len):
    got_cu, got_max = cu_seqlens_from_position_ids(torch.tensor(position_ids))
    assert got_cu.dtype == torch.int32
    assert got_cu.tolist() == cu
    assert got_max == max_len


def test_cu_seqlens_rejects_batched_position_ids():
    with pytest.raises(ValueError, match="batch size 1"):
        cu_seqlens_from_position_ids(torch.zeros(2, 4, dtype=torch.long))


# ------------------------------------------------------------------------------------------------ selection
def test_cpu_backends_and_auto():
    assert available_backends(CPU) == ["sdpa_block"]
    assert select_backend("auto", CPU) == "sdpa_block"
    assert select_backend("sdpa_block", CPU) == "sdpa_block"


@pytest.mark.parametrize("name, why", [("flex", "not available on cpu"), ("flash", "unknown")])
def test_select_backend_errors_name_the_backend_and_the_choices(name, why):
    with pytest.raises(UserError) as err:
        select_backend(name, CPU)
    assert repr(name) in str(err.value) and why in str(err.value) and "sdpa_block" in str(err.value)


def test_gpu_preference_order_and_fp32_leaves_out_flash_kernels(monkeypatch):
    """Availability on a CUDA device is decided without touching the GPU, so it is checked here too."""
    cuda = torch.device("cuda")
    monkeypatch.setattr(kernels, "has_flash_attn", lambda: True)
    monkeypatch.setattr(kernels, "torch_varlen_fn", lambda: object())
    assert available_backends(cuda) == ["flash_varlen", "torch_varlen", "flex", "sdpa_block"]
    assert available_backends(cuda, torch.bfloat16) == ["flash_varlen", "torch_varlen", "flex", "sdpa_block"]
    assert available_backends(cuda, torch.float32) == ["flex", "sdpa_block"]
    assert select_backend("auto", cuda, torch.float32) == "flex"
    with pytest.raises(UserError, match="'torch_varlen' is not available on cuda with torch.float32"):
        select_backend("torch_varlen", cuda, torch.float32)


def test_a_flash_attn_that_raises_at_import_falls_back_with_one_warning(tmp_path, monkeypatch, caplog):
    """A broken flash-attn build (ABI mismatch: it is found, but importing it raises) is not a backend."""
    package = tmp_path / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text(
        "raise ImportError('flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDeviceEi')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    monkeypatch.setattr(kernels, "torch_varlen_fn", lambda: object())
    kernels.flash_attn_fn.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="hbp_train.model.attention_kernels"):
            assert available_backends(torch.device("cuda"), torch.bfloat16) == ["torch_varlen", "flex", "sdpa_block"]
            assert select_backend("auto", torch.device("cuda"), torch.bfloat16) == "torch_varlen"
    finally:
        kernels.flash_attn_fn.cache_clear()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "undefined symbol" in warnings[0] and "does not import" in warnings[0]


def _all_kernels_installed(monkeypatch, major: int):
    """Every kernel importable and a GPU of compute capability ``major``, without touching a GPU."""
    monkeypatch.setattr(kernels, "fa3_fn", lambda: object())
    monkeypatch.setattr(kernels, "fa4_registered", lambda: True)
    monkeypatch.setattr(kernels, "has_flash_attn", lambda: True)
    monkeypatch.setattr(kernels, "torch_varlen_fn", lambda: object())
    monkeypatch.setattr(attention_setup, "_capability_major", lambda device: major)


@pytest.mark.parametrize("major, expected", [
    (9, ["fa3", "fa4", "flash_varlen", "torch_varlen", "flex", "sdpa_block"]),  # Hopper: FA3 and FA4
    (10, ["fa4", "flash_varlen", "torch_varlen", "flex", "sdpa_block"]),  # Blackwell: FA4 only (FA3 is Hopper's)
    (8, ["flash_varlen", "torch_varlen", "flex", "sdpa_block"]),  # Ampere: neither
])
def test_fa3_and_fa4_are_offered_by_capability_and_first(monkeypatch, major, expected):
    _all_kernels_installed(monkeypatch, major)
    cuda = torch.device("cuda")
    assert available_backends(cuda, torch.bfloat16) == expected
    assert select_backend("auto", cuda, torch.bfloat16) == expected[0]  # no shape: nothing probed
    assert available_backends(cuda, torch.float32) == ["flex", "sdpa_block"]  # fp32: no flash kernel at all


def test_kernels_missing_leave_the_next_backend(monkeypatch):
    _all_kernels_installed(monkeypatch, 9)
    monkeypatch.setattr(kernels, "fa3_fn", lambda: None)  # FA3 not installed
    monkeypatch.setattr(kernels, "fa4_registered", lambda: False)  # no FA4 (or a torch without the registry)
    assert available_backends(torch.device("cuda"), torch.bfloat16)[0] == "flash_varlen"


def test_fa4_needs_torch_registry_and_the_fa4_kernels(monkeypatch, tmp_path):
    """FA4 is offered only when torch lists it in its flash registry and flash_attn.cute.interface imports."""
    monkeypatch.setattr(kernels, "torch_varlen_fn", lambda: object())
    kernels.fa4_registered.cache_clear()
    try:
        monkeypatch.setattr(kernels, "_flash_impl_registry", None)  # a torch before the registry
        assert kernels.fa4_registered() is False
        kernels.fa4_registered.cache_clear()
        monkeypatch.undo()
        monkeypatch.setattr(kernels, "torch_varlen_fn", lambda: object())
        # the registry is there (torch >= 2.10 lists FA4), the kernels are not installed on this machine
        assert "FA4" in kernels._flash_impl_registry.list_flash_attention_impls()
        monkeypatch.setattr(kernels, "import_kernel", lambda module, attr, what: object())
        assert kernels.fa4_registered() is True
    finally:
        kernels.fa4_registered.cache_clear()


def test_auto_skips_a_kernel_that_fails_its_probe_and_a_requested_one_is_a_user_error(monkeypatch, caplog):
    _all_kernels_installed(monkeypatch, 9)
    verdicts = {"fa3": "RuntimeError: head dim 24 not supported", "fa4": None}
    probed = []

    def fake_probe(name, device, dtype, shape):
        probed.append(name)
        return verdicts.get(name)

    monkeypatch.setattr(attention_setup, "probe_backend", fake_probe)
    cuda, shape = torch.device("cuda"), attention_setup.HeadShape(4, 2, 24, 16)
    with caplog.at_level(logging.WARNING, logger="hbp_train.model.attention_kernels"):
        assert select_backend("auto", cuda, torch.bfloat16, shape) == "fa4"
    assert probed == ["fa3", "fa4"]
    assert [r.getMessage() for r in caplog.records] == [
        "attention backend fa3 is installed but failed its check here (RuntimeError: head dim 24 not supported); "
        "trying the next one"]
    with pytest.raises(UserError, match="'fa3' is installed but fails on this model's attention \\(RuntimeError"):
        select_backend("fa3", cuda, torch.bfloat16, shape)
    assert select_backend("sdpa_block", cuda, torch.bfloat16, shape) == "sdpa_block"  # exact: never probed
    assert probed == ["fa3", "fa4", "fa3"]


def test_probe_accepts_a_right_kernel_and_names_what_is_wrong_with_others(monkeypatch):
    """The probe itself, on the CPU with stand-in kernels: a correct one passes; one that attends across the
    sample boundary, or one that has no backward (FlexAttention on the CPU, really), is refused with the reason."""
    shape = attention_setup.HeadShape(num_heads=4, num_kv_heads=2, head_dim=16, v_head_dim=16)

    def across_samples(q, k, v, cu, max_seqlen, scale):  # plain causal attention over the whole pack
        return backends._sdpa_block(q, k, v, torch.tensor([0, q.shape[0]], dtype=torch.int32), q.shape[0], scale)

    monkeypatch.setitem(backends._BACKEND_FNS, "flex", backends._sdpa_block)
    assert attention_setup.probe_backend("flex", CPU, torch.float32, shape) is None
    monkeypatch.setitem(backends._BACKEND_FNS, "flex", across_samples)
    assert "differs from sdpa_block" in attention_setup.probe_backend("flex", CPU, torch.float32, shape)
    monkeypatch.undo()
    assert "does not support backward" in attention_setup.probe_backend("flex", CPU, torch.float32, shape)  # on the CPU
    assert get_backend() == "sdpa_block"  # the probe leaves the chosen backend as it was


def test_fa4_is_activated_in_torch_only_while_chosen(monkeypatch):
    """fa4 switches torch's flash kernels to FlashAttention-4 through torch's own registry; any other backend
    restores torch's, so torch_varlen then runs the bundled FA2 again."""
    from torch.nn.attention import _registry

    events = []

    class Handle:
        def remove(self):
            events.append("removed")

    def register():
        events.append("activated")
        return Handle()

    monkeypatch.setitem(_registry._FLASH_ATTENTION_IMPLS, "FA4", register)
    try:
        set_backend("fa4")
        assert _registry._FLASH_ATTENTION_ACTIVE[0] == "FA4" and events == ["activated"]
        set_backend("fa4")  # already active: not registered twice
        assert events == ["activated"]
        set_backend("torch_varlen")
        assert _registry._FLASH_ATTENTION_ACTIVE is None and events == ["activated", "removed"]
    finally:
        set_backend("sdpa_block")


def test_head_shape_of_gqa_explicit_head_dim_and_mla():
    from transformers import AutoConfig

    from hbp_train.model.families import tiny_config

    llama = AutoConfig.for_model("llama", **tiny_config("llama"))
    assert attention_setup.HeadShape.of(llama) == attention_setup.HeadShape(4, 2, 16, 16)
    qwen3 = AutoConfig.for_model("qwen3", **tiny_config("qwen3", head_dim=32))
    assert attention_setup.HeadShape.of(qwen3) == attention_setup.HeadShape(4, 2, 32, 32)
    mla = AutoConfig.for_model("deepseek_v3", **tiny_config("deepseek_v3"))
    assert attention_setup.HeadShape.of(mla) == attention_setup.HeadShape(4, 4, 24, 16)


def test_describe_backend_names_the_kernel_library_and_device(monkeypatch):
    assert attention_setup.describe_backend("sdpa_block", CPU) == (
        f"sdpa_block (torch {torch.__version__} scaled_dot_product_attention per sample) on CPU")
    monkeypatch.setattr(attention_setup, "_distribution_version", lambda *names: "3.0.0" if "flash_attn_3" in names else None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    assert attention_setup.describe_backend("fa3", torch.device("cuda", 0)) == (
        "fa3 (flash_attn_interface 3.0.0) on NVIDIA H100 80GB HBM3")
    assert attention_setup.describe_backend("fa4", torch.device("cuda", 0)).startswith(
        "fa4 (flash-attn-4 (version unknown) through torch")


@pytest.mark.filterwarnings("ignore")
def test_flex_compiles_at_most_twice_for_many_pack_layouts():
    """Dynamic shapes: five packs of different lengths and boundaries reuse one or two graphs (dynamo with the eager
    backend on the CPU; the GPU uses inductor with the same options), never one graph per pack."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    flex.compiled_flex.cache_clear()
    fn = flex.compiled_flex("eager")
    try:
        for lengths in ([100, 156], [200, 184], [128, 128, 256], [600, 40], [768], [300, 300, 100, 68]):
            num_tokens = sum(lengths)
            q, k, v = torch.randn(1, 4, num_tokens, 16), torch.randn(1, 2, num_tokens, 16), torch.randn(1, 2, num_tokens, 16)
            fn(q, k, v, block_mask=flex.block_mask(_cu(lengths), num_tokens), enable_gqa=True)
    finally:
        flex.compiled_flex.cache_clear()
        torch._dynamo.reset()
    assert 1 <= counters["stats"]["unique_graphs"] <= 2


def test_auto_never_picks_flex_for_training_on_the_cpu():
    """flex's backward is not implemented on the CPU: neither auto nor an explicit choice gets it there."""
    for dtype in (None, torch.float32, torch.bfloat16):
        assert "flex" not in available_backends(CPU, dtype) and select_backend("auto", CPU, dtype) == "sdpa_block"


@pytest.mark.parametrize("version", ["2.11", "2.12"])
def test_torch_varlen_hands_the_kernel_k_heads_never_repeated_ones(monkeypatch, version):
    """GQA: K/V reach varlen_attn with their K heads (the flash kernel takes K dividing H), not repeated to H, which
    would keep H/K times the KV activations for backward. A fake varlen_attn with each version's signature records
    what it got and computes the exact result on the CPU."""
    seen = []

    def reference(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        seen.append((k.shape[1], v.shape[1]))
        assert k.shape[1] == v.shape[1] and q.shape[1] % k.shape[1] == 0
        return backends._sdpa_block(q, k, v, cu_q, max_q, scale)

    if version == "2.11":
        def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1)):
            return reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale)
    else:
        def fake(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                 enable_gqa=False):
            assert enable_gqa == (key.shape[1] != query.shape[1])  # torch's cuDNN path refuses it for MHA
            return reference(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale)

    monkeypatch.setattr(kernels, "torch_varlen_fn", lambda: fake)
    backends._torch_varlen_params.cache_clear()
    try:
        for heads, kv_heads in ((4, 2), (6, 1), (4, 4)):
            q, k, v = _qkv(heads, kv_heads)
            out = backends._torch_varlen(q, k, v, _cu(LENGTHS), max(LENGTHS), 0.3)
            torch.testing.assert_close(out, _reference(q, k, v, LENGTHS, 0.3), atol=1e-5, rtol=1e-5)
    finally:
        backends._torch_varlen_params.cache_clear()
    assert seen == [(2, 2), (1, 1), (4, 4)]


def test_set_backend_rejects_unknown_names():
    with pytest.raises(ValueError, match="'nope'"):
        set_backend("nope")


# ------------------------------------------------------------------------------------------- raw attention
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (6, 1)])
def test_sdpa_block_matches_per_sample_reference_with_grads(num_heads, num_kv_heads):
    q, k, v = (x.requires_grad_() for x in _qkv(num_heads, num_kv_heads))
    scale = 0.3
    out = packed_attention(q, k, v, _cu(LENGTHS), max(LENGTHS), "sdpa_block", scale=scale)
    ref = _reference(q, k, v, LENGTHS, scale)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    grad_out = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    ref_grads = torch.autograd.grad(ref, (q, k, v), grad_out)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_mask_matches_reference_on_cpu_forward():
    """FlexAttention has no CPU backward; its eager forward still checks the document BlockMask here."""
    q, k, v = _qkv(4, 2)
    out = packed_attention(q, k, v, _cu(LENGTHS), max(LENGTHS), "flex")
    torch.testing.assert_close(out, _reference(q, k, v, LENGTHS, 16**-0.5), atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_block_mask_from_boundaries_matches_create_block_mask_over_many_blocks():
    """The BlockMask is built from the sample boundaries (no T x T mask: 16 GiB at 128K); over packs of several
    128-token blocks, with samples inside, across and exactly on block edges and a last partial block, it needs
    the same blocks as create_block_mask, runs no masked block as full, and attention equals the reference."""
    from torch.nn.attention.flex_attention import create_block_mask

    from hbp_train.model.attention_flex import block_mask as _flex_block_mask, document_ids as _document_ids

    for lengths in [(20, 400, 130, 1, 200), (128, 128, 256, 3), (725,), (1,) * 5 + (300, 97)]:
        cu, num_tokens = _cu(lengths), sum(lengths)
        doc = _document_ids(cu, num_tokens)
        ref = create_block_mask(lambda b, h, q, kv: (doc[q] == doc[kv]) & (q >= kv), None, None, num_tokens,
                                num_tokens, device="cpu")
        ours = _flex_block_mask(cu, num_tokens)
        assert torch.equal(ours.to_dense(), ref.to_dense()), lengths  # the same blocks are computed
        ours_full = torch.zeros_like(ours.to_dense())
        for i, (n, idx) in enumerate(zip(ours.full_kv_num_blocks[0, 0], ours.full_kv_indices[0, 0])):
            ours_full[0, 0, i, idx[:n].long()] = 1
        ref_full = torch.zeros_like(ours_full)
        for i, (n, idx) in enumerate(zip(ref.full_kv_num_blocks[0, 0], ref.full_kv_indices[0, 0])):
            ref_full[0, 0, i, idx[:n].long()] = 1
        assert bool((ours_full <= ref_full).all()), lengths  # full only where no element is masked
        gen = torch.Generator().manual_seed(1)
        q, k, v = (torch.randn(num_tokens, heads, 8, generator=gen) for heads in (4, 2, 2))
        out = packed_attention(q, k, v, cu, max(lengths), "flex")
        torch.testing.assert_close(out, _reference(q, k, v, lengths, 8**-0.5), atol=1e-5, rtol=1e-5)


def test_gpu_only_backends_refuse_cpu_tensors():
    q, k, v = _qkv(4, 2)
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        packed_attention(q, k, v, _cu(LENGTHS), max(LENGTHS), "torch_varlen")


def _fake_varlen(release):
    """A CPU stand-in for torch.nn.attention.varlen.varlen_attn with the keyword signature of a torch release; it
    checks what _torch_varlen hands over, then computes per-sample attention the way the kernel would."""
    def kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, causal, scale, gqa):
        assert causal, "the kernel was not asked for causal attention"
        assert cu_seq_q.dtype == torch.int32 and isinstance(max_q, int) and max_q == max_k
        # K/V keep their K heads in every release (the flash kernel takes K dividing H; defect 6 of issue 19)
        assert key.shape[1] == value.shape[1] == 2 and query.shape[1] % key.shape[1] == 0, "kv heads were repeated"
        assert gqa == (release in ("2.12", "2.13")), "enable_gqa is passed exactly where the signature has it (GQA)"
        lengths = (cu_seq_q[1:] - cu_seq_q[:-1]).tolist()
        return _reference(query, key, value, lengths, query.shape[-1] ** -0.5 if scale is None else scale)

    if release == "2.10":
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, is_causal=False):
            return kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal, None, False)
    elif release == "2.11":
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1)):
            # torch 2.11 derives causality as `window_size == (-1, 0)`: a list would silently mean non-causal
            return kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size == (-1, 0), scale, False)
    else:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1), enable_gqa=False):
            return kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, window_size == (-1, 0), scale,
                          enable_gqa)
    return varlen_attn


@pytest.mark.parametrize("release", ["2.10", "2.11", "2.12", "2.13"])
def test_torch_varlen_call_matches_each_release_signature(release, monkeypatch):
    """The GPU-only torch_varlen backend's call, checked on the CPU against each release's keyword signature."""
    monkeypatch.setattr(kernels, "torch_varlen_fn", lambda: _fake_varlen(release))
    backends._torch_varlen_params.cache_clear()
    try:
        q, k, v = _qkv(8, 2)
        for scale in (None, 0.3):
            out = backends._torch_varlen(q, k, v, _cu(LENGTHS), max(LENGTHS), 16**-0.5 if scale is None else scale)
            ref = _reference(q, k, v, LENGTHS, 16**-0.5 if scale is None else scale)
            torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    finally:
        backends._torch_varlen_params.cache_clear()


# ---------------------------------------------------------------------------------------------- tiny Llama
def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=4096, use_cache=False,
    )
    return LlamaForCausalLM(config).eval()


def _packed_vs_per_sample(model, backend, device, boundaries_from, monkeypatch=None):
    gen = torch.Generator().manual_seed(1)
    samples = [torch.randint(0, 4096, (n,), generator=gen).to(device) for n in LENGTHS]
    input_ids = torch.cat(samples)[None]
    position_ids = torch.cat([torch.arange(n, device=device) for n in LENGTHS])[None]
    kwargs = {}
    if boundaries_from == "cu_seq_lens":
        # the boundaries must come from cu_seq_lens_q alone: deriving them from position_ids now fails
        monkeypatch.setattr(attention, "cu_seqlens_from_position_ids", _fail)
        kwargs = {"cu_seq_lens_q": _cu(LENGTHS, device), "max_length_q": max(LENGTHS)}
    chosen = register_packed_attention(model, backend, device=device)
    assert chosen == get_backend() == (select_backend(backend, device))
    assert model.config._attn_implementation == "hbp_packed"
    with torch.no_grad():
        packed = model(input_ids=input_ids, position_ids=position_ids, **kwargs).logits[0]
        model.set_attn_implementation("sdpa")
        per_sample = torch.cat([model(input_ids=s[None]).logits[0] for s in samples])
    return packed, per_sample


def _fail(*args):
    raise AssertionError("boundaries were derived from position_ids")


@pytest.mark.parametrize("boundaries_from", ["position_ids", "cu_seq_lens"])
def test_tiny_llama_packed_logits_equal_per_sample_logits(boundaries_from, monkeypatch):
    packed, per_sample = _packed_vs_per_sample(_tiny_llama(), "sdpa_block", CPU, boundaries_from, monkeypatch)
    torch.testing.assert_close(packed, per_sample, atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_tiny_llama_flex_forward_on_cpu(monkeypatch):
    monkeypatch.setattr(attention_setup, "available_backends", lambda device, dtype=None: ["flex", "sdpa_block"])
    # flex has no backward on the CPU, so its probe refuses it for training there: this checks its forward only
    monkeypatch.setattr(attention_setup, "probe_backend", lambda *args: None)
    packed, per_sample = _packed_vs_per_sample(_tiny_llama(), "flex", CPU, "position_ids")
    torch.testing.assert_close(packed, per_sample, atol=1e-5, rtol=1e-5)


def test_hf_packed_attention_rejects_batches_missing_boundaries():
    q = torch.zeros(2, 4, 6, 8)
    with pytest.raises(ValueError, match="batch size 1"):
        hf_packed_attention(None, q, q, q, None, position_ids=torch.zeros(2, 6, dtype=torch.long))
    with pytest.raises(ValueError, match="position_ids"):
        hf_packed_attention(None, q[:1], q[:1], q[:1], None)


def test_boundaries_follow_an_in_place_refill_of_the_same_position_ids_tensor():
    # The boundary cache is keyed by the tensor and its version: a reused buffer refilled in place (a loader that
    # recycles its input tensors) must not keep the previous pack's boundaries.
    attention.set_backend("sdpa_block")
    q, k, v = (t.transpose(0, 1)[None] for t in _qkv(2, 2, dim=4))
    position_ids = torch.arange(q.shape[2])[None]
    hf_packed_attention(None, q, k, v, None, position_ids=position_ids)
    lengths = [3, q.shape[2] - 3]
    position_ids.copy_(torch.cat([torch.arange(n) for n in lengths])[None])
    out, _ = hf_packed_attention(None, q, k, v, None, position_ids=position_ids)
    expected = packed_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), _cu(lengths),
                                max(lengths), "sdpa_block")
    torch.testing.assert_close(out[0], expected)


# ----------------------------------------------------------------------------------------------------- GPU
GPU_BACKENDS = list(attention.BACKENDS)  # fa3, fa4, FA2, ...: each one this GPU has


def _skip_unless_on_gpu(backend):
    if backend not in available_backends(torch.device("cuda")):
        pytest.skip(f"{backend} is not available on this GPU machine")


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (8, 2)])
def test_gpu_backend_matches_reference_with_grads(backend, num_heads, num_kv_heads):
    _skip_unless_on_gpu(backend)
    cuda = torch.device("cuda")
    q, k, v = (x.requires_grad_() for x in _qkv(num_heads, num_kv_heads, dim=64, device=cuda, dtype=torch.bfloat16))
    out = packed_attention(q, k, v, _cu(LENGTHS, cuda), max(LENGTHS), backend)
    q32, k32, v32 = (x.detach().float().cpu().requires_grad_() for x in (q, k, v))
    ref = _reference(q32, k32, v32, LENGTHS, 64**-0.5)
    torch.testing.assert_close(out.float().cpu(), ref, atol=2e-2, rtol=2e-2)
    grad_out = torch.randn_like(ref)
    grads = torch.autograd.grad(out, (q, k, v), grad_out.to(cuda, torch.bfloat16))
    ref_grads = torch.autograd.grad(ref, (q32, k32, v32), grad_out)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got.float().cpu(), want, atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_gpu_tiny_llama_packed_logits_equal_per_sample_logits(backend):
    _skip_unless_on_gpu(backend)
    cuda = torch.device("cuda")
    model = _tiny_llama().to(cuda, torch.bfloat16)
    packed, per_sample = _packed_vs_per_sample(model, backend, cuda, "position_ids")
    torch.testing.assert_close(packed.float(), per_sample.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
def test_gpu_auto_picks_the_first_installed_kernel_that_passes_its_probe():
    """On this GPU, with the Llama-3.2-1B attention shape: auto's choice is the first available backend whose probe
    passes, and a fa4 choice leaves FA4 active in torch only while it is the backend."""
    cuda, shape = torch.device("cuda"), attention_setup.HeadShape(32, 8, 64, 64)
    available = available_backends(cuda, torch.bfloat16)
    first_ok = next(b for b in available if attention_setup.probe_backend(b, cuda, torch.bfloat16, shape) is None)
    assert select_backend("auto", cuda, torch.bfloat16, shape) == first_ok
    if "fa4" in available:
        from torch.nn.attention import current_flash_attention_impl

        set_backend("fa4")
        assert current_flash_attention_impl() == "FA4"
        set_backend("torch_varlen")
        assert current_flash_attention_impl() is None
    set_backend("sdpa_block")


def test_flex_reads_a_packs_boundaries_once_not_in_every_layer(monkeypatch):
    """flex's BlockMask is cached per pack: the layers after the first find it by the boundaries tensor itself (and
    its version, for a buffer refilled in place), without reading the boundaries back to the host, which on a GPU is
    a device sync in every layer."""
    reads = []
    real_tolist = torch.Tensor.tolist
    monkeypatch.setattr(torch.Tensor, "tolist", lambda self: reads.append(1) or real_tolist(self))
    flex._mask_cache.update(key=None, masks={})
    cu = _cu([100, 156])
    first = flex.block_mask(cu, 256)
    built = len(reads)  # the first layer reads the boundaries (building the mask may too)
    for _ in range(15):  # the other layers of the forward, and its recompute
        assert flex.block_mask(cu, 256) is first
    assert len(reads) == built
    cu[1] = 128  # the same buffer refilled for the next pack
    refilled = flex.block_mask(cu, 256)
    assert refilled is not first and len(reads) > built
    assert flex.block_mask(_cu([128, 128]), 256) is refilled  # equal boundaries in a new tensor: reused


def test_torch_varlen_call_binds_to_the_installed_torchs_own_signature(monkeypatch):
    """The call torch_varlen makes, bound to the signature of the varlen_attn installed here (no CPU kernel, so the
    stand-in computes the result): every keyword is one it has, with the value it expects (causal window, GQA flag,
    scale), for GQA and for MHA."""
    import inspect

    from torch.nn.attention.varlen import varlen_attn

    signature = inspect.signature(varlen_attn)
    bound = []

    def installed(*args, **kwargs):
        call = signature.bind(*args, **kwargs)
        bound.append(call.arguments)
        q, k, v, cu_q, cu_k, max_q, max_k = args
        window = call.arguments.get("window_size", (-1, -1))
        assert call.arguments.get("is_causal", False) or tuple(window) == (-1, 0), "not asked for causal attention"
        return _reference(q, k, v, (cu_q[1:] - cu_q[:-1]).tolist(), call.arguments.get("scale") or q.shape[-1] ** -0.5)

    installed.__signature__ = signature  # what _torch_varlen reads its keywords from
    monkeypatch.setattr(kernels, "torch_varlen_fn", lambda: installed)
    backends._torch_varlen_params.cache_clear()
    try:
        for heads, kv_heads in ((8, 2), (4, 4)):
            q, k, v = _qkv(heads, kv_heads)
            out = backends._torch_varlen(q, k, v, _cu(LENGTHS), max(LENGTHS), 0.3)
            torch.testing.assert_close(out, _reference(q, k, v, LENGTHS, 0.3), atol=1e-5, rtol=1e-5)
    finally:
        backends._torch_varlen_params.cache_clear()
    if "enable_gqa" in signature.parameters:
        assert [b.get("enable_gqa", False) for b in bound] == [True, False]


@pytest.mark.parametrize("owners, offered", [(["flash-attn-4"], False), (["flash-attn", "flash-attn-4"], True)])
def test_flash_attn_2_is_told_apart_from_flash_attn_4_in_the_same_folder(owners, offered, tmp_path, monkeypatch,
                                                                        caplog):
    """flash-attn (FA2) and flash-attn-4 both install into flash_attn/: with only FA4 installed, flash_varlen is not
    offered and no "flash-attn does not import" warning is given (FA4 runs as the fa4 backend); with both, FA2 is."""
    import importlib.metadata

    package = tmp_path / "flash_attn"
    (package / "cute").mkdir(parents=True)
    (package / "cute" / "interface.py").write_text("def _flash_attn_bwd(): pass\n")
    if "flash-attn" in owners:
        (package / "__init__.py").write_text("def flash_attn_varlen_func(*args, **kwargs): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("flash_attn", "flash_attn.cute", "flash_attn.cute.interface"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setattr(importlib.metadata, "packages_distributions", lambda: {"flash_attn": owners})
    kernels.flash_attn_fn.cache_clear()
    try:
        with caplog.at_level(logging.WARNING, logger="hbp_train.model.attention_kernels"):
            assert kernels.has_flash_attn() is offered
    finally:
        kernels.flash_attn_fn.cache_clear()
    assert not caplog.records


# ------------------------------------------------------------------------- what a layer hands the attention
def test_hf_packed_attention_applies_the_layers_window_and_softcap():
    """The layer's sliding_window and softcap keywords reach the backend (a window no sample exceeds is dropped)."""
    attention.set_backend("sdpa_block")
    lengths = [9, 4]
    q, k, v = (t.transpose(0, 1)[None] * 3 for t in _qkv(4, 2, dim=8))
    q, k, v = (t[:, :, :sum(lengths)] for t in (q, k, v))
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    flat = [t[0].transpose(0, 1) for t in (q, k, v)]
    for window, softcap in ((3, None), (None, 0.5), (3, 0.5), (9, None)):
        out, _ = hf_packed_attention(None, q, k, v, None, scaling=0.3, position_ids=position_ids,
                                     sliding_window=window, softcap=softcap, use_cache=False)
        expected = packed_attention(*flat, _cu(lengths), max(lengths), "sdpa_block", scale=0.3,
                                    window=window if window and window < max(lengths) else None, softcap=softcap)
        torch.testing.assert_close(out[0], expected)
        plain = packed_attention(*flat, _cu(lengths), max(lengths), "sdpa_block", scale=0.3)
        assert (window == 9) == torch.allclose(out[0], plain)  # each feature binds here, but a window of 9


@pytest.mark.parametrize("kwargs, expected", [
    ({"s_aux": torch.zeros(4)}, r"asks its attention for attention sinks \(s_aux"),
    ({"is_causal": False}, r"asks its attention for is_causal=False \(bidirectional attention\)"),
    ({"attention_chunk": 8}, r"asks its attention for a 'attention_chunk' argument"),
])
def test_what_the_packed_attention_does_not_do_is_refused_in_one_line(kwargs, expected):
    q = torch.zeros(1, 4, 6, 8)
    with pytest.raises(UserError, match=expected) as err:
        hf_packed_attention(torch.nn.Linear(1, 1), q, q, q, None, position_ids=torch.arange(6)[None], **kwargs)
    assert str(err.value).startswith("Linear asks its attention") and "\n" not in str(err.value)
    with pytest.raises(UserError, match="hands its attention its own mask"):
        hf_packed_attention(None, q, q, q, torch.zeros(1, 1, 6, 6), position_ids=torch.arange(6)[None])
    out, _ = hf_packed_attention(None, q, q, q, None, position_ids=torch.arange(6)[None], s_aux=None,
                                 is_causal=True, use_cache=False, output_attentions=False)
    assert out.shape == (1, 6, 4, 8)
