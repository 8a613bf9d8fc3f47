"""The run folder checked before any worker trains: writable, room for a checkpoint, not another run's, and the
same folder on every rank.

A run that cannot save loses every step it trained: a read-only folder, a full disk or a node-local folder used to
be found at the first save (``save_every=0``: at the end). These checks move that to the start, each one line
naming ``train.out_dir`` and the fix (exit 2). Two moments:

- **Before the workers start** (``check_out_dir``; ``config.check_paths`` calls it, which ``./launch.sh train``
  runs before starting any worker and every worker runs before Hydra creates the folder): the folder, or the
  nearest folder above it that exists, takes a new file (a probe file is created and removed: permission bits say
  nothing about a read-only mount or a root-squashed share); its file system has room for one checkpoint
  (``checkpoint_bytes``: the files DeepSpeed writes for the model's weights and optimizer state at its ZeRO stage,
  from the model's config and its tokenizer, no weights read); and a run that
  does not resume from the checkpoints already there is refused (they would mix with its own).
- **Right after torch.distributed starts** (``check_shared_run_dir``, collective): rank 0 writes a token file in
  the folder and every rank reads it back and writes a probe file of its own, which rank 0 must see. A rank on
  another node whose ``train.out_dir`` is a node-local disk sees no token: every rank then stops with the same line
  naming that rank and its host, before anything is built.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
from typing import Optional

from hbp_train.common.errors import UserError
from hbp_train.runtime import checkpoint

TOKEN_PREFIX = ".rank0-token-"
"""Rank 0's token file in the run folder (removed when the check ends)."""

OPTIMIZER_BYTES = 12
"""Optimizer bytes per trained parameter in a checkpoint: the fp32 master weight and Adam's two fp32 moments, in the
optimizer files of all ranks together."""
RNG_FILE_BYTES = 16 << 10
"""One rank's rng_rank<r>.pt (python, numpy and torch generator states)."""
LORA_MODULES = {"q_proj": ("hidden", "attn_width"), "k_proj": ("hidden", "k_width"), "v_proj": ("hidden", "v_width"),
                "o_proj": ("out_width", "hidden"), "gate_proj": ("hidden", "ffn"), "up_proj": ("hidden", "ffn"),
                "down_proj": ("ffn", "hidden")}
"""A decoder layer's linear modules LoRA adapts by default, as (input width, output width) of perf.shape.ModelShape."""


def checkpoint_bytes(num_params: int, zero_stage: int, weight_bytes: int, world_size: int = 1,
                     trained_params: Optional[int] = None, other_bytes: int = 0) -> int:
    """About how many bytes one checkpoint takes on disk, file by file as DeepSpeed and checkpoint.save write them:

    - the model states: below ZeRO-3 rank 0's ``mp_rank_00_model_states.pt`` holds every weight in its own dtype
      (``weight_bytes``: 2 for bf16, 4 for fp32), frozen ones included; at ZeRO-3 each rank's
      ``zero_pp_rank_<r>_mp_rank_00_model_states.pt`` holds shapes and its share of the frozen weights only;
    - the optimizer states: each rank's ``*zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` holds its partition of the
      trained parameters (``trained_params``, default all): OPTIMIZER_BYTES each, all ranks together, at every stage;
    - an RNG file per rank, and ``other_bytes`` (the tokenizer and model config in hf/; config and ledger are small).

    tests/test_save_faults.py compares it with the bytes real checkpoints take."""
    trained = num_params if trained_params is None else trained_params
    weights = num_params if zero_stage < 3 else num_params - trained
    return weight_bytes * weights + OPTIMIZER_BYTES * trained + RNG_FILE_BYTES * world_size + other_bytes


def lora_params(shape, r: int, target_modules: Optional[list] = None, dora: bool = False) -> int:
    """About how many parameters LoRA adapters of rank ``r`` add to a model of ``shape`` (perf.shape.ModelShape):
    r x (input + output width) per adapted linear module of every layer (DoRA: + its output width), over the
    modules of LORA_MODULES that ``target_modules`` names (None: all)."""
    widths = {"hidden": shape.hidden, "attn_width": shape.attn_width, "out_width": shape.out_width,
              "k_width": shape.num_kv_heads * shape.head_dim, "v_width": shape.num_kv_heads * shape.v_head_dim,
              "ffn": shape.ffn}
    per_layer = 0
    for name, (fan_in, fan_out) in LORA_MODULES.items():
        if target_modules is None or name in target_modules:
            per_layer += r * (widths[fan_in] + widths[fan_out]) + (widths[fan_out] if dora else 0)
    return per_layer * shape.num_layers


def tokenizer_bytes(folder: Optional[str]) -> int:
    """The bytes of a tokenizer folder's files that a checkpoint's hf/ copies (everything but weights)."""
    weights = (".safetensors", ".bin", ".pt", ".pth", ".h5", ".msgpack", ".gguf", ".onnx")
    try:
        names = os.listdir(folder) if folder else []
    except OSError:
        return 0
    paths = [os.path.join(folder, n) for n in names if not n.endswith(weights)]
    return sum(os.path.getsize(p) for p in paths if os.path.isfile(p))


def _existing_folder(path: str) -> str:
    """``path`` or the nearest folder above it that exists (where a new run folder would be created)."""
    path = os.path.abspath(path)
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


