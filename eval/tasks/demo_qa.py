"""Short instruction-following questions whose answers the demo's training data teaches.

The questions come from the demo's own generator (``data_tools/demo_data/synthetic_chats.py``) with a seed the demo
never trains on: repeat, reverse or sort a word list, name word number k, find the secret code in a short passage.
Each answer is a deterministic function of its question, so a model trained on the demo data can get them exactly
right and an untrained one cannot. Only single-turn chats without a system turn and with short answers are kept (so
``max_out_len`` stays small); scored by exact match (OpenCompass's ``EMEvaluator``: the answer up to its first
period, comma or newline, punctuation and articles dropped).
"""

from __future__ import annotations

from dataclasses import dataclass

from hbp_train.common.errors import UserError

# The demo trains on seeds 0 (train) and 1 (held-out): these questions are drawn with seeds from here on.
SEED_OFFSET = 1000
MAX_PROMPT_TOKENS = 256
KINDS = {"Repeat these words:": "repeat", "Reverse these words:": "reverse", "Sort alphabetically": "sort",
         "Here is a list of words:": "kth"}


@dataclass
class DemoQAConfig:
    """What the demo QA set holds."""

    num_samples: int = 40
    """Questions in the set."""
    max_answer_tokens: int = 24
    """Longest expected answer in tokens (longer ones are skipped)."""
    seed: int = 0
    """Seed (offset by ``SEED_OFFSET``) of the demo generator."""

    def __post_init__(self):
        if self.num_samples < 1:
            raise UserError(f"--qa-samples: need >= 1, got {self.num_samples}")


def kind(question: str) -> str:
    """Which demo task a question is (the report groups scores by it)."""
    for start, name in KINDS.items():
        if question.startswith(start):
            return name
    return "needle" if question.endswith("What is the secret code?") else "other"


def generate_records(tokenizer, config: DemoQAConfig) -> list[dict]:
    """``num_samples`` rows ``{"prompt", "answer": [text], "kind", "tokens"}``, deterministic in ``config.seed``."""
    from data_tools.demo_data.synthetic_chats import generate

    records: list[dict] = []
    seed = SEED_OFFSET + config.seed
    while len(records) < config.num_samples:
        for chat in generate(4 * config.num_samples, MAX_PROMPT_TOKENS, seed):
            messages = chat["messages"]
            if [m["role"] for m in messages] != ["user", "assistant"]:
                continue
            question, answer = messages[0]["content"], messages[1]["content"]
            if len(tokenizer.encode(answer, add_special_tokens=False)) > config.max_answer_tokens:
                continue
            records.append({"prompt": question, "answer": [answer], "kind": kind(question),
                            "tokens": len(tokenizer.encode(question, add_special_tokens=False))})
            if len(records) == config.num_samples:
                break
        seed += 1
    return records
