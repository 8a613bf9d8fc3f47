"""Tests of the generated tasks (eval/tasks/) and of the suite that writes and re-scores them (eval/suite.py), with
the shipped tokenizer and its chat template."""

from __future__ import annotations

import re

import pytest

from eval import suite
from eval.tasks import demo_qa
from eval.tasks.haystack import FILLER_SENTENCES, place, render_prompt
from eval.tasks.needle import NeedleConfig, generate_samples
from hbp_train.common.errors import UserError


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def test_place_keeps_facts_at_their_fractions_in_order():
    sentences = ["a", "b", "c", "d"]
    assert place(sentences, [(0.0, "X")]) == ["X", "a", "b", "c", "d"]
    assert place(sentences, [(1.0, "X")]) == ["a", "b", "c", "d", "X"]
    assert place(sentences, [(0.5, "Y"), (0.5, "X"), (0.25, "W")]) == ["a", "W", "b", "Y", "X", "c", "d"]


def test_multikey_needles_hide_one_asked_value_among_other_keys(tokenizer):
    config = NeedleConfig(lengths=[300, 600], depths=[0.0, 0.5, 1.0], trials=2, num_keys=4, seed=5)
    samples = generate_samples(tokenizer, config)
    assert len(samples) == 12
    for sample in samples:
        needles = re.findall(r"The special magic number for (\w+) is (\d+)\.", sample.user)
        assert len(needles) == 4 and len({k for k, _ in needles}) == 4
        assert (sample.key, sample.value) in needles
        assert sample.user.endswith(f"What is the special magic number for {sample.key}?")
        # The other needles' values are the first distractors of the offline log-likelihood score.
        assert set(sample.distractors) == {v for k, v in needles if k != sample.key} | set(sample.distractors[3:])
        assert sample.length - 15 <= len(sample.prompt_ids) <= sample.length
        prefix = f"The special magic number for {sample.key} is"
        assert sample.prompt_ids == render_prompt(tokenizer, sample.user, prefix)
        if sample.depth in (0.0, 1.0):  # the asked needle first or last, whatever the others' depths
            haystack = sample.user.split("\n\n")[1]
            needle = f"The special magic number for {sample.key} is {sample.value}."
            assert haystack.startswith(needle) if sample.depth == 0.0 else haystack.endswith(needle)


def test_variable_tracking_chain_is_in_reading_order_and_answered_by_its_names(tokenizer):
    rows = suite.generate(tokenizer, "variable_tracking", suite.SuiteConfig(lengths=[256, 512], depths=[0, 1],
                                                                            trials=2, seed=3))
    assert len(rows) == 2 * 4 and rows == suite.generate(tokenizer, "variable_tracking", suite.SuiteConfig(
        lengths=[256, 512], depths=[0, 1], trials=2, seed=3))
    for row in rows:
        value = row["value"]
        statements = re.findall(r"VAR ([A-Z]{5}) = (VAR ([A-Z]{5})|\d+)\.", row["prompt"])
        assert [s[0] for s in statements] == row["answer"] and len(row["answer"]) == 5
        assert statements[0][1] == value  # the first assignment holds the value ...
        assert all(s[2] == previous for s, previous in zip(statements[1:], row["answer"]))  # ... then each copies
        assert row["prompt"].endswith(f"Which variables are assigned the value {value}?")
        assert row["length"] - 15 <= row["tokens"] <= row["length"]


def _expected_answer(question: str) -> str:
    """The demo data's rule, restated from data_tools/demo_data/synthetic_chats.py's task descriptions."""
    kind = demo_qa.kind(question)
    if kind in ("repeat", "reverse", "sort"):
        words = question.split(": ", 1)[1].split()
        return " ".join({"repeat": words, "reverse": words[::-1], "sort": sorted(words)}[kind])
    if kind == "kth":
        words = question.split(": ", 1)[1].split("\n")[0].split()
        k = int(re.search(r"word number (\d+)\?", question).group(1))
        return f"Word number {k} is {words[k - 1]}."
    assert kind == "needle", question
    return re.search(r"The secret code is [a-z]+ [a-z]+\.", question).group(0)


def test_demo_qa_answers_follow_from_their_questions(tokenizer):
    rows = suite.generate(tokenizer, "demo_qa", suite.SuiteConfig(qa_samples=40))
    assert len(rows) == 40 and len({r["prompt"] for r in rows}) == 40
    assert {r["kind"] for r in rows} == {"repeat", "reverse", "sort", "kth", "needle"}
    for row in rows:
        assert row["answer"] == [_expected_answer(row["prompt"])]
        assert len(tokenizer.encode(row["answer"][0], add_special_tokens=False)) <= 24
    # Seeds the demo trains on (0 and 1) are not used: none of these questions is in its training data.
    from data_tools.demo_data.synthetic_chats import generate

    trained = {m["content"] for seed in (0, 1) for chat in generate(400, 2048, seed) for m in chat["messages"]}
    assert not trained & {r["prompt"] for r in rows}


@pytest.mark.parametrize("rule, prediction, answers, expected", [
    ("contains", "It is 1234567, I think.", ["1234567"], 100.0),
    ("contains", "ABCDE and FGHIJ", ["abcde", "FGHIJ", "KLMNO", "PQRST"], 50.0),
    ("exact", "Word number 3 is bat.", ["Word number 3 is bat."], 100.0),
    ("exact", "The secret code is fib bagu. More text", ["The secret code is fib bagu."], 100.0),
    ("exact", "ba de fo<|im_end|>", ["ba de fo"], 0.0),
    ("exact", "ba de", ["ba de fo"], 0.0),
])
def test_rescoring_follows_opencompass_evaluators(rule, prediction, answers, expected):
    """contains = RulerNiahEvaluator/RulerVtEvaluator; exact = EMEvaluator (its general_postprocess: cut at the
    first period, comma or newline, drop punctuation and articles)."""
    assert suite.score(rule, prediction, answers) == expected


def test_breakdown_groups_and_averages():
    rows = [{"answer": ["1"], "length": n, "depth": d} for n in (100, 200) for d in (0.0, 1.0)]
    result = suite.breakdown("needle", rows, ["1", "x", "1", "1"])
    assert result["score"] == 75.0 and result["group_by"] == ["length", "depth"]
    assert [(g["length"], g["depth"], g["score"]) for g in result["groups"]] == [
        (100, 0.0, 100.0), (100, 1.0, 0.0), (200, 0.0, 100.0), (200, 1.0, 100.0)]


def test_too_short_length_is_a_user_error(tokenizer):
    with pytest.raises(UserError, match=r"--lengths: 100 tokens cannot hold the 5 assignments and question"):
        suite.generate(tokenizer, "variable_tracking", suite.SuiteConfig(lengths=[100]))
    with pytest.raises(UserError, match=r"--lengths: 80 tokens cannot hold the 4 needles"):
        suite.generate(tokenizer, "multikey", suite.SuiteConfig(lengths=[80]))


def test_filler_is_plain_text_without_digits_or_variables():
    """No filler sentence may look like an answer: no digits, no upper-case five-letter names."""
    assert not any(re.search(r"\d|\b[A-Z]{5}\b", s) for s in FILLER_SENTENCES)
