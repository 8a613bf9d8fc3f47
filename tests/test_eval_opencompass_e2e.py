"""End to end with the real OpenCompass, on the CPU: its venv built by ``--setup-opencompass`` (kept in the repo's
git-ignored ``.venv-opencompass``, so only the first run pays for it), the offline suite run on a tiny exported model
with the parsed scores checked against OpenCompass's own predictions, and a run whose task fails exiting non-zero.

The tiny model has memorized the demo QA set it is asked (a few seconds of training), so a correct run must score
100 there: the prompt reaches the model as OpenCompass renders it with the chat template, the answer stops at
``<|im_end|>`` and OpenCompass's exact-match evaluator scores it. The long-context tasks it cannot do score near 0;
for those the check is that our per-length/depth breakdown re-scores OpenCompass's predictions to its own score.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv-opencompass"
QA_SAMPLES = 6

pytestmark = [pytest.mark.slow, pytest.mark.full]  # the real OpenCompass: the full tier


@pytest.fixture(scope="module")
def venv() -> Path:
    """The OpenCompass venv, built and self-tested on first use (minutes), then reused (stamp)."""
    from eval.opencompass_setup import setup
    from eval.opencompass_venv import is_ready

    assert setup(VENV) == 0 and is_ready(VENV)
    return VENV


def _run(*argv: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-m", "eval.run", *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=timeout)


def memorized_model(out: Path, tokenizer_dir: Path) -> Path:
    """A 2-layer Llama trained until it answers the demo QA rows of the suite exactly, saved as an export is
    (weights, tokenizer, generation config with the end-of-turn token)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from eval.suite import SuiteConfig, generate
    from hbp_train.export import build_generation_config

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    samples = []
    for row in generate(tokenizer, "demo_qa", SuiteConfig(qa_samples=QA_SAMPLES)):
        # OpenCompass 0.5.4 hands a chat model the user turn with a newline appended (its default meta template
        # merges an empty SYSTEM item into the HUMAN one), so that is the prompt to learn.
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"] + "\n"}], tokenize=False,
                                               add_generation_prompt=True)
        prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
        ids = tokenizer.encode(prompt + row["answer"][0] + "<|im_end|>", add_special_tokens=False)
        labels = torch.tensor(ids)
        labels[:len(prompt_ids)] = -100
        samples.append((torch.tensor(ids), labels))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a tiny model: more threads only wait on each other (tens of times slower when loaded)
    try:
        for _ in range(400):
            loss = sum(model(input_ids=ids[None], labels=labels[None]).loss for ids, labels in samples) / len(samples)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            if loss.item() < 0.005:
                break
    finally:
        torch.set_num_threads(threads)
    assert loss.item() < 0.005
    model.generation_config = build_generation_config(str(out), config, tokenizer)
    model.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def test_setup_again_is_instant(venv):
    start = time.time()
    proc = _run("--setup-opencompass", "--venv", str(venv), timeout=120)
    assert proc.returncode == 0 and "is ready" in proc.stdout
    assert time.time() - start < 30  # the interpreter's start-up; no pip, no self-test


def test_offline_suite_on_an_exported_model(venv, tmp_path, tokenizer_dir):
    model = memorized_model(tmp_path / "tiny-export", tokenizer_dir)
    out = tmp_path / "oc"
    proc = _run("opencompass", "--model", str(model), "--out", str(out), "--datasets", "offline", "--lengths",
                "256,320", "--depths", "0,1", "--trials", "1", "--qa-samples", str(QA_SAMPLES), "--venv", str(venv))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    result = json.loads((out / "results.json").read_text())
    assert (result["device"], result["dtype"], result["failures"]) == ("cpu", "float32", [])
    scores = {s["dataset"]: s["score"] for s in result["scores"] if s["mode"] == "gen"}
    assert set(scores) == {"hbp_needle", "hbp_multikey", "hbp_variable_tracking", "hbp_demo_qa"}
    assert scores["hbp_demo_qa"] == 100.0
    assert all(0.0 <= s <= 100.0 for s in scores.values())

    run = Path(result["files"]["work_dir"])
    assert run.parent == out / "work"  # OpenCompass wrote under --out
    predictions = json.loads((run / "predictions" / "tiny-export" / "hbp_demo_qa.json").read_text())
    # Cut at the stop word: exactly the answer, nothing of what the model would generate after <|im_end|>.
    assert [p["prediction"] for p in predictions.values()] == [p["gold"][0] for p in predictions.values()]
    for name, breakdown in result["breakdowns"].items():
        # OpenCompass rounds to 2 decimals; the breakdown re-scores its predictions with the evaluator's rule.
        assert breakdown["score"] == pytest.approx(scores["hbp_" + name], abs=0.006), name
    needle = result["breakdowns"]["needle"]
    assert [(g["length"], g["depth"], g["samples"]) for g in needle["groups"]] == [
        (256, 0.0, 1), (256, 1.0, 1), (320, 0.0, 1), (320, 1.0, 1)]

    config = (out / "opencompass_config.py").read_text()
    assert "run_cfg={'num_gpus': 0}" in config and "model_kwargs={'torch_dtype': 'float32'}" in config
    assert "stop_words=['<|endoftext|>', '<|im_end|>']" in config
    table = (out / "results.md").read_text()
    assert "| hbp_demo_qa | score | gen | 100 |" in table and "hbp_needle by length and depth" in table
    assert (out / "needle_heatmap.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    infer_log = (run / "logs" / "infer" / "tiny-export" / "hbp_needle.out").read_text()
    used = re.search(r"using stop words: (\[.*\])", infer_log).group(1)  # OpenCompass's own list, in set order
    assert sorted(ast.literal_eval(used)) == ["<|endoftext|>", "<|im_end|>"]


def test_a_failed_task_exits_nonzero_naming_it_and_its_log(venv, tmp_path, tokenizer_dir):
    """Weights OpenCompass cannot load: its inference task dies, and so does the scoring that needs its
    predictions. OpenCompass itself exits 0; our command exits 1 with a line per failed task and its log."""
    from transformers import AutoTokenizer, LlamaConfig

    model = tmp_path / "broken"
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4, max_position_embeddings=1024).save_pretrained(str(model))
    tokenizer.save_pretrained(str(model))
    (model / "model.safetensors").write_bytes(b"these are not safetensors")
    out = tmp_path / "oc"
    proc = _run("opencompass", "--model", str(model), "--out", str(out), "--datasets", "demo_qa", "--qa-samples",
                "2", "--venv", str(venv))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert errors and "Traceback" not in proc.stderr
    infer = [e for e in errors if "OpenCompass task OpenICLInfer[broken/hbp_demo_qa] exited with an error" in e]
    assert len(infer) == 1
    log = Path(infer[0].split("; see ")[1])
    assert log == out / "work" / log.relative_to(out / "work")
    assert log.name == "hbp_demo_qa.out" and "Traceback" in log.read_text()
    result = json.loads((out / "results.json").read_text())
    assert {f["task"] for f in result["failures"]} >= {"OpenICLInfer[broken/hbp_demo_qa]"}
    assert "## Failed tasks" in (out / "results.md").read_text()
