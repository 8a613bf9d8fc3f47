"""Tests of the offline evaluation (eval/needle.py, eval/perplexity.py, eval/run.py offline) on a tiny CPU Llama
saved with the shipped tokenizer, exactly as hbp_train.export writes a checkpoint."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from eval.model_io import load_model, stop_token_ids
from eval.needle import score_sample
from eval.tasks.haystack import FILLER_SENTENCES
from eval.tasks.needle import INSTRUCTION, NeedleConfig, generate_samples
from eval.perplexity import run_perplexity, sample_nll
from eval.run import main
from tests.cli_exit import exit_code

REPO = Path(__file__).resolve().parent.parent


def build_tiny_checkpoint(out: Path, tokenizer_dir: Path) -> Path:
    """A randomly initialised 2-layer Llama + the shipped tokenizer, saved like an exported checkpoint."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    return out


def build_tokenized_dataset(out: Path, tokenizer_dir: Path) -> Path:
    """A few rows in the data_tools.preprocess format: chat-rendered, labels only on the assistant turn."""
    from datasets import Dataset
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    rows = []
    for i in range(5):
        messages = [{"role": "user", "content": f"Question {i}: " + " ".join(FILLER_SENTENCES[i:i + 2 + i])},
                    {"role": "assistant", "content": " ".join(FILLER_SENTENCES[i + 3:i + 5 + 2 * i])}]
        prompt = tokenizer.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages, tokenize=False)
        prompt_len = len(tokenizer.encode(prompt, add_special_tokens=False))
        input_ids = tokenizer.encode(full, add_special_tokens=False)
        labels = [-100] * prompt_len + input_ids[prompt_len:]
        rows.append({"input_ids": input_ids, "labels": labels, "length": len(input_ids),
                     "num_loss_tokens": sum(label != -100 for label in labels[1:]), "source": f"test:{i}"})
    Dataset.from_list(rows).save_to_disk(str(out))
    return out


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tokenizer_dir) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "model", tokenizer_dir)


@pytest.fixture(scope="module")
def dataset_dir(tmp_path_factory, tokenizer_dir) -> Path:
    return build_tokenized_dataset(tmp_path_factory.mktemp("data") / "heldout", tokenizer_dir)


@pytest.fixture(scope="module")
def loaded(checkpoint):
    torch.set_num_threads(1)  # tiny model: threads only add synchronisation
    return load_model(checkpoint, torch.device("cpu"), torch.float32)


