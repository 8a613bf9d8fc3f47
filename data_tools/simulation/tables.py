"""The simulator's printed tables: durations in the unit that shows them, fixed-width text tables, and the
communication columns shown when ZeRO's collectives are modelled."""

from __future__ import annotations


def format_seconds(seconds: float) -> str:
    """A duration with 3 significant digits in the unit that shows it: µs, ms, s, min or h (a tiny model's step
    is microseconds, an 8B model's run hours: one fixed unit would print 0.000 for one of them)."""
    if seconds == 0:
        return "0 s"
    for unit, scale, below in (("µs", 1e-6, 1e-3), ("ms", 1e-3, 1.0), ("s", 1.0, 120.0), ("min", 60.0, 7200.0)):
        if abs(seconds) < below:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 3600:.3g} h"


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A fixed-width text table; columns are (key, header, format), format "time" for seconds (format_seconds)."""
    def cell(value, f):
        if value is None:
            return "-"
        return format_seconds(value) if f == "time" else format(value, f)

    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append([cell(r.get(k), f) for k, _, f in columns])
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c[i].rjust(widths[i]) if i else c[i].ljust(widths[i]) for i in range(len(columns)))
             for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def comm_columns(config) -> list[tuple[str, str, str]]:
    """Table columns for the communication model: none when it is not modelled."""
    if config.zero_stage is None:
        return []
    return [("zero_stage", "ZeRO", "d"), ("comm_seconds_per_step", "comm/step", "time"),
            ("optimizer_seconds_per_step", "opt/step", "time")]
