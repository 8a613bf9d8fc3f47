"""Presenting evaluation results: the output folder, markdown tables, and the length × depth heatmaps (matplotlib
Agg) of the offline needle check and of the generated OpenCompass tasks."""

from __future__ import annotations

from pathlib import Path

from hbp_train.common.errors import UserError


def make_out(path: Path) -> Path:
    """The ``--out`` folder, created if missing; a one-line UserError if it cannot be."""
    path = Path(path).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"--out {path}: cannot create the directory ({err.strerror})") from None
    return path


def markdown_table(header: list[str], rows: list[list]) -> str:
    """A GitHub-style markdown table; floats show 4 significant digits, ``None`` shows as ``-``."""

    def cell(value) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            return f"{value:.4g}"
        return str(value).replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def needle_table(needle: dict) -> str:
    """Per-length accuracies (averaged over depths) plus the overall row; the reference model's beside them when
    there is one (``needle["baseline"]``), and the chance level under the table."""
    baseline = needle.get("baseline")
    metrics = ("loglik_acc", "greedy_acc")
    rows = []
    for length in needle["lengths"]:
        cells = [c for c in needle["cells"] if c["length"] == length]
        row = [length, sum(c["mean_tokens"] for c in cells) / len(cells),
               *[sum(c[m] for c in cells) / len(cells) for m in metrics]]
        if baseline:
            base = [c for c in baseline["cells"] if c["length"] == length]
            row += [sum(c[m] for c in base) / len(base) for m in metrics]
        rows.append(row)
    rows.append(["all", None, *[needle[m] for m in metrics], *([baseline[m] for m in metrics] if baseline else [])])
    header = ["length", "mean tokens", "loglik acc", "greedy acc"]
    if baseline:
        header += [f"loglik acc ({baseline['model']})", f"greedy acc ({baseline['model']})"]
    note = (f"\nChance for loglik acc: {needle['chance_loglik_acc']:.2f} (the true value against "
            f"{needle['num_distractors']} distractors of as many tokens)"
            + (f"; {baseline['model']}: {baseline['loglik_acc']:.2f}, measured on the same samples.\n" if baseline
               else ".\n"))
    return markdown_table(header, rows) + note


def _length_depth_heatmap(fig, ax, grid, lengths, depths, vmax: float, fmt: str, title: str) -> None:
    """One score grid on ``ax``: rows = context lengths, columns = needle depths, each cell's value written in it."""
    image = ax.imshow(grid, vmin=0.0, vmax=vmax, cmap="RdYlGn", aspect="auto", origin="lower")
    for i in range(len(lengths)):
        for j in range(len(depths)):
            ax.text(j, i, format(grid[i, j], fmt), ha="center", va="center", fontsize=8)
    ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
    ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
    ax.set_xlabel("needle depth (fraction of haystack)")
    ax.set_ylabel("context length (tokens)")
    ax.set_title(title)
    fig.colorbar(image, ax=ax, fraction=0.046)


def plot_needle_heatmap(needle: dict, path: Path) -> Path:
    """Two heatmaps side by side (log-likelihood and greedy accuracy), rows = lengths, columns = depths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    lengths, depths = needle["lengths"], needle["depths"]
    fig, axes = plt.subplots(1, 2, figsize=(4 + 1.6 * len(depths), 1.5 + 0.6 * len(lengths)), squeeze=False)
    for ax, metric, title in zip(axes[0], ("loglik_acc", "greedy_acc"), ("log-likelihood ranking", "greedy decoding")):
        grid = np.zeros((len(lengths), len(depths)))
        for c in needle["cells"]:
            grid[lengths.index(c["length"]), depths.index(c["depth"])] = c[metric]
        _length_depth_heatmap(fig, ax, grid, lengths, depths, 1.0, ".2f", f"{title}: {needle[metric]:.2f}")
    baseline = needle.get("baseline")
    fig.suptitle(f"needle in a haystack ({needle['trials']} trials/cell, "
                 f"chance {needle['chance_loglik_acc']:.2f} for log-likelihood"
                 + (f", {baseline['model']} {baseline['loglik_acc']:.2f})" if baseline else ")"))
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def score_table(scores: list[dict]) -> str:
    """One checkpoint's scores: a row per (dataset, metric)."""
    return markdown_table(["dataset", "metric", "mode", "score"],
                          [[s["dataset"], s["metric"], s.get("mode", "-"), s["score"]] for s in scores])


def breakdown_table(name: str, breakdown: dict) -> str:
    """A generated task's score per group: a length × depth grid (rows lengths, columns depths, plus the mean
    over depths), else a row per group (length, or kind of question) with its number of samples."""
    keys = breakdown["group_by"]
    if keys == ["length", "depth"]:
        lengths = sorted({g["length"] for g in breakdown["groups"]})
        depths = sorted({g["depth"] for g in breakdown["groups"]})
        cell = {(g["length"], g["depth"]): g for g in breakdown["groups"]}
        rows = []
        for length in lengths:
            cells = [cell.get((length, d)) for d in depths]
            present = [c for c in cells if c]
            mean = sum(c["score"] * c["samples"] for c in present) / sum(c["samples"] for c in present)
            rows.append([length, *[c["score"] if c else None for c in cells], mean])
        return markdown_table(["length \\ depth", *[f"{d:g}" for d in depths], "all depths"], rows)
    return markdown_table([*keys, "samples", "score"],
                          [[g[k] for k in keys] + [g["samples"], g["score"]] for g in breakdown["groups"]])


def breakdown_scores(abbr: str, breakdown: dict) -> list[dict]:
    """Score rows per length (or kind) of a generated task, for the results table and ``compare``."""
    key = breakdown["group_by"][0]
    values: dict = {}
    for group in breakdown["groups"]:
        values.setdefault(group[key], []).append((group["score"], group["samples"]))
    return [{"dataset": abbr, "metric": f"{key} {value}", "mode": "breakdown",
             "score": sum(s * n for s, n in pairs) / sum(n for _, n in pairs)} for value, pairs in values.items()]


def plot_score_grids(breakdowns: dict[str, dict], path: Path) -> Path | None:
    """Length × depth heatmaps of the generated tasks that have both (needle, multikey); None if none has."""
    grids = {name: b for name, b in breakdowns.items() if b["group_by"] == ["length", "depth"]}
    if not grids:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, axes = plt.subplots(1, len(grids), squeeze=False,
                             figsize=(4 + 4 * len(grids), 1.5 + 0.6 * max(len({g["length"] for g in b["groups"]})
                                                                          for b in grids.values())))
    for ax, (name, b) in zip(axes[0], grids.items()):
        lengths = sorted({g["length"] for g in b["groups"]})
        depths = sorted({g["depth"] for g in b["groups"]})
        grid = np.full((len(lengths), len(depths)), np.nan)
        for g in b["groups"]:
            grid[lengths.index(g["length"]), depths.index(g["depth"])] = g["score"]
        _length_depth_heatmap(fig, ax, grid, lengths, depths, 100.0, ".0f", f"{name}: {b['score']:.1f}")
    fig.suptitle("OpenCompass, generated suite: % correct")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
