"""The GPU acceptance report: every figure beside its target and a verdict, as JSON and markdown."""

from __future__ import annotations

import json
from pathlib import Path

TARGETS = {  # name -> (description, comparison, value)
    "tokens_per_s_ratio": ("ours / faster HF path tokens/s (16K packs)", ">=", 1.2),
    "tokens_per_s_ratio_64k": ("ours / faster HF path tokens/s (64K packs, all layers checkpointed)", ">=", 1.5),
    "auto_backend_fastest": ("attention_backend=auto chose the fastest backend measured here (its time / the "
                             "fastest's)", "<=", 1.05),
    "loss_share": ("LM head + loss, share of our step (profile; no target until a first GPU profile sets "
                   "today's)", "<=", None),
    "mfu": ("ours MFU (1B shape, 16K packs, bf16)", ">=", 0.45),
    "longest_pack": ("longest pack, 1B shape on 80 GB", ">=", 131072),
    "cost_model_error": ("cost model: largest error on measured packs", "<=", 0.10),
    "memory_model_error": ("memory model: largest error vs measured peaks", "<=", 0.10),
    "profiler_s": ("profiler wall time, s", "<=", 300.0),
    "backend_loss_rel_error": ("backend loss vs reference, relative error", "<=", None),  # set per dtype
    "backend_grad_cosine": ("backend grads vs reference, lowest cosine over parameters", ">=", None),
}


def verdict(name: str, value, dry_run: bool, target=None):
    """{"value", "target", "met"}: met is None (n/a) on a dry run or without a value."""
    desc, op, default = TARGETS[name]
    target = default if target is None else target
    met = None if (dry_run or value is None or target is None) else (value >= target if op == ">=" else value <= target)
    return {"what": desc, "value": value, "target": f"{op} {target}" if target is not None else "(none yet)",
            "met": met}


def all_verdicts(report: dict) -> list[tuple[str, dict]]:
    """(label, verdict) for every judged figure of the report, in check order; a skipped check is one row."""
    found = []
    for name, result in report["checks"].items():
        result = result or {}
        if result.get("budget_skipped") or result.get("skipped_check"):
            why = result.get("budget_skipped") or result["skipped_check"]
            found.append((name, {"what": "skipped: " + why, "value": None, "target": "", "met": "skipped"}))
            continue
        if result.get("over_budget"):  # its figures below are what it measured before it was stopped
            found.append((name, {"what": result["over_budget"] + "; what it measured before is kept", "value": None,
                                 "target": "", "met": "stopped"}))
        if "verdict" in result:
            found.append((name, result["verdict"]))
        for key, v in (result.get("verdicts") or {}).items():
            found.append((f"{name}/{key}", v))
        for backend, row in (result.get("backends") or {}).items():
            if "error" in row:  # a backend installed here that failed: the finding, in the table
                found.append((f"{name}/{backend}", {"what": f"failed: {row['error'][:200]}", "value": None,
                                                    "target": "", "met": None if report["dry_run"] else False}))
            for key, v in (row.get("verdicts") or {}).items():
                found.append((f"{name}/{backend}/{key}", v))
    return found


def to_markdown(report: dict) -> str:
    met = {True: "met", False: "**NOT met**", None: "n/a", "skipped": "**skipped**", "stopped": "**stopped**"}
    lines = [f"# GPU acceptance report", "", f"{report['started']} on {report['device']}"
             f"{' (dry run: the figures mean nothing, no verdicts)' if report['dry_run'] else ''}", "",
             f"Budget {report['budget_s']:.0f} s, used {report.get('elapsed_s', 0):.0f} s.", "",
             "| check | figure | value | target | verdict |", "|---|---|---|---|---|"]
    for label, v in all_verdicts(report):
        value = v["value"]
        shown = "n/a" if value is None else (f"{value:.4g}" if isinstance(value, float) else str(value))
        lines.append(f"| {label} | {v['what']} | {shown} | {v['target']} | {met[v['met']]} |")
    lines.append("")
    for name in ("trainer", "trainer_64k"):
        paths = (report["checks"].get(name) or {}).get("paths")
        if paths:
            lines += [f"{name}: the paths compared (tokens/s; the target is judged against the faster HF path)", "",
                      "| path | what | attention | tokens/s | MFU | peak GiB |", "|---|---|---|---|---|---|"]
            for key, r in paths.items():
                what = r.get("label") or ""
                attention = r.get("attention_kernel") or r.get("attention") or ""
                if r.get("decoder_kernels"):
                    attention += f"; decoder kernels: {r['decoder_kernels']}"
                cells = ["n/a" if r.get(f) is None else f"{r[f]:.4g}" for f in ("tokens_per_s", "mfu", "peak_mem_gib")]
                if r.get("error"):
                    cells = [f"did not run: {r['error']}", "", ""]
                lines.append(f"| {key} | {what} | {attention} | " + " | ".join(cells) + " |")
            lines.append("")
    profile = report["checks"].get("step_profile") or {}
    if profile.get("markdown"):
        lines += [profile["markdown"]]
    budgets = {row["check"]: row["budget_s"] for row in report.get("plan", [])}
    for name, result in report["checks"].items():
        if "error" in result:
            lines.append(f"- **{name} failed**: {result['error']}")
        elif "seconds" in result and not result.get("budget_skipped"):
            held = f" of its {budgets[name]:.0f} s" if name in budgets else ""
            lines.append(f"- {name}: {result['seconds']:.0f} s{held}")
        for skipped in result.get("skipped") or []:
            lines.append(f"- {name} skipped {skipped}")
    lines += ["", "Details: acceptance.json. What to do when a check fails: docs/gpu.md.", ""]
    return "\n".join(lines)


def write(report: dict, out: Path) -> None:
    """Both files, each written whole or not at all (a check stopped from outside can land in a write)."""
    from hbp_train.common.outputs import atomic_write

    text, markdown = json.dumps(report, indent=1, default=str) + "\n", to_markdown(report)
    atomic_write(out / "acceptance.json", lambda tmp: tmp.write_text(text))
    atomic_write(out / "acceptance.md", lambda tmp: tmp.write_text(markdown))
