"""What an operator and a scheduler read while a run goes on: RUN_DIR/status.json (hbp_train/runtime/status.py) and
the rank-0 lines when the output is not a terminal (hbp_train/observe/telemetry.py). The whole flow with the real
engine (status.json after every step, a failed save) is in tests/test_save_faults.py."""

from __future__ import annotations

import io
import json
import os
import socket

import pytest
import torch

from hbp_train.common.errors import UserError
from hbp_train.observe.telemetry import LoggingConfig, MetricsLogger, clock
from hbp_train.runtime import status
from hbp_train.trainer import STAT_COLUMNS


def _row(**values) -> list:
    base = dict(compute_time=1.0, loss_sum=8.0, loss_tokens=4, tokens=10, flops=1e9, nonfinite=0, stop=0,
                peak_mem_gib=0.5, booked_tokens=0, sp_tokens=0, aux_sum=0, grad_norm=1.0)
    base.update(values)
    return [base[c] for c in STAT_COLUMNS]


def _log_steps(logger, steps, total) -> None:
    for step in steps:
        logger.log(logger.step_metrics(step=step, total_steps=total, gathered=torch.tensor([_row()], dtype=torch.float64),
                                       columns=STAT_COLUMNS, lr=0.1, grad_norm=1.0, step_time=1.0, data_time=0.0,
                                       group=0, sp=1, num_micro_batches=1, plan_metrics={}, skipped=False,
                                       num_skipped=0))


def test_a_log_that_is_not_a_terminal_gets_plain_lines_with_elapsed_time_and_eta(tmp_path, capsys, monkeypatch):
    # The bar asked for, but the output is a file (a SLURM .out): no bar and no carriage return; every line says
    # how long the run has trained and how long it has to go.
    logger = MetricsLogger(LoggingConfig(tensorboard=False, jsonl=False), str(tmp_path), rank=0, total_steps=4,
                           start_step=1)
    assert logger.bar is None
    _log_steps(logger, [1, 2], total=4)
    logger.close()
    out, err = capsys.readouterr()
    assert "\r" not in out + err
    lines = out.splitlines()
    assert [line.split(" | ")[0] for line in lines] == ["step 2/4", "step 3/4"]
    assert all(line.rsplit(" | ", 1)[1].endswith(" elapsed, ETA 0:00") for line in lines), lines
    # In a terminal the bar is drawn, and the lines go through it.
    terminal = io.StringIO()
    terminal.isatty = lambda: True
    monkeypatch.setattr("sys.stderr", terminal)
    logger = MetricsLogger(LoggingConfig(tensorboard=False, jsonl=False), str(tmp_path), rank=0, total_steps=4)
    assert logger.bar is not None
    _log_steps(logger, [0], total=4)
    logger.close()
    assert "\r" in terminal.getvalue() and "step 1/4" in capsys.readouterr().out  # the bar, and the line above it


def test_clock_formats_durations():
    assert (clock(0), clock(59.6), clock(61), clock(3 * 3600 + 62), clock(None), clock(float("nan"))) == \
        ("0:00", "1:00", "1:01", "3:01:02", "?", "?")


def test_status_is_written_only_once_the_run_owns_the_folder_and_replaced_atomically(tmp_path):
    run = status.RunStatus(str(tmp_path), 0, "run-a")
    run.step(1, 10, 2.0, 18.0)
    run.end("failed", "refused")  # a run refused before it owned the folder writes nothing there
    assert not (tmp_path / "status.json").exists()
    run.start(0, None)
    assert status.read(str(tmp_path))["state"] == "running"
    run.start(0, 10)
    run.step(1, 10, 2.0, 18.0)
    run.saved(str(tmp_path / "checkpoints" / "step_00000001"), 1)
    record = status.read(str(tmp_path))
    assert {k: record[k] for k in ("state", "step", "total", "elapsed_s", "eta_s", "last_checkpoint_step",
                                   "run_id", "host", "pid")} == \
        {"state": "running", "step": 1, "total": 10, "elapsed_s": 2.0, "eta_s": 18.0, "last_checkpoint_step": 1,
         "run_id": "run-a", "host": socket.gethostname(), "pid": os.getpid()}
    assert record["eta_at"] and record["updated_at"] and record["message"] is None
    assert sorted(os.listdir(tmp_path)) == ["status.json"]  # the temporary file was renamed over it
    run.end("finished")
    record = status.read(str(tmp_path))
    assert record["state"] == "finished" and record["eta_s"] is None and record["step"] == 1


def test_the_first_failure_is_the_one_kept_and_names_its_rank(tmp_path):
    rank0 = status.RunStatus(str(tmp_path), 0, "run-a")
    rank0.start(0, 10)
    rank0.step(3, 10, 3.0, 7.0)
    # Rank 1 fails first (its disk, its data): it writes its line into this run's file.
    rank1 = status.RunStatus(str(tmp_path), 1, "run-a")
    rank1.end("finished")  # only rank 0 reports anything but a failure
    assert status.read(str(tmp_path))["state"] == "running"
    rank1.end(*status.ended_by(UserError("rank 1's shard is damaged"), 1))
    # Rank 0 then fails because its peer is gone: the first failure explains it, and stays.
    rank0.end(*status.ended_by(RuntimeError("Connection closed by peer"), 0))
    record = status.read(str(tmp_path))
    assert record["state"] == "failed" and record["step"] == 3
    assert record["message"] == f"rank 1 ({socket.gethostname()}): error: rank 1's shard is damaged"
    # Another run's file is never written by this run's other ranks.
    other = status.RunStatus(str(tmp_path), 1, "run-b")
    other.end("failed", "not mine")
    assert status.read(str(tmp_path))["message"].endswith("rank 1's shard is damaged")


@pytest.mark.parametrize("exc, state, text", [
    (KeyboardInterrupt(), "preempted", "interrupted (a second Ctrl-C): stopped without saving"),
    (SystemExit(143), "preempted", "stopped by a signal outside the training steps"),
    (FloatingPointError("step 3: the loss is NaN/inf\nmore"), "failed", "error: step 3: the loss is NaN/inf"),
    (ValueError("a bug"), "failed", "ValueError: a bug"),
])
def test_how_a_run_ended(exc, state, text):
    assert status.ended_by(exc, 2) == (state, f"rank 2 ({socket.gethostname()}): {text}")


def test_a_status_file_that_cannot_be_written_never_stops_the_run(tmp_path):
    run = status.RunStatus(str(tmp_path / "gone" / "deeper"), 0, "run-a")
    run.start(0, 10)  # the folder does not exist: nothing written, nothing raised
    run.step(1, 10, 1.0, 9.0)
    assert not (tmp_path / "gone").exists()
    json.dumps(run.record)  # still a plain record
