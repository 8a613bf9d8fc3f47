"""hbp_train.launch around the real trainer (``-m hbp_train.train``, tiny Llama, CPU gloo): the launcher's last line
says whether a checkpoint exists to resume from, read from the run folder the overrides name.

  - two "nodes" on one host, node 1 killed with -9 after a checkpoint: node 0's last line names node 1 (not its own
    rank 0, which noticed first) and the checkpoint to resume from;
  - SIGHUP while both workers are inside their steps (their collectives), before any checkpoint: the workers stop
    without saving and the last line says so; it never says "resume with train.resume=auto" (it used to).
"""

from __future__ import annotations

import json
import os
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
