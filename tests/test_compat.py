"""Tests for hbp_train/model/compat.py: features the packed path cannot honour are refused before any weight is loaded,
in one line naming the feature, the family and what would work; every family of the support matrix passes."""

from __future__ import annotations

import pytest

from hbp_train.model.compat import _meta_model, check_logit_head, check_model_support, logit_head_of
from hbp_train.common.errors import UserError
from hbp_train.model.families import FAMILIES, tiny_config
from hbp_train.model.hf_model import ModelConfig, hf_config_for
from hbp_train.model.loss import LogitHead


def _config(family, **overrides):
    return hf_config_for(ModelConfig(config=tiny_config(family, **overrides), architecture=family), vocab_size=128)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_family_of_the_matrix_is_supported(family):
    check_model_support(_config(family), longest_sample=256, sp_degrees=[1, 2, 4], backend="sdpa_block")


@pytest.mark.parametrize("family, overrides, longest, sp, expected", [
    # a window shorter than the longest sample: layer windows (Gemma) and the config's (Mistral)
    ("gemma3_text", {"sliding_window": 32}, 64, [1], r"gemma3_text.*sliding-window.*sliding_window=32.*--max-len 32"),
    ("mistral", {"sliding_window": 48}, 64, [1], r"mistral.*sliding_window=48.*sliding_window=null"),
    ("cohere", {"logit_scale": 0.0}, 16, [1], r"cohere \(model.config.logit_scale\): must be a positive number"),
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


def test_what_the_head_does_to_the_logits_is_read_from_the_config():
    """Granite divides the logits by logits_scaling, Cohere multiplies them by logit_scale, Gemma soft-caps them:
    the loss's LogitHead says so; the other families of the matrix leave them as the LM head makes them."""
    assert logit_head_of(_config("granite")) == LogitHead(scale=1 / 16)
    assert logit_head_of(_config("cohere")) == LogitHead(scale=0.0625)
    assert logit_head_of(_config("gemma3_text", final_logit_softcapping=30.0)) == LogitHead(softcap=30.0)
    assert logit_head_of(_config("granite", logits_scaling=1.0)) == LogitHead()
    for family in set(FAMILIES) - {"granite", "cohere"}:
        assert logit_head_of(_config(family)) == LogitHead(), family


@pytest.mark.parametrize("family", ["granite", "cohere"])
def test_the_logit_head_check_runs_on_the_host_whatever_the_default_device(family):
    """The check draws its probe with a host generator: under a caller's default device (``with torch.device(
    "cuda")``, where a host generator cannot fill a tensor; the meta device stands for it here) its tensors must still
    be made on the host, and it must still tell the model's head from another one."""
    import torch

    config = _config(family)
    with torch.device("meta"):
        check_logit_head(_meta_model(config), logit_head_of(config), family)
        with pytest.raises(UserError, match="its forward changes the LM head's logits"):
            check_logit_head(_meta_model(config), LogitHead(scale=2.0), family)


@pytest.mark.parametrize("family", ["recurrent_gemma", "xlstm", "inkling_text"])
def test_a_head_the_loss_would_not_reproduce_is_refused_in_one_line(family):
    """Families transformers ships whose forward changes the logits otherwise (RecurrentGemma and xLSTM soft-cap
    them under other config fields, Inkling slices the vocabulary): the probe of their own forward finds it."""
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING[family]()
    with pytest.raises(UserError, match=rf"^{family} .*: its forward changes the LM head's logits in a way the packed "
                                        r"LM-head loss does not reproduce \(on a probe: .*apart") as err:
        check_logit_head(_meta_model(config), logit_head_of(config), f"{family} (model.architecture)")
    assert "\n" not in str(err.value)


def test_a_head_with_layers_before_its_output_embeddings_is_refused_in_one_line():
    """BERT-style heads (a dense layer and a norm before the output embeddings): the loss would skip them."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("roberta", is_decoder=True, hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=32, vocab_size=128)
    with pytest.raises(UserError, match=r"roberta.*its forward changes the LM head's logits"):
        check_logit_head(_meta_model(config), logit_head_of(config), "roberta")


@pytest.mark.full  # ~40 s: every causal LM transformers ships, built on the meta device
def test_every_causal_lm_transformers_ships_gets_its_own_logits_or_is_refused_in_one_line():
    """The probe runs on every causal LM whose default config builds: no crash, only one-line refusals; the ones
    whose forward scales or soft-caps the logits under a field the loss reads are accepted with that transform,
    and the ones that do something else are refused."""
    import warnings

    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    accepted, refused = {}, {}
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                config = CONFIG_MAPPING[model_type]()
                model = _meta_model(config)
            except Exception:  # a default config that does not build (needs arguments, an extra package)
                continue
        try:
            head = logit_head_of(config)
            check_logit_head(model, head, model_type)
            accepted[model_type] = head
        except UserError as err:
            assert "\n" not in str(err), model_type
            refused[model_type] = str(err)
    assert len(accepted) >= 120, len(accepted)
    assert {"llama", "qwen3", "mixtral", "deepseek_v3", "opt"} <= set(accepted)
    for model_type, head in {"cohere": LogitHead(scale=0.0625), "cohere2": LogitHead(scale=0.0625),
                             "gemma2": LogitHead(softcap=30.0), "vaultgemma": LogitHead(softcap=30.0),
                             "minicpm3": LogitHead(scale=0.1)}.items():
        assert accepted[model_type] == head, model_type
    assert {"recurrent_gemma", "xlstm", "inkling_text", "bert", "roberta"} <= set(refused)


def test_samples_longer_than_the_models_positions_are_refused_unless_rope_scaling_provides_them():
    """A pack may be longer than max_position_embeddings (positions restart in every sample); a sample may not,
    unless the config's RoPE scaling stretches the positions: then one line says how (a 1024-position model used to
    train on 8192-token samples without a word)."""
    from hbp_train.model.compat import check_positions

    assert check_positions(_config("qwen2", max_position_embeddings=1024), 1024) is None
    with pytest.raises(UserError, match=r"qwen2 .*samples reach 8192 tokens but the model has 1024 positions "
                                        r"\(max_position_embeddings\); re-plan .*--max-len 1024.*rope_scaling="
                                        r"\{rope_type:yarn,factor:8,original_max_position_embeddings:1024\} "
                                        r"\+\+model.config.max_position_embeddings=8192") as err:
        check_positions(_config("qwen2", max_position_embeddings=1024), 8192)
    assert "\n" not in str(err.value)
    yarn = _config("qwen2", max_position_embeddings=1024,
                   rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024})
    assert "RoPE scaling provides 4096 positions (yarn, factor 4 x 1024" in check_positions(yarn, 4000)
    with pytest.raises(UserError, match="1024 positions \\(max_position_embeddings; RoPE scaling yarn gives 4096\\)"):
        check_positions(yarn, 8192)
    # Gemma 3 scales its full-attention layers only; its sliding-window layers never look further than the window.
    gemma = _config("gemma3_text", max_position_embeddings=1024, rope_scaling={"rope_type": "linear", "factor": 8.0})
    assert "8192 positions (linear" in check_positions(gemma, 4000)
    with pytest.raises(UserError, match=r"rope_parameters=\{\.\.\.\} with a scaling"):
        check_positions(_config("gemma3_text", max_position_embeddings=1024), 4000)


def test_the_start_of_run_line_says_rope_is_applied_per_sample():
    """Where a RoPE reads the sequence length (dynamic's base, longrope's factors), the line says that each sample's
    own length sets it (hbp_train/model/rope.py); a Phi-3 longrope's samples past its original positions get the line
    even within max_position_embeddings."""
    from hbp_train.model.compat import check_positions

    dynamic = _config("llama", max_position_embeddings=1024,
                      rope_scaling={"rope_type": "dynamic", "factor": 4.0})
    assert check_positions(dynamic, 3000) == (
        "[train] the plan's samples reach 3000 tokens, beyond max_position_embeddings 1024 of llama: RoPE scaling "
        "provides 4096 positions (dynamic, factor 4 x 1024; model.config.rope_scaling); RoPE is applied per sample "
        "(each sample gets the cos/sin the model gives it alone: a sample's own length sets the base)")
    longrope = _config("phi3", max_position_embeddings=2048, original_max_position_embeddings=256,
                       rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                        "long_factor": [2.0] * 8})
    assert check_positions(longrope, 256) is None
    assert check_positions(longrope, 1000) == (
        "[train] the plan's samples reach 1000 tokens, past the 256 original positions of phi3's longrope RoPE: RoPE "
        "is applied per sample (each sample gets the cos/sin the model gives it alone: a sample's own length picks "
        "the long or the short factors, in a pack and under SP alike)")


def test_the_build_refuses_samples_beyond_the_positions_before_any_weight_loads(tmp_path, tokenizer_dir, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from hbp_train import build, config

    from hbp_train.model import hf_model as model
    from tests.assets.packed_fixture import ONE_RANK_STEPS, synthetic_samples, write_packed

    model_dir = tmp_path / "model"
    shape = tiny_config("qwen2", vocab_size=4096, max_position_embeddings=1024)
    AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen2", **shape)).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(model_dir)
    shards = write_packed(str(tmp_path / "packed"), synthetic_samples(12, 4096, seed=1), ONE_RANK_STEPS, world_size=1,
                          plan_extra={"max_len": 2048})  # a plan that may hold 2048-token samples
    monkeypatch.setattr(model, "build_model", lambda *a, **k: pytest.fail("read the weights first"))
    cfg = config.load([f"model.name_or_path={model_dir}", f"data.shards={shards}", f"train.out_dir={tmp_path}/run"])
    with pytest.raises(UserError, match="the plan's samples reach 2048 tokens but the model has 1024 positions"):
        build.build(cfg)
