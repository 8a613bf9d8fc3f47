"""Tests for data_tools.preprocess: input shapes, the assistant label mask, drop/error accounting, the saved dataset."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data_tools.demo_data.synthetic_chats import generate
from data_tools.preprocessing.chat_labels import ChatEncoder, TokenizerError
from data_tools.preprocess import main
from data_tools.preprocessing.pipeline import PreprocessError, preprocess
from data_tools.preprocessing.formats import parse_record

ASSETS = Path(__file__).resolve().parent / "assets" / "preprocess"
REPO = Path(__file__).resolve().parent.parent
IM_END = "<|im_end|>"
GOOD = {"messages": [{"role": "user", "content": "Repeat these words: babo kas"},
                     {"role": "assistant", "content": "babo kas"}]}
# A Llama-3-like template (no generation markers): exercises the incremental assistant search.
LLAMA_LIKE_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] + '<|eot_id|>' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)


def run(tmp_path: Path, inputs, name: str = "out", **kwargs) -> tuple[dict, object]:
    import datasets

    out = tmp_path / name
    report = preprocess([str(p) for p in inputs], str(out), kwargs.pop("tokenizer", TOKENIZER), progress=False,
                        **kwargs)
    return report, datasets.load_from_disk(str(out))


TOKENIZER = str(REPO / "data_tools" / "assets" / "tokenizer")


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


def tokenizer_with_template(tmp_path: Path, template: str | None) -> str:
    """A copy of the shipped tokenizer with another chat template (None: no template at all)."""
    directory = tmp_path / "tokenizer"
    shutil.copytree(TOKENIZER, directory)
    config_path = directory / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
    config_path.write_text(json.dumps(config))
    return str(directory)


def labelled_runs(tokenizer, labels) -> list[str]:
    """Decode each maximal run of labelled tokens."""
    labels = np.asarray(labels)
    runs, current = [], []
    for token in labels:
        if token != -100:
            current.append(int(token))
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tokenizer.decode(run) for run in runs]


def source_turns(source: str) -> list[dict]:
    """The normalised turns of the record a ``path:N`` source points at (JSONL line or JSON/Parquet row)."""
    path, n = source.rsplit(":", 1)
    if path.endswith(".jsonl"):
        record = json.loads(Path(path).read_text().split("\n")[int(n) - 1])
    else:
        record = json.loads(Path(path).read_text())[int(n)]
    return parse_record(record).turns


def check_rows(dataset, tokenizer, end_marker: str = IM_END) -> None:
    """Every row: int32 columns, consistent counts, labels exactly on each assistant turn's content + end marker."""
    assert dataset.features["input_ids"].feature.dtype == "int32"
    assert dataset.features["labels"].feature.dtype == "int32"
    assert dataset.features["length"].dtype == "int32"
    assert dataset.features["num_loss_tokens"].dtype == "int32"
    for row in dataset:
        ids, labels = np.asarray(row["input_ids"]), np.asarray(row["labels"])
        assert row["length"] == len(ids) == len(labels)
        assert row["num_loss_tokens"] == np.count_nonzero(labels[1:] != -100) >= 1
        assert np.array_equal(labels[labels != -100], ids[labels != -100])
        expected = [t["content"] + end_marker for t in source_turns(row["source"]) if t["role"] == "assistant"]
        assert labelled_runs(tokenizer, labels) == expected


@pytest.fixture(scope="module")
def encoder():
    return ChatEncoder(TOKENIZER)


# --------------------------------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("name, shape, count", [
    ("messages.jsonl", "messages", 4), ("sharegpt.jsonl", "sharegpt", 3), ("alpaca.json", "alpaca", 3)])
def test_input_shapes_and_label_mask(tmp_path, encoder, name, shape, count):
    report, dataset = run(tmp_path, [ASSETS / name])
    assert report["read"] == report["kept"] == count == len(dataset)
    assert report["formats"] == {shape: count} and report["dropped"] == {}
    assert report["label_mode"] == "generation"
    check_rows(dataset, encoder.tokenizer)


