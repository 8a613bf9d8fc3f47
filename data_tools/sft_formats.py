"""Detect the shape of a raw SFT record and normalise it into chat turns ``[{"role", "content"}, ...]``.

Supported shapes (``fmt`` = ``auto`` detects per record, in this order):

* ``messages`` (OpenAI): ``{"messages": [{"role": "system"|"developer"|"user"|"assistant", "content": str}, ...]}``.
  ``content`` may also be a list of ``{"type": "text", "text": str}`` parts (joined); ``developer`` means system.
* ``sharegpt``: ``{"conversations": [{"from": "system"|"human"|"user"|"gpt"|"assistant"|..., "value": str}, ...],
  "system": optional str}``. A ``conversations`` list of role/content turns is read as OpenAI turns.
* ``alpaca``: ``{"instruction": str, "input": optional str, "output": str, "system": optional str}`` becomes
  ``[system], user = instruction + "\\n\\n" + input, assistant = output``.

Every problem raises ``FormatError(reason, detail, fix)``; ``reason`` is the stable key counted in
``report.json["dropped"]`` by ``data_tools.preprocess`` (see ``REASONS``).
"""

from __future__ import annotations

from hbp_train.errors import UserError

FORMATS = ("messages", "sharegpt", "alpaca")

# reason -> what it means; every record-level drop in preprocess uses one of these (or a file/tokenizer reason there).
REASONS = {
    "not_an_object": "the record is not a JSON object",
    "unknown_format": "no messages/conversations/instruction field",
    "missing_field": "a required field is missing",
    "bad_field_type": "a field has the wrong type",
    "unknown_role": "a turn has a role that is not system/user/assistant (or a ShareGPT alias)",
    "empty_conversation": "the conversation has no turns",
    "no_assistant_turn": "nothing to train on: no assistant turn",
}

MESSAGES_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "model": "assistant",
    "bard": "assistant", "bing": "assistant",
}


class FormatError(UserError):
    """A record that cannot be turned into chat turns. ``str(e)`` is ``"<detail>; <fix>"`` (one line)."""

    def __init__(self, reason: str, detail: str, fix: str):
        super().__init__(f"{detail}; {fix}")
        self.reason, self.detail, self.fix = reason, detail, fix


def one_line(text: object, limit: int = 300) -> str:
    """``text`` (an exception's message, say) on one line of at most ``limit`` characters, for error messages."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def json_kind(value: object) -> str:
    """What a parsed JSON value is, in JSON's words ("a number", "null", ...), for messages about the input."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "an array", dict: "an object"}.get(type(value), f"a {type(value).__name__}")


def detect_format(record: object) -> str:
    """Return the shape of ``record`` (one of ``FORMATS``) or raise ``FormatError``."""
    if not isinstance(record, dict):
        raise FormatError("not_an_object", f"record is {json_kind(record)}, not an object",
                          "each record must be a JSON object such as {\"messages\": [...]}")
    if "messages" in record:
        return "messages"
    if "conversations" in record:
        return "sharegpt"
    if "instruction" in record or "output" in record:
        return "alpaca"
    keys = ", ".join(sorted(map(str, record))[:8]) or "none"
    raise FormatError("unknown_format", f"unrecognised record shape (keys: {keys})",
                      "use 'messages' (OpenAI), 'conversations' (ShareGPT) or 'instruction'+'output' (Alpaca)")


