"""The haystack the generated long-context tasks hide their facts in: neutral filler sentences, filled to a budget.

Every long-context task (``eval/tasks/needle.py`` single and multi-key, ``eval/tasks/variable_tracking.py``) builds
a prompt the same way: facts placed among shuffled filler sentences in a user turn, rendered with the model's chat
template, filled with filler to within one short sentence of the target length in tokens (never over).

Facts are placed at fractions of the haystack (0 = before the first sentence, 1 = after the last) rather than at
fixed indices, so a prompt trimmed by a sentence keeps each fact at the same relative depth.
"""

from __future__ import annotations

import random
from typing import Callable

from hbp_train.common.errors import UserError

# Neutral filler; shuffled per sample so the haystack is not one repeated block.
FILLER_SENTENCES = [
    "The river bends twice before it reaches the old stone bridge.",
    "Most of the village gardens grow beans, onions and a few rows of potatoes.",
    "In winter the market opens an hour later than it does in summer.",
    "A narrow path climbs from the harbour to the lighthouse on the hill.",
    "The library keeps its maps in long flat drawers near the back wall.",
    "Every spring the school paints the fence around the playground.",
    "The baker starts work before dawn so the bread is ready by seven.",
    "Clouds gathered over the valley but the rain never came.",
    "The train to the coast stops at four small stations on the way.",
    "Someone left a blue bicycle leaning against the post office door.",
    "The museum added a room for old clocks and measuring tools.",
    "On quiet evenings you can hear the bells from across the lake.",
    "The orchard at the edge of town has apples, pears and plums.",
    "A tall pine tree marks the start of the forest trail.",
    "The town hall clock was repaired last year after a long silence.",
    "Fishing boats return in the afternoon with their nets folded.",
    "The café on the corner serves soup in large white bowls.",
    "Children collect smooth pebbles along the shallow part of the stream.",
    "The old mill has been turned into a workshop for furniture.",
    "Snow covers the mountain pass from November until April.",
    "The farmer counts his sheep every evening before closing the gate.",
    "A row of lanterns lights the street during the autumn festival.",
    "The ferry crosses the bay six times a day when the sea is calm.",
    "Wild roses grow along the wall behind the church.",
    # Short ones let the haystack fill its budget closely.
    "Birds sang.",
    "It was quiet.",
    "The wind rose.",
    "Tea was served.",
]


def render_prompt(tokenizer, user: str, answer_prefix: str = "") -> list[int]:
    """Token ids of a prompt: ``user`` as the user turn (chat template when the tokenizer has one, else plain text
    with an ``Answer:`` line), then ``answer_prefix`` as the start of the answer."""
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                             add_generation_prompt=True)
        # The template already holds bos and the turn markers: add no special tokens again.
        return tokenizer.encode(text + answer_prefix, add_special_tokens=False)
    return tokenizer.encode(f"{user}\nAnswer: {answer_prefix}".rstrip(" "), add_special_tokens=True)


def sentence_tokens(tokenizer) -> list[int]:
    """Tokens of each filler sentence as it appears in a haystack (joined with a space)."""
    return [len(tokenizer.encode(" " + s, add_special_tokens=False)) for s in FILLER_SENTENCES]


def place(sentences: list[str], facts: list[tuple[float, str]]) -> list[str]:
    """``sentences`` with each ``(fraction, fact)`` inserted at ``round(fraction * len(sentences))``, in order (a
    later fact at the same place goes after an earlier one)."""
    out = list(sentences)
    for offset, (fraction, fact) in enumerate(sorted(facts, key=lambda f: f[0])):
        out.insert(round(fraction * len(sentences)) + offset, fact)
    return out


def fill(length: int, render: Callable[[list[str]], list[int]], facts: list[tuple[float, str]], rng: random.Random,
         tokens_per_sentence: list[int], what: str) -> tuple[list[str], list[int]]:
    """Haystack parts (filler with ``facts`` placed) and the rendered prompt ids, at most ``length`` tokens.

    ``render(parts)`` turns haystack parts into prompt ids. Filler is added sentence by sentence (a shuffled cycle,
    skipping any that no longer fits) while the summed per-sentence estimate stays within the budget; merges at
    the joins can shift the estimate by a token, so the rendered prompt is re-checked and trimmed. ``what`` names
    the facts in the error for a length too short to hold them.
    """
    base = len(render(place([], facts)))
    budget = length - base
    if budget < 0:
        raise UserError(f"--lengths: {length} tokens cannot hold the {what} and question ({base} tokens); "
                        f"use lengths >= {base}")
    order = list(range(len(FILLER_SENTENCES)))
    rng.shuffle(order)
    sentences: list[str] = []
    used = 0
    while True:  # stop after a pass that adds nothing
        added = False
        for index in order:
            if used + tokens_per_sentence[index] <= budget:
                sentences.append(FILLER_SENTENCES[index])
                used += tokens_per_sentence[index]
                added = True
        if not added:
            break
    while True:
        parts = place(sentences, facts)
        prompt_ids = render(parts)
        if len(prompt_ids) <= length or not sentences:
            return parts, prompt_ids
        sentences.pop()
