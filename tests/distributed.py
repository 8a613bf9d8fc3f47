"""Run a function in N fresh CPU processes with gloo and collect each rank's return value.

Used by every distributed test: the result of the N-process run is compared against a single-process
reference computed in the test itself.

The processes come from multiprocessing's fork server, which imports torch, DeepSpeed, transformers and the
trainer once per test session: a process spawned from scratch spends seconds importing them, and the suite starts
dozens. The server only imports (no thread, no process group, no device), so each forked process starts as a
spawned one would; it gets the test's environment as it is at the call (a forked process would otherwise have the
server's).
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import socket
import sys
import tempfile
import traceback

import torch.multiprocessing as mp

PRELOAD = ["torch", "deepspeed", "transformers", "datasets", "hbp_train.trainer", "tests.distributed"]
multiprocessing.set_forkserver_preload(PRELOAD)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, out_dir: str, environ: dict, fn, args) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
    )
    import torch

    torch.set_num_threads(1)
    try:
        result = fn(rank, world_size, *args)
        payload = ("ok", result)
    except BaseException:  # report the failure to the parent test instead of a silent hang
        payload = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(payload, f)
    try:
        import torch.distributed as dist

        if dist.is_initialized():
            if payload[0] == "ok":  # no rank tears gloo down while a peer still talks to it
                dist.barrier()
            dist.destroy_process_group()
    except Exception:
        pass
    # The result is on disk; leave without the interpreter's teardown, where gloo's C++ threads have been seen
    # to abort ("terminate called without an active exception") on a loaded machine after a clean run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn, world_size: int, *args, timeout: float = 240.0) -> list:
    """Spawn ``world_size`` processes running ``fn(rank, world_size, *args)``; return the list of results.

    ``fn`` must be importable (defined at module level). Raises with the failing rank's traceback.
    """
    with tempfile.TemporaryDirectory() as out_dir:
        ctx = mp.start_processes(
            _worker, args=(world_size, _free_port(), out_dir, dict(os.environ), fn, args), nprocs=world_size,
            join=False, start_method="forkserver",
        )
        import time

        deadline = time.time() + timeout
        while not ctx.join(timeout=1.0):
            if time.time() > deadline:
                for p in ctx.processes:
                    p.kill()
                raise TimeoutError(f"distributed test did not finish in {timeout} s")
        results = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} wrote no result")
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results
