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
    ("gemma3_text", {"use_bidirectional_attention": True}, 64, [1],
     r"gemma3_text.*its attention \(Gemma3Attention\) asks for bidirectional attention \(is_causal=False\)"),
    ("gemma2", {"attn_logit_softcapping": -1.0}, 16, [1],
     r"gemma2 .*model.config.attn_logit_softcapping.*must be a positive number or null"),
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


def test_windows_and_softcaps_are_implemented_and_read_from_the_layers_calls():
    """A window shorter than every sample, Gemma 2's soft-cap: accepted (the packed attention applies them), and
    what the layers really hand their attention is what counts: a window field the family does not read (Llama) is
    no window."""
    qwen2_windows = {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}
    for family, overrides, expected in (("gemma3_text", {"sliding_window": 4}, [4, None]),
                                        ("mistral", {"sliding_window": 4}, [4, 4]),
                                        ("gemma2", {"sliding_window": 4}, [4, None]),
                                        ("qwen2", qwen2_windows, [None, 4])):
        calls = check_model_support(_config(family, **overrides), longest_sample=64, sp_degrees=[1, 2],
                                    backend="sdpa_block")
        assert [c.window for c in calls.calls] == expected, family
    assert check_model_support(_config("gemma2"), 64, [1], "sdpa_block").softcaps == {50.0}
    assert not check_model_support(_config("llama", sliding_window=4), 64, [1], "sdpa_block").windows


def test_heads_come_from_the_layers_not_from_a_field_the_family_does_not_read():
    """Issue 43, item 5: a GPT-NeoX config carrying a stray num_key_value_heads=2 has 4 kv heads in its layers (it
    reads no such field); SP=4 splits them, and Ulysses is sized by 4 (tests/test_attention_features.py runs it)."""
    from hbp_train.model.attention_calls import attention_heads

    neox = stray_kv_heads_config()
    assert neox.num_key_value_heads == 2 and attention_heads(neox) == (4, 4, 16, 16)
    assert check_model_support(neox, 16, [1, 2, 4], "sdpa_block").heads == (4, 4, 16, 16)


def stray_kv_heads_config():
    from transformers import AutoConfig

    return AutoConfig.for_model("gpt_neox", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                num_attention_heads=4, num_key_value_heads=2, vocab_size=128)


def test_a_named_backend_that_cannot_apply_the_models_features_is_refused_up_front(monkeypatch):
    from hbp_train.model import compat

    monkeypatch.setattr(compat, "feature_problem",
                        lambda name, window, softcap: "no soft-cap here" if softcap else None)
    with pytest.raises(UserError, match=r"^model.attention_backend=torch_varlen cannot apply gemma2's sliding window 6 "
                                        r"and soft-cap 50 \(no soft-cap here\); choose auto") as err:
        check_model_support(_config("gemma2"), 64, [1], "torch_varlen")
    assert "\n" not in str(err.value)
    check_model_support(_config("gemma2"), 64, [1], "auto")  # auto's probe skips such a kernel by itself


@pytest.mark.parametrize("family, overrides, expected", [
    ("gpt_oss", {"num_local_experts": 4}, r"gpt_oss.*attention sinks"),
    ("llama4_text", {"attention_chunk_size": 8},
     r"llama4_text.*chunked attention \(attention_chunk_size=8\).*samples reach 64 tokens.*--max-len 8"),
    ("llama4_text", {"attention_chunk_size": 64, "num_hidden_layers": 4},  # layer 3 is a NoPE layer
     r"llama4_text.*attention temperature tuning.*attn_temperature_tuning"),
    ("qwen3_next", {}, r"qwen3_next.*layers that mix tokens without attention.*layer_types linear_attention"),
    ("falcon_h1", {}, r"falcon_h1.*layers that mix tokens without attention.*layer_types hybrid"),
    ("bloom", {}, r"bloom.*does not go through transformers' attention-function interface"),
    ("deepseek_v32", {}, r"deepseek_v32.*attention of kind indexed_attention"),
])
def test_families_outside_the_matrix_with_unsupported_features(family, overrides, expected):
    """Refused before any weight loads, one line each (the full-tier scan below runs every causal LM transformers
    ships)."""
    from transformers import AutoConfig

    tiny = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, vocab_size=128)
    with pytest.raises(UserError, match=expected) as err:
        check_model_support(AutoConfig.for_model(family, **{**tiny, **overrides}), 64, [1], "sdpa_block")
    assert "\n" not in str(err.value)


