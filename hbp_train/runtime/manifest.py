"""What makes a checkpoint complete: ``manifest.json``, written last, after every rank has saved, and its check.

The manifest lists every file of the tag folder with its size in bytes and its CRC-32 (``zlib.crc32`` over the
whole file, read in 16 MiB chunks; a GB/s-class checksum that catches a truncated, cut-short or overwritten file,
not a deliberate forgery). The files are checksummed by all ranks together, each rank a share (file i by rank
i mod W), so the cost per rank is the checkpoint's size / W. A tag folder without a manifest is a save that did not
finish; ``latest`` is moved only after the manifest exists (checkpoint.save).

What it lists is what the checkpoint must have, not merely what is there: every rank passes ``write`` the files it
wrote (DeepSpeed's model and optimizer shards as the engine wrote them, its RNG file; rank 0 also the config,
resume.json and hf/), and a file one of them wrote that is not there when the manifest is made — deleted, or on a
disk only its writer sees — fails the save on every rank (IncompleteCheckpoint, naming the file and the rank), so
the checkpoint is never published. Every rank checksums the same list (rank 0's view plus what every rank wrote).

``problem(tag_dir)`` re-reads the folder against its manifest (the same shared work) and returns the first thing
that is wrong, naming the file, or None, the same answer on every rank. It also requires what a resume needs besides
DeepSpeed's own files: ``resume.json`` and one ``rng_rank<r>.pt`` per rank of the run that saved it.
"""

from __future__ import annotations

import json
import os
import zlib
from typing import Optional

import torch.distributed as dist

MANIFEST = "manifest.json"
CHUNK = 16 << 20
VERSION = 1


def file_crc32(path: str) -> int:
    """zlib.crc32 of a whole file."""
    crc = 0
    with open(path, "rb") as f:
        while True:
            block = f.read(CHUNK)
            if not block:
                return crc
            crc = zlib.crc32(block, crc)


def tag_files(tag_dir: str) -> list:
    """The files under a tag folder (relative paths, sorted), without the manifest and temporary files."""
    out = []
    for parent, _, names in os.walk(tag_dir):
        for name in names:
            rel = os.path.relpath(os.path.join(parent, name), tag_dir)
            if rel != MANIFEST and ".tmp-" not in name:
                out.append(rel)
    return sorted(out)


def _rank_world() -> tuple:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _gather(value) -> list:
    """Every rank's ``value`` (a list of one element per rank without torch.distributed)."""
    rank, world = _rank_world()
    if world == 1:
        return [value]
    out = [None] * world
    dist.all_gather_object(out, value)
    return out


def _broadcast(value):
    """Rank 0's ``value`` on every rank."""
    if _rank_world()[1] == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _shared_crc32(tag_dir: str, files: list) -> dict:
    """{file: (bytes, crc32) or an error phrase}, each rank reading its share of ``files`` (which must be the same
    list on every rank); collective, and every rank gets the whole answer."""
    rank, world = _rank_world()
    mine = {}
    for i, rel in enumerate(files):
        if i % world == rank:
            path = os.path.join(tag_dir, rel)
            try:
                mine[rel] = (os.path.getsize(path), file_crc32(path))
            except FileNotFoundError:
                mine[rel] = "is missing"
            except OSError as exc:
                mine[rel] = f"cannot be read ({exc.strerror})"
    merged = {}
    for part in _gather(mine):
        merged.update(part)
    return merged


class IncompleteCheckpoint(OSError):
    """A file the checkpoint must have is missing or unreadable at the end of its save (the same on every rank)."""


