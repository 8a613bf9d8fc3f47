"""Tests for data_tools.preprocessing.formats: shape detection, normalisation into samples and the error reasons;
then every shape through the real preprocess, token for token."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from data_tools.preprocessing.formats import FormatError, detect_format, parse_record

U = {"role": "user", "content": "hi"}
A = {"role": "assistant", "content": "hello"}


def to_turns(record, fmt: str = "auto") -> tuple[str, list[dict]]:
    sample = parse_record(record, fmt)
    return sample.shape, sample.turns


def test_messages_with_and_without_system():
    assert to_turns({"messages": [U, A]}) == ("messages", [U, A])
    system = {"role": "system", "content": "be brief"}
    assert to_turns({"messages": [system, U, A]}) == ("messages", [system, U, A])


def test_messages_aliases_and_text_parts():
    record = {"messages": [{"role": "developer", "content": "rules"},
                           {"role": "User", "content": [{"type": "text", "text": "a "}, {"type": "text", "text": "b"}]},
                           {"role": "assistant", "content": "c", "name": None}]}
    assert to_turns(record)[1] == [{"role": "system", "content": "rules"}, {"role": "user", "content": "a b"},
                                   {"role": "assistant", "content": "c"}]


def test_sharegpt_roles_and_system_field():
    record = {"system": "sys", "conversations": [{"from": "human", "value": "q1"}, {"from": "gpt", "value": "a1"},
                                                 {"from": "user", "value": "q2"}, {"from": "chatgpt", "value": "a2"}]}
    shape, turns = to_turns(record)
    assert shape == "sharegpt"
    assert [t["role"] for t in turns] == ["system", "user", "assistant", "user", "assistant"]
    assert [t["content"] for t in turns] == ["sys", "q1", "a1", "q2", "a2"]
    # A system turn already present is not duplicated by the top-level field.
    record = {"system": "x", "conversations": [{"from": "system", "value": "y"}, {"from": "human", "value": "q"},
                                               {"from": "gpt", "value": "a"}]}
    assert [t["content"] for t in to_turns(record)[1]] == ["y", "q", "a"]


def test_sharegpt_list_of_role_content_turns():
    assert to_turns({"conversations": [U, A]}) == ("sharegpt", [U, A])


def test_alpaca_variants():
    assert to_turns({"instruction": "do", "input": "this", "output": "done"})[1] == [
        {"role": "user", "content": "do\n\nthis"}, {"role": "assistant", "content": "done"}]
    assert to_turns({"instruction": "do", "input": None, "output": "done", "system": "s"})[1] == [
        {"role": "system", "content": "s"}, {"role": "user", "content": "do"}, {"role": "assistant", "content": "done"}]


def test_samples_of_weights_history_prompt_completion_and_text():
    """The turn indices of untrained turns follow the turns as finally ordered (a ShareGPT system field first)."""
    sample = parse_record({"system": "s", "conversations": [
        {"from": "human", "value": "q"}, {"from": "gpt", "value": "a", "weight": 0},
        {"from": "human", "value": "q2"}, {"from": "gpt", "value": "b", "weight": 1}]})
    assert [t["role"] for t in sample.turns] == ["system", "user", "assistant", "user", "assistant"]
    assert sample.untrained == {2: "weight_0"} and not sample.uses_tools and sample.ignored == []
    sample = parse_record({"instruction": "q3", "output": "c", "history": [["q1", "a"], ["q2", "b"]]})
    assert [t["content"] for t in sample.turns] == ["q1", "a", "q2", "b", "q3", "c"] and sample.untrained == {}
    sample = parse_record({"prompt": [U, A, U], "completion": [A], "id": 3})
    assert sample.shape == "prompt_completion" and sample.turns == [U, A, U, A]
    assert sample.untrained == {1: "prompt"} and sample.ignored == ["id"] and sample.text is None
    sample = parse_record({"prompt": "p", "completion": "c", "tools": []})
    assert (sample.text, sample.turns, sample.ignored) == (("p", "c"), [], ["tools"])
    assert parse_record({"text": "t"}).text == ("", "t")
    assert parse_record({"messages": [U, {"role": "tool", "content": "r"}, A]}).uses_tools


def test_detect_format_order():
    assert detect_format({"messages": []}) == "messages"
    assert detect_format({"conversations": []}) == "sharegpt"
    assert detect_format({"instruction": "x", "output": "y"}) == "alpaca"
    assert detect_format({"prompt": "x", "completion": "y", "text": "z"}) == "prompt_completion"
    assert detect_format({"text": "z", "messages": None}) == "text"  # null is absent


@pytest.mark.parametrize("record, fmt, reason", [
    ([1, 2], "auto", "not_an_object"),
    ("text", "messages", "not_an_object"),
    ({"body": "hello"}, "auto", "unknown_format"),
    ({"prompt": "2+2?", "chosen": "4", "rejected": "5"}, "auto", "preference_data"),
    ({"chosen": [U, A], "rejected": [U, A]}, "auto", "preference_data"),
    ({"messages": [U, A]}, "sharegpt", "missing_field"),
    ({"instruction": "x"}, "auto", "missing_field"),
    ({"messages": [{"role": "user"}, A]}, "auto", "missing_field"),
    ({"messages": [{"content": "x"}, A]}, "auto", "missing_field"),
    ({"messages": "hello"}, "auto", "bad_field_type"),
    ({"messages": ["hello", A]}, "auto", "bad_field_type"),
    ({"messages": [{"role": "user", "content": 3}, A]}, "auto", "bad_field_type"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}, A]}, "auto",
     "bad_field_type"),
    ({"instruction": "x", "output": 5}, "auto", "bad_field_type"),
    ({"messages": [U, {"role": "narrator", "content": "x"}, A]}, "auto", "unknown_role"),
    ({"conversations": [{"from": "robot", "value": "x"}, {"from": "gpt", "value": "y"}]}, "auto", "unknown_role"),
    ({"messages": [{**U, "weight": 1}, A]}, "auto", "bad_field_value"),
    ({"messages": [U, {**A, "weight": True}]}, "auto", "bad_field_value"),
    ({"prompt": [U, {**A, "weight": 1}, U], "completion": [A]}, "auto", "bad_field_value"),
    ({"messages": [U, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]},
     "auto", "bad_field_value"),
    ({"messages": [U, {"role": "assistant", "tool_calls": [{"function": {"arguments": "{}"}}]}]}, "auto",
     "bad_field_type"),
    ({"messages": [U, {"role": "assistant", "tool_calls": []}]}, "auto", "bad_field_type"),
    ({"messages": [U, {"role": "assistant", "content": None}]}, "auto", "missing_field"),
    ({"conversations": [{"from": "human", "value": "q"}, {"from": "function_call", "value": "get_weather()"}]},
     "auto", "bad_field_value"),
    ({"messages": [U, A], "tools": "[{"}, "auto", "bad_field_value"),
    ({"messages": [U, A], "tools": {"name": "f"}}, "auto", "bad_field_type"),
    ({"instruction": "q", "output": "a", "history": [["q0"]]}, "auto", "bad_field_type"),
    ({"instruction": "q", "output": "a", "history": "q0 a0"}, "auto", "bad_field_type"),
    ({"prompt": "q"}, "auto", "missing_field"),
    ({"prompt": "q", "completion": [A]}, "auto", "bad_field_type"),
    ({"prompt": [U], "completion": [U]}, "auto", "no_assistant_turn"),
    ({"text": 5}, "auto", "bad_field_type"),
    ({"messages": []}, "auto", "empty_conversation"),
    ({"instruction": "", "input": "", "output": "y"}, "auto", "empty_conversation"),
    ({"messages": [U]}, "auto", "no_assistant_turn"),
])
def test_errors_have_reason_detail_and_fix(record, fmt, reason):
    with pytest.raises(FormatError) as info:
        to_turns(record, fmt)
    error = info.value
    assert error.reason == reason
    assert error.detail and error.fix
    assert "\n" not in str(error)


def test_unknown_fmt_argument_is_a_programming_error():
    with pytest.raises(ValueError, match="fmt must be"):
        to_turns({"messages": [U, A]}, "csv")


# ------------------------------------------------ every shape through the real preprocess, token for token
# Each test preprocesses records with the shipped tokenizer (ChatML, bos first, eos <|endoftext|>) or a copy of it
# with another chat template, and checks the exact tokens (the text they encode), the labelled runs (what is trained
# on) and the report's counts.

from data_tools.preprocessing.pipeline import PreprocessError  # noqa: E402
from tests.test_preprocess import (  # noqa: E402
    IM_END, TOKENIZER, labelled_runs, run, tokenizer_with_template, write_jsonl)

BOS = "<|begin_of_text|>"
EOS = "<|endoftext|>"
TOOL_TEMPLATE = (Path(__file__).resolve().parent / "assets" / "preprocess" / "tool_chat_template.jinja").read_text()


def chatml(*turns: tuple[str, str]) -> str:
    """The shipped template's rendering of (role, content) turns."""
    return BOS + "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in turns)


