"""Chat turns -> ``(input_ids, labels)``: render with the tokenizer's chat template, train on the assistant tokens.

``labels`` equal ``input_ids`` on the tokens of every assistant turn and ``IGNORE_INDEX`` elsewhere (not shifted;
the loss shifts). If the template marks the assistant with ``{% generation %}`` the tokenizer's assistant mask is
used. Otherwise each assistant turn is found incrementally: the text rendered up to that turn with
``add_generation_prompt=True`` and the text rendered up to the end of the turn must be prefixes of the full render;
the characters in between (minus trailing whitespace) are the assistant's, and the tokens that overlap them are
labelled. Templates that rewrite earlier turns (Qwen3 drops the reasoning of earlier assistant turns, so rendering
up to a turn is not a prefix of the whole) fall back, turn by turn, to substitution: the conversation is rendered
with that turn's content replaced by a sentinel; the text before and after the sentinel must then frame the turn's
content in the full render, and the template's end-of-turn text (e.g. ``<|im_end|>``, found by rendering one
assistant turn) is labelled with it. Header tokens (Llama 3), an injected default system prompt (Qwen2.5) and renamed
roles (Gemma's ``model``) need nothing special: they are the same in every render. A tokenizer without a chat template gets ``DEFAULT_CHAT_TEMPLATE``: ChatML
(``<|im_start|>role\\ncontent<|im_end|>\\n``, the tokenizer's bos first if it has one) with the assistant's
``content<|im_end|>`` in generation markers (the shipped tokenizer, data_tools.train_tokenizer, carries the same).

A conversation the template cannot render raises ``FormatError`` with one of ``TEMPLATE_REASONS``; an unusable
tokenizer directory raises ``TokenizerError``.

``encode_batch`` does the same for many conversations at once. With generation markers it is transformers'
``apply_chat_template(..., return_assistant_tokens_mask=True)`` made batch-wise: the same template rendering
(``render_jinja_template``, which records the generation spans), the same Rust tokenizer call (one batch, no Python
objects per token but the offsets), and the same mask rule (a token is trained on when it overlaps a generation
span, in transformers' order of tests) computed with numpy over the whole batch instead of a Python loop per token
(tests/test_chat_labels.py checks the result against apply_chat_template token for token).
"""

from __future__ import annotations

import re
from itertools import chain
from pathlib import Path

import numpy as np

from data_tools.sft_formats import FormatError, one_line
from hbp_train.errors import UserError
from hbp_train.labels import IGNORE_INDEX

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

