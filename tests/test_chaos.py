"""Chaos, through the real entry points (``python -m hbp_train.train`` and ``hbp_train.launch``), on a tiny model:
each way a run can be cut short ends either with a loss trace equal to the uninterrupted run's, step for step and
bit for bit (metrics.jsonl after ``train.resume=auto``), or with a clean one-line refusal.

  - kill -9 at a random step (3 seeds; a kill may land inside a save), then resume=auto;
  - SIGTERM (finish the step, save, exit 0), then resume=auto;
  - the launcher killed with -9: its worker notices (parent_watch), saves and exits; then resume=auto;
  - a truncated file in the newest checkpoint: resume=auto falls back to the previous one with one warning line;
  - a second run into a live run's folder: refused in one line (exit 2), the live run's files untouched.

One process per run keeps these to a few minutes of CPU. The issue's own setting, kill -9 of every process (the
launcher and both workers) on 2 CPU processes with a world-size-2 plan, has one test of its own
(test_kill_9_of_every_process_of_a_two_process_run_then_resume_gives_the_same_trace): the manifest written after
every rank saved, the lock held by rank 0 and the per-rank RNG files are what 2 ranks add.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.assets.packed_fixture import ONE_RANK_STEPS, TINY_LLAMA, TWO_RANK_STEPS, synthetic_samples, write_packed
from tests.run_watch import steps_logged, wait_for_step

REPO = Path(__file__).resolve().parents[1]
VOCAB = 4096
EPOCHS = 2
TOTAL = len(ONE_RANK_STEPS) * EPOCHS
ENV = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")

pytestmark = pytest.mark.slow


def _overrides(shards: str, out: Path, *extra) -> list:
    model_cfg = json.dumps(TINY_LLAMA).replace('"', "").replace(" ", "")
    return ["experiment=cpu_demo", f"data.shards={shards}", f"train.out_dir={out}", "logging=quiet",
            f"model.config={model_cfg}", "train.warmup_steps=2", "train.lr=1e-2", f"data.epochs={EPOCHS}",
            "train.save_every=2", *extra]


def _train(shards, out, *extra, launcher=False, nproc=1) -> subprocess.Popen:
    entry = ([sys.executable, "-m", "hbp_train.launch", "--standalone", "--nproc_per_node", str(nproc), "-m",
              "hbp_train.train"] if launcher else [sys.executable, "-m", "hbp_train.train"])
    return subprocess.Popen(entry + _overrides(shards, out, *extra), cwd=REPO, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _finish(proc, timeout=300) -> tuple:
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def _trace(out: Path) -> list:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [(r["plan/step"], r["loss/train"]) for r in rows]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_packed(str(tmp_path_factory.mktemp("chaos_packed")), synthetic_samples(12, VOCAB, seed=1),
                        ONE_RANK_STEPS, world_size=1)


@pytest.fixture(scope="module")
def reference(shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("chaos_ref") / "run"
    code, _, err = _finish(_train(shards, out))
    assert code == 0, err
    trace = _trace(out)
    assert [s for s, _ in trace] == list(range(TOTAL))
    return trace


def _resume_and_compare(shards, out, reference) -> str:
    code, stdout, err = _finish(_train(shards, out, "train.resume=auto"))
    assert code == 0, err
    assert _trace(out) == reference  # bit for bit, one row per step (the re-run steps' rows replaced)
    assert not (out / "run.lock").exists()
    return stdout + err


# Seed 0 is the default tier's kill-and-resume; the other kill points, and the tests below, are the full tier.
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.full), pytest.param(2, marks=pytest.mark.full)])
def test_kill_9_at_a_random_step_then_resume_gives_the_same_trace(shards, tmp_path, reference, seed):
    out = tmp_path / "run"
    kill_at = int(np.random.default_rng(seed).integers(1, TOTAL - 3))
    proc = _train(shards, out)
    wait_for_step([proc], out, kill_at)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    assert (out / "run.lock").exists()  # left behind by the killed run: stale, taken over with a warning
    output = _resume_and_compare(shards, out, reference)
    assert "took over the stale lock" in output


@pytest.mark.full
def test_sigterm_then_resume_gives_the_same_trace_and_a_second_run_is_refused_meanwhile(shards, tmp_path,
                                                                                        reference):
    out = tmp_path / "run"
    proc = _train(shards, out, "data.epochs=400")  # long enough to still be running after the second run's start
    wait_for_step([proc], out, 2)
    config_before = (out / "config.yaml").read_text()
    second = _train(shards, out, "train.resume=auto", "train.lr=5e-3")
    code, stdout, err = _finish(second)
    assert code == 2 and "Traceback" not in err, err
    assert err.strip().splitlines() == [line for line in err.strip().splitlines() if line.startswith("error: ")]
    assert len(err.strip().splitlines()) == 1 and "is in use by another run (host " in err
    assert (out / "config.yaml").read_text() == config_before  # the live run's files are untouched
    assert proc.poll() is None
    proc.send_signal(signal.SIGTERM)
    code, stdout, err = _finish(proc)
    assert code == 0 and "stopped by SIGTERM" in stdout + err, err
    # The run's length (400 epochs) shapes its LR schedule, so the uninterrupted reference is a run of the same
    # length cut after the same number of steps (train.exit_after_steps does not change the schedule).
    stopped_at = len(_trace(out))
    code, _, err = _finish(_train(shards, out, "train.resume=auto", "data.epochs=400", "train.exit_after_steps=2"))
    assert code == 0, err
    full = tmp_path / "full"
    code, _, err = _finish(_train(shards, full, "data.epochs=400", f"train.exit_after_steps={stopped_at + 2}"))
    assert code == 0, err
    assert _trace(out) == _trace(full) and len(_trace(out)) == stopped_at + 2


@pytest.mark.full
def test_the_launcher_killed_with_9_lets_its_worker_save_and_exit(shards, tmp_path, reference):
    out = tmp_path / "run"
    launcher = _train(shards, out, launcher=True)
    wait_for_step([launcher], out, 3)
    launcher.send_signal(signal.SIGKILL)  # the launcher alone; its worker is in a session of its own
    launcher.communicate()
    deadline = time.time() + 120
    while (out / "run.lock").exists() and time.time() < deadline:  # the worker releases it on its way out
        time.sleep(0.1)
    assert not (out / "run.lock").exists(), "the worker outlived its launcher"
    latest = (out / "checkpoints" / "latest").read_text()
    assert int(latest.split("_")[1]) == steps_logged(out)  # saved where it stopped
    _resume_and_compare(shards, out, reference)


@pytest.mark.full
def test_a_truncated_file_in_the_newest_checkpoint_falls_back_with_one_warning(shards, tmp_path, reference):
    out = tmp_path / "run"
    code, _, err = _finish(_train(shards, out, "train.exit_after_steps=5"))
    assert code == 0, err
    newest = out / "checkpoints" / "step_00000005"
    shard = next(p for p in sorted(newest.glob("*optim_states.pt")))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    output = _resume_and_compare(shards, out, reference)
    warnings = [line for line in output.splitlines() if "warning: train.resume=auto skips" in line]
    assert len(warnings) == 1 and shard.name in warnings[0] and "step_00000004" in warnings[0]


def _descendants(pid: int) -> list:
    """Every process below ``pid`` (torchrun's workers run in sessions of their own: killpg misses them)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except (FileNotFoundError, ProcessLookupError):
                continue
            found += children
            todo += children
    return found


@pytest.mark.full
def test_kill_9_of_every_process_of_a_two_process_run_then_resume_gives_the_same_trace(tmp_path):
    # Two replicas, 3 steps of 2, 1, 2 micro-batches, over 3 epochs: 9 steps, a checkpoint every other one.
    shards = write_packed(str(tmp_path / "packed"), synthetic_samples(14, VOCAB, seed=2), TWO_RANK_STEPS,
                          world_size=2)
    total = len(TWO_RANK_STEPS) * 3
    extra = ("data.epochs=3",)
    ref = tmp_path / "ref"
    code, _, err = _finish(_train(shards, ref, *extra, launcher=True, nproc=2))
    assert code == 0, err
    reference = _trace(ref)
    assert [s for s, _ in reference] == list(range(total))

    out = tmp_path / "run"
    kill_at = int(np.random.default_rng(0).integers(1, total - 2))
    launcher = _train(shards, out, *extra, launcher=True, nproc=2)
    wait_for_step([launcher], out, kill_at)
    workers = _descendants(launcher.pid)
    assert len(workers) >= 2
    for pid in [*workers, launcher.pid]:  # the workers first: none of them gets to save on its way out
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    launcher.communicate()
    assert (out / "run.lock").exists()  # stale: the resumed run takes it over
    assert len(_trace(out)) < total
    code, stdout, err = _finish(_train(shards, out, *extra, "train.resume=auto", launcher=True, nproc=2))
    assert code == 0, err
    assert _trace(out) == reference  # bit for bit, one row per step
    assert "took over the stale lock" in stdout + err
    assert not (out / "run.lock").exists()
