"""LoRA / DoRA fine-tuning through peft: ``model.lora.{r,alpha,dropout,target_modules,dora}``.

``apply_lora`` injects the adapters into the HF model in place (``peft.inject_adapter_in_model``: the model keeps
its class, so the packed attention, Ulysses, per-layer checkpointing and the chunked loss see the same modules)
and freezes every other parameter; build.build_engine hands DeepSpeed only the trainable ones. The settings are
stored in the model's config (``hbp_lora``), so a checkpoint's ``hf/config.json`` carries them and export.py can
rebuild the adapted model, load the checkpoint and merge the adapters into full HF weights (``merge_lora``), or
keep them unmerged with ``--adapter``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Optional

from hbp_train.errors import UserError

CONFIG_KEY = "hbp_lora"  # the HF config attribute that carries the settings into checkpoints


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
    """Names of the linear modules to adapt (e.g. [q_proj, v_proj]); None = every linear layer but the LM head."""
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


def _peft_config(settings: dict):
    from peft import LoraConfig

    targets = settings.get("target_modules")
    return LoraConfig(r=settings["r"], lora_alpha=settings["alpha"], lora_dropout=settings["dropout"],
                      target_modules=list(targets) if targets else "all-linear", use_dora=settings["dora"],
                      bias="none")


def apply_lora(model, settings: LoraSettings) -> None:
    """Inject the adapters into ``model`` (in place) and freeze everything else; no-op for r=0."""
    if not settings.r:
        return
    from peft import inject_adapter_in_model

    values = asdict(settings)
    try:
        inject_adapter_in_model(_peft_config(values), model)
    except ValueError as e:  # peft: a target module name the model does not have
        raise UserError(f"model.lora.target_modules={settings.target_modules}: {str(e).splitlines()[0]}") from None
    for name, param in model.named_parameters():
        param.requires_grad = "lora_" in name
    setattr(model.config, CONFIG_KEY, values)


def is_adapter_parameter(name: str) -> bool:
    """A parameter apply_lora added (trained) rather than one of the model's own (frozen)."""
    return "lora_" in name


def merge_lora(model) -> None:
    """Merge the adapters of a model built with apply_lora into its base weights and remove them (in place)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for name, module in list(model.named_modules()):
        if isinstance(module, BaseTunerLayer):
            module.merge()
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, name.rsplit(".", 1)[-1], module.get_base_layer())
    if hasattr(model.config, CONFIG_KEY):
        delattr(model.config, CONFIG_KEY)


def lora_settings_of(hf_config) -> Optional[LoraSettings]:
    """The settings a checkpoint's HF config carries (apply_lora stored them), or None."""
    values = getattr(hf_config, CONFIG_KEY, None)
    return LoraSettings(**values) if values else None
