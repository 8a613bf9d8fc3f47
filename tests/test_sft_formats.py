"""Tests for data_tools.sft_formats: shape detection, normalisation into chat turns, and the error reasons."""

from __future__ import annotations

import pytest

from data_tools.sft_formats import FormatError, detect_format, to_turns

U = {"role": "user", "content": "hi"}
A = {"role": "assistant", "content": "hello"}


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


def test_detect_format_order():
    assert detect_format({"messages": []}) == "messages"
    assert detect_format({"conversations": []}) == "sharegpt"
    assert detect_format({"instruction": "x", "output": "y"}) == "alpaca"


@pytest.mark.parametrize("record, fmt, reason", [
    ([1, 2], "auto", "not_an_object"),
    ("text", "messages", "not_an_object"),
    ({"text": "hello"}, "auto", "unknown_format"),
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
    ({"messages": [U, {"role": "tool", "content": "x"}, A]}, "auto", "unknown_role"),
    ({"conversations": [{"from": "observation", "value": "x"}, {"from": "gpt", "value": "y"}]}, "auto",
     "unknown_role"),
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
