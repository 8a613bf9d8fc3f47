"""The up-front compatibility check: an attention or loss feature of the model that the packed path cannot
honour is refused before any weight is loaded, in one line naming the feature, the family and what would work.

`check_model_support` reads the HF config (no weights) and the model's modules built on the meta device (no
memory), so the rule is about features, never about family names:

* sliding-window attention: the packed attention is plain causal within each sample, which equals a sliding
  window only when no sample is longer than the window; a plan whose samples may be longer is refused;
* attention sinks (a learned per-head logit, a ``sinks`` parameter of the attention module): not implemented;
* attention logit soft-capping (``attn_logit_softcapping``): no packed backend implements it;
* final logit soft-capping (``final_logit_softcapping``): the chunked LM-head loss does not implement it;
* attention dropout: the packed attention has none;
* an SP degree Ulysses cannot split the heads by (perf.shape.sp_heads_problem).

`check_positions` refuses samples longer than the model's positions (positions restart at 0 in every sample of a
pack, so the longest sample counts, not the pack), unless RoPE scaling in the config extends them: then it says so.

hf_packed_attention refuses the same features at run time (a safety net for a model this check did not see).
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch

from hbp_train.common.errors import UserError
from hbp_train.perf.shape import parse_model_shape, sp_heads_problem


def check_model_support(hf_config, longest_sample: int, sp_degrees: Iterable[int], backend: str) -> None:
    """Raise a one-line UserError if the packed path cannot train this model as configured.

    ``longest_sample``: the longest sample the plan may put in a pack; ``sp_degrees``: the plan's SP degrees;
    ``backend``: the packed attention backend (named in the message).
    """
    family = getattr(hf_config, "model_type", "this model")
    where = f"{family} (model.architecture / model.name_or_path)"
    for feature, value in (("attn_logit_softcapping", "attention logit soft-capping"),
                           ("final_logit_softcapping", "final logit soft-capping")):
        if getattr(hf_config, feature, None) is not None:
            what = "the packed attention backends (any of them)" if feature.startswith("attn") else \
                "the chunked LM-head loss"
            raise UserError(f"{where}: {value} ({feature}={getattr(hf_config, feature)}) is not implemented by "
                            f"{what} (backend {backend}); set model.config.{feature}=null to train without it "
                            "(the model then differs from the pretrained one), or use a model without it")
    if float(getattr(hf_config, "attention_dropout", 0.0) or 0.0) > 0:
        raise UserError(f"{where}: attention dropout ({hf_config.attention_dropout}) is not implemented by the packed "
                        "attention; set model.config.attention_dropout=0")
    modules = _meta_modules(hf_config)
    if any(name.split(".")[-1] == "sinks" for m in modules for name, _ in m.named_parameters(recurse=False)):
        raise UserError(f"{where}: attention sinks (a learned per-head 'sinks' logit) are not implemented by the "
                        f"packed attention (backend {backend}); use a model without them")
    window = _smallest_window(hf_config, modules)
    if window is not None and longest_sample > window:
        raise UserError(f"{where}: sliding-window attention (sliding_window={window}) is not implemented by the "
                        f"packed attention (backend {backend}) and the plan's samples reach {longest_sample} tokens; "
                        f"re-plan with samples of at most {window} tokens (data_tools.preprocess/pack --max-len "
                        f"{window}), or set model.config.sliding_window=null (full causal attention)")
    shape = parse_model_shape(hf_config)
    for sp in sorted(set(sp_degrees)):
        problem = sp_heads_problem(shape.num_heads, shape.num_kv_heads, sp)
        if problem:
            good = [d for d in (1, 2, 4, 8, 16, 32, 64) if sp_heads_problem(shape.num_heads, shape.num_kv_heads, d) is None]
            raise UserError(f"{where}: {problem} (SP degrees that work: {', '.join(map(str, good))}; "
                            "data_tools.pack --groups)")


# RoPE scalings that stretch the trained positions by their factor (transformers' rope_type names).
STRETCHING_ROPE = ("linear", "dynamic", "yarn", "longrope", "llama3")


def check_positions(hf_config, longest_sample: int) -> Optional[str]:
    """UserError (one line) when the plan's samples are longer than the model's positions; a line to print when
    RoPE scaling in the config provides the positions beyond max_position_embeddings; None otherwise."""
    max_positions = getattr(hf_config, "max_position_embeddings", None)
    if not max_positions or longest_sample <= max_positions:
        return None
    family = getattr(hf_config, "model_type", "this model")
    scaled = _rope_scaled_positions(hf_config)
    if scaled is not None and longest_sample <= scaled[0]:
        positions, rope_type, factor, original = scaled
        return (f"[train] the plan's samples reach {longest_sample} tokens, beyond max_position_embeddings "
                f"{max_positions} of {family}: RoPE scaling provides {positions} positions ({rope_type}, factor "
                f"{factor:g} x {original}; model.config.rope_scaling)")
    have = f"{max_positions} positions (max_position_embeddings" + (
        f"; RoPE scaling {scaled[1]} gives {scaled[0]})" if scaled else ")")
    factor = math.ceil(longest_sample / max_positions)
    params = getattr(hf_config, "rope_parameters", None) or {}
    if any(isinstance(v, dict) for v in params.values()):  # RoPE per layer type (Gemma 3)
        how = "++model.config.rope_parameters={...} with a scaling (e.g. yarn) for its full-attention layers"
    else:
        how = (f"++model.config.rope_scaling={{rope_type:yarn,factor:{factor},original_max_position_embeddings:"
               f"{max_positions}}} ++model.config.max_position_embeddings={factor * max_positions}")
    raise UserError(f"{family} (model.name_or_path / model.config): the plan's samples reach {longest_sample} tokens "
                    f"but the model has {have}; re-plan with samples of at most {max_positions} tokens "
                    f"(data_tools.preprocess and pack --max-len {max_positions}), or extend the positions with RoPE "
                    f"scaling: {how}")


def _rope_scaled_positions(hf_config) -> Optional[tuple]:
    """(positions, rope_type, factor, original positions) of a RoPE scaling that stretches the positions, or None.
    transformers 5 keeps it in rope_parameters, per layer type for some families (Gemma 3): the smallest of the
    full-attention layers counts (a sliding-window layer sees no further back than its window)."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    sets = [p for kind, p in params.items() if isinstance(p, dict) and "sliding" not in kind] or [params]
    found = []
    for p in sets:
        rope_type = p.get("rope_type", p.get("type"))
        if rope_type in STRETCHING_ROPE and p.get("factor"):
            original = int(p.get("original_max_position_embeddings") or hf_config.max_position_embeddings)
            positions = max(int(hf_config.max_position_embeddings), int(original * float(p["factor"])))
            found.append((positions, rope_type, float(p["factor"]), original))
    return min(found) if found and len(found) == len(sets) else None


def _meta_modules(hf_config) -> list:
    """The model's modules, built on the meta device: their structure, no memory, no initialisation."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # eager: every model supports it (some not sdpa); the attention is not used here
        model = AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
    return list(model.modules())


def _smallest_window(hf_config, modules) -> int | None:
    """The smallest sliding window any attention layer applies: the layers' own ``sliding_window`` (Gemma,
    Qwen2 with use_sliding_window) when they have one, else the config's (Mistral, Mixtral)."""
    per_layer = [m.sliding_window for m in modules if hasattr(m, "sliding_window") and not hasattr(m, "layers")]
    if per_layer:
        windows = [w for w in per_layer if w]
    else:
        windows = [getattr(hf_config, "sliding_window", None)] if getattr(hf_config, "sliding_window", None) else []
    return min(windows) if windows else None
