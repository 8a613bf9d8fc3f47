"""Detect the shape of a raw SFT record and normalise it into a ``Sample``: chat turns ``[{"role", "content"}, ...]``
for the chat template (or plain text, rendered with none), the tool definitions, which assistant turns are context
only, and the fields the record holds that no shape uses.

Shapes (``fmt`` = ``auto`` detects per record, in this order; docs/input_formats.md has an example of each):

* ``messages`` (OpenAI): ``{"messages": [{"role": "system"|"developer"|"user"|"assistant"|"tool", "content": str},
  ...], "tools": optional}``. ``content`` may be a list of ``{"type": "text", "text": str}`` parts (joined);
  ``developer`` means system. An assistant turn may carry ``tool_calls`` (then ``content`` may be null) and a
  ``weight`` (0: context, not trained on; 1: trained); a tool turn its ``tool_call_id`` and ``name``.
* ``sharegpt``: ``{"conversations": [{"from": "human"|"gpt"|"system"|"function_call"|"observation"|..., "value": str},
  ...], "system": optional str, "tools": optional}``. LLaMA-Factory's ``function_call`` turn (``value`` the JSON of
  ``{"name", "arguments"}`` or of a list of them) becomes an assistant turn with ``tool_calls``, ``observation`` a
  tool turn. A ``conversations`` list of role/content turns is read as OpenAI turns.
* ``alpaca``: ``{"instruction": str, "input": optional str, "output": str, "system": optional str, "history":
  optional [[instruction, output], ...]}`` becomes ``[system], (user, assistant) per history pair, user =
  instruction + "\\n\\n" + input, assistant = output``; every answer is trained on, as LLaMA-Factory does.
* ``prompt_completion`` (TRL): lists of messages (the turns of both, in order; only the completion's assistant
  turns are trained on), or strings (plain text, no chat template: the completion is trained on).
* ``text``: ``{"text": str}``, plain text for continued pre-training: every token trained on, no chat template.

``tools`` (a list of definitions, or the JSON text of one as LLaMA-Factory writes it) goes to the chat template; a
call's ``arguments`` given as JSON text (OpenAI's way) is parsed into the object chat templates expect. A null value
counts as an absent field (Parquet and Arrow give every row every column). TRL's preference records
(``prompt``/``chosen``/``rejected``) are refused: they are not SFT data.

Every problem raises ``FormatError(reason, detail, fix)``; ``reason`` is the stable key counted in
``report.json["dropped"]`` by ``data_tools.preprocess`` (see ``REASONS``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from hbp_train.common.errors import UserError

FORMATS = ("messages", "sharegpt", "alpaca", "prompt_completion", "text")

# reason -> what it means; every record-level drop in preprocess uses one of these (or a file/tokenizer reason there).
REASONS = {
    "not_an_object": "the record is not a JSON object",
    "unknown_format": "no messages/conversations/instruction/prompt/text field",
    "preference_data": "a preference record (prompt/chosen/rejected) is DPO data, not SFT",
    "missing_field": "a required field is missing",
    "bad_field_type": "a field has the wrong type",
    "bad_field_value": "a field's value is not allowed (a weight other than 0 or 1, arguments that are not JSON)",
    "unknown_role": "a turn has a role that is not system/user/assistant/tool (or a ShareGPT alias)",
    "empty_conversation": "the conversation has no turns",
    "no_assistant_turn": "nothing to train on: no assistant turn",
    "empty": "the field a record needs is there but empty: an empty CSV cell, or null",
}
# The fields whose presence decides a record's shape (detect_format).
_SHAPE_KEYS = ("messages", "conversations", "instruction", "output", "prompt", "completion", "text")

MESSAGES_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant", "tool": "tool"}
SHAREGPT_ROLES = {
    "system": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "model": "assistant",
    "bard": "assistant", "bing": "assistant",
    "function_call": "assistant",  # LLaMA-Factory: the assistant's tool calls, as JSON
    "observation": "tool", "tool": "tool",  # the tool's result
}
# The fields each shape reads (the rest of a record is counted as ignored) ...
SHAPE_FIELDS = {
    "messages": frozenset({"messages", "tools"}),
    "sharegpt": frozenset({"conversations", "system", "tools"}),
    "alpaca": frozenset({"instruction", "input", "output", "system", "history"}),
    "prompt_completion": frozenset({"prompt", "completion", "tools"}),
    "text": frozenset({"text"}),
}
# ... and the keys of a turn: the plain ones, and those read only on some roles.
_PLAIN_TURN_KEYS = (frozenset({"role", "content"}), frozenset({"from", "value"}))
_ROLE_KEYS = {"assistant": frozenset({"tool_calls"}), "tool": frozenset({"tool_call_id", "name"})}


class FormatError(UserError):
    """A record that cannot be turned into chat turns. ``str(e)`` is ``"<detail>; <fix>"`` (one line)."""

    def __init__(self, reason: str, detail: str, fix: str):
        super().__init__(f"{detail}; {fix}")
        self.reason, self.detail, self.fix = reason, detail, fix


@dataclass(slots=True)
class Sample:
    """One record, normalised: what data_tools.preprocessing.chat_labels encodes."""

    shape: str
    """One of FORMATS."""
    turns: list = field(default_factory=list)
    """Chat turns for the template (empty for plain text)."""
    text: tuple[str, str] | None = None
    """``(prompt, completion)`` of a sample rendered with no chat template: the completion is trained on; plain
    text is ``("", text)``."""
    tools: list | None = None
    """Tool definitions handed to the chat template."""
    untrained: dict = field(default_factory=dict)
    """Index of an assistant turn that is context only -> why (``weight_0``, ``prompt``)."""
    uses_tools: bool = False
    """Some turn is a tool call or result, or there are tool definitions: the template must render them."""
    ignored: list = field(default_factory=list)
    """Fields of the record no shape uses (``meta``; ``messages[].name`` for a turn's)."""


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
    if record.get("messages") is not None:
        return "messages"
    if record.get("conversations") is not None:
        return "sharegpt"
    if record.get("instruction") is not None or record.get("output") is not None:
        return "alpaca"
    if record.get("chosen") is not None or record.get("rejected") is not None:
        raise FormatError("preference_data", "a prompt/chosen/rejected record is preference (DPO) data, not SFT",
                          "to train on the chosen answers, rename 'chosen' to 'completion' and drop 'rejected'")
    if record.get("prompt") is not None or record.get("completion") is not None:
        return "prompt_completion"
    if record.get("text") is not None:
        return "text"
    _raise_if_empty(record, _SHAPE_KEYS)
    keys = ", ".join(sorted(map(str, record))[:8]) or "none"
    raise FormatError("unknown_format", f"unrecognised record shape (keys: {keys})",
                      "use 'messages' (OpenAI), 'conversations' (ShareGPT), 'instruction'+'output' (Alpaca), "
                      "'prompt'+'completion' (TRL) or 'text'")


def parse_record(record: object, fmt: str = "auto") -> Sample:
    """Normalise ``record`` into a ``Sample``. ``fmt`` is ``"auto"`` or one of ``FORMATS``; raises ``FormatError``
    for any invalid record."""
    if fmt == "auto":
        fmt = detect_format(record)
    elif not isinstance(record, dict):
        detect_format(record)  # raises not_an_object
    if fmt not in FORMATS:
        raise ValueError(f"fmt must be 'auto' or one of {FORMATS}, got {fmt!r}")
    sample = Sample(fmt)
    if not record.keys() <= SHAPE_FIELDS[fmt]:
        sample.ignored = [str(k) for k, v in record.items() if v is not None and k not in SHAPE_FIELDS[fmt]]
    if fmt == "messages":
        _add_turns(sample, _required(record, "messages", list), "messages")
    elif fmt == "sharegpt":
        _add_turns(sample, _required(record, "conversations", list), "conversations")
        system = _optional_str(record, "system")
        if system and not (sample.turns and sample.turns[0]["role"] == "system"):  # never a second system turn
            sample.turns.insert(0, {"role": "system", "content": system})
            sample.untrained = {i + 1: why for i, why in sample.untrained.items()}
    elif fmt == "alpaca":
        _alpaca_turns(sample, record)
    elif fmt == "text":
        sample.text = ("", _required(record, "text", str))
        return sample
    else:
        _prompt_completion(sample, record)
        if sample.text is not None:
            return sample  # strings: plain text, no chat template
    if fmt != "alpaca":
        sample.tools = _tools(record.get("tools"))
        sample.uses_tools = sample.uses_tools or sample.tools is not None
    if not sample.turns:
        raise FormatError("empty_conversation", f"'{_list_field(fmt)}' is empty",
                          "drop the record or add at least a user and an assistant turn")
    if not any(turn["role"] == "assistant" for turn in sample.turns):
        raise FormatError("no_assistant_turn", "conversation has no assistant turn, so nothing to train on",
                          "add the assistant's answer or drop the record")
    return sample


def _list_field(fmt: str) -> str:
    return {"messages": "messages", "sharegpt": "conversations", "prompt_completion": "prompt"}[fmt]


def _raise_if_empty(record: dict, names) -> None:
    """A record that lacks what its shape needs only because the field is there and empty (a CSV row's empty cell:
    the reader lists them in ``empty_cells``; a null) says so, naming the fields: its header or keys are right."""
    cells = getattr(record, "empty_cells", ())
    empty = [name for name in names if name in cells]
    if empty:
        columns = ", ".join(f"'{name}'" for name in empty)
        raise FormatError("empty", f"the cell{'s' if len(empty) > 1 else ''} of column{'s' if len(empty) > 1 else ''}"
                                   f" {columns} {'are' if len(empty) > 1 else 'is'} empty",
                          "fill it in or drop the row")
    null = [name for name in names if name in record and record[name] is None]
    if null:
        fields = ", ".join(f"'{name}'" for name in null)
        raise FormatError("empty", f"field{'s' if len(null) > 1 else ''} {fields} {'are' if len(null) > 1 else 'is'}"
                                   " null", "give it a value or drop the record")


def _required(record: dict, field: str, kind: type):
    if record.get(field) is None:
        _raise_if_empty(record, (field,))
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


def _add_turns(sample: Sample, raw_turns: list, field: str, context: bool = False) -> None:
    """Append role/content (OpenAI) or from/value (ShareGPT) turns to ``sample``; the keys of each turn decide.
    ``context``: the turns are a TRL prompt, whose assistant turns are not trained on."""
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
                              "give every turn a role: system, user, assistant or tool")
        raw_role = turn[role_key]
        role = roles.get(raw_role.lower()) if isinstance(raw_role, str) else None
        if role is None:
            raise FormatError("unknown_role", f"{where}.{role_key} is {raw_role!r}", f"use one of {sorted(roles)}")
        function_call = raw_role.lower() == "function_call"
        if turn.keys() in _PLAIN_TURN_KEYS and turn[content_key] is not None and not function_call \
                and not (context and role == "assistant"):  # the common turn, quickly
            sample.turns.append({"role": role, "content": _content(turn[content_key], f"{where}.{content_key}")})
            sample.uses_tools = sample.uses_tools or role == "tool"
        else:
            _add_turn(sample, turn, where, field, role, content_key, function_call, context)


