"""Needle-in-a-haystack retrieval generated locally (RULER-style NIAH), for offline and air-gapped checks.

A sample is a haystack of filler sentences with one needle, "The special magic number for <key> is <value>.",
placed at a given depth (0 = first sentence, 1 = last), followed by the question. It is rendered with the model's
chat template when it has one, and the answer prefix "The special magic number for <key> is" is appended to the
prompt (as RULER does), so the next tokens should be the value. Two scores per sample:

- **loglik**: the summed log-likelihood of " <value>" against ``num_distractors`` random values of the same
  number of digits; correct when the true value scores strictly highest. Cheap and informative even for tiny
  models (chance = 1 / (num_distractors + 1)).
- **greedy**: greedy decoding until an end token or ``max_new_tokens``; correct when the first number in the
  output equals the value.

The prompt is encoded once; every candidate and the greedy loop continue from its KV cache, which is cropped back
afterwards, so a sample costs one prefill plus a few short decodes.
"""

from __future__ import annotations

import random
import re
import warnings
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from eval.model_io import UsageError

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
KEY_WORDS = [
    "amber", "birch", "cobalt", "dune", "ember", "falcon", "glacier", "harbor", "iris", "juniper", "kestrel",
    "lantern", "meadow", "nectar", "orchid", "pepper", "quartz", "raven", "saffron", "thistle", "umber",
    "velvet", "willow", "yarrow", "zephyr", "basalt", "cedar", "delta", "fjord", "granite",
]
NUM_VALUE_DIGITS = 7
# Kept short so that short contexts (a 128-token demo) still hold some haystack.
INSTRUCTION = "Remember the special magic number in this text."


@dataclass
class NeedleConfig:
    """What the needle test sweeps and how it scores."""

    lengths: list[int] = field(default_factory=lambda: [256, 512, 1024])
    """Target prompt lengths in tokens (haystack + needle + question, chat template included)."""
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    """Needle positions as a fraction of the haystack: 0 = before the first sentence, 1 = after the last."""
    trials: int = 4
    """Samples per (length, depth) cell, each with a fresh key, value and haystack order."""
    num_distractors: int = 4
    """Wrong values the true value is ranked against in the log-likelihood score."""
    max_new_tokens: int = 16
    """Greedy-decoding budget per sample (a 7-digit value plus punctuation needs far fewer)."""
    seed: int = 0
    """Seed of the sample generator: the same seed gives the same prompts."""

    def __post_init__(self):
        if not self.lengths or any(int(n) <= 0 for n in self.lengths):
            raise ValueError(f"lengths: need positive token counts, got {self.lengths}")
        if not self.depths or any(not 0.0 <= float(d) <= 1.0 for d in self.depths):
            raise ValueError(f"depths: need fractions in [0, 1], got {self.depths}")
        if self.trials < 1:
            raise ValueError(f"trials: need >= 1, got {self.trials}")
        if self.num_distractors < 1:
            raise ValueError(f"num_distractors: need >= 1, got {self.num_distractors}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: need >= 1, got {self.max_new_tokens}")
        self.lengths = sorted({int(n) for n in self.lengths})
        self.depths = sorted({float(d) for d in self.depths})


@dataclass
class NeedleSample:
    """One rendered prompt and what a correct answer is."""

    prompt_ids: list[int]
    value: str
    distractors: list[str]
    length: int
    """The target length of the sweep cell; the real one is ``len(prompt_ids)``."""
    depth: float


def _needle(key: str, value: str) -> str:
    return f"The special magic number for {key} is {value}."


def _question(key: str) -> str:
    return f"What is the special magic number for {key}?"


def _answer_prefix(key: str) -> str:
    return f"The special magic number for {key} is"


def render_prompt(tokenizer, context: str, key: str) -> list[int]:
    """Token ids of the prompt: the task in a user turn (chat template when the tokenizer has one) + answer prefix."""
    user = f"{INSTRUCTION}\n\n{context}\n\n{_question(key)}"
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                             add_generation_prompt=True)
        # The template already holds bos and the turn markers: add no special tokens again.
        return tokenizer.encode(text + _answer_prefix(key), add_special_tokens=False)
    return tokenizer.encode(f"{user}\nAnswer: {_answer_prefix(key)}", add_special_tokens=True)


def make_sample(tokenizer, length: int, depth: float, rng: random.Random, num_distractors: int,
                sentence_tokens: list[int]) -> NeedleSample:
    """A prompt of about ``length`` tokens with the needle at ``depth``.

    Filler is added sentence by sentence while the estimated total stays within ``length``; the estimate sums
    per-sentence token counts (``sentence_tokens``), which is exact up to merges at the sentence joins, so the
    rendered prompt is re-checked and trimmed if it came out longer. It ends within about one short filler sentence
    below ``length``.
    """
    key = rng.choice(KEY_WORDS)
    low, high = 10 ** (NUM_VALUE_DIGITS - 1), 10**NUM_VALUE_DIGITS - 1
    value = str(rng.randint(low, high))
    distractors: list[str] = []
    while len(distractors) < num_distractors:
        other = str(rng.randint(low, high))
        if other != value and other not in distractors:
            distractors.append(other)

    base = len(render_prompt(tokenizer, _needle(key, value), key))
    budget = length - base
    if budget < 0:
        raise UsageError(f"--lengths: {length} tokens cannot hold the needle and question ({base} tokens); "
                         f"use lengths >= {base}")
    order = list(range(len(FILLER_SENTENCES)))
    rng.shuffle(order)
    sentences: list[str] = []
    used = 0
    # Cycle through the shuffled sentences, skipping any that no longer fits; stop after a pass that adds none.
    while True:
        added = False
        for index in order:
            if used + sentence_tokens[index] <= budget:
                sentences.append(FILLER_SENTENCES[index])
                used += sentence_tokens[index]
                added = True
        if not added:
            break
    while True:
        position = round(depth * len(sentences))
        haystack = sentences[:position] + [_needle(key, value)] + sentences[position:]
        prompt_ids = render_prompt(tokenizer, " ".join(haystack), key)
        # Merges at the joins can shift the estimate by a token; never exceed the target length.
        if len(prompt_ids) <= length or not sentences:
            break
        sentences.pop()
    return NeedleSample(prompt_ids, value, distractors, length, depth)


