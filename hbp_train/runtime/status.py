"""``RUN_DIR/status.json``: where a run stands, in a small file a scheduler or a script can read.

    {"state": "running", "step": 12, "total": 100, "elapsed_s": 61.2, "eta_s": 448.0,
     "eta_at": "2026-11-30T14:05:11+0000", "last_checkpoint": "runs/x/checkpoints/step_00000010",
     "last_checkpoint_step": 10, "message": null, "run_id": "9f2c...", "host": "node0", "pid": 4242,
     "started_at": "...", "updated_at": "..."}

``state``: ``running`` (building, training or saving), ``finished`` (every step run, the final checkpoint saved),
``preempted`` (stopped early by a signal, a second Ctrl-C or train.exit_after_steps: resume with
``train.resume=auto`` from ``last_checkpoint``), ``failed`` (``message`` is the error line, naming the rank when
the failure was another rank's). ``step`` counts the steps done; ``eta_s`` is the mean step time of this invocation
over the steps left (as the log line's ETA). A ``running`` file whose ``updated_at`` stops moving belongs to a run
that died without a word (kill -9, a lost node).

Rank 0 rewrites it after every step with an atomic replace (a temporary file renamed over it: a reader sees the
previous or the new file, never half of one; a few hundred bytes, not fsynced, so cheap at every step). It is
written only once the run owns the folder (after its lock and the check that the folder holds no other run's
checkpoints), so a refused run never overwrites another run's status. A rank other than 0 that fails writes
``failed`` with its own line into the file of the same run (``run_id``), unless a failure is there already: the
first failure is the one that explains the others. Writing it never stops a run: an error is ignored.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Optional

from hbp_train.common.errors import UserError
from hbp_train.common.outputs import atomic_write

STATUS = "status.json"
STATES = ("running", "finished", "preempted", "failed")


def _now(at: Optional[float] = None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(time.time() if at is None else at))


def read(run_dir: str) -> Optional[dict]:
    """The run folder's status record, or None when there is none (or it cannot be read)."""
    try:
        with open(os.path.join(run_dir, STATUS)) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


class RunStatus:
    """The status file of one run, as rank ``rank`` writes it (``run_id``: the same on every rank)."""

    def __init__(self, run_dir: str, rank: int, run_id: str):
        self.path = os.path.join(run_dir, STATUS)
        self.rank = rank
        self.record = {"state": "running", "step": 0, "total": None, "elapsed_s": 0.0, "eta_s": None, "eta_at": None,
                       "last_checkpoint": None, "last_checkpoint_step": None, "message": None, "run_id": run_id,
                       "host": socket.gethostname(), "pid": os.getpid(), "started_at": _now(), "updated_at": None}
        self.started = False

    def start(self, step: int, total: Optional[int], last_checkpoint: Optional[str] = None) -> None:
        """The run owns its folder and will train from ``step`` of ``total`` (None while the run is being built;
        ``last_checkpoint``: the one it resumes from). Rank 0 writes from now on."""
        self.started = self.rank == 0
        self.record.update(state="running", message=None, step=step, total=total)
        if last_checkpoint is not None:
            self.record.update(last_checkpoint=last_checkpoint, last_checkpoint_step=step)
        self._write()

    def step(self, step: int, total: int, elapsed_s: float, eta_s: Optional[float]) -> None:
        """``step`` steps done of ``total``."""
        self.record.update(step=step, total=total, elapsed_s=round(elapsed_s, 3),
                           eta_s=None if eta_s is None else round(eta_s, 3),
                           eta_at=None if eta_s is None else _now(time.time() + eta_s))
        self._write()

    def saved(self, tag_dir: str, step: int) -> None:
        """A checkpoint of ``step`` steps is published at ``tag_dir``."""
        self.record.update(last_checkpoint=tag_dir, last_checkpoint_step=step)
        self._write()

    def end(self, state: str, message: Optional[str] = None) -> None:
        """The run ends in ``state`` (one of STATES; ``message``: the error line of a failure). On a rank other than
        0 only a failure is written, into the file of this run, and only when none is there yet."""
        assert state in STATES
        if self.rank != 0:
            if state != "failed":
                return
            current = read(os.path.dirname(self.path))
            if current is None or current.get("run_id") != self.record["run_id"] or current.get("state") == "failed":
                return
            self.record = current
            self.started = True
        elif self.started and state == "failed" and (read(os.path.dirname(self.path)) or {}).get("state") == "failed":
            return  # another rank's failure came first: it explains this one
        self.record.update(state=state, message=message, eta_s=None if state != "running" else self.record["eta_s"],
                           eta_at=None if state != "running" else self.record["eta_at"])
        self._write()

    def _write(self) -> None:
        if not self.started:
            return
        self.record["updated_at"] = _now()
        text = json.dumps(self.record, indent=1) + "\n"
        try:
            atomic_write(self.path, lambda tmp: _write_text(tmp, text))
        except OSError:
            pass  # a status file is for the operator: a full disk is reported by the save, not here


def ended_by(exc: BaseException, rank: int) -> tuple:
    """(state, message) of a run ended by ``exc``: the line the user sees, naming the rank and its host."""
    who = f"rank {rank} ({socket.gethostname()})"
    if isinstance(exc, KeyboardInterrupt):
        return "preempted", f"{who}: interrupted (a second Ctrl-C): stopped without saving"
    if isinstance(exc, SystemExit):
        return "preempted", f"{who}: stopped by a signal outside the training steps"
    first = (str(exc).strip().splitlines() or [""])[0]
    if isinstance(exc, (UserError, FloatingPointError)):
        return "failed", f"{who}: error: {first}"
    return "failed", f"{who}: {type(exc).__name__}: {first}"


def _write_text(path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