def assert_row(tokenizer, row, text: str, trained: list[str], bos_id: int | None = None, eos: bool = False):
    """The row holds exactly the tokens of ``text`` (after ``bos_id``, before the eos when ``eos``) and trains on
    exactly the runs ``trained``."""
    ids = ([bos_id] if bos_id is not None else []) + tokenizer(text, add_special_tokens=False)["input_ids"]
    assert row["input_ids"] == ids + ([tokenizer.eos_token_id] if eos else [])
    assert labelled_runs(tokenizer, row["labels"]) == trained


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(TOKENIZER, local_files_only=True)


def test_alpaca_history_turns_are_kept_and_trained(tmp_path, tokenizer):
    """LLaMA-Factory's multi-turn Alpaca: ``history`` pairs come before the current turn, every answer trained."""
    record = {"instruction": "And 3+3?", "input": "", "output": "6", "system": "Be brief.",
              "history": [["What is 1+1?", "2"], ["And 2+2?", "4"]]}
    report, dataset = run(tmp_path, [write_jsonl(tmp_path / "a.jsonl", [record])])
    assert report["formats"] == {"alpaca": 1} and report["kept"] == 1 and report["ignored_fields"] == {}
    text = chatml(("system", "Be brief."), ("user", "What is 1+1?"), ("assistant", "2"), ("user", "And 2+2?"),
                  ("assistant", "4"), ("user", "And 3+3?"), ("assistant", "6"))
    assert_row(tokenizer, dataset[0], text, ["2" + IM_END, "4" + IM_END, "6" + IM_END])


