"""Tests for hbp_train/perf/flops.py: the one FLOPs formula (MFU's and the cost model's) against the real model's
matmul weights and against the numbers written out."""

from __future__ import annotations

import torch

from hbp_train.model.hf_model import ModelConfig, build_model, decoder_layers
from hbp_train.perf.flops import (attention_flops, attention_fwd_flops, flops_per_token, head_fwd_flops_per_token,
                                  linear_fwd_flops_per_token, pack_flops)
from hbp_train.perf.shape import MODEL_SHAPES, parse_model_shape

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2)
VOCAB = 4096


def _tiny(architecture="llama", **overrides):
    return build_model(ModelConfig(config={**TINY, **overrides}, architecture=architecture), vocab_size=VOCAB)


def _matmul_weights(model) -> int:
    return sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))


def test_flops_per_token_counts_every_matmul_weight_six_times():
    model = _tiny()
    assert flops_per_token(parse_model_shape(model.config)) == 6 * _matmul_weights(model)


def test_attention_flops_sum_per_sample_squares():
    shape = parse_model_shape(_tiny().config)
    per_layer_token_pair = 12 * TINY["hidden_size"] / 2  # heads * head_dim == hidden here
    expected = TINY["num_hidden_layers"] * per_layer_token_pair * (100**2 + 28**2)
    assert attention_flops(shape, [100, 28]) == expected
    assert attention_flops(shape, [128]) > attention_flops(shape, [100, 28])  # a pack is not one T^2 block
    assert pack_flops(shape, [100, 28]) == flops_per_token(shape) * 128 + expected


def test_attention_flops_use_the_query_width_not_hidden():
    """Models whose heads * head_dim differs from hidden (e.g. Qwen3: hidden 1024, 16 x 128): attention FLOPs follow
    the width of q (the q_proj output), 6 x layers x width x sum L^2."""
    model = _tiny(head_dim=32)  # 4 heads x 32 = 128 != hidden 64
    shape = parse_model_shape(model.config)
    width = decoder_layers(model)[0].self_attn.q_proj.out_features
    assert width != TINY["hidden_size"]
    assert attention_flops(shape, [100, 28]) == 6 * TINY["num_hidden_layers"] * width * (100**2 + 28**2)
    assert flops_per_token(shape) == 6 * _matmul_weights(model)


def test_llama8b_forward_flops_written_out():
    """The cost model's per-layer terms for Llama-3-8B: q, o (4096x4096), k, v (4096x1024), MLP 3 x 4096x14336."""
    shape = MODEL_SHAPES["llama3-8b"]
    linear = 2 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    head = 2 * 4096 * 128256
    assert linear_fwd_flops_per_token(shape) == linear and head_fwd_flops_per_token(shape) == head
    assert attention_fwd_flops(shape, [1000, 10]).tolist() == [2 * 1000**2 * 4096, 2 * 10**2 * 4096]
    # Training = 3 x forward, for MFU and the analytic cost model alike.
    assert flops_per_token(shape) == 3 * (32 * linear + head)