def test_multi_turn_labels_cover_every_assistant_turn(tmp_path, encoder):
    _report, dataset = run(tmp_path, [ASSETS / "messages.jsonl"])
    row = next(r for r in dataset if r["source"].endswith(":4"))  # system + 2 assistant turns + trailing user
    assert labelled_runs(encoder.tokenizer, row["labels"]) == ["nopa" + IM_END, "Word number 2 is sel." + IM_END]
    text = encoder.tokenizer.decode(row["input_ids"])
    assert text.startswith("<|begin_of_text|><|im_start|>system\nAnswer briefly.")
    assert text.endswith("Thanks.<|im_end|>\n")


def test_parquet_and_hf_dir_and_mixed_inputs(tmp_path, encoder):
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [json.loads(line) for line in (ASSETS / "messages.jsonl").read_text().splitlines() if line.strip()]
    # Content parts do not fit one Arrow type with plain strings; keep string contents here.
    records = [r for r in records if all(isinstance(m["content"], str) for m in r["messages"])]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "data.parquet")
    datasets.Dataset.from_list(records).save_to_disk(str(tmp_path / "hf"))
    report, dataset = run(tmp_path, [tmp_path / "data.parquet", tmp_path / "hf", ASSETS / "alpaca.json"])
    n = len(records)
    assert report["read"] == report["kept"] == 2 * n + 3
    assert report["formats"] == {"alpaca": 3, "messages": 2 * n}
    sources = dataset["source"]
    assert sources[:n] == [f"{tmp_path / 'data.parquet'}:{i}" for i in range(n)]
    assert sources[n: 2 * n] == [f"{tmp_path / 'hf'}:{i}" for i in range(n)]
    # Parquet and HF rows tokenize exactly like the same records encoded directly.
    for i, record in enumerate(records):
        ids, labels = encoder.encode(record["messages"])
        for row in (dataset[i], dataset[n + i]):
            assert row["input_ids"] == ids.tolist() and row["labels"] == labels.tolist()


def test_json_file_with_json_lines_is_read_as_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "lines.json", [GOOD, GOOD])
    report, _ = run(tmp_path, [path])
    assert report["kept"] == 2


def test_format_flag_forces_the_shape(tmp_path):
    """--format skips detection: records of another shape are bad input (missing_field), counted in skip mode."""
    report, dataset = run(tmp_path, [ASSETS / "alpaca.json", ASSETS / "messages.jsonl"], fmt="alpaca",
                          on_error="skip")
    assert report["formats"] == {"alpaca": 3} and report["dropped"] == {"missing_field": 4}
    assert report["read"] == 7 and len(dataset) == report["kept"] == 3
    with pytest.raises(PreprocessError, match=r"messages.jsonl:1: missing field 'instruction'"):
        run(tmp_path, [ASSETS / "messages.jsonl"], "fail", fmt="alpaca")


# ------------------------------------------------------------------------------------------ chat templates


def test_incremental_search_matches_generation_mask(tmp_path, encoder):
    """The shipped ChatML template without its generation markers must give the very same labels."""
    plain = encoder.template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    incremental = ChatEncoder(tokenizer_with_template(tmp_path, plain))
    assert incremental.label_mode == "incremental"
    fixtures = [json.loads(line) for line in (ASSETS / "messages.jsonl").read_text().splitlines() if line]
    for record in generate(40, 512, seed=3) + fixtures:
        turns = parse_record(record).turns
        ids_a, labels_a = encoder.encode(turns)
        ids_b, labels_b = incremental.encode(turns)
        assert np.array_equal(ids_a, ids_b) and np.array_equal(labels_a, labels_b)


def test_llama_like_template_without_generation_markers(tmp_path):
    tokenizer_dir = tokenizer_with_template(tmp_path, LLAMA_LIKE_TEMPLATE)
    report, dataset = run(tmp_path, [ASSETS / "messages.jsonl", ASSETS / "sharegpt.jsonl"], tokenizer=tokenizer_dir)
    assert report["label_mode"] == "incremental" and report["kept"] == 7
    check_rows(dataset, ChatEncoder(tokenizer_dir).tokenizer, end_marker="<|eot_id|>")


