"""LoRA / DoRA fine-tuning through peft: ``model.lora.{r,alpha,dropout,target_modules,target_parameters,dora}``.

``apply_lora`` injects the adapters into the HF model in place (``peft.inject_adapter_in_model``: the model keeps
its class, so the packed attention, Ulysses, per-layer checkpointing and the chunked loss see the same modules)
and freezes every other parameter; build.build_engine hands DeepSpeed only the trainable ones. The settings are
stored in the model's config (``hbp_lora``), so a checkpoint's ``hf/config.json`` carries them and export.py can
rebuild the adapted model, load the checkpoint and merge the adapters into full HF weights (``merge_lora``), or
write them as a peft adapter folder with ``--adapter`` (``save_adapter``).

MoE families on transformers 5 keep their experts as fused 3-D parameters (``experts.gate_up_proj``,
``experts.down_proj``), not linear layers. peft (0.21) rewrites the targets of the MoE types that transformers
converts from v4 checkpoints (mixtral, qwen2_moe, qwen3_moe, deepseek_v3): the v4 names ``gate_proj``/``up_proj``/
``down_proj``/``w1``/``w2``/``w3``/``gate`` become the fused expert parameters and the router weight
(``target_parameters``, the fused ``gate_up_proj`` at rank 2r). So with the default targets those models adapt
attention, router and experts, while a dense MLP or shared expert whose layers carry those names (deepseek_v3's
first layers and shared experts) is not adapted. We keep peft's rewrite rather than work around it: it is what
``peft.PeftModel.from_pretrained`` does again when it loads an exported adapter, so training and loading agree.
"""

from __future__ import annotations

import ast
import re
import warnings
from dataclasses import asdict, dataclass
from typing import Optional

from hbp_train.common.errors import UserError

CONFIG_KEY = "hbp_lora"  # the HF config attribute that carries the settings into checkpoints
LM_HEAD = "lm_head"  # the output projection's name in the HF families we train (any other name: apply_lora checks)


def _head_refusal(targets: list, name: str) -> str:
    return (f"model.lora.target_modules={targets}: {name} is the LM head, whose weight the loss reads directly "
            "(chunk by chunk, never through the module), so an adapter on it would train nothing; leave it out "
            "(model.lora.r=0 trains the head with every other weight)")


@dataclass
class LoraSettings:
    """Parameter-efficient fine-tuning with LoRA (or DoRA) adapters; r=0 trains every weight."""

    r: int = 0
    """Adapter rank; 0 = no adapters (full fine-tuning)."""
    alpha: float = 16.0
    """LoRA alpha: the adapter's update is scaled by alpha / r."""
    dropout: float = 0.0
    """Dropout on the adapter's input."""
    target_modules: Optional[list] = None
    """Names of the linear modules to adapt (e.g. [q_proj, v_proj]); None = every linear layer but the LM head (for
    the MoE families peft turns this into attention + router + fused experts: see the module docstring). Never the
    LM head: the loss reads its weight directly, past an adapter, which would then train nothing (refused)."""
    target_parameters: Optional[list] = None
    """Names of (3-D, fused MoE expert) parameters to adapt as well, e.g. [gate_up_proj, down_proj] (peft's
    ``target_parameters``); not with dora."""
    dora: bool = False
    """Weight-decomposed LoRA (DoRA) instead of plain LoRA."""

    def __post_init__(self):
        if not isinstance(self.r, int) or self.r < 0:
            raise UserError(f"model.lora.r={self.r!r}: must be an integer >= 0 (0 = no adapters)")
        if self.r and not self.alpha > 0:
            raise UserError(f"model.lora.alpha={self.alpha!r}: must be > 0")
        if not 0 <= self.dropout < 1:
            raise UserError(f"model.lora.dropout={self.dropout!r}: must be in [0, 1)")
        if self.target_modules is not None and not list(self.target_modules):
            raise UserError("model.lora.target_modules: give module names, or null for every linear layer")
        if self.target_modules is not None and LM_HEAD in self.target_modules:
            raise UserError(_head_refusal(list(self.target_modules), LM_HEAD))
        if self.target_parameters is not None and not list(self.target_parameters):
            raise UserError("model.lora.target_parameters: give parameter names (e.g. [gate_up_proj, down_proj]), "
                            "or null")
        if self.dora and self.target_parameters:
            raise UserError("model.lora.dora=true with model.lora.target_parameters: peft's DoRA adapts linear "
                            "layers only; drop target_parameters or use dora=false")


def _peft_config(settings: dict):
    from peft import LoraConfig

    targets = settings.get("target_modules")
    parameters = settings.get("target_parameters")
    return LoraConfig(r=settings["r"], lora_alpha=settings["alpha"], lora_dropout=settings["dropout"],
                      target_modules=list(targets) if targets else "all-linear",
                      target_parameters=list(parameters) if parameters else None, use_dora=settings["dora"],
                      bias="none")


_UNMATCHED_PATTERN = re.compile(r"The following (?:rank|alpha)_pattern keys did not match any targeted module and "
                                r"were ignored: (\[.*\])\.")