def _add_turn(sample: Sample, turn: dict, where: str, field: str, role: str, content_key: str, function_call: bool,
              context: bool) -> None:
    """Any turn but a plain role and content: a weight, tool calls (OpenAI's or a ShareGPT function_call), a tool
    turn's fields, an assistant turn of a TRL prompt, a missing content; the keys it does not use are counted."""
    out = {"role": role}
    if function_call:
        out["tool_calls"] = _function_call(turn.get(content_key), f"{where}.value")
        out["content"] = ""
    elif role == "assistant" and turn.get("tool_calls") is not None:
        out["tool_calls"] = _tool_calls(turn["tool_calls"], f"{where}.tool_calls")
        out["content"] = "" if turn.get(content_key) is None else _content(turn[content_key], f"{where}.{content_key}")
    elif turn.get(content_key) is None:
        raise FormatError("missing_field", f"{where} has no '{content_key}'", f"add '{content_key}' (a string) to "
                          "the turn" + (" (or its 'tool_calls')" if role == "assistant" else ""))
    else:
        out["content"] = _content(turn[content_key], f"{where}.{content_key}")
    if role == "tool":
        out.update((k, turn[k]) for k in _ROLE_KEYS["tool"] if turn.get(k) is not None)
    weight = turn.get("weight")
    if weight is not None:
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight not in (0, 1):
            shown = weight if isinstance(weight, (int, float)) and not isinstance(weight, bool) else json_kind(weight)
            raise FormatError("bad_field_value", f"{where}.weight is {shown}",
                              "use 0 (not trained on) or 1 (trained on)")
        if weight == 1 and role != "assistant":
            raise FormatError("bad_field_value", f"{where}.weight is 1 on a {role} turn",
                              "only assistant turns are trained on: remove the weight or make it 0")
        if weight == 1 and context:
            raise FormatError("bad_field_value", f"{where}.weight is 1 but the prompt is context, not trained on",
                              "move the turn into 'completion'")
    if role == "assistant" and (context or weight == 0):
        sample.untrained[len(sample.turns)] = "prompt" if context else "weight_0"
    sample.uses_tools = sample.uses_tools or role == "tool" or "tool_calls" in out
    used = {"role", "from", content_key, "weight", *_ROLE_KEYS.get(role, ())}
    sample.ignored += [f"{field}[].{k}" for k, v in turn.items() if v is not None and k not in used]
    sample.turns.append(out)


