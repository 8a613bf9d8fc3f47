"""hbp_train.launch: torchrun whose worker failure ends in one line and the worker's exit code, no traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hbp_train.launch import failure_line

REPO = Path(__file__).resolve().parents[1]
ENV = {"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"}


def test_failure_line_names_rank_and_code_or_signal():
    assert "rank 3 stopped first, with exit code 2" in failure_line("hbp_train.train", 3, 2)
    assert "with signal 9" in failure_line("hbp_train.train", 0, -9)


def test_failed_worker_gives_its_exit_code_and_one_line_without_traceback():
    worker = 'echo "error: data.shards=x: no plan.json there" >&2; exit 3'
    proc = subprocess.run([sys.executable, "-m", "hbp_train.launch", "--standalone", "--nproc_per_node", "2",
                           "--no-python", "sh", "-c", worker], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=ENV)
    assert proc.returncode == 3
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr
    assert "error: data.shards=x: no plan.json there" in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("[launch] sh failed: rank ") and "exit code 3" in last


def test_successful_workers_exit_zero():
    proc = subprocess.run([sys.executable, "-m", "hbp_train.launch", "--standalone", "--nproc_per_node", "2",
                           "--no-python", "true"], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=ENV)
    assert proc.returncode == 0, proc.stderr
