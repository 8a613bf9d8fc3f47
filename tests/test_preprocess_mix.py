"""Tests for data_tools/preprocessing/mixing.py through the real preprocess: per-input weights (``--input a.jsonl:2
b.jsonl:0.5``) and the held-out split (``--heldout-fraction`` / ``--heldout-count``). Every kept sample ends up in
the training set (as often as its weight says), in the held-out set, or listed in dropped.jsonl as left out by its
weight; held-out samples are whole rows, never trained on, and the held-out folder packs for the trainer's held-out
loss."""

from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest

from data_tools.preprocessing.mixing import Mix, parse_input, plan_rows
from data_tools.preprocess import main
from hbp_train.common.errors import UserError
from tests.cli_exit import exit_code
from tests.test_preprocess import GOOD, TOKENIZER, run, write_jsonl


def chats(prefix: str, n: int) -> list[dict]:
    return [{"messages": [{"role": "user", "content": f"{prefix} question {i}: repeat babo kas {'tiko ' * i}"},
                          {"role": "assistant", "content": f"babo kas {i}"}]} for i in range(n)]


@pytest.fixture
def two_inputs(tmp_path):
    return write_jsonl(tmp_path / "a.jsonl", chats("a", 6)), write_jsonl(tmp_path / "b.jsonl", chats("b", 10))


def test_a_trailing_number_is_a_weight_and_a_path_with_colons_stays_a_path(tmp_path):
    assert parse_input("data/a.jsonl:2") == ("data/a.jsonl", 2.0)
    assert parse_input("b.parquet:0.5") == ("b.parquet", 0.5)
    assert parse_input("c.jsonl:1e-1") == ("c.jsonl", 0.1)
    assert parse_input("s3:bucket/c.jsonl") == ("s3:bucket/c.jsonl", 1.0)  # no trailing number: a path
    odd = tmp_path / "run:12"
    odd.write_text("{}\n")
    assert parse_input(str(odd)) == (str(odd), 1.0)  # exists as given: never split
    assert parse_input(f"{odd}:3") == (str(odd), 3.0)
    for bad in ("a.jsonl:0", "a.jsonl:-1", "a.jsonl:0.0"):
        with pytest.raises(UserError, match=rf"--input {bad}: weight .* must be a number > 0"):
            parse_input(bad)


def test_weights_take_whole_repeats_and_a_seeded_fraction(tmp_path, two_inputs):
    a, b = two_inputs
    report, dataset = run(tmp_path, [f"{a}:2.5", f"{b}:0.5"], seed=7)
    sources = Counter(dataset["source"])
    # a: every sample twice, a seeded half (3 of 6) a third time; b: a seeded half (5 of 10) once.
    assert sorted(n for s, n in sources.items() if s.startswith(str(a))) == [2, 2, 2, 3, 3, 3]
    kept_b = {s for s in sources if s.startswith(str(b))}
    assert len(kept_b) == 5 and all(sources[s] == 1 for s in kept_b)
    assert report["rows"] == len(dataset) == 15 + 5
    assert report["per_input"] == [
        {"input": str(a), "weight": 2.5, "read": 6, "kept": 6, "heldout": 0, "before_weight": 6, "after_weight": 15,
         "left_out_by_weight": 0},
        {"input": str(b), "weight": 0.5, "read": 10, "kept": 10, "heldout": 0, "before_weight": 10,
         "after_weight": 5, "left_out_by_weight": 5}]
    # Nothing silently lost: the five samples of b left out are listed, as left out by the weight.
    lines = [json.loads(line) for line in (tmp_path / "out" / "dropped.jsonl").read_text().splitlines()]
    assert {line["source"] for line in lines} == {f"{b}:{i}" for i in range(1, 11)} - kept_b
    assert {line["reason"] for line in lines} == {"weight"} and report["dropped"] == {}
    assert report["read"] == report["kept"] + sum(report["dropped"].values())
    # The report's tokens are the training set's, copies included.
    assert report["tokens"] == sum(dataset["length"]) and report["loss_tokens"] == sum(dataset["num_loss_tokens"])
    # Copies are the very rows of the unweighted run.
    _, plain = run(tmp_path, [a, b], "plain")
    row = {s: ids for s, ids in zip(plain["source"], plain["input_ids"])}
    assert all(ids == row[s] for s, ids in zip(dataset["source"], dataset["input_ids"]))


def test_the_same_seed_gives_the_same_rows_whatever_the_workers(tmp_path, two_inputs):
    a, b = two_inputs
    args = dict(seed=3, heldout_fraction=0.25)
    _, first = run(tmp_path, [f"{a}:1.5", f"{b}:0.3"], "one", **args)
    _, again = run(tmp_path, [f"{a}:1.5", f"{b}:0.3"], "two", num_proc=2, **args)
    assert first["source"] == again["source"] and first["input_ids"] == again["input_ids"]
    _, other = run(tmp_path, [f"{a}:1.5", f"{b}:0.3"], "three", seed=4, heldout_fraction=0.25)
    assert other["source"] != first["source"]