def _json_text(value: object, where: str, fix: str) -> object:
    """``value`` parsed when it is a string (a field given as its JSON text), else as it is."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as e:
        raise FormatError("bad_field_value", f"{where} is not JSON ({e.msg} at column {e.colno})", fix) from None


def _arguments(value: object, where: str) -> object:
    """A tool call's arguments as chat templates expect them: an object (OpenAI writes its JSON text)."""
    value = _json_text(value, where, "write the arguments as an object or as its JSON text")
    if not isinstance(value, dict):
        raise FormatError("bad_field_type", f"{where} is {json_kind(value)}, expected an object",
                          "write the arguments as an object or as its JSON text")
    return value


def _tool_calls(value: object, where: str) -> list[dict]:
    """OpenAI ``tool_calls``, each passed whole to the template with its arguments parsed."""
    if not isinstance(value, list) or not value:
        raise FormatError("bad_field_type", f"{where} is {json_kind(value)}, expected a non-empty array",
                          "give 'tool_calls' as [{\"type\": \"function\", \"function\": {\"name\", \"arguments\"}}]")
    calls = []
    for j, call in enumerate(value):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise FormatError("bad_field_type", f"{where}[{j}] has no function name",
                              "write each call as {\"type\": \"function\", \"function\": {\"name\", \"arguments\"}}")
        arguments = _arguments(function.get("arguments", {}), f"{where}[{j}].function.arguments")
        calls.append({**call, "type": call.get("type") or "function", "function": {**function, "arguments": arguments}})
    return calls


