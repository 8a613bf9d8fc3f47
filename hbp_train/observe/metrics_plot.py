"""The training run at a glance: RUN_DIR/metrics.png from RUN_DIR/metrics.jsonl (`python -m hbp_train.run_plot`).

Four panels over the optimizer steps: the training loss (with the held-out loss where it was measured), tokens/s
coloured by the SP degrees the step ran (a step that mixes packing groups may run several: "sp=1+2"), the live
imbalance between ranks (max/mean compute time) beside the plan's predicted ABR, and the peak memory with the live
communication ratio (CR) and each step's share of compute time at SP > 1. The trainer writes it when a run ends
(rank 0, with logging.jsonl on); this command redraws it for any run directory, also while the run is going on.
"""

from __future__ import annotations

import json
from pathlib import Path

from hbp_train.common.errors import UserError


TIME_SHARE = "sp/time_share/sp"  # sp/time_share/sp<d>: the step's share of compute time at SP degree d


def _time_share_above_sp1(record: dict) -> float:
    return sum(v for k, v in record.items() if k.startswith(TIME_SHARE) and int(k[len(TIME_SHARE):]) > 1)


def read_metrics(path: Path) -> list[dict]:
    """The step records of a metrics.jsonl; UserError naming the line for a damaged one. A resumed run appends
    to the same file, so a step seen twice keeps its latest record."""
    by_step = {}
    try:
        with open(path, encoding="utf-8") as f:
            lines = list(f)
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text; is it the metrics.jsonl of a run?") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            by_step[int(record["plan/step"])] = record
        # JSONDecodeError and int("x") are ValueErrors; a missing key or a list instead of an object the others.
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"{path}:{number}: not a step record ({exc})") from None
    return [by_step[s] for s in sorted(by_step)]


def plot_run(run_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw RUN_DIR/metrics.jsonl into ``out`` (default RUN_DIR/metrics.png); returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from hbp_train.common.outputs import write_output

    run_dir = Path(run_dir)
    records = read_metrics(run_dir / "metrics.jsonl")
    if not records:
        raise UserError(f"{run_dir / 'metrics.jsonl'}: no steps logged yet")
    out = Path(out) if out else run_dir / "metrics.png"

    def series(key):
        return [(r["plan/step"] + 1, r[key]) for r in records if isinstance(r.get(key), (int, float))]

    fig, axes = plt.subplots(2, 2, figsize=(13, 8))
    ax = axes[0][0]
    ax.plot(*zip(*series("loss/train")), lw=1, label="train (step)")
    if series("loss/eval"):
        ax.plot(*zip(*series("loss/eval")), "o-", label="held-out")
    ax.set_title("loss")
    ax.legend()
    ax = axes[0][1]
    ran = {r["plan/step"]: tuple(r.get("plan/sp_degrees") or [r["plan/sp"]]) for r in records}
    for degrees in sorted(set(ran.values())):
        pts = [(r["plan/step"] + 1, r["perf/tokens_per_s"]) for r in records if ran[r["plan/step"]] == degrees]
        ax.plot(*zip(*pts), ".", label="sp=" + "+".join(map(str, degrees)))
    ax.set_title("tokens/s (all ranks)")
    ax.legend()
    ax = axes[1][0]
    ax.plot(*zip(*series("balance/imbalance")), lw=1, label="live max/mean rank time")
    if series("balance/plan_ABR"):
        steps, abr = zip(*series("balance/plan_ABR"))
        ax.plot(steps, [1 / (1 - min(a, 0.99)) for a in abr], lw=1, label="plan: 1/(1-ABR)")
    ax.set_title("balance between ranks (1 = perfect)")
    ax.legend()
    ax = axes[1][1]
    ax.plot(*zip(*series("memory/peak_gib")), lw=1, color="tab:red")
    ax.set_ylabel("peak memory (GiB)", color="tab:red")
    time_at_sp = [(r["plan/step"] + 1, _time_share_above_sp1(r)) for r in records
                  if any(k.startswith(TIME_SHARE) for k in r)]
    if series("sp/cr"):
        twin = ax.twinx()
        twin.plot(*zip(*series("sp/cr")), lw=1, color="tab:blue", label="live CR (run so far)")
        if time_at_sp:
            twin.plot(*zip(*time_at_sp), ".", ms=3, color="tab:cyan", label="step's compute time at SP > 1")
            twin.legend(fontsize=8, loc="lower right")
        twin.set_ylabel("share through SP: tokens (live CR), step time", color="tab:blue")
    ax.set_title("memory and communication")
    for ax in axes.flat:
        ax.set_xlabel("step")
    fig.suptitle(f"{run_dir}: {len(records)} steps")
    fig.tight_layout()
    try:
        write_output("--out", str(out), lambda path: fig.savefig(path, dpi=100))
    finally:
        plt.close(fig)
    return out
