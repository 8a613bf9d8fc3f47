"""Samples -> ``(input_ids, labels)``: render chats with the tokenizer's chat template and train on the assistant
tokens; tokenize plain text as it is and train on its completion.

``labels`` equal ``input_ids`` on the tokens of every trained assistant turn and ``IGNORE_INDEX`` elsewhere (not
shifted; the loss shifts). If the template marks the assistant with ``{% generation %}`` the tokenizer's assistant
mask is used. Otherwise each assistant turn is found incrementally: the text rendered up to that turn with
``add_generation_prompt=True`` and the text rendered up to the end of the turn must be prefixes of the full render;
the characters in between (minus trailing whitespace) are the assistant's, and the tokens that overlap them are
labelled. Templates that rewrite earlier turns (Qwen3 drops the reasoning of earlier assistant turns, so rendering
up to a turn is not a prefix of the whole) fall back, turn by turn, to substitution: the conversation is rendered
with that turn's content replaced by a sentinel; the text before and after the sentinel must then frame the turn's
content in the full render, and the template's end-of-turn text (e.g. ``<|im_end|>``, found by rendering one
assistant turn) is labelled with it. Header tokens (Llama 3), an injected default system prompt (Qwen2.5) and
renamed roles (Gemma's ``model``) need nothing special: they are the same in every render. A tokenizer without a
chat template gets ``DEFAULT_CHAT_TEMPLATE``: ChatML (``<|im_start|>role\\ncontent<|im_end|>\\n``, the tokenizer's
bos first if it has one) with the assistant's ``content<|im_end|>`` in generation markers (the shipped tokenizer,
data_tools.train_tokenizer, carries the same).

An assistant turn that is context only (``weight`` 0, or inside a TRL prompt) is found the same incremental way and
left out of the labels, whichever way the others were found. Tool calls, tool results and tool definitions go to
the template, which decides how they read; a template that would leave one out of its text (found once per
tokenizer by rendering a probe, ``tool_support``) is refused for the samples that have one. Plain text
(``encode_text``) gets no template: the tokenizer's own special tokens (a bos for Llama, Mistral, Gemma; none for
Qwen) and the eos after it, as TRL does.

A sample that cannot be encoded raises ``FormatError`` with one of ``TEMPLATE_REASONS``; an unusable tokenizer
directory raises ``TokenizerError``.

``encode_batch`` does the same for many samples at once. With generation markers, conversations with every
assistant turn trained and no tools (the common case) are transformers' ``apply_chat_template(...,
return_assistant_tokens_mask=True)`` made batch-wise: the same template rendering (``render_jinja_template``, which
records the generation spans), the same Rust tokenizer call (one batch, no Python objects per token but the
offsets), and the same mask rule (a token is trained on when it overlaps a generation span, in transformers' order
of tests) computed with numpy over the whole batch instead of a Python loop per token (tests/test_chat_labels.py
checks the result against apply_chat_template token for token). Other samples are encoded one by one.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from itertools import chain
from pathlib import Path

import numpy as np

from data_tools.preprocessing.formats import FormatError, Sample, one_line
from hbp_train.common.errors import UserError
from hbp_train.common.labels import IGNORE_INDEX

DEFAULT_CHAT_TEMPLATE = (
    "{% if bos_token %}{{ bos_token }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{{ '\\n' }}"
    "{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")

# reason -> what it means, for conversations the chat template cannot label (record shapes: formats.REASONS).
TEMPLATE_REASONS = {
    "template_error": "the chat template raised on this conversation",
    "template_not_incremental": "the chat template (without generation markers) does not render prefixes stably",
    "template_without_tools": "the chat template does not render the tool calls, results or definitions of a sample",
}


class TokenizerError(UserError):
    """--tokenizer is not a usable local HF fast tokenizer; ``str(e)`` names the directory and the fix."""


def load_tokenizer(tokenizer_dir: str):
    """Load a local HF tokenizer (offline); raises TokenizerError with the fix."""
    from transformers import AutoTokenizer

    if Path(tokenizer_dir).is_file():
        raise TokenizerError(f"{tokenizer_dir}: is a file; pass --tokenizer the directory that holds "
                             f"tokenizer.json/tokenizer_config.json (e.g. data_tools/assets/tokenizer)")
    if not Path(tokenizer_dir).is_dir():
        raise TokenizerError(f"{tokenizer_dir}: tokenizer directory not found; pass --tokenizer DIR with "
                             f"tokenizer.json/tokenizer_config.json (e.g. data_tools/assets/tokenizer)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    except Exception as e:  # noqa: BLE001 -- transformers raises many types; all mean "not a usable tokenizer"
        raise TokenizerError(f"{tokenizer_dir}: cannot load tokenizer ({one_line(e, 200)}); pass a local HF "
                             f"tokenizer directory") from None
    if not tokenizer.is_fast:
        raise TokenizerError(f"{tokenizer_dir}: tokenizer is not a fast (Rust) tokenizer, so it has no offsets "
                             f"for the assistant mask; provide a tokenizer.json")
    return tokenizer


_SENTINEL = "\u2063HBP_ASSISTANT_TURN\u2063"  # invisible separators: text no conversation or template holds
_TOOL_SENTINEL = "\u2063HBP_TOOL\u2063"
# What a conversation may need from the template beyond roles and contents, in the order a refusal names them.
_TOOL_FEATURES = ("tool calls", "tool results", "tool definitions")


class ChatEncoder:
    """Renders chat turns with a tokenizer's chat template and labels the assistant tokens (see module docstring)."""

    def __init__(self, tokenizer_dir: str):
        self.tokenizer = load_tokenizer(tokenizer_dir)
        template = self.tokenizer.chat_template
        if isinstance(template, dict):  # several named templates: the default one renders chats
            template = template.get("default") or next(iter(template.values()), None)
        self.template_source = "tokenizer" if template else "default"
        self.template = template or DEFAULT_CHAT_TEMPLATE
        self.label_mode = "generation" if _GENERATION_TAG.search(self.template) else "incremental"
        # What apply_chat_template hands the template besides the messages, and its tokenizer settings for the call
        # (no truncation, no padding, special tokens split or not as configured): encode_batch calls the backend.
        self._template_kwargs = dict(self.tokenizer.special_tokens_map)
        self._backend = self.tokenizer.backend_tokenizer
        self._backend.no_truncation()
        self._backend.no_padding()
        self._backend.encode_special_tokens = bool(getattr(self.tokenizer, "split_special_tokens", False))
        self._tool_support: dict[str, bool] | None = None

    def render(self, turns: list[dict], add_generation_prompt: bool = False, tools: list | None = None) -> str:
        """The conversation as the text the template makes; ``encode`` tokenizes this text (no special tokens
        added), so its token count is the sample's length (data_tools.make_code_data caps with it)."""
        return self.tokenizer.apply_chat_template(turns, chat_template=self.template, tokenize=False, tools=tools,
                                                  add_generation_prompt=add_generation_prompt)

    def encode(self, turns: list[dict], tools: list | None = None,
               untrained: Collection[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids, labels)`` of a conversation as int32 arrays, every assistant turn trained on but those whose
        index is in ``untrained``; raises FormatError if the template fails on ``turns`` or cannot render its
        tools."""
        try:
            self._check_tools(turns, tools)
            if self.label_mode == "generation":
                texts, spans, encodings, errors = self._render_generation([turns], tools)
                if errors:
                    raise errors[0]
                ids = np.asarray(encodings[0].ids, np.int32)
                offsets = np.asarray(encodings[0].offsets, np.int64).reshape(-1, 2)
                mask = _assistant_mask(offsets, np.array([len(ids)]), texts, spans)
                for i in untrained:  # the template marks every assistant turn: unmark these
                    lo, hi = self._assistant_span(turns, i, texts[0], tools)
                    hi += len(texts[0][hi:]) - len(texts[0][hi:].lstrip())  # and the whitespace that ends the turn
                    mask &= ~_overlaps(offsets, lo, hi)
            else:
                ids, mask = self._encode_incremental(turns, tools, untrained)
        except FormatError:
            raise
        except Exception as e:  # noqa: BLE001 -- jinja raises arbitrary errors (e.g. "roles must alternate")
            raise _template_error(e) from None
        return ids, np.where(mask, ids, np.int32(IGNORE_INDEX)).astype(np.int32)

    def encode_text(self, prompt: str, completion: str) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids, labels)`` of plain text, no chat template: ``prompt + completion`` tokenized as the tokenizer
        tokenizes any text (a bos first where it adds one), the eos after it unless the text ends with it already;
        the completion's tokens and the eos are trained on (TRL's standard prompt/completion and text formats)."""
        text = prompt + completion
        encoding = self._backend.encode(text, add_special_tokens=True)
        ids = np.asarray(encoding.ids, np.int32)
        # Overlap, as for chat turns: a token that straddles prompt and completion is one the model must produce.
        mask = _overlaps(np.asarray(encoding.offsets, np.int64).reshape(-1, 2), len(prompt), len(text))
        eos = self.tokenizer.eos_token_id
        if eos is not None:
            if not len(ids) or ids[-1] != eos:
                ids, mask = np.append(ids, np.int32(eos)), np.append(mask, True)
            mask[-1] = True  # the eos a post-processor adds has no characters, and is trained on all the same
        return ids, np.where(mask, ids, np.int32(IGNORE_INDEX)).astype(np.int32)

    def encode_sample(self, sample: Sample) -> tuple[np.ndarray, np.ndarray]:
        """``encode`` or ``encode_text``, as the sample is a conversation or plain text."""
        if sample.text is not None:
            return self.encode_text(*sample.text)
        return self.encode(sample.turns, sample.tools, sample.untrained)

    def encode_batch(self, samples: list[Sample]) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
        """``(input_ids, labels, row_ptr, errors)`` of many samples: ids and labels int32, all rows one after the
        other (row i = ``[row_ptr[i]:row_ptr[i + 1]]``), and ``{i: FormatError}`` for the samples that could not be
        encoded (their rows are empty). Equal to ``encode_sample`` row by row. Conversations with all their
        assistant turns trained and no tools, with a template that has generation markers, are encoded as one
        batch; the others one by one."""
        batched = [i for i, s in enumerate(samples) if s.text is None and not s.untrained and not s.uses_tools] \
            if self.label_mode == "generation" else []
        if samples and len(batched) == len(samples):
            return self._encode_generation_batch([s.turns for s in samples])
        rows, errors = [None] * len(samples), {}
        if batched:
            ids, labels, row_ptr, batch_errors = self._encode_generation_batch([samples[i].turns for i in batched])
            for k, i in enumerate(batched):
                rows[i] = ids[row_ptr[k]:row_ptr[k + 1]], labels[row_ptr[k]:row_ptr[k + 1]]
                if k in batch_errors:
                    errors[i] = batch_errors[k]
        for i, sample in enumerate(samples):
            if rows[i] is None:
                try:
                    rows[i] = self.encode_sample(sample)
                except FormatError as e:
                    errors[i] = e
                    rows[i] = np.zeros(0, np.int32), np.zeros(0, np.int32)
        row_ptr = np.concatenate([[0], np.cumsum([len(ids) for ids, _ in rows])]).astype(np.int64)
        flat = (lambda parts: np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32))
        return flat([ids for ids, _ in rows]), flat([labels for _, labels in rows]), row_ptr, errors

    def _render_generation(self, conversations: list[list[dict]], tools: list | None = None):
        """``(texts, generation spans, encodings, errors)``: every conversation rendered with the template (as one
        batch; one by one to find the ones the template refuses, whose text is then empty) and tokenized in one
        call of the Rust tokenizer."""
        from transformers.utils.chat_template_utils import render_jinja_template

        errors = {}
        try:
            texts, spans = render_jinja_template(conversations=conversations, chat_template=self.template, tools=tools,
                                                 return_assistant_tokens_mask=True, **self._template_kwargs)
        except Exception:  # noqa: BLE001 -- one conversation stopped the batch: render one by one to find it
            texts, spans = [], []
            for i, turns in enumerate(conversations):
                try:
                    text, span = render_jinja_template(conversations=[turns], chat_template=self.template, tools=tools,
                                                       return_assistant_tokens_mask=True, **self._template_kwargs)
                except Exception as e:  # noqa: BLE001 -- jinja raises arbitrary errors
                    errors[i] = _template_error(e)
                    text, span = [""], [[]]
                texts.append(text[0])
                spans.append(span[0])
        return texts, spans, self._backend.encode_batch(texts, add_special_tokens=False), errors

    def _encode_generation_batch(self, conversations: list[list[dict]]):
        """encode_batch of conversations without tools, all assistant turns trained, with generation markers: it
        is transformers' ``apply_chat_template(..., return_assistant_tokens_mask=True)`` made batch-wise."""
        texts, spans, encodings, errors = self._render_generation(conversations)
        sizes = np.fromiter((len(e.ids) for e in encodings), np.int64, len(encodings))
        row_ptr = np.concatenate([[0], np.cumsum(sizes)])
        total = int(row_ptr[-1])
        ids = np.fromiter(chain.from_iterable(e.ids for e in encodings), np.int32, total)
        offsets = np.fromiter(chain.from_iterable(chain.from_iterable(e.offsets for e in encodings)), np.int64,
                              2 * total).reshape(-1, 2)
        mask = _assistant_mask(offsets, sizes, texts, spans)
        return ids, np.where(mask, ids, np.int32(IGNORE_INDEX)).astype(np.int32), row_ptr, errors

    def _check_tools(self, turns: list[dict], tools: list | None) -> None:
        """Raise ``template_without_tools`` when the conversation has tool calls, tool results or tool definitions
        that the template would not render (they would vanish from the text silently)."""
        needs = {"tool calls": any("tool_calls" in t for t in turns),
                 "tool results": any(t["role"] == "tool" for t in turns), "tool definitions": bool(tools)}
        if not any(needs.values()):
            return
        support = self.tool_support()
        missing = [feature for feature in _TOOL_FEATURES if needs[feature] and not support[feature]]
        if missing:
            raise FormatError("template_without_tools",
                              f"the tokenizer's chat template does not render {' or '.join(missing)}",
                              "use a tokenizer whose chat template does (e.g. Qwen2.5's, Llama 3.1's, Mistral's), "
                              "or put such a template in its tokenizer_config.json 'chat_template'")

    def tool_support(self) -> dict[str, bool]:
        """Which of ``_TOOL_FEATURES`` the template renders: it renders a probe conversation whose tool call name,
        tool result and tool definition hold a marker, and the marker must come out in the text."""
        if self._tool_support is None:
            call = {"type": "function", "id": "abcdef123",  # 9 alphanumerics: Mistral's templates demand them
                    "function": {"name": _TOOL_SENTINEL + "call", "arguments": {}}}
            conversation = [{"role": "user", "content": "x"},
                            {"role": "assistant", "content": "", "tool_calls": [call]},
                            {"role": "tool", "content": _TOOL_SENTINEL + "result", "tool_call_id": "abcdef123"},
                            {"role": "assistant", "content": "y"}]
            definition = {"type": "function", "function": {"name": _TOOL_SENTINEL + "definition", "description": "",
                                                           "parameters": {"type": "object", "properties": {}}}}
            texts = []
            for turns, tools in ((conversation, None), (conversation[:1] + conversation[3:], [definition])):
                try:
                    texts.append(self.render(turns, tools=tools))
                except Exception:  # noqa: BLE001 -- a template that refuses the probe renders none of it
                    texts.append("")
            self._tool_support = {"tool calls": _TOOL_SENTINEL + "call" in texts[0],
                                  "tool results": _TOOL_SENTINEL + "result" in texts[0],
                                  "tool definitions": _TOOL_SENTINEL + "definition" in texts[1]}
        return self._tool_support

    def _encode_incremental(self, turns: list[dict], tools: list | None = None,
                            untrained: Collection[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        full = self.render(turns, tools=tools)
        # The Rust tokenizer, as for every other sample: the Python call would also compare the length with the
        # tokenizer's model_max_length and warn of "indexing errors" for a sample --max-len then drops.
        encoding = self._backend.encode(full, add_special_tokens=False)
        ids = np.asarray(encoding.ids, dtype=np.int32)
        offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
        mask = np.zeros(len(ids), dtype=bool)
        for i, turn in enumerate(turns):
            if turn["role"] == "assistant" and i not in untrained:
                mask |= _overlaps(offsets, *self._assistant_span(turns, i, full, tools))
        return ids, mask

    def _assistant_span(self, turns: list[dict], i: int, full: str, tools: list | None) -> tuple[int, int]:
        """(start, end) of assistant turn i's text in ``full``, the conversation's render: between the render up to
        the turn's header and the render through the turn (trailing whitespace left out) where the template renders
        prefixes stably, else by substitution; raises FormatError when neither finds it."""
        before = self.render(turns[:i], add_generation_prompt=True, tools=tools)
        through = self.render(turns[: i + 1], tools=tools)
        if through.startswith(before) and full.startswith(through):
            return len(before), max(len(before), len(through.rstrip()))
        span = self._span_by_substitution(turns, i, full, tools)
        if span is None:
            raise FormatError("template_not_incremental",
                              f"rendering turn {i} changes earlier text and its content cannot be located by "
                              "substitution, so its assistant tokens cannot be found",
                              "use a chat template with {% generation %} markers around the assistant's text"
                              if self.label_mode == "incremental" else
                              "train on the turn (drop its weight 0) or use a template that keeps earlier turns")
        return span

    def _span_by_substitution(self, turns: list[dict], i: int, full: str, tools: list | None):
        """(start, end) of assistant turn i's text in ``full`` (its end-of-turn text included), found by rendering
        the conversation with the turn's content replaced by a sentinel; None if that does not frame it, or if the
        turn has tool calls (rendered outside its content, so the sentinel cannot frame them)."""
        if "tool_calls" in turns[i]:
            return None
        probe = [*turns[:i], {**turns[i], "content": _SENTINEL}, *turns[i + 1:]]
        text = self.render(probe, tools=tools)
        if text.count(_SENTINEL) != 1:
            return None
        before, after = text.split(_SENTINEL)
        if not (len(before) + len(after) <= len(full) and full.startswith(before) and full.endswith(after)):
            return None
        end = len(full) - len(after)
        closing = self._end_of_turn()
        if closing and after.startswith(closing):
            end += len(closing)
        return len(before), end

    def _end_of_turn(self) -> str:
        """The text the template puts after an assistant turn's content (e.g. ``<|im_end|>``), trailing whitespace
        removed; "" if a one-turn render does not show it."""
        if not hasattr(self, "_closing"):
            try:
                text = self.render([{"role": "user", "content": "x"}, {"role": "assistant", "content": _SENTINEL}])
                self._closing = text.split(_SENTINEL)[1].rstrip() if text.count(_SENTINEL) == 1 else ""
            except Exception:  # noqa: BLE001 -- a template that cannot render the probe: label the content only
                self._closing = ""
        return self._closing


def _template_error(e: Exception) -> FormatError:
    return FormatError("template_error", f"chat template failed: {type(e).__name__}: {one_line(e, 200)}",
                       "fix the conversation or use a tokenizer whose template accepts it")


def _overlaps(offsets: np.ndarray, lo: int, hi: int) -> np.ndarray:
    """Tokens (character ``offsets``) that overlap ``[lo, hi)``. Overlap, not containment: with a prompt ending in
    "Assistant: ", BPE merges that space into the first answer token, which the model must still learn to produce."""
    return (offsets[:, 1] > lo) & (offsets[:, 0] < hi)


def _assistant_mask(offsets: np.ndarray, sizes: np.ndarray, texts: list[str], spans: list) -> np.ndarray:
    """transformers' assistant mask for a whole batch: for each token in order, skip the generation spans that end at
    or before its start (never going back), stop at the last span, and mask the token if it ends after the current
    span's start. Every row is moved past the previous rows' characters so that one pass over the batch stands for
    a pass per row: the span index after a token is the number of spans ending at or before the largest token start
    so far."""
    base = np.concatenate([[0], np.cumsum([len(t) + 1 for t in texts])])
    row = np.repeat(np.arange(len(sizes)), sizes)
    span_rows = np.repeat(np.arange(len(spans)), [len(s) for s in spans])
    flat = np.asarray(list(chain.from_iterable(spans)), np.int64).reshape(-1, 2) + base[span_rows, None]
    span_ptr = np.concatenate([[0], np.cumsum([len(s) for s in spans])])
    start = offsets[:, 0] + base[row]
    end = offsets[:, 1] + base[row]
    current = np.searchsorted(flat[:, 1], np.maximum.accumulate(start), side="right")
    inside = current < span_ptr[row + 1]
    return inside & (end > flat[np.minimum(current, max(len(flat) - 1, 0)), 0]) if len(flat) else inside
