"""Deterministic, long-tailed synthetic chat SFT dataset for demos, tests and the CPU smoke run: ``generate()``,
which ``python -m data_tools.make_demo_data`` writes to a JSONL file.

Each sample is an OpenAI-style ``{"messages": [...]}`` record. The text is made of pseudo-words from a fixed
vocabulary (the shipped tokenizer was trained on this generator's output, so it tokenizes them compactly), and
every assistant answer is a deterministic function of the user turn, so a small model can learn it and the demo
loss goes down:

* ``repeat`` / ``reverse`` / ``sort``: echo the user's word list as is, reversed, or sorted alphabetically;
* ``kth``: "What is word number k?" over a word list;
* ``needle``: a long passage of filler words with one "secret code" sentence hidden at a random depth, then
  "What is the secret code?" (a needle-retrieval eval can ask the same question).

Token lengths follow a long-tailed mix, like real SFT data: most samples are short (lognormal, median about 90
tokens, tens to a few hundred), ``LONG_FRACTION`` of them are long (uniform between a quarter of and almost
``--max-tokens``); ``--long-fraction`` changes that share (bench/bench_quality.py's second dataset raises it).
Lengths are planned in words with a conservative tokens-per-word estimate, so rendered with the shipped
tokenizer's chat template no sample exceeds ``--max-tokens`` (the longest reach about 90% of it). About a
tenth of the samples are multi-turn (2-3 exchanges; only samples with room for them) and about a third have a
system turn.

The shipped tokenizer is trained on this generator's output (bpe_tokenizer.py): changing how text is
generated changes the tokenizer, so retrain and re-ship it (tests/test_train_tokenizer.py checks they match).

Library: ``generate(num_samples, max_tokens, seed, long_fraction) -> list[dict]`` (a bad argument: ``UserError``
naming it).
"""

from __future__ import annotations

import numpy as np

from hbp_train.common.errors import UserError

# Tokens per pseudo-word (word + its leading space) under the shipped tokenizer, slightly above the real ~1.0
# (demo words are mostly single tokens), so planned lengths err short; tests check none passes --max-tokens.
TOKENS_PER_WORD = 1.05
# Tokens of chat-template overhead per turn (<|im_start|>role\n ... <|im_end|>\n) plus the instruction sentence.
TURN_OVERHEAD_TOKENS = 16
LONG_FRACTION = 0.04
SHORT_MEDIAN_TOKENS = 100
SHORT_SIGMA = 0.8
MIN_TOKENS = 32
MULTI_TURN_FRACTION = 0.25
SYSTEM_FRACTION = 0.35
VOCAB_SIZE = 2048
VOCAB_SEED = 20240611  # fixed: the vocabulary never depends on --seed

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a careful assistant. Follow the word instructions exactly.",
    "Answer briefly and precisely.",
)
TASKS = ("repeat", "reverse", "sort", "kth", "needle")


def _build_vocab() -> list[str]:
    """A fixed list of pronounceable pseudo-words (1-3 consonant-vowel syllables, optional final consonant)."""
    rng = np.random.default_rng(VOCAB_SEED)
    consonants = list("bdfgklmnprstvz")
    vowels = list("aeiou")
    words: set[str] = set()
    while len(words) < VOCAB_SIZE:
        num_syllables = int(rng.integers(1, 4))
        word = "".join(str(rng.choice(consonants)) + str(rng.choice(vowels)) for _ in range(num_syllables))
        if rng.random() < 0.3:
            word += str(rng.choice(consonants))
        if len(word) >= 3:
            words.add(word)
    return sorted(words)


VOCAB = _build_vocab()
# Zipf-like word frequencies, as in natural text: a few words are common, most are rare.
_WORD_P = 1.0 / (np.arange(VOCAB_SIZE) + 10.0)
_WORD_P /= _WORD_P.sum()


