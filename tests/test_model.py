"""Model building, per-layer activation checkpointing, hidden-state forward + chunked loss (FLOPs: test_flops.py)."""

from __future__ import annotations

import pytest
import torch

from hbp_train.common.errors import UserError
from hbp_train.model.loss import chunked_token_losses
from hbp_train.model.hf_model import (
    SHIPPED_TOKENIZER,
    ModelConfig,
    build_model,
    decoder_layers,
    forward_hidden,
    num_params,
    set_checkpointed_layers,
)

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
VOCAB = 4096


def _tiny(architecture="llama", **overrides):
    return build_model(ModelConfig(config={**TINY, **overrides}, architecture=architecture), vocab_size=VOCAB)


def _shift(labels_T, lengths):
    """Shift labels within each sample: the last token of a sample has no target."""
    out, start = [], 0
    for n in lengths:
        out += [*labels_T[start + 1 : start + n].tolist(), -100]
        start += n
    return torch.tensor(out)


# --------------------------------------------------------------------------------------------------- config
def test_vocabulary_is_the_larger_of_tokenizer_and_config():
    # A real model's vocabulary in model.config (e.g. 128256 for a Llama-3 profile) survives a smaller tokenizer;
    # a config without one, or with a smaller one, gets the tokenizer's.
    assert _tiny(vocab_size=VOCAB * 2).get_output_embeddings().weight.shape[0] == VOCAB * 2
    assert _tiny(vocab_size=100).config.vocab_size == VOCAB and _tiny().config.vocab_size == VOCAB


def test_build_tiny_llama_from_config():
    model = _tiny()
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.use_cache is False
    assert model.config._attn_implementation == "hbp_packed"
    assert model.dtype == torch.float32  # "auto" on a CPU machine
    assert model.get_input_embeddings().weight.shape[0] == VOCAB
    assert num_params(model) == sum(p.numel() for p in model.parameters())


def test_model_config_defaults_and_validation(tmp_path):
    cfg = ModelConfig(config=TINY)
    assert cfg.tokenizer == str(SHIPPED_TOKENIZER) and cfg.attention_backend == "auto" and cfg.dtype == "auto"
    for kwargs, field in [
        ({}, "model.config"),
        ({"config": TINY, "dtype": "fp16"}, "model.dtype"),
        ({"config": TINY, "attention_backend": "flash"}, "model.attention_backend"),
        ({"config": TINY, "architecture": "not_a_model"}, "model.architecture"),
        ({"name_or_path": str(tmp_path / "missing")}, "model.name_or_path"),
        ({"config": [1, 2]}, "model.config"),
    ]:
        with pytest.raises(UserError, match=field):
            ModelConfig(**kwargs)