def _is_false_alarm(message: str, fused_names: list) -> bool:
    """peft's warning that a rank/alpha pattern matched no targeted *module*, when every such pattern names a fused
    expert *parameter*: peft's MoE rewrite (module docstring) adds ``.*\\.gate_up_proj`` when it targets the fused
    experts, applies it to them (rank 2r, alpha 2·alpha) and then checks it against modules only."""
    found = _UNMATCHED_PATTERN.search(message)
    if not found:
        return False
    keys = ast.literal_eval(found.group(1))  # peft prints the Python list
    return all(any(re.match(rf"(.*\.)?({key})$", name) for name in fused_names) for key in keys)


def apply_lora(model, settings: LoraSettings) -> None:
    """Inject the adapters into ``model`` (in place) and freeze everything else; no-op for r=0."""
    if not settings.r:
        return
    from peft import inject_adapter_in_model

    values = asdict(settings)
    # the fused MoE expert tensors (module docstring); ZeRO-3 keeps a partitioned parameter's shape in ds_shape
    fused = [name for name, param in model.named_parameters() if len(getattr(param, "ds_shape", param.shape)) == 3]
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            inject_adapter_in_model(_peft_config(values), model)
    except ValueError as e:  # peft: a target name the model does not have, DoRA on a fused parameter
        first = str(e).splitlines()[0]
        if settings.dora and "ParamWrapper" in first:
            raise UserError(f"model.lora.dora=true: {model.config.model_type}'s MoE experts are fused parameters, "
                            f"which peft's DoRA cannot adapt (the default targets include them); set "
                            f"model.lora.target_modules (e.g. [q_proj,k_proj,v_proj,o_proj]) or use dora=false"
                            ) from None
        raise UserError(f"model.lora.target_modules={settings.target_modules}, target_parameters="
                        f"{settings.target_parameters}: {first}") from None
    for w in caught:  # re-issue all but peft's false alarm about its own MoE rank pattern
        if not _is_false_alarm(str(w.message), fused):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    head = model.get_output_embeddings()
    if head is not None and any("lora_" in n for n, _ in head.named_parameters()):  # a head by another name
        name = next(n for n, m in model.named_modules() if m is head)
        raise UserError(_head_refusal(list(settings.target_modules or []), name.rsplit(".", 1)[-1]))
    for name, param in model.named_parameters():
        param.requires_grad = "lora_" in name
    setattr(model.config, CONFIG_KEY, values)


def is_adapter_parameter(name: str) -> bool:
    """A parameter apply_lora added (trained) rather than one of the model's own (frozen)."""
    return "lora_" in name


def merge_lora(model) -> None:
    """Merge the adapters of a model built with apply_lora into its base weights and remove them (in place)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    replaced = []
    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            if any(name.startswith(prefix) for prefix in replaced):
                continue  # nested in one merged already (peft stacks a wrapper per fused MoE parameter)
            replaced.append(name + ".")
            # as peft's merge_and_unload: a fused-parameter wrapper merges its nested wrappers too
            if hasattr(module, "unload_and_optionally_merge_module"):
                base = module.unload_and_optionally_merge_module(merge=True, safe_merge=False, adapter_names=None)
            else:
                module.merge()
                base = module.get_base_layer()
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, name.rsplit(".", 1)[-1], base)
    if hasattr(model.config, CONFIG_KEY):
        delattr(model.config, CONFIG_KEY)


def lora_settings_of(hf_config) -> Optional[LoraSettings]:
    """The settings a checkpoint's HF config carries (apply_lora stored them), or None."""
    values = getattr(hf_config, CONFIG_KEY, None)
    return LoraSettings(**values) if values else None


def save_adapter(model, out: str, dtype, base_model: Optional[str] = None) -> None:
    """Write the adapters of a model built with apply_lora as a peft adapter folder (``adapter_config.json`` and
    ``adapter_model.safetensors``, the layout ``peft.PeftModel.save_pretrained`` writes), which
    ``peft.PeftModel.from_pretrained(base_model, out)`` loads over the base model."""
    from peft import get_peft_model_state_dict
    from safetensors.torch import save_file

    state = get_peft_model_state_dict(model, adapter_name="default")  # keys without the adapter name, as peft saves
    save_file({f"base_model.model.{k}": v.detach().to(dtype).contiguous() for k, v in state.items()},
              f"{out}/adapter_model.safetensors", metadata={"format": "pt"})
    peft_config = model.peft_config["default"]
    peft_config.base_model_name_or_path = base_model or None
    peft_config.inference_mode = True
    peft_config.save_pretrained(out)


def zero3_external_parameters(model) -> list:
    """(module, parameter) pairs ZeRO-3 must gather for a module that reads another module's weight: a DoRA
    magnitude layer reads its linear layer's base weight and adapter weights (for the column norms), outside those
    modules' own forward, where ZeRO-3 would hand it the empty partition."""
    pairs = []
    for module in model.modules():
        magnitudes = getattr(module, "lora_magnitude_vector", None)
        if not magnitudes:
            continue
        for adapter, dora_layer in magnitudes.items():
            for param in (module.get_base_layer().weight, module.lora_A[adapter].weight,
                          module.lora_B[adapter].weight):
                pairs.append((dora_layer, param))
    return pairs
