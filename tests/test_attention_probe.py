"""The attention backend's probe and choice where a GPU run makes them: under a default device (a model built inside
`with torch.device(...)`, as build_run's init_device, the benches and the profiler do), with gradients checked as well
as outputs.

No GPU here: the device-context class runs under a meta default device. A tensor made on it has no data, so a probe
that makes its inputs on the default device and copies them to the target fails on the CPU exactly as it fails on a
GPU under `torch.device("cuda")` (there: a CPU generator for a CUDA tensor). The GPU kernels are stood in for by CPU
functions with the same call signature, right or wrong in a chosen way.
"""

from __future__ import annotations

import logging

import pytest
import torch

from hbp_train.model import attention, attention_setup
from hbp_train.model import attention_backends as backends
from hbp_train.model import attention_backends as backends
from hbp_train.model import attention_flex as flex
from hbp_train.model import attention_kernels as kernels
from hbp_train.model.attention_setup import HeadShape, probe_backend, select_backend

CPU = torch.device("cpu")
SHAPE = HeadShape(num_heads=4, num_kv_heads=2, head_dim=16, v_head_dim=16)


def _right_kernel(q, k, v, cu, max_seqlen, scale):
    return backends._sdpa_block(q, k, v, cu, max_seqlen, scale)


class _FirstOfGroup(torch.autograd.Function):
    """K/V heads repeated for their query group, whose backward keeps the gradient of the group's first query head
    only: the kv gradients are not summed over the group (a GQA bug a kernel's backward can have)."""

    @staticmethod
    def forward(ctx, x, groups):
        ctx.groups = groups
        return x.repeat_interleave(groups, dim=1)

    @staticmethod
    def backward(ctx, grad):
        return grad[:, ::ctx.groups].contiguous(), None


def _gqa_unsummed_kernel(q, k, v, cu, max_seqlen, scale):
    """The right forward, wrong dk/dv."""
    groups = q.shape[1] // k.shape[1]
    return backends._sdpa_block(q, _FirstOfGroup.apply(k, groups), _FirstOfGroup.apply(v, groups), cu, max_seqlen,
                                 scale)


@pytest.fixture
def offered(monkeypatch):
    """Offer "flex" on the CPU, run by a given stand-in (or by the real flex, which has no CPU backward)."""
    def offer(kernel=None):
        monkeypatch.setattr(attention_setup, "available_backends", lambda device, dtype=None: ["flex", "sdpa_block"])
        if kernel is not None:
            monkeypatch.setitem(backends._BACKEND_FNS, "flex", kernel)
    yield offer
    attention.set_backend("sdpa_block")


class TestUnderADeviceContext:
    """What build_model, select_backend and probe_backend do while a default device is set (the bug class of a
    probe that made its inputs before its `try`, on the default device)."""

    def test_the_probe_runs_on_its_target_device_whatever_the_default_device(self, offered):
        offered(_right_kernel)
        with torch.device("meta"):
            assert probe_backend("flex", CPU, torch.float32, SHAPE) is None
        assert attention.get_backend() == "sdpa_block"  # the backend chosen before the probe, restored

    def test_auto_falls_back_with_a_reason_under_a_device_context(self, offered, caplog):
        offered()  # the real flex: it runs forward on the CPU but has no backward there
        with caplog.at_level(logging.WARNING, logger="hbp_train.model.attention_setup"):
            with torch.device("meta"):
                assert select_backend("auto", CPU, torch.float32, SHAPE) == "sdpa_block"
        (line,) = [r.getMessage() for r in caplog.records]
        assert line.startswith("attention backend flex is installed but failed its check here") and "backward" in line

    def test_a_model_built_under_a_device_context_is_probed_for_the_device_it_trains_on(self, offered, capsys):
        """A model made on the meta device (weights to be loaded or materialised later) trains on the host here: the
        backend is probed and chosen for the host, under the meta default device, and the model is built."""
        from hbp_train.model.families import tiny_config
        from hbp_train.model.hf_model import ModelConfig, build_model

        offered(_right_kernel)
        with torch.device("meta"):
            model = build_model(ModelConfig(config=tiny_config("llama"), dtype="fp32"), vocab_size=256)
        assert next(model.parameters()).device.type == "meta"
        assert attention_setup.training_device(model) == CPU
        assert attention.get_backend() == "flex"  # probed on the host, passed, chosen
        assert "[model] attention: flex" in capsys.readouterr().out