def to_turns(record: object, fmt: str = "auto") -> tuple[str, list[dict]]:
    """Normalise ``record`` into ``(shape, [{"role": "system"|"user"|"assistant", "content": str}, ...])``.

    ``fmt`` is ``"auto"`` or one of ``FORMATS``; raises ``FormatError`` for any invalid record.
    """
    if fmt == "auto":
        fmt = detect_format(record)
    elif not isinstance(record, dict):
        detect_format(record)  # raises not_an_object
    if fmt == "messages":
        turns = _turns(_required(record, "messages", list), "messages")
    elif fmt == "sharegpt":
        turns = _turns(_required(record, "conversations", list), "conversations")
        system = _optional_str(record, "system")
        if system and not (turns and turns[0]["role"] == "system"):
            turns.insert(0, {"role": "system", "content": system})
    elif fmt == "alpaca":
        turns = _alpaca_turns(record)
    else:
        raise ValueError(f"fmt must be 'auto' or one of {FORMATS}, got {fmt!r}")
    if not turns:
        raise FormatError("empty_conversation", f"'{_list_field(fmt)}' is empty",
                          "drop the record or add at least a user and an assistant turn")
    if not any(turn["role"] == "assistant" for turn in turns):
        raise FormatError("no_assistant_turn", "conversation has no assistant turn, so nothing to train on",
                          "add the assistant's answer or drop the record")
    return fmt, turns


def _list_field(fmt: str) -> str:
    return {"messages": "messages", "sharegpt": "conversations", "alpaca": "instruction"}[fmt]


def _required(record: dict, field: str, kind: type):
    if field not in record or record[field] is None:
        keys = ", ".join(sorted(map(str, record))[:8]) or "none"
        raise FormatError("missing_field", f"missing field '{field}' (keys: {keys})",
                          f"add '{field}' or pick the right --format")
    value = record[field]
    if not isinstance(value, kind):
        raise FormatError("bad_field_type", f"field '{field}' is {json_kind(value)}, expected {json_kind(kind())}",
                          f"make '{field}' {'a list of turns' if kind is list else json_kind(kind())}")
    return value


def _optional_str(record: dict, field: str) -> str:
    value = record.get(field)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise FormatError("bad_field_type", f"field '{field}' is {json_kind(value)}, expected a string",
                          f"make '{field}' a string or remove it")
    return value


def _content(value: object, where: str) -> str:
    """Turn content: a string, or OpenAI-style text parts joined together."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                       and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise FormatError("bad_field_type", f"{where} is {json_kind(value)}, expected a string",
                      "use a string (or a list of {\"type\": \"text\", \"text\": ...} parts); "
                      "other modalities are not supported")


def _turns(raw_turns: list, field: str) -> list[dict]:
    """Read role/content (OpenAI) or from/value (ShareGPT) turns; the keys of each turn decide."""
    turns = []
    for i, turn in enumerate(raw_turns):
        where = f"{field}[{i}]"
        if not isinstance(turn, dict):
            raise FormatError("bad_field_type", f"{where} is {json_kind(turn)}, expected an object",
                              "each turn must be {\"role\", \"content\"} or {\"from\", \"value\"}")
        if turn.get("role") is not None:
            role_key, content_key, roles = "role", "content", MESSAGES_ROLES
        elif turn.get("from") is not None:
            role_key, content_key, roles = "from", "value", SHAREGPT_ROLES
        else:
            raise FormatError("missing_field", f"{where} has no 'role' (or ShareGPT 'from')",
                              "give every turn a role: system, user or assistant")
        raw_role = turn[role_key]
        role = roles.get(raw_role.lower()) if isinstance(raw_role, str) else None
        if role is None:
            raise FormatError("unknown_role", f"{where}.{role_key} is {raw_role!r}",
                              f"use one of {sorted(roles)}; tool/function turns are not supported")
        if turn.get(content_key) is None:
            raise FormatError("missing_field", f"{where} has no '{content_key}'",
                              f"add '{content_key}' (a string) to the turn")
        turns.append({"role": role, "content": _content(turn[content_key], f"{where}.{content_key}")})
    return turns


def _alpaca_turns(record: dict) -> list[dict]:
    instruction = _required(record, "instruction", str)
    output = _required(record, "output", str)
    extra_input = _optional_str(record, "input")
    system = _optional_str(record, "system")
    user = "\n\n".join(part for part in (instruction, extra_input) if part)
    if not user:
        raise FormatError("empty_conversation", "'instruction' and 'input' are both empty",
                          "give the record an instruction or drop it")
    turns = [{"role": "system", "content": system}] if system else []
    return turns + [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
