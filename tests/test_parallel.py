"""Tests for hbp_train/distributed/groups.py: SP degree validation, the SP groups and each rank's place in the
data-parallel layout (4 gloo processes)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hbp_train.distributed.groups import build_parallel_state, check_sp_degrees, sp_group_ranks, valid_sp_degrees
from hbp_train.common.errors import UserError
from tests.distributed import run_distributed


def test_valid_sp_degrees_are_powers_of_two_dividing_the_world():
    assert valid_sp_degrees(1) == [1]
    assert valid_sp_degrees(8) == [1, 2, 4, 8]
    assert valid_sp_degrees(6) == [1, 2]
    assert valid_sp_degrees(12) == [1, 2, 4]


def test_check_sp_degrees_sorts_adds_one_and_accepts_numpy_ints():
    assert check_sp_degrees([4, 2, 4], 8) == [1, 2, 4]
    assert check_sp_degrees([np.int64(2)], 4) == [1, 2]
    assert check_sp_degrees([], 4) == [1]


@pytest.mark.parametrize("bad, world, match", [
    (3, 4, "sp=3 is not usable with world size 4"),
    (8, 4, "sp=8 is not usable with world size 4"),
    (0, 4, "sp=0 is not usable"),
    (2, 6, None),  # fine: 2 divides 6
    (4, 6, "powers of two that divide the world size \\(1, 2\\)"),
    (2.0, 4, "not an integer"),
    ("2", 4, "not an integer"),
    (True, 4, "not an integer"),
])
def test_check_sp_degrees_rejects_with_one_line(bad, world, match):
    if match is None:
        assert check_sp_degrees([bad], world) == [1, bad]
        return
    with pytest.raises(UserError, match=match) as info:
        check_sp_degrees([bad], world)
    assert "\n" not in str(info.value)


def test_sp_group_ranks_are_consecutive():
    assert sp_group_ranks(5, 4) == [4, 5, 6, 7]
    assert sp_group_ranks(5, 1) == [5]
    assert sp_group_ranks(0, 2) == [0, 1]


def test_single_process_state():
    state = build_parallel_state([1])
    assert state.world_size == 1 and state.sp_degrees == [1]
    assert state.sp_group(1) is None and state.dp_size(1) == 1 and state.dp_rank(1) == 0
    with pytest.raises(UserError, match="sp=2 is not usable with world size 1"):
        build_parallel_state([2])
    with pytest.raises(ValueError, match="sp=2 was not built"):
        state.sp_group(2)


def _groups_worker(rank, world_size):
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    state = build_parallel_state([2, 4])
    members = {}
    for sp in state.sp_degrees:
        # sum of 2**rank over a group identifies exactly which ranks are in it
        group = state.sp_group(sp)
        if group is None:
            members[sp] = [rank]
            continue
        mask = torch.tensor([1 << rank], dtype=torch.int64)
        dist.all_reduce(mask, group=group)
        members[sp] = [r for r in range(world_size) if int(mask) >> r & 1]
    ranks = {sp: (state.sp_rank(sp), state.dp_rank(sp), state.dp_size(sp)) for sp in state.sp_degrees}
    return members, ranks


@pytest.mark.slow
def test_groups_on_four_processes():
    results = run_distributed(_groups_worker, 4)
    for rank, (members, ranks) in enumerate(results):
        for sp in (1, 2, 4):
            assert members[sp] == sp_group_ranks(rank, sp)
            assert ranks[sp] == (rank % sp, rank // sp, 4 // sp)
    # The data-parallel layout (no groups: DeepSpeed averages over all ranks): the ranks with the same SP rank are
    # one per replica, every replica once.
    for sp in (1, 2, 4):
        for sp_rank in range(sp):
            replicas = [ranks[sp][1] for _, ranks in results if ranks[sp][0] == sp_rank]
            assert sorted(replicas) == list(range(4 // sp))


@pytest.mark.parametrize("local_rank, visible, device", [(3, 8, 3), (3, 1, 0), (5, 4, 1), (0, 1, 0)])
def test_each_rank_binds_a_gpu_it_can_see(monkeypatch, local_rank, visible, device):
    """NCCL: LOCAL_RANK modulo the visible GPUs (srun --gpus-per-task=1 shows each task one GPU while LOCAL_RANK
    counts the tasks), and LOCAL_RANK set to that GPU for DeepSpeed's engine, which binds LOCAL_RANK itself."""
    import deepspeed
    import torch

    from hbp_train.distributed import groups

    bound = []
    monkeypatch.setattr(groups.dist, "is_initialized", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_device", bound.append)
    monkeypatch.setattr(deepspeed, "init_distributed", lambda **kwargs: bound.append(kwargs["dist_backend"]))
    for name, value in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="1",
                            LOCAL_RANK=str(local_rank)).items():
        monkeypatch.setenv(name, value)
    groups.init_distributed("nccl")
    assert bound == [device, "nccl"] and os.environ["LOCAL_RANK"] == str(device)
