"""The model a plan is made for: read at pack time, recorded in the plan, costed by the simulator.

``hbp-pack --model DIR`` (a local HF model folder, or its config.json) reads the model's config (no weights; the
heads as its layers use them, hbp_train/model/attention_calls.py), refuses SP degrees of ``--groups`` that Ulysses
cannot split its heads by (perf/shape.py's ``sp_heads_problem``, the rule the trainer applies), and records the
model in the plan as ``"model"``: its folder, ``model_type`` and shape (``perf.shape.ModelShape``'s fields). The
record is one of the plan's extra keys, so plan.json and plan.npz both keep it and plans written without one still
load. ``hbp-simulate`` and ``hbp-compare`` cost the recorded shape unless told another (``cost_shape``), and say so
in one line when they cost a shape that is not the plan's model.
"""

from __future__ import annotations

from dataclasses import asdict, replace
from pathlib import Path
from typing import Iterable, Optional

from hbp_train.common.errors import UserError
from hbp_train.perf.shape import ModelShape, parse_model_shape, sp_degrees_that_work, sp_heads_problem


def read_model(path: str, flag: str = "--model") -> dict:
    """The record of the model at ``path`` (a folder holding config.json, or a config.json file): {"path", "name",
    "model_type", "shape"}. One-line UserError naming ``flag`` for what is not a readable HF config."""
    from transformers import AutoConfig

    given = Path(path)
    folder = given.parent if given.is_file() else given
    if not (given.is_file() or (given / "config.json").is_file()):
        raise UserError(f"{flag} {path}: not a model folder (no config.json) nor a config.json file; pass the "
                        "folder of the model you will train (model.name_or_path)")
    try:
        config = AutoConfig.from_pretrained(str(given))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        raise UserError(f"{flag} {path}: transformers cannot read its config ({' '.join(lines[:2])[:200]})") from None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    try:
        shape = parse_model_shape(text)
    except UserError as exc:
        raise UserError(f"{flag} {path}: {exc}") from None
    # the heads the model's layers hand their attention (counted on the meta device), not a config field the family
    # may not read (a GPT-NeoX config with a stray num_key_value_heads): the heads the trainer's Ulysses splits
    from hbp_train.model.attention_calls import attention_heads

    num_heads, num_kv_heads = attention_heads(text)[:2]
    shape = replace(shape, name=folder.resolve().name, num_heads=num_heads, num_kv_heads=num_kv_heads)
    return {"path": str(folder.resolve()), "name": shape.name, "model_type": getattr(text, "model_type", None),
            "shape": asdict(shape)}


def record_shape(record: dict) -> ModelShape:
    """The ModelShape of a plan's model record."""
    return parse_model_shape(dict(record["shape"]))


def describe(record: dict) -> str:
    """'NAME (model_type, H heads, K kv heads; PATH)' for messages."""
    shape = record_shape(record)
    return (f"{record.get('name', shape.name)} ({record.get('model_type') or 'model'}, {shape.num_heads} heads, "
            f"{shape.num_kv_heads} kv heads; {record.get('path')})")


def check_sp_degrees(record: dict, groups: Iterable, flag: str = "--groups") -> None:
    """UserError (one line) for the first group whose SP degree Ulysses cannot split the model's heads by, naming
    the group, the model and the degrees that work."""
    shape = record_shape(record)
    for group in groups:
        problem = sp_heads_problem(shape.num_heads, shape.num_kv_heads, int(group.sp))
        if problem:
            good = sp_degrees_that_work(shape.num_heads, shape.num_kv_heads)
            raise UserError(f"{flag} {group.pack_len}:{group.sp}: {problem}; model {describe(record)}; SP degrees "
                            f"that work: {', '.join(map(str, good))}")


def plan_model(plan) -> Optional[dict]:
    """The model record a plan carries (hbp-pack --model), or None."""
    record = plan.extra.get("model") if hasattr(plan, "extra") else None
    return record if isinstance(record, dict) and isinstance(record.get("shape"), dict) else None


def cost_shape(model_shape: Optional[str], records: list, what: str) -> tuple:
    """(the shape the cost model is to use, a warning line or None): --model-shape when given (``model_shape``),
    else the recorded model's (a dict), else None (the calibration's own; ``unrecorded_line`` then says so).

    ``records``: the model record (or None) of each plan (or of --model); ``what``: the plans' files (or --model),
    named in messages. The warning names the recorded model when --model-shape is another shape; plans recording
    different models are refused (one shape costed for all would be wrong for some)."""
    recorded = [r for r in records if r is not None]
    if model_shape is None and len({tuple(sorted(r["shape"].items())) for r in recorded}) > 1:
        raise UserError(f"{what}: made for different models ({'; '.join(describe(r) for r in recorded)}); "
                        "simulate them one model at a time, or give --model-shape")
    if model_shape is not None:
        if recorded:
            given, mine = parse_model_shape(model_shape), record_shape(recorded[0])
            if replace(given, name=mine.name) != mine:
                return model_shape, (f"warning: costing --model-shape {given.name}, not the model of {what}: "
                                     f"{describe(recorded[0])}")
        return model_shape, None
    return (dict(recorded[0]["shape"]) if recorded else None), None


def unrecorded_line(shape_name: str, reason: str) -> str:
    """The warning printed when no model is known (``reason``, e.g. "plan.json records no model") and the
    calibration's own shape is costed."""
    return (f"warning: {reason}: costing {shape_name} (the calibration's shape), not necessarily your model; "
            "hbp-pack --model DIR records the model in the plan, --model-shape DIR/config.json costs it")
