"""The one module that creates process groups.

Every SP degree a plan uses is built up front (consecutive ranks form an SP group, so SP stays inside a node).
Switching the SP degree between steps is then a dictionary lookup, never a collective. Nothing else in the code
base calls ``dist.new_group``. No data-parallel groups are made: DeepSpeed averages gradients over all ranks (no
mpu, see model/ulysses.py), and a rank's replica at a degree is plain arithmetic (``dp_rank``).

Every group has a timeout, HBP_PG_TIMEOUT seconds (``collective_timeout``, default 1800): a collective whose peer
froze or vanished fails after it instead of waiting for ever, the rank's process exits, and the launcher names
the node or rank that stopped answering (hbp_train/launch.py). The default process group and the groups DeepSpeed
makes for itself (ZeRO reduces over a clone of the world group, made without a timeout) get it too.

Legend: W = world size, sp = sequence-parallel degree, dp = W // sp data-parallel replicas.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from hbp_train.common.errors import UserError


def rank() -> int:
    """This process's global rank (0 without torch.distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """The number of ranks (1 without torch.distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


PG_TIMEOUT = 1800  # seconds, HBP_PG_TIMEOUT's default: torch's own default for gloo, longer than any save
# The start of the one-line message a rank leaves when a collective failed because of a peer: hbp_train.launch
# then looks for the node or rank that began it.
COLLECTIVE_FAILED = "a collective failed"


