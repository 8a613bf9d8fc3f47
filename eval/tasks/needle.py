"""Needle-in-a-haystack samples (RULER's NIAH, single-key and multi-key), generated locally with the model's tokenizer.

A sample is a haystack of filler sentences (``eval/tasks/haystack.py``) with a needle, "The special magic number for
<key> is <value>.", at a given depth (0 = before the first sentence, 1 = after the last), then the question "What is
the special magic number for <key>?". With ``num_keys`` > 1 (RULER's ``niah_multikey``) the haystack also holds
needles of other keys with their own values at random depths; the question asks for the first key only, so a model
that copies any number it saw is caught.

The same samples serve both evaluations: ``eval/needle.py`` scores them offline (the prompt rendered with the chat
template plus the answer prefix "The special magic number for <key> is"), and ``eval/suite.py`` writes them as an
OpenCompass dataset (the user turn as ``prompt``, the value as ``answer``). Same lengths, depths, trials, seed and
tokenizer, same prompts (the number of distractors does not change them).

Every value of a sweep, the asked-for one, the other keys' and the distractors, is a 7-digit number that the
tokenizer splits into the same number of tokens (``value_token_count``: the count most 7-digit numbers get). A
tokenizer that merges digits splits some numbers into fewer tokens than others, and the offline score sums
log-probabilities over a value's tokens, each costing some: a weak model ranked first whichever candidates had the
fewest tokens, so its score followed how the tokenizer splits numbers, and among those the least preference for a
number it had seen in the prompt (an untrained model's random weights have some) won it the sample; an untrained
model scored 35% where chance is 20%. With equal counts only the model's preference among the candidates decides,
and a model whose preference owes nothing to the needle is right ``1 / (distractors + 1)`` of the time over the
draws: the true value and its distractors come from one distribution. (Dividing each sum by its token count would
not do it: a mean over fewer tokens varies more, so it is the highest more often.)
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass, field

from eval.tasks.haystack import fill, render_prompt, sentence_tokens
from hbp_train.common.errors import UserError

KEY_WORDS = [
    "amber", "birch", "cobalt", "dune", "ember", "falcon", "glacier", "harbor", "iris", "juniper", "kestrel",
    "lantern", "meadow", "nectar", "orchid", "pepper", "quartz", "raven", "saffron", "thistle", "umber",
    "velvet", "willow", "yarrow", "zephyr", "basalt", "cedar", "delta", "fjord", "granite",
]
NUM_VALUE_DIGITS = 7
# Values drawn to find the token count most 7-digit numbers get (their own fixed seed: the same count for a
# tokenizer whatever the sweep's seed), and the draws allowed to find one value of that count.
_COUNT_POOL = 512
_MAX_DRAWS = 10_000
# Kept short so that short contexts (a 128-token demo) still hold some haystack.
INSTRUCTION = "Remember the special magic number in this text."
MULTIKEY_INSTRUCTION = "Remember the special magic numbers in this text."


@dataclass
class NeedleConfig:
    """What the needle sweep generates."""

    lengths: list[int] = field(default_factory=lambda: [256, 512, 1024])
    """Target prompt lengths in tokens (haystack + needles + question, chat template and answer prefix included)."""
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    """Positions of the asked-for needle as a fraction of the haystack: 0 = before the first sentence, 1 = after
    the last."""
    trials: int = 4
    """Samples per (length, depth) cell, each with a fresh key, value and haystack order."""
    num_distractors: int = 4
    """Wrong values the true value is ranked against in the offline log-likelihood score (for multi-key samples
    the other needles' values come first)."""
    seed: int = 0
    """Seed of the sample generator: the same seed gives the same prompts."""
    num_keys: int = 1
    """Needles per haystack; above 1 the other keys' needles are distractors (RULER's multi-key NIAH)."""

    def __post_init__(self):
        if not self.lengths or any(int(n) <= 0 for n in self.lengths):
            raise UserError(f"--lengths: need positive token counts, got {self.lengths}")
        if not self.depths or any(not 0.0 <= float(d) <= 1.0 for d in self.depths):
            raise UserError(f"--depths: need fractions in [0, 1], got {self.depths}")
        if self.trials < 1:
            raise UserError(f"--trials: need >= 1, got {self.trials}")
        if self.num_distractors < 1:
            raise UserError(f"--distractors: need >= 1, got {self.num_distractors}")
        if not 1 <= self.num_keys <= len(KEY_WORDS):
            raise UserError(f"num_keys: need 1..{len(KEY_WORDS)}, got {self.num_keys}")
        self.lengths = sorted({int(n) for n in self.lengths})
        self.depths = sorted({float(d) for d in self.depths})


@dataclass
class NeedleSample:
    """One prompt and what a correct answer is."""

    prompt_ids: list[int]
    """The offline prompt: user turn (chat template) + answer prefix."""
    value: str
    distractors: list[str]
    length: int
    """The target length of the sweep cell; the real one is ``len(prompt_ids)``."""
    depth: float
    user: str = ""
    """The user turn alone (what OpenCompass renders with the chat template itself)."""
    key: str = ""
    num_keys: int = 1
    value_tokens: int = 0
    """Tokens of " <value>" (and of every distractor: the same count), as the offline score encodes them."""


def _needle(key: str, value: str) -> str:
    return f"The special magic number for {key} is {value}."


def _question(key: str) -> str:
    return f"What is the special magic number for {key}?"


def answer_prefix(key: str) -> str:
    return f"The special magic number for {key} is"


def _user(instruction: str, haystack: list[str], key: str) -> str:
    return f"{instruction}\n\n{' '.join(haystack)}\n\n{_question(key)}"


def candidate_tokens(tokenizer, value: str) -> list[int]:
    """The token ids of ``value`` as a continuation of the answer prefix: " <value>", no special tokens."""
    return tokenizer.encode(" " + value, add_special_tokens=False)


def value_token_count(tokenizer) -> int:
    """The number of tokens most 7-digit values split into with this tokenizer (the smaller on a tie); every value
    of a sweep has this many (see the module docstring)."""
    low, high = 10 ** (NUM_VALUE_DIGITS - 1), 10**NUM_VALUE_DIGITS - 1
    pool = random.Random("needle value token count")
    counts = Counter(len(candidate_tokens(tokenizer, str(pool.randint(low, high)))) for _ in range(_COUNT_POOL))
    return min(counts, key=lambda n: (-counts[n], n))


def _draw_value(rng: random.Random, tokenizer, count: int, taken: list[str]) -> str:
    """A 7-digit value not in ``taken`` that splits into ``count`` tokens."""
    low, high = 10 ** (NUM_VALUE_DIGITS - 1), 10**NUM_VALUE_DIGITS - 1
    for _ in range(_MAX_DRAWS):
        value = str(rng.randint(low, high))
        if value not in taken and len(candidate_tokens(tokenizer, value)) == count:
            return value
    # value_token_count found this count for most values of a pool: missing it this often cannot happen by chance.
    raise RuntimeError(f"no 7-digit value of {count} tokens in {_MAX_DRAWS} draws")


def make_sample(tokenizer, length: int, depth: float, rng: random.Random, num_distractors: int,
                tokens_per_sentence: list[int], num_keys: int = 1, value_tokens: int | None = None) -> NeedleSample:
    """A prompt of at most ``length`` tokens (within about one short filler sentence) with the needle at ``depth``;
    every value (asked-for, other keys', distractors) splits into ``value_tokens`` tokens (default:
    ``value_token_count``)."""
    count = value_token_count(tokenizer) if value_tokens is None else value_tokens
    key = rng.choice(KEY_WORDS)
    value = _draw_value(rng, tokenizer, count, [])
    facts = [(depth, _needle(key, value))]
    values = [value]
    if num_keys > 1:
        for other in rng.sample([k for k in KEY_WORDS if k != key], num_keys - 1):
            other_value = _draw_value(rng, tokenizer, count, values)
            values.append(other_value)
            facts.append((rng.random(), _needle(other, other_value)))
    # Their own generator: the prompts do not depend on how many distractors the offline score asks for.
    distractor_rng = random.Random(rng.random())
    distractors = values[1:][:num_distractors]
    while len(distractors) < num_distractors:
        distractors.append(_draw_value(distractor_rng, tokenizer, count, values + distractors))
    instruction = INSTRUCTION if num_keys == 1 else MULTIKEY_INSTRUCTION
    what = "needle" if num_keys == 1 else f"{num_keys} needles"
    parts, prompt_ids = fill(length, lambda hay: render_prompt(tokenizer, _user(instruction, hay, key),
                                                               answer_prefix(key)),
                             facts, rng, tokens_per_sentence, what)
    return NeedleSample(prompt_ids, value, distractors, length, depth, _user(instruction, parts, key), key, num_keys,
                        count)


def generate_samples(tokenizer, config: NeedleConfig) -> list[NeedleSample]:
    """All samples of the sweep, deterministic in ``config.seed``: lengths × depths × trials."""
    rng = random.Random(config.seed)
    tokens_per_sentence = sentence_tokens(tokenizer)
    count = value_token_count(tokenizer)
    return [
        make_sample(tokenizer, length, depth, rng, config.num_distractors, tokens_per_sentence, config.num_keys,
                    count)
        for length in config.lengths
        for depth in config.depths
        for _ in range(config.trials)
    ]


def to_record(sample: NeedleSample) -> dict:
    """The sample as a row of the OpenCompass dataset (``eval/suite.py``): ``prompt`` (the user turn), ``answer``
    (the list of strings a correct answer contains) and what the report groups by."""
    return {"prompt": sample.user, "answer": [sample.value], "length": sample.length, "depth": sample.depth,
            "tokens": len(sample.prompt_ids), "key": sample.key, "num_keys": sample.num_keys}
