"""The run folder is checked before any worker trains (hbp_train/runtime/preflight.py), each failure one line naming
train.out_dir and the fix, exit 2:

  - before the workers start (``python -m hbp_train.config``, what ./launch.sh train runs first): a folder that
    holds another run's checkpoints, a read-only folder, a disk without room for one checkpoint;
  - right after torch.distributed starts: ranks that see different folders ("two nodes on one host", each with its
    own train.out_dir, as a node-local disk would be) stop before anything is built, naming the rank.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
from collections import namedtuple
from pathlib import Path

import pytest

from hbp_train import config
from hbp_train.common.errors import UserError
from hbp_train.runtime import checkpoint, preflight
from tests.assets.packed_fixture import ONE_RANK_STEPS, TINY_LLAMA, TWO_RANK_STEPS, synthetic_samples, write_packed
from tests.distributed import run_distributed

REPO = Path(__file__).resolve().parents[1]
VOCAB = 4096
MODEL = json.dumps(TINY_LLAMA).replace('"', "").replace(" ", "")


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_packed(str(tmp_path_factory.mktemp("packed")), synthetic_samples(12, VOCAB, seed=1), ONE_RANK_STEPS,
                        world_size=1)


def _overrides(shards, out, *extra) -> list:
    return ["experiment=cpu_demo", f"data.shards={shards}", f"train.out_dir={out}", f"model.config={MODEL}", *extra]


def _check(argv, capsys) -> tuple:
    """(exit code, stderr) of python -m hbp_train.config ARGV: what ./launch.sh train runs before any worker."""
    code = config.main(argv)
    return code, capsys.readouterr().err


def test_a_folder_holding_another_runs_checkpoints_is_refused_before_the_workers_start(shards, tmp_path, capsys):
    out = tmp_path / "run"
    (out / "checkpoints" / checkpoint.tag_for(4)).mkdir(parents=True)
    code, err = _check(_overrides(shards, out), capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"config error: {out}/checkpoints already holds checkpoints of an earlier run (newest "
                          "step_00000004): continue it with train.resume=auto"), err
    # Continuing it is what it asks for; a checkpoint of another folder would still mix two runs in this one.
    assert _check(_overrides(shards, out, "train.resume=auto"), capsys)[0] == 0
    elsewhere = tmp_path / "other" / "checkpoints" / checkpoint.tag_for(2)
    elsewhere.mkdir(parents=True)
    code, err = _check(_overrides(shards, out, f"train.resume={elsewhere}"), capsys)
    assert code == 2 and "already holds checkpoints of an earlier run" in err
    code, err = _check(_overrides(shards, tmp_path / "fresh", f"train.resume={tmp_path / 'nothing'}"), capsys)
    assert code == 2 and err.count("\n") == 1 and f"train.resume={tmp_path / 'nothing'}: " in err and "no such" in err


def test_no_room_for_one_checkpoint_is_refused_before_the_workers_start(shards, tmp_path, capsys, monkeypatch):
    cfg = config.load(_overrides(shards, tmp_path / "run"))
    need = config._checkpoint_bytes(cfg)
    # ZeRO-2, fp32 weights: 12 B of optimizer state and 4 B of weights per parameter of the model the run builds
    # (its vocabulary the tokenizer's), an RNG file and the tokenizer's files (a real checkpoint's size is compared
    # with it in tests/test_save_faults.py).
    from transformers import AutoTokenizer

    from hbp_train.runtime.resume_config import built_shape

    shape = built_shape(cfg.model)
    assert shape.vocab == len(AutoTokenizer.from_pretrained(cfg.model.tokenizer))
    assert need == 16 * shape.num_params + preflight.RNG_FILE_BYTES + preflight.tokenizer_bytes(cfg.model.tokenizer)
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * need, 9 * need, need - 1))
    code, err = _check(_overrides(shards, tmp_path / "run"), capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert f"train.out_dir={tmp_path / 'run'}: " in err and "free there, and one checkpoint of this model takes about" \
        in err and "choose a train.out_dir on a larger disk" in err
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * need, 8 * need, need))
    assert _check(_overrides(shards, tmp_path / "run"), capsys)[0] == 0


def _as_unprivileged(fn, *args):
    """fn(*args) in a forked child that runs as an unprivileged user when this process is root (root ignores
    permission bits); its return value, or the UserError's text."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no torch work here, only the file-system check
        try:
            os.close(read_end)
            if os.geteuid() == 0:
                os.setgid(65534)
                os.setuid(65534)
            try:
                result = ("ok", fn(*args))
            except UserError as exc:
                result = ("error", str(exc))
            os.write(write_end, pickle.dumps(result))
        finally:
            os._exit(0)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    return pickle.loads(data)


