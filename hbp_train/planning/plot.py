"""Plan plots (matplotlib, Agg): length histogram with group boundaries, per-replica attention cost of a few
steps (isf vs hbp), and ABR per step. Used by ``data_tools.pack --plot``.

A plan whose steps run one replica each (isf with the largest group's SP degree equal to the world size, as in the
demo: sp=2 on 2 ranks) has no imbalance between replicas to draw; its panel says so on the figure and draws instead
each step's first W packs side by side, the imbalance those packs would have if W ranks ran them at sp=1."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from hbp_train.planning.plan import Plan

NUM_STEPS_SHOWN = 3


def replica_attention(plan: Plan, step: int) -> np.ndarray:
    """[R] attention cost (sum len^2 over the replica's packs of ``step``), in units of 1e9."""
    mat = plan.step_matrix(step)  # [m, R]
    return np.array([pack_attention(plan, mat[:, r]).sum() for r in range(mat.shape[1])])


def pack_attention(plan: Plan, packs) -> np.ndarray:
    """Attention cost (sum len^2) of each of ``packs``, in units of 1e9."""
    return np.array([float((plan.lengths[plan.pack(p)].astype(np.float64) ** 2).sum()) for p in packs]) / 1e9


def _slot_abr(cost: np.ndarray) -> float:
    """The ABR formula (1 - mean/max) of one slot's costs."""
    return 1.0 - float(cost.mean()) / float(cost.max()) if cost.max() > 0 else 0.0


def plot_plans(isf: Plan | None, hbp: Plan | None, path: str):
    """Write a 2x2 figure comparing the given plans (either may be None) to ``path`` (PNG); returns the (closed)
    matplotlib figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plans = [(name, p) for name, p in (("isf", isf), ("hbp", hbp)) if p is not None]
    ref = plans[-1][1]
    fig, axes = plt.subplots(2, 2, figsize=(14, 9))
    ax = axes[0, 0]
    lengths = ref.lengths
    bins = np.logspace(np.log10(lengths.min()), np.log10(max(2, lengths.max())) + 0.05, 60)
    ax.hist(lengths, bins=bins, color="tab:gray")
    ax.set_xscale("log")
    ax.set_yscale("log")
    for i, g in enumerate(ref.config.groups):
        ax.axvline(g.pack_len, color=f"C{i}", ls="--", label=f"group {i}: pack_len {g.pack_len}, sp {g.sp}")
    ax.set_xlabel("sample length (tokens)")
    ax.set_ylabel("samples")
    ax.set_title(f"length histogram ({len(lengths)} samples)")
    ax.legend(fontsize=8)

    for ax, (name, plan) in zip([axes[0, 1], axes[1, 0]], plans):
        shown = _steps_to_show(plan)
        one_replica = bool(shown) and plan.config.world_size > 1 and all(plan.step_replicas(s) == 1 for s in shown)
        width = 0.8 / max(1, len(shown))
        for i, s in enumerate(shown):
            if one_replica:  # the step's first W packs as W ranks at sp=1 would run them side by side
                cost = pack_attention(plan, plan.step_matrix(s)[:plan.config.world_size, 0])
                label = f"step {s}: its first {len(cost)} packs side by side, ABR {_slot_abr(cost):.3f} at sp=1"
            else:
                cost = replica_attention(plan, s)
                label = f"step {s} (group {int(plan.step_group[s])}, ABR {plan.step_metrics['ABR'][s]:.3f})"
            cost = cost / cost.max() if cost.max() > 0 else cost
            ax.bar(np.arange(len(cost)) + (i - (len(shown) - 1) / 2) * width, cost, width=width, label=label)
        ax.set_ylabel("attention cost (sum len^2) / step max")
        ax.set_ylim(0, 1.6 if one_replica else 1.15)  # one replica: room above the bars for the note and legend
        ax.xaxis.get_major_locator().set_params(integer=True)
        if one_replica:
            sp = plan.config.groups[int(plan.step_group[shown[0]])].sp
            ax.set_xlabel("rank, if the packs ran at sp=1")
            ax.set_title(f"{name}: one replica per step (sp={sp} on {plan.config.world_size} ranks), nothing to "
                         f"balance between replicas", fontsize=10)
            ax.text(0.5, 0.98, f"so ABR is 0 by construction, and every token pays SP communication (CR "
                    f"{plan.metrics['CR']:.2f}).\nDrawn instead: each step's first packs, as "
                    f"{plan.config.world_size} ranks at sp=1 would run them (the imbalance without SP)",
                    transform=ax.transAxes, ha="center", va="top", fontsize=8,
                    bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none"})
        else:
            ax.set_xlabel("replica")
            ax.set_title(f"{name}: per-replica attention cost of {len(shown)} steps (1 = balanced)")
        if shown:  # a plan whose samples were all dropped has no steps to draw
            ax.legend(fontsize=8, **({"loc": "upper center", "bbox_to_anchor": (0.5, 0.87)} if one_replica else {}))
    if len(plans) == 1:
        axes[1, 0].axis("off")

    ax = axes[1, 1]
    for name, plan in plans:
        abr = plan.step_metrics["ABR"]
        ax.plot(np.arange(len(abr)), abr, ".", ms=3, label=f"{name} (mean slot ABR {plan.metrics['ABR']:.4f})")
    ax.set_xlabel("step")
    ax.set_ylabel("ABR of the step")
    ax.set_yscale("symlog", linthresh=1e-3)
    ax.set_title("attention balance ratio per step (lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # as Plan.to_json does for plan.json
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return fig


def _steps_to_show(plan: Plan) -> list[int]:
    """The first NUM_STEPS_SHOWN steps taken round-robin over the groups (each group's first steps), so every
    group is represented when there are few groups and isf and hbp show the same number of steps."""
    per_group = [np.flatnonzero(plan.step_group == g).tolist() for g in np.unique(plan.step_group)]
    out = []
    for k in range(NUM_STEPS_SHOWN):
        out.extend(steps[k] for steps in per_group if k < len(steps))
    return sorted(out[:NUM_STEPS_SHOWN])
