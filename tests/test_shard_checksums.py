"""Packed shards carry checksums.json (every file's size and xxh3_64, written last by hbp-pack) and the loader checks
it before training: a flipped byte in the token ids or the labels of a real ``hbp-pack`` output stops the open with
one line naming the file and the fix; shards without checksums.json still load, with one warning line; the ranks
share the hashing and all raise the same error."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from data_tools.pack import main as pack
from hbp_train.batches.loader import PackedData
from hbp_train.common.errors import UserError
from hbp_train.batches import shards
from tests.test_planning_shards import tokenized  # noqa: F401  (the fixture: a small tokenized dataset)

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture()
def packed(tmp_path, tokenized):  # noqa: F811
    src, _ = tokenized
    out = tmp_path / "packed"
    assert pack(["--dataset", str(src), "--shards", str(out), "--world-size", "2", "--groups", "64:1,256:2",
                 "--global-tokens", "512", "--quiet"]) == 0
    return out


def _first_row_values(arrow_file: Path, column: str) -> tuple:
    """(byte offset in the file of row 0's ``column`` values, those values): the Arrow stream is read zero-copy from
    the file's bytes, so a buffer's address minus theirs is its place in the file."""
    whole = pa.py_buffer(arrow_file.read_bytes())
    table = pa.ipc.open_stream(pa.BufferReader(whole)).read_all()
    chunk = table.column(column).chunks[0]
    values = chunk.values
    start = chunk.offsets[0].as_py() + values.offset
    data = values.buffers()[1]
    offset = data.address - whole.address + start * 4  # int32 values
    return offset, values.to_numpy()[chunk.offsets[0].as_py():chunk.offsets[1].as_py()]


def _flip(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_hbp_pack_writes_a_checksum_for_every_file(packed):
    listed = json.loads((packed / "checksums.json").read_text())
    assert listed["algorithm"] == "xxh3_64"
    on_disk = sorted(p.relative_to(packed).as_posix() for p in packed.rglob("*")
                     if p.is_file() and p.name != "checksums.json")
    assert sorted(listed["files"]) == on_disk and "plan.json" in on_disk
    assert any(f.startswith("group_") and f.endswith(".arrow") for f in on_disk)
    for rel, entry in listed["files"].items():
        assert entry["bytes"] == (packed / rel).stat().st_size
        assert entry["xxh3_64"] == shards.file_checksum(packed / rel)
    PackedData(str(packed))  # whole: opens without a word


@pytest.mark.parametrize("column", ["input_ids", "labels"])
def test_a_flipped_byte_in_token_ids_or_labels_is_one_line_naming_the_file(packed, tmp_path, column, capsys):
    arrow = sorted((packed / "group_0").glob("*.arrow"))[0]
    offset, values = _first_row_values(arrow, column)
    _flip(arrow, offset)  # the lowest byte of row 0's first value
    _, damaged = _first_row_values(arrow, column)
    assert damaged[0] == values[0] ^ 1 and np.array_equal(damaged[1:], values[1:])

    with pytest.raises(UserError) as err:
        PackedData(str(packed))
    message = str(err.value)
    assert "\n" not in message and str(arrow) in message and "damaged" in message
    assert f"re-run hbp-pack (data_tools.pack --dataset TOKENIZED_DIR --shards {packed})" in message

    # What happened before checksums: the same damaged folder loads and serves the flipped value to the trainer.
    (packed / "checksums.json").unlink()
    data = PackedData(str(packed))
    warning = capsys.readouterr().err.strip().splitlines()
    assert warning == [f"[data] warning: {packed} has no checksums.json (packed by an older hbp-pack): a damaged "
                       f"file would go unnoticed; re-run data_tools.pack --shards {packed} to add it"]
    assert np.array_equal(np.asarray(data.dataset(0)[0][column]), damaged)


def test_a_truncated_or_missing_file_is_named_before_any_hashing(packed):
    arrow = sorted((packed / "group_0").glob("*.arrow"))[0]
    arrow.write_bytes(arrow.read_bytes()[:-10])
    with pytest.raises(UserError, match=r"group_0/.*\.arrow has \d+ bytes, checksums.json says \d+ \(truncated"):
        PackedData(str(packed))
    arrow.unlink()
    with pytest.raises(UserError, match=r"group_0/.*\.arrow is missing; re-run hbp-pack"):
        PackedData(str(packed))


def test_an_edited_plan_is_caught_too(packed):
    plan = packed / "plan.json"
    plan.write_text(plan.read_text().replace('"seed":0', '"seed":7', 1))  # same size: only the hash tells
    with pytest.raises(UserError, match=r"plan.json is damaged \(its xxh3_64 differs from checksums.json\)"):
        PackedData(str(packed))


def test_a_repack_over_checksummed_shards_is_allowed(packed, tokenized):  # noqa: F811
    src, _ = tokenized
    assert pack(["--dataset", str(src), "--shards", str(packed), "--world-size", "2", "--groups", "64:1,256:2",
                 "--global-tokens", "512", "--quiet", "--seed", "1"]) == 0
    PackedData(str(packed))


def test_the_ranks_share_the_files_each_hashed_once():
    files = {f"f{i}": {"bytes": b} for i, b in enumerate([900, 10, 500, 400, 300, 20, 0])}
    shares = [shards.share_of_files(files, r, 3) for r in range(3)]
    assert sorted(f for share in shares for f in share) == sorted(files)
    loads = [sum(files[f]["bytes"] for f in share) for share in shares]
    assert loads == [900, 530, 700]  # largest first, each to the least loaded rank: the largest file bounds it
    assert shards.share_of_files(files, 0, 1) == sorted(files, key=lambda f: (-files[f]["bytes"], f))


def test_the_cli_verifies_and_says_how_fast(packed):
    ok = subprocess.run([sys.executable, "-m", "hbp_train.batches.shards", str(packed)], capture_output=True,
                        text=True, cwd=REPO)
    assert ok.returncode == 0 and ok.stderr == ""
    assert ok.stdout.startswith(f"{packed}: ") and "GB verified in" in ok.stdout and "GB/s, xxh3_64)" in ok.stdout
    arrow = sorted((packed / "group_1").glob("*.arrow"))[0]
    _flip(arrow, _first_row_values(arrow, "input_ids")[0])
    bad = subprocess.run([sys.executable, "-m", "hbp_train.batches.shards", str(packed)], capture_output=True,
                         text=True, cwd=REPO)
    assert bad.returncode == 2 and bad.stdout == "" and bad.stderr.count("\n") == 1
    assert bad.stderr.startswith(f"error: {arrow} is damaged")


def _open_on_rank(rank: int, world_size: int, port: int, folder: str, results) -> None:
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        PackedData(folder)
        results.put((rank, "opened"))
    except UserError as e:
        results.put((rank, str(e)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ranks_share_the_hashing_and_both_stop_on_a_file_only_the_other_hashed(packed):
    import multiprocessing as mp
    import socket

    listed = json.loads((packed / "checksums.json").read_text())["files"]
    theirs = shards.share_of_files(listed, 1, 2)
    victim = next(f for f in theirs if f.endswith(".arrow"))  # hashed by rank 1 only
    _flip(packed / victim, _first_row_values(packed / victim, "labels")[0])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_open_on_rank, args=(r, 2, port, str(packed), results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got[0] == got[1] and got[0].startswith(f"{packed / victim} is damaged")
