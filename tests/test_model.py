"""Model building, per-layer activation checkpointing, hidden-state forward + chunked loss, FLOP counts."""

from __future__ import annotations

import pytest
import torch

from hbp_train.loss import chunked_token_losses
from hbp_train.model import (
    SHIPPED_TOKENIZER,
    ModelConfig,
    attention_flops,
    build_model,
    decoder_layers,
    flops_per_token,
    forward_hidden,
    num_params,
    pack_flops,
    set_checkpointed_layers,
    token_losses,
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
        with pytest.raises(ValueError, match=field):
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
    torch.testing.assert_close(token_losses(model, hidden, shift_labels, chunk_size=5), loss_T)


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


# -------------------------------------------------------------------------------------------------- FLOPs
def test_flops_per_token_counts_every_matmul_weight_six_times():
    model = _tiny()
    matmul_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert flops_per_token(model.config) == 6 * matmul_weights


def test_attention_flops_sum_per_sample_squares():
    config = _tiny().config
    per_layer_token_pair = 12 * TINY["hidden_size"] / 2  # heads * head_dim == hidden here
    expected = TINY["num_hidden_layers"] * per_layer_token_pair * (100**2 + 28**2)
    assert attention_flops(config, [100, 28]) == expected
    assert attention_flops(config, [128]) > attention_flops(config, [100, 28])  # a pack is not one T^2 block
    assert pack_flops(config, [100, 28]) == flops_per_token(config) * 128 + expected


# ------------------------------------------------------------------------------------------------- ZeRO-3
Z3_TINY = {**TINY, "num_hidden_layers": 2, "tie_word_embeddings": False}


def _z3_step(rank, world_size):
    """One ZeRO-3 forward/backward through token_losses; returns the loss and the full LM-head/embedding grads."""
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    deepspeed.init_distributed(dist_backend="gloo")
    model = build_model(ModelConfig(config=Z3_TINY), vocab_size=512)
    config = {
        "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 3}, "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.0), config=config)
    input_ids, shift_labels = _z3_batch()
    hidden = forward_hidden(engine.module, input_ids, torch.arange(input_ids.shape[1])[None])
    loss = token_losses(engine.module, hidden, shift_labels, chunk_size=7).sum() / (shift_labels != -100).sum()
    engine.backward(loss)
    return (loss.item(), safe_get_full_grad(engine.module.lm_head.weight).clone(),
            safe_get_full_grad(engine.module.model.embed_tokens.weight).clone())


def _z3_batch():
    input_ids = torch.randint(0, 512, (1, 20), generator=torch.Generator().manual_seed(4))
    return input_ids, _shift(input_ids[0], [20])


@pytest.mark.slow
def test_token_losses_through_the_head_module_work_under_zero3():
    """Under ZeRO-3 the head weight is a partition outside its module's forward; token_losses goes through it."""
    from tests.distributed import run_distributed

    model = build_model(ModelConfig(config=Z3_TINY), vocab_size=512)
    input_ids, shift_labels = _z3_batch()
    hidden = forward_hidden(model, input_ids, torch.arange(input_ids.shape[1])[None])
    loss = token_losses(model, hidden, shift_labels, chunk_size=7).sum() / (shift_labels != -100).sum()
    loss.backward()
    for rank_loss, head_grad, embed_grad in run_distributed(_z3_step, 1):
        assert rank_loss == pytest.approx(loss.item(), abs=1e-6)
        torch.testing.assert_close(head_grad, model.lm_head.weight.grad, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(embed_grad, model.model.embed_tokens.weight.grad, atol=1e-6, rtol=1e-5)


def test_attention_flops_use_the_query_width_not_hidden():
    """Models whose heads * head_dim differs from hidden (e.g. Qwen3: hidden 1024, 16 x 128): attention FLOPs follow
    the width of q (the q_proj output), 6 x layers x width x sum L^2."""
    model = _tiny(head_dim=32)  # 4 heads x 32 = 128 != hidden 64
    width = decoder_layers(model)[0].self_attn.q_proj.out_features
    assert width != TINY["hidden_size"]
    assert attention_flops(model.config, [100, 28]) == 6 * TINY["num_hidden_layers"] * width * (100**2 + 28**2)
    matmul_weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert flops_per_token(model.config) == 6 * matmul_weights


def test_pretrained_vocabulary_is_never_shrunk_to_the_tokenizer(tmp_path):
    big = _tiny(vocab_size=VOCAB * 2)
    big.save_pretrained(tmp_path)
    loaded = build_model(ModelConfig(name_or_path=str(tmp_path)), vocab_size=VOCAB)
    assert loaded.get_input_embeddings().weight.shape[0] == VOCAB * 2
    assert loaded.get_output_embeddings().weight.shape[0] == VOCAB * 2