def test_build_from_local_dir_keeps_weights_and_grows_vocab(tmp_path):
    model = _tiny()
    model.save_pretrained(tmp_path)
    loaded = build_model(ModelConfig(name_or_path=str(tmp_path)))
    assert loaded.config._attn_implementation == "hbp_packed" and loaded.config.use_cache is False
    # from_pretrained leaves eval mode, in which HF layers skip activation checkpointing: built for training,
    # per-layer checkpointing takes effect on a pretrained model too.
    set_checkpointed_layers(loaded, 2)
    counts, _ = _run_counting_layer_calls(loaded, torch.randint(0, VOCAB, (1, 16)))
    assert counts == [2, 2, 1]
    assert ModelConfig(name_or_path=str(tmp_path)).tokenizer == str(tmp_path)
    for (name, p), (_, q) in zip(model.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(p, q, msg=name)
    grown = build_model(ModelConfig(name_or_path=str(tmp_path)), vocab_size=VOCAB + 8)
    assert grown.get_input_embeddings().weight.shape[0] == VOCAB + 8


def _save_qwen2(folder, **fields):
    """A user's own model of another family and shape than the tiny_llama preset's (hidden 64, 2 layers)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen2", hidden_size=48, intermediate_size=96, num_hidden_layers=3,
                                  num_attention_heads=6, num_key_value_heads=2, vocab_size=VOCAB, **fields)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    return model


def test_a_model_by_path_keeps_its_own_config_under_the_default_preset(tmp_path, tokenizer_dir):
    """model.name_or_path alone: the default preset (tiny_llama) leaves its shape in model.init_config, which only a
    model built from scratch uses (it was model.config, laid over the checkpoint: a load report, then a traceback)."""
    from hbp_train import config

    saved = _save_qwen2(tmp_path)
    cfg = config.load([f"model.name_or_path={tmp_path}", "data.shards=unused"]).model
    assert cfg.init_config["hidden_size"] == 64 and cfg.hf_overrides() == {}
    loaded = build_model(cfg)
    assert type(loaded).__name__ == "Qwen2ForCausalLM" and loaded.config.hidden_size == 48
    for (name, p), (_, q) in zip(saved.state_dict().items(), loaded.state_dict().items()):
        torch.testing.assert_close(p, q, msg=name)
    # Built from scratch, the preset's shape applies, under what the user sets in model.config.
    scratch = config.load(["data.shards=unused", "++model.config.num_hidden_layers=3"]).model
    assert scratch.hf_overrides() == {**scratch.init_config, "num_hidden_layers": 3}
    assert len(decoder_layers(build_model(scratch, vocab_size=VOCAB))) == 3


def test_model_config_changes_a_checkpoint_only_where_it_keeps_the_weights_shapes(tmp_path):
    _save_qwen2(tmp_path)
    # A field that changes no weight (RoPE, the router loss weight...) applies on top of config.json; RoPE given
    # with the config.json keys of long-context guides (rope_theta, rope_scaling) lands in transformers 5's
    # rope_parameters, keeping the model's theta (passed through as they are, one was ignored, the other lost it).
    rope = build_model(ModelConfig(name_or_path=str(tmp_path), config={"rope_theta": 20000.0})).config.rope_parameters
    assert rope == {"rope_type": "default", "rope_theta": 20000.0}
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    model = build_model(ModelConfig(name_or_path=str(tmp_path), config={"rope_scaling": yarn,
                                                                       "max_position_embeddings": 4096}))
    assert model.config.rope_parameters == {**yarn, "rope_theta": 10000.0} and model.config.max_position_embeddings \
        == 4096 and model.model.rotary_emb.rope_type == "yarn"
    with pytest.raises(UserError, match=r"model.config \(hidden_size\) changes the shape of the weights in .*"
                                        r"model.name_or_path=null") as err:
        ModelConfig(name_or_path=str(tmp_path), config={"hidden_size": 64})
    assert "\n" not in str(err.value)
    # transformers' own checks name the field the value came from: the preset's shape or the user's change.
    with pytest.raises(UserError, match=r"^model.init_config: transformers rejects it .*attention heads"):
        ModelConfig(init_config={**TINY, "num_attention_heads": 3})
    with pytest.raises(UserError, match=r"^model.config: transformers rejects it .*attention heads"):
        ModelConfig(init_config=TINY, config={"num_attention_heads": 3})


# ------------------------------------------------------------------------------------ hidden + chunked loss
@pytest.mark.parametrize("architecture", ["llama", "qwen2"])
def test_forward_hidden_and_chunked_loss_equal_hf_loss(architecture):
    model = _tiny(architecture)
    gen = torch.Generator().manual_seed(0)
    input_ids = torch.randint(0, VOCAB, (1, 23), generator=gen)
    labels = input_ids.clone()
    labels[0, :6] = -100  # the prompt
    reference = model(input_ids=input_ids, labels=labels).loss
    hidden = forward_hidden(model, input_ids, torch.arange(23)[None])
    shift_labels = _shift(labels[0], [23])
    loss_T = chunked_token_losses(hidden[0], model.get_output_embeddings().weight, shift_labels, chunk_size=5)
    torch.testing.assert_close(loss_T.sum() / (shift_labels != -100).sum(), reference, atol=1e-5, rtol=1e-5)
    # The engine's module (model/packed_lm.PackedCausalLM) gives the same token losses from the ids.
    from hbp_train.model.packed_lm import PackedCausalLM

    torch.testing.assert_close(PackedCausalLM(model, chunk_size=5)(input_ids, torch.arange(23)[None], shift_labels),
                               loss_T)


def test_packed_loss_equals_per_sample_hf_losses():
    """A pack of 3 samples through forward_hidden gives each sample exactly its own HF loss."""
    model = _tiny()
    lengths = [7, 12, 9]
    gen = torch.Generator().manual_seed(1)
    samples = [torch.randint(0, VOCAB, (n,), generator=gen) for n in lengths]
    position_ids = torch.cat([torch.arange(n) for n in lengths])[None]
    hidden = forward_hidden(model, torch.cat(samples)[None], position_ids)
    shift_labels = _shift(torch.cat(samples), lengths)
    loss_T = chunked_token_losses(hidden[0], model.lm_head.weight, shift_labels, chunk_size=8)
    model.set_attn_implementation("sdpa")
    bounds = torch.tensor([0, *lengths]).cumsum(0).tolist()
    for sample, start, end in zip(samples, bounds[:-1], bounds[1:]):
        reference = model(input_ids=sample[None], labels=sample[None]).loss
        torch.testing.assert_close(loss_T[start:end].sum() / (end - start - 1), reference, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------------------------------ checkpointing
def _run_counting_layer_calls(model, input_ids):
    """One forward + backward; returns how often each decoder layer's attention ran (2 = recomputed in backward).

    A pre-hook: non-reentrant checkpointing stops its recompute early, once the last saved tensor is rebuilt,
    so a post-forward hook on a layer's last submodule would never fire during the recompute."""
    counts = [0] * len(decoder_layers(model))
    handles = [
        layer.self_attn.register_forward_pre_hook(lambda *_, i=i: counts.__setitem__(i, counts[i] + 1))
        for i, layer in enumerate(decoder_layers(model))
    ]
    model.zero_grad()
    hidden = forward_hidden(model, input_ids, torch.arange(input_ids.shape[1])[None])
    hidden.pow(2).mean().backward()
    for handle in handles:
        handle.remove()
    return counts, {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_checkpointing_first_k_layers_and_switching_k():
    model = _tiny().train()
    input_ids = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(2))
    counts, reference_grads = _run_counting_layer_calls(model, input_ids)
    assert counts == [1, 1, 1]  # never enabled
    for k in [1, 3, 0, 2, 1]:  # k changes between steps, as packing groups do
        set_checkpointed_layers(model, k)
        counts, grads = _run_counting_layer_calls(model, input_ids)
        assert counts == [2] * k + [1] * (3 - k), f"k={k}"
        assert grads.keys() == reference_grads.keys()
        for name, want in reference_grads.items():
            torch.testing.assert_close(grads[name], want, msg=name)  # recompute changes memory, never the gradient
    with pytest.raises(ValueError, match=r"\[0, 3\]"):
        set_checkpointed_layers(model, 4)


# ------------------------------------------------------------------------------------------------- ZeRO-3
Z3_TINY = {**TINY, "num_hidden_layers": 2, "tie_word_embeddings": False}


def _z3_step(rank, world_size):
    """One ZeRO-3 forward/backward through the trainer's engine (build.build_engine: PackedCausalLM with the LM head
    registered as an external parameter); returns the loss and the full LM-head/embedding grads."""
    from types import SimpleNamespace

    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    from hbp_train.build import DeepSpeedConfig, build_engine
    from hbp_train.model.loss import LossConfig
    from hbp_train.trainer import TrainConfig

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    model_cfg = ModelConfig(config=Z3_TINY)
    cfg = SimpleNamespace(model=model_cfg, train=TrainConfig(warmup_steps=0), deepspeed=DeepSpeedConfig(zero_stage=3),
                          loss=LossConfig(chunk_size=7))
    engine = build_engine(cfg, build_model(model_cfg, vocab_size=512), total_steps=1, world_size=1)
    input_ids, shift_labels = _z3_batch()
    loss = engine(input_ids, torch.arange(input_ids.shape[1])[None], shift_labels).sum() / (shift_labels != -100).sum()
    engine.backward(loss)
    hf_model = engine.module.model
    return (loss.item(), safe_get_full_grad(hf_model.lm_head.weight).clone(),
            safe_get_full_grad(hf_model.model.embed_tokens.weight).clone())


def _z3_batch():
    input_ids = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(4))
    return input_ids, _shift(input_ids[0], [20])


