"""Checkpoint bookkeeping without DeepSpeed: tags, resume resolution, pruning, RNG round trip, signal flag.
(Saving/loading through DeepSpeed, exact resume and SIGTERM are in tests/test_trainer.py.)"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from hbp_train.runtime import checkpoint

from hbp_train.runtime import manifest
from hbp_train.common.errors import UserError


def _make(root, steps, latest=None, complete=True):
    """Tag folders for ``steps``; complete ones hold what a resume needs and a manifest."""
    for s in steps:
        tag_dir = os.path.join(root, checkpoint.tag_for(s))
        os.makedirs(tag_dir)
        if complete:
            (Path(tag_dir) / "resume.json").write_text(json.dumps({"next_step": s, "world_size": 1}))
            torch.save(checkpoint.rng_state(), os.path.join(tag_dir, "rng_rank0.pt"))
            manifest.write(tag_dir, s, 1)
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


def test_resume_is_refused_for_another_plan_and_another_world_size_is_left_to_the_elastic_resume(tmp_path):
    shards, other = tmp_path / "shards", tmp_path / "other"
    for d, plan in ((shards, {"steps": [1]}), (other, {"steps": [2]})):
        d.mkdir()
        (d / "plan.json").write_text(json.dumps(plan))
    root = str(tmp_path / "checkpoints")
    _make(root, [4], complete=False)
    tag = checkpoint.tag_for(4)
    with pytest.raises(UserError, match="resume.json: missing, so the world size and plan it was saved with "
                                         "cannot be checked"):
        checkpoint.check_resumable(root, tag, 8, str(other))  # not silently skipped
    with open(os.path.join(root, tag, "resume.json"), "w") as f:
        json.dump({"next_step": 4, "world_size": 8, "data_shards": str(shards),
                   "plan_sha256": checkpoint.plan_fingerprint(str(shards))}, f)
    assert checkpoint.check_resumable(root, tag, 8, str(shards))["world_size"] == 8
    # Another world size is not refused here: the record goes to runtime/elastic.py (tests/test_elastic.py).
    assert checkpoint.check_resumable(root, tag, 16, str(shards))["next_step"] == 4
    with pytest.raises(UserError, match=r"saved with another plan than .*other/plan.json .*step 4 would be other data"):
        checkpoint.check_resumable(root, tag, 8, str(other))
    moved = tmp_path / "moved"  # the same plan under another path is the same data
    moved.mkdir()
    (moved / "plan.json").write_bytes((shards / "plan.json").read_bytes())
    checkpoint.check_resumable(root, tag, 8, str(moved))


class _TorchCheckpointEngine:
    """DeepSpeed's checkpoint engine as far as saving goes: every file of the engine is written through ``save``."""

    def save(self, state_dict, path):
        torch.save(state_dict, path)