def test_a_read_only_folder_is_refused_before_the_workers_start(shards, tmp_path, capsys, monkeypatch):
    base = Path(tempfile.mkdtemp())  # reachable by the unprivileged user (tmp_path's parents are private)
    try:
        base.chmod(0o777)  # writable by anyone: the folder a run may be created in
        read_only = base / "ro"
        read_only.mkdir(mode=0o555)
        read_only.chmod(0o555)
        for out, where in ((read_only, ""), (read_only / "run", f" (in {read_only}, where it would be created)")):
            status, message = _as_unprivileged(preflight.check_out_dir, str(out), None)
            assert status == "error", message
            assert message == (f"train.out_dir={out}: cannot write there{where}: Permission denied; choose a writable "
                               "train.out_dir")
        assert _as_unprivileged(preflight.check_out_dir, str(base / "run"), None) == ("ok", None)
    finally:
        shutil.rmtree(base)
    # A read-only mount: the OS's own answer to creating a file there, through the config check of a whole run.
    real_open = os.open

    def read_only_mount(path, *args, **kwargs):
        if ".write-probe-" in str(path):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only_mount)
    code, err = _check(_overrides(shards, tmp_path / "run"), capsys)
    assert code == 2 and err.count("\n") == 1, err
    assert err == (f"config error: train.out_dir={tmp_path / 'run'}: cannot write there (in {tmp_path}, where it "
                   "would be created): Read-only file system; choose a writable train.out_dir\n")


def _shared_check(rank, world_size, cases):
    """Each case gives every rank its own train.out_dir; the check's answer (or its one line) per case."""
    import torch.distributed as dist

    from hbp_train.distributed.groups import init_distributed

    init_distributed()
    out = []
    real_read = preflight._read
    for folders, one_way in cases:
        # one_way: rank 1 reads rank 0's folder but writes its own (a view that only goes one way)
        preflight._read = (lambda p: real_read(os.path.join(folders[0], os.path.basename(p)))) \
            if one_way and rank == 1 else real_read
        try:
            token = preflight.check_shared_run_dir(folders[rank])
            dist.barrier()  # every rank has cleaned up after itself
            out.append(("ok", token, sorted(os.listdir(folders[rank]))))
        except UserError as exc:
            out.append(("error", str(exc)))
    return out


@pytest.mark.slow
def test_ranks_that_see_different_run_folders_stop_before_anything_is_built(tmp_path):
    # Two "nodes" on one host: rank 1's train.out_dir is another folder, as a node-local disk would be.
    shared, node0, node1 = (str(tmp_path / name) for name in ("shared", "node0", "node1"))
    os.makedirs(node1)  # existing or not on node 1, it is not the folder rank 0 writes
    results = run_distributed(_shared_check, 2, [([shared, shared], False), ([node0, node1], False),
                                                 ([node0, str(tmp_path / "n1")], False), ([node0, node1], True)])
    (ok0, token0, left0), (ok1, token1, left1) = results[0][0], results[1][0]
    assert ok0 == ok1 == "ok" and token0 == token1 and left0 == left1 == []  # nothing left behind
    import socket

    for case in (1, 2):
        assert results[0][case] == results[1][case]  # the same line on every rank
        status, message = results[0][case]
        assert status == "error" and "\n" not in message
        assert message.startswith(f"train.out_dir={node0}: rank 1 (host {socket.gethostname()}) cannot see the folder "
                                  f"rank 0 (host {socket.gethostname()}) writes (a node-local disk?)")
        assert message.endswith("set train.out_dir to such a folder")
    assert results[0][3] == results[1][3] and results[0][3][1].startswith(
        f"train.out_dir={node0}: rank 0 (host {socket.gethostname()}) cannot see the files rank 1 (host "
        f"{socket.gethostname()}) write there (a node-local disk?)")


@pytest.mark.full
def test_two_torchrun_nodes_with_their_own_folders_stop_in_one_line_before_training(tmp_path):
    """What a cluster does: two torchrun "nodes" on one host (--nnodes 2), each given its own train.out_dir. Before,
    node 1 trained and the first save ended in KeyError: 'hf/chat_template.jinja' and a gloo traceback."""
    shards = write_packed(str(tmp_path / "packed"), synthetic_samples(14, VOCAB, seed=2), TWO_RANK_STEPS,
                          world_size=2)
    from tests.distributed import _free_port

    port = str(_free_port())
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    procs = [subprocess.Popen([sys.executable, "-m", "hbp_train.launch", "--nnodes", "2", "--node_rank", str(node),
                               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", port, "-m",
                               "hbp_train.train", *_overrides(shards, tmp_path / f"node{node}", "logging=quiet",
                                                              "train.save_every=1")],
                              cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in (0, 1)]
    start = time.time()
    outputs = [p.communicate(timeout=300) for p in procs]
    for node, (proc, (stdout, stderr)) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 2, stderr
        assert "Traceback" not in stderr and "KeyError" not in stderr
        lines = [line for line in stderr.splitlines() if line.startswith("[launch]")]
        assert len(lines) == 1 and "rank 1 (host " in lines[0] and "cannot see the folder rank 0" in lines[0], stderr
        assert "set train.out_dir to such a folder" in lines[0]
        assert not (tmp_path / f"node{node}" / "metrics.jsonl").exists()  # no step trained
        assert not (tmp_path / f"node{node}" / "checkpoints").exists()
    assert time.time() - start < 240