def test_at_sp2_the_layers_must_hand_their_attention_position_ids():
    """CTRL's layers pass no position_ids to their attention: enough at sp=1 (the trainer hands them the pack's
    boundaries), not under Ulysses, which gathers position_ids (DeepSpeed would assert)."""
    from transformers import AutoConfig

    ctrl = AutoConfig.for_model("ctrl", n_embd=64, n_head=4, n_layer=2, dff=64, vocab_size=128)
    check_model_support(ctrl, 64, [1], "sdpa_block")
    with pytest.raises(UserError, match=r"ctrl.*not handed position_ids, which Ulysses needs.*train it at sp=1"):
        check_model_support(ctrl, 64, [1, 2], "sdpa_block")


def test_what_the_head_does_to_the_logits_is_read_from_the_config():
    """Granite divides the logits by logits_scaling, Cohere multiplies them by logit_scale, Gemma soft-caps them:
    the loss's LogitHead says so; the other families of the matrix leave them as the LM head makes them."""
    assert logit_head_of(_config("granite")) == LogitHead(scale=1 / 16)
    assert logit_head_of(_config("cohere")) == LogitHead(scale=0.0625)
    assert logit_head_of(_config("gemma3_text", final_logit_softcapping=30.0)) == LogitHead(softcap=30.0)
    assert logit_head_of(_config("granite", logits_scaling=1.0)) == LogitHead()
    assert logit_head_of(_config("gemma2")) == LogitHead(softcap=30.0)
    for family in set(FAMILIES) - {"granite", "cohere", "gemma2"}:
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


# ------------------------------------------------------------------ every causal LM: its attention, by value
# A tiny version of any config: these fields where the family has them, features made to bind on SCAN_LENGTHS
# (a window and a chunk of 4 tokens, Llama 4's temperature from position 2, a soft-cap of 2 on logits made large).
SCAN_FIELDS = dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                   vocab_size=128, max_position_embeddings=256, num_local_experts=4, num_experts=4,
                   n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                   shared_expert_intermediate_size=32, ffn_hidden_size=64, n_embd=64, n_head=4, n_layer=2, d_model=64,
                   n_positions=256)
SCAN_FEATURES = dict(sliding_window=4, attention_chunk_size=4, floor_scale=2, attn_logit_softcapping=2.0)
SCAN_LENGTHS = (11, 3, 9)
# Feature variants beside each family's tiny default: (model_type, fields).
SCAN_VARIANTS = [("llama4_text", {"attention_chunk_size": 64}),
                 ("qwen2", {"use_sliding_window": True, "max_window_layers": 1}),
                 ("gemma3_text", {"use_bidirectional_attention": True})]


def scan_config(model_type: str, **extra):
    """A tiny config of ``model_type`` (the support matrix's own for its families), its features binding."""
    from transformers import CONFIG_MAPPING

    default = CONFIG_MAPPING[model_type]()
    present = lambda fields: {k: v for k, v in fields.items() if getattr(default, k, None) is not None}  # noqa
    if model_type in FAMILIES:
        fields = tiny_config(model_type, vocab_size=128, pad_token_id=None, **present(SCAN_FEATURES))
    else:
        fields = present({**SCAN_FIELDS, **SCAN_FEATURES})
        layers = getattr(default, "num_hidden_layers", None)
        if layers:
            fields["num_hidden_layers"] = min(int(layers), 4)
            if getattr(default, "layer_types", None):
                fields["layer_types"] = list(default.layer_types)[:fields["num_hidden_layers"]]
        for key in ("pad_token_id", "bos_token_id", "eos_token_id"):
            if isinstance(getattr(default, key, None), int) and getattr(default, key) >= 128:
                fields[key] = 1
    return CONFIG_MAPPING[model_type](**{**fields, **extra})