class _FakeEngine:
    """What checkpoint.save/load use of a DeepSpeed engine: a tag directory with its shard files (the model states
    on rank 0, an optimizer shard per rank), written through its checkpoint engine, and the client state back.
    ``fail`` makes the save raise (a full disk); ``after_save(tag_dir)`` runs once the engine has written its files
    (something deleting one); ``skips`` names a file DeepSpeed's naming says this rank saves that it never writes."""

    def __init__(self, fail=None, after_save=None, skips=None):
        self.fail, self.after_save, self.skips = fail, after_save, skips
        self.checkpoint_engine = _TorchCheckpointEngine()
        self.save_zero_checkpoint = skips is not None

    def _get_zero_ckpt_name(self, root, tag):
        return os.path.join(root, tag, self.skips)

    def save_checkpoint(self, root, tag, client_state, save_latest=True):
        assert not save_latest  # `latest` is ours to move, after the manifest
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        os.makedirs(os.path.join(root, tag), exist_ok=True)
        if rank == 0:
            self.checkpoint_engine.save({"w": torch.arange(1000.0)},
                                        os.path.join(root, tag, "mp_rank_00_model_states.pt"))
        if self.fail is not None:
            raise self.fail
        self.checkpoint_engine.save({"m": torch.arange(10.0)},
                                    os.path.join(root, tag, f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"))
        if self.after_save is not None:
            self.after_save(os.path.join(root, tag))
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


def test_latest_naming_a_missing_checkpoint_falls_back_with_a_warning(tmp_path):
    root = str(tmp_path / "checkpoints")
    engine = _FakeEngine()
    for step in (2, 4):
        checkpoint.save(engine, root, step, "cfg: 1")
    with open(os.path.join(root, "latest"), "w") as f:
        f.write(checkpoint.tag_for(8))
    warnings = []
    assert checkpoint.find_resume("auto", root, warn=warnings.append) == (root, checkpoint.tag_for(4))
    assert len(warnings) == 1 and "latest names 'step_00000008', which is not there" in warnings[0]


def test_a_save_is_published_only_by_its_manifest_and_then_latest(tmp_path, monkeypatch):
    root = str(tmp_path)
    engine = _FakeEngine()
    checkpoint.save(engine, root, 2, "cfg: 1")
    tag_dir = os.path.join(root, checkpoint.tag_for(2))
    with open(os.path.join(tag_dir, manifest.MANIFEST)) as f:
        record = json.load(f)
    files = sorted(manifest.tag_files(tag_dir))
    assert sorted(record["files"]) == files and {"resume.json", "rng_rank0.pt", "config.yaml",
                                                 "mp_rank_00_model_states.pt"} <= set(files)
    for rel, entry in record["files"].items():
        data = Path(tag_dir, rel).read_bytes()
        assert entry == {"bytes": len(data), "crc32": zlib.crc32(data)}
    assert Path(root, "latest").read_text() == checkpoint.tag_for(2)

    # A crash after every file is written but before the manifest: nothing is published.
    def crash(*args):
        raise KeyboardInterrupt

    monkeypatch.setattr(manifest, "write", crash)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.save(engine, root, 4, "cfg: 1")
    assert Path(root, "latest").read_text() == checkpoint.tag_for(2)
    assert not manifest.has_manifest(os.path.join(root, checkpoint.tag_for(4)))
    monkeypatch.undo()
    warnings = []
    assert checkpoint.find_resume("auto", root, warn=warnings.append) == (root, checkpoint.tag_for(2))
    assert warnings == []  # latest names the complete one: the unfinished step 4 is newer, never tried
    checkpoint.save(engine, root, 4, "cfg: 1")  # the same step again: the unfinished folder is replaced
    assert checkpoint.find_resume("auto", root) == (root, checkpoint.tag_for(4))


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete_rng", "delete_manifest", "delete_resume"])
def test_auto_resume_falls_back_past_a_damaged_checkpoint_and_a_named_one_is_one_line(tmp_path, damage):
    root = str(tmp_path)
    engine = _FakeEngine()
    for step in (2, 4):
        checkpoint.save(engine, root, step, "cfg: 1")
    newest = Path(root, checkpoint.tag_for(4))
    shard = newest / "mp_rank_00_model_states.pt"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-100])
    elif damage == "flip":  # same size, one byte changed: only the checksum sees it
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    else:
        (newest / {"delete_rng": "rng_rank0.pt", "delete_manifest": manifest.MANIFEST,
                   "delete_resume": "resume.json"}[damage]).unlink()
    named = {"truncate": "mp_rank_00_model_states.pt has", "flip": "mp_rank_00_model_states.pt: its CRC-32",
             "delete_rng": "rng_rank0.pt is missing", "delete_manifest": "no manifest.json",
             "delete_resume": "resume.json is missing"}[damage]
    warnings = []
    assert checkpoint.find_resume("auto", root, warn=warnings.append) == (root, checkpoint.tag_for(2))
    assert len(warnings) == 1 and "\n" not in warnings[0] and named in warnings[0]
    assert warnings[0].endswith("resuming from the newest complete checkpoint, step_00000002")
    with pytest.raises(UserError, match=named) as info:
        checkpoint.find_resume(str(newest), root)
    assert "\n" not in str(info.value)
    # Nothing complete left: one line, not a fresh start over the remains.
    shutil.rmtree(os.path.join(root, checkpoint.tag_for(2)))
    with pytest.raises(UserError, match="no complete checkpoint in"):
        checkpoint.find_resume("auto", root)


