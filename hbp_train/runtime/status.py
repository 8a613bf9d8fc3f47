"""``RUN_DIR/status.json``: where a run stands, in a small file a scheduler or a script can read.

    {"state": "running", "step": 12, "total": 100, "elapsed_s": 61.2, "eta_s": 448.0,
     "eta_at": "2026-11-30T14:05:11+0000", "last_checkpoint": "runs/x/checkpoints/step_00000010",
     "last_checkpoint_step": 10, "message": null, "run_id": "9f2c...", "launch_id": "51e0...", "host": "node0",
     "pid": 4242, "started_at": "...", "updated_at": "..."}

``state``: ``running`` (building, training or saving), ``finished`` (every step run, the final checkpoint saved),
``preempted`` (stopped early by a signal, a second Ctrl-C or train.exit_after_steps: resume with
``train.resume=auto`` from ``last_checkpoint``), ``failed`` (``message`` is the error line, naming the rank when
the failure was another rank's). ``message`` is the run's last line for every ending (``finished: steps 0..12 of 12,
...``). ``launch_id`` names the launcher that started the workers (hbp_train.launch, HBP_LAUNCH_ID): once every
worker has stopped it rewrites the ending with what only it knows (a silent node, a signal, a save its shutdown
timeout cut short) and prints the same line (``conclude``; runtime/run_end.py). ``step`` counts the steps done;
``eta_s`` is the mean step time of this invocation over the steps left (as the log line's ETA). A ``running`` file
whose ``updated_at`` stops moving belongs to a run that died without a word (kill -9, a lost node).

Rank 0 rewrites it after every step with an atomic replace (a temporary file renamed over it: a reader sees the
previous or the new file, never half of one; a few hundred bytes, not fsynced, so cheap at every step). It is
written only once the run owns the folder (after its lock and the check that the folder holds no other run's
checkpoints), so a refused run never overwrites another run's status. A rank other than 0 that fails writes
``failed`` with its own line into the file of the same run (``run_id``), unless a failure is there already: the
first failure is the one that explains the others. Writing it never stops a run: an error is ignored. On a full
disk, where the temporary file cannot be made, the file is rewritten in place (its block is already allocated), so
that a save that failed for want of space is still reported as ``failed``.
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
                       "launch_id": os.environ.get("HBP_LAUNCH_ID") or None, "host": socket.gethostname(),
                       "pid": os.getpid(), "started_at": _now(), "updated_at": None}
        self.started = False

    def start(self, step: int, total: Optional[int], last_checkpoint: Optional[str] = None) -> None:
        """The run owns its folder and will train from ``step`` of ``total`` (None while the run is being built;
        ``last_checkpoint``: the one it resumes from). Rank 0 writes from now on."""
        if self.rank == 0 and not self.started and os.environ.get("HBP_LAUNCH_RECORD"):
            _tell_launcher(os.environ["HBP_LAUNCH_RECORD"], os.path.dirname(self.path))
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
        write(os.path.dirname(self.path), self.record)


def write(run_dir: str, record: dict) -> None:
    """Replace RUN_DIR/status.json with ``record``: atomically (a temporary file renamed over it), or, when the
    temporary file cannot be written (a full disk, a quota), by rewriting the existing file in place. Errors are
    ignored: the status file is for the operator, a full disk is reported by the save."""
    path = os.path.join(run_dir, STATUS)
    text = json.dumps(record, indent=1) + "\n"
    try:
        atomic_write(path, lambda tmp: _write_text(tmp, text))
    except OSError:
        try:
            fd = os.open(path, os.O_WRONLY)
        except OSError:
            return
        try:
            os.pwrite(fd, text.encode(), 0)
            os.ftruncate(fd, len(text.encode()))
        except OSError:
            pass
        finally:
            os.close(fd)


def conclude(run_dir: str, launch_id: Optional[str], state: str, message: str,
             last_checkpoint: Optional[str] = None) -> bool:
    """The launcher's ending of the run it started (``launch_id``): ``state`` and ``message`` (its last line) and
    the checkpoint to resume from (None: leave the record's), written into status.json when the file belongs to
    that launch (a second run refused at the folder's lock must not overwrite the live run's file). Returns whether
    it was written."""
    assert state in STATES
    record = read(run_dir)
    if record is None or not launch_id or record.get("launch_id") != launch_id:
        return False
    record.update(state=state, message=message, eta_s=None, eta_at=None, updated_at=_now())
    if last_checkpoint is not None:
        tag = os.path.basename(os.path.normpath(last_checkpoint))
        record.update(last_checkpoint=last_checkpoint,
                      last_checkpoint_step=int(tag.split("_")[-1]) if tag.split("_")[-1].isdigit() else None)
    write(run_dir, record)
    return True


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


def _tell_launcher(path: str, run_dir: str) -> None:
    """Tell hbp_train.launch (HBP_LAUNCH_RECORD, a file of its own) which run folder this run writes: it reads this
    status.json when the workers have stopped (runtime/run_end.py)."""
    try:
        with open(path, "w") as f:
            f.write(run_dir)
    except OSError:
        pass  # the launcher then reads the folder from the overrides


def _write_text(path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