def test_heldout_samples_are_whole_rows_never_trained_on(tmp_path, two_inputs):
    import datasets

    a, b = two_inputs
    report, train = run(tmp_path, [f"{a}:2", b], heldout_count=4, seed=1)
    heldout = datasets.load_from_disk(str(tmp_path / "out_heldout"))
    assert report["heldout"]["output"] == str(tmp_path / "out_heldout") and len(heldout) == 4
    assert not set(heldout["source"]) & set(train["source"])  # no copy of a held-out sample is trained on
    assert len(set(heldout["source"])) == 4
    # The held-out rows are the samples as preprocessing made them: whole conversations, untouched.
    _, plain = run(tmp_path, [a, b], "plain")
    row = {s: (ids, labels) for s, ids, labels in zip(plain["source"], plain["input_ids"], plain["labels"])}
    assert all((ids, labels) == row[s] for s, ids, labels in zip(heldout["source"], heldout["input_ids"],
                                                                    heldout["labels"]))
    held_a = sum(s.startswith(str(a)) for s in heldout["source"])
    assert report["per_input"][0]["heldout"] == held_a and report["per_input"][0]["after_weight"] == 2 * (6 - held_a)
    assert report["rows"] == len(train) == 2 * (6 - held_a) + 10 - (4 - held_a)
    assert report["heldout"]["tokens"] == sum(heldout["length"])
    saved = json.loads((tmp_path / "out_heldout" / "report.json").read_text())
    assert saved["heldout_of"] == str(tmp_path / "out") and saved["samples"] == 4 and saved["seed"] == 1


def test_the_heldout_folder_packs_for_the_trainers_heldout_loss(tmp_path, two_inputs):
    """The held-out folder is a tokenized set as any: data_tools.pack packs it, and the trainer's loader of
    data.eval_shards reads every one of its labelled tokens; the tokenizer record the trainer checks is there."""
    from data_tools.pack import main as pack
    from eval.perplexity import load_tokenized
    from hbp_train.batches.loader import PackedData
    from hbp_train.batches.vocab import recorded_tokenizer

    a, b = two_inputs
    report, _ = run(tmp_path, [a, b], heldout_fraction=0.25, seed=2)
    heldout = tmp_path / "out_heldout"
    assert report["heldout"]["samples"] == 4  # 16 kept, a quarter
    assert pack(["--dataset", str(heldout), "--shards", str(tmp_path / "packed_heldout"), "--max-len", "128",
                 "--world-size", "1", "--groups", "128:1", "--no-baseline", "--quiet"]) == 0
    data = PackedData(str(tmp_path / "packed_heldout"))
    labelled = sum(int((mb["shift_labels"] != -100).sum()) for step in range(data.num_steps)
                   for mb in data.step_batch(step, 0, 0).micro_batches)
    assert labelled == report["heldout"]["loss_tokens"]
    assert recorded_tokenizer(str(heldout))["sha256"] == report["tokenizer_identity"]["sha256"]
    assert len(load_tokenized(heldout)) == 4  # what hbp-eval offline --dataset reads


def test_plan_rows_counts():
    """Whole repeats plus round(frac * n) more, per input, after the held-out rows are taken out."""
    row_input = np.array([0] * 10 + [1] * 7)
    plan = plan_rows(row_input, Mix(weights=[1.25, 3.0], heldout_count=3, seed=0))
    assert len(plan.heldout) == 3 and len(set(plan.heldout.tolist())) == 3
    train = Counter(plan.train.tolist())
    held_a = int(np.sum(plan.heldout < 10))
    a_rows, b_rows = 10 - held_a, 7 - (3 - held_a)
    assert sum(n for r, n in train.items() if r < 10) == a_rows + int(np.floor(0.25 * a_rows + 0.5))
    assert all(train[r] == 3 for r in range(10, 17) if r not in plan.heldout)
    assert not set(train) & set(plan.heldout.tolist()) and len(plan.left_out) == 0


@pytest.mark.parametrize("argv_tail, expected", [
    (["--heldout-fraction", "1"], "--heldout-fraction 1.0: must be between 0 and 1"),
    (["--heldout-count", "3"], "--heldout-count 3 would hold out 3 of 3 kept samples and leave none to train on"),
    (["--heldout-fraction", "0.01"], "--heldout-fraction 0.01 of 3 kept samples holds out none"),
])
def test_a_bad_heldout_size_is_one_line(tmp_path, capsys, argv_tail, expected):
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD] * 3)
    code = exit_code(main, ["--input", str(data), "--output", str(tmp_path / "o"), "--tokenizer", TOKENIZER,
                            *argv_tail])
    err = capsys.readouterr().err.strip()
    assert code == 2 and expected in err and "\n" not in err
    assert not (tmp_path / "o").exists() and not (tmp_path / "o_heldout").exists()


def test_flag_conflicts_are_refused(tmp_path, capsys):
    data = write_jsonl(tmp_path / "d.jsonl", [GOOD] * 3)
    base = ["--input", str(data), "--output", str(tmp_path / "o"), "--tokenizer", TOKENIZER]
    assert exit_code(main, [*base, "--heldout-fraction", "0.5", "--heldout-count", "1"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert exit_code(main, [*base, "--heldout-count", "1", "--heldout-output", str(tmp_path / "o")]) == 2
    assert "the same folder as --output" in capsys.readouterr().err
    assert exit_code(main, ["--input", f"{data}:0", "--output", str(tmp_path / "o"), "--tokenizer", TOKENIZER]) == 2
    assert "weight 0 must be a number > 0" in capsys.readouterr().err


def test_the_cli_prints_the_counts_before_and_after_weighting(tmp_path, two_inputs, capsys):
    a, b = two_inputs
    assert main(["--input", f"{a}:2", f"{b}:0.5", "--output", str(tmp_path / "o"), "--tokenizer", TOKENIZER,
                 "--heldout-count", "2"]) == 0
    out = capsys.readouterr().out
    report = json.loads((tmp_path / "o" / "report.json").read_text())
    a_in, b_in = report["per_input"]
    assert (f"a.jsonl x2: {a_in['before_weight']} -> {a_in['after_weight']} samples, b.jsonl x0.5: "
            f"{b_in['before_weight']} -> {b_in['after_weight']} samples ({b_in['left_out_by_weight']} left out, "
            "listed in dropped.jsonl)") in out
    assert f"held out 2 samples ({report['heldout']['tokens']:,} tokens) -> {tmp_path / 'o_heldout'}" in out
