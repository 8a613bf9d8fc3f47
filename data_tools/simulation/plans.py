"""The plans a simulation reads and what it says of them: a plan file (or a --shards folder) loaded with one-line
errors, its groups written as hbp-pack's --groups writes them, and the isf plan it is compared with when it is
simulated alone."""

from __future__ import annotations

import json
from pathlib import Path

from hbp_train.common.errors import UserError


def load_plan(path: str):
    """Plan.from_json with one-line errors (UserError naming the file)."""
    from hbp_train.planning.metrics import with_metrics
    from hbp_train.planning.plan import Plan

    p = Path(path)
    if p.is_dir():  # a --shards folder: use its plan
        if not (p / "plan.json").is_file():
            raise UserError(f"{path}: is a folder with no plan.json; pass a plan file from python -m data_tools.pack")
        p = p / "plan.json"
        path = str(p)
    if not p.is_file():
        raise UserError(f"{path}: no such plan file")
    try:
        with open(p) as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: invalid JSON at line {exc.lineno} ({exc.msg})") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text; pass a plan file from python -m data_tools.pack") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    if not isinstance(data, dict) or "steps" not in data or "groups" not in data:
        raise UserError(f"{path}: not a plan (no 'steps'/'groups'); make one with python -m data_tools.pack")
    if "lengths" not in data:
        raise UserError(f"{path}: the plan has no 'lengths' (written by data_tools.pack); re-run the planner")
    try:
        return with_metrics(Plan.from_dict(data))
    except UserError as exc:  # the plan's own checks (version, world size, groups): name the file
        raise UserError(f"{path}: {exc}") from None
    # Fields of the wrong shape in the file: int("x") (ValueError), a missing key, a number where a list goes.
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        raise UserError(f"{path}: malformed plan ({type(exc).__name__}: {exc})") from None


def describe_groups(plan) -> str:
    """A plan's groups with their levers, as hbp-pack's --groups writes them (pack_len:sp:ckpt_layers[:levers]),
    and the ZeRO stage it was made for."""
    from hbp_train.perf.cost_model import group_levers

    parts = []
    for g in plan.config.groups:
        levers = "+".join(n for n, on in zip(("tiled_mlp", "offload"), group_levers(g)) if on)
        ckpt = "-" if g.ckpt_layers is None else g.ckpt_layers
        parts.append(f"{g.pack_len}:{g.sp}:{ckpt}" + (f":{levers}" if levers else ""))
    stage = plan.extra.get("zero_stage")
    return ", ".join(parts) + (f" (made for ZeRO-{stage})" if stage is not None else "")


def isf_baseline(plan):
    """isf planned on ``plan``'s lengths with its world size, largest group, step budget, curriculum and seed: what
    the plan is compared with when it is simulated alone (data_tools.compare's baseline)."""
    from dataclasses import replace

    from hbp_train.planning import make_plan

    return make_plan(plan.lengths, replace(plan.config, strategy="isf", pack_cost=None, progress=False))
