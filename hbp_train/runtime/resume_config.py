"""Resuming with a command line that differs from the checkpoint's: every changed setting is named in one line, and
each is either applied or refused.

A checkpoint holds the resolved config it was saved with (``config.yaml``). At a resume every setting of this run
that differs from it is compared, by its dotted key (``train.lr``, ``model.init_config.hidden_size``):

- **refused** (one line, exit 2, before any engine is built): what the checkpoint's state cannot be loaded into or
  would no longer mean the same —
  the model (its shape read from the checkpoint's ``hf/config.json`` against the one this run would build, its
  dtype, its LoRA adapters), the order of the data (``train.seed``, ``data.shuffle_epochs``: the epochs already
  planned would train other samples), and ``deepspeed.zero_stage`` to or from 3 (a ZeRO-3 checkpoint holds other
  files than a ZeRO-1/2 one; 1 and 2 load each other's). A changed plan is refused by checkpoint.check_resumable.
- **applied**: everything else. The optimizer's settings (lr, betas, eps, weight decay) are set again after the load
  (DeepSpeed's load would put back the saved ones) and the LR schedule is rebuilt at the step the run resumes from
  (``apply``): a changed ``train.lr``, ``warmup_steps``, ``min_lr_ratio``, ``max_steps`` or ``data.epochs`` takes
  effect at the next step. Cadences (save, eval), logging, the loss and the memory levers are read from this run's
  config as they are for any run. A model path that moved (``model.name_or_path``, ``model.tokenizer``) with the same
  model shape is applied too.

``check`` is run by every worker before the engine is built (the line is logged by rank 0) and, through
``precheck``, by the config check (``python -m hbp_train.config``, which ``./launch.sh train`` runs before any
worker starts), with the refusals that need no worker: the model, the plan, the SP degrees at the new world size.
docs/reliability.md, "Resuming with other settings".
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Optional

import yaml

from hbp_train.common.errors import UserError
from hbp_train.runtime import checkpoint, manifest

UNSET = "(unset)"
"""A key one side of a comparison does not have."""
IGNORED = ("train.resume",)
"""Keys that differ at every resume by design."""
REFUSED = {"model.dtype": "the dtype of the saved weights and optimizer state",
           "model.lora": "the adapters the checkpoint holds",
           "train.seed": "the order of the epochs already planned (data.shuffle_epochs)",
           "data.shuffle_epochs": "the order of the epochs already planned"}
"""Keys (or key prefixes) a resume cannot change, and why."""
SCHEDULE = ("train.lr", "train.min_lr_ratio", "train.warmup_steps", "train.max_steps", "data.epochs")
"""Keys that shape the LR schedule, which ``apply`` rebuilds at the resumed step."""
MODEL_PATHS = ("model.name_or_path", "model.tokenizer", "model.init_config", "model.config", "model.architecture",
               "model.resize_vocab")
"""Keys that decide the model's shape: refused when the shape they give differs from the checkpoint's."""


def flatten(tree, prefix: str = "") -> dict:
    """{dotted key: value} of a nested mapping (lists are values)."""
    if not isinstance(tree, dict):
        return {prefix: tree}
    out = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def config_tree(cfg) -> dict:
    """The run config (config.HBPConfig, a dataclass) as the nested mapping its config.yaml holds."""
    return json.loads(json.dumps(dataclasses.asdict(cfg), default=str))


def config_yaml(cfg) -> str:
    """The resolved config as YAML, as config.resolved_yaml writes it (for a run started without it)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def saved_config(tag_dir: str) -> Optional[dict]:
    """The config a checkpoint was saved with (its config.yaml), or None when it has none that can be read."""
    try:
        with open(os.path.join(tag_dir, "config.yaml")) as f:
            tree = yaml.safe_load(f)
    except (OSError, yaml.YAMLError, UnicodeDecodeError):
        return None
    return tree if isinstance(tree, dict) and tree else None


