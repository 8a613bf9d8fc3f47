"""hbp_train/model/kernels.py (model.kernels): which decoder kernels a run gets, how Liger is applied to a model instance
(with a stand-in for Liger, whose Triton kernels need CUDA), Liger's kernels probed before use (model/liger_probe.py:
a stand-in that fails, and the real Liger through Triton's interpreter on the CPU where it is installed), and that
compiled decoder layers give the eager layers' loss and gradients on the CPU with the real inductor."""

from __future__ import annotations

import copy
import types

import pytest
import torch

from hbp_train.model import kernels
from hbp_train.common.errors import UserError
from hbp_train.model.families import tiny_config
from hbp_train.common.labels import IGNORE_INDEX
from hbp_train.model.hf_model import ModelConfig, build_model, decoder_layers, forward_hidden, set_checkpointed_layers

CPU, CUDA = torch.device("cpu"), torch.device("cuda")


@pytest.fixture
def liger_installed(monkeypatch):
    """A stand-in for liger_kernel.transformers that does to transformers' modules what Liger's apply functions do
    (swap the family's RoPE function and its RMSNorm class, patch the instance) and records its arguments; its
    "kernels" compute what HF's modules do, so they pass the probe (model/liger_probe.py) on the CPU."""
    from transformers.models.llama import modeling_llama

    calls = []
    hf_rope = modeling_llama.apply_rotary_pos_emb

    def apply_liger_kernel_to_llama(model=None, **kwargs):
        calls.append(dict(kwargs, model=model))
        if kwargs.get("rope"):
            modeling_llama.apply_rotary_pos_emb = fused_rope
        if kwargs.get("rms_norm"):
            modeling_llama.LlamaRMSNorm = FusedNorm
            for layer in model.model.layers:
                layer.input_layernorm.patched = True

    def fused_rope(*args, **kwargs):
        return hf_rope(*args, **kwargs)

    class FusedNorm(torch.nn.Module):
        pass

    fake = types.SimpleNamespace(apply_liger_kernel_to_llama=apply_liger_kernel_to_llama, calls=calls,
                                 fused_rope=fused_rope)
    monkeypatch.setattr(kernels, "liger_module", lambda: fake)
    monkeypatch.setattr(kernels, "_version", lambda dist: "0.8.5")
    yield fake
    kernels.restore_hf_modules()


def test_auto_is_liger_only_on_cuda_with_liger_and_a_listed_family(monkeypatch, liger_installed):
    assert kernels.select_kernels("auto", "llama", CUDA) == "liger"
    assert kernels.select_kernels("auto", "llama", CPU) == "none"  # Triton kernels: CUDA only
    assert kernels.select_kernels("auto", "gpt2", CUDA) == "none"  # a family Liger is not applied to here
    monkeypatch.setattr(kernels, "liger_module", lambda: None)
    assert kernels.select_kernels("auto", "llama", CUDA) == "none"  # not installed
    assert kernels.select_kernels("compile", "llama", CPU) == "compile"  # opt-in, any device
    assert kernels.select_kernels("none", "llama", CUDA) == "none"


@pytest.mark.parametrize("requested, model_type, device, zero3, message", [
    ("liger", "llama", CPU, False, "model.kernels=liger: Liger's Triton kernels need a CUDA device"),
    ("liger", "gpt2", CUDA, False, "model.kernels=liger: no Liger kernels for model type 'gpt2'"),
    ("compile", "llama", CUDA, True, "model.kernels=compile: not with ZeRO-3"),
    ("fused", "llama", CPU, False, "model.kernels: 'fused' is not one of auto, liger, compile, none"),
])
def test_a_choice_that_cannot_run_is_one_line(liger_installed, requested, model_type, device, zero3, message):
    with pytest.raises(UserError) as err:
        kernels.select_kernels(requested, model_type, device, zero3)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_a_bad_kernels_value_in_the_config_is_one_line():
    with pytest.raises(UserError, match="model.kernels: 'triton' is not one of auto, liger, compile, none"):
        ModelConfig(config=tiny_config("llama"), kernels="triton")


def test_every_tested_family_is_either_given_liger_kernels_or_listed_as_eager():
    from hbp_train.model.families import FAMILIES

    # docs/models.md lists what each family gets
    assert set(kernels.LIGER_KERNELS) | set(kernels.EAGER_FAMILIES) == set(FAMILIES)
    assert not set(kernels.LIGER_KERNELS) & set(kernels.EAGER_FAMILIES)
    for family, chosen in kernels.LIGER_KERNELS.items():
        assert set(chosen) <= {"rope", "rms_norm", "swiglu", "geglu"}, family  # never Liger's loss: ours is used