def test_keep_last_counts_complete_checkpoints_only(tmp_path):
    root = str(tmp_path)
    _make(root, [2], latest=2)
    _make(root, [4, 6], complete=False)  # two saves cut short after step 2
    checkpoint.prune(root, 1, upto_step=6)
    assert checkpoint.list_tags(root) == [checkpoint.tag_for(s) for s in (2, 4, 6)]  # the only complete one stays
    _make(root, [8])
    checkpoint.prune(root, 1, upto_step=8)
    assert checkpoint.list_tags(root) == [checkpoint.tag_for(8)]  # the unfinished ones went with the older one


@pytest.mark.parametrize("failure", [OSError(errno.ENOSPC, "No space left on device"),
                                     RuntimeError("[enforce fail at inline_container.cc:672] . PytorchStreamWriter "
                                                  "failed writing file data/0: file write failed"),
                                     # A full disk as torch.save reported it in a real run: no "write" in it.
                                     RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1088 vs "
                                                  "1040")])
def test_a_full_disk_during_a_save_is_one_line_and_leaves_it_unpublished(tmp_path, failure):
    root = str(tmp_path)
    checkpoint.save(_FakeEngine(), root, 2, "cfg: 1")
    with pytest.raises(UserError) as info:
        checkpoint.save(_FakeEngine(fail=failure), root, 4, "cfg: 1")
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"saving checkpoint {root}/step_00000004 failed (")
    assert "GiB free there); it is left unpublished" in message
    assert Path(root, "latest").read_text() == checkpoint.tag_for(2)
    assert not manifest.has_manifest(os.path.join(root, checkpoint.tag_for(4)))
    assert checkpoint.find_resume("auto", root, warn=lambda line: None) == (root, checkpoint.tag_for(2))


def test_the_rng_file_loads_without_unpickling_code(tmp_path):
    root = str(tmp_path)
    engine = _FakeEngine()
    checkpoint.save(engine, root, 2, "cfg: 1")
    rng_path = os.path.join(root, checkpoint.tag_for(2), "rng_rank0.pt")
    torch.load(rng_path, weights_only=True)  # what was saved needs no allow-list
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"python": Payload()}, rng_path)
    with pytest.raises(UserError, match=r"rng_rank0.pt: not an RNG state this trainer saved"):
        checkpoint.load(engine, root, checkpoint.tag_for(2))
    assert not marker.exists()
    os.remove(rng_path)
    with pytest.raises(UserError, match=r"rng_rank0.pt: missing"):
        checkpoint.load(engine, root, checkpoint.tag_for(2))


def test_a_bug_in_a_save_keeps_its_traceback(tmp_path):
    # Only a failed write, a file gone and a peer lost are the user's one line; anything else is ours to fix.
    with pytest.raises(RuntimeError, match="expected a tensor"):
        checkpoint.save(_FakeEngine(fail=RuntimeError("expected a tensor")), str(tmp_path), 2, "cfg: 1")


@pytest.mark.parametrize("how", ["deleted", "never_written"])
def test_a_checkpoint_missing_a_file_is_never_published(tmp_path, how):
    """The manifest lists what the save wrote and what it must have, not what happens to be there: a model-states
    file deleted during the save (or an optimizer shard DeepSpeed's naming expects but the engine never wrote) leaves
    the checkpoint unpublished, latest on the previous one, which resume=auto takes."""
    root = str(tmp_path)
    checkpoint.save(_FakeEngine(), root, 2, "cfg: 1")
    if how == "deleted":
        engine = _FakeEngine(after_save=lambda tag_dir: os.remove(os.path.join(tag_dir, "mp_rank_00_model_states.pt")))
        gone = "mp_rank_00_model_states.pt, written by rank 0, is missing"
    else:
        engine = _FakeEngine(skips="bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
        gone = "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt, written by rank 0, is missing"
    with pytest.raises(UserError) as info:
        checkpoint.save(engine, root, 4, "cfg: 1")
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"saving checkpoint {root}/step_00000004 failed: {root}/"
                                                      f"step_00000004/{gone}")
    assert message.endswith(f"it is left unpublished and {root}/latest still names the previous complete checkpoint, "
                            "step_00000002: resume with train.resume=auto")
    assert Path(root, "latest").read_text() == checkpoint.tag_for(2)
    assert not manifest.has_manifest(os.path.join(root, checkpoint.tag_for(4)))
    warnings = []
    assert checkpoint.find_resume("auto", root, warn=warnings.append) == (root, checkpoint.tag_for(2))
    assert warnings == []


