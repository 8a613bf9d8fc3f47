"""A small worker for the launcher's multi-node tests (tests/test_launch_nodes.py), started by hbp_train.launch:
torch.distributed through hbp_train.distributed.groups (its timeouts), an SP group over all ranks, then all-reduces
over it and the world in a loop, as a training step's collectives would.

    python tests/peer_worker.py OUT_DIR SECONDS

Writes OUT_DIR/ready_<rank> after the first all-reduce and OUT_DIR/pid_<rank> (its pid) at start; runs SECONDS, then
exits 0. With HBP_TEST_FAIL_RANK=r, rank r ends at once with a user error (exit 2). A collective that fails because of a peer ends it the way hbp_train.train ends a failure: its one line in
torchrun's error file (train._fail), exit 1. With HBP_TEST_SAVE=1 it waits for SIGTERM and "saves" (sleeps
HBP_TEST_SAVE_SECONDS, then writes OUT_DIR/saved_<rank>), as a trainer's preemption save does.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path


def main() -> None:
    out, seconds = Path(sys.argv[1]), float(sys.argv[2])
    rank = int(os.environ["RANK"])
    (out / f"pid_{rank}").write_text(str(os.getpid()))
    if os.environ.get("HBP_TEST_SAVE") == "1":
        stop = []
        signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
        (out / f"ready_{rank}").write_text("1")
        while not stop:
            time.sleep(0.05)
        time.sleep(float(os.environ.get("HBP_TEST_SAVE_SECONDS", "0")))
        (out / f"saved_{rank}").write_text("1")
        return
    import torch
    import torch.distributed as dist

    from hbp_train.distributed.groups import (build_parallel_state, collective_failure_line, init_distributed,
                                              is_collective_failure)
    from hbp_train.train import _fail

    init_distributed("gloo")
    world = dist.get_world_size()
    state = build_parallel_state([world])
    value = torch.ones(8)
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            dist.all_reduce(value, group=state.sp_group(world))
            dist.all_reduce(value)
            (out / f"ready_{rank}").write_text("1")
            if os.environ.get("HBP_TEST_FAIL_RANK") == str(rank):  # bad input met by this rank alone
                dist.destroy_process_group()  # as train.run's clean-up does
                _fail(f"error: {out}/input.jsonl line 3: no 'messages' field (rank {rank})", 2)
            time.sleep(0.1)
        dist.barrier()
    except Exception as exc:  # noqa: BLE001
        if not is_collective_failure(exc):
            raise
        dist.destroy_process_group()  # as train.run's clean-up does, before the process ends
        _fail(collective_failure_line(exc), 1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