def test_liger_patches_the_instance_keeps_our_loss_and_undoes_its_class_swaps(liger_installed):
    """Liger is asked for RMSNorm, RoPE and SwiGLU only; its class swap is undone at once (models built later are
    HF's), its RoPE swap lasts until restore_hf_modules (bench/ calls it before an HF baseline)."""
    from transformers.models.llama import modeling_llama

    hf_norm, hf_rope = modeling_llama.LlamaRMSNorm, modeling_llama.apply_rotary_pos_emb
    model = build_model(ModelConfig(config=tiny_config("llama"), dtype="fp32"), vocab_size=256)
    phrase = kernels.apply_kernels(model, "liger", decoder_layers(model))
    assert phrase == "liger (liger-kernel 0.8.5: RMSNorm, RoPE, SwiGLU)"
    assert modeling_llama.LlamaRMSNorm is hf_norm and modeling_llama.apply_rotary_pos_emb is liger_installed.fused_rope
    probes, (call,) = liger_installed.calls[:-1], liger_installed.calls[-1:]  # each kernel probed alone first
    assert [sorted(k for k, on in c.items() if on is True) for c in probes] == [["rope"], ["rms_norm"], ["swiglu"]]
    assert all(c["model"] is not model for c in probes)
    assert call == {"model": model, "rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False,
                    "fused_linear_cross_entropy": False}
    assert all(getattr(layer.input_layernorm, "patched", False) for layer in model.model.layers)
    assert modeling_llama.LlamaRMSNorm is hf_norm
    assert modeling_llama.apply_rotary_pos_emb is liger_installed.fused_rope
    kernels.restore_hf_modules()
    assert modeling_llama.apply_rotary_pos_emb is hf_rope


def test_the_start_of_run_log_names_the_attention_kernel_and_the_decoder_kernels(capsys):
    build_model(ModelConfig(config=tiny_config("llama"), dtype="fp32", kernels="none"), vocab_size=256)
    out = capsys.readouterr().out.splitlines()
    assert f"[model] attention: sdpa_block (torch {torch.__version__} scaled_dot_product_attention per sample) " \
           "on CPU" in out
    assert "[model] decoder kernels: none (eager HF modules)" in out


def test_every_attention_function_is_registered_for_eager_use_inside_compiled_layers():
    """A compiled layer must break its graph at the attention call (host-side boundaries, Ulysses' collectives):
    whatever use_attention registers (the packed attention, the Ulysses dispatcher) is behind compiler.disable."""
    from transformers import AttentionInterface

    from hbp_train.model.attention import ATTN_IMPLEMENTATION

    from hbp_train.model.attention_setup import use_attention

    model = build_model(ModelConfig(config=tiny_config("llama"), dtype="fp32", kernels="none"), vocab_size=256)
    assert getattr(AttentionInterface._global_mapping[ATTN_IMPLEMENTATION], "_torchdynamo_disable", False)
    use_attention(model, "test_dispatcher", lambda *args, **kwargs: None)
    assert getattr(AttentionInterface._global_mapping["test_dispatcher"], "_torchdynamo_disable", False)
    del AttentionInterface._global_mapping["test_dispatcher"]


# --------------------------------------------------------------------------------------------- compiled layers
def _packs(vocab: int):
    """Two packs of different token counts (a compiled layer must serve both) with their sample boundaries."""
    gen = torch.Generator().manual_seed(0)
    packs = []
    for lengths in ((37, 21, 50), (70, 33)):
        ids = torch.randint(0, vocab, (sum(lengths),), generator=gen)
        labels = torch.cat([torch.cat([ids[s + 1:s + n], torch.tensor([IGNORE_INDEX])])
                            for s, n in zip(torch.tensor([0, *lengths]).cumsum(0).tolist(), lengths)])
        cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
        packs.append((ids, labels, torch.cat([torch.arange(n) for n in lengths]), cu, max(lengths)))
    return packs