def test_tokenizer_without_template_gets_default_chatml(tmp_path, encoder):
    tokenizer_dir = tokenizer_with_template(tmp_path, None)
    report, dataset = run(tmp_path, [ASSETS / "sharegpt.jsonl"], tokenizer=tokenizer_dir)
    assert report["chat_template"] == "default" and report["label_mode"] == "generation"
    check_rows(dataset, encoder.tokenizer)
    # The default template is the shipped one (bos first when the tokenizer has a bos).
    assert dataset[0]["input_ids"] == encoder.encode(source_turns(dataset[0]["source"]))[0].tolist()


def test_template_that_rejects_a_conversation(tmp_path):
    strict = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}"
              "{{ m['content'] }}{% endfor %}")
    tokenizer_dir = tokenizer_with_template(tmp_path, strict)
    inputs = [ASSETS / "sharegpt.jsonl"]  # line 2 and 3 have a system turn
    with pytest.raises(PreprocessError, match=r"sharegpt.jsonl:2: chat template failed.*no system"):
        run(tmp_path, inputs, tokenizer=tokenizer_dir)
    report, _ = run(tmp_path, inputs, tokenizer=tokenizer_dir, on_error="skip")
    assert report["dropped"] == {"template_error": 2} and report["kept"] == 1


def test_sample_without_loss_tokens_is_dropped_with_reason(tmp_path):
    # Generation markers around the content only: an empty answer leaves nothing to train on.
    template = ("{% for m in messages %}{{ m['role'] + ': ' }}{% if m['role'] == 'assistant' %}{% generation %}"
                "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{{ '\n' }}{% endfor %}")
    tokenizer_dir = tokenizer_with_template(tmp_path, template)
    empty = {"messages": [{"role": "user", "content": "say nothing"}, {"role": "assistant", "content": ""}]}
    report, dataset = run(tmp_path, [write_jsonl(tmp_path / "d.jsonl", [GOOD, empty])], tokenizer=tokenizer_dir)
    assert report["dropped"] == {"no_loss_tokens": 1} and report["kept"] == 1
    assert dataset["source"] == [f"{tmp_path / 'd.jsonl'}:1"]
    dropped = [json.loads(l) for l in (tmp_path / "out" / "dropped.jsonl").read_text().splitlines()]
    assert [(d["source"], d["reason"]) for d in dropped] == [(f"{tmp_path / 'd.jsonl'}:2", "no_loss_tokens")]


# ------------------------------------------------------------------------------------- over-long samples


def test_truncation_and_drop_accounting(tmp_path, encoder):
    words = " ".join(["babo"] * 200)
    long_question = {"messages": [{"role": "user", "content": words}, {"role": "assistant", "content": "kas"}]}
    long_answer = {"messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": words}]}
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, long_question, long_answer])
    short_len = len(encoder.encode(GOOD["messages"])[0])
    max_len = 64
    assert short_len <= max_len < len(encoder.encode(long_question["messages"])[0])

    report, dataset = run(tmp_path, [path], "truncate", max_len=max_len, overlong="truncate")
    assert (report["read"], report["kept"], report["truncated"]) == (3, 2, 1)
    assert report["dropped"] == {"no_loss_tokens_after_truncation": 1}
    assert dataset["length"] == [short_len, max_len]
    truncated = dataset[1]
    full_ids, full_labels = encoder.encode(long_answer["messages"])
    assert truncated["input_ids"] == full_ids[:max_len].tolist()
    assert truncated["labels"] == full_labels[:max_len].tolist()
    assert report["tokens"] == short_len + max_len
    assert report["loss_tokens"] == sum(dataset["num_loss_tokens"])
    assert report["length_percentiles"]["max"] == max_len

    report, dataset = run(tmp_path, [path], "drop", max_len=max_len, overlong="drop")
    assert (report["read"], report["kept"], report["truncated"]) == (3, 1, 0)
    assert report["dropped"] == {"overlong": 2}
    dropped = [json.loads(l) for l in (tmp_path / "drop" / "dropped.jsonl").read_text().splitlines()]
    assert [d["source"] for d in dropped] == [f"{path}:2", f"{path}:3"]

    # A sample of exactly --max-len is not overlong: kept whole under either policy.
    for policy in ("drop", "truncate"):
        report, dataset = run(tmp_path, [write_jsonl(tmp_path / "good.jsonl", [GOOD])], f"exact_{policy}",
                              max_len=short_len, overlong=policy)
        assert (report["kept"], report["truncated"], report["dropped"]) == (1, 0, {})
        assert dataset["length"] == [short_len]