def _function_call(value: object, where: str) -> list[dict]:
    """LLaMA-Factory's ``function_call`` turn: the JSON text of ``{"name", "arguments"}`` or of a list of them."""
    fix = "write the value as the JSON text of {\"name\": ..., \"arguments\": {...}} (or of a list of them)"
    try:
        calls = json.loads(value) if isinstance(value, str) else None
    except json.JSONDecodeError as e:
        raise FormatError("bad_field_value", f"{where} is not JSON ({e.msg} at column {e.colno})", fix) from None
    calls = [calls] if isinstance(calls, dict) else calls
    if not calls or not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls):
        raise FormatError("bad_field_value", f"{where} is not a function call with a name", fix)
    return [{"type": "function", "function": {"name": c["name"], "arguments": _arguments(c.get("arguments", {}),
                                                                                       f"{where}.arguments")}}
            for c in calls]


def _tools(value: object) -> list | None:
    """Tool definitions: a list of objects, or its JSON text; None when there are none."""
    value = _json_text(value, "field 'tools'", "give 'tools' as a list of definitions or its JSON text")
    if value is None or value == []:
        return None
    if not isinstance(value, list) or not all(isinstance(tool, dict) for tool in value):
        raise FormatError("bad_field_type", f"field 'tools' is {json_kind(value)}, expected a list of objects",
                          "give 'tools' as a list of definitions or its JSON text")
    return value


def _alpaca_turns(sample: Sample, record: dict) -> None:
    instruction = _required(record, "instruction", str)
    output = _required(record, "output", str)
    extra_input = _optional_str(record, "input")
    system = _optional_str(record, "system")
    user = "\n\n".join(part for part in (instruction, extra_input) if part)
    if not user:
        raise FormatError("empty_conversation", "'instruction' and 'input' are both empty",
                          "give the record an instruction or drop it")
    if system:
        sample.turns.append({"role": "system", "content": system})
    history = record.get("history") or []
    if not isinstance(history, list):
        raise FormatError("bad_field_type", f"field 'history' is {json_kind(history)}, expected an array",
                          "give 'history' as [[instruction, output], ...]")
    for i, pair in enumerate(history):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(p, str) for p in pair)):
            raise FormatError("bad_field_type", f"history[{i}] is not a pair of strings",
                              "give 'history' as [[instruction, output], ...]")
        sample.turns += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    sample.turns += [{"role": "user", "content": user}, {"role": "assistant", "content": output}]


def _prompt_completion(sample: Sample, record: dict) -> None:
    """TRL's prompt/completion into ``sample``: its ``text`` when both are strings, else its turns."""
    prompt, completion = record.get("prompt"), record.get("completion")
    if isinstance(prompt, str) and isinstance(completion, str):
        sample.text = (prompt, completion)
        if record.get("tools") is not None:
            sample.ignored.append("tools")  # no chat template renders them
        return
    for name, value in (("prompt", prompt), ("completion", completion)):
        if value is None:
            _raise_if_empty(record, (name,))
            raise FormatError("missing_field", f"missing field '{name}'", "give both 'prompt' and 'completion'")
    if not (isinstance(prompt, list) and isinstance(completion, list)):
        raise FormatError("bad_field_type", f"'prompt' is {json_kind(prompt)} and 'completion' {json_kind(completion)}",
                          "make both strings (plain text) or both lists of messages")
    _add_turns(sample, prompt, "prompt", context=True)
    first = len(sample.turns)
    _add_turns(sample, completion, "completion")
    if not any(turn["role"] == "assistant" for turn in sample.turns[first:]):
        raise FormatError("no_assistant_turn", "'completion' has no assistant turn, so nothing to train on",
                          "put the assistant's answer in 'completion'")