def packed_error(config) -> float | None:
    """Largest difference between the logits of a pack through our packed attention (sdpa_block, the boundaries
    as the trainer hands them) and of each sample alone through HF eager, relative to the logits' size; None when
    HF's own forward does not run on this tiny config. Weights drawn large, so that attention is peaked."""
    import torch
    from transformers import AutoModelForCausalLM

    from hbp_train.model.attention_setup import register_packed_attention

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2:
                param.normal_(0, 0.2)
    gen = torch.Generator().manual_seed(1)
    samples = [torch.randint(0, 128, (n,), generator=gen) for n in SCAN_LENGTHS]
    cu = torch.tensor([0, *torch.tensor(SCAN_LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    with torch.no_grad():
        try:
            alone = torch.cat([model(input_ids=s[None], use_cache=False).logits[0] for s in samples])
        except Exception:  # noqa: BLE001 - the tiny config does not run in HF itself
            return None
        register_packed_attention(model, "sdpa_block", torch.device("cpu"))
        packed = model(input_ids=torch.cat(samples)[None], use_cache=False, cu_seq_lens_q=cu,
                       max_length_q=max(SCAN_LENGTHS),
                       position_ids=torch.cat([torch.arange(n) for n in SCAN_LENGTHS])[None]).logits[0]
    return float((packed - alone).abs().max() / alone.abs().max().clamp_min(1e-6))


@pytest.mark.full  # minutes: every causal LM transformers ships, built tiny and run on the CPU
def test_every_causal_lm_transformers_ships_trains_exactly_or_is_refused_in_one_line():
    """What compat accepts trains the model's own attention: for every causal LM whose tiny config builds, the
    check either refuses it in one line or accepts it, and then a pack through the packed attention gives each
    sample's HF eager logits (windows, chunks, caps and Llama 4's temperature made to bind). Nothing crashes."""
    import warnings

    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    import torch

    accepted, refused, differ = {}, {}, []
    cases = [(t, {}) for t in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)] + SCAN_VARIANTS
    for model_type, extra in cases:
        name = model_type + (f" {extra}" if extra else "")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                config = scan_config(model_type, **extra)
                with torch.device("meta"):
                    size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
            except Exception:  # noqa: BLE001 - fields this scan cannot make tiny (the family's own checks)
                continue
            try:
                check_model_support(config, max(SCAN_LENGTHS), [1], "sdpa_block")
            except UserError as err:
                assert "\n" not in str(err), name
                refused[name] = str(err)
                continue
            # a family whose size lies in fields this scan does not know is too large to run here
            error = packed_error(config) if size <= 3_000_000 else None
        if error is not None:
            accepted[name] = error
            if not error < 1e-4:
                differ.append(f"{name}: packed logits off by {error:.3g} of their size")
    assert not differ, "accepted but not exact:\n" + "\n".join(differ)
    assert len(accepted) >= 60, sorted(accepted)
    assert {*FAMILIES, "gpt2", "opt", "gpt_neox", "vaultgemma", "cohere2", "olmo3", "starcoder2"} <= set(accepted)
    for name, why in {"gpt_oss": "attention sinks", "llama4_text": "chunked attention",
                      "llama4_text {'attention_chunk_size': 64}": "attention temperature tuning",
                      "qwen3_5_text": "layers that mix tokens without attention", "bloom": "attention-function",
                      "blenderbot-small": "does not read position_ids",
                      "bert": "bidirectional", "deepseek_v32": "indexed_attention",
                      "gemma3_text {'use_bidirectional_attention': True}": "bidirectional",
                      "zamba2": "layers that mix tokens"}.items():
        assert why in refused.get(name, ""), (name, refused.get(name))
