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
    # torchrun's own failure log lines are quieted: the workers' lines and ours are all there is
    assert all(line.startswith(("error: ", "[launch] ")) for line in proc.stderr.strip().splitlines()), proc.stderr


def test_the_worker_error_file_message_becomes_the_last_line():
    # What hbp_train.train._fail leaves for the launcher: the rank's one-line error in torchrun's error file.
    worker = 'printf \'{"message": "error: data.shards=x: no plan.json there", "timestamp": 1}\' > "$TORCHELASTIC_ERROR_FILE"; exit 2'
    proc = subprocess.run([sys.executable, "-m", "hbp_train.launch", "--standalone", "--nproc_per_node", "2",
                           "--no-python", "sh", "-c", worker], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=ENV)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("[launch] sh failed on rank ") and last.endswith("(exit code 2): error: data.shards=x: "
                                                                             "no plan.json there")


def test_train_fail_writes_the_error_file_and_leaves_printing_to_the_launcher(tmp_path, monkeypatch, capsys):
    import json

    import pytest

    from hbp_train.train import _fail

    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("HBP_LAUNCHER", "1")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit) as exit_info:
        _fail("error: data.shards=x: no plan.json there", 2)
    assert exit_info.value.code == 2 and capsys.readouterr().err == ""
    assert json.loads(error_file.read_text())["message"] == "error: data.shards=x: no plan.json there"
    monkeypatch.delenv("HBP_LAUNCHER")  # plain torchrun: rank 0 prints it too
    with pytest.raises(SystemExit):
        _fail("error: again", 2)
    assert capsys.readouterr().err == "error: again\n"


def test_successful_workers_exit_zero():
    proc = subprocess.run([sys.executable, "-m", "hbp_train.launch", "--standalone", "--nproc_per_node", "2",
                           "--no-python", "true"], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=ENV)
    assert proc.returncode == 0, proc.stderr


def test_a_busy_rendezvous_port_is_one_line():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run([sys.executable, "-m", "hbp_train.launch", "--nnodes", "1", "--nproc_per_node", "1",
                               "--master_addr", "127.0.0.1", "--master_port", str(port), "--no-python", "true"],
                              capture_output=True, text=True, timeout=120, cwd=REPO, env=ENV)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert lines == [f"[launch] port 127.0.0.1:{port} is in use (another job on this host?): on one node leave "
                     "MASTER_PORT unset and a free port is chosen, or set another MASTER_PORT"], proc.stderr


def test_launch_sh_picks_a_free_port_on_one_node_and_a_fixed_one_only_when_asked():
    text = (REPO / "launch.sh").read_text()
    train = text[text.index("\ntrain() {"):text.index("\n}\n", text.index("\ntrain() {"))]
    # one node and no MASTER_PORT: torchrun --standalone (its own free port); else the given or default port
    assert 'if [ "${NNODES:-1}" = 1 ] && [ -z "${MASTER_PORT:-}" ]; then' in train
    standalone = train[train.index("--standalone"):]
    assert standalone.index("--standalone") < standalone.index("--master_port")


def test_a_user_error_recorded_before_a_sigterm_ends_in_its_line_and_exit_2():
    """The race behind a refusal made on a worker ending "signal 15", exit 1, on one run and exit 2 on the next:
    rank 0 records its one-line error (hbp_train.train does before tearing down), then is still tearing down when
    its peer, whose collective the tear-down broke, exits 1 first; torchrun stops rank 0 with SIGTERM. The line is
    rank 0's and the exit code the one it recorded."""
    record = ('{"message": "error: gemma2 (model.architecture): its attention asks for x", "timestamp": 1, '
              '"exitcode": 2}')
    worker = (f'if [ "$RANK" = 0 ]; then printf \'{record}\' > "$TORCHELASTIC_ERROR_FILE"; exec sleep 60; '
              'else sleep 2; exit 1; fi')
    proc = subprocess.run([sys.executable, "-m", "hbp_train.launch", "--standalone", "--nproc_per_node", "2",
                           "--no-python", "sh", "-c", worker], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=ENV)
    assert proc.returncode == 2, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("[launch] sh failed on rank 0 (exit code 2): error: gemma2"), proc.stderr
    assert "Traceback" not in proc.stderr
