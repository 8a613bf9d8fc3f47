"""hbp_train.distributed.groups: every process group gets HBP_PG_TIMEOUT (SP groups, the default group and the
groups DeepSpeed makes without one), a bad value is one line, and a collective that failed because of a peer is told
from a bug and becomes one line for the launcher. The frozen-peer run itself is in tests/test_launch_nodes.py."""

from __future__ import annotations

import datetime
import os

import pytest

from hbp_train.distributed import groups
from hbp_train.common.errors import UserError


def test_timeout_from_the_environment_or_the_default():
    assert groups.collective_timeout({}) == datetime.timedelta(seconds=groups.PG_TIMEOUT) == \
        datetime.timedelta(minutes=30)
    assert groups.collective_timeout({"HBP_PG_TIMEOUT": "12.5"}) == datetime.timedelta(seconds=12.5)
    assert groups.collective_timeout({"DEEPSPEED_TIMEOUT": "5"}) == datetime.timedelta(minutes=5)  # DeepSpeed's own
    assert groups.collective_timeout({"DEEPSPEED_TIMEOUT": "5", "HBP_PG_TIMEOUT": "9"}) == datetime.timedelta(seconds=9)
    for bad in ("0", "-3", "soon"):
        with pytest.raises(UserError, match=f"HBP_PG_TIMEOUT={bad}: not a number of seconds > 0"):
            groups.collective_timeout({"HBP_PG_TIMEOUT": bad})


def test_peer_failures_are_told_from_bugs_and_say_one_line():
    closed = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
                          "[127.0.0.1]:12182. This is typically caused by a remote worker crashing. GLHF!")
    timed_out = RuntimeError("[/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
                             "3000ms for recv operation to complete")
    assert groups.is_collective_failure(closed) and groups.is_collective_failure(timed_out)
    assert not groups.is_collective_failure(RuntimeError("shape mismatch")) and \
        not groups.is_collective_failure(ValueError("Timed out waiting"))
    assert groups.collective_failure_line(closed) == (
        "error: a collective failed on rank 0 (Connection closed by peer [127.0.0.1]:12182); another rank stopped "
        "answering (see the launcher's last line)")


def _groups_on_rank(rank: int, port: int, results) -> None:
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), HBP_PG_TIMEOUT="7")
    groups.init_distributed("gloo")
    from deepspeed.utils.groups import _clone_world_group

    import torch

    state = groups.build_parallel_state([2])
    seen = {name: group._get_backend(torch.device("cpu")).options._timeout
            for name, group in (("default", dist.group.WORLD), ("sp", state.sp_group(2)),
                                ("deepspeed", _clone_world_group()))}
    results.put((rank, {k: v.total_seconds() for k, v in seen.items()}))
    dist.destroy_process_group()


@pytest.mark.slow
def test_every_group_gets_the_timeout(tmp_path):
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_groups_on_rank, args=(r, port, results)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert got[0] == got[1] == {"default": 7.0, "sp": 7.0, "deepspeed": 7.0}
