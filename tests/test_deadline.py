"""bench/trainer/deadline.py: the hard limit the GPU benches hold their checks and paths to (SIGALRM in the main
thread): a run past its seconds is stopped and reported, nested limits stop what they should, and a bench's
``except Exception`` around a path cannot swallow the stop."""

from __future__ import annotations

import time

from bench.trainer.deadline import Deadline, run_limited


def _spin(seconds: float) -> str:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    return "done"


def test_a_run_within_its_seconds_returns_its_result_and_one_past_them_is_stopped():
    assert run_limited(lambda: _spin(0.01), 5, "quick") == ("done", None)
    t0 = time.monotonic()
    assert run_limited(lambda: _spin(5), 0.2, "slow") == (None, "slow: stopped after its 0.2 s")
    assert time.monotonic() - t0 < 1
    assert run_limited(lambda: time.sleep(5), 0.2, "asleep")[1] == "asleep: stopped after its 0.2 s"


def test_a_path_that_catches_exceptions_is_still_stopped():
    def careful():
        try:
            _spin(5)
        except Exception:  # noqa: BLE001 - what a bench does around one path
            return "swallowed"
        return "ran out"

    assert run_limited(careful, 0.2, "path") == (None, "path: stopped after its 0.2 s")


def test_nested_limits_stop_what_expired():
    inner_first = run_limited(lambda: run_limited(lambda: _spin(5), 0.2, "inner"), 5, "outer")
    assert inner_first == ((None, "inner: stopped after its 0.2 s"), None)
    t0 = time.monotonic()
    outer_first = run_limited(lambda: (run_limited(lambda: _spin(5), 5, "inner"), "after")[1], 0.2, "outer")
    assert outer_first == (None, "outer: stopped after its 0.2 s") and time.monotonic() - t0 < 1
    assert run_limited(lambda: _spin(0.3), 1, "disarmed") == ("done", None)  # no timer left behind


def test_a_deadline_says_what_is_left():
    assert Deadline(None).left() == float("inf")
    assert 9 < Deadline(10).left() <= 10 and Deadline(0.0).left() <= 0