# ------------------------------------------------------------------------------------------------ bad input

BAD_LINES = {
    "malformed_json": '{"messages": [',
    "not_an_object": "[1, 2]",
    "unknown_format": '{"body": "hello"}',
    "missing_field": '{"instruction": "no output"}',
    "bad_field_type": '{"messages": "hello"}',
    "unknown_role": '{"messages": [{"role": "narrator", "content": "x"}, {"role": "assistant", "content": "y"}]}',
    "empty_conversation": '{"messages": []}',
    "no_assistant_turn": '{"messages": [{"role": "user", "content": "hi"}]}',
}


def bad_file(tmp_path: Path, reason: str) -> Path:
    """good line, the bad line (line 2), good line."""
    path = tmp_path / f"{reason}.jsonl"
    good = json.dumps(GOOD).encode()
    bad = b'{"messages": "caf\xff"}' if reason == "invalid_utf8" else BAD_LINES[reason].encode()
    path.write_bytes(good + b"\n" + bad + b"\n" + good + b"\n")
    return path


def bad_input(tmp_path: Path, reason: str) -> tuple[list[Path], str]:
    """Inputs with one bad record or file, and the source the error must name."""
    good = write_jsonl(tmp_path / "good.jsonl", [GOOD, GOOD])
    if reason == "missing_file":
        bad = tmp_path / "nope.jsonl"
    elif reason == "unsupported_file_type":
        bad = tmp_path / "data.xlsx"
        bad.write_text("a,b\n")
    elif reason == "unreadable_file":
        bad = tmp_path / "broken.parquet"
        bad.write_bytes(b"PAR1 this is not parquet")
    else:
        path = bad_file(tmp_path, reason)
        return [path], f"{path}:2"
    return [good, bad], str(bad)


RECORD_REASONS = sorted(BAD_LINES) + ["invalid_utf8"]
FILE_REASONS = ["missing_file", "unsupported_file_type", "unreadable_file"]


@pytest.mark.parametrize("reason", RECORD_REASONS + FILE_REASONS)
def test_bad_input_fail_mode_one_line_exit_2(tmp_path, capsys, reason):
    inputs, source = bad_input(tmp_path, reason)
    code = main(["--input", *map(str, inputs), "--output", str(tmp_path / "out"), "--tokenizer", TOKENIZER])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"error: {source}: ") and "--on-error skip" in err
    assert not (tmp_path / "out").exists()  # nothing half-written
    assert not list(tmp_path.glob(".out.staging-*"))


@pytest.mark.parametrize("reason", RECORD_REASONS + FILE_REASONS)
def test_bad_input_skip_mode_counts_by_reason(tmp_path, reason):
    inputs, source = bad_input(tmp_path, reason)
    report, dataset = run(tmp_path, inputs, on_error="skip")
    assert report["dropped"] == {reason: 1}
    assert report["read"] == report["kept"] + sum(report["dropped"].values()) == 3
    assert len(dataset) == report["kept"] == 2
    dropped = [json.loads(l) for l in (tmp_path / "out" / "dropped.jsonl").read_text().splitlines()]
    assert [(d["source"], d["reason"]) for d in dropped] == [(source, reason)]
    assert json.loads((tmp_path / "out" / "report.json").read_text())["dropped"] == {reason: 1}


