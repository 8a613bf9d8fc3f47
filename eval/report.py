"""Presenting evaluation results: markdown tables and the needle heatmap (length × depth, matplotlib Agg)."""

from __future__ import annotations

from pathlib import Path


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
    """Per-length accuracies (averaged over depths) plus the overall row."""
    rows = []
    for length in needle["lengths"]:
        cells = [c for c in needle["cells"] if c["length"] == length]
        rows.append([
            length,
            sum(c["mean_tokens"] for c in cells) / len(cells),
            sum(c["loglik_acc"] for c in cells) / len(cells),
            sum(c["greedy_acc"] for c in cells) / len(cells),
        ])
    rows.append(["all", None, needle["loglik_acc"], needle["greedy_acc"]])
    return markdown_table(["length", "mean tokens", "loglik acc", "greedy acc"], rows)


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
        image = ax.imshow(grid, vmin=0.0, vmax=1.0, cmap="RdYlGn", aspect="auto", origin="lower")
        for i in range(len(lengths)):
            for j in range(len(depths)):
                ax.text(j, i, f"{grid[i, j]:.2f}", ha="center", va="center", fontsize=8)
        ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_xlabel("needle depth (fraction of haystack)")
        ax.set_ylabel("context length (tokens)")
        ax.set_title(f"{title}: {needle[metric]:.2f}")
        fig.colorbar(image, ax=ax, fraction=0.046)
    fig.suptitle(f"needle in a haystack ({needle['trials']} trials/cell, "
                 f"chance {needle['chance_loglik_acc']:.2f} for log-likelihood)")
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
