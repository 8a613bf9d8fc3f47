"""The run-folder lock: one live training run per ``train.out_dir``.

Two runs writing into one folder interleave their checkpoints and overwrite each other's metrics.jsonl; it happens
for real when a scheduler requeues a job whose first incarnation is still alive. Rank 0 creates
``RUN_DIR/run.lock`` with ``O_CREAT | O_EXCL`` (atomic, also on NFS v3+) before anything is built, holding the
holder's host, pid, process start time and a token, and a daemon thread refreshes its modification time every
``HEARTBEAT_S`` seconds. Every rank gets rank 0's answer (a broadcast), so a refusal is the same one line everywhere.

A lock left by a run that died without releasing it (kill -9, a node failure) is stale and taken over with a
one-line warning when
  - it was taken on this host and its pid is gone, or now belongs to another process (another start time), or
  - it was taken on another host and its heartbeat is older than ``STALE_AFTER_S`` (that host's pid cannot be
    checked from here).
Anything else is a live run: refused, naming its host, pid and start time, and what to do.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from typing import Optional

import torch.distributed as dist

from hbp_train.common.errors import UserError

LOCK_NAME = "run.lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 600.0  # 20 missed heartbeats: a live run's thread refreshes the lock long before this
EMPTY_GRACE_S = 5.0  # an empty lock file younger than this is a run still writing its record


def process_start(pid: int) -> Optional[str]:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), which tells a reused pid
    apart; None where /proc is not there (then only the pid is compared)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()[19]  # fields after "(comm)" start at field 3


def pid_alive(pid: int, start: Optional[str]) -> bool:
    """Whether ``pid`` runs on this host and is the same process (same start time when both are known)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        pass
    now = process_start(pid)
    return start is None or now is None or now == start


class RunLock:
    """RUN_DIR/run.lock held by this process; ``acquire`` raises UserError when a live run holds it."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, LOCK_NAME)
        self.token = secrets.token_hex(8)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def record(self) -> dict:
        pid = os.getpid()
        return {"host": socket.gethostname(), "pid": pid, "process_start": process_start(pid),
                "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "token": self.token}

    def acquire(self) -> Optional[str]:
        """Take the lock; returns a warning line when a stale lock was taken over, else None."""
        if os.path.exists(self.run_dir) and not os.path.isdir(self.run_dir):
            raise UserError(f"train.out_dir={self.run_dir}: is a file, not a folder; choose another train.out_dir")
        try:
            os.makedirs(self.run_dir, exist_ok=True)
        except OSError as exc:
            raise UserError(f"train.out_dir={self.run_dir}: cannot create it ({exc.strerror})") from None
        warning = None
        for _ in range(3):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder, why = self._stale_reason()
                if why is None:
                    raise UserError(f"train.out_dir={self.run_dir} is in use by another run ({_describe(holder)}): "
                                    "wait for it to end or stop it, or choose another train.out_dir (if no run "
                                    f"uses it, delete {self.path})") from None
                aside = f"{self.path}.stale-{os.getpid()}"
                try:
                    os.replace(self.path, aside)
                    os.remove(aside)
                except FileNotFoundError:
                    pass  # another contender took it over first; try again
                warning = f"[train] warning: took over the stale lock {self.path} ({_describe(holder)}: {why})"
                continue
            except OSError as exc:
                raise UserError(f"train.out_dir={self.run_dir}: cannot create {LOCK_NAME} ({exc.strerror})") \
                    from None
            with os.fdopen(fd, "w") as f:
                json.dump(self.record(), f)
            self._thread = threading.Thread(target=self._heartbeat, name="run-lock-heartbeat", daemon=True)
            self._thread.start()
            return warning
        raise UserError(f"train.out_dir={self.run_dir}: could not take {self.path} (another run is starting there?)")

    def _stale_reason(self) -> tuple:
        """(the holder's record, why its lock is stale) or (record, None) for a live holder."""
        try:
            with open(self.path) as f:
                text = f.read()
            age = time.time() - os.path.getmtime(self.path)
        except FileNotFoundError:
            return {}, "released meanwhile"
        try:
            holder = json.loads(text)
        except ValueError:
            holder = None
        if not isinstance(holder, dict):
            return ({}, None) if age < EMPTY_GRACE_S else ({}, "its record is empty or unreadable")
        if holder.get("host") == socket.gethostname():
            if not isinstance(holder.get("pid"), int) or not pid_alive(holder["pid"], holder.get("process_start")):
                return holder, "that process is gone"
            return holder, None
        if age > STALE_AFTER_S:
            return holder, f"no heartbeat for {age:.0f} s"
        return holder, None

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except OSError:
                return

    def release(self) -> None:
        """Stop the heartbeat and delete the lock if it is still ours."""
        self._stop.set()
        try:
            with open(self.path) as f:
                ours = json.load(f).get("token") == self.token
        except (OSError, ValueError, AttributeError):
            return
        if ours:
            try:
                os.remove(self.path)
            except FileNotFoundError:
                pass


def _describe(holder: dict) -> str:
    if not holder:
        return "holder unknown"
    return f"host {holder.get('host')}, pid {holder.get('pid')}, started {holder.get('started_at')}"


def lock_run_dir(run_dir: str, warn=print) -> Optional[RunLock]:
    """Rank 0 takes the lock; every rank gets its answer (collective under torch.distributed). Returns the lock on
    rank 0 (None elsewhere); raises the same one-line UserError on every rank when the folder is in use."""
    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    lock, answer = None, [None]
    if rank == 0:
        lock = RunLock(run_dir)
        try:
            warning = lock.acquire()
            if warning:
                warn(warning)
        except UserError as exc:
            lock, answer[0] = None, str(exc)
    if distributed:
        dist.broadcast_object_list(answer, src=0)
    if answer[0] is not None:
        raise UserError(answer[0])
    return lock