def _loss_and_grads(model, pack) -> tuple[float, dict]:
    ids, labels, position_ids, cu, max_len = pack
    model.zero_grad(set_to_none=True)
    hidden = forward_hidden(model, ids[None], position_ids[None], cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                            max_length_q=max_len, max_length_k=max_len)
    logits = model.get_output_embeddings()(hidden[0])
    loss = torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)
    loss.backward()
    return float(loss.detach()), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _compiled_vs_eager(cfg: ModelConfig, backend: str):
    """(eager, compiled) losses and gradients of the same weights over both packs; the first layer checkpointed
    (per-layer activation checkpointing wraps the compiled call)."""
    results = {}
    for kind in ("none", "compile"):
        torch.manual_seed(0)
        torch._dynamo.reset()
        model = build_model(ModelConfig(**{**vars(cfg), "kernels": kind}), vocab_size=256)
        if kind == "compile" and backend != "inductor":
            for layer in decoder_layers(model):
                layer._compiled_call_impl = None
                layer.compile(backend=backend, dynamic=True)
        set_checkpointed_layers(model, 1)
        torch._dynamo.utils.counters.clear()
        results[kind] = [_loss_and_grads(model, pack) for pack in _packs(256)]
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert (graphs > 0) == (kind == "compile"), graphs  # really compiled (and the eager run really was not)
    return results["none"], results["compile"]


def _assert_same(eager, compiled, tol):
    for (loss_e, grads_e), (loss_c, grads_c) in zip(eager, compiled):
        assert loss_c == pytest.approx(loss_e, rel=tol)
        assert grads_c.keys() == grads_e.keys() and grads_e
        for name, grad in grads_e.items():
            torch.testing.assert_close(grads_c[name], grad, rtol=tol, atol=tol, msg=name)


@pytest.mark.slow
@pytest.mark.full  # inductor's first compile; the aot_eager tests stay in the default tier
def test_compiled_layers_with_inductor_give_eager_losses_and_gradients_on_the_cpu():
    """model.kernels=compile with the real inductor (C++ kernels on the CPU: ~30-45 s of compiling here)."""
    eager, compiled = _compiled_vs_eager(ModelConfig(config=tiny_config("llama"), dtype="fp32"), "inductor")
    _assert_same(eager, compiled, 1e-5)


@pytest.mark.slow
def test_compiled_layers_keep_lora_adapters_training():
    """peft's wrapped Linear layers inside a compiled layer (aot_eager: dynamo's graph capture and AOT autograd,
    which is what LoRA could break; inductor's code generation is proven by the test above)."""
    from hbp_train.model.lora import LoraSettings

    cfg = ModelConfig(config=tiny_config("llama"), dtype="fp32", lora=LoraSettings(r=4, alpha=8))
    eager, compiled = _compiled_vs_eager(cfg, "aot_eager")
    _assert_same(eager, compiled, 1e-5)
    assert all("lora_" in name for name in eager[0][1])  # only the adapters train


