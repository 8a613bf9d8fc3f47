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

hf_packed_attention refuses the same features at run time (a safety net for a model this check did not see).
"""

from __future__ import annotations

from typing import Iterable

import torch

from hbp_train.errors import UserError
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