def generate_samples(tokenizer, config: NeedleConfig) -> list[NeedleSample]:
    """All samples of the sweep, deterministic in ``config.seed``: lengths × depths × trials."""
    rng = random.Random(config.seed)
    # " " + sentence: the haystack joins sentences with a space, so this is how each is tokenized in context.
    sentence_tokens = [len(tokenizer.encode(" " + s, add_special_tokens=False)) for s in FILLER_SENTENCES]
    return [
        make_sample(tokenizer, length, depth, rng, config.num_distractors, sentence_tokens)
        for length in config.lengths
        for depth in config.depths
        for _ in range(config.trials)
    ]


@torch.inference_mode()
def score_sample(model, tokenizer, sample: NeedleSample, max_new_tokens: int, stop_ids: set[int]) -> dict:
    """``{"loglik_correct", "greedy_correct", "greedy_text", "logliks"}`` for one sample (see the module doc)."""
    device = next(model.parameters()).device
    prompt = torch.tensor([sample.prompt_ids], device=device)
    # logits_to_keep=1: only the last position's logits, not [T, vocab] for a long prompt.
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    cache = out.past_key_values
    last_logprobs = out.logits[0, -1].float().log_softmax(-1)

    logliks = []
    for candidate in [sample.value, *sample.distractors]:
        ids = tokenizer.encode(" " + candidate, add_special_tokens=False)
        total = last_logprobs[ids[0]]
        if len(ids) > 1:
            step = model(input_ids=torch.tensor([ids[:-1]], device=device), past_key_values=cache, use_cache=True)
            logprobs = step.logits[0].float().log_softmax(-1)
            targets = torch.tensor(ids[1:], device=device)
            total = total + logprobs[torch.arange(len(ids) - 1, device=device), targets].sum()
            # A negative crop removes that many tokens (the positive form changed meaning across versions).
            cache.crop(-(len(ids) - 1))
        logliks.append(float(total))
    loglik_correct = logliks[0] > max(logliks[1:])

    generated: list[int] = []
    next_id = int(last_logprobs.argmax())
    for _ in range(max_new_tokens):
        if next_id in stop_ids:
            break
        generated.append(next_id)
        step = model(input_ids=torch.tensor([[next_id]], device=device), past_key_values=cache, use_cache=True)
        next_id = int(step.logits[0, -1].argmax())
    text = tokenizer.decode(generated, skip_special_tokens=True)
    match = re.search(r"\d+", text)
    greedy_correct = match is not None and match.group(0) == sample.value
    return {"loglik_correct": bool(loglik_correct), "greedy_correct": bool(greedy_correct),
            "greedy_text": text, "logliks": logliks}


def run_needle(model, tokenizer, config: NeedleConfig, stop_ids: set[int], progress: bool = True,
               samples: list[NeedleSample] | None = None) -> dict:
    """Run the sweep (``samples`` from ``generate_samples`` if already made); returns per-cell and overall
    accuracies (JSON-ready)."""
    max_positions = getattr(model.config, "max_position_embeddings", None)
    if max_positions and max(config.lengths) > max_positions:
        warnings.warn(f"--lengths: {max(config.lengths)} exceeds the model's max_position_embeddings "
                      f"({max_positions}); results there measure extrapolation", stacklevel=2)
    if samples is None:
        samples = generate_samples(tokenizer, config)
    results = [score_sample(model, tokenizer, s, config.max_new_tokens, stop_ids)
               for s in tqdm(samples, desc="needle", unit="sample", disable=not progress)]

    cells = []
    for length in config.lengths:
        for depth in config.depths:
            picked = [(s, r) for s, r in zip(samples, results) if s.length == length and s.depth == depth]
            cells.append({
                "length": length,
                "depth": depth,
                "trials": len(picked),
                "mean_tokens": sum(len(s.prompt_ids) for s, _ in picked) / len(picked),
                "loglik_acc": sum(r["loglik_correct"] for _, r in picked) / len(picked),
                "greedy_acc": sum(r["greedy_correct"] for _, r in picked) / len(picked),
            })
    examples = [{"length": s.length, "tokens": len(s.prompt_ids), "depth": s.depth, "value": s.value,
                 "greedy_text": r["greedy_text"]}
                for s, r in list(zip(samples, results))[:: max(1, len(samples) // 5)]]
    return {
        "lengths": config.lengths,
        "depths": config.depths,
        "trials": config.trials,
        "num_distractors": config.num_distractors,
        "seed": config.seed,
        "chance_loglik_acc": 1.0 / (config.num_distractors + 1),
        "loglik_acc": sum(r["loglik_correct"] for r in results) / len(results),
        "greedy_acc": sum(r["greedy_correct"] for r in results) / len(results),
        "cells": cells,
        "examples": examples,
    }