def test_weight_0_turns_are_context_not_trained(tmp_path, tokenizer):
    """OpenAI fine-tuning's per-turn ``weight``: 0 = shown to the model but not trained on, 1 = trained."""
    record = {"messages": [{"role": "user", "content": "Name a colour."},
                           {"role": "assistant", "content": "Gren.", "weight": 0},
                           {"role": "user", "content": "Spell it right."},
                           {"role": "assistant", "content": "Green.", "weight": 1}]}
    report, dataset = run(tmp_path, [write_jsonl(tmp_path / "w.jsonl", [record])])
    text = chatml(("user", "Name a colour."), ("assistant", "Gren."), ("user", "Spell it right."),
                  ("assistant", "Green."))
    assert_row(tokenizer, dataset[0], text, ["Green." + IM_END])
    assert report["untrained_turns"] == {"weight_0": 1} and report["ignored_fields"] == {}
    # The same with a template without generation markers (the turn is found by rendering prefixes).
    plain = tokenizer_with_template(tmp_path, tokenizer.chat_template.replace("{% generation %}", "")
                                    .replace("{% endgeneration %}", ""))
    report, dataset = run(tmp_path, [tmp_path / "w.jsonl"], "incremental", tokenizer=plain)
    assert report["label_mode"] == "incremental"
    assert_row(tokenizer, dataset[0], text, ["Green." + IM_END])
    # Every answer at weight 0: nothing to train on, a counted drop.
    record["messages"][3]["weight"] = 0
    report, _ = run(tmp_path, [write_jsonl(tmp_path / "w0.jsonl", [record, GOOD_RECORD])], "none")
    assert report["dropped"] == {"no_loss_tokens": 1} and report["kept"] == 1


@pytest.mark.parametrize("turn, message", [
    ({"role": "assistant", "content": "x", "weight": 0.5},
     r"messages\[1\].weight is 0.5; use 0 \(not trained on\) or 1"),
    ({"role": "assistant", "content": "x", "weight": "0"}, r"messages\[1\].weight is a string; use 0"),
])
def test_a_weight_other_than_0_or_1_is_refused(tmp_path, turn, message):
    record = {"messages": [{"role": "user", "content": "q"}, turn]}
    with pytest.raises(PreprocessError, match=message):
        run(tmp_path, [write_jsonl(tmp_path / "w.jsonl", [record])])


GOOD_RECORD = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}


def test_trl_conversational_prompt_completion_trains_the_completion(tmp_path, tokenizer):
    """TRL's conversational prompt/completion: the chat template renders prompt + completion; only the completion's
    assistant turns are trained (an assistant turn inside the prompt is context, counted as such)."""
    record = {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"},
                         {"role": "assistant", "content": "2"}, {"role": "user", "content": "2+2?"}],
              "completion": [{"role": "assistant", "content": "4"}]}
    report, dataset = run(tmp_path, [write_jsonl(tmp_path / "pc.jsonl", [record])])
    text = chatml(("system", "Be brief."), ("user", "1+1?"), ("assistant", "2"), ("user", "2+2?"), ("assistant", "4"))
    assert_row(tokenizer, dataset[0], text, ["4" + IM_END])
    assert report["formats"] == {"prompt_completion": 1} and report["untrained_turns"] == {"prompt": 1}