def test_cli_subprocess_exit_code_and_no_traceback(tmp_path):
    path = bad_file(tmp_path, "malformed_json")
    result = subprocess.run([sys.executable, "-m", "data_tools.preprocess", "--input", str(path), "--output",
                             str(tmp_path / "out"), "--tokenizer", TOKENIZER], cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert f"{path}:2: malformed JSON" in result.stderr and "Traceback" not in result.stderr


def test_bad_arguments_and_nothing_kept(tmp_path):
    good = write_jsonl(tmp_path / "good.jsonl", [GOOD])
    with pytest.raises(TokenizerError, match="tokenizer directory not found"):
        run(tmp_path, [good], tokenizer=str(tmp_path / "missing"))
    with pytest.raises(TokenizerError, match=f"{good}: is a file; pass --tokenizer the directory"):
        run(tmp_path, [good], tokenizer=str(good))  # e.g. DIR/tokenizer.json instead of DIR
    with pytest.raises(PreprocessError, match="--max-len"):
        run(tmp_path, [good], max_len=1)
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "precious.txt").write_text("x")
    with pytest.raises(PreprocessError, match="not empty"):
        run(tmp_path, [good], "taken")
    with pytest.raises(PreprocessError, match=r"no sample kept out of 1 read \(overlong: 1\)"):
        run(tmp_path, [good], max_len=4)
    with pytest.raises(PreprocessError, match="cannot create the output directory"):
        run(tmp_path, [good], "good.jsonl/out")  # a file where the output's parent should be


def test_num_proc_above_the_cpu_count_is_capped_with_a_warning(tmp_path, capsys, monkeypatch):
    import os

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, GOOD])
    report, dataset = run(tmp_path, [path], num_proc=10**6)  # would fork a million workers
    assert report["kept"] == len(dataset) == 2
    assert "--num-proc 1000000 > 1 CPUs available; using 1" in capsys.readouterr().err


def test_help_explains_every_option(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--input", "--output", "--tokenizer", "--format", "--max-len", "--overlong", "--on-error",
                   "--num-proc", "--num-shards", "default ChatML template"):
        assert option in text
    from data_tools.preprocess import build_parser

    for action in build_parser()._actions:  # every option, including ones added later, is explained
        assert action.help and action.help.strip(), action.option_strings


# ------------------------------------------------------------------------------------------- saved dataset


def test_roundtrip_shards_and_rerun(tmp_path, encoder):
    import datasets

    path = tmp_path / "demo.jsonl"
    records = generate(60, 512, seed=1)
    write_jsonl(path, records)
    report, _ = run(tmp_path, [path], num_shards=3)
    assert report["num_shards"] == 3 and len(list((tmp_path / "out").glob("data-*.arrow"))) == 3
    dataset = datasets.load_from_disk(str(tmp_path / "out"))  # memory-mapped from the shards
    assert len(dataset) == 60
    # report.json on disk is the returned report and has every key of the contract (docs/architecture.md).
    assert json.loads((tmp_path / "out" / "report.json").read_text()) == report
    for key in ("read", "kept", "truncated", "dropped", "tokens", "loss_tokens", "length_percentiles", "inputs",
                "tokenizer", "max_len", "formats", "chat_template", "label_mode", "overlong", "on_error",
                "num_shards", "ignored_fields", "untrained_turns"):
        assert key in report, key
    lengths = np.asarray(dataset["length"])
    assert report["length_percentiles"] == {
        **{f"p{q}": int(np.percentile(lengths, q)) for q in (50, 90, 99)},
        "min": int(lengths.min()), "max": int(lengths.max()), "mean": round(float(lengths.mean()), 1)}
    assert (report["read"], report["kept"], report["tokens"]) == (60, 60, int(lengths.sum()))
    assert report["loss_tokens"] == sum(dataset["num_loss_tokens"])
    for i, record in enumerate(records):
        ids, labels = encoder.encode(record["messages"])
        row = dataset[i]
        assert row["source"] == f"{path}:{i + 1}"
        assert row["input_ids"] == ids.tolist() and row["labels"] == labels.tolist()
        assert row["length"] == len(ids) and row["num_loss_tokens"] == np.count_nonzero(labels[1:] != -100)
    # Re-running over an earlier output replaces it.
    report2, again = run(tmp_path, [path])
    assert report2["kept"] == 60 and again["input_ids"] == dataset["input_ids"]


