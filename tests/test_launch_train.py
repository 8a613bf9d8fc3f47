"""hbp_train.launch around the real trainer (``-m hbp_train.train``, tiny Llama, CPU gloo): the launcher's last line
says whether a checkpoint exists to resume from, read from the run folder the overrides name.

  - two "nodes" on one host, node 1 killed with -9 after a checkpoint: node 0's last line names node 1 (not its own
    rank 0, which noticed first) and the checkpoint to resume from;
  - SIGHUP while both workers are inside their steps (their collectives), before any checkpoint: the workers stop
    without saving and the last line says so; it never says "resume with train.resume=auto" (it used to);
  - SIGTERM with a save slower than the shutdown timeout: the workers are killed at it, and the last line and
    status.json both say preempted, the save cut short (status.json used to say ``failed``);
  - a real full disk (a small tmpfs in a user and mount namespace): the failed save is one line, exit 2, and
    status.json says ``failed`` with the same line (it used to stay ``running``: its own write failed too).
In each, status.json's state and message are the launcher's last line (runtime/run_end.py).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.assets.packed_fixture import TINY_LLAMA, TWO_RANK_STEPS, synthetic_samples, write_packed
from tests.run_watch import wait_for_step

REPO = Path(__file__).resolve().parents[1]
ENV = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
           DS_ACCELERATOR="cpu", HBP_HEARTBEAT="2", HBP_PG_TIMEOUT="60")

# Each trains a tiny model on 2 CPU processes for a minute or so on 2 shared cores: the full tier.
pytestmark = pytest.mark.full


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_packed(str(tmp_path_factory.mktemp("launch_packed")), synthetic_samples(14, 4096, seed=2),
                        TWO_RANK_STEPS, world_size=2)


def _overrides(shards: str, out: Path, *extra) -> list:
    model_cfg = json.dumps(TINY_LLAMA).replace('"', "").replace(" ", "")
    return ["experiment=cpu_demo", f"data.shards={shards}", f"train.out_dir={out}", "logging=quiet",
            f"model.config={model_cfg}", "train.warmup_steps=2", "data.epochs=30", *extra]


def _children(pid: int) -> list:
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            pass
    return found


def _last_line(text: str) -> str:
    return [line for line in text.splitlines() if line.strip()][-1]


def _status(out: Path) -> dict:
    return json.loads((out / "status.json").read_text())


def _agrees(out: Path, last: str, state: str) -> None:
    """status.json says what the launcher's last line says."""
    record = _status(out)
    assert (record["state"], "[launch] " + record["message"]) == (state, last), (record, last)