def changes(saved: dict, current: dict) -> list:
    """[(key, saved value, this run's value)] of every setting that differs, sorted by key; UNSET where one side
    does not have the key (an entry of a mapping field such as model.config added or removed). A field the
    checkpoint's config does not have at all (added to hbp-train since it was saved) is not a change."""
    old, new = flatten(saved), flatten(current)
    fields = {".".join(key.split(".")[:2]) for key in old}
    out = []
    for key in sorted(set(old) | set(new)):
        o, n = old.get(key, UNSET), new.get(key, UNSET)
        if key.startswith(IGNORED) or ".".join(key.split(".")[:2]) not in fields:
            continue
        if UNSET in (o, n) and (o if n is UNSET else n) in (None, {}):
            continue  # a mapping field left empty on one side, set on the other: its entries are the change
        if _normal(o) != _normal(n):
            out.append((key, o, n))
    return out


def _normal(value):
    """Values as YAML and a dataclass may spell them alike: tuples as lists, ints as floats where they are equal."""
    if isinstance(value, (list, tuple)):
        return [_normal(v) for v in value]
    if isinstance(value, dict):
        return {k: _normal(v) for k, v in value.items()}
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return value
    return float(value)


def _show(value) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list)) else str(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _why_refused(key: str, old, new, shape_change: Optional[str]) -> Optional[str]:
    """Why a resume cannot take this change, or None when it is applied. ``shape_change``: model_shape_change's."""
    if key.startswith(MODEL_PATHS):
        return f"the model's shape: {shape_change}" if shape_change else None
    for prefix, why in REFUSED.items():
        if key == prefix or key.startswith(prefix + "."):
            return why
    if key == "deepspeed.zero_stage" and 3 in (old, new):
        return "ZeRO-3's checkpoint files (1 and 2 load each other's)"
    return None


def model_shape_change(cfg, tag_dir: str) -> Optional[str]:
    """How the shape of the model this run would build differs from the checkpoint's (``hf/config.json``), as
    "hidden 64 -> 96, ...", or None when they are the same. When either cannot be read as a shape (perf/shape.py
    reads Llama-like configs), a change of the model's keys cannot be judged: it is refused as a change of shape."""
    from hbp_train.perf.shape import parse_model_shape

    try:
        with open(os.path.join(tag_dir, "hf", "config.json")) as f:
            saved = dataclasses.asdict(parse_model_shape(json.load(f)))
        current = dataclasses.asdict(built_shape(cfg.model))
    except (OSError, ValueError, TypeError, UserError):
        return "it cannot be compared with the checkpoint's hf/config.json"
    diff = [f"{k} {saved[k]} -> {current[k]}" for k in saved if k != "name" and saved[k] != current[k]]
    return ", ".join(diff) or None


def built_shape(model_cfg):
    """The perf.shape.ModelShape of the model a run builds from ``model_cfg`` (no weights read): its config, with
    the vocabulary the build gives it (batches/vocab.py: the tokenizer's, for a model built from scratch or with
    model.resize_vocab). UserError when the config cannot be read."""
    from hbp_train.perf.shape import model_shape_of

    vocab = None
    if model_cfg.name_or_path is None or model_cfg.resize_vocab:
        from transformers import AutoTokenizer

        try:
            vocab = len(AutoTokenizer.from_pretrained(model_cfg.tokenizer))
        except (OSError, ValueError, TypeError) as exc:
            raise UserError(f"model.tokenizer={model_cfg.tokenizer}: cannot read it ({exc})") from None
    return model_shape_of(model_cfg, vocab)


def check(cfg, tag_dir: str) -> Optional[str]:
    """Compare this run's config with the checkpoint's. UserError (one line naming every refused change) when the
    resume cannot take them; else the line naming the applied changes (None when nothing changed)."""
    saved = saved_config(tag_dir)
    if saved is None:
        return None
    found = changes(saved, config_tree(cfg))
    if not found:
        return None
    shape_change = model_shape_change(cfg, tag_dir) if any(k.startswith(MODEL_PATHS) for k, _, _ in found) else None
    refused = [(k, o, n, why) for k, o, n in found if (why := _why_refused(k, o, n, shape_change))]
    if refused:
        listed = "; ".join(f"{k}={_show(n)} (saved with {_show(o)}: {why})" for k, o, n, why in refused)
        raise UserError(f"{tag_dir} cannot resume with {listed}: a checkpoint resumes only the model, data order "
                        "and ZeRO-3 choice it was saved with; drop these overrides to resume it, or start a new run "
                        "elsewhere (another train.out_dir) from an export of it (python -m hbp_train.export)")
    listed = ", ".join(f"{k} {_show(o)} -> {_show(n)}" for k, o, n in found)
    step = checkpoint.TAG_RE.match(os.path.basename(os.path.normpath(tag_dir)))
    at = f"step {int(step.group(1))}" if step else "the resumed step"
    schedule = any(k in SCHEDULE for k, _, _ in found)
    return (f"[train] resuming {tag_dir} with {len(found)} setting{'s' if len(found) > 1 else ''} changed since it "
            f"was saved, applied: {listed}" + (f" (the LR schedule is rebuilt at {at})" if schedule else ""))


def apply(engine, train) -> None:
    """After a checkpoint's load: this run's optimizer settings (``train``: a trainer.TrainConfig) instead of the
    saved ones, and the LR schedule (built from this run's config by build.deepspeed_config) set at the iteration
    the checkpoint reached, so that its next step uses this run's rate. Without a change it sets what was loaded."""
    scheduler = engine.lr_scheduler
    optimizer = getattr(scheduler, "optimizer", None) or engine.optimizer
    for group in optimizer.param_groups:
        group.update(betas=tuple(train.betas), eps=train.eps, weight_decay=train.weight_decay)
    if scheduler is not None:
        scheduler.step(scheduler.last_batch_iteration)


def precheck(cfg, world_size: Optional[int], planned_groups: Optional[list]) -> None:
    """The refusals of a resume that need no worker, for the config check: UserError (one line) when the checkpoint
    train.resume picks was saved with another plan or model, or a setting it cannot change, or when the plan's SP
    degrees cannot run on ``world_size`` ranks (None: not known; ``planned_groups``: data.shards' groups, dicts with
    pack_len and sp). Cheap: reads the checkpoint's small files, never its weights; a checkpoint it cannot judge
    (damaged, unfinished) is left to the workers, which fall back or say why."""
    tag_dir = checkpoint_to_resume(cfg)
    if tag_dir is None:
        return
    prefix = f"train.resume={cfg.train.resume}"
    try:
        saved = checkpoint.check_resumable(os.path.dirname(tag_dir), os.path.basename(tag_dir), world_size or 1,
                                           cfg.data.shards)
        check(cfg, tag_dir)
    except UserError as exc:
        raise UserError(f"{prefix}: {exc}") from None
    saved_world = saved.get("world_size")
    if world_size and planned_groups and saved_world and int(saved_world) != world_size:
        from hbp_train.planning.replan import sp_world_problem

        problem = sp_world_problem(planned_groups, world_size)
        if problem:
            raise UserError(f"{prefix}: cannot resume on {world_size} rank{'s' if world_size > 1 else ''} from "
                            f"{tag_dir} (saved by {saved_world}): {problem}")


def checkpoint_to_resume(cfg) -> Optional[str]:
    """The tag folder a resume would start from, found without reading any checkpoint's contents: the one
    train.resume names, or for 'auto' the one ``latest`` names (else the newest) with a manifest; None when there is
    none, or when it is not whole enough to judge here."""
    resume = cfg.train.resume
    if not resume:
        return None
    if resume == "auto":
        root = os.path.join(cfg.train.out_dir, "checkpoints")
        tags = [t for t in reversed(checkpoint.list_tags(root)) if manifest.has_manifest(os.path.join(root, t))]
        try:
            with open(os.path.join(root, "latest")) as f:
                latest = f.read().strip()
        except (OSError, UnicodeDecodeError):
            latest = None
        tag = latest if latest in tags else (tags[0] if tags else None)
    else:
        try:
            root, tag = checkpoint.resolve(resume)
        except UserError:
            return None  # the run folder check names it
    if tag is None or not manifest.has_manifest(os.path.join(root, tag)):
        return None
    tag_dir = os.path.join(root, tag)
    return tag_dir if os.path.isfile(os.path.join(tag_dir, "resume.json")) else None