def test_the_probe_refuses_a_kernel_whose_gradients_are_wrong(offered):
    """A kernel with the right output but dk/dv not summed over each query group would pass a forward-only probe
    and be chosen by auto; the probe compares q/k/v gradients with sdpa_block's too."""
    offered(_gqa_unsummed_kernel)
    why = probe_backend("flex", CPU, torch.float32, SHAPE)
    assert why is not None and why.startswith(("its k gradient differs from sdpa_block's", "its v gradient differs"))
    offered(_right_kernel)
    assert probe_backend("flex", CPU, torch.float32, SHAPE) is None
    mha = HeadShape(num_heads=4, num_kv_heads=4, head_dim=16, v_head_dim=16)
    offered(_gqa_unsummed_kernel)
    assert probe_backend("flex", CPU, torch.float32, mha) is None  # no group to sum over: this kernel is right there


def _fails_on_long_packs(q, k, v, cu, max_seqlen, scale):
    """Right on the probe's 128 tokens, raises on a longer pack (a per-shape compile that fails, a missing kernel)."""
    if q.shape[0] > 200:
        raise RuntimeError("no kernel for 300 tokens (stand-in)")
    return _right_kernel(q, k, v, cu, max_seqlen, scale)


def _pack_loss(model, lengths):
    ids = torch.cat([torch.arange(3, 3 + n) % 256 for n in lengths])[None]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    logits = model(input_ids=ids, position_ids=position_ids).logits
    loss = logits.float().logsumexp(-1).mean()
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_a_kernel_that_fails_on_the_first_real_pack_gives_way_instead_of_crashing(offered, caplog):
    """The probe runs 128 tokens: a kernel can still fail on the first real pack (FA4 compiles per shape; a backward
    this head shape and length lack). Each new largest pack is tried once, forward and backward on copies, before
    the real call: a failure switches auto's choice to the next backend that works, with one warning line, and the
    step goes on with the same result; a backend the user named is one error line instead."""
    from hbp_train.common.errors import UserError
    from hbp_train.model.families import tiny_config
    from hbp_train.model.hf_model import ModelConfig, build_model, set_checkpointed_layers

    offered(_fails_on_long_packs)
    cfg = dict(config=tiny_config("llama"), dtype="fp32", seed=1)
    model = build_model(ModelConfig(**cfg, attention_backend="auto"), vocab_size=256)
    set_checkpointed_layers(model, 1)  # the trial runs inside a checkpointed layer's forward too
    assert attention.get_backend() == "flex"  # it passed the probe
    with caplog.at_level(logging.WARNING, logger="hbp_train.model.attention"):
        loss, grads = _pack_loss(model, [180, 120])
    assert attention.get_backend() == "sdpa_block"
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("attention backend flex failed on the first pack of 300 tokens") and "sdpa_block" in line
    reference = build_model(ModelConfig(**cfg, attention_backend="sdpa_block"), vocab_size=256)
    ref_loss, ref_grads = _pack_loss(reference, [180, 120])
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad)
    offered(_fails_on_long_packs)
    named = build_model(ModelConfig(**cfg, attention_backend="flex"), vocab_size=256)
    with pytest.raises(UserError) as err:
        _pack_loss(named, [180, 120])
    assert str(err.value).startswith("model.attention_backend=flex fails on a pack of 300 tokens") and \
        "\n" not in str(err.value)


# ------------------------------------------------------------------------ the model's window and soft-cap
def _ignores_the_window(q, k, v, cu, max_seqlen, scale, window=None, softcap=None):
    return backends._sdpa_block(q, k, v, cu, max_seqlen, scale, softcap=softcap)


def _window_one_key_too_long(q, k, v, cu, max_seqlen, scale, window=None, softcap=None):
    """HF's window W taken as FlashAttention's left W (W + 1 keys): the off-by-one the conversion must avoid."""
    return backends._sdpa_block(q, k, v, cu, max_seqlen, scale, window=window + 1 if window else None,
                                softcap=softcap)