def direct_token_mean_loss(model, dataset_dir: Path) -> float:
    """Reference: full-logit forward per row, shifted cross-entropy summed over label tokens / their count."""
    from datasets import load_from_disk

    total, count = 0.0, 0
    for row in load_from_disk(str(dataset_dir)):
        ids = torch.tensor(row["input_ids"])
        labels = torch.tensor(row["labels"])
        with torch.no_grad():
            logits = model(input_ids=ids[None]).logits[0]
        total += float(F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum"))
        count += int((labels[1:] != -100).sum())
    return total / count


def test_offline_cli_end_to_end(checkpoint, dataset_dir, tmp_path, loaded):
    out = tmp_path / "eval"
    code = main(["offline", "--model", str(checkpoint), "--lengths", "128,256", "--depths", "0,0.5,1",
                 "--trials", "2", "--dataset", str(dataset_dir), "--out", str(out), "--no-progress"])
    assert code == 0
    result = json.loads((out / "results.json").read_text())
    assert result["device"] == "cpu" and result["chat_template"] is True
    needle = result["needle"]
    assert needle["lengths"] == [128, 256] and needle["depths"] == [0.0, 0.5, 1.0]
    assert len(needle["cells"]) == 6
    for cell in needle["cells"]:
        assert cell["trials"] == 2
        assert 0.0 <= cell["loglik_acc"] <= 1.0 and 0.0 <= cell["greedy_acc"] <= 1.0
        # The haystack fills the target to within the shortest filler sentence and never overshoots it.
        assert cell["length"] - 15 <= cell["mean_tokens"] <= cell["length"]
    assert 0.0 <= needle["loglik_acc"] <= 1.0 and 0.0 <= needle["greedy_acc"] <= 1.0
    assert needle["chance_loglik_acc"] == pytest.approx(1 / 5)

    scores = {(s["dataset"], s["metric"]): s["score"] for s in result["scores"]}
    assert scores[("needle (offline)", "loglik_acc")] == pytest.approx(100 * needle["loglik_acc"])
    assert scores[("needle (offline)", "greedy_acc length 256")] == pytest.approx(
        100 * sum(c["greedy_acc"] for c in needle["cells"] if c["length"] == 256) / 3)
    assert scores[("held-out", "perplexity")] == result["perplexity"]["perplexity"]
    # The samples it scored are the rows `eval.run opencompass --datasets needle` writes for the same settings.
    from eval.suite import SuiteConfig, generate, read_jsonl

    _, tokenizer = loaded
    rows = generate(tokenizer, "needle", SuiteConfig(lengths=[128, 256], depths=[0, 0.5, 1], trials=2))
    assert read_jsonl(out / "needle.jsonl") == rows and len(rows) == 12

    heatmap = Path(result["files"]["heatmap"])
    assert heatmap.is_file() and heatmap.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "results.md").read_text().count("|") > 10

    ppl = result["perplexity"]
    model, _ = loaded
    expected_loss = direct_token_mean_loss(model, dataset_dir)
    assert ppl["loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert ppl["perplexity"] == pytest.approx(math.exp(expected_loss), rel=1e-5)
    from datasets import load_from_disk

    assert ppl["num_loss_tokens"] == sum(load_from_disk(str(dataset_dir))["num_loss_tokens"])


def test_chunked_nll_matches_full_logits(loaded, dataset_dir):
    """The LM head applied in small chunks to label positions only equals the full-logit cross-entropy."""
    from datasets import load_from_disk

    model, _ = loaded
    row = load_from_disk(str(dataset_dir))[4]
    ids, labels = torch.tensor(row["input_ids"]), torch.tensor(row["labels"])
    nll, count = sample_nll(model, ids, labels, chunk_size=7)
    with torch.no_grad():
        logits = model(input_ids=ids[None]).logits[0]
    expected = float(F.cross_entropy(logits[:-1], labels[1:], ignore_index=-100, reduction="sum"))
    assert count == row["num_loss_tokens"]
    assert nll == pytest.approx(expected, rel=1e-5)


def test_perplexity_max_samples(loaded, dataset_dir):
    model, _ = loaded
    result = run_perplexity(model, dataset_dir, max_samples=2, progress=False)
    assert result["num_rows"] == 5 and result["num_samples"] == 2
    assert result["perplexity"] == pytest.approx(math.exp(result["loss"]))


def test_needle_samples_are_deterministic_and_well_formed(loaded):
    _, tokenizer = loaded
    config = NeedleConfig(lengths=[400], depths=[0.0, 0.5, 1.0], trials=2, seed=3)
    first, again = generate_samples(tokenizer, config), generate_samples(tokenizer, config)
    assert [s.prompt_ids for s in first] == [s.prompt_ids for s in again]
    assert len(first) == 6
    for sample in first:
        text = tokenizer.decode(sample.prompt_ids)
        needle = f"is {sample.value}."
        assert text.startswith("<|begin_of_text|><|im_start|>user\n")  # rendered with the chat template
        assert text.rstrip().endswith("is")  # the answer prefix ends the prompt
        assert text.count(needle) == 1
        haystack = text[text.index(INSTRUCTION) + len(INSTRUCTION) + 2:text.index("\n\nWhat is the special magic")]
        sentences = haystack.split(". ")
        position = [i for i, sentence in enumerate(sentences) if sample.value in sentence][0]
        assert position == round(sample.depth * (len(sentences) - 1))
        assert sample.value not in sample.distractors and len(set(sample.distractors)) == len(sample.distractors)


def test_needle_scores_match_direct_computation(loaded):
    """Candidate log-likelihoods (computed from the cropped KV cache) equal full forward passes, and the greedy
    answer equals HF generate's greedy output."""
    model, tokenizer = loaded
    sample = generate_samples(tokenizer, NeedleConfig(lengths=[170], depths=[0.5], trials=1, num_distractors=3))[0]
    stop = stop_token_ids(model, tokenizer)
    result = score_sample(model, tokenizer, sample, max_new_tokens=8, stop_ids=stop)

    prompt = torch.tensor(sample.prompt_ids)
    for candidate, score in zip([sample.value, *sample.distractors], result["logliks"]):
        cand = torch.tensor(tokenizer.encode(" " + candidate, add_special_tokens=False))
        with torch.no_grad():
            logits = model(input_ids=torch.cat([prompt, cand])[None]).logits[0]
        logprobs = logits[len(prompt) - 1:-1].log_softmax(-1)
        assert score == pytest.approx(float(logprobs[torch.arange(len(cand)), cand].sum()), abs=1e-4)
    assert result["loglik_correct"] == (result["logliks"][0] > max(result["logliks"][1:]))

    with torch.no_grad():
        generated = model.generate(prompt[None], max_new_tokens=8, do_sample=False, eos_token_id=sorted(stop),
                                   pad_token_id=tokenizer.pad_token_id)[0, len(prompt):].tolist()
    generated = [t for t in generated if t not in stop]
    assert result["greedy_text"] == tokenizer.decode(generated, skip_special_tokens=True)


@pytest.mark.parametrize("argv_tail, expected", [
    (["--lengths", "40"], "--lengths: 40 tokens cannot hold"),
    (["--depths", "0,1.5"], "--depths: '0,1.5' is not a list of numbers in [0, 1]"),
    (["--distractors", "0"], "--distractors: 0 is out of range (give a whole number >= 1)"),
    (["--dataset", "/nonexistent/heldout"], "--dataset: /nonexistent/heldout: no such folder"),
    (["--device", "tpu", "--lengths", "200"], "--device tpu: not a device"),
    (["--lengths", "abc"], "error: --lengths: 'abc' is not a list of whole numbers >= 1"),
    (["--depths", "half"], "error: --depths: 'half' is not a list of numbers in [0, 1]"),
    (["--lengths", "99999999"], "--lengths: 99999999 tokens exceed the model's max_position_embeddings (2048"),
])
def test_offline_bad_input_is_one_line(checkpoint, tmp_path, capsys, argv_tail, expected):
    code = exit_code(main, ["offline", "--model", str(checkpoint), "--out", str(tmp_path), "--no-progress",
                            *argv_tail])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert "error: " in err and expected in err and "\n" not in err


def test_offline_missing_model_is_one_line(tmp_path, capsys):
    code = exit_code(main, ["offline", "--model", str(tmp_path / "nope"), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "--model: " in err and "no such folder" in err and "\n" not in err


def test_demo_command_shape_runs(checkpoint, dataset_dir, tmp_path):
    """The exact command the launch.sh demo ends with (defaults for lengths, depths and trials)."""
    out = tmp_path / "demo_eval"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "eval.run", "offline", "--model", str(checkpoint),
                           "--dataset", str(dataset_dir), "--out", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads((out / "results.json").read_text())
    assert result["needle"]["lengths"] == [256, 512, 1024] and len(result["needle"]["cells"]) == 15
    assert result["perplexity"]["num_samples"] == 5
    assert (out / "needle_heatmap.png").is_file()


def test_needle_cells_aggregate_each_score_per_length_and_depth(monkeypatch):
    """run_needle's cells: per (length, depth), the share of loglik-correct and of greedy-correct samples, counted
    separately (a fake scorer makes the two differ by construction)."""
    from types import SimpleNamespace

    import eval.needle as needle
    from eval.needle import run_needle
    from eval.tasks.needle import NeedleSample

    config = NeedleConfig(lengths=[100, 200], depths=[0.0, 1.0], trials=3, num_distractors=4)
    samples = [NeedleSample(list(range(length - t)), str(t), [], length, depth)
               for length in config.lengths for depth in config.depths for t in range(config.trials)]

    def fake_score(model, tokenizer, sample, max_new_tokens, stop_ids):
        t = int(sample.value)
        return {"loglik_correct": t < (2 if sample.depth == 0.0 else 1), "greedy_correct": sample.length == 200 and t == 0,
                "greedy_text": "", "logliks": []}
    monkeypatch.setattr(needle, "score_sample", fake_score)
    model = SimpleNamespace(config=SimpleNamespace(max_position_embeddings=4096))
    out = run_needle(model, None, config, set(), progress=False, samples=samples)
    for cell in out["cells"]:
        picked = [s for s in samples if (s.length, s.depth) == (cell["length"], cell["depth"])]
        scores = [fake_score(None, None, s, 0, None) for s in picked]
        assert cell["trials"] == len(picked) == 3
        assert cell["loglik_acc"] == pytest.approx(sum(r["loglik_correct"] for r in scores) / 3)
        assert cell["greedy_acc"] == pytest.approx(sum(r["greedy_correct"] for r in scores) / 3)
        assert cell["mean_tokens"] == pytest.approx(sum(len(s.prompt_ids) for s in picked) / 3)
    every = [fake_score(None, None, s, 0, None) for s in samples]
    assert out["loglik_acc"] == pytest.approx(sum(r["loglik_correct"] for r in every) / len(samples))
    assert out["greedy_acc"] == pytest.approx(sum(r["greedy_correct"] for r in every) / len(samples))
