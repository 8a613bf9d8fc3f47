"""Checkpoints side by side: ``python -m eval.run compare RUN_A RUN_B ... --out DIR``.

Each RUN is the ``--out`` folder of an ``offline`` or ``opencompass`` evaluation (or its ``results.json``); both
write a ``scores`` list of ``{"dataset", "metric", "mode", "score"}``. The comparison is one row per (dataset, metric)
found in any run and one column per run (``-`` where a run lacks it), written as ``compare.md`` and
``compare.json``, and drawn as grouped bars (``compare.png``; percentages only, breakdown rows left out: loss and
perplexity have other scales).
"""

from __future__ import annotations

import json
from pathlib import Path

from eval.report import markdown_table
from hbp_train.common.errors import UserError

MAX_PLOTTED = 30
UNSCALED = ("loss", "perplexity")  # metrics that are not percentages


def load_run(path: Path) -> tuple[Path, dict]:
    """``(results.json path, its content)`` of an evaluation folder or file; one-line UserError if it is none."""
    path = Path(path).expanduser().resolve()
    file = path / "results.json" if path.is_dir() else path
    if not file.is_file():
        raise UserError(f"{path}: no results.json; pass the --out folder of `eval.run offline` or "
                        "`eval.run opencompass`")
    try:
        content = json.loads(file.read_text())
    except (OSError, ValueError) as err:
        raise UserError(f"{file}: not readable JSON ({err})") from None
    if not isinstance(content, dict) or not isinstance(content.get("scores"), list):
        raise UserError(f"{file}: no 'scores' list (written by an older eval.run? re-run the evaluation)")
    return file, content


def labels_for(files: list[Path]) -> list[str]:
    """Short distinct names: the folder name, or more of the path when two folders share a name."""
    for depth in range(2, 8):
        labels = ["/".join(f.parent.parts[-(depth - 1):]) for f in files]
        if len(set(labels)) == len(labels):
            return labels
    return [str(f.parent) for f in files]


def compare(runs: list[Path], labels: list[str] | None = None) -> dict:
    """``{"runs": [{label, results}], "rows": [{dataset, metric, mode, scores: {label: score or None}}]}``."""
    if len(runs) < 2:
        raise UserError("compare: give at least two evaluation folders")
    loaded = [load_run(r) for r in runs]
    if labels is None:
        labels = labels_for([file for file, _ in loaded])
    elif len(labels) != len(runs):
        raise UserError(f"--labels: {len(labels)} labels for {len(runs)} runs")
    rows: dict[tuple[str, str], dict] = {}
    for label, (_, content) in zip(labels, loaded):
        for s in content["scores"]:
            row = rows.setdefault((s["dataset"], s["metric"]), {"dataset": s["dataset"], "metric": s["metric"],
                                                                "mode": s.get("mode", "-"), "scores": {}})
            row["scores"][label] = s["score"]
    for row in rows.values():
        row["scores"] = {label: row["scores"].get(label) for label in labels}
    return {"runs": [{"label": label, "results": str(file)} for label, (file, _) in zip(labels, loaded)],
            "rows": list(rows.values())}


def table(comparison: dict) -> str:
    labels = [r["label"] for r in comparison["runs"]]
    return markdown_table(["dataset", "metric", *labels],
                          [[r["dataset"], r["metric"], *r["scores"].values()] for r in comparison["rows"]])


def plot(comparison: dict, path: Path) -> Path:
    """Grouped horizontal bars: a group per (dataset, metric) in percent, a bar per run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = [r["label"] for r in comparison["runs"]]
    rows = [r for r in comparison["rows"] if r["mode"] != "breakdown" and r["metric"] not in UNSCALED]
    shown = rows[:MAX_PLOTTED]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.35 * max(1, len(shown)) * max(1, len(labels)) / 2))
    height = 0.8 / len(labels)
    positions = np.arange(len(shown))
    for i, label in enumerate(labels):
        values = [r["scores"][label] if r["scores"][label] is not None else 0.0 for r in shown]
        ax.barh(positions + i * height, values, height=height, label=label)
    ax.set_yticks(positions + height * (len(labels) - 1) / 2, [f"{r['dataset']} ({r['metric']})" for r in shown])
    ax.invert_yaxis()
    ax.set_xlabel("score (%)")
    ax.set_xlim(0, 100)
    ax.legend(loc="lower right")
    more = f" (first {MAX_PLOTTED} of {len(rows)})" if len(rows) > len(shown) else ""
    ax.set_title(f"checkpoints side by side{more}")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
