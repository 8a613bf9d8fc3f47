"""The MoE router (load-balancing) loss of a packed, sequence-parallel step.

Two losses, chosen by the key the model's config holds its weight under (``COEF_KEYS``):

* ``router_aux_loss_coef`` (Mixtral, Qwen2/3-MoE, OLMoE, Granite-MoE, Jamba, PhiMoE, GPT-OSS, ... : every family
  whose HF model adds a router loss; JetMoE names it ``aux_loss_coef``): HF's ``load_balancing_loss_func``,
  ``aux = E · Σ_e f_e · P_e`` with f_e the share of (token, layer) top-k assignments of the softmax router that went
  to expert e and P_e the mean router probability of e, over every real token of every MoE layer;
* ``aux_loss_alpha`` (DeepSeek-V2/V3 checkpoints; transformers' DeepSeek models compute no router loss, so without
  this the model would train with none): DeepSeek's loss, ``Σ_layers E · Σ_e f_e · P_e`` per MoE layer, f_e from
  the experts the router really chose (group-limited or bias-corrected routing included), P_e from its scores
  (softmax, or with ``scoring_func: sigmoid`` (V3) sigmoid scores normalised per token). With ``seq_aux: true``
  it is the sequence-wise loss: f and P per sample of the pack (a sequence of DeepSeek's batch), else per pack.

The trainer runs the decoder and its own chunked loss, so it adds the loss itself:

* per pack (the analogue of one HF forward) over the pack's real tokens only (no SP padding, no dummy pack), or
  per sample of the pack for DeepSeek's sequence-wise loss;
* under SP each rank holds a slice of the pack: the counts, the probability sums and the token counts are summed
  over the SP group (the probabilities with the differentiable all-reduce) before the product, so every rank
  gets the pack's (or each sample's) aux exactly;
* normalised like the LM loss: each loss token gets its pack's (sample's) aux (``aux_T``), which goes through the
  same normaliser, so ave_token weighs packs by loss tokens, sample_mean by samples, sum adds it per token;
* logged as ``loss/aux`` (unweighted, as HF's ``aux_loss``): the loss-token-weighted mean over the step's packs.

A model whose config holds no positive weight under any of the keys trains without a router loss, and
``router_loss_line`` says so at start in one line, naming the key that turns it on (``model.config`` may set a
key to 0 to turn a checkpoint's loss off).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hbp_train.perf.shape import parse_model_shape

# The router-loss weight under the names transformers' MoE families and their checkpoints use, first found wins:
# HF's load-balancing loss (most families; JetMoE's aux_loss_coef), DeepSeek's (aux_loss_alpha, with seq_aux).
COEF_KEYS = ("router_aux_loss_coef", "aux_loss_coef", "aux_loss_alpha")
DEEPSEEK_KEY = "aux_loss_alpha"


@dataclass(frozen=True)
class RouterAux:
    """What the router loss of a model needs from its config."""

    coef: float
    """The weight of aux in the loss."""
    num_experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Experts per token (num_experts_per_tok)."""
    key: str = "router_aux_loss_coef"
    """The config key the weight was read from (COEF_KEYS)."""
    per_sample: bool = False
    """DeepSeek's sequence-wise loss (seq_aux): f and P per sample instead of per pack."""
    sigmoid: bool = False
    """DeepSeek-V3 scoring (scoring_func: sigmoid): P from sigmoid scores normalised per token, not a softmax."""

    @property
    def deepseek(self) -> bool:
        """DeepSeek's loss (per layer, the experts the router chose) rather than HF's load_balancing_loss_func."""
        return self.key == DEEPSEEK_KEY

    def describe(self) -> str:
        if not self.deepseek:
            return f"{self.key}={self.coef:g} (HF's load-balancing loss, per pack)"
        return (f"{self.key}={self.coef:g} (DeepSeek's, per MoE layer, per {'sample' if self.per_sample else 'pack'}"
                f"{', sigmoid scores' if self.sigmoid else ''})")


def _coefficient(hf_config) -> tuple[Optional[str], float]:
    """(the first of COEF_KEYS the config sets, its value), or (None, 0)."""
    for key in COEF_KEYS:
        value = getattr(hf_config, key, None)
        if value is not None:
            return key, float(value)
    return None, 0.0


def router_aux_of(hf_config) -> Optional[RouterAux]:
    """The router loss settings of a model's HF config, or None when it has none (dense, or no positive weight)."""
    key, coef = _coefficient(hf_config)
    shape = parse_model_shape(hf_config)
    if coef <= 0 or not shape.num_experts:
        return None
    return RouterAux(coef=coef, num_experts=shape.num_experts, top_k=shape.experts_per_token, key=key,
                     per_sample=key == DEEPSEEK_KEY and bool(getattr(hf_config, "seq_aux", False)),
                     sigmoid=key == DEEPSEEK_KEY and getattr(hf_config, "scoring_func", "softmax") == "sigmoid")


def records_router_logits(model) -> bool:
    """Whether transformers records router logits for this model, i.e. it routes tokens to experts."""
    return "router_logits" in (getattr(model.base_model, "_can_record_outputs", None) or {})


