"""The OpenCompass virtual environment: build it, prove it works, and refuse to run without it.

OpenCompass 0.5 pins numpy < 2 and datasets < 4, which conflict with the training stack, so it lives in its own
venv (``.venv-opencompass`` in the repo root) and runs as a subprocess. ``setup`` builds it:

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
import sys
import tempfile
import time
from pathlib import Path

from hbp_train.errors import UserError

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


def setup(venv: Path = DEFAULT_VENV) -> int:
    """Build, self-test and stamp the venv (see the module doc); 0 when it is ready, 2 when a step failed."""
    venv = Path(venv).resolve()
    if is_ready(venv):
        print(f"[eval] the OpenCompass venv {venv} is ready (stamp {venv / STAMP}; delete the venv to rebuild it)")
        return 0
    start = time.time()
    (venv / STAMP).unlink(missing_ok=True)
    python = venv / "bin" / "python"
    pip = [str(python), "-m", "pip", "install", "-q"]
    steps = []
    if not python.is_file():
        # From this interpreter: the same Python version as the training venv, so the same torch wheel exists.
        steps.append(("create the virtual environment", [sys.executable, "-m", "venv", str(venv)]))
    steps.append(("upgrade pip", pip + ["--upgrade", "pip"]))
    if torch_requirement():
        steps.append((f"install {torch_requirement()}", pip + [torch_requirement()]))
    steps.append((f"install -r {REQUIREMENTS.name}", pip + ["-r", str(REQUIREMENTS)]))
    for title, command in steps:
        print(f"[eval] {title}: {' '.join(command)}", flush=True)
        if subprocess.run(command).returncode != 0:
            print(f"error: OpenCompass set-up failed at '{title}' (output above); fix it and re-run {SETUP_COMMAND}",
                  file=sys.stderr)
            return 2
    print(f"[eval] install the compatibility shim: {install_compat(python)}", flush=True)
    installed = time.time() - start
    print("[eval] self-test: a tiny model through OpenCompass on the CPU", flush=True)
    error = self_test(venv)
    if error:
        print(f"error: the OpenCompass venv {venv} failed its self-test: {error}; fix it and re-run "
              f"{SETUP_COMMAND}", file=sys.stderr)
        return 2
    (venv / STAMP).write_text(fingerprint() + "\n")
    print(f"[eval] OpenCompass is ready in {venv} (install {installed:.0f} s, self-test "
          f"{time.time() - start - installed:.0f} s); run: ./launch.sh eval opencompass --model DIR --datasets offline")
    return 0


def self_test(venv: Path) -> str | None:
    """Run two generated questions on a tiny random model through OpenCompass; None if it ran and scored, else
    what went wrong (with the log to read)."""
    from eval import opencompass as oc

    with tempfile.TemporaryDirectory(prefix="hbp-opencompass-selftest-") as tmp:
        model_dir = tiny_model(Path(tmp) / "model")
        out = Path(tmp) / "out"
        try:
            result = oc.evaluate(oc.RunOptions(model_dir=model_dir, out=out, venv=venv, suite=["demo_qa"],
                                               qa_samples=2, num_gpus=0, max_num_workers=1, dtype="float32",
                                               check_stamp=False), echo=False)
        except UserError as err:
            return str(err)
        if result.failures:
            log = venv / "selftest.log"
            shutil.copyfile(out / oc.LOG_NAME, log)
            return f"{result.failures[0].describe()} (OpenCompass output kept in {log})"
        if not any(row["dataset"] == "hbp_demo_qa" and row["score"] is not None for row in result.scores):
            return f"OpenCompass reported no score for hbp_demo_qa (its table: {result.scores})"
    return None


def tiny_model(out: Path) -> Path:
    """A 2-layer random Llama with the shipped tokenizer, saved as an export (generation config included)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from hbp_train.export import build_generation_config

    tokenizer = AutoTokenizer.from_pretrained(str(REPO / "data_tools" / "assets" / "tokenizer"))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.generation_config = build_generation_config(str(out), config, tokenizer)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out
