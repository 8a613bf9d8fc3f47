"""Per-input weights and the held-out split of a data_tools.preprocess run (``--input a.jsonl:2 b.parquet:0.5``,
``--heldout-fraction F`` / ``--heldout-count N``, ``--seed S``).

Both act on the samples preprocessing kept (after every drop), each sample one row: a whole conversation or text,
never a part of one.

* **Held-out split**: N samples (``--heldout-count``, or ``--heldout-fraction`` of the kept ones, rounded) drawn at
  random with the seed from all kept samples of all inputs, before any weighting, so no copy of a held-out sample is
  trained on. They are written as a dataset of their own in the same format (``--heldout-output``, by default
  OUTPUT_heldout beside OUTPUT), which ``data_tools.pack`` packs for the trainer's held-out loss
  (``data.eval_shards``) and ``eval.run offline --dataset`` reads as it is.
* **Weights**: a trailing ``:<number>`` on an input (only when the whole argument is not itself an existing path, so
  paths holding ':' still work) is its weight, > 0. An input's training samples are each taken ``floor(w)`` times,
  and a seeded ``round(frac(w) * n)`` of them once more: 2 doubles an input, 0.5 keeps a seeded half, 1.5 takes all
  once and a seeded half twice. Copies sit next to each other in the output (the planner orders samples itself). The
  samples a weight below 1 leaves out are listed in dropped.jsonl with reason ``weight``, not counted as bad input.

Everything is deterministic in the seed and the kept samples (so in the inputs), whatever ``--num-proc``.
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from hbp_train.common.errors import UserError

# A trailing weight: a plain decimal number (a sign allowed so that ':-1' is refused as a weight, not read as a
# missing file).
_WEIGHT = re.compile(r"^(?P<path>.+):(?P<weight>[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)$")


def parse_input(arg: str) -> tuple[str, float]:
    """``(path, weight)`` of one ``--input``: ``a.jsonl:2`` -> ``("a.jsonl", 2.0)``. An argument that exists as a
    path, or does not end in ``:<number>``, is a path of weight 1. UserError for a weight that is not > 0."""
    match = None if os.path.exists(arg) else _WEIGHT.match(arg)
    if match is None:
        return arg, 1.0
    weight = float(match["weight"])
    if not (weight > 0 and math.isfinite(weight)):
        raise UserError(f"--input {arg}: weight {match['weight']} must be a number > 0 (2 takes the input twice, "
                        "0.5 a seeded half; leave the input out to take none of it)")
    return match["path"], weight


@dataclass
class Mix:
    """The weights of the inputs (in --input order) and the held-out settings of one preprocess run."""

    weights: list[float] = field(default_factory=list)
    heldout_fraction: float | None = None
    heldout_count: int | None = None
    heldout_output: str | None = None
    """The held-out dataset folder; None = OUTPUT_heldout beside OUTPUT (``heldout_dir``)."""
    seed: int = 0

    def __post_init__(self):
        if self.heldout_fraction is not None and self.heldout_count is not None:
            raise UserError("--heldout-fraction and --heldout-count: give one of them")
        if self.heldout_fraction is not None and not 0 < self.heldout_fraction < 1:
            raise UserError(f"--heldout-fraction {self.heldout_fraction}: must be between 0 and 1 (e.g. 0.02)")
        if self.heldout_count is not None and self.heldout_count < 1:
            raise UserError(f"--heldout-count {self.heldout_count}: must be >= 1")
        if self.seed < 0:
            raise UserError(f"--seed {self.seed}: must be >= 0")

    @property
    def heldout(self) -> bool:
        return self.heldout_fraction is not None or self.heldout_count is not None

    @property
    def active(self) -> bool:
        """Whether the output differs from the kept samples in reading order (a split or a weight other than 1)."""
        return self.heldout or any(w != 1 for w in self.weights)

    def heldout_dir(self, output: str) -> Path:
        """Where the held-out dataset goes: ``heldout_output``, else OUTPUT_heldout beside OUTPUT."""
        if self.heldout_output:
            return Path(self.heldout_output)
        out = Path(os.path.abspath(output))
        return out.with_name(out.name + "_heldout")

    def heldout_size(self, kept: int) -> int:
        """Samples held out of ``kept``; UserError when that leaves none on either side."""
        if self.heldout_count is not None:
            size, asked = self.heldout_count, f"--heldout-count {self.heldout_count}"
        else:
            size, asked = int(math.floor(self.heldout_fraction * kept + 0.5)), \
                f"--heldout-fraction {self.heldout_fraction:g}"
        if size < 1:
            raise UserError(f"{asked} of {kept} kept samples holds out none; use a larger fraction or "
                            "--heldout-count N")
        if size >= kept:
            raise UserError(f"{asked} would hold out {size} of {kept} kept samples and leave none to train on; "
                            "hold out fewer")
        return size


@dataclass
class RowPlan:
    """What becomes of the kept rows (indices into them, in reading order)."""

    train: np.ndarray
    """The training dataset's rows: each kept row as many times as its weight gives, copies together."""
    heldout: np.ndarray
    """The held-out rows, ascending."""
    left_out: np.ndarray
    """Training rows a weight below 1 left out, ascending."""
    copies: np.ndarray
    """Copies of each kept row in the training set (0 for held-out and left-out rows)."""