def test_trl_standard_prompt_completion_is_text_without_template(tmp_path, tokenizer):
    """TRL's standard prompt/completion (strings): no chat template, prompt + completion as text with the eos
    after it; the completion and the eos are trained."""
    record = {"prompt": "The capital of France is", "completion": " Paris."}
    report, dataset = run(tmp_path, [write_jsonl(tmp_path / "pc.jsonl", [record])])
    assert_row(tokenizer, dataset[0], "The capital of France is Paris.", [" Paris." + EOS], eos=True)
    assert report["formats"] == {"prompt_completion": 1}


def test_trl_preference_pairs_are_refused_in_one_line(tmp_path):
    record = {"prompt": "2+2?", "chosen": "4", "rejected": "5"}
    path = write_jsonl(tmp_path / "dpo.jsonl", [record, GOOD_RECORD])
    with pytest.raises(PreprocessError, match=r"dpo.jsonl:1: .*chosen/rejected.* preference .*not SFT") as info:
        run(tmp_path, [path])
    assert "\n" not in str(info.value)
    report, _ = run(tmp_path, [path], "skip", on_error="skip")
    assert report["dropped"] == {"preference_data": 1} and report["kept"] == 1


def test_plain_text_trains_every_token_and_ends_with_eos(tmp_path, tokenizer):
    """Continued pre-training: the text as the tokenizer encodes any text (the shipped one adds no bos), the eos
    after it, every token trained."""
    report, dataset = run(tmp_path, [write_jsonl(tmp_path / "t.jsonl", [{"text": "Once upon a time."}])])
    assert_row(tokenizer, dataset[0], "Once upon a time.", ["Once upon a time." + EOS], eos=True)
    assert report["formats"] == {"text": 1} and dataset[0]["num_loss_tokens"] == len(dataset[0]["input_ids"]) - 1


def test_plain_text_gets_the_bos_a_tokenizer_adds_to_text(tmp_path, tokenizer):
    """A tokenizer that adds a bos to every text (Llama, Mistral, Gemma): the bos comes first, untrained (no token
    predicts it); a text that already ends with the eos does not get a second one."""
    from tokenizers.processors import TemplateProcessing

    from data_tools.preprocessing.chat_labels import load_tokenizer

    directory = Path(tokenizer_with_template(tmp_path, tokenizer.chat_template))
    with_bos = load_tokenizer(str(directory))
    with_bos.backend_tokenizer.post_processor = TemplateProcessing(
        single=f"{BOS} $A", special_tokens=[(BOS, tokenizer.bos_token_id)])
    with_bos.save_pretrained(str(directory))
    records = [{"text": "Once upon a time."}, {"text": "The end." + EOS}]
    report, dataset = run(tmp_path, [write_jsonl(tmp_path / "t.jsonl", records)], tokenizer=str(directory))
    assert_row(tokenizer, dataset[0], "Once upon a time.", ["Once upon a time." + EOS], bos_id=tokenizer.bos_token_id,
               eos=True)
    assert_row(tokenizer, dataset[1], "The end." + EOS, ["The end." + EOS], bos_id=tokenizer.bos_token_id)
    assert dataset[0]["labels"][0] == -100


def test_fields_not_used_are_counted(tmp_path):
    records = [{"messages": [{"role": "user", "content": "q", "name": "ann"}, {"role": "assistant", "content": "a"}],
                "meta": {"id": 1}, "score": None},
               {"instruction": "q", "output": "a", "meta": "x", "id": 7}]
    report, _ = run(tmp_path, [write_jsonl(tmp_path / "m.jsonl", records)])
    # null values count as absent (Parquet and Arrow give every row every column, null where the row has none)
    assert report["ignored_fields"] == {"id": 1, "meta": 2, "messages[].name": 1}


def test_the_cli_summary_says_what_was_not_trained_on(tmp_path, capsys):
    from data_tools.preprocess import main

    records = [{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "weight": 0},
                             {"role": "user", "content": "q"}, {"role": "assistant", "content": "b"}], "meta": 1}]
    argv = ["--input", str(write_jsonl(tmp_path / "m.jsonl", records)), "--output", str(tmp_path / "out"),
            "--tokenizer", TOKENIZER]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "assistant turns kept as context, not trained on: weight_0 1" in out
    assert "fields not used (records holding them): meta 1" in out and "shapes: messages 1" in out


