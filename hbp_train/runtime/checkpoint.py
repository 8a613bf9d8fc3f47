"""Checkpoints: periodic and on SIGTERM/SIGINT saves, and resuming at the exact plan step with the same RNG state.

Layout under ``CKPT_ROOT`` (= RUN_DIR/checkpoints):

    latest                      the newest complete tag; moved only after that tag's manifest.json is written
    step_00000012/              one tag: DeepSpeed's model/optimizer shards of every rank, plus
        rng_rank<r>.pt          each rank's python/numpy/torch(/cuda) RNG state, tensors and plain values only
                                (loaded with torch.load(weights_only=True))
        config.yaml             the resolved run config
        resume.json             what a resume must match: world size and the plan's fingerprint (read before any
                                model is built, so a mismatch is one line, not a failed DeepSpeed load), the
                                epoch of next_step and, for a run resumed on another number of ranks, its re-plan
        ledger.npz              the sample ledger: which samples every step so far trained (runtime/ledger.py)
        hf/                     the model's HF config and the tokenizer (what export needs besides the weights)
        manifest.json           written last, after every rank has saved: every file's size and CRC-32
                                (hbp_train/runtime/manifest.py); a tag without it is a save that did not finish

``client_state`` holds ``next_step`` (the global step to run next) and the config. Resuming verifies the checkpoint
against its manifest, loads the DeepSpeed state (weights, optimizer, LR schedule), restores every rank's RNG state
and continues at ``next_step``, so a resumed run reproduces the uninterrupted run's loss trace. ``train.resume=auto``
falls back to the newest complete checkpoint, with a one-line warning, when the newest is damaged or unfinished;
a checkpoint named explicitly must be whole (a one-line error names the damaged file). docs/reliability.md.

Every save also carries DeepSpeed's ``universal_checkpoint_info``, which its ``ds_to_universal`` needs to turn the
checkpoint into one any number of ranks can load: a resume on another world size (runtime/elastic.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import random
import re
import shutil
import signal
import time
from typing import NamedTuple, Optional

import numpy as np
import torch
import torch.distributed as dist

from hbp_train.runtime import manifest
from hbp_train.runtime.ledger import FILE as LEDGER_FILE
from hbp_train.common.errors import UserError

TAG_RE = re.compile(r"^step_(\d+)$")
# In every save's client_state: what DeepSpeed's ds_to_universal requires to convert it (runtime/elastic.py).
UNIVERSAL_INFO = {"universal_checkpoint_info": {"universal_checkpoint_version": 0.2}}


def tag_for(step: int) -> str:
    """The tag of a checkpoint taken after ``step`` steps have run."""
    return f"step_{step:08d}"


def rng_state() -> dict:
    """This process's RNG states as tensors, ints and tuples only: what torch.load(weights_only=True) accepts
    without an allow-list (numpy's state is a numpy array, so its key goes in as a tensor)."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                       "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)}}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


class Resumed(NamedTuple):
    """What a checkpoint tells the training loop besides the engine state."""

    next_step: int
    """The global step to run next."""
    total_steps: Optional[int]
    """The run length it was saved with (None for checkpoints that predate the field)."""
    counters: dict
    """Run-long counters (skipped steps, SP token totals) so live metrics continue instead of restarting."""


def plan_fingerprint(shards: str) -> str:
    """sha256 (16 hex digits) of a packed-shard directory's plan (plan.npz or plan.json): which steps "step n"
    means."""
    npz = os.path.join(shards, "plan.npz")
    with open(npz if os.path.isfile(npz) else os.path.join(shards, "plan.json"), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def check_resumable(ckpt_root: str, tag: str, world_size: int, shards: str) -> dict:
    """The checkpoint's resume record (resume.json); UserError (one line) when it was saved with another plan: its
    next_step would point into different data. A missing resume.json is an error too: without it none of this can
    be checked. Another world size is not refused here: runtime/elastic.py resumes it, or says why it cannot."""
    path = os.path.join(ckpt_root, tag, "resume.json")
    if not os.path.isfile(path):
        raise UserError(f"{path}: missing, so the world size and plan it was saved with cannot be checked; the "
                        "checkpoint is incomplete: resume from an earlier one, or start fresh (train.resume=null, "
                        "another train.out_dir)")
    try:
        with open(path) as f:
            saved = json.load(f)
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UserError(f"{path}: cannot read ({getattr(exc, 'strerror', None) or exc}); the checkpoint is damaged: "
                        "resume from an earlier one, or start fresh (train.resume=null, another train.out_dir)") \
            from None
    if not isinstance(saved, dict):
        raise UserError(f"{path}: not a resume record (a JSON object); the checkpoint is damaged: resume from an "
                        "earlier one, or start fresh (train.resume=null, another train.out_dir)")
    if saved.get("plan_sha256") not in (None, plan_fingerprint(shards)):
        raise UserError(f"{os.path.join(ckpt_root, tag)} was saved with another plan than {shards}/plan.json "
                        f"(saved with {saved.get('data_shards')}): its step {saved.get('next_step')} would be other "
                        "data; resume with the same packed shards, or start fresh (train.resume=null, another "
                        "train.out_dir)")
    return saved


def save(engine, ckpt_root: str, next_step: int, config_yaml: str, hf_model=None, tokenizer=None,
         keep_last: int = 0, total_steps: Optional[int] = None, counters: Optional[dict] = None,
         shards: Optional[str] = None, ledger=None, record: Optional[dict] = None) -> str:
    """Save a checkpoint after ``next_step`` steps; every rank must call this. Returns the tag directory.

    ``total_steps`` (the run's length, which shapes the LR schedule) is kept so a resume can tell when it changed;
    ``counters`` (JSON-able, the same on every rank) are handed back by ``load``; ``shards`` (the packed-shard
    directory) goes into resume.json for ``check_resumable``; ``ledger`` (rank 0's ledger.SampleLedger) is written
    as ledger.npz; ``record`` (JSON-able: the epoch of next_step, a re-plan's record) is added to resume.json.

    Publishing is the last act: DeepSpeed writes its shards without touching ``latest``, every rank writes its RNG
    file, rank 0 the config, resume.json and hf/; after a barrier the files are checksummed into manifest.json, and
    only then does ``latest`` move and do older checkpoints get pruned. The manifest lists what every rank wrote
    (DeepSpeed's files as its checkpoint engine wrote them and as its naming says this rank saves them, the RNG
    files, rank 0's config, resume.json and hf/ files): one of them missing fails the save. A crash or a full disk
    before that leaves a tag without a manifest, which no resume uses. A failed write (full disk, quota), a file
    gone before the manifest and a peer lost during the save are one-line UserErrors (``_save_failure``)."""
    tag = tag_for(next_step)
    tag_dir = os.path.join(ckpt_root, tag)
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    if _rank() == 0 and os.path.isdir(tag_dir):
        # An earlier attempt at this step (a save cut short, or a timeline that was resumed from further back):
        # unpublish it first, so its stale files cannot end up in the new manifest.
        _remove_file(os.path.join(tag_dir, manifest.MANIFEST))
        shutil.rmtree(tag_dir, ignore_errors=True)
    _barrier()
    written = _record_writes(engine)  # what DeepSpeed's checkpoint engine writes from here on: the manifest's due
    try:
        engine.save_checkpoint(ckpt_root, tag=tag, save_latest=False,
                               client_state={"next_step": next_step, "config": config_yaml,
                                             "total_steps": total_steps, "counters": counters or {},
                                             **UNIVERSAL_INFO})
        _atomic(os.path.join(tag_dir, f"rng_rank{_rank()}.pt"), lambda p: torch.save(rng_state(), p))
        ours = [f"rng_rank{_rank()}.pt"]
        if _rank() == 0:
            ours += ["config.yaml", "resume.json"]
            _atomic(os.path.join(tag_dir, "config.yaml"), lambda p: _write_text(p, config_yaml))
            resume = json.dumps({"next_step": next_step, "world_size": world_size, "data_shards": shards,
                                 "plan_sha256": plan_fingerprint(shards) if shards else None, **(record or {})})
            _atomic(os.path.join(tag_dir, "resume.json"), lambda p: _write_text(p, resume))
            if ledger is not None:
                _atomic(os.path.join(tag_dir, LEDGER_FILE), lambda p: _write_with(p, ledger.save))
            hf_dir = os.path.join(tag_dir, "hf")
            os.makedirs(hf_dir, exist_ok=True)
            if hf_model is not None:
                hf_model.config.save_pretrained(hf_dir)
                if getattr(hf_model, "generation_config", None) is not None:
                    hf_model.generation_config.save_pretrained(hf_dir)
            if tokenizer is not None:
                tokenizer.save_pretrained(hf_dir)
            ours += [os.path.join("hf", rel) for rel in manifest.tag_files(hf_dir)]
        _barrier()
        manifest.write(tag_dir, next_step, world_size, _engine_files(engine, ckpt_root, tag, written) + ours)
        if _rank() == 0:
            _atomic(os.path.join(ckpt_root, "latest"), lambda p: _write_text(p, tag))
    except (OSError, RuntimeError) as exc:
        raise _save_failure(exc, tag_dir, ckpt_root) from None
    if _rank() == 0 and keep_last > 0:
        prune(ckpt_root, keep_last, next_step)
    _barrier()
    return tag_dir


def _write_text(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _write_with(path: str, write) -> None:
    """write(file object) into ``path`` (np.savez given a name would add .npz to it)."""
    with open(path, "wb") as f:
        write(f)


def _atomic(path: str, write) -> None:
    """write(tmp) to a temporary name beside ``path``, flushed to disk, then renamed over it."""
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        _remove_file(tmp)


def _remove_file(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _record_writes(engine) -> list:
    """A list that, until the next call, collects the path of every file ``engine``'s DeepSpeed checkpoint engine
    saves on this rank (its ``save`` wrapped once per engine; engines without one record nothing)."""
    ckpt_engine = getattr(engine, "checkpoint_engine", None)
    if ckpt_engine is None or not callable(getattr(ckpt_engine, "save", None)):
        return []
    written = getattr(ckpt_engine, "_hbp_written", None)
    if written is None:
        written = ckpt_engine._hbp_written = []
        save = ckpt_engine.save

        def recording_save(state_dict, path, *args, **kwargs):
            written.append(str(path))  # before the write: a file the write leaves out is still due
            return save(state_dict, path, *args, **kwargs)

        ckpt_engine.save = recording_save
    written.clear()
    return written


def _engine_files(engine, ckpt_root: str, tag: str, written: list) -> list:
    """This rank's part of the DeepSpeed checkpoint, relative to the tag folder: what its checkpoint engine wrote
    there, and what DeepSpeed's own naming says this rank saves (the model states where it writes them, its ZeRO
    optimizer shard), so a file the engine skipped is due all the same."""
    tag_dir = os.path.abspath(os.path.join(ckpt_root, tag))
    paths = list(written)
    for flag, name in (("save_non_zero_checkpoint", "_get_ckpt_name"), ("save_zero_checkpoint", "_get_zero_ckpt_name")):
        if getattr(engine, flag, False) and callable(getattr(engine, name, None)):
            paths.append(getattr(engine, name)(ckpt_root, tag))
    out = []
    for path in paths:
        rel = os.path.relpath(os.path.abspath(path), tag_dir)
        if not rel.startswith(os.pardir) and rel not in out:
            out.append(rel)
    return out


def _save_failure(exc: BaseException, tag_dir: str, ckpt_root: str) -> BaseException:
    """The one-line UserError of a save that did not finish (a failed write, a file gone before the manifest, a peer
    that stopped during it), or ``exc`` itself when it is none of these (a bug keeps its traceback)."""
    latest = _read_latest(ckpt_root)
    kept = "it is left unpublished and " + (f"{ckpt_root}/latest still names the previous complete checkpoint, "
                                            f"{latest}" if latest else "no checkpoint of this run is complete yet")
    if isinstance(exc, manifest.IncompleteCheckpoint):
        return UserError(f"saving checkpoint {tag_dir} failed: {exc} (a folder not every rank shares, or something "
                         f"deleting files there?); {kept}: resume with train.resume=auto")
    if isinstance(exc, OSError) or _is_write_failure(exc):
        return UserError(f"saving checkpoint {tag_dir} failed ({_write_failure_text(exc, ckpt_root)}); {kept}: free "
                         "space and resume with train.resume=auto")
    if _is_peer_lost(exc):
        return UserError(f"saving checkpoint {tag_dir} did not finish: another rank stopped during the save (its own "
                         f"line says why); {kept}: resume with train.resume=auto")
    return exc


def _is_write_failure(exc: BaseException) -> bool:
    """torch.save reports a failed write (a full disk, a quota) as a RuntimeError from its zip writer: "... file write
    failed", "... failed writing file data/0", or, when the short write surfaces at the next record,
    "[enforce fail at inline_container.cc:NNN] . unexpected pos N vs M"."""
    text = str(exc).lower()
    return ("write" in text and ("fail" in text or "space" in text)) or (
        "inline_container" in text and "unexpected pos" in text)


def _is_peer_lost(exc: BaseException) -> bool:
    """A collective that failed because a peer process went away (gloo's "Connection closed/reset by peer", NCCL's
    aborted communicator): that peer's own failure is the one to report."""
    text = str(exc)
    return isinstance(exc, getattr(dist, "DistError", ())) or any(
        s in text for s in ("Connection closed by peer", "Connection reset by peer", "communicator was aborted"))


def _write_failure_text(exc: BaseException, ckpt_root: str) -> str:
    """One phrase for a failed write: the OS's reason and the free space left."""
    reason = getattr(exc, "strerror", None) or (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    try:
        free = shutil.disk_usage(ckpt_root).free / 2**30
        return f"{reason}; {free:.1f} GiB free there"
    except OSError:
        return reason


def list_tags(ckpt_root: str) -> list:
    """Checkpoint tags under ckpt_root, oldest first."""
    if not os.path.isdir(ckpt_root):
        return []
    tags = [d for d in os.listdir(ckpt_root) if TAG_RE.match(d) and os.path.isdir(os.path.join(ckpt_root, d))]
    return sorted(tags, key=lambda t: int(TAG_RE.match(t).group(1)))


def prune(ckpt_root: str, keep_last: int, upto_step: Optional[int] = None) -> None:
    """Delete all but the newest ``keep_last`` complete checkpoints up to step ``upto_step`` (the one just saved),
    and the unfinished saves older than the oldest one kept.

    Only complete checkpoints (with a manifest) count towards ``keep_last``, so unfinished saves never push the only
    complete one out. Tags of later steps are left alone: they exist only when a run resumed from an older
    checkpoint, and ranking them as newer would delete the checkpoint just written."""
    tags = list_tags(ckpt_root)
    if upto_step is not None:
        tags = [t for t in tags if int(TAG_RE.match(t).group(1)) <= upto_step]
    complete = [t for t in tags if manifest.has_manifest(os.path.join(ckpt_root, t))]
    if not complete:
        return
    kept = complete[-keep_last:]
    for tag in tags[:tags.index(kept[0])]:
        shutil.rmtree(os.path.join(ckpt_root, tag), ignore_errors=True)


def check_fresh_root(ckpt_root: str, resume: Optional[tuple]) -> None:
    """UserError (one line) when a run that does not resume from ``ckpt_root`` would save into it while it holds
    another run's checkpoints: the two runs' steps would mix (pruning, ``latest``, export, resume=auto)."""
    if resume is not None and os.path.abspath(resume[0]) == os.path.abspath(ckpt_root):
        return
    tags = list_tags(ckpt_root)
    if tags:
        run_dir = os.path.dirname(os.path.abspath(ckpt_root))
        raise UserError(f"{ckpt_root} already holds checkpoints of an earlier run (newest {tags[-1]}): continue it "
                        f"with train.resume=auto, or start this run elsewhere (train.out_dir=...), or delete {run_dir}")


def resolve(path: str) -> tuple:
    """(ckpt_root, tag) of a checkpoint given as a tag directory, a root holding ``latest`` (or step_<n> tags), or
    the run directory above that root."""
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise UserError(f"{path}: no such directory (expected RUN_DIR, RUN_DIR/checkpoints or "
                        f"RUN_DIR/checkpoints/step_<n>)")
    latest = os.path.join(path, "latest")
    if os.path.isfile(latest):
        with open(latest) as f:
            tag = f.read().strip()
        if not os.path.isdir(os.path.join(path, tag)):
            tags = list_tags(path)
            fix = f"pass one explicitly, e.g. {os.path.join(path, tags[-1])}" if tags else "start fresh"
            raise UserError(f"{latest} names {tag}, which is not there (checkpoints there: "
                            f"{', '.join(tags) or 'none'}); {fix}")
        return path, tag
    if os.path.isdir(path) and TAG_RE.match(os.path.basename(path)):
        return os.path.dirname(path), os.path.basename(path)
    tags = list_tags(path)
    if tags:
        return path, tags[-1]
    if os.path.isdir(os.path.join(path, "checkpoints")):  # RUN_DIR (train.out_dir) given
        return resolve(os.path.join(path, "checkpoints"))
    raise UserError(
        f"{path}: not a checkpoint (expected RUN_DIR, RUN_DIR/checkpoints or RUN_DIR/checkpoints/step_<n>)")


def find_resume(resume: Optional[str], ckpt_root: str, warn=print) -> Optional[tuple]:
    """Where ``train.resume`` points, verified against its manifest: None (start fresh), 'auto' (the newest
    complete checkpoint in ckpt_root, if any) or a path (which must be complete: a UserError names what is wrong).

    'auto' tries the tag ``latest`` names, then older tags, newest first; when it passes over damaged or unfinished
    ones it calls ``warn`` with one line saying which and why. Checkpoints there but none complete is a UserError
    (starting fresh would mix two runs in one folder). Collective under torch.distributed (the checksums are
    shared), with the same answer on every rank."""
    if not resume:
        return None
    if resume != "auto":
        root, tag = resolve(resume)
        why = manifest.problem(os.path.join(root, tag))
        if why:
            raise UserError(f"{why}; pass another checkpoint, or train.resume=auto to take the newest complete one")
        return root, tag
    tags = list_tags(ckpt_root)
    if not tags:
        if os.path.isfile(os.path.join(ckpt_root, "latest")):
            resolve(ckpt_root)  # latest naming a missing tag: its one-line error
        return None
    latest = _read_latest(ckpt_root)
    passed = []
    if latest in tags:
        newest = int(TAG_RE.match(latest).group(1))
        tags = [latest] + [t for t in reversed(tags) if int(TAG_RE.match(t).group(1)) < newest]
    else:
        if latest is not None:
            passed.append(f"{os.path.join(ckpt_root, 'latest')} names {latest!r}, which is not there")
        tags = list(reversed(tags))
    for tag in tags:
        why = manifest.problem(os.path.join(ckpt_root, tag))
        if why is None:
            if passed:
                warn(f"[train] warning: train.resume=auto skips {'; '.join(passed)}; resuming from the newest "
                     f"complete checkpoint, {tag}")
            return ckpt_root, tag
        passed.append(why)
    raise UserError(f"no complete checkpoint in {ckpt_root} ({'; '.join(passed[:2])}): start fresh in another "
                    "train.out_dir, or delete the unfinished step_* folders")


def _read_latest(ckpt_root: str) -> Optional[str]:
    try:
        with open(os.path.join(ckpt_root, "latest")) as f:
            return f.read().strip()
    except (OSError, UnicodeDecodeError):
        return None


def load(engine, ckpt_root: str, tag: str, engine_state: Optional[tuple] = None,
         saved_world_size: Optional[int] = None) -> Resumed:
    """Load a checkpoint into the engine and restore this rank's RNG state.

    A resume on another number of ranks (runtime/elastic.py) loads the engine state from ``engine_state`` (the
    (folder, tag) of the checkpoint converted to DeepSpeed's universal format) and gives rank r the RNG state of
    saved rank r mod ``saved_world_size`` (every rank starts a run with the same seed, train.seed)."""
    load_dir, load_tag = engine_state or (ckpt_root, tag)
    load_path, client_state = engine.load_checkpoint(load_dir, tag=load_tag, load_optimizer_states=True,
                                                     load_lr_scheduler_states=True)
    if load_path is None:
        raise UserError(f"{os.path.join(load_dir, load_tag)}: DeepSpeed could not load this checkpoint")
    rng_rank = _rank() % saved_world_size if saved_world_size else _rank()
    rng_path = os.path.join(ckpt_root, tag, f"rng_rank{rng_rank}.pt")
    if not os.path.isfile(rng_path):
        raise UserError(f"{rng_path}: missing; without it the resumed run would not reproduce the uninterrupted "
                        "one: resume from another checkpoint (or with the world size that saved this one)")
    try:  # tensors and plain values only: a checkpoint from elsewhere cannot run code through this file
        set_rng_state(torch.load(rng_path, weights_only=True))
    except (pickle.UnpicklingError, RuntimeError, KeyError, TypeError, ValueError, EOFError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise UserError(f"{rng_path}: not an RNG state this trainer saved ({first})") from None
    return Resumed(int(client_state["next_step"]), client_state.get("total_steps"), client_state.get("counters") or {})


class StopSignal:
    """Turns SIGTERM/SIGINT into a flag the training loop checks after each step (finish the step, save, exit 0).

    A second SIGINT while the flag is set interrupts immediately (the user insists), unless it comes within
    ``REPEAT_WINDOW_S`` of the first: under torchrun one Ctrl-C reaches each worker twice, from the terminal
    (same process group) and forwarded by torchrun, and that must still finish the step and save.
    """

    REPEAT_WINDOW_S = 2.0

    def __init__(self):
        self.received: Optional[str] = None
        self._received_at = 0.0
        self._previous = {}

    def install(self) -> "StopSignal":
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.received is None:
            self.received = signal.Signals(signum).name
            self._received_at = time.monotonic()
        elif signum == signal.SIGINT and time.monotonic() - self._received_at > self.REPEAT_WINDOW_S:
            raise KeyboardInterrupt

    @property
    def requested(self) -> bool:
        return self.received is not None

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
