"""Tests for hbp_train/moe.py: the MoE router loss of a pack equals the model's own aux_loss on one unpacked
sample (and the model's own total loss and gradients), counts real tokens only, and is off for models without a
coefficient. SP=2 == SP=1 with the aux loss included: tests/test_families.py."""

from __future__ import annotations

import pytest
import torch

from hbp_train.build import PackedCausalLM
from hbp_train.families import tiny_config
from hbp_train.labels import IGNORE_INDEX
from hbp_train.loss import normalize_loss
from hbp_train.model import ModelConfig, build_model
from hbp_train.moe import pack_aux_loss, router_aux_of

VOCAB = 128


def _model(family, **overrides):
    return build_model(ModelConfig(config=tiny_config(family, **{"router_aux_loss_coef": 0.25, **overrides}),
                                   architecture=family, seed=1), vocab_size=VOCAB)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_aux_equals_the_models_own_on_one_unpacked_sample(family):
    model = _model(family)
    aux_cfg = router_aux_of(model.config)
    assert aux_cfg is not None and aux_cfg.coef == 0.25
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


def test_no_router_loss_without_a_coefficient_or_experts():
    assert router_aux_of(_model("llama").config) is None
    assert router_aux_of(_model("mixtral", router_aux_loss_coef=0.0).config) is None
    deepseek = build_model(ModelConfig(config=tiny_config("deepseek_v3"), architecture="deepseek_v3"), VOCAB)
    assert router_aux_of(deepseek.config) is None  # bias-balanced routing, no aux coefficient in its config