def _words(rng: np.random.Generator, n: int) -> list[str]:
    return [VOCAB[i] for i in rng.choice(VOCAB_SIZE, size=max(1, n), p=_WORD_P)]


def _exchange(rng: np.random.Generator, task: str, budget_tokens: int) -> tuple[str, str]:
    """One (user, assistant) pair of the given task whose rendered length is about ``budget_tokens``."""
    budget_words = max(2, int((budget_tokens - TURN_OVERHEAD_TOKENS * 2) / TOKENS_PER_WORD))
    if task in ("repeat", "reverse", "sort"):
        words = _words(rng, max(1, budget_words // 2))  # the answer repeats the list: half the budget each
        answer = {"repeat": words, "reverse": words[::-1], "sort": sorted(words)}[task]
        verb = {"repeat": "Repeat", "reverse": "Reverse", "sort": "Sort alphabetically"}[task]
        return f"{verb} these words: {' '.join(words)}", " ".join(answer)
    if task == "kth":
        words = _words(rng, max(1, budget_words - 8))
        k = int(rng.integers(1, len(words) + 1))
        return (f"Here is a list of words: {' '.join(words)}\nWhat is word number {k}?",
                f"Word number {k} is {words[k - 1]}.")
    assert task == "needle", task
    filler = _words(rng, max(1, budget_words - 16))
    code = " ".join(_words(rng, 2))
    depth = int(rng.integers(0, len(filler) + 1))
    passage = filler[:depth] + [f"The secret code is {code}."] + filler[depth:]
    return f"{' '.join(passage)}\nWhat is the secret code?", f"The secret code is {code}."


def _sample_target_tokens(rng: np.random.Generator, max_tokens: int, long_fraction: float = LONG_FRACTION) -> int:
    """Draw one sample's planned token length from the long-tailed mix."""
    ceiling = int(0.95 * max_tokens)
    if rng.random() < long_fraction:
        target = rng.uniform(max_tokens / 4, ceiling)
    else:
        target = rng.lognormal(np.log(SHORT_MEDIAN_TOKENS), SHORT_SIGMA)
    return int(np.clip(target, min(MIN_TOKENS, ceiling), ceiling))


def generate(num_samples: int = 2000, max_tokens: int = 2048, seed: int = 0,
             long_fraction: float = LONG_FRACTION) -> list[dict]:
    """Return ``num_samples`` chat records ``{"messages": [{"role", "content"}, ...]}``; same arguments, same output.

    ``long_fraction``: share of samples drawn from the long part of the mix (0..1)."""
    if num_samples < 1:  # an empty dataset fails in every later stage
        raise UserError(f"num_samples must be >= 1, got {num_samples}")
    if max_tokens < 64:
        raise UserError(f"max_tokens must be >= 64 (room for one short exchange), got {max_tokens}")
    if seed < 0:  # numpy's generator rejects it with a message that names no option
        raise UserError(f"seed must be >= 0, got {seed}")
    if not 0.0 <= long_fraction <= 1.0:
        raise UserError(f"long_fraction must be between 0 and 1, got {long_fraction}")
    rng = np.random.default_rng(seed)
    records = []
    for _ in range(num_samples):
        target = _sample_target_tokens(rng, max_tokens, long_fraction)
        messages = []
        if rng.random() < SYSTEM_FRACTION:
            system = SYSTEM_PROMPTS[int(rng.integers(len(SYSTEM_PROMPTS)))]
            messages.append({"role": "system", "content": system})
            target -= TURN_OVERHEAD_TOKENS
        num_turns = int(rng.integers(2, 4)) if rng.random() < MULTI_TURN_FRACTION and target >= 120 else 1
        for _turn in range(num_turns):
            budget = target // num_turns
            # Long budgets go to retrieval tasks: echoing a 1000-word list is not a long-context skill.
            task = str(rng.choice(TASKS[3:])) if budget > 600 else str(rng.choice(TASKS))
            user, assistant = _exchange(rng, task, budget)
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        records.append({"messages": messages})
    return records
