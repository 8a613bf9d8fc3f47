"""Watching a training run started as a subprocess: how many steps its metrics.jsonl holds, and waiting for a step
while the processes live (the chaos and launch tests stop or kill a run at a chosen step)."""

from __future__ import annotations

import time
from pathlib import Path


def steps_logged(out: Path) -> int:
    """Complete lines of OUT/metrics.jsonl (one per optimizer step); 0 before the file exists."""
    try:
        return sum(1 for line in (out / "metrics.jsonl").read_text().splitlines() if line.endswith("}"))
    except FileNotFoundError:
        return 0


def wait_for_step(procs: list, out: Path, step: int, timeout: float = 240) -> None:
    """Return once ``step`` steps are logged; fail with a process's output if one ends first, or at ``timeout``."""
    deadline = time.time() + timeout
    while steps_logged(out) < step:
        for proc in procs:
            assert proc.poll() is None, proc.communicate()
        assert time.time() < deadline, "the run did not reach the step in time"
        time.sleep(0.02)
