"""Tests for hbp_train/perf/shape.py: the one model-shape reader (presets, JSON, HF keys, HF config objects, a run's
ModelConfig) and the one rule for which SP degrees Ulysses can split a model's heads by."""

from __future__ import annotations

import json

import pytest

from hbp_train.common.errors import UserError
from hbp_train.perf.shape import (MODEL_SHAPES, ModelShape, load_json_object, model_shape_of, parse_model_shape,
                                  sp_heads_problem)

HF_TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "intermediate_size": 128, "vocab_size": 100}


def test_bad_shapes_are_user_errors_naming_the_problem():
    with pytest.raises(UserError, match="not a preset"):
        parse_model_shape("gpt-17")
    with pytest.raises(UserError, match="missing"):
        parse_model_shape('{"hidden": 64}')
    with pytest.raises(UserError, match="num_kv_heads"):
        ModelShape("x", 64, 2, 4, 3, 128, 100)
    with pytest.raises(UserError, match="hidden must be > 0"):
        parse_model_shape({**HF_TINY, "hidden_size": 0})
    with pytest.raises(UserError, match="model shape"):
        parse_model_shape({**HF_TINY, "hidden_size": "wide"})


def test_hf_key_names_config_objects_and_files_read_the_same_shape(tmp_path):
    from transformers import LlamaConfig

    # HF config.json key names are accepted.
    hf = parse_model_shape(HF_TINY)
    assert (hf.hidden, hf.num_kv_heads, hf.head_dim) == (64, 2, 16)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**HF_TINY, "head_dim": None, "model_type": "llama"}))  # null head_dim: derived
    assert parse_model_shape(str(path)) == hf
    assert parse_model_shape(json.dumps(HF_TINY)) == hf
    assert parse_model_shape(LlamaConfig(**HF_TINY)) == hf  # what the trainer passes: model.config
    assert parse_model_shape("llama3-8b") is MODEL_SHAPES["llama3-8b"]
    # No num_key_value_heads: one kv head per query head, as HF does.
    assert parse_model_shape({k: v for k, v in HF_TINY.items() if k != "num_key_value_heads"}).num_kv_heads == 4


def test_load_json_object_names_what_it_reads(tmp_path):
    assert load_json_object('{"a": 1}') == {"a": 1}
    path = tmp_path / "s.json"
    path.write_text("[1, 2]")
    with pytest.raises(UserError, match="--model-shape: the JSON must be an object"):
        load_json_object(str(path), "--model-shape")
    with pytest.raises(UserError, match="invalid JSON"):
        load_json_object("{nope")
    with pytest.raises(UserError, match="neither a JSON object nor a file"):
        load_json_object(str(tmp_path / "missing.json"))


@pytest.mark.parametrize("heads,kv,ok,bad", [
    (32, 8, [1, 2, 4, 8, 16, 32], [64]),  # Llama-3-8B: kv split up to 8, replicated at 16 and 32
    (14, 2, [1, 2, 14], [4, 7, 8]),       # Qwen2.5-0.5B: 14 heads not divisible by 4; 7 and 2 kv do not divide
    (12, 3, [1, 3, 6, 12], [2, 4]),       # 3 kv heads: sp=2 neither splits nor replicates them, sp=6 replicates
])
def test_sp_heads_problem_is_ulysses_head_rule(heads, kv, ok, bad):
    assert [sp for sp in ok if sp_heads_problem(heads, kv, sp) is not None] == []
    for sp in bad:
        assert sp_heads_problem(heads, kv, sp).startswith(f"sp={sp} ")


def test_model_shape_follows_build_model_vocabulary_rule():
    from hbp_train.model.hf_model import ModelConfig

    tiny = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2}
    assert model_shape_of(ModelConfig(config=tiny), 4096).vocab == 4096  # the tokenizer's, as build_model
    assert model_shape_of(ModelConfig(config={**tiny, "vocab_size": 128256}), 4096).vocab == 128256  # the larger
    assert model_shape_of(ModelConfig(config={**tiny, "vocab_size": 100}), 4096).vocab == 4096


# ------------------------------------------------------------------------------- MoE and MLA: against HF modules
@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "mixtral", "qwen3_moe", "deepseek_v3"])
def test_params_and_flops_match_the_hf_module(family):
    """Total and active matmul weights (MoE: top-k of the routed experts) and the forward linear FLOPs per token
    (counted by torch's FLOP counter on the real forward) equal what the shape reader says."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from hbp_train.model.families import tiny_config
    from hbp_train.model.hf_model import ModelConfig, build_model, decoder_layers
    from hbp_train.perf.flops import linear_fwd_flops_per_token

    model = build_model(ModelConfig(config=tiny_config(family), architecture=family), vocab_size=128)
    shape = parse_model_shape(model.config)
    weights = {n: p.numel() for n, p in decoder_layers(model).named_parameters() if p.dim() >= 2}
    experts = sum(n for name, n in weights.items() if ".experts." in name)  # routed experts (not shared_experts)
    assert sum(weights.values()) == shape.linear_params(active=False)
    if shape.num_experts:
        assert experts > 0 and shape.active_params < shape.num_params
        active = sum(weights.values()) - experts + experts * shape.experts_per_token // shape.num_experts
    else:
        assert experts == 0 and shape.active_params == shape.num_params
        active = sum(weights.values())
    assert shape.linear_params(active=True) == active
    if shape.num_experts:  # a loop over the experts each token was routed to: the FLOP counter sees their matmuls
        model.set_experts_implementation("eager")
    tokens = 5
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model.base_model(input_ids=torch.arange(tokens)[None], position_ids=torch.arange(tokens)[None])
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    linear = counts.get("aten.mm", 0) + counts.get("aten.addmm", 0)
    assert linear == tokens * shape.num_layers * linear_fwd_flops_per_token(shape)


def test_mla_and_moe_fields_from_hf_names():
    deepseek = parse_model_shape({**HF_TINY, "num_key_value_heads": 4, "qk_nope_head_dim": 16,
                                  "qk_rope_head_dim": 8, "v_head_dim": 12, "kv_lora_rank": 32, "q_lora_rank": None,
                                  "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 24,
                                  "n_shared_experts": 2, "first_k_dense_replace": 1})
    assert (deepseek.head_dim, deepseek.v_head_dim, deepseek.kv_lora_rank, deepseek.q_lora_rank) == (24, 12, 32, 0)
    assert (deepseek.num_experts, deepseek.experts_per_token, deepseek.moe_ffn) == (8, 2, 24)
    assert (deepseek.shared_ffn, deepseek.dense_layers, deepseek.active_ffn) == (48, 1, 128)
    qwen_moe = parse_model_shape({**HF_TINY, "num_experts": 4, "num_experts_per_tok": 1, "moe_intermediate_size": 8,
                                  "decoder_sparse_step": 2, "mlp_only_layers": []})
    assert qwen_moe.dense_layers == 1 and qwen_moe.active_ffn == 128  # layer 0 dense, layer 1 MoE
    # our own names round-trip, and a dense shape keeps the old Llama counts
    assert parse_model_shape({k: getattr(deepseek, k) for k in ("name", *deepseek.__dataclass_fields__)
                              if k != "name"}) == deepseek.__class__(**{**deepseek.__dict__, "name": "custom"})
    assert MODEL_SHAPES["llama3-8b"].num_params == MODEL_SHAPES["llama3-8b"].active_params == 8_030_261_248
    with pytest.raises(UserError, match="experts_per_token"):
        ModelShape("x", 64, 2, 4, 2, 128, 100, num_experts=4, experts_per_token=5)
