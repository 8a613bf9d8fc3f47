"""Tests for hbp_train/model/moe.py: the MoE router loss of every family under the key its checkpoints use.

HF's load-balancing loss (router_aux_loss_coef; JetMoE's aux_loss_coef) equals the model's own aux_loss on one
unpacked sample (and the model's own total loss and gradients), for tiny configs of several families carrying their
real keys; DeepSeek's (aux_loss_alpha, seq_aux, scoring_func) equals its published formula on each sample run alone
(values and gradients), per sample and per pack; only real tokens count; a model without a weight says so in one
line naming the key that turns it on, for every MoE family transformers ships. SP=2 == SP=1 with the router loss
included, and the trainer logging loss/aux for Mixtral and DeepSeek-V3: tests/test_families.py."""

from __future__ import annotations

import pytest
import torch

from hbp_train.model.packed_lm import PackedCausalLM
from hbp_train.model.families import tiny_config
from hbp_train.common.labels import IGNORE_INDEX
from hbp_train.model.loss import normalize_loss
from hbp_train.model.hf_model import ModelConfig, build_model, forward_hidden
from hbp_train.model.moe import COEF_KEYS, pack_aux_loss, records_router_logits, router_aux_of, router_loss_line

VOCAB = 128


# Tiny MoE families beyond the support matrix (hbp_train/model/families.py), each with 4 experts, top-2.
_SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512)
EXTRA_FAMILIES = {
    "jetmoe": dict(_SMALL, num_local_experts=4, num_experts_per_tok=2, kv_channels=16),
    "olmoe": dict(_SMALL, num_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(_SMALL, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=32),
    "granitemoe": dict(_SMALL, num_local_experts=4, num_experts_per_tok=2),
    "phimoe": dict(_SMALL, num_local_experts=4, num_experts_per_tok=2),
}
# The key each family's checkpoints hold the router-loss weight under (HF's load-balancing loss).
HF_LOSS_KEYS = {"mixtral": "router_aux_loss_coef", "qwen3_moe": "router_aux_loss_coef", "jetmoe": "aux_loss_coef",
                "olmoe": "router_aux_loss_coef", "qwen2_moe": "router_aux_loss_coef",
                "granitemoe": "router_aux_loss_coef", "phimoe": "router_aux_loss_coef"}


def _model(family, **overrides):
    base = EXTRA_FAMILIES[family] if family in EXTRA_FAMILIES else tiny_config(family)
    key = HF_LOSS_KEYS.get(family, "router_aux_loss_coef")
    return build_model(ModelConfig(config={**base, key: 0.25, **overrides}, architecture=family, seed=1),
                       vocab_size=VOCAB)


@pytest.mark.parametrize("family", sorted(HF_LOSS_KEYS))
def test_aux_equals_the_models_own_on_one_unpacked_sample(family):
    model = _model(family)
    aux_cfg = router_aux_of(model.config)
    assert aux_cfg is not None and aux_cfg.coef == 0.25 and aux_cfg.key == HF_LOSS_KEYS[family]
    ids = torch.randint(0, VOCAB, (1, 11), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(11)[None]
    shift_labels = torch.cat([ids[:, 1:], torch.tensor([[IGNORE_INDEX]])], dim=1)
    # HF: mean token CE + coef * aux_loss, over the whole (unpadded) sample
    model.zero_grad()
    hf = model(input_ids=ids, position_ids=positions, labels=ids, output_router_logits=True)
    hf.loss.backward()
    hf_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    # ours: chunked token losses + the pack's aux given to each loss token, through the ave_token normaliser
    model.zero_grad()
    wrapper = PackedCausalLM(model, chunk_size=4, router_aux=True)
    loss_T = wrapper(ids, positions, shift_labels)
    aux = pack_aux_loss(wrapper.router_logits, 11, aux_cfg, lambda t: t)
    torch.testing.assert_close(aux, hf.aux_loss.float(), rtol=1e-5, atol=1e-6)
    has_label_T = (shift_labels[0] != IGNORE_INDEX).float()
    total = normalize_loss(loss_T + aux_cfg.coef * aux * has_label_T, shift_labels, None, "ave_token",
                           global_loss_tokens=int(has_label_T.sum()), dp_world_size=1)
    total.backward()
    torch.testing.assert_close(total, hf.loss, rtol=1e-5, atol=1e-6)
    for name, grad in hf_grads.items():
        torch.testing.assert_close(model.get_parameter(name).grad, grad, rtol=1e-4, atol=1e-6, msg=name)


def test_only_real_tokens_count():
    """Padding after the real tokens (an SP slice's tail) changes nothing."""
    model = _model("mixtral")
    aux_cfg = router_aux_of(model.config)
    wrapper = PackedCausalLM(model, chunk_size=4, router_aux=True)
    ids = torch.randint(0, VOCAB, (1, 9), generator=torch.Generator().manual_seed(2))
    labels = torch.full((1, 9), IGNORE_INDEX)
    wrapper(ids, torch.arange(9)[None], labels)
    real = pack_aux_loss(wrapper.router_logits, 9, aux_cfg, lambda t: t)
    padded = torch.cat([ids, torch.zeros((1, 3), dtype=ids.dtype)], dim=1)
    wrapper(padded, torch.cat([torch.arange(9), torch.arange(3)])[None], torch.full((1, 12), IGNORE_INDEX))
    torch.testing.assert_close(pack_aux_loss(wrapper.router_logits, 9, aux_cfg, lambda t: t), real)
    assert float(pack_aux_loss(wrapper.router_logits, 0, aux_cfg, lambda t: t).detach()) == 0.0  # a dummy pack


def test_no_router_loss_without_a_weight_says_so_in_one_line_with_the_key_that_turns_it_on():
    llama = build_model(ModelConfig(config=tiny_config("llama"), architecture="llama"), VOCAB)
    assert router_aux_of(llama.config) is None and router_loss_line(llama.config, records_router_logits(llama)) is None
    off = _model("mixtral", router_aux_loss_coef=0.0)
    assert router_aux_of(off.config) is None
    assert router_loss_line(off.config, records_router_logits(off)) == (
        "[train] mixtral: an MoE model trained WITHOUT a router (load-balancing) loss: its config sets no positive "
        "router_aux_loss_coef / aux_loss_coef / aux_loss_alpha; ++model.config.router_aux_loss_coef=<weight> turns "
        "one on")
    # transformers' DeepSeek-V3 config has no weight at all (its checkpoints carry aux_loss_alpha)
    deepseek = build_model(ModelConfig(config=tiny_config("deepseek_v3"), architecture="deepseek_v3"), VOCAB)
    assert router_aux_of(deepseek.config) is None and records_router_logits(deepseek)
    line = router_loss_line(deepseek.config, True)
    assert line.startswith("[train] deepseek_v3: an MoE model trained WITHOUT a router") and "\n" not in line
    assert "++model.config.router_aux_loss_coef=<weight>" in line and "++model.config.aux_loss_alpha=<weight>" in line
    on = _model("mixtral")
    assert router_loss_line(on.config, True) == ("[train] mixtral: MoE router loss router_aux_loss_coef=0.25 (HF's "
                                                 "load-balancing loss, per pack), logged as loss/aux")


def _moe_causal_lm_configs():
    """(model_type, default config) of every causal LM transformers ships whose config names routed experts."""
    import warnings

    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                config = CONFIG_MAPPING[model_type]()
            except Exception:  # a config class that needs arguments (or is missing here) is not a family we can build
                continue
        try:  # a multimodal family: its language model's config
            config = config.get_text_config()
        except ValueError:  # several text configs (an encoder-decoder): none is a causal LM's
            continue
        if any((getattr(config, k, 0) or 0) > 1 for k in ("num_local_experts", "n_routed_experts", "num_experts",
                                                         "moe_num_experts")):
            out.append((model_type, config))
    return out


def test_every_moe_family_transformers_ships_is_honoured_or_announced():
    """Each MoE causal LM's default config: a positive weight under one of COEF_KEYS is the loss it trains with,
    under that key; without one, the start line says it trains with none (and how to add one, when hbp-train reads
    the family's experts)."""
    from hbp_train.common.errors import UserError
    from hbp_train.perf.shape import parse_model_shape

    families = _moe_causal_lm_configs()
    assert len(families) >= 10 and {"mixtral", "deepseek_v3", "jetmoe"} <= {name for name, _ in families}
    checked = 0
    for name, config in families:
        try:
            parse_model_shape(config)
        except (UserError, RuntimeError):  # a default config the shape reader refuses (no experts per token, no
            continue                       # ffn width, per-layer head counts): such a model is not trained at all
        checked += 1
        line = router_loss_line(config, True)
        assert line is not None and "\n" not in line and line.startswith(f"[train] {config.model_type}: "), name
        weights = {k: getattr(config, k) for k in COEF_KEYS if getattr(config, k, None) is not None}
        aux = router_aux_of(config)
        if aux is not None:
            key = next(iter(weights))
            assert aux.key == key and aux.coef == weights[key] > 0, name
            assert f"MoE router loss {key}=" in line, name
        else:
            assert "trained WITHOUT a router" in line, name
            assert "turns one on" in line or "does not read this family's expert count" in line, name
    assert checked >= 0.75 * len(families), (checked, len(families))


# DeepSeek's router loss, transcribed from DeepSeek-V2's published MoEGate (modeling_deepseek.py), unweighted:
# per MoE layer over one batch of bsz sequences; seq_aux: per sequence, else over all the batch's tokens.
def deepseek_reference_aux(scores, topk_idx, seq_aux: bool, num_experts: int, top_k: int, bsz: int, seq_len: int):
    topk_idx_for_aux_loss = topk_idx.view(bsz, -1)
    if seq_aux:
        scores_for_seq_aux = scores.view(bsz, seq_len, -1)
        ce = torch.zeros(bsz, num_experts)
        ce.scatter_add_(1, topk_idx_for_aux_loss, torch.ones(bsz, seq_len * top_k)).div_(seq_len * top_k / num_experts)
        return (ce * scores_for_seq_aux.mean(dim=1)).sum(dim=1).mean()
    mask_ce = torch.nn.functional.one_hot(topk_idx_for_aux_loss.view(-1), num_classes=num_experts)
    ce = mask_ce.float().mean(0)
    return (scores.mean(0) * ce * num_experts).sum()


DEEPSEEK = {  # tiny DeepSeek-V2 (group-limited softmax routing) and V3 (sigmoid + bias) with their checkpoints' keys
    "deepseek_v2": dict(tiny_config("deepseek_v3"), n_group=2, topk_group=1, topk_method="group_limited_greedy",
                        scoring_func="softmax"),
    "deepseek_v3": dict(tiny_config("deepseek_v3"), n_group=2, topk_group=1, scoring_func="sigmoid"),
}
LENGTHS = (7, 12, 5)


@pytest.mark.parametrize("family", sorted(DEEPSEEK))
@pytest.mark.parametrize("seq_aux", [True, False])
def test_deepseek_aux_equals_its_published_formula_on_the_samples_alone(family, seq_aux):
    """A pack of three samples: each loss token's aux is DeepSeek's loss (summed over MoE layers) of its sample run
    alone (seq_aux) or of the three as one batch, with the experts the router really chose; so are the gradients."""
    config = dict(DEEPSEEK[family], aux_loss_alpha=0.001, seq_aux=seq_aux)
    model = build_model(ModelConfig(config=config, architecture=family, seed=2), vocab_size=VOCAB)
    aux_cfg = router_aux_of(model.config)
    assert aux_cfg.deepseek and aux_cfg.coef == 0.001 and aux_cfg.per_sample == seq_aux
    assert aux_cfg.sigmoid == (family == "deepseek_v3")
    gen = torch.Generator().manual_seed(4)
    samples = [torch.randint(0, VOCAB, (n,), generator=gen) for n in LENGTHS]
    # ours: one pack
    ids = torch.cat(samples)[None]
    positions = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    sample_ids = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))[None]
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(LENGTHS), 0).tolist()], dtype=torch.int32)
    wrapper = PackedCausalLM(model, chunk_size=8, router_aux=True, router_choices=True)
    model.zero_grad()
    wrapper(ids, positions, torch.full_like(ids, IGNORE_INDEX), cu, max(LENGTHS))
    assert len(wrapper.router_choices) == len(wrapper.router_logits) == 1  # one MoE layer (the first is dense)
    aux_T = pack_aux_loss(wrapper.router_logits, ids.shape[1], aux_cfg, lambda t: t, wrapper.router_choices,
                          sample_ids, len(LENGTHS))
    aux_T = aux_T.expand(ids.shape[1]) if aux_T.dim() == 0 else aux_T
    aux_T.sum().backward()
    ours = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    # the reference: each sample alone, its router outputs into DeepSeek's formula
    model.zero_grad()
    per_sample = []
    for sample in samples:
        logits, chosen = [], []
        forward_hidden(model, sample[None], torch.arange(len(sample))[None], router_logits=logits,
                       router_choices=chosen)
        scores = [torch.sigmoid(x) / torch.sigmoid(x).sum(-1, keepdim=True) if aux_cfg.sigmoid else x.softmax(-1)
                  for x in logits]
        per_sample.append((scores, chosen))
    reference = []
    if seq_aux:
        for (scores, chosen), n in zip(per_sample, LENGTHS):
            reference.append(sum(deepseek_reference_aux(s, c, True, 4, 2, 1, n) for s, c in zip(scores, chosen)))
        expected_T = torch.cat([r.expand(n) for r, n in zip(reference, LENGTHS)])
    else:
        layers = len(per_sample[0][0])
        batch = sum(deepseek_reference_aux(torch.cat([p[0][l] for p in per_sample]),
                                           torch.cat([p[1][l] for p in per_sample]), False, 4, 2, 1, sum(LENGTHS))
                    for l in range(layers))
        expected_T = batch.expand(sum(LENGTHS))
    torch.testing.assert_close(aux_T.detach(), expected_T.detach(), rtol=1e-5, atol=1e-7)
    assert float(expected_T.min()) > 0
    expected_T.sum().backward()
    reference_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    assert ours.keys() == reference_grads.keys() and any("gate" in n for n in ours)
    for name, grad in ours.items():
        torch.testing.assert_close(grad, reference_grads[name], rtol=1e-4, atol=1e-7, msg=name)