def router_loss_line(config, routes_tokens: bool) -> Optional[str]:
    """The one line said at start about an MoE model's router loss: the one it trains with, or that it trains with
    none and which ``model.config`` key turns it on; None for a dense model. ``routes_tokens``: the model has
    routers (records_router_logits), also when the shape reader does not know its family's expert keys."""
    name = getattr(config, "model_type", "this model")
    aux = router_aux_of(config)
    if aux is not None:
        return f"[train] {name}: MoE router loss {aux.describe()}, logged as loss/aux"
    if not (routes_tokens or parse_model_shape(config).num_experts):
        return None
    key, _ = _coefficient(config)
    if not parse_model_shape(config).num_experts:  # the shape reader does not know this family's expert keys
        return (f"[train] {name}: an MoE model trained WITHOUT a router (load-balancing) loss: hbp-train does not "
                "read this family's expert count, so it cannot add one")
    how = (f"++model.config.{key}=<weight>" if key else
           "++model.config.router_aux_loss_coef=<weight> (HF's load-balancing loss) or "
           "++model.config.aux_loss_alpha=<weight> (DeepSeek's; ++model.config.seq_aux=true per sample)")
    return (f"[train] {name}: an MoE model trained WITHOUT a router (load-balancing) loss: its config sets no "
            f"positive {' / '.join(COEF_KEYS)}; {how} turns one on")


def _probabilities(logits: torch.Tensor, aux: RouterAux) -> torch.Tensor:
    """[T, E] router probabilities: softmax, or DeepSeek-V3's sigmoid scores normalised per token."""
    if aux.sigmoid:
        scores = torch.sigmoid(logits.float())
        return scores / scores.sum(dim=-1, keepdim=True)
    return torch.softmax(logits.float(), dim=-1)


def router_sums(router_logits, num_real: int, aux: RouterAux) -> tuple:
    """HF's loss: this rank's sums over its first ``num_real`` tokens (the real ones; padding is at the end of a
    slice) of every MoE layer: top-k assignment counts per expert [E] (no gradient), router probabilities per expert
    [E] and the number of (token, layer) rows."""
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


def deepseek_sums(router_logits, router_choices, num_real: int, aux: RouterAux, segments, num_segments: int) -> tuple:
    """DeepSeek's loss: this rank's sums over its first ``num_real`` tokens per segment and MoE layer: the counts of
    the experts the router chose [S, L, E] (no gradient), the router probabilities [S, L, E] and the tokens [S].
    ``segments`` [T]: each token's segment (its sample), or None for one segment; ``router_choices``: the chosen
    experts, [T, k] per layer."""
    first = router_logits[0]
    if segments is None:
        segments = torch.zeros(num_real, dtype=torch.long, device=first.device)
    seg = segments[:num_real]
    shape = (num_segments, len(router_logits), aux.num_experts)
    counts = torch.zeros(shape, dtype=torch.float32, device=first.device)
    probs_by_layer = []
    for layer, (logits, chosen) in enumerate(zip(router_logits, router_choices)):
        flat = (seg[:, None] * shape[1] + layer) * shape[2] + chosen[:num_real].reshape(num_real, -1)
        counts.view(-1).index_add_(0, flat.reshape(-1), torch.ones(flat.numel(), device=first.device))
        p = _probabilities(logits[:num_real], aux)
        probs_by_layer.append(torch.zeros(num_segments, aux.num_experts, device=first.device).index_add(0, seg, p))
    tokens = torch.bincount(seg, minlength=num_segments).float()
    return counts, torch.stack(probs_by_layer, dim=1), tokens


def pack_aux_loss(router_logits, num_real: int, aux: RouterAux, sum_over_sp, router_choices=None,
                  sample_ids=None, num_samples: int = 1) -> torch.Tensor:
    """The pack's aux (unweighted, as HF's aux_loss) from this rank's router logits: a scalar, or for DeepSeek's
    sequence-wise loss each local token's sample's aux ([T_local]; ``sample_ids`` [T_local] numbers the pack's
    ``num_samples`` samples, its padding after the real tokens). ``router_choices``: the experts the router chose,
    for DeepSeek's loss. ``sum_over_sp``: sums a tensor over the active SP group, differentiably
    (SequenceParallel.reduce_loss; identity at sp=1). 0 for a pack with no real tokens. Every rank of the group
    must call it (it is collective under SP)."""
    if aux.deepseek:
        num_segments = max(num_samples, 1) if aux.per_sample else 1
        segments = sample_ids.reshape(-1) if aux.per_sample else None
        counts, probs, tokens = (sum_over_sp(t) for t in deepseek_sums(router_logits, router_choices, num_real, aux,
                                                                       segments, num_segments))
        per_token = tokens.detach().clamp(min=1)[:, None, None]
        share = counts.detach() / (per_token * aux.top_k)  # f_e: the segment's share of choices per layer
        seg_aux = aux.num_experts * (share * probs / per_token).sum(dim=(1, 2))  # [S]: Σ_layers E·Σ_e f_e·P_e
        if not aux.per_sample:
            return seg_aux[0]
        return seg_aux[segments.clamp(max=num_segments - 1)]  # padding tokens (no label) read the last sample's
    counts, probs, rows = (sum_over_sp(t) for t in router_sums(router_logits, num_real, aux))
    if float(rows) == 0:
        return probs.sum() * 0.0  # keeps the graph (and the collectives) the same on every rank
    return aux.num_experts * torch.sum((counts.detach() / rows.detach()) * (probs / rows.detach()))
