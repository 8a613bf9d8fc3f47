"""Variable tracking samples (RULER's ``vt`` task), generated locally with the model's tokenizer.

A chain of assignments is hidden in the haystack (``eval/tasks/haystack.py``) in reading order: "VAR QXKTA = 48213."
then "VAR BLMRE = VAR QXKTA." and so on for ``num_hops`` hops; the question asks for every variable that is assigned
the value. A correct answer names all ``num_hops + 1`` variables, which takes following references across the
context rather than finding one fact. Scored as RULER does: the share of the names the answer contains.
"""

from __future__ import annotations

import random
import string
from dataclasses import dataclass

from eval.tasks.haystack import fill, render_prompt, sentence_tokens
from hbp_train.common.errors import UserError

INSTRUCTION = "Track the chain of variable assignments in this text."
NAME_LETTERS = 5
VALUE_DIGITS = 5


@dataclass
class VariableTrackingConfig:
    """What the variable tracking task generates."""

    lengths: list[int]
    """Target prompt lengths in tokens (chat template and answer prefix included)."""
    samples_per_length: int = 20
    """Samples per length, each with fresh names, value, positions and haystack order."""
    num_hops: int = 4
    """Assignments that copy a variable; the chain names ``num_hops + 1`` variables."""
    seed: int = 0
    """Seed of the sample generator: the same seed gives the same prompts."""

    def __post_init__(self):
        if not self.lengths or any(int(n) <= 0 for n in self.lengths):
            raise UserError(f"--lengths: need positive token counts, got {self.lengths}")
        if self.samples_per_length < 1:
            raise UserError(f"variable tracking: need >= 1 sample per length, got {self.samples_per_length}")
        if self.num_hops < 1:
            raise UserError(f"variable tracking: need >= 1 hop, got {self.num_hops}")
        self.lengths = sorted({int(n) for n in self.lengths})


def _question(value: str) -> str:
    return f"Which variables are assigned the value {value}?"


def answer_prefix(value: str, num_names: int) -> str:
    return f"The {num_names} variables assigned the value {value} are:"


def _user(haystack: list[str], value: str) -> str:
    return f"{INSTRUCTION}\n\n{' '.join(haystack)}\n\n{_question(value)}"


def make_record(tokenizer, length: int, rng: random.Random, num_hops: int, tokens_per_sentence: list[int]) -> dict:
    """One sample as an OpenCompass dataset row: ``prompt`` (the user turn), ``answer`` (the variable names)."""
    names: list[str] = []
    while len(names) < num_hops + 1:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(NAME_LETTERS))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10 ** (VALUE_DIGITS - 1), 10**VALUE_DIGITS - 1))
    statements = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    # Reading order follows the chain: sorted fractions keep each assignment after the one it copies.
    facts = list(zip(sorted(rng.random() for _ in statements), statements))
    prefix = answer_prefix(value, len(names))
    parts, prompt_ids = fill(length, lambda hay: render_prompt(tokenizer, _user(hay, value), prefix), facts, rng,
                             tokens_per_sentence, f"{len(statements)} assignments")
    return {"prompt": _user(parts, value), "answer": names, "length": length, "tokens": len(prompt_ids),
            "value": value}


def generate_records(tokenizer, config: VariableTrackingConfig) -> list[dict]:
    """All samples, deterministic in ``config.seed``: lengths × samples_per_length."""
    rng = random.Random(config.seed)
    tokens_per_sentence = sentence_tokens(tokenizer)
    return [make_record(tokenizer, length, rng, config.num_hops, tokens_per_sentence)
            for length in config.lengths for _ in range(config.samples_per_length)]