# reason -> what it means, for conversations the chat template cannot label (record shapes: sft_formats.REASONS).
TEMPLATE_REASONS = {
    "template_error": "the chat template raised on this conversation",
    "template_not_incremental": "the chat template (without generation markers) does not render prefixes stably",
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

    def render(self, turns: list[dict], add_generation_prompt: bool = False) -> str:
        """The conversation as the text the template makes; ``encode`` tokenizes this text (no special tokens
        added), so its token count is the sample's length (data_tools.make_code_data caps with it)."""
        return self.tokenizer.apply_chat_template(turns, chat_template=self.template, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def encode(self, turns: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        """``(input_ids, labels)`` as int32 arrays; raises FormatError if the template fails on ``turns``."""
        try:
            if self.label_mode == "generation":
                out = self.tokenizer.apply_chat_template(turns, chat_template=self.template, tokenize=True,
                                                         return_dict=True, return_assistant_tokens_mask=True)
                ids = np.asarray(out["input_ids"], dtype=np.int32)
                mask = np.asarray(out["assistant_masks"], dtype=bool)
            else:
                ids, mask = self._encode_incremental(turns)
        except FormatError:
            raise
        except Exception as e:  # noqa: BLE001 -- jinja raises arbitrary errors (e.g. "roles must alternate")
            raise _template_error(e) from None
        labels = np.where(mask, ids, np.int32(IGNORE_INDEX)).astype(np.int32)
        return ids, labels

    def encode_batch(self, conversations: list[list[dict]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
        """``(input_ids, labels, row_ptr, errors)`` of many conversations: ids and labels int32, all rows one after
        the other (row i = ``[row_ptr[i]:row_ptr[i + 1]]``), and ``{i: FormatError}`` for the conversations the
        template could not render (their rows are empty). Equal to ``encode`` row by row."""
        if self.label_mode != "generation":
            return self._encode_each(conversations)
        from transformers.utils.chat_template_utils import render_jinja_template

        errors = {}
        try:
            texts, spans = render_jinja_template(conversations=conversations, chat_template=self.template,
                                                 return_assistant_tokens_mask=True, **self._template_kwargs)
        except Exception:  # noqa: BLE001 -- one conversation stopped the batch: render one by one to find it
            texts, spans = [], []
            for i, turns in enumerate(conversations):
                try:
                    text, span = render_jinja_template(conversations=[turns], chat_template=self.template,
                                                       return_assistant_tokens_mask=True, **self._template_kwargs)
                except Exception as e:  # noqa: BLE001 -- jinja raises arbitrary errors
                    errors[i] = _template_error(e)
                    text, span = [""], [[]]
                texts.append(text[0])
                spans.append(span[0])
        encodings = self._backend.encode_batch(texts, add_special_tokens=False)
        sizes = np.fromiter((len(e.ids) for e in encodings), np.int64, len(encodings))
        row_ptr = np.concatenate([[0], np.cumsum(sizes)])
        total = int(row_ptr[-1])
        ids = np.fromiter(chain.from_iterable(e.ids for e in encodings), np.int32, total)
        offsets = np.fromiter(chain.from_iterable(chain.from_iterable(e.offsets for e in encodings)), np.int64,
                              2 * total).reshape(-1, 2)
        mask = _assistant_mask(offsets, sizes, texts, spans)
        return ids, np.where(mask, ids, np.int32(IGNORE_INDEX)).astype(np.int32), row_ptr, errors

    def _encode_each(self, conversations: list[list[dict]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict]:
        """encode_batch one conversation at a time (templates without generation markers)."""
        ids, labels, errors = [], [], {}
        for i, turns in enumerate(conversations):
            try:
                row_ids, row_labels = self.encode(turns)
            except FormatError as e:
                errors[i] = e
                row_ids = row_labels = np.zeros(0, np.int32)
            ids.append(row_ids)
            labels.append(row_labels)
        row_ptr = np.concatenate([[0], np.cumsum([len(x) for x in ids])]).astype(np.int64)
        flat = (lambda parts: np.concatenate(parts).astype(np.int32) if parts else np.zeros(0, np.int32))
        return flat(ids), flat(labels), row_ptr, errors

    def _encode_incremental(self, turns: list[dict]) -> tuple[np.ndarray, np.ndarray]:
        full = self.render(turns)
        spans = []
        for i, turn in enumerate(turns):
            if turn["role"] != "assistant":
                continue
            before = self.render(turns[:i], add_generation_prompt=True)
            through = self.render(turns[: i + 1])
            if through.startswith(before) and full.startswith(through):
                spans.append((len(before), max(len(before), len(through.rstrip()))))
                continue
            span = self._span_by_substitution(turns, i, full)
            if span is None:
                raise FormatError("template_not_incremental",
                                  f"rendering turn {i} changes earlier text and its content cannot be located by "
                                  "substitution, so its assistant tokens cannot be found",
                                  "use a chat template with {% generation %} markers around the assistant's text")
            spans.append(span)
        encoded = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(encoded["input_ids"], dtype=np.int32)
        offsets = np.asarray(encoded["offset_mapping"], dtype=np.int64).reshape(-1, 2)
        mask = np.zeros(len(ids), dtype=bool)
        for lo, hi in spans:
            # Overlap, not containment: with a prompt ending in "Assistant: ", BPE merges that space into the first
            # answer token, which the model must still learn to produce.
            mask |= (offsets[:, 1] > lo) & (offsets[:, 0] < hi)
        return ids, mask

    def _span_by_substitution(self, turns: list[dict], i: int, full: str):
        """(start, end) of assistant turn i's text in ``full`` (its end-of-turn text included), found by rendering
        the conversation with the turn's content replaced by a sentinel; None if that does not frame it."""
        probe = [*turns[:i], {**turns[i], "content": _SENTINEL}, *turns[i + 1:]]
        text = self.render(probe)
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