def write(tag_dir: str, next_step: int, world_size: int, expected=()) -> None:
    """Checksum the finished tag folder (every rank its share) and write manifest.json on rank 0; collective.
    Every rank must have finished writing its files (a barrier) before this is called.

    ``expected``: the files this rank wrote (paths relative to ``tag_dir``). The manifest lists every rank's, and
    whatever else rank 0 finds in the folder: a file some rank wrote that is not there (deleted, or on a disk only
    that rank sees) or cannot be read raises IncompleteCheckpoint on every rank, naming it and its writer, and no
    manifest is written. So is a manifest rank 0 cannot write."""
    rank, world = _rank_world()
    views = _gather((sorted(set(expected)), tag_files(tag_dir) if rank == 0 else [], tag_dir))
    writer = {}
    for r, (wrote, _, _) in enumerate(views):
        for rel in wrote:
            writer.setdefault(rel, r)
    files = sorted(set(writer) | set(views[0][1]))  # the same list on every rank
    found = _shared_crc32(tag_dir, files)
    for i, rel in enumerate(files):
        if isinstance(found[rel], str):  # the same message on every rank: rank 0's path, the writer, the reader
            by = f", written by rank {writer[rel]}," if rel in writer else ""
            where = f" where rank {i % world} looks" if world > 1 else ""
            raise IncompleteCheckpoint(f"{os.path.join(views[0][2], rel)}{by} {found[rel]}{where}")
    failed = None
    if rank == 0:
        record = {"version": VERSION, "next_step": next_step, "world_size": world_size, "checksum": "crc32",
                  "files": {rel: {"bytes": found[rel][0], "crc32": found[rel][1]} for rel in files}}
        path = os.path.join(tag_dir, MANIFEST)
        tmp = f"{path}.tmp-{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump(record, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except OSError as exc:
            failed = f"{path}: {exc.strerror or exc}"
            try:
                os.remove(tmp)
            except OSError:
                pass
    failed = _broadcast(failed)  # rank 0's outcome, on every rank
    if failed is not None:
        raise OSError(failed)


def has_manifest(tag_dir: str) -> bool:
    """Whether the save of this tag finished (cheap: no file is read)."""
    return os.path.isfile(os.path.join(tag_dir, MANIFEST))


def _local_problem(tag_dir: str) -> tuple:
    """(what is wrong with the folder as this rank sees it, without reading the files' contents, or None; the
    manifest's files {path: entry})."""
    path = os.path.join(tag_dir, MANIFEST)
    if not os.path.isfile(path):
        return f"no {MANIFEST} in {tag_dir} (its save did not finish)", {}
    try:
        with open(path) as f:
            record = json.load(f)
        files = record["files"]
        world_size = int(record["world_size"])
        if not isinstance(files, dict):
            raise TypeError("files is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{path}: unreadable ({getattr(exc, 'strerror', None) or exc})", {}
    needed = ["resume.json"] + [f"rng_rank{r}.pt" for r in range(world_size)]
    for rel in needed:
        if rel not in files:
            return f"{path} lists no {rel} (saved by an older hbp-train, or damaged)", files
    for rel, entry in sorted(files.items()):
        full = os.path.join(tag_dir, rel)
        if not os.path.isfile(full):
            return f"{full} is missing", files
        size = os.path.getsize(full)
        if size != entry.get("bytes"):
            return f"{full} has {size} bytes, the manifest says {entry.get('bytes')} (truncated or overwritten)", files
    return None, files


def problem(tag_dir: str) -> Optional[str]:
    """What is wrong with a checkpoint folder (one phrase naming the file), or None when it matches its manifest;
    collective when torch.distributed is initialized (every rank must call it, and all get the same answer, also
    when the ranks see different folders: the first rank's problem, naming that rank)."""
    why, files = _local_problem(tag_dir)
    for r, why in enumerate(_gather(why)):
        if why is not None:
            return why if r == 0 else f"{why} (as rank {r} sees it)"
    files = _broadcast(files)  # rank 0's manifest: the same list on every rank
    found = _shared_crc32(tag_dir, sorted(files))
    for rel, entry in sorted(files.items()):
        if isinstance(found[rel], str):
            return f"{os.path.join(tag_dir, rel)} {found[rel]}"
        if found[rel][1] != entry.get("crc32"):
            return f"{os.path.join(tag_dir, rel)}: its CRC-32 differs from the manifest's (damaged)"
    return None