def test_node_1_killed_after_a_checkpoint_is_named_with_the_checkpoint_to_resume_from(shards, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run"

    def node(index):
        return subprocess.Popen(
            [sys.executable, "-m", "hbp_train.launch", "--nnodes", "2", "--node_rank", str(index),
             "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port), "-m",
             "hbp_train.train", *_overrides(shards, out, "train.save_every=2")],
            cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    node0, node1 = node(0), node(1)
    try:
        wait_for_step([node0, node1], out, 3)  # the checkpoint of step 2 is published before step 3 runs
        for pid in [*_children(node1.pid), node1.pid]:
            os.kill(pid, signal.SIGKILL)
        node1.communicate()
        _, err = node0.communicate(timeout=120)
    finally:
        for proc in (node0, node1):
            if proc.poll() is None:
                proc.kill()
    assert node0.returncode == 1
    tag = out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip()
    assert (tag / "manifest.json").is_file()
    last = _last_line(err)
    assert last.startswith(f"[launch] hbp_train.train stopped: node 1 ({socket.gethostname()}, rank 1) stopped "
                           "answering "), err[-3000:]
    assert last.endswith(f"(killed, frozen or cut off from the network); checkpoint {tag} was saved: resume with "
                         "train.resume=auto")
    assert "rank 0 stopped first" not in err
    _agrees(out, last, "failed")  # not rank 0's own collective timeout: the node where it began


def test_sighup_before_any_checkpoint_never_says_resume(shards, tmp_path):
    out = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "hbp_train.launch", "--standalone", "--nproc_per_node", "2", "-m", "hbp_train.train",
         *_overrides(shards, out, "train.save_every=0", "train.save_final=false")],
        cwd=REPO, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step([launcher], out, 2)
        launcher.send_signal(signal.SIGHUP)
        stdout, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signal.SIGHUP
    assert not (out / "checkpoints" / "latest").exists()
    assert "resume with train.resume=auto" not in stdout + err and "death signal" not in err
    assert "[launch] SIGHUP: the workers are stopped without saving (SIGTERM or Ctrl-C saves)" in err
    assert _last_line(err) == (f"[launch] stopped by SIGHUP; no checkpoint in {out}/checkpoints, so a rerun starts "
                               "from the beginning")
    _agrees(out, _last_line(err), "preempted")


SLOW_SAVE = """
import sys, time
from hbp_train.runtime import checkpoint
real_save = checkpoint.save
def slow_save(*args, **kwargs):
    time.sleep(60)
    return real_save(*args, **kwargs)
checkpoint.save = slow_save
from hbp_train.train import main
sys.argv = ["hbp_train.train", *sys.argv[1:]]
main()
"""


def test_a_save_cut_short_by_the_shutdown_timeout_is_preempted_in_the_line_and_in_status(shards, tmp_path):
    out = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "hbp_train.launch", "--standalone", "--nproc_per_node", "2", "--no-python",
         sys.executable, "-c", SLOW_SAVE, *_overrides(shards, out)],
        cwd=REPO, env=dict(ENV, HBP_SHUTDOWN_TIMEOUT="3"), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_step([launcher], out, 2)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=120)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 128 + signal.SIGTERM
    last = _last_line(err)
    assert last == (f"[launch] stopped by SIGTERM; the workers were killed 3 s after it, before their checkpoint was "
                    "saved (HBP_SHUTDOWN_TIMEOUT: give a save more time); no checkpoint in "
                    f"{out}/checkpoints, so a rerun starts from the beginning"), err[-3000:]
    _agrees(out, last, "preempted")


@pytest.mark.skipif(shutil.which("unshare") is None or subprocess.run(
    ["unshare", "-rm", "true"], capture_output=True).returncode != 0, reason="needs unprivileged user namespaces")
def test_a_real_full_disk_is_one_line_and_status_says_failed_with_it(tmp_path):
    """An 8 MB tmpfs holds the first checkpoint (4.8 MB) and not the second: the save of step 4 meets a full disk."""
    from tests.assets.packed_fixture import ONE_RANK_STEPS

    shards = write_packed(str(tmp_path / "packed"), synthetic_samples(12, 4096, seed=1), ONE_RANK_STEPS, world_size=1)
    disk, kept = tmp_path / "disk", tmp_path / "kept"
    disk.mkdir()
    kept.mkdir()
    out = disk / "run"
    train = [sys.executable, "-m", "hbp_train.launch", "--standalone", "--nproc_per_node", "1", "-m", "hbp_train.train",
             *_overrides(shards, out, "train.save_every=2", "data.epochs=2")]
    script = ('mount -t tmpfs -o size=8m tmpfs "$1" && shift 2 && "$@"; rc=$?; '
              f'cp "{out}/status.json" "{kept}/"; cat "{out}/checkpoints/latest" > "{kept}/latest"; exit $rc')
    proc = subprocess.run(["unshare", "-rm", "sh", "-c", script, "sh", str(disk), "--", *train], cwd=REPO, env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = _last_line(proc.stderr)
    assert last.startswith(f"[launch] hbp_train.train failed on rank 0 (exit code 2): error: saving checkpoint "
                           f"{out}/checkpoints/step_00000004 failed ("), proc.stderr[-3000:]
    assert "GiB free there); it is left unpublished and" in last and "Traceback" not in proc.stderr
    assert (kept / "latest").read_text() == "step_00000002"
    _agrees(kept, last, "failed")