@pytest.mark.slow
def test_one_graph_set_serves_every_layer_and_every_pack_length():
    """Dynamo's cache holds 8 entries per code object: compiled per layer with static shapes, 16 layers times a few
    pack lengths would overflow it and silently fall back to eager. Dynamic token count, layers sharing code: the
    graphs made for the first pack serve every layer and every later pack."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = build_model(ModelConfig(config=tiny_config("llama", num_hidden_layers=12), dtype="fp32", kernels="none"),
                        vocab_size=256)
    for layer in decoder_layers(model):
        layer.compile(backend="aot_eager", dynamic=True)  # what kernels.apply_kernels does, without inductor's time
    graphs = []
    for num_tokens in (100, 150, 230, 310):
        ids = torch.randint(0, 256, (1, num_tokens))
        half = num_tokens // 2
        cu = torch.tensor([0, half, num_tokens], dtype=torch.int32)
        position_ids = torch.cat([torch.arange(half), torch.arange(num_tokens - half)])[None]
        forward_hidden(model, ids, position_ids, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=num_tokens - half,
                       max_length_k=num_tokens - half).sum().backward()
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs == [graphs[0]] * 4, graphs


@pytest.mark.gpu
def test_gpu_liger_gives_eager_losses_and_gradients_within_bf16():
    pytest.importorskip("liger_kernel")
    cfg = ModelConfig(config=tiny_config("llama"), dtype="bf16")
    results = {}
    for kind in ("none", "liger"):
        torch.manual_seed(0)
        with torch.device("cuda"):
            model = build_model(ModelConfig(**{**vars(cfg), "kernels": kind}), vocab_size=256)
        assert model._hbp_kernels.startswith(kind)
        pack = [t.cuda() if isinstance(t, torch.Tensor) else t for t in _packs(256)[0]]
        results[kind] = _loss_and_grads(model, pack)
        kernels.restore_hf_modules()
    (loss_e, grads_e), (loss_l, grads_l) = results["none"], results["liger"]
    assert loss_l == pytest.approx(loss_e, rel=2e-2)
    for name, grad in grads_e.items():
        cos = torch.nn.functional.cosine_similarity(grads_l[name].float().flatten(), grad.float().flatten(), dim=0)
        assert cos > 0.99, name


# ------------------------------------------------------------------------------- Liger where it cannot be applied
class _LigerReleaseThatDoesNotImport:
    """liger_kernel.transformers of a release whose lazy import fails on this transformers (a release older than 0.7
    on transformers 5): the package imports, each apply_liger_kernel_to_* raises when it is looked up."""

    def __getattr__(self, name):
        raise ImportError("cannot import name 'LlamaFlashAttention2' from 'transformers.models.llama.modeling_llama'")


def test_a_family_without_its_liger_function_stays_eager_and_says_why(liger_installed, caplog):
    """deepseek_v3 is listed (its RMSNorms would fit) but this Liger has no apply_liger_kernel_to_deepseek_v3: auto
    falls back to the eager modules with one warning naming the function; model.kernels=liger is one line."""
    import logging

    with caplog.at_level(logging.WARNING, logger="hbp_train.model.kernels"):
        assert kernels.select_kernels("auto", "deepseek_v3", CUDA) == "none"
    (line,) = [r.getMessage() for r in caplog.records]
    assert "apply_liger_kernel_to_deepseek_v3" in line and "eager" in line
    with pytest.raises(UserError, match="model.kernels=liger: liger-kernel 0.8.5 has no apply_liger_kernel_to_deepseek_v3"):
        kernels.select_kernels("liger", "deepseek_v3", CUDA)
    assert kernels.select_kernels("auto", "llama", CUDA) == "liger"  # the stand-in has Llama's


def test_a_liger_release_whose_import_fails_here_falls_back_eagerly(monkeypatch, caplog):
    import logging

    monkeypatch.setattr(kernels, "liger_module", lambda: _LigerReleaseThatDoesNotImport())
    monkeypatch.setattr(kernels, "_version", lambda dist: "0.6.4")
    with caplog.at_level(logging.WARNING, logger="hbp_train.model.kernels"):
        assert kernels.select_kernels("auto", "llama", CUDA) == "none"
    (line,) = [r.getMessage() for r in caplog.records]
    assert "liger-kernel 0.6.4" in line and "ImportError" in line and "LlamaFlashAttention2" in line
    with pytest.raises(UserError) as err:
        kernels.select_kernels("liger", "llama", CUDA)
    assert str(err.value).startswith("model.kernels=liger: liger-kernel 0.6.4 does not import apply_liger_kernel_to_llama")
    assert "\n" not in str(err.value)


def test_qwen3_query_and_key_norms_are_fused_too(monkeypatch):
    """Liger's apply function for Qwen3 patches the decoder's RMSNorms but leaves each attention's q_norm and k_norm
    eager: they are patched with Liger's own module patcher (not in place: their gradient is still read after)."""
    import sys

    patched = []
    fake_module = types.ModuleType("fake_liger_monkey_patch")

    def _patch_rms_norm_module(module, offset=0.0, eps=1e-6, casting_mode="llama", in_place=True, row_mode=None):
        patched.append((module, in_place))

    def apply_liger_kernel_to_qwen3(model=None, **kwargs):
        for layer in model.model.layers:  # what Liger does: the decoder norms, not the attention's
            _patch_rms_norm_module(layer.input_layernorm)
            _patch_rms_norm_module(layer.post_attention_layernorm)

    for fn in (_patch_rms_norm_module, apply_liger_kernel_to_qwen3):
        fn.__module__ = fake_module.__name__
        setattr(fake_module, fn.__name__, fn)
    monkeypatch.setitem(sys.modules, fake_module.__name__, fake_module)
    monkeypatch.setattr(kernels, "liger_module", lambda: fake_module)
    monkeypatch.setattr(kernels.liger_probe, "probe_liger", lambda *args: {})  # the probe: tests below
    monkeypatch.setattr(kernels, "_version", lambda dist: "0.8.5")
    model = build_model(ModelConfig(config=tiny_config("qwen3"), architecture="qwen3", dtype="fp32", kernels="none"),
                        vocab_size=256)
    kernels.apply_kernels(model, "liger", decoder_layers(model))
    attention_norms = [(m, False) for layer in model.model.layers for m in (layer.self_attn.q_norm, layer.self_attn.k_norm)]
    assert all(any(m is p and in_place == want for p, in_place in patched) for m, want in attention_norms)
    assert len(patched) == 4 * len(model.model.layers)


