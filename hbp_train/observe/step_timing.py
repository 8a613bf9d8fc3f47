"""What one rank's step time is made of: its own compute, its waits inside DeepSpeed's collectives, and its
tokens and compute seconds at each SP degree of a step that mixes packing groups.

The trainer (hbp_train/trainer.py) times every step with these; hbp_train/observe/telemetry.py turns the gathered values
into the live balance figures (``balance/…``, ``time/compute_s/…``) and the SP shares (``sp/…``).
"""

from __future__ import annotations

import functools
import time
from contextlib import contextmanager
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:  # annotations only
    from hbp_train.observe.telemetry import LoggingConfig


# DeepSpeed's collectives (deepspeed.comm) that ZeRO's gradient reduction and parameter gathers call.
DS_COLLECTIVES = ("all_reduce", "reduce", "reduce_scatter_fn", "reduce_scatter_tensor", "reduce_scatter",
                  "all_gather_into_tensor", "allgather_fn", "all_gather", "all_reduce_coalesced", "broadcast")


def comm_wait_mode(cfg: Optional[LoggingConfig], step: int, on_gpu: bool, world_size: int) -> str:
    """How step ``step`` times each rank's compute: "exclude" (wrap the collectives with comm_wait_timer and leave
    their waits out), "include" (no wrapping, the waits count as compute: logging.exclude_comm_wait=false, or a
    single rank, which waits for nobody), or "skip" (a GPU step between two timed ones: no wrapping, no sync,
    per-rank compute times not reported)."""
    if cfg is None or not cfg.exclude_comm_wait or world_size == 1:
        return "include"
    if not on_gpu or step % cfg.comm_wait_every == 0:
        return "exclude"
    return "skip"


@contextmanager
def comm_wait_timer(enabled: bool = True):
    """Within it, seconds spent inside DeepSpeed's collectives add up in the yielded one-item list.

    ZeRO reduces gradients inside ``engine.backward`` (its hooks), so a rank that finished its own work early waits
    there for the slowest; timing the step minus this wait is the rank's own compute. Each collective is timed on
    the host between two device syncs (the first lets this rank's queued compute finish, so that is not counted as
    waiting); an async collective is waited for inside the timing. DeepSpeed's ZeRO code calls the functions
    through the ``deepspeed.comm`` module, which is what is wrapped, for the context's duration only."""
    total = [0.0]
    if not enabled:
        yield total
        return
    import deepspeed.comm as ds_comm

    def sync():
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def timed(fn):
        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            sync()
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            if kwargs.get("async_op") and hasattr(out, "wait"):
                out.wait()
            sync()
            total[0] += time.perf_counter() - start
            return out
        return wrapper

    originals = {name: getattr(ds_comm, name) for name in DS_COLLECTIVES if hasattr(ds_comm, name)}
    try:
        for name, fn in originals.items():
            setattr(ds_comm, name, timed(fn))
        yield total
    finally:
        for name, fn in originals.items():
            setattr(ds_comm, name, fn)


def sp_mix_columns(degrees) -> list[str]:
    """The per-step all-gather's columns that split a step by SP degree: this rank's tokens at each degree, then its
    compute seconds at each (SPMixTimer.values, in the same order)."""
    return [f"tokens_sp{d}" for d in degrees] + [f"compute_time_sp{d}" for d in degrees]


class SPMixTimer:
    """This rank's tokens and compute seconds at each SP degree within one step.

    ``switch(sp)`` where the micro-batches change degree (a no-op when it stays the same) and ``stop()`` after the
    last one; each marks the time after a device sync, so queued device work counts at the degree that ran it.
    ``waited()`` returns the seconds spent so far inside collectives (comm_wait_timer): a degree's time leaves its
    waits out, as the step's compute time does."""

    def __init__(self, waited=lambda: 0.0):
        self.waited = waited
        self.tokens: dict = {}
        self.seconds: dict = {}
        self._sp = None
        self._since = (0.0, 0.0)  # (time, waited) when the current degree began

    def switch(self, sp) -> None:
        if sp == self._sp:
            return
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now, waited = time.perf_counter(), self.waited()
        if self._sp is not None:
            spent = (now - self._since[0]) - (waited - self._since[1])
            self.seconds[self._sp] = self.seconds.get(self._sp, 0.0) + spent
        self._sp, self._since = sp, (now, waited)

    def stop(self) -> None:
        self.switch(None)

    def add_tokens(self, sp: int, num_tokens: float) -> None:
        self.tokens[sp] = self.tokens.get(sp, 0.0) + num_tokens

    def values(self, degrees) -> list:
        """This rank's values for sp_mix_columns(degrees)."""
        return [self.tokens.get(d, 0.0) for d in degrees] + [self.seconds.get(d, 0.0) for d in degrees]