# ------------------------------------------------------------------------------------------------ tools

CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city.",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
OPENAI_TOOLS = {"messages": [{"role": "user", "content": "Weather in Paris?"},
                             {"role": "assistant", "content": None, "tool_calls": [CALL]},
                             {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
                             {"role": "assistant", "content": "18 C and sunny."}],
                "tools": TOOLS}
SHAREGPT_TOOLS = {"conversations": [{"from": "human", "value": "Weather in Paris?"},
                                    {"from": "function_call",
                                     "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
                                    {"from": "observation", "value": "18 C, sunny"},
                                    {"from": "gpt", "value": "18 C and sunny."}],
                  "tools": json.dumps(TOOLS)}  # LLaMA-Factory writes the definitions as a JSON string


def tool_text() -> tuple[str, list[str]]:
    """What the tool template renders for OPENAI_TOOLS, and what is trained."""
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    text = (BOS + "<|im_start|>system\n# Tools\n<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False)
            + "\n</tools><|im_end|>\n<|im_start|>user\nWeather in Paris?<|im_end|>\n<|im_start|>assistant\n"
            + call + "<|im_end|>\n<|im_start|>user\n<tool_response>18 C, sunny</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n18 C and sunny.<|im_end|>\n")
    return text, [call + IM_END, "18 C and sunny." + IM_END]


@pytest.mark.parametrize("markers", [True, False], ids=["generation", "incremental"])
def test_tool_calls_and_results_with_a_template_that_renders_them(tmp_path, tokenizer, markers):
    """OpenAI tool_calls/tool turns and LLaMA-Factory's ShareGPT function_call/observation turns become the same
    conversation; the template renders the definitions and the call; the call is trained, the result is not."""
    template = TOOL_TEMPLATE if markers else (TOOL_TEMPLATE.replace("{%- generation -%}", "")
                                              .replace("{%- endgeneration -%}", ""))
    path = write_jsonl(tmp_path / "tools.jsonl", [OPENAI_TOOLS, SHAREGPT_TOOLS])
    report, dataset = run(tmp_path, [path], tokenizer=tokenizer_with_template(tmp_path, template))
    assert report["label_mode"] == ("generation" if markers else "incremental")
    assert report["formats"] == {"messages": 1, "sharegpt": 1} and report["ignored_fields"] == {}
    text, trained = tool_text()
    for row in dataset:
        assert_row(tokenizer, row, text, trained)


@pytest.mark.parametrize("record, what", [
    (OPENAI_TOOLS, "tool calls or tool definitions"),
    ({"messages": GOOD_RECORD["messages"], "tools": TOOLS}, "tool definitions"),
])
def test_tools_with_a_template_that_cannot_render_them_are_refused_naming_the_fix(tmp_path, record, what):
    """The shipped ChatML template has no tool support: the call (or the definitions) would vanish from the text."""
    path = write_jsonl(tmp_path / "tools.jsonl", [record, GOOD_RECORD])
    with pytest.raises(PreprocessError, match=rf"tools.jsonl:1: the tokenizer's chat template does not render "
                                              rf"{what}; .*tokenizer whose chat template") as info:
        run(tmp_path, [path])
    assert "\n" not in str(info.value)
    report, _ = run(tmp_path, [path], "skip", on_error="skip")
    assert report["dropped"] == {"template_without_tools": 1} and report["kept"] == 1


def test_every_example_in_the_input_formats_page_is_read_as_it_says(tmp_path):
    """docs/input_formats.md stays true: each ```json example is kept (the tool ones with a template that renders
    tools), the ```json refused one is refused."""
    import re

    page = (Path(__file__).resolve().parent.parent / "docs" / "input_formats.md").read_text()
    blocks = re.findall(r"```json( refused)?\n(.*?)```", page, re.S)
    assert len(blocks) >= 9
    tools = tokenizer_with_template(tmp_path, TOOL_TEMPLATE)
    for i, (refused, text) in enumerate(blocks):
        path = write_jsonl(tmp_path / f"example{i}.jsonl", [json.loads(text)])
        if refused:
            with pytest.raises(PreprocessError, match="preference"):
                run(tmp_path, [path], f"out{i}")
        else:
            report, _ = run(tmp_path, [path], f"out{i}", tokenizer=tools if "tool" in text else TOKENIZER)
            assert report["kept"] == 1 and report["ignored_fields"] == {}, text
