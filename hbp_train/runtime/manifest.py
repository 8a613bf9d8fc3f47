"""What makes a checkpoint complete: ``manifest.json``, written last, after every rank has saved, and its check.

The manifest lists every file of the tag folder with its size in bytes and its CRC-32 (``zlib.crc32`` over the
whole file, read in 16 MiB chunks; a GB/s-class checksum that catches a truncated, cut-short or overwritten file,
not a deliberate forgery). The files are checksummed by all ranks together, each rank a share (file i by rank
i mod W), so the cost per rank is the checkpoint's size / W. A tag folder without a manifest is a save that did not
finish; ``latest`` is moved only after the manifest exists (checkpoint.save).

``problem(tag_dir)`` re-reads the folder against its manifest (the same shared work) and returns the first thing
that is wrong, naming the file, or None. It also requires what a resume needs besides DeepSpeed's own files:
``resume.json`` and one ``rng_rank<r>.pt`` per rank of the run that saved it.
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


def _shared_crc32(tag_dir: str, files: list) -> dict:
    """{file: crc32 or an error string}, each rank reading its share of ``files``; collective."""
    rank, world = _rank_world()
    mine = {}
    for i, rel in enumerate(files):
        if i % world == rank:
            try:
                mine[rel] = file_crc32(os.path.join(tag_dir, rel))
            except OSError as exc:
                mine[rel] = f"cannot read ({exc.strerror})"
    merged = {}
    for part in _gather(mine):
        merged.update(part)
    return merged


def write(tag_dir: str, next_step: int, world_size: int) -> None:
    """Checksum the finished tag folder (every rank its share) and write manifest.json on rank 0; collective.
    Every rank must have finished writing its files (a barrier) before this is called."""
    files = tag_files(tag_dir)
    crcs = _shared_crc32(tag_dir, files)
    if _rank_world()[0] != 0:
        return
    entries = {rel: {"bytes": os.path.getsize(os.path.join(tag_dir, rel)), "crc32": crcs[rel]} for rel in files}
    bad = {rel: e["crc32"] for rel, e in entries.items() if not isinstance(e["crc32"], int)}
    if bad:
        rel, why = next(iter(bad.items()))
        raise OSError(f"{os.path.join(tag_dir, rel)}: {why}")
    record = {"version": VERSION, "next_step": next_step, "world_size": world_size, "checksum": "crc32",
              "files": entries}
    path = os.path.join(tag_dir, MANIFEST)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(record, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def has_manifest(tag_dir: str) -> bool:
    """Whether the save of this tag finished (cheap: no file is read)."""
    return os.path.isfile(os.path.join(tag_dir, MANIFEST))


def problem(tag_dir: str) -> Optional[str]:
    """What is wrong with a checkpoint folder (one phrase naming the file), or None when it matches its manifest;
    collective when torch.distributed is initialized (every rank must call it, and all get the same answer)."""
    path = os.path.join(tag_dir, MANIFEST)
    if not os.path.isfile(path):
        return f"no {MANIFEST} in {tag_dir} (its save did not finish)"
    try:
        with open(path) as f:
            record = json.load(f)
        files = record["files"]
        world_size = int(record["world_size"])
        if not isinstance(files, dict):
            raise TypeError("files is not a mapping")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{path}: unreadable ({getattr(exc, 'strerror', None) or exc})"
    needed = ["resume.json"] + [f"rng_rank{r}.pt" for r in range(world_size)]
    for rel in needed:
        if rel not in files:
            return f"{path} lists no {rel} (saved by an older hbp-train, or damaged)"
    for rel, entry in sorted(files.items()):
        full = os.path.join(tag_dir, rel)
        if not os.path.isfile(full):
            return f"{full} is missing"
        size = os.path.getsize(full)
        if size != entry.get("bytes"):
            return f"{full} has {size} bytes, the manifest says {entry.get('bytes')} (truncated or overwritten)"
    crcs = _shared_crc32(tag_dir, sorted(files))
    for rel, entry in sorted(files.items()):
        if crcs[rel] != entry.get("crc32"):
            why = crcs[rel] if isinstance(crcs[rel], str) else "its CRC-32 differs from the manifest's (damaged)"
            return f"{os.path.join(tag_dir, rel)}: {why}"
    return None