def test_the_manifest_lists_every_ranks_files_and_the_tokenizers(tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer

    root = str(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    checkpoint.save(_FakeEngine(), root, 2, "cfg: 1", tokenizer=tokenizer)
    tag_dir = os.path.join(root, checkpoint.tag_for(2))
    with open(os.path.join(tag_dir, manifest.MANIFEST)) as f:
        listed = set(json.load(f)["files"])
    saved = {os.path.join("hf", name) for name in os.listdir(os.path.join(tag_dir, "hf"))}
    assert "hf/tokenizer_config.json" in saved and saved <= listed
    assert {"mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt", "rng_rank0.pt",
            "resume.json", "config.yaml"} <= listed


def _two_rank_saves(rank, world_size, root):
    import torch.distributed as dist

    from hbp_train.distributed.groups import init_distributed

    init_distributed()
    out = {}
    # Node-local folders: each rank saves into a folder only it sees (the same path on two disks of two nodes).
    own = os.path.join(root, f"node{rank}", "checkpoints")
    try:
        checkpoint.save(_FakeEngine(), own, 2, "cfg: 1")
        out["local"] = "saved"
    except UserError as exc:
        out["local"] = str(exc)
    out["local_published"] = os.path.exists(os.path.join(own, "latest"))
    # One shared folder, whose disk fills up as rank 1 writes its shard: rank 1 stops with the one line; rank 0,
    # waiting for it inside the save, says a peer stopped (and leaves the checkpoint unpublished).
    shared = os.path.join(root, "common", "checkpoints")
    try:
        checkpoint.save(_FakeEngine(fail=OSError(errno.ENOSPC, "No space left on device") if rank == 1 else None),
                        shared, 2, "cfg: 1")
        out["peer"] = "saved"
    except UserError as exc:
        out["peer"] = str(exc)
    if rank == 1:
        dist.destroy_process_group()  # this rank is gone, as a failed worker would be
    return out


@pytest.mark.slow
def test_two_ranks_that_cannot_finish_a_save_say_so_in_one_line_each(tmp_path):
    from tests.distributed import run_distributed

    results = run_distributed(_two_rank_saves, 2, str(tmp_path))
    # Before: KeyError: 'hf/...' on rank 0 (the ranks listed different files) and a gloo traceback on rank 1.
    assert results[0]["local"] != "saved" and not results[0]["local_published"] and not results[1]["local_published"]
    for rank in (0, 1):
        message = results[rank]["local"]
        assert "\n" not in message and message.startswith(f"saving checkpoint {tmp_path}/node{rank}/checkpoints/"
                                                          "step_00000002 failed: ")
        assert "is missing where rank" in message and "(a folder not every rank shares" in message
    # The same file, writer and reader named on both ranks (rank 0's path).
    assert results[0]["local"].split(" failed: ")[1].split(" (a folder")[0] == \
        results[1]["local"].split(" failed: ")[1].split(" (a folder")[0]
    assert results[1]["peer"].startswith(f"saving checkpoint {tmp_path}/common/checkpoints/step_00000002 failed "
                                         "(No space left on device; ")
    assert results[0]["peer"] == (f"saving checkpoint {tmp_path}/common/checkpoints/step_00000002 did not finish: "
                                  "another rank stopped during the save (its own line says why); it is left "
                                  "unpublished and no checkpoint of this run is complete yet: resume with "
                                  "train.resume=auto")
    assert not (tmp_path / "common" / "checkpoints" / "latest").exists()
