"""The MoE router (load-balancing) loss of a packed, sequence-parallel step.

HF MoE models (Mixtral, Qwen-MoE, ...) add ``router_aux_loss_coef · aux`` to the LM loss, where for one forward
``aux = E · Σ_e f_e · P_e``: f_e the share of (token, layer) top-k assignments that went to expert e, P_e the
mean router probability of e, both over every real token of every MoE layer (transformers'
``load_balancing_loss_func``). The trainer runs the decoder and its own chunked loss, so it adds this itself:

* per pack (the analogue of one HF forward): over the pack's real tokens only (no SP padding, no dummy pack);
* under SP each rank holds a slice of the pack: the counts, the probability sums and the token count are summed
  over the SP group (the probabilities with the differentiable all-reduce) before the product, so every rank
  gets the pack's aux exactly;
* normalised like the LM loss: the pack's aux is given to each of its loss tokens (``aux_T``) and goes through the
  same normaliser, so ave_token weighs packs by loss tokens, sample_mean by samples, sum adds it per token;
* logged as ``loss/aux`` (unweighted, as HF's ``aux_loss``): the loss-token-weighted mean over the step's packs.

Enabled when the model's config has ``router_aux_loss_coef`` > 0 and routed experts (``model.config`` may set it
to 0 to turn it off). Models without the coefficient (DeepSeek-V3 balances with a bias instead) get none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hbp_train.perf.shape import parse_model_shape


@dataclass(frozen=True)
class RouterAux:
    """What the router loss of a model needs from its config."""

    coef: float
    """router_aux_loss_coef: the weight of aux in the loss."""
    num_experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Experts per token (num_experts_per_tok)."""


def router_aux_of(hf_config) -> Optional[RouterAux]:
    """The router loss settings of a model's HF config, or None when it has none (dense, or no coefficient)."""
    coef = float(getattr(hf_config, "router_aux_loss_coef", 0.0) or 0.0)
    shape = parse_model_shape(hf_config)
    if coef <= 0 or not shape.num_experts:
        return None
    return RouterAux(coef=coef, num_experts=shape.num_experts, top_k=shape.experts_per_token)


def router_sums(router_logits, num_real: int, aux: RouterAux) -> tuple:
    """This rank's sums over its first ``num_real`` tokens (the real ones; padding is at the end of a slice) of
    every MoE layer: top-k assignment counts per expert [E] (no gradient), router probabilities per expert [E]
    and the number of (token, layer) rows."""
    first = router_logits[0]
    counts = torch.zeros(aux.num_experts, dtype=torch.float32, device=first.device)
    probs = torch.zeros(aux.num_experts, dtype=torch.float32, device=first.device)
    rows = 0
    for logits in router_logits:
        weights = torch.softmax(logits[:num_real].float(), dim=-1)
        _, chosen = torch.topk(weights, aux.top_k, dim=-1)
        counts = counts + torch.bincount(chosen.reshape(-1), minlength=aux.num_experts).float()
        probs = probs + weights.sum(dim=0)
        rows += weights.shape[0]
    return counts, probs, torch.tensor(float(rows), device=first.device)


def pack_aux_loss(router_logits, num_real: int, aux: RouterAux, sum_over_sp) -> torch.Tensor:
    """The pack's aux (unweighted, as HF's aux_loss) from this rank's router logits. ``sum_over_sp``: sums a tensor
    over the active SP group, differentiably (SequenceParallel.reduce_loss; identity at sp=1). 0 for a pack with no
    real tokens. Every rank of the group must call it (it is collective under SP)."""
    counts, probs, rows = (sum_over_sp(t) for t in router_sums(router_logits, num_real, aux))
    if float(rows) == 0:
        return probs.sum() * 0.0  # keeps the graph (and the collectives) the same on every rank
    return aux.num_experts * torch.sum((counts.detach() / rows.detach()) * (probs / rows.detach()))