def test_a_model_without_liger_runs_hf_modules_after_one_with_liger(liger_installed):
    """Liger's RoPE lives in transformers' modeling module, for the whole process: a model built afterwards with
    model.kernels=none (the profile's ours_eager, after ours) must run HF's RoPE, not keep Liger's."""
    from transformers.models.llama import modeling_llama

    hf_rope = modeling_llama.apply_rotary_pos_emb
    fused = build_model(ModelConfig(config=tiny_config("llama"), dtype="fp32", kernels="none"), vocab_size=256)
    kernels.apply_kernels(fused, "liger", decoder_layers(fused))
    assert modeling_llama.apply_rotary_pos_emb is liger_installed.fused_rope
    eager = build_model(ModelConfig(config=tiny_config("llama"), dtype="fp32", kernels="none"), vocab_size=256)
    assert eager._hbp_kernels.startswith("none")
    assert modeling_llama.apply_rotary_pos_emb is hf_rope


# ----------------------------------------------------------------------------- Liger's kernels probed before use
class _BrokenKernels:
    """liger_kernel.transformers whose RMSNorm gives wrong values and whose SwiGLU fails at its first call (as a
    Triton kernel that does not compile for this GPU or width would, inside the first step); its RoPE is HF's."""

    def __init__(self, broken=("rms_norm", "swiglu")):
        from transformers.models.llama import modeling_llama

        self.broken, self.patched, hf_rope = broken, [], modeling_llama.apply_rotary_pos_emb
        self.fused_rope = lambda *args, **kwargs: hf_rope(*args, **kwargs)

    def apply_liger_kernel_to_llama(self, model=None, rope=False, rms_norm=False, swiglu=False, **kwargs):
        from transformers.models.llama import modeling_llama

        def wrong_norm(x):
            return 2 * x

        def failing_mlp(x):
            raise RuntimeError("triton: out of resource: shared memory, required 262144, hardware limit 232448")

        if rope:
            modeling_llama.apply_rotary_pos_emb = self.fused_rope
        for layer in model.model.layers:
            if rms_norm:
                layer.input_layernorm.forward = wrong_norm if "rms_norm" in self.broken else layer.input_layernorm.forward
                self.patched.append(layer.input_layernorm)
            if swiglu:
                layer.mlp.forward = failing_mlp if "swiglu" in self.broken else layer.mlp.forward
                self.patched.append(layer.mlp)


def test_a_liger_kernel_that_fails_its_probe_stays_eager_with_one_line(monkeypatch, caplog):
    """Each kernel is run alone on a one-layer copy, forward and backward, against HF's modules before the model uses
    it: a kernel that raises (a Triton compile) or differs stays eager, named in one warning line, the others are
    used; with model.kernels=liger it is one error line; when none passes the model keeps HF's modules."""
    import logging

    from transformers.models.llama import modeling_llama

    fake = _BrokenKernels()
    monkeypatch.setattr(kernels, "liger_module", lambda: fake)
    monkeypatch.setattr(kernels, "_version", lambda dist: "0.8.5")
    hf_rope = modeling_llama.apply_rotary_pos_emb
    eager = build_model(ModelConfig(config=tiny_config("llama"), dtype="fp32", kernels="none"), vocab_size=256)
    model = copy.deepcopy(eager)
    try:
        with caplog.at_level(logging.WARNING, logger="hbp_train.model.kernels"):
            phrase = kernels.apply_kernels(model, "liger", decoder_layers(model))
        (line,) = [r.getMessage() for r in caplog.records]
        assert line.startswith("Liger's kernels failed their check on cpu (RMSNorm: its output differs from HF's by")
        assert "SwiGLU: RuntimeError: triton: out of resource" in line and "stay eager" in line
        assert phrase == "liger (liger-kernel 0.8.5: RoPE; RMSNorm, SwiGLU eager: failed their check)"
        assert model._hbp_fused_kernels == ("rope",) and modeling_llama.apply_rotary_pos_emb is fake.fused_rope
        assert not any(m in fake.patched for layer in model.model.layers for m in (layer.input_layernorm, layer.mlp))
        (loss_e, grads_e), (loss_f, grads_f) = (_loss_and_grads(m, _packs(256)[0]) for m in (eager, model))
        assert loss_f == loss_e and all(torch.equal(grads_f[n], g) for n, g in grads_e.items())  # it trains as HF's
        with pytest.raises(UserError) as err:
            kernels.apply_kernels(model, "liger", decoder_layers(model), requested="liger")
        assert str(err.value).startswith("model.kernels=liger: Liger's kernels failed their check on cpu (RMSNorm:")
        assert "\n" not in str(err.value)
        fake.broken = ("rms_norm", "swiglu", "rope")
        fake.fused_rope = lambda *args, **kwargs: (args[0] * 0, args[1] * 0)
        assert kernels.apply_kernels(model, "liger", decoder_layers(model)).startswith("none (eager HF modules")
        assert modeling_llama.apply_rotary_pos_emb is hf_rope  # the probe left transformers as it found it
    finally:
        kernels.restore_hf_modules()


