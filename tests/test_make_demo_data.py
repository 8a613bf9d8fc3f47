"""Tests for data_tools.make_demo_data: determinism, learnable answers, and the long-tailed token-length mix."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data_tools.demo_data.synthetic_chats import LONG_FRACTION, VOCAB, generate
from data_tools.make_demo_data import main
from hbp_train.common.errors import UserError
from tests.cli_exit import exit_code


def expected_answer(user: str) -> str:
    """Recompute the assistant answer from the user turn alone (the task is learnable)."""
    for verb, transform in (("Repeat", lambda w: w), ("Reverse", lambda w: w[::-1]),
                            ("Sort alphabetically", sorted)):
        prefix = f"{verb} these words: "
        if user.startswith(prefix):
            return " ".join(transform(user[len(prefix):].split()))
    body, question = user.rsplit("\n", 1)
    if question == "What is the secret code?":
        code = body.split("The secret code is ", 1)[1].split(".", 1)[0]
        return f"The secret code is {code}."
    assert question.startswith("What is word number "), question
    k = int(question[len("What is word number "):-1])
    words = body[len("Here is a list of words: "):].split()
    return f"Word number {k} is {words[k - 1]}."


def test_deterministic_per_seed():
    assert generate(200, 2048, seed=0) == generate(200, 2048, seed=0)
    assert generate(200, 2048, seed=0) != generate(200, 2048, seed=1)
    assert generate(50, 2048, seed=0) == generate(200, 2048, seed=0)[:50]  # a prefix of a longer run


def test_records_are_valid_chats_with_learnable_answers():
    records = generate(400, 2048, seed=5)
    vocab = set(VOCAB)
    num_system = num_multi_turn = 0
    for record in records:
        messages = record["messages"]
        roles = [m["role"] for m in messages]
        if roles[0] == "system":
            num_system += 1
            roles = roles[1:]
        assert roles == ["user", "assistant"] * (len(roles) // 2) and roles
        num_multi_turn += len(roles) > 2
        pairs = [m["content"] for m in messages if m["role"] != "system"]
        for user, assistant in zip(pairs[::2], pairs[1::2]):
            assert assistant == expected_answer(user)
            assert any(word in vocab for word in user.split())
    assert 0.25 < num_system / len(records) < 0.45
    assert 0.05 < num_multi_turn / len(records) < 0.35


@pytest.mark.parametrize("max_tokens, num_samples", [(2048, 2000), (8192, 600)])
def test_long_tailed_token_lengths_within_max(tokenizer_dir, max_tokens, num_samples):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    lengths = np.array([len(tokenizer.apply_chat_template(r["messages"], tokenize=True)["input_ids"])
                        for r in generate(num_samples, max_tokens, seed=0)])
    assert lengths.max() <= max_tokens  # planned lengths are conservative
    assert lengths.max() >= 0.8 * max_tokens  # ...but the tail reaches close to the limit
    assert 40 <= np.median(lengths) <= 200  # most samples are short
    assert np.percentile(lengths, 90) < max_tokens / 4
    long_fraction = np.mean(lengths > max_tokens / 4)
    assert LONG_FRACTION / 2 <= long_fraction <= 3 * LONG_FRACTION


def test_cli_writes_the_generated_records(tmp_path):
    out = tmp_path / "sub" / "demo.jsonl"
    assert main(["--out", str(out), "--num-samples", "30", "--max-tokens", "512", "--seed", "7"]) == 0
    assert [json.loads(line) for line in out.read_text().splitlines()] == generate(30, 512, seed=7)


def test_bad_arguments(tmp_path, capsys):
    assert exit_code(main, ["--out", str(tmp_path / "x.jsonl"), "--max-tokens", "10"]) == 2
    assert "error: --max-tokens: 10 is out of range (give a whole number >= 64)" in capsys.readouterr().err
    assert exit_code(main, ["--out", str(tmp_path / "x.jsonl"), "--num-samples", "0"]) == 2
    assert "error: --num-samples: 0 is out of range (give a whole number >= 1)" in capsys.readouterr().err
    assert not (tmp_path / "x.jsonl").exists()
    with pytest.raises(UserError, match="num_samples"):
        generate(-1)
    assert exit_code(main, ["--out", str(tmp_path / "x.jsonl"), "--seed", "-1"]) == 2
    assert "--seed: -1 is out of range" in capsys.readouterr().err
    assert exit_code(main, ["--out", str(tmp_path), "--num-samples", "1"]) == 2  # a directory, not a file
    assert f"--out: {tmp_path}: is a folder (give a file path)" in capsys.readouterr().err


def test_interrupt_while_writing_keeps_the_earlier_file(tmp_path, capsys, monkeypatch):
    """Ctrl-C half-way through the file: one line, exit code 130, the earlier file whole, no temporary file."""
    out = tmp_path / "demo.jsonl"
    assert main(["--out", str(out), "--num-samples", "5", "--max-tokens", "512"]) == 0
    before = out.read_bytes()
    capsys.readouterr()
    dumps, calls = json.dumps, []

    def dumps_then_interrupt(obj, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return dumps(obj, **kwargs)

    monkeypatch.setattr(json, "dumps", dumps_then_interrupt)
    assert main(["--out", str(out), "--num-samples", "5", "--max-tokens", "512", "--seed", "1"]) == 130
    assert capsys.readouterr().err == f"make_demo_data: interrupted; --out {out} was left as it was\n"
    assert out.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["demo.jsonl"]


def test_long_fraction_option(tokenizer_dir, tmp_path, capsys):
    """--long-fraction sets the share of long samples (bench/bench_quality.py's second dataset); the default mix is
    unchanged, and every sample still fits --max-tokens."""
    from transformers import AutoTokenizer

    assert generate(100, 2048, seed=0) == generate(100, 2048, seed=0, long_fraction=LONG_FRACTION)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))

    def lengths(fraction):
        return np.array([len(tokenizer.apply_chat_template(r["messages"], tokenize=True)["input_ids"])
                         for r in generate(300, 2048, seed=0, long_fraction=fraction)])

    few, many = np.mean(lengths(0.0) > 512), lengths(0.5)
    assert few <= 0.03  # only the lognormal's far tail
    assert 0.35 <= np.mean(many > 512) <= 0.65 and many.max() <= 2048
    out = tmp_path / "long.jsonl"
    assert main(["--out", str(out), "--num-samples", "20", "--seed", "3", "--long-fraction", "0.3"]) == 0
    assert [json.loads(line) for line in out.read_text().splitlines()] == generate(20, 2048, 3, 0.3)
    assert exit_code(main, ["--out", str(out), "--long-fraction", "1.5"]) == 2
    assert "error: --long-fraction: 1.5 is out of range (give a number in [0, 1])" in capsys.readouterr().err