def _ignores_the_softcap(q, k, v, cu, max_seqlen, scale, window=None, softcap=None):
    return backends._sdpa_block(q, k, v, cu, max_seqlen, scale, window=window)


def _right_with_features(q, k, v, cu, max_seqlen, scale, window=None, softcap=None):
    return backends._sdpa_block(q, k, v, cu, max_seqlen, scale, window=window, softcap=softcap)


@pytest.mark.parametrize("kernel, shape, expected", [
    (_ignores_the_window, HeadShape(4, 2, 16, 16, window=4096), "its output with sliding window 4096 differs"),
    (_window_one_key_too_long, HeadShape(4, 2, 16, 16, window=256), "its output with sliding window 256 differs"),
    (_ignores_the_softcap, HeadShape(4, 2, 16, 16, softcap=50.0), "its output with soft-cap 50 differs"),
    (_ignores_the_softcap, HeadShape(4, 2, 16, 16, window=3, softcap=30.0),
     "its output with sliding window 3 and soft-cap 30 differs"),
])
def test_the_probe_checks_the_models_window_and_softcap(offered, kernel, shape, expected):
    """A kernel that drops the window, counts one key too many, or drops the soft-cap is refused, with a window far
    longer than the probe's samples too (it probes at a window that binds on them) and a cap of 50 (its queries are
    scaled so that the logits reach the cap); a kernel that applies both passes."""
    offered(kernel)
    why = probe_backend("flex", CPU, torch.float32, shape)
    assert why is not None and why.startswith(expected), why
    offered(_right_with_features)
    assert probe_backend("flex", CPU, torch.float32, shape) is None


def test_auto_skips_a_kernel_that_cannot_apply_a_feature_and_a_named_one_is_refused(offered, monkeypatch, caplog):
    """feature_problem (a kernel without soft-capping, say): auto goes on to the next backend with one warning line,
    without running it; the user's choice of it is one error line."""
    from hbp_train.common.errors import UserError

    offered(_right_with_features)
    monkeypatch.setattr(attention_setup, "feature_problem",
                        lambda name, window, softcap: "no soft-cap in this kernel" if softcap else None)
    shape = HeadShape(4, 2, 16, 16, window=64, softcap=50.0)
    with caplog.at_level(logging.WARNING, logger="hbp_train.model.attention_setup"):
        assert select_backend("auto", CPU, torch.float32, shape) == "sdpa_block"
    assert [r.getMessage() for r in caplog.records] == [
        "attention backend flex is installed but failed its check here (it cannot apply this model's sliding window "
        "64 and soft-cap 50: no soft-cap in this kernel); trying the next one"]
    with pytest.raises(UserError, match=r"^attention backend 'flex' is installed but fails on this model's attention "
                                        r"\(it cannot apply this model's sliding window 64 and soft-cap 50") as err:
        select_backend("flex", CPU, torch.float32, shape)
    assert "\n" not in str(err.value)
    assert select_backend("flex", CPU, torch.float32, HeadShape(4, 2, 16, 16, window=64)) == "flex"


def test_a_gemma2_model_is_probed_with_its_own_window_and_softcap(offered, caplog):
    """build_model on a tiny Gemma 2 (windowed layers, soft-capping): auto leaves a kernel that ignores the window
    for sdpa_block with one warning naming the window; the model's probe shape comes from its layers' calls."""
    from hbp_train.model.families import tiny_config
    from hbp_train.model.hf_model import ModelConfig, build_model

    config = tiny_config("llama") | {"head_dim": 16, "sliding_window": 6}
    assert HeadShape.of(build_model(ModelConfig(config=config, architecture="gemma2"), 256).config) == HeadShape(
        4, 2, 16, 16, window=6, softcap=50.0)
    offered(_ignores_the_window)
    with caplog.at_level(logging.WARNING, logger="hbp_train.model.attention_setup"):
        build_model(ModelConfig(config=config, architecture="gemma2"), vocab_size=256)
    assert attention.get_backend() == "sdpa_block"
    (line,) = [r.getMessage() for r in caplog.records]
    assert line.startswith("attention backend flex is installed but failed its check here (its output with sliding "
                           "window 6 and soft-cap 50 differs from sdpa_block"), line
