"""The offline needle check's chance level (eval/tasks/needle.py, eval/needle.py, eval/run.py offline) with a
tokenizer that merges digits: its candidates split into equal token counts, so a summed log-likelihood cannot be won
by having fewer tokens, and the same samples' score of the untrained model (the export's config, random weights)
is measured and reported beside the export's.

The tokenizer is a byte-level BPE trained here on 7-digit numbers (data_tools.train_tokenizer): most values split
into 4 tokens, a third into 3, a few into 5."""

from __future__ import annotations

import json
import random
from collections import Counter

import pytest
import torch

from eval.needle import run_needle
from eval.tasks.haystack import FILLER_SENTENCES
from eval.tasks.needle import NeedleConfig, candidate_tokens, generate_samples

CONFIG = NeedleConfig(lengths=[200], depths=[0.0, 0.5, 1.0], trials=10, seed=1)


@pytest.fixture(scope="module")
def digit_tokenizer_dir(tmp_path_factory):
    from data_tools.demo_data.bpe_tokenizer import train

    rng = random.Random(0)
    numbers = [" ".join(str(rng.randint(10**6, 10**7 - 1)) for _ in range(100)) for _ in range(100)]
    texts = ["system\n", "user\n", "assistant\n", *numbers, *FILLER_SENTENCES * 3]
    return train(tmp_path_factory.mktemp("tokenizer") / "digits", vocab_size=800, texts=texts)


@pytest.fixture(scope="module")
def tokenizer(digit_tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(digit_tokenizer_dir))


def tiny_llama(tokenizer, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(1)  # tiny model: more threads only add synchronisation (as eval.run does for it)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()


def test_the_tokenizer_merges_digits_into_uneven_counts(tokenizer):
    """The premise: 7-digit values of this tokenizer do not all split into the same number of tokens."""
    rng = random.Random(5)
    counts = Counter(len(candidate_tokens(tokenizer, str(rng.randint(10**6, 10**7 - 1)))) for _ in range(300))
    assert len(counts) >= 2 and min(counts) < 7 and max(counts.values()) < 300


def test_every_candidate_splits_into_as_many_tokens_as_the_value(tokenizer):
    samples = generate_samples(tokenizer, CONFIG)
    assert len(samples) == 30
    for sample in samples:
        counts = {len(candidate_tokens(tokenizer, v)) for v in [sample.value, *sample.distractors]}
        assert counts == {sample.value_tokens}
        assert len({sample.value, *sample.distractors}) == 1 + CONFIG.num_distractors
    # The multi-key variant's other needles (the first distractors) are drawn the same way.
    multikey = generate_samples(tokenizer, NeedleConfig(lengths=[300], depths=[0.5], trials=4, num_keys=3, seed=2))
    for sample in multikey:
        assert {len(candidate_tokens(tokenizer, v)) for v in [sample.value, *sample.distractors]} == \
            {sample.value_tokens}


def test_token_counts_cannot_decide_the_loglik_score(tokenizer):
    """A real model whose LM head is zero gives every token the same log-probability: candidates differ only in
    how many tokens they have. Ranked by summed log-likelihood, no value may win by that: every sample is a tie,
    which counts as wrong (the true value must score strictly highest)."""
    model = tiny_llama(tokenizer)
    with torch.no_grad():
        model.lm_head.weight.zero_()
    needle = run_needle(model, tokenizer, CONFIG, {tokenizer.eos_token_id}, max_new_tokens=1, progress=False)
    assert needle["loglik_acc"] == 0.0
    assert needle["value_tokens"] and needle["chance_loglik_acc"] == pytest.approx(0.2)


def test_offline_eval_reports_the_untrained_models_score_beside_the_exports(tokenizer, digit_tokenizer_dir,
                                                                            tmp_path):
    """`hbp-eval offline` scores the same samples on the export's config with fresh weights (seeded by --seed) and
    reports it beside the export's: what it reports equals scoring that untrained model directly."""
    from eval.model_io import untrained_model
    from eval.run import main

    export = tmp_path / "export"
    tiny_llama(tokenizer, seed=3).save_pretrained(str(export))
    tokenizer.save_pretrained(str(export))
    out = tmp_path / "eval"
    assert main(["offline", "--model", str(export), "--lengths", "200", "--depths", "0,0.5,1", "--trials", "10",
                 "--seed", "1", "--max-new-tokens", "2", "--out", str(out), "--no-progress"]) == 0
    result = json.loads((out / "results.json").read_text())
    needle = result["needle"]
    baseline = needle["baseline"]
    assert baseline["model"] == "untrained baseline"

    untrained = untrained_model(export, torch.device("cpu"), torch.float32, seed=1)
    samples = generate_samples(tokenizer, CONFIG)
    direct = run_needle(untrained, tokenizer, CONFIG, {tokenizer.eos_token_id}, max_new_tokens=2, progress=False,
                        samples=samples)
    assert baseline["loglik_acc"] == direct["loglik_acc"] and baseline["greedy_acc"] == direct["greedy_acc"]
    # Its weights are not the export's: the two models score the same samples differently.
    exported = tiny_llama(tokenizer, seed=3)
    assert any(not torch.equal(a, b) for a, b in zip(untrained.parameters(), exported.parameters()))

    scores = {(s["metric"], s["mode"]): s["score"] for s in result["scores"] if s["dataset"] == "needle (offline)"}
    assert scores[("loglik_acc, untrained baseline", "baseline")] == pytest.approx(100 * baseline["loglik_acc"])
    assert scores[("loglik_acc", "offline")] == pytest.approx(100 * needle["loglik_acc"])
    table = (out / "results.md").read_text()
    assert "loglik acc (untrained baseline)" in table and "Chance for loglik acc: 0.20" in table


def test_no_baseline_and_a_base_model_with_another_vocabulary(tokenizer, digit_tokenizer_dir, tokenizer_dir,
                                                              tmp_path, capsys):
    from eval.run import main
    from tests.cli_exit import exit_code

    export = tmp_path / "export"
    tiny_llama(tokenizer).save_pretrained(str(export))
    tokenizer.save_pretrained(str(export))
    argv = ["offline", "--model", str(export), "--lengths", "200", "--depths", "0.5", "--trials", "1",
            "--out", str(tmp_path / "eval"), "--no-progress"]
    assert main([*argv, "--baseline", "none"]) == 0
    assert "baseline" not in json.loads((tmp_path / "eval" / "results.json").read_text())["needle"]

    from transformers import AutoTokenizer

    other = tmp_path / "other_base"
    shipped = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tiny_llama(shipped).save_pretrained(str(other))
    shipped.save_pretrained(str(other))
    assert exit_code(main, [*argv, "--baseline", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"--baseline {other}: its tokenizer's vocabulary differs" in err
    assert exit_code(main, [*argv, "--baseline", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "--baseline: '" in err and "neither 'untrained', 'none' nor a model folder" in err