_INTERPRETED = """
import json, logging, os, sys
os.environ["TRITON_INTERPRET"] = "1"  # Triton's interpreter: Liger's kernels on CPU tensors, before Liger imports
sys.path.insert(0, sys.argv[1])
import torch
from liger_kernel.transformers.rope import liger_rotary_pos_emb
from transformers.models.llama import modeling_llama
from hbp_train.model import kernels
from hbp_train.model.families import tiny_config
from hbp_train.model.hf_model import ModelConfig, build_model, decoder_layers
from tests.test_kernels import _loss_and_grads, _packs

warnings = []
logging.getLogger("hbp_train.model.kernels").addHandler(logging.Handler())
logging.getLogger("hbp_train.model.kernels").handlers[-1].emit = lambda record: warnings.append(record.getMessage())
cfg = ModelConfig(config=tiny_config("llama"), dtype="fp32", kernels="none")
eager, model = build_model(cfg, vocab_size=256), build_model(cfg, vocab_size=256)
phrase = kernels.apply_kernels(model, "liger", decoder_layers(model))
(loss_e, grads_e), (loss_l, grads_l) = (_loss_and_grads(m, _packs(256)[0]) for m in (eager, model))
print(json.dumps({"phrase": phrase, "warnings": warnings, "fused": list(model._hbp_fused_kernels),
                  "liger_rope": modeling_llama.apply_rotary_pos_emb is liger_rotary_pos_emb,
                  "loss": [loss_e, loss_l],
                  "grad_error": max(float((grads_l[n] - g).abs().max()) for n, g in grads_e.items())}))
"""


@pytest.mark.slow  # a subprocess: Triton reads TRITON_INTERPRET when Liger's kernels are defined, at its import
def test_the_real_liger_probe_through_tritons_interpreter_on_the_cpu():
    """The real Liger kernels, probed on the CPU by Triton's interpreter: its RoPE runs there and passes (the model
    then trains with it, with HF's loss and gradients), its RMSNorm and SwiGLU do not run there (the interpreter
    rejects their scalar eps / casts) and stay eager, said in one line. Needs triton and liger-kernel installed
    (pip install --no-deps triton liger-kernel into the venv)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    for module in ("triton", "liger_kernel"):
        pytest.importorskip(module, reason=f"{module} is not installed: pip install --no-deps triton liger-kernel")
    repo = Path(__file__).resolve().parent.parent
    proc = subprocess.run([sys.executable, "-c", _INTERPRETED, str(repo)], capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ, "CUDA_VISIBLE_DEVICES": "",
                                            "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    (line,) = found["warnings"]
    assert line.startswith("Liger's kernels failed their check on cpu (") and "RoPE" not in line
    assert "RMSNorm: " in line and "SwiGLU: " in line
    assert found["fused"] == ["rope"] and found["liger_rope"]  # Liger's RoPE kernel is what the model runs
    assert found["phrase"].startswith("liger (liger-kernel ") and "RoPE; RMSNorm, SwiGLU eager" in found["phrase"]
    loss_e, loss_l = found["loss"]
    assert loss_l == pytest.approx(loss_e, rel=1e-6) and found["grad_error"] < 1e-5
