"""The transformers floor admits only versions that have the calls the trainer makes (issue 19, defect 10): per-layer
activation checkpointing (``activation_checkpointing_enable``) and ``set_attn_implementation`` exist only in
transformers 5, so pyproject.toml and requirements.txt must both require it."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parent.parent


def _floor(spec: str) -> Version:
    req = Requirement(spec)
    floors = [Version(s.version) for s in req.specifier if s.operator in (">=", "==", "~=")]
    assert floors, f"{spec}: no lower bound"
    return max(floors)


def test_transformers_floor_is_5_in_pyproject_and_requirements():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    from_pyproject = next(d for d in deps if Requirement(d).name == "transformers")
    line = next(l for l in (REPO / "requirements.txt").read_text().splitlines() if re.match(r"transformers\b", l))
    assert _floor(from_pyproject) >= Version("5") and _floor(from_pyproject) == _floor(line)


def test_the_installed_transformers_has_the_calls_the_trainer_uses():
    from transformers import PreTrainedModel

    assert hasattr(PreTrainedModel, "activation_checkpointing_enable")
    assert hasattr(PreTrainedModel, "set_attn_implementation")
