"""The TRL virtual environment of bench/trl/bench_trl.py: built by the bench, apart from the project's.

TRL is what the bench compares against, so it is not a requirement of hbp-train. The bench builds ``.venv-trl`` in the
repository root (ignored by git) once:

1. ``python -m venv`` with the training venv's Python;
2. torch, transformers, accelerate and datasets at the training venv's versions (both sides of the comparison then
   run the same model code, kernels and data library; a CPU machine gets the CPU build of torch, and
   ``HBP_TORCH_INDEX`` names another index for it, as for ``./launch.sh setup``);
3. ``pip install -r bench/trl/requirements-trl.txt`` (TRL, pinned);
4. a check: the venv imports trl and its torch and transformers are the training venv's;
5. a stamp holding the fingerprint of all of the above, written last.

A later call whose fingerprint matches the stamp returns at once. Building needs the package index (pip); a build
that fails says so in one line (``VenvError``), and the bench's test is skipped with that reason.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_VENV = REPO / ".venv-trl"
REQUIREMENTS = Path(__file__).resolve().parent / "requirements-trl.txt"
STAMP = ".hbp-trl-ready"
SHARED = ("torch", "transformers", "accelerate", "datasets")  # at the training venv's versions


class VenvError(RuntimeError):
    """The TRL venv could not be built (no package index, a failed install): the message says which step."""


def pins() -> list:
    """``name==version`` of the SHARED libraries as the training venv has them (torch without its local tag)."""
    return [f"{name}=={importlib.metadata.version(name).split('+')[0]}" for name in SHARED]


def fingerprint() -> str:
    digest = hashlib.sha256(REQUIREMENTS.read_bytes())
    digest.update(" ".join(pins()).encode())
    digest.update(sys.version.encode())
    return digest.hexdigest()[:16]


def python(venv: Path = DEFAULT_VENV) -> Path:
    return Path(venv) / "bin" / "python"


def is_ready(venv: Path = DEFAULT_VENV) -> bool:
    stamp = Path(venv) / STAMP
    return stamp.is_file() and stamp.read_text().strip() == fingerprint()


def ensure(venv: Path = DEFAULT_VENV, echo=print) -> Path:
    """The venv's python, building the venv first when it is missing or stale (module docstring)."""
    venv = Path(venv)
    if is_ready(venv):
        return python(venv)
    (venv / STAMP).unlink(missing_ok=True)
    pip = [str(python(venv)), "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check"]
    torch_pin, *others = pins()
    index = ["--index-url", os.environ["HBP_TORCH_INDEX"]] if os.environ.get("HBP_TORCH_INDEX") else []
    steps = ([("create the venv", [sys.executable, "-m", "venv", str(venv)])] if not python(venv).is_file() else [])
    steps += [(f"install {torch_pin}", pip + index + [torch_pin]),
              (f"install {' '.join(others)} and {REQUIREMENTS.name}", pip + [*others, "-r", str(REQUIREMENTS)])]
    for title, command in steps:
        echo(f"[trl venv] {title}")
        res = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if res.returncode != 0:
            tail = res.stdout.strip().splitlines()[-1:] or ["(no output)"]
            raise VenvError(f"building {venv.name} failed at '{title}': {tail[0]}")
    check = ("import json, torch, transformers, trl; print(json.dumps([torch.__version__.split('+')[0], "
             "transformers.__version__, trl.__version__]))")
    res = subprocess.run([str(python(venv)), "-c", check], capture_output=True, text=True)
    if res.returncode != 0:
        raise VenvError(f"{venv.name} does not import trl: {(res.stderr.strip().splitlines() or [''])[-1]}")
    import json

    torch_v, transformers_v, _trl_v = json.loads(res.stdout.strip().splitlines()[-1])
    if [f"torch=={torch_v}", f"transformers=={transformers_v}"] != pins()[:2]:
        raise VenvError(f"{venv.name} has torch {torch_v} and transformers {transformers_v}, the training venv "
                        f"{' '.join(pins()[:2])}: delete {venv} and rerun")
    (venv / STAMP).write_text(fingerprint() + "\n")
    return python(venv)