def plan_rows(row_input: np.ndarray, mix: Mix) -> RowPlan:
    """The plan for kept rows whose inputs (indices into ``mix.weights``) are ``row_input``: held-out rows first
    (seeded, among all), then each input's weight over its remaining rows (seeded per input)."""
    n = len(row_input)
    heldout = np.zeros(0, np.int64)
    if mix.heldout:
        size = mix.heldout_size(n)
        heldout = np.sort(np.random.default_rng([mix.seed, 0]).choice(n, size, replace=False))
    training = np.ones(n, bool)
    training[heldout] = False
    copies = np.zeros(n, np.int64)
    for i, weight in enumerate(mix.weights):
        rows = np.flatnonzero(training & (row_input == i))
        whole = int(math.floor(weight))
        extra = int(math.floor((weight - whole) * len(rows) + 0.5))
        copies[rows] = whole
        if extra:
            picked = np.random.default_rng([mix.seed, 1, i]).choice(len(rows), extra, replace=False)
            copies[rows[picked]] += 1
    return RowPlan(train=np.repeat(np.arange(n), copies), heldout=heldout,
                   left_out=np.flatnonzero(training & (copies == 0)), copies=copies)


def per_input(paths: list[str], mix: Mix, read: list[int], row_input: np.ndarray, plan: RowPlan) -> list[dict]:
    """Each input's counts for the report: records read, samples kept, held out, before and after its weight, and
    left out by it (``before * weight`` rounded = ``after``)."""
    rows = []
    for i, (path, weight) in enumerate(zip(paths, mix.weights)):
        mine = row_input == i
        held = int(np.count_nonzero(mine[plan.heldout])) if len(plan.heldout) else 0
        kept = int(np.count_nonzero(mine))
        rows.append({"input": path, "weight": weight, "read": read[i], "kept": kept, "heldout": held,
                     "before_weight": kept - held, "after_weight": int(plan.copies[mine].sum()),
                     "left_out_by_weight": int(np.count_nonzero(mine[plan.left_out])) if len(plan.left_out) else 0})
    return rows


def apply_mix(dataset, row_input: np.ndarray, mix: Mix, inputs: list[str], read: list[int], report: dict,
              dropped_file, heldout_dir: Path | None):
    """``(training rows, held-out rows or None)`` of the kept rows (``dataset``, whose inputs are ``row_input``)
    under the held-out split and the weights; adds to ``report`` where the samples went (``rows``, ``seed``,
    ``per_input``, ``heldout``, the training set's tokens and lengths) and writes to ``dropped_file`` a line for each
    sample a weight left out. Without a split or a weight other than 1 the dataset is returned as it is."""
    from data_tools.preprocessing.report import rows_summary

    plan = plan_rows(row_input, mix)
    report.update(rows=len(plan.train), seed=mix.seed, per_input=per_input(inputs, mix, read, row_input, plan))
    if not mix.active:
        return dataset, None
    if len(plan.left_out):
        sources = dataset.data.column("source").take(plan.left_out).to_pylist()
        for source, row in zip(sources, plan.left_out.tolist()):
            line = {"source": source, "reason": "weight", "detail": f"weight {mix.weights[row_input[row]]:g} keeps "
                    "a seeded part of its input's samples; this one is not in it"}
            dropped_file.write(json.dumps(line, ensure_ascii=False) + "\n")
    lengths = dataset.data.column("length").to_numpy()
    loss = dataset.data.column("num_loss_tokens").to_numpy()
    report.update(rows_summary(lengths[plan.train], loss[plan.train]))
    heldout = None
    if mix.heldout:
        report["heldout"] = {"output": str(heldout_dir), "samples": len(plan.heldout), "seed": mix.seed,
                             "fraction": mix.heldout_fraction, "count": mix.heldout_count,
                             **rows_summary(lengths[plan.heldout], loss[plan.heldout])}
        heldout = dataset.select(plan.heldout)
    return dataset.select(plan.train), heldout