def test_num_proc_2_matches_num_proc_1(tmp_path):
    other_shapes = [{"text": "plain text"}, {"instruction": "q", "output": "a", "history": [["q0", "a0"]]},
                    {"messages": [GOOD["messages"][0], {**GOOD["messages"][1], "weight": 0}, *GOOD["messages"]]}]
    path = write_jsonl(tmp_path / "demo.jsonl", generate(300, 1024, seed=2) + other_shapes + ['{"bad json'])
    kwargs = dict(max_len=512, overlong="truncate", on_error="skip")
    report1, one = run(tmp_path, [path], "one", num_proc=1, **kwargs)
    report2, two = run(tmp_path, [path], "two", num_proc=2, **kwargs)
    assert report1["dropped"].get("malformed_json") == 1 and report1["truncated"] > 0
    assert report1["untrained_turns"] == {"weight_0": 1} and report1["formats"]["text"] == 1
    for key in ("read", "kept", "truncated", "dropped", "tokens", "loss_tokens", "length_percentiles", "formats",
                "ignored_fields", "untrained_turns"):
        assert report1[key] == report2[key]
    assert one.to_dict() == two.to_dict()
    assert (tmp_path / "one" / "dropped.jsonl").read_text() == (tmp_path / "two" / "dropped.jsonl").read_text()


def test_incremental_labels_the_answer_token_that_absorbs_the_prompt_space(tmp_path):
    """'assistant: ' + 'babo kas': BPE makes ' babo' one token straddling the prompt; it must be labelled."""
    template = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")
    encoder = ChatEncoder(tokenizer_with_template(tmp_path, template))
    assert encoder.label_mode == "incremental"
    ids, labels = encoder.encode(GOOD["messages"])
    assert labelled_runs(encoder.tokenizer, labels) == [" babo kas"]
    assert encoder.tokenizer.decode(ids[labels == -100]) == "user: Repeat these words: babo kas\nassistant:\n"


def test_json_array_errors_name_the_line(tmp_path):
    broken = tmp_path / "broken.json"
    broken.write_text('[\n  {"instruction": "a", "output": "b"},\n  {"instruction": "a" "output": "b"}\n]\n')
    with pytest.raises(PreprocessError, match=rf"^{broken}:3: malformed JSON"):
        run(tmp_path, [broken])
    single = tmp_path / "single.json"
    single.write_text(json.dumps(GOOD))
    report, _ = run(tmp_path, [single, ASSETS / "alpaca.json"], on_error="skip")
    assert report["dropped"] == {"malformed_json": 1} and report["kept"] == 3


def test_interrupt_exits_130_and_keeps_the_earlier_output(tmp_path, capsys, monkeypatch):
    """Ctrl-C as the new dataset is being saved: one line, exit code 130, the earlier output as it was and no
    staging folder left beside it."""
    import datasets

    path = write_jsonl(tmp_path / "d.jsonl", [GOOD, GOOD])
    argv = ["--input", str(path), "--output", str(tmp_path / "out"), "--tokenizer", TOKENIZER]
    assert main(argv) == 0
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    capsys.readouterr()
    write_jsonl(path, [GOOD, GOOD, GOOD])

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", interrupt)
    assert main(argv) == 130
    err = capsys.readouterr().err
    assert err.splitlines() == [f"preprocess: interrupted; --output {tmp_path / 'out'} was left as it was"]
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d.jsonl", "out"]


def test_pool_workers_leave_ctrl_c_to_the_parent(encoder, ctrl_c_stops_python):
    """Ctrl-C reaches every process of the job: workers ignore it (else each prints a traceback); the parent
    stops them. (ctrl_c_stops_python: the parent starts with Python's Ctrl-C handler even when the suite runs in
    the background, where SIGINT is ignored from the start.)"""
    import signal

    from data_tools.preprocessing.workers import start_pool

    pool = start_pool(1, TOKENIZER, None, "drop", encoder)
    try:
        assert pool.apply(signal.getsignal, (signal.SIGINT,)) == signal.SIG_IGN
    finally:
        pool.terminate()
        pool.join()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # this process still stops on Ctrl-C
