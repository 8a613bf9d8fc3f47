"""Time budgets the GPU benches are held to: a deadline to plan against, and a hard limit that stops what runs past
its seconds.

A bench plans with a ``Deadline`` (a path or a step starts only when its time is left) and runs what it cannot
plan, a kernel's first compile above all, under ``run_limited``: past its seconds an ``OverBudget`` is raised in the
running code (SIGALRM, so in the main thread of a Unix process; elsewhere nothing is stopped and only the plan
holds), the code's ``finally`` blocks free what it held, and ``run_limited`` returns what stopped it. Limits nest:
the soonest deadline is the one armed, and a limit that expires inside an inner one stops both.

The exception is a BaseException so that the benches' ``except Exception`` around a path (a path that fails is
reported and the next one runs) does not swallow it: only the code that set the limit catches it.
"""

from __future__ import annotations

import math
import signal
import threading
import time
from dataclasses import dataclass, field


@dataclass
class Deadline:
    """A point in time (``time.monotonic``) to plan against; None seconds: no deadline."""

    seconds: float | None
    start: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        """Seconds left (inf without a deadline; negative once past it)."""
        return math.inf if self.seconds is None else self.start + self.seconds - time.monotonic()


class OverBudget(BaseException):
    """Raised in the running code when a ``run_limited`` limit's seconds are over."""

    def __init__(self, limit: "_Limit"):
        self.limit = limit
        super().__init__(f"{limit.what}: stopped after its {limit.seconds:.3g} s")


@dataclass(eq=False)
class _Limit:
    what: str
    seconds: float
    end: float
    active: bool = True


_active: list[_Limit] = []  # the limits set, outermost first
_previous_handler: list = []  # SIGALRM's handler before the outermost limit


def _usable() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


def _arm() -> None:
    """Point the timer at the soonest active limit (or disarm it)."""
    live = [limit for limit in _active if limit.active]
    if not live:
        signal.setitimer(signal.ITIMER_REAL, 0)
        return
    soonest = min(live, key=lambda limit: limit.end)
    signal.setitimer(signal.ITIMER_REAL, max(soonest.end - time.monotonic(), 1e-3))


def _on_alarm(signum, frame) -> None:
    due = [limit for limit in _active if limit.active and limit.end <= time.monotonic() + 1e-3]
    if not due:  # early (timer resolution) or every limit already left: re-arm
        _arm()
        return
    expired = min(due, key=lambda limit: limit.end)
    for limit in _active[_active.index(expired):]:  # it and every limit set inside it stop
        limit.active = False
    raise OverBudget(expired)


def run_limited(fn, seconds: float | None, what: str):
    """(fn(), None), or (None, a one-line reason) when fn ran past ``seconds`` (None: no limit). An outer limit that
    expires while fn runs is raised on to its own caller."""
    if seconds is None or math.isinf(seconds) or not _usable():
        return fn(), None
    limit = _Limit(what, float(seconds), time.monotonic() + max(float(seconds), 0.0))
    if not _active:
        _previous_handler[:] = [signal.signal(signal.SIGALRM, _on_alarm)]
    _active.append(limit)
    try:
        _arm()
        return fn(), None
    except OverBudget as exc:
        if exc.limit is not limit:
            raise
        return None, str(exc)
    finally:
        limit.active = False
        _active.remove(limit)
        _arm()
        if not _active:
            signal.signal(signal.SIGALRM, _previous_handler.pop() if _previous_handler else signal.SIG_DFL)
