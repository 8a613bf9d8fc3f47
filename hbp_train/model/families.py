"""The support matrix: the HF model families we test, each as a tiny config built without the hub.

Data only: nothing in the trainer reads this table or branches on a family name (any HF causal LM whose attention
goes through transformers' attention-function interface is trained the same way). tests/test_families.py trains
every entry (packed == per-sample, SP=2 == SP=1, a run over a plan with sp=1 and sp=2 groups, our per-sample losses
== the model's own HF loss) and bench/bench_families.py tabulates them; docs/models.md lists what was tested per
family.

Each entry is ``model.config`` for ``model.architecture=<name>``: small enough for a CPU test, but keeping what
makes the family different (GQA, kv heads fewer than SP=2, q/k norms, MoE routing, MLA's latent projections with
unequal q/k and v head dims, sliding windows shorter than the tests' longest samples, per layer or in every layer,
attention logit soft-capping, tied embeddings, and what the head does to the logits: Granite
divides them by logits_scaling, Cohere multiplies them by logit_scale).
"""

from __future__ import annotations

# Shared by every family: 2 layers of width 64, 4 query heads (so SP=2 and SP=4 divide them).
_BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)

FAMILIES: dict[str, dict] = {
    "llama": {},
    "qwen2": {},
    "qwen3": {"head_dim": 16},  # q/k RMSNorm per head
    # 1 kv head: replicated at SP=2; a window of 8 in every layer (shorter than the tests' longest samples)
    "mistral": {"num_key_value_heads": 1, "sliding_window": 8},
    # a sliding layer (window 6) and a full one, each with its own RoPE
    "gemma3_text": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 6,
                    "layer_types": ["sliding_attention", "full_attention"]},
    # attention logit soft-capping (50) in every layer, a sliding layer and a full one, final logit soft-capping (30)
    "gemma2": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 6,
               "layer_types": ["sliding_attention", "full_attention"]},
    "phi3": {},  # no pad_token_id given: its default (32000) lies outside the tiny vocabulary
    # the multipliers of Granite-3.x-8B: embeddings, residual branches, attention scale, logits divided by 16
    "granite": {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.0078125,
                "logits_scaling": 16.0},
    # LayerNorm (not RMSNorm) with q/k norms per head, parallel attention + MLP, interleaved RoPE, tied embeddings,
    # logits multiplied by logit_scale (Command R's)
    "cohere": {"use_qk_norm": True, "logit_scale": 0.0625},
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen3_moe": {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "decoder_sparse_step": 1, "mlp_only_layers": []},
    # MLA: q/k head dim 16 + 8 (rope) = 24, v head dim 16; the first layer dense, the second MoE with a shared expert
    "deepseek_v3": {"num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16,
                    "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
                    "moe_intermediate_size": 32, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
                    "topk_group": 1},
}


def tiny_config(family: str, **overrides) -> dict:
    """``model.config`` of the tiny ``family`` model (plus overrides)."""
    return {**_BASE, **FAMILIES[family], **overrides}
