"""hbp_train.launch with two "nodes" on one host (two launchers, --nnodes 2, static rendezvous on 127.0.0.1), CPU
gloo, a small worker (tests/peer_worker.py) whose collectives run through hbp_train.distributed.groups:

  - a node that never joins: node 0 says every HBP_RDZV_REPORT s which node is missing and gives up after
    HBP_RDZV_TIMEOUT s with one line (torchrun: silence for 600 s, then a 40-line DistStoreError traceback);
  - node 1 before node 0 is up, or pointed at a port another program holds: it says so, then one line;
  - node 1 frozen with SIGSTOP: node 0's collective times out (HBP_PG_TIMEOUT) and its launcher names node 1;
  - node 1's launcher alone frozen, its worker alive: the run finishes and node 0 exits 0 as soon as node 1 has
    been silent for a few beats (torchrun's exit barrier held it for 300 s, deaf to SIGTERM);
  - node 1 killed with -9: node 0 names node 1, not its own rank 0 that noticed first;
  - one worker of node 1 killed (the OOM killer), or ending with bad input: both nodes name that rank (full tier);
  - the preemption save: a SIGTERM'd worker that needs longer than the shutdown timeout to save is killed at it,
    and HBP_SHUTDOWN_TIMEOUT raises it (default 300 s, torchrun's 30 s).
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hbp_train.common.errors import UserError
from hbp_train.distributed.node_watch import Node, blame
from hbp_train.launch import SHUTDOWN_TIMEOUT, checkpoint_state, shutdown_timeout

REPO = Path(__file__).resolve().parents[1]
WORKER = [sys.executable, str(REPO / "tests" / "peer_worker.py")]
NAME = WORKER[1]  # torchrun names a job by its script


def _env(**extra) -> dict:
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "DS_ACCELERATOR": "cpu", "HBP_HEARTBEAT": "2", "HBP_PG_TIMEOUT": "10"}
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node(index: int, port: int, out: Path, seconds: float = 60, nnodes: int = 2, **env) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "hbp_train.launch", "--nnodes", str(nnodes), "--node_rank", str(index),
         "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port), "--no-python",
         *WORKER, str(out), str(seconds)],
        cwd=REPO, env=_env(**env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path: Path, timeout: float = 60) -> None:
    end = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < end, f"{path} never appeared"
        time.sleep(0.1)


def _lines(proc: subprocess.Popen, timeout: float = 60) -> tuple:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, [line for line in err.splitlines() if line.strip()]


def _kill(*pids: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# --- the decisions, without processes ---------------------------------------------------------------------------


def test_shutdown_timeout_default_covers_a_save_and_the_flag_and_env_win():
    assert shutdown_timeout(None, {}) == SHUTDOWN_TIMEOUT == 300  # torchrun's own default is 30 s
    assert shutdown_timeout(None, {"HBP_SHUTDOWN_TIMEOUT": "600"}) == 600
    assert shutdown_timeout(None, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "45"}) == 45  # torchrun's variable still heard
    assert shutdown_timeout(None, {"HBP_SHUTDOWN_TIMEOUT": "90", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "45"}) == 90
    assert shutdown_timeout(12, {"HBP_SHUTDOWN_TIMEOUT": "600"}) == 12  # --shutdown-timeout on the command line


def test_blame_prefers_a_message_then_a_silent_node_then_a_signal_then_a_peer_consequence():
    node1 = Node(1, "gpu-018", 4, 4)
    peer = {"exitcode": 1, "message": "error: a collective failed on rank 0 (...)", "timestamp": 10}
    traceback_exit = {"exitcode": 1, "message": "", "timestamp": 10}
    oom = {"exitcode": -9, "message": "", "timestamp": 11}
    bad_input = {"exitcode": 2, "message": "error: x.jsonl line 3: ...", "timestamp": 12}
    assert blame({0: peer}, {}, [(node1, 9.0)]) == ("silent", [(node1, 9.0)])
    assert blame({0: traceback_exit}, {}, [(node1, 9.0)])[0] == "silent"
    assert blame({0: peer}, {1: {5: bad_input}}, [(node1, 9.0)]) == ("rank", (5, bad_input, 1))
    assert blame({0: peer, 1: traceback_exit}, {1: {6: oom}}, []) == ("rank", (6, oom, 1))
    assert blame({0: peer, 1: traceback_exit}, {}, []) == ("rank", (1, traceback_exit, None))
    assert blame({3: peer, 2: dict(peer)}, {}, []) == ("rank", (2, peer, None))  # a tie: the lowest rank
    assert str(node1) == "node 1 (gpu-018, ranks 4-7)" and str(Node(2, "h", 2, 1)) == "node 2 (h, rank 2)"


def test_checkpoint_state_says_whether_there_is_a_checkpoint_to_resume_from(tmp_path):
    out = tmp_path / "run"
    assert checkpoint_state(str(out), time.time()) == f"no checkpoint in {out}/checkpoints, so a rerun starts from " \
                                                       "the beginning"
    tag = out / "checkpoints" / "step_00000004"
    tag.mkdir(parents=True)
    (out / "checkpoints" / "latest").write_text("step_00000004")
    # a save that did not finish (no manifest.json) is not a checkpoint
    assert checkpoint_state(str(out), 0).startswith("no checkpoint in ")
    (tag / "manifest.json").write_text("{}")
    assert checkpoint_state(str(out), 0) == f"checkpoint {tag} was saved: resume with train.resume=auto"
    assert checkpoint_state(str(out), time.time() + 60) == ("no checkpoint was saved by this run; resume with "
                                                            f"train.resume=auto from the earlier {tag}")
    assert checkpoint_state(None, 0) == ""


def test_the_run_folder_is_read_from_the_training_overrides():
    from hbp_train.launch import build_parser, run_dir

    args = build_parser().parse_args(["--standalone", "-m", "hbp_train.train", "experiment=cpu_demo",
                                      "train.out_dir=runs/here"])
    assert run_dir(args) == "runs/here"
    assert run_dir(build_parser().parse_args(["--standalone", "--no-python", "true"])) is None


def test_bad_timeouts_are_one_line_before_any_worker():
    from hbp_train.launch import env_seconds

    assert env_seconds("HBP_RDZV_TIMEOUT", 600, {}) == 600 and env_seconds("HBP_RDZV_TIMEOUT", 600,
                                                                              {"HBP_RDZV_TIMEOUT": "45"}) == 45
    for bad in ("soon", "-1", "nan"):
        with pytest.raises(UserError, match=f"HBP_RDZV_TIMEOUT={bad}: not a number of seconds >= 0"):
            env_seconds("HBP_RDZV_TIMEOUT", 600, {"HBP_RDZV_TIMEOUT": bad})
    proc = subprocess.run([sys.executable, "-m", "hbp_train.launch", "--standalone", "--nproc_per_node", "1",
                           "--no-python", "true"], cwd=REPO, env=_env(HBP_PG_TIMEOUT="soon"), capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr == ("python -m hbp_train.launch: error: HBP_PG_TIMEOUT=soon: not a "
                                                    "number of seconds > 0; unset it for the default (1800)\n")


# --- the preemption save ----------------------------------------------------------------------------------------


def _sigterm_during_save(tmp_path, **env) -> tuple:
    out = tmp_path / f"save-{len(list(tmp_path.iterdir()))}"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "hbp_train.launch", "--standalone", "--nproc_per_node", "1",
                             "--no-python", *WORKER, str(out), "60"], cwd=REPO,
                            env=_env(HBP_TEST_SAVE=1, HBP_TEST_SAVE_SECONDS=3, **env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    _wait_for(out / "ready_0")
    proc.send_signal(signal.SIGTERM)
    code, lines = _lines(proc)
    return code, lines, (out / "saved_0").exists()


@pytest.mark.slow
def test_a_save_longer_than_the_shutdown_timeout_is_killed_and_the_raised_timeout_lets_it_finish(tmp_path):
    code, lines, saved = _sigterm_during_save(tmp_path, HBP_SHUTDOWN_TIMEOUT=1)  # torchrun's cut, made short
    assert not saved and code == 128 + signal.SIGTERM
    code, lines, saved = _sigterm_during_save(tmp_path, HBP_SHUTDOWN_TIMEOUT=6)
    assert saved and code == 128 + signal.SIGTERM
    # torchrun's "Received 15 death signal, shutting down workers" is replaced by one line of ours
    assert not any("death signal" in line for line in lines), lines
    assert lines == ["[launch] SIGTERM: passed on to the workers, which finish their step and save a checkpoint "
                     "(killed if not done within 6 s: HBP_SHUTDOWN_TIMEOUT)", "[launch] stopped by SIGTERM"]


# --- two nodes --------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.full  # the default tier names a frozen node (the same watch); these two cases are proven in CI
def test_a_node_that_never_joins_is_named_every_few_seconds_then_one_line(tmp_path):
    start = time.monotonic()
    code, lines = _lines(_node(0, _free_port(), tmp_path, HBP_RDZV_TIMEOUT=5, HBP_RDZV_REPORT=2))
    assert code == 1 and time.monotonic() - start < 30
    waiting = [line for line in lines if "waiting for node 1 of 2" in line]
    assert len(waiting) >= 2 and waiting[0].startswith("[launch] rendezvous at 127.0.0.1:")
    assert "gives up after 5 s, HBP_RDZV_TIMEOUT" in waiting[0]
    assert lines[-1].startswith("[launch] rendezvous at 127.0.0.1:") and "node 1 of 2 did not join within 5 s" \
        in lines[-1]
    assert "Traceback" not in "\n".join(lines) and len(lines) == len(waiting) + 1, lines


@pytest.mark.slow
@pytest.mark.full  # the default tier names a frozen node (the same watch); these two cases are proven in CI
def test_node_1_without_node_0_or_on_a_port_another_program_holds_is_one_line(tmp_path):
    code, lines = _lines(_node(1, _free_port(), tmp_path, HBP_RDZV_TIMEOUT=4, HBP_RDZV_REPORT=1))
    assert code == 1 and "Traceback" not in "\n".join(lines)
    assert lines[0].startswith("[launch] node 1: waiting for node 0 at 127.0.0.1:")
    assert lines[-1].startswith("[launch] rendezvous at 127.0.0.1:") and "node 0 was not reachable within 4 s" \
        in lines[-1]
    with socket.socket() as foreign:  # listens, never answers: a TCPStore client would wait for ever
        foreign.bind(("127.0.0.1", 0))
        foreign.listen()
        code, lines = _lines(_node(1, foreign.getsockname()[1], tmp_path, HBP_RDZV_TIMEOUT=4))
    assert code == 1 and len(lines) == 1, lines
    assert "something listens there but does not answer as node 0's rendezvous" in lines[0]


def test_a_busy_port_on_node_0_of_two_is_one_line(tmp_path):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        code, lines = _lines(_node(0, busy.getsockname()[1], tmp_path))
    assert code == 1 and len(lines) == 1 and " is in use (another job on this host?)" in lines[0], lines


def _two_nodes(tmp_path, **env1) -> tuple:
    port = _free_port()
    node0 = _node(0, port, tmp_path)
    node1 = _node(1, port, tmp_path, **env1)
    return node0, node1


@pytest.mark.slow
def test_a_frozen_node_ends_the_job_naming_it(tmp_path):
    node0, node1 = _two_nodes(tmp_path)
    try:
        _wait_for(tmp_path / "ready_1")
        frozen = [node1.pid, int((tmp_path / "pid_1").read_text())]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)  # the whole node: its launcher and its worker
        start = time.monotonic()
        code, lines = _lines(node0)
        waited = time.monotonic() - start
    finally:
        _kill(node1.pid, int((tmp_path / "pid_1").read_text()) if (tmp_path / "pid_1").exists() else node1.pid)
        node1.communicate()
    assert code == 1 and 8 <= waited < 30  # HBP_PG_TIMEOUT=10 s
    # said while node 0 still waits: after 3 missed beats and a second (7 s), at the next beat
    assert re.fullmatch(rf"\[launch\] node 1 \({socket.gethostname()}, rank 1\) has given no sign of life for [78] s "
                        r"\(its launcher frozen, dead or cut off\?\); if its workers stopped too, the others stop "
                        r"when a collective times out \(HBP_PG_TIMEOUT\)", lines[0]), lines
    assert lines[-1].startswith(f"[launch] {NAME} stopped: node 1 ({socket.gethostname()}, rank 1) "
                                "stopped answering ") and "(killed, frozen or cut off from the network)" in lines[-1]
    assert len(lines) == 2, lines


@pytest.mark.slow
def test_a_frozen_launcher_whose_worker_finished_does_not_hold_node_0(tmp_path):
    port = _free_port()
    node0 = _node(0, port, tmp_path, seconds=6, HBP_PG_TIMEOUT=120)  # no collective waits for the frozen launcher
    node1 = _node(1, port, tmp_path, seconds=6, HBP_PG_TIMEOUT=120)
    try:
        _wait_for(tmp_path / "ready_1")
        os.kill(node1.pid, signal.SIGSTOP)  # the launcher only: its worker trains on and finishes
        start = time.monotonic()
        code, lines = _lines(node0, timeout=120)
        waited = time.monotonic() - start
    finally:
        os.kill(node1.pid, signal.SIGCONT)
        _kill(node1.pid)
        node1.communicate()
    assert code == 0 and waited < 40, (waited, lines)
    assert re.fullmatch(rf"\[launch\] node 1 \({socket.gethostname()}, rank 1\) gave no sign of life for \d+ s: not "
                        r"waiting for it \(this node's workers have finished\)", lines[-1]), lines


@pytest.mark.slow
def test_a_killed_node_is_named_not_the_rank_that_noticed(tmp_path):
    node0, node1 = _two_nodes(tmp_path)
    _wait_for(tmp_path / "ready_1")
    _kill(int((tmp_path / "pid_1").read_text()), node1.pid)
    node1.communicate()
    code, lines = _lines(node0)
    assert code == 1 and lines == [f"[launch] {NAME} stopped: node 1 ({socket.gethostname()}, rank 1) "
                                   f"stopped answering {lines[-1].split('stopped answering ')[1].split(' ')[0]} s "
                                   "ago (killed, frozen or cut off from the network)"], lines


@pytest.mark.full  # two more two-node runs; the choice itself is test_blame_prefers_...
def test_a_worker_killed_on_node_1_or_its_bad_input_is_named_by_both_nodes(tmp_path):
    node0, node1 = _two_nodes(tmp_path)
    _wait_for(tmp_path / "ready_1")
    _kill(int((tmp_path / "pid_1").read_text()))  # the worker alone, as the OOM killer would
    (code0, lines0), (code1, lines1) = _lines(node0), _lines(node1)
    assert (code0, code1) == (1, 1)
    assert lines0[-1].startswith(f"[launch] {NAME} failed: rank 1 (node 1) stopped first, with signal 9; "
                                 "its output is in node 1's log")
    assert lines1[-1].startswith(f"[launch] {NAME} failed: rank 1 stopped first, with signal 9")

    (tmp_path / "ready_1").unlink()
    node0, node1 = _two_nodes(tmp_path, HBP_TEST_FAIL_RANK=1)
    (code0, lines0), (code1, lines1) = _lines(node0), _lines(node1)
    message = f"error: {tmp_path}/input.jsonl line 3: no 'messages' field (rank 1)"
    assert (code0, code1) == (2, 2), (lines0, lines1)
    assert lines0[-1] == f"[launch] {NAME} failed on rank 1 (node 1) (exit code 2): {message}"
    assert lines1[-1] == f"[launch] {NAME} failed on rank 1 (exit code 2): {message}"
