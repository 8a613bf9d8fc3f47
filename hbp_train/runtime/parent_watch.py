"""Workers notice when their launcher dies: a watchdog thread that turns the launcher's death into SIGTERM.

torchrun starts each worker in its own session, so when the launcher is killed with SIGKILL (an OOM killer, a
scheduler's hard kill) nothing reaches the workers: they would train on as orphans and keep their GPUs. A daemon
thread polls the parent pid every ``POLL_S`` seconds; when the worker has been re-parented (the launcher is gone)
it sends SIGTERM to its own process. The training loop's StopSignal then does what a scheduler's SIGTERM does:
finish the step (every rank notices within one poll and they agree through the step's all-gather), save a
checkpoint, exit. A polling thread rather than prctl(PR_SET_PDEATHSIG): the death signal fires when the *thread*
that forked the worker ends, which in a multi-threaded launcher need not be the launcher's end, and it is Linux-only.
"""

from __future__ import annotations

import os
import signal
import threading

POLL_S = 1.0


def under_launcher() -> bool:
    """Whether this process was started by torchrun / hbp_train.launch (or the deepspeed launcher)."""
    return "TORCHELASTIC_RUN_ID" in os.environ or os.environ.get("HBP_LAUNCHER") == "1" or \
        "LOCAL_RANK" in os.environ and "RANK" in os.environ


def watch_parent(poll_s: float = POLL_S, signum: int = signal.SIGTERM) -> threading.Event:
    """Start the watchdog; returns an Event that stops it. Sends ``signum`` to this process once, when the parent
    pid changes (the parent died and init or a subreaper adopted this process)."""
    parent = os.getppid()
    stop = threading.Event()

    def poll():
        while not stop.wait(poll_s):
            if os.getppid() != parent:
                print(f"[train] the launcher (pid {parent}) is gone: finishing the step, saving a checkpoint and "
                      "exiting", flush=True)
                os.kill(os.getpid(), signum)
                return

    if parent > 1:
        threading.Thread(target=poll, name="parent-watch", daemon=True).start()
    return stop