def collective_timeout(environ=os.environ) -> timedelta:
    """How long a collective waits for its peers: HBP_PG_TIMEOUT seconds, else DeepSpeed's own DEEPSPEED_TIMEOUT
    (minutes), else PG_TIMEOUT. Long enough for the slowest legitimate wait (ranks waiting at a barrier while one
    saves its share of a checkpoint or verifies the shards), short enough that a frozen node ends the job.
    UserError for anything but a number > 0."""
    text = environ.get("HBP_PG_TIMEOUT", "").strip()
    try:
        if text:
            seconds = float(text)
        elif environ.get("DEEPSPEED_TIMEOUT", "").strip():  # what DeepSpeed itself would have used
            seconds = 60 * float(environ["DEEPSPEED_TIMEOUT"])
        else:
            seconds = float(PG_TIMEOUT)
    except ValueError:
        seconds = -1.0
        text = text or f"(DEEPSPEED_TIMEOUT={environ.get('DEEPSPEED_TIMEOUT')})"
    if not seconds > 0:
        raise UserError(f"HBP_PG_TIMEOUT={text}: not a number of seconds > 0; unset it for the default "
                        f"({PG_TIMEOUT})")
    return timedelta(seconds=seconds)


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective that failed because of a peer (gloo's "Connection closed by peer" or "Timed
    out waiting", NCCL's watchdog timeout, torch's DistError family), not a bug of this rank."""
    if isinstance(exc, dist.DistError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and any(mark in text for mark in (
        "gloo/transport", "Connection closed by peer", "Connection reset by peer", "Timed out waiting",
        "Watchdog caught collective operation timeout", "NCCL communicator was aborted", "ProcessGroupNCCL"))


def collective_failure_line(exc: BaseException) -> str:
    """The one line a rank leaves for the launcher when a collective failed because of a peer."""
    first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    first = first.split("] ", 1)[-1] if first.startswith("[") else first  # gloo prefixes its source file
    first = first.split(". ", 1)[0][:160]  # the error itself, not gloo's advice after it
    return (f"error: {COLLECTIVE_FAILED} on rank {rank()} ({first}); another rank stopped answering "
            "(see the launcher's last line)")


def init_distributed(backend: str | None = None) -> None:
    """Initialise torch.distributed through DeepSpeed, with the CPU switches the trainer needs (gloo without the
    shm comm op's JIT build, a free port for a single process) and every group's timeout (``collective_timeout``).

    Works for a single process without a launcher (world size 1 on a free local port), for torchrun, the
    deepspeed launcher and ``mp.spawn`` with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set.
    """
    if dist.is_available() and dist.is_initialized():
        return
    import deepspeed
    import deepspeed.ops

    # The shm comm op is a ~55 s g++ JIT build on first use; gloo does not need it. Set the table in the module's
    # namespace rather than reading the attribute: reading it runs DeepSpeed's probe of every op, which compiles a
    # test program per op (seconds, and gcc command lines on stdout). Only the shm entry is ever looked up.
    vars(deepspeed.ops).setdefault("__compatible_ops__", {})["deepspeed_shm_comm"] = False
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "gloo"
    if "RANK" not in os.environ:
        # Single process without a launcher: set the env DeepSpeed expects, else it tries MPI discovery.
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(_free_port()))
    if backend == "nccl":  # before the process group exists, so NCCL binds this rank's GPU, not GPU 0
        device = local_cuda_device()
        torch.cuda.set_device(device)
        # DeepSpeed's engine calls set_device(LOCAL_RANK) itself: give it the same, visible, GPU.
        os.environ["LOCAL_RANK"] = str(device)
    timeout = collective_timeout()
    # Groups made without a timeout take torch's module default (30 min for gloo, 10 min for NCCL): DeepSpeed makes
    # its own that way (the clone of the world group ZeRO reduces in), so the default itself is set.
    from torch.distributed import distributed_c10d

    for name in ("default_pg_timeout", "default_pg_nccl_timeout"):
        if isinstance(getattr(distributed_c10d, name, None), timedelta):
            setattr(distributed_c10d, name, timeout)
    deepspeed.init_distributed(dist_backend=backend, verbose=False, timeout=timeout)


def local_cuda_device() -> int:
    """This rank's GPU among those it can see: LOCAL_RANK modulo their number. torchrun shows every process of a
    node all its GPUs (LOCAL_RANK picks one); launchers that show each task only its own GPU (``srun
    --gpus-per-task=1``, a CUDA_VISIBLE_DEVICES per task) number it 0 while LOCAL_RANK still counts the tasks."""
    return int(os.environ.get("LOCAL_RANK", 0)) % max(torch.cuda.device_count(), 1)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def valid_sp_degrees(world_size: int) -> list[int]:
    """Powers of two that divide the world size."""
    return [s for s in (1 << i for i in range(world_size.bit_length())) if world_size % s == 0]


def check_sp_degrees(sp_degrees, world_size: int) -> list[int]:
    """Validate SP degrees against the world size; return them sorted, unique, with 1 always included.

    Raises UserError (one line, naming the degree and the fix) for a degree that is not an integer, is below 1,
    or is not a power of two dividing the world size: an SP group is ``sp`` consecutive ranks, and the ranks
    must split into whole groups.
    """
    degrees = {1}
    for sp in sp_degrees:
        if isinstance(sp, bool) or not hasattr(sp, "__index__"):  # ints and numpy ints, not floats or strings
            raise UserError(f"sp={sp!r} is not an integer; SP degrees are powers of two such as 1, 2, 4")
        sp = sp.__index__()
        if sp < 1 or sp not in valid_sp_degrees(world_size):
            raise UserError(
                f"sp={sp} is not usable with world size {world_size}: SP degrees must be powers of two that "
                f"divide the world size ({', '.join(map(str, valid_sp_degrees(world_size)))})"
            )
        degrees.add(sp)
    return sorted(degrees)


def sp_group_ranks(rank: int, sp: int) -> list[int]:
    """The global ranks of the SP group of degree ``sp`` that ``rank`` belongs to (consecutive ranks)."""
    start = rank - rank % sp
    return list(range(start, start + sp))


@dataclass
class ParallelState:
    """Ranks and groups for every SP degree in use. Built once by :func:`build_parallel_state`."""

    world_size: int
    """W: all ranks."""
    rank: int
    """This rank's global rank."""
    sp_degrees: list[int]
    """Every SP degree built, sorted, 1 included."""
    sp_groups: dict[int, object] = field(default_factory=dict)
    """SP degree -> the SP group this rank belongs to (None for sp == 1: no communication)."""

    def sp_group(self, sp: int):
        """This rank's SP group of degree ``sp`` (None for sp == 1); ValueError for a degree never built."""
        if sp not in self.sp_groups:
            raise ValueError(
                f"sp={sp} was not built by build_parallel_state (built: {', '.join(map(str, self.sp_degrees))}); "
                f"pass every SP degree of the plan's groups to it at start-up"
            )
        return self.sp_groups[sp]

    def sp_rank(self, sp: int) -> int:
        """This rank's position inside its SP group of degree ``sp``."""
        return self.rank % sp

    def dp_rank(self, sp: int) -> int:
        """Which data-parallel replica (= plan replica index) this rank serves at degree ``sp``."""
        return self.rank // sp

    def dp_size(self, sp: int) -> int:
        """Number of data-parallel replicas at degree ``sp``."""
        return self.world_size // sp


def build_parallel_state(sp_degrees: list[int]) -> ParallelState:
    """Create the SP groups of every given degree, on every rank, in the same order.

    ``dist.new_group`` is collective over the whole world: every rank must create every group, including the
    ones it is not a member of, in the same order. That is why this happens once, up front.
    """
    num_ranks, my_rank = world_size(), rank()
    degrees = check_sp_degrees(sp_degrees, num_ranks)
    state = ParallelState(world_size=num_ranks, rank=my_rank, sp_degrees=degrees)
    timeout = collective_timeout()
    for sp in degrees:
        if sp == 1:
            state.sp_groups[1] = None
        else:
            for start in range(0, num_ranks, sp):
                ranks = sp_group_ranks(start, sp)
                group = dist.new_group(ranks, timeout=timeout)
                if my_rank in ranks:
                    state.sp_groups[sp] = group
    return state
