"""Checkpoint bookkeeping without DeepSpeed: tags, resume resolution, pruning, RNG round trip, signal flag.
(Saving/loading through DeepSpeed, exact resume and SIGTERM are in tests/test_trainer.py.)"""

from __future__ import annotations

import json
import os
import random
import signal

import numpy as np
import pytest
import torch

from hbp_train import checkpoint
from hbp_train.errors import UserError


def _make(root, steps, latest=None):
    for s in steps:
        os.makedirs(os.path.join(root, checkpoint.tag_for(s)))
    if latest is not None:
        with open(os.path.join(root, "latest"), "w") as f:
            f.write(checkpoint.tag_for(latest))


def test_resolve_and_find_resume(tmp_path):
    root = str(tmp_path / "checkpoints")
    assert checkpoint.find_resume(None, root) is None
    assert checkpoint.find_resume("auto", root) is None  # nothing yet: start fresh
    _make(root, [2, 10, 4], latest=4)
    assert checkpoint.list_tags(root) == [checkpoint.tag_for(s) for s in (2, 4, 10)]
    assert checkpoint.find_resume("auto", root) == (root, checkpoint.tag_for(4))  # DeepSpeed's 'latest' wins
    assert checkpoint.resolve(os.path.join(root, checkpoint.tag_for(10))) == (root, checkpoint.tag_for(10))
    assert checkpoint.resolve(str(tmp_path)) == (root, checkpoint.tag_for(4))  # the run directory above checkpoints/
    with pytest.raises(UserError, match="step_7: no such directory"):
        checkpoint.resolve(str(tmp_path / "checkpoints" / "step_7"))
    (tmp_path / "empty" / "checkpoints").mkdir(parents=True)
    with pytest.raises(UserError, match="not a checkpoint"):
        checkpoint.resolve(str(tmp_path / "empty"))
    checkpoint.prune(root, 2)
    assert checkpoint.list_tags(root) == [checkpoint.tag_for(4), checkpoint.tag_for(10)]


def test_rng_state_round_trip():
    random.seed(1), np.random.seed(1), torch.manual_seed(1)
    state = checkpoint.rng_state()
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    checkpoint.set_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_stop_signal_sets_flag_and_restores_handlers():
    before = signal.getsignal(signal.SIGTERM)
    stop = checkpoint.StopSignal().install()
    try:
        assert not stop.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested and stop.received == "SIGTERM"
    finally:
        stop.uninstall()
    assert signal.getsignal(signal.SIGTERM) == before


def test_repeated_sigint_finishes_the_step_unless_the_user_insists():
    stop = checkpoint.StopSignal().install()
    try:
        # One Ctrl-C under torchrun: the terminal's SIGINT and torchrun's forwarded copy arrive together.
        os.kill(os.getpid(), signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)
        assert stop.received == "SIGINT"
        # A second Ctrl-C seconds later means: stop now.
        stop._received_at -= 2 * stop.REPEAT_WINDOW_S
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
    finally:
        stop.uninstall()


def test_resume_is_refused_for_another_world_size_or_plan(tmp_path):
    shards, other = tmp_path / "shards", tmp_path / "other"
    for d, plan in ((shards, {"steps": [1]}), (other, {"steps": [2]})):
        d.mkdir()
        (d / "plan.json").write_text(json.dumps(plan))
    root = str(tmp_path / "checkpoints")
    _make(root, [4])
    tag = checkpoint.tag_for(4)
    checkpoint.check_resumable(root, tag, 8, str(other))  # no resume.json (an older checkpoint): not checked
    with open(os.path.join(root, tag, "resume.json"), "w") as f:
        json.dump({"next_step": 4, "world_size": 8, "data_shards": str(shards),
                   "plan_sha256": checkpoint.plan_fingerprint(str(shards))}, f)
    checkpoint.check_resumable(root, tag, 8, str(shards))
    with pytest.raises(UserError, match="saved by 8 ranks and this run has 16: resume with 8 ranks"):
        checkpoint.check_resumable(root, tag, 16, str(shards))
    with pytest.raises(UserError, match=r"saved with another plan than .*other/plan.json .*step 4 would be other data"):
        checkpoint.check_resumable(root, tag, 8, str(other))
    moved = tmp_path / "moved"  # the same plan under another path is the same data
    moved.mkdir()
    (moved / "plan.json").write_bytes((shards / "plan.json").read_bytes())
    checkpoint.check_resumable(root, tag, 8, str(moved))


class _FakeEngine:
    """What checkpoint.save/load use of a DeepSpeed engine: a tag directory and the client state back."""

    def save_checkpoint(self, root, tag, client_state):
        os.makedirs(os.path.join(root, tag))
        self.client_state = client_state

    def load_checkpoint(self, root, tag, **kwargs):
        return os.path.join(root, tag), self.client_state


def test_load_restores_the_rng_state_save_stored(tmp_path):
    # The loss-trace resume test draws no random numbers (dropout 0), so check the RNG restore directly.
    engine = _FakeEngine()
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    checkpoint.save(engine, str(tmp_path), 2, "cfg: 1")
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    random.seed(99), np.random.seed(99), torch.manual_seed(99)
    resumed = checkpoint.load(engine, str(tmp_path), checkpoint.tag_for(2))
    assert resumed.next_step == 2
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_prune_never_deletes_the_checkpoint_just_saved_when_later_tags_exist(tmp_path):
    # A run resumed from step 4 while step 10 exists: saving step 6 must keep 6 (the newest of this timeline).
    root = str(tmp_path)
    _make(root, [2, 4, 6, 10])
    checkpoint.prune(root, 2, upto_step=6)
    assert checkpoint.list_tags(root) == [checkpoint.tag_for(s) for s in (4, 6, 10)]


def test_latest_naming_a_missing_checkpoint_is_one_line_naming_what_is_there(tmp_path):
    root = str(tmp_path / "checkpoints")
    _make(root, [2, 4], latest=8)
    with pytest.raises(UserError, match=r"latest names step_00000008, which is not there \(checkpoints there: "
                                         r"step_00000002, step_00000004\); pass one explicitly"):
        checkpoint.find_resume("auto", root)