@pytest.mark.slow
def test_chunked_loss_of_the_engine_works_under_zero3():
    """Under ZeRO-3 the head weight is a partition outside its module's forward: the engine's module reads it as a
    registered external parameter, so loss and gradients equal the unpartitioned model's."""
    from hbp_train.model.packed_lm import PackedCausalLM
    from tests.distributed import run_distributed

    model = build_model(ModelConfig(config=Z3_TINY), vocab_size=512)
    input_ids, shift_labels = _z3_batch()
    loss_T = PackedCausalLM(model, chunk_size=7)(input_ids, torch.arange(input_ids.shape[1])[None], shift_labels)
    loss = loss_T.sum() / (shift_labels != -100).sum()
    loss.backward()
    for rank_loss, head_grad, embed_grad in run_distributed(_z3_step, 1):
        assert rank_loss == pytest.approx(loss.item(), abs=1e-6)
        torch.testing.assert_close(head_grad, model.lm_head.weight.grad, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(embed_grad, model.model.embed_tokens.weight.grad, atol=1e-6, rtol=1e-5)


def test_pretrained_vocabulary_is_never_shrunk_to_the_tokenizer(tmp_path):
    big = _tiny(vocab_size=VOCAB * 2)
    big.save_pretrained(tmp_path)
    loaded = build_model(ModelConfig(name_or_path=str(tmp_path)), vocab_size=VOCAB)
    assert loaded.get_input_embeddings().weight.shape[0] == VOCAB * 2
    assert loaded.get_output_embeddings().weight.shape[0] == VOCAB * 2


def _z3_trace_invalidations(rank, world_size, groups):
    """ZeRO-3 steps alternating between two packing groups with 0 and 2 checkpointed layers; returns how often
    DeepSpeed invalidated its parameter-prefetch trace, with the trainer's rule (build.step_ckpt_layers) and with
    each group's own count (the rule before the fix)."""
    from types import SimpleNamespace

    import deepspeed
    from deepspeed.runtime.zero import partitioned_param_coordinator as ppc

    from hbp_train.build import DeepSpeedConfig, build_engine, ckpt_layers_for, step_ckpt_layers
    from hbp_train.model.loss import LossConfig
    from hbp_train.trainer import TrainConfig

    count = [0]
    real = ppc.PartitionedParameterCoordinator._invalidate_trace

    def counted(self):
        count[0] += 1
        return real(self)

    ppc.PartitionedParameterCoordinator._invalidate_trace = counted
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    model_cfg = ModelConfig(config={**Z3_TINY, "num_hidden_layers": 4})
    cfg = SimpleNamespace(model=model_cfg, train=TrainConfig(warmup_steps=0), deepspeed=DeepSpeedConfig(zero_stage=3),
                          loss=LossConfig(chunk_size=7))
    rules = {"trainer": lambda g: step_ckpt_layers(cfg, g, groups[g]["ckpt_layers"], groups),
             "per_group": lambda g: ckpt_layers_for(None, g, groups[g]["ckpt_layers"])}
    counts = {}
    for name, rule in rules.items():
        engine = build_engine(cfg, build_model(model_cfg, vocab_size=512), total_steps=100, world_size=1)
        input_ids, shift_labels = _z3_batch()
        count[0] = 0
        for step in range(6):
            set_checkpointed_layers(engine.module.model, rule(step % 2))
            loss = engine(input_ids, torch.arange(input_ids.shape[1])[None], shift_labels).sum()
            engine.backward(loss)
            engine.step()
        counts[name] = count[0]
    return counts


@pytest.mark.slow
def test_zero3_keeps_its_prefetch_trace_across_packing_group_switches():
    """Under ZeRO-3 every step checkpoints the same layers (the most any group does), so switching groups never
    invalidates DeepSpeed's trace; with each group's own count it is invalidated at the switches."""
    from types import SimpleNamespace

    from hbp_train.build import step_ckpt_layers
    from hbp_train.trainer import TrainConfig
    from tests.distributed import run_distributed

    groups = [{"pack_len": 16, "sp": 1, "ckpt_layers": 0}, {"pack_len": 64, "sp": 1, "ckpt_layers": 2}]
    counts = run_distributed(_z3_trace_invalidations, 1, groups)[0]
    assert counts["trainer"] == 0 and counts["per_group"] >= 2, counts
    z2 = SimpleNamespace(deepspeed=SimpleNamespace(zero_stage=2), train=TrainConfig())
    assert [step_ckpt_layers(z2, g, groups[g]["ckpt_layers"], groups) for g in (0, 1)] == [0, 2]  # below ZeRO-3