def write_problem(folder: str) -> Optional[str]:
    """Why a new file cannot be created in ``folder`` (the OS's reason), or None: a probe file is created and
    removed, which also sees a read-only mount, a full quota or a root-squashed share."""
    probe = os.path.join(folder, f".write-probe-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    os.close(fd)
    try:
        os.remove(probe)
    except OSError:
        pass
    return None


def check_out_dir(out_dir: str, resume: Optional[str], need_bytes: int = 0) -> None:
    """UserError (one line naming train.out_dir) when the run folder is not writable, has no room for one
    checkpoint of ``need_bytes``, or holds another run's checkpoints that this run would not resume from. Cheap
    (no collective, no checkpoint read): run before the workers start."""
    folder = _existing_folder(out_dir)
    if not os.path.isdir(folder):
        raise UserError(f"train.out_dir={out_dir}: {folder} is a file, not a folder; choose another train.out_dir")
    why = write_problem(folder)
    if why is not None:
        where = "" if folder == os.path.abspath(out_dir) else f" (in {folder}, where it would be created)"
        raise UserError(f"train.out_dir={out_dir}: cannot write there{where}: {why}; choose a writable "
                        "train.out_dir")
    if need_bytes > 0:
        free = shutil.disk_usage(folder).free
        if free < need_bytes:
            raise UserError(f"train.out_dir={out_dir}: {_size(free)} free there, and one checkpoint of this model "
                            f"takes about {_size(need_bytes)}: free space, or choose a train.out_dir on a larger disk")
    ckpt_root = os.path.join(out_dir, "checkpoints")
    if resume not in (None, "auto"):
        try:
            found = checkpoint.resolve(resume)
        except UserError as exc:
            raise UserError(f"train.resume={resume}: {exc}") from None
    else:
        found = (ckpt_root, None) if resume == "auto" else None
    checkpoint.check_fresh_root(ckpt_root, found)


def _size(num_bytes: int) -> str:
    return f"{num_bytes / 2**30:.1f} GiB" if num_bytes >= 2**30 else f"{num_bytes / 2**20:.1f} MiB"


def _describe(ranks: list, hosts: list) -> str:
    """``rank 1 (host b)`` or ``ranks 1, 3 (hosts b, c)``."""
    names = sorted(set(hosts), key=hosts.index)
    return (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
            f"(host{'s' if len(names) > 1 else ''} {', '.join(names)})")


def check_shared_run_dir(out_dir: str) -> str:
    """Every rank sees the run folder rank 0 writes and can write there: UserError (the same line on every rank)
    naming the ranks that cannot. Collective under torch.distributed; call it right after the process group
    starts, before anything is built. Returns rank 0's token (the same on every rank; it names this run)."""
    import torch.distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1
    host = socket.gethostname()
    token_path = None
    answer = [None, None, out_dir]  # [token, rank 0's problem, rank 0's folder: the one every message names]
    if rank == 0:
        token = secrets.token_hex(8)
        token_path = os.path.join(out_dir, TOKEN_PREFIX + token)
        try:
            os.makedirs(out_dir, exist_ok=True)
            with open(token_path, "w") as f:
                f.write(token)
            answer = [token, None, out_dir]
        except OSError as exc:
            answer = [None, f"train.out_dir={out_dir}: rank 0 (host {host}) cannot write there: {exc.strerror}; "
                            "choose a writable train.out_dir", out_dir]
    if distributed:
        dist.broadcast_object_list(answer, src=0)
    token, failed, named = answer  # messages name rank 0's folder, so that every rank prints the same line
    if failed is not None:
        raise UserError(failed)
    probe = os.path.join(out_dir, f"{TOKEN_PREFIX}{token}.rank{rank}")
    try:
        sees = _read(os.path.join(out_dir, TOKEN_PREFIX + token)) == token
        write_error = _touch(probe) if sees else None
        views = _gather((rank, host, sees, write_error), distributed, world)
        host0 = views[0][1]
        unseen = [v for v in views if not v[2]]
        if unseen:
            raise UserError(f"train.out_dir={named}: {_describe([v[0] for v in unseen], [v[1] for v in unseen])} "
                            f"cannot see the folder rank 0 (host {host0}) writes (a node-local disk?): every rank "
                            "saves its part of each checkpoint there, so the run folder must be on a file system all "
                            "nodes share, at the same path; set train.out_dir to such a folder")
        unwritable = [v for v in views if v[3] is not None]
        if unwritable:
            raise UserError(f"train.out_dir={named}: {_describe([v[0] for v in unwritable], [v[1] for v in unwritable])} "
                            f"cannot write there ({unwritable[0][3]}); choose a train.out_dir every rank can write")
        # What each rank writes must reach rank 0, which checksums and publishes every checkpoint.
        missing = [r for r in range(world) if rank == 0 and not os.path.isfile(
            os.path.join(out_dir, f"{TOKEN_PREFIX}{token}.rank{r}"))]
        missing = _broadcast(missing, distributed)
        if missing:
            raise UserError(f"train.out_dir={named}: rank 0 (host {host0}) cannot see the files "
                            f"{_describe(missing, [views[r][1] for r in missing])} write there (a node-local disk?): "
                            "the run folder must be on a file system all nodes share, at the same path; set "
                            "train.out_dir to such a folder")
    finally:
        for path in (probe, token_path):
            if path is not None:
                try:
                    os.remove(path)
                except OSError:
                    pass
    return token


def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except (OSError, UnicodeDecodeError):
        return None


def _touch(path: str) -> Optional[str]:
    try:
        with open(path, "w") as f:
            f.write("")
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return None


def _gather(value, distributed: bool, world: int) -> list:
    if not distributed:
        return [value]
    import torch.distributed as dist

    out = [None] * world
    dist.all_gather_object(out, value)
    return out


def _broadcast(value, distributed: bool):
    if not distributed:
        return value
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
