"""The OpenCompass virtual environment: build it, prove it works, and refuse to run without it.

OpenCompass 0.5 pins numpy < 2 and datasets < 4, which conflict with the training stack, so it lives in its own
venv (``.venv-opencompass`` in the repo root) and runs as a subprocess. ``eval/opencompass_setup.py`` builds it:

1. ``python -m venv`` with the training venv's Python; torch at its version (so a CPU machine gets the CPU build);
2. ``pip install -r eval/requirements-opencompass.txt`` (OpenCompass and the pins it needs);
3. ``eval/opencompass_compat.py`` copied into its site-packages with a ``.pth`` that imports it (transformers 5
   lacks ``batch_encode_plus``, which OpenCompass calls);
4. a self-test: a tiny random model run through the real OpenCompass on two generated questions, on the CPU;
5. a stamp holding the fingerprint of all of the above, written last.

A second call whose fingerprint matches the stamp returns at once. A venv without a matching stamp (never finished,
or made for other requirements) is refused by ``check_install`` with the command that fixes it.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import shutil
import subprocess
from pathlib import Path

from hbp_train.common.errors import UserError

REPO = Path(__file__).resolve().parent.parent
DEFAULT_VENV = REPO / ".venv-opencompass"
REQUIREMENTS = Path(__file__).resolve().parent / "requirements-opencompass.txt"
COMPAT = Path(__file__).resolve().parent / "opencompass_compat.py"
COMPAT_MODULE = "hbp_opencompass_compat"
STAMP = ".hbp-opencompass-ready"
SETUP_COMMAND = "./launch.sh eval --setup-opencompass"


def torch_requirement() -> str | None:
    """``torch==<the training venv's version>`` without a local tag (pip picks the build for the machine)."""
    try:
        return "torch==" + importlib.metadata.version("torch").split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return None  # OpenCompass then pulls its own torch


def fingerprint() -> str:
    """What the venv is built from: the requirements file, the compat shim and the torch pin."""
    digest = hashlib.sha256()
    for part in (REQUIREMENTS.read_bytes(), COMPAT.read_bytes(), (torch_requirement() or "").encode()):
        digest.update(hashlib.sha256(part).digest())
    return digest.hexdigest()[:16]


def is_ready(venv: Path) -> bool:
    stamp = Path(venv) / STAMP
    return stamp.is_file() and stamp.read_text().strip() == fingerprint()


def check_install(venv: Path) -> Path:
    """The ``opencompass`` entry point of a finished venv, else a one-line UserError with the fix."""
    venv = Path(venv)
    exe = venv / "bin" / "opencompass"
    if not exe.is_file():
        raise UserError(f"OpenCompass is not installed in {venv}: run {SETUP_COMMAND}")
    if not is_ready(venv):
        raise UserError(f"the OpenCompass venv {venv} is unfinished or was built from other requirements "
                        f"({REQUIREMENTS.name} or {COMPAT.name} changed since): run {SETUP_COMMAND}")
    return exe


def _site_packages(python: Path) -> Path:
    out = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                         capture_output=True, text=True, check=True)
    return Path(out.stdout.strip())


def install_compat(python: Path) -> Path:
    """Copy the compat shim into the venv and make every interpreter start there import it."""
    site = _site_packages(python)
    shutil.copyfile(COMPAT, site / f"{COMPAT_MODULE}.py")
    pth = site / f"{COMPAT_MODULE}.pth"
    pth.write_text(f"import {COMPAT_MODULE}; {COMPAT_MODULE}.install()\n")
    return pth
