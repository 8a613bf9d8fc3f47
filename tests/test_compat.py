"""Tests for hbp_train/compat.py: features the packed path cannot honour are refused before any weight is loaded,
in one line naming the feature, the family and what would work; every family of the support matrix passes."""

from __future__ import annotations

import pytest

from hbp_train.compat import check_model_support
from hbp_train.errors import UserError
from hbp_train.families import FAMILIES, tiny_config
from hbp_train.model import ModelConfig, hf_config_for


def _config(family, **overrides):
    return hf_config_for(ModelConfig(config=tiny_config(family, **overrides), architecture=family), vocab_size=128)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_of_the_matrix_is_supported(family):
    check_model_support(_config(family), longest_sample=256, sp_degrees=[1, 2, 4], backend="sdpa_block")


@pytest.mark.parametrize("family, overrides, longest, sp, expected", [
    # a window shorter than the longest sample: layer windows (Gemma) and the config's (Mistral)
    ("gemma3_text", {"sliding_window": 32}, 64, [1], r"gemma3_text.*sliding-window.*sliding_window=32.*--max-len 32"),
    ("mistral", {"sliding_window": 48}, 64, [1], r"mistral.*sliding_window=48.*sliding_window=null"),
    ("gemma3_text", {"final_logit_softcapping": 30.0}, 16, [1], r"final logit soft-capping.*chunked LM-head loss"),
    ("llama", {"attention_dropout": 0.1}, 16, [1], r"llama.*attention dropout.*attention_dropout=0"),
    ("llama", {}, 16, [1, 3], r"llama.*sp=3 does not divide.*SP degrees that work: 1, 2, 4"),
    ("mistral", {"num_attention_heads": 8, "num_key_value_heads": 4}, 16, [8, 16],
     r"sp=16 does not divide the model's 8 attention heads"),
])
def test_unsupported_features_are_refused_in_one_line(family, overrides, longest, sp, expected):
    with pytest.raises(UserError, match=expected) as err:
        check_model_support(_config(family, **overrides), longest_sample=longest, sp_degrees=sp,
                            backend="sdpa_block")
    assert "\n" not in str(err.value)


def test_a_window_at_least_as_long_as_every_sample_is_plain_causal_attention():
    check_model_support(_config("gemma3_text", sliding_window=64), longest_sample=64, sp_degrees=[1],
                        backend="sdpa_block")


def test_families_outside_the_matrix_with_unsupported_features():
    from transformers import AutoConfig

    tiny = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=128)
    with pytest.raises(UserError, match=r"gemma2.*attention logit soft-capping \(attn_logit_softcapping=50"):
        check_model_support(AutoConfig.for_model("gemma2", **tiny), 16, [1], "sdpa_block")
    with pytest.raises(UserError, match=r"gpt_oss.*attention sinks"):
        check_model_support(AutoConfig.for_model("gpt_oss", **tiny, num_local_experts=4), 16, [1], "sdpa_block")
