"""The report of a data_tools.preprocess run: running totals over the workers' chunks, report.json's counts and
the summary the CLI prints.

Every record read is kept or dropped with a reason (``read == kept + sum(dropped.values())``; ``plain_text`` of the
kept ones were plain text, labelled with no chat template), and what a kept record held that was not trained on is
counted too: the records per detected shape (``formats``), the fields no shape uses (``ignored_fields``, e.g.
``{"meta": 500, "messages[].name": 3}``) and the assistant turns kept as context only (``untrained_turns``:
``weight_0``, ``prompt``). Kept lengths are held as a histogram: exact percentiles, memory bounded by the longest
sample, not by the number of samples. With a held-out split or input weights (mixing.py), ``tokens``,
``loss_tokens`` and the percentiles are the written training set's, ``rows`` its rows, and ``per_input`` and
``heldout`` say where the kept samples went.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


class Counts:
    """Running totals for report.json, fed one worker chunk at a time (``add``) and one drop at a time."""

    def __init__(self):
        self.read = 0
        self.truncated = 0
        self.plain = 0
        self.tokens = 0
        self.loss_tokens = 0
        self.dropped: dict[str, int] = {}
        self.formats: dict[str, int] = {}
        self.ignored: dict[str, int] = {}
        self.untrained: dict[str, int] = {}
        self.histogram = np.zeros(0, np.int64)

    def add(self, chunk) -> None:
        """Add a ``workers.Chunk``: its records read, their shapes, ignored fields and untrained turns,
        and the lengths and trained tokens of its kept rows (its drops are counted one by one, ``drop``)."""
        self.read += chunk.read
        for total, part in ((self.formats, chunk.formats), (self.ignored, chunk.ignored),
                            (self.untrained, chunk.untrained)):
            for key, n in part.items():
                total[key] = total.get(key, 0) + n
        self.tokens += int(chunk.lengths.sum())
        self.loss_tokens += int(chunk.num_loss_tokens.sum())
        self.truncated += chunk.truncated
        self.plain += chunk.plain
        counts = np.bincount(chunk.lengths)
        if len(counts) > len(self.histogram):
            self.histogram = np.concatenate([self.histogram, np.zeros(len(counts) - len(self.histogram), np.int64)])
        self.histogram[:len(counts)] += counts

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def report(self) -> dict:
        return {
            "read": self.read, "kept": int(self.histogram.sum()), "plain_text": self.plain,
            "truncated": self.truncated, "dropped": dict(sorted(self.dropped.items())), "tokens": self.tokens,
            "loss_tokens": self.loss_tokens, "length_percentiles": length_percentiles(self.histogram),
            "formats": dict(sorted(self.formats.items())),
            "ignored_fields": dict(sorted(self.ignored.items())),
            "untrained_turns": dict(sorted(self.untrained.items())),
        }


def length_percentiles(histogram: np.ndarray) -> dict:
    """p50, p90, p99, min, max and mean of the lengths whose counts ``histogram`` holds; {} for none."""
    n = int(histogram.sum())
    if not n:
        return {}
    present = np.flatnonzero(histogram)
    percentiles = {f"p{q}": int(histogram_percentile(histogram, q)) for q in (50, 90, 99)}
    mean = float(np.dot(np.arange(len(histogram)), histogram) / n)
    percentiles.update(min=int(present[0]), max=int(present[-1]), mean=round(mean, 1))
    return percentiles


def rows_summary(lengths: np.ndarray, num_loss_tokens: np.ndarray) -> dict:
    """``tokens``, ``loss_tokens`` and ``length_percentiles`` of a set of rows (a training set after its held-out
    split and weights, or the held-out set)."""
    return {"tokens": int(lengths.sum()), "loss_tokens": int(num_loss_tokens.sum()),
            "length_percentiles": length_percentiles(np.bincount(lengths))}


def histogram_percentile(histogram: np.ndarray, q: float) -> float:
    """``np.percentile(values, q)`` (linear method) of the integers whose counts ``histogram`` holds (value v
    ``histogram[v]`` times), computed as numpy computes it from the sorted values."""
    n = int(histogram.sum())
    position = (q / 100) * (n - 1)
    below = int(np.floor(position))
    cumulative = np.cumsum(histogram)
    a, b = np.searchsorted(cumulative, [below + 1, min(below + 2, n)])  # the values at ranks below, below + 1
    t = position - below
    return float(b - (b - a) * (1 - t)) if t >= 0.5 else float(a + (b - a) * t)


def format_report(report: dict) -> str:
    """A short human summary of a report."""
    dropped = sum(report["dropped"].values())
    reasons = ", ".join(f"{k} {v}" for k, v in report["dropped"].items())
    pct = report["length_percentiles"]
    shapes = ", ".join(f"{k} {v}" for k, v in report["formats"].items())
    lines = [
        f"read {report['read']}, kept {report['kept']}, truncated {report['truncated']}, dropped {dropped}"
        + (f" ({reasons})" if reasons else "") + (f"; shapes: {shapes}" if shapes else ""),
        f"tokens {report['tokens']:,} (trained on {report['loss_tokens']:,}); length p50 {pct.get('p50')} "
        f"p90 {pct.get('p90')} p99 {pct.get('p99')} max {pct.get('max')}",
    ]
    if report["untrained_turns"]:
        lines.append("assistant turns kept as context, not trained on: "
                     + ", ".join(f"{k} {v}" for k, v in report["untrained_turns"].items()))
    if report["ignored_fields"]:
        lines.append("fields not used (records holding them): "
                     + ", ".join(f"{k} {v}" for k, v in report["ignored_fields"].items()))
    lines += format_mix(report)
    lines.append(f"labels: {labels_line(report)}; wrote {report['output']} ({report['num_shards'] or 'auto'} "
                 "shards) + report.json + dropped.jsonl")
    return "\n".join(lines)


def labels_line(report: dict) -> str:
    """How the kept samples were labelled: conversations by the chat template (generation markers or incremental
    renders), plain text with no template; both, with their counts, when the run had both."""
    plain = report["plain_text"]
    chats = report["kept"] - plain
    parts = []
    if chats:
        parts.append(f"{report['label_mode']} mask, {report['chat_template']} chat template"
                     + (f" ({chats} conversations)" if plain else ""))
    if plain:
        parts.append("plain text, no chat template, the text (or completion) and the eos trained"
                     + (f" ({plain} samples)" if chats else ""))
    return "; ".join(parts)


def format_mix(report: dict) -> list[str]:
    """The summary lines of the input weights and the held-out split (none when neither was asked for)."""
    lines = []
    if any(p["weight"] != 1 for p in report.get("per_input", [])):
        lines.append("weights: " + ", ".join(
            f"{Path(p['input']).name} x{p['weight']:g}: {p['before_weight']} -> {p['after_weight']} samples"
            + (f" ({p['left_out_by_weight']} left out, listed in dropped.jsonl)" if p["left_out_by_weight"] else "")
            for p in report["per_input"]))
    held = report.get("heldout")
    if held:
        lines.append(f"held out {held['samples']} samples ({held['tokens']:,} tokens) -> {held['output']}; "
                     f"the training set has {report['rows']} rows (seed {report['seed']})")
    return lines
