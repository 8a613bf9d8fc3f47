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
"""

from __future__ import annotations

import re
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
            raise FormatError("template_error", f"chat template failed: {type(e).__name__}: {one_line(e, 200)}",
                              "fix the conversation or use a tokenizer whose template accepts it") from None
        labels = np.where(mask, ids, np.int32(IGNORE_INDEX)).astype(np.int32)
        return ids, labels

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
