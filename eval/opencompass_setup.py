"""``--setup-opencompass``: build the OpenCompass venv, prove it on a tiny model, then stamp it.

The steps are listed in eval/opencompass_venv.py, which owns the venv's paths, pins, fingerprint and the check
that refuses an unfinished venv. This module sits above both it and eval/opencompass.py, because the self-test
runs the real OpenCompass through the same ``evaluate`` a user's run goes through.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from eval import opencompass as oc
from eval.opencompass_venv import (DEFAULT_VENV, REPO, REQUIREMENTS, SETUP_COMMAND, STAMP, fingerprint,
                                   install_compat, is_ready, torch_requirement)
from hbp_train.common.errors import UserError


def setup(venv: Path = DEFAULT_VENV) -> int:
    """Build, self-test and stamp the venv (see the module doc); 0 when it is ready, 2 when a step failed."""
    venv = Path(venv).resolve()
    if is_ready(venv):
        print(f"[eval] the OpenCompass venv {venv} is ready (stamp {venv / STAMP}; delete the venv to rebuild it)")
        return 0
    start = time.time()
    (venv / STAMP).unlink(missing_ok=True)
    python = venv / "bin" / "python"
    # --no-compile: byte-compiling every installed file (torch's thousands included) is half of pip's time here;
    # Python compiles the modules OpenCompass imports on their first use instead.
    pip = [str(python), "-m", "pip", "install", "-q", "--no-compile"]
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
