"""Packed-shard writer: a plan + the tokenized dataset -> OUT/plan.json and OUT/group_<g>/ (one row per pack).

Format (docs/architecture.md, "Packed shards"): per pack ``input_ids``, ``labels`` (concatenated, unshifted),
``position_ids`` (restart at 0 per sample), ``cu_seqlens`` ([0, l1, l1+l2, ..., T]), ``sample_indices`` and
``num_loss_tokens`` (targets after the per-sample shift: labels[1:] != -100 within each sample, so no sample
predicts its neighbour). Rows of a group are numbered in step order (step by step, replica by replica,
micro-batch by micro-batch), so a step reads contiguous rows; each step of OUT/plan.json gets "rows":
[[row, ...] per replica], parallel to "replicas".

The work is vectorised over chunks of packs (a few million tokens each): each chunk gathers its samples' tokens in
place from the tokenized dataset's memory-mapped files (hbp_train.batches.columns; the token columns are never read
whole), becomes one Arrow record batch streamed to a cache file with datasets' ArrowWriter, and is then saved
with ``save_to_disk`` (memory-mapped, never all in RAM): the writer's memory is a chunk's, whatever the dataset's
size. Everything is written into a staging folder beside OUT that replaces OUT only when complete, so an
interrupted re-pack leaves the earlier shards whole.

Checksums: the last file written is OUT/checksums.json, every other file's size and xxh3_64 hash (``xxhash``, which
``datasets`` depends on; about 30 GB/s on one core from memory, so verifying costs what reading the files from
disk costs: docs/data.md has the figures). The trainer verifies them before training (data.PackedData, the files shared among the ranks), so a
flipped byte in the token ids or labels stops the run at start-up in one line naming the file, not a loss that is
quietly off. ``python -m hbp_train.batches.shards OUT`` verifies a folder (e.g. a copy on a node's own disk) and
says how fast it went. Shards from before checksums load with a one-line warning (docs/data.md).

``write_shards_from_packed`` writes the shards of a re-plan (planning/replan.py) from the packed shards of the
plan it re-plans (``PackedSamples``: each sample is a slice of its pack's row), so a resume on another number of
ranks needs only the packed shards it was trained from, not the tokenized data.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import pyarrow as pa

from hbp_train.batches.columns import int_column, open_list_columns
from hbp_train.common.errors import UserError
from hbp_train.common.labels import IGNORE_INDEX
from hbp_train.common.outputs import replace_dir, staging_dir
from hbp_train.planning.csr import gather_ranges
from hbp_train.planning.metrics import with_metrics
from hbp_train.planning.plan import Plan

CHUNK_TOKENS = 1 << 24  # tokens per written batch: large enough for numpy, small enough for RAM
COLUMNS = ("input_ids", "labels", "position_ids", "cu_seqlens", "sample_indices", "num_loss_tokens")
CHECKSUMS = "checksums.json"
CHECKSUM_ALGORITHM = "xxh3_64"
READ_CHUNK = 64 << 20  # bytes hashed per call: large enough for the hash's speed


def group_row_order(plan: Plan) -> tuple[dict[int, np.ndarray], list]:
    """Pack ids of each group in row order, and per step the rows [[row, ...] per replica]."""
    next_row = {}
    packs_by_group: dict[int, list] = {}
    step_rows = []
    for s in range(plan.num_steps):
        g = int(plan.step_group[s])
        mat = plan.step_matrix(s)  # [m, R]
        m, r = mat.shape
        base = next_row.get(g, 0)
        rows = (base + np.arange(m * r)).reshape(r, m)  # replica-major numbering
        packs_by_group.setdefault(g, []).append(mat.T.reshape(-1))
        next_row[g] = base + m * r
        step_rows.append(rows.tolist())
    return {g: np.concatenate(v) for g, v in packs_by_group.items()}, step_rows


def _pack_batch(plan: Plan, packs: np.ndarray, lengths: np.ndarray, columns) -> pa.RecordBatch:
    """One Arrow record batch for ``packs`` (vectorised); ``lengths``: every dataset row's token count; ``columns``:
    the dataset's input_ids and labels (hbp_train.batches.columns.open_list_columns)."""
    sizes = plan.pack_ptr[packs + 1] - plan.pack_ptr[packs]
    samples = plan.pack_samples[gather_ranges(plan.pack_ptr[packs], sizes)]
    lens = lengths[samples]
    input_ids, labels = (c.astype(np.int32, copy=False) for c in columns.gather(["input_ids", "labels"], samples, lens))
    sample_start = np.concatenate([[0], np.cumsum(lens)[:-1]])
    position_ids = (np.arange(len(input_ids)) - np.repeat(sample_start, lens)).astype(np.int32)
    # Targets after the per-sample shift: label at t counts when t is not a sample's first token.
    counted = labels != IGNORE_INDEX
    counted[sample_start[lens > 0]] = False
    pack_of_sample = np.repeat(np.arange(len(packs)), sizes)
    pack_tokens = np.bincount(pack_of_sample, lens, minlength=len(packs)).astype(np.int64)
    tok_offsets = np.concatenate([[0], np.cumsum(pack_tokens)])
    loss_per_sample = np.add.reduceat(counted.astype(np.int64), sample_start) if len(lens) else np.zeros(0, np.int64)
    loss_per_pack = np.bincount(pack_of_sample, loss_per_sample, minlength=len(packs)).astype(np.int32)
    # cu_seqlens: per pack [0, cumulative sample ends within the pack]; n + 1 entries per pack.
    ends_in_pack = np.cumsum(lens) - np.repeat(tok_offsets[:-1], sizes)
    cu_sizes = sizes + 1
    cu_offsets = np.concatenate([[0], np.cumsum(cu_sizes)])
    cu_vals = np.zeros(int(cu_offsets[-1]), np.int32)
    is_end = np.ones(len(cu_vals), bool)
    is_end[cu_offsets[:-1]] = False
    cu_vals[is_end] = ends_in_pack
    smp_offsets = np.concatenate([[0], np.cumsum(sizes)])

    def lst(offsets, values, typ):
        return pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(values, type=typ))

    return pa.RecordBatch.from_arrays(
        [
            lst(tok_offsets, input_ids, pa.int32()),
            lst(tok_offsets, labels, pa.int32()),
            lst(tok_offsets, position_ids, pa.int32()),
            lst(cu_offsets, cu_vals, pa.int32()),
            lst(smp_offsets, samples.astype(np.int64), pa.int64()),
            pa.array(loss_per_pack, type=pa.int32()),
        ],
        names=list(COLUMNS),
    )


def write_shards(plan: Plan, dataset_dir: str | Path, out_dir: str | Path, progress: bool = True,
                 num_shards: int | None = None, plan_format: str = "json") -> dict[int, int]:
    """Write OUT/plan.json (with per-step "rows") and OUT/group_<g>/ for every group that has steps.

    ``plan_format="npz"`` writes the binary OUT/plan.npz instead (planning/plan_npz.py, with every pack's row),
    which the loader memory-maps: for plans of millions of samples.

    The set is built in a staging folder beside OUT and replaces an earlier OUT as a whole only once complete
    (hbp_train.common.outputs.replace_dir); the caller checks that OUT is new, empty or an earlier output.
    Raises UserError if the dataset's ``length`` column does not match the plan's lengths. Returns
    {group: number of rows}."""
    import datasets

    ds = datasets.load_from_disk(str(dataset_dir))
    for col in ("input_ids", "labels", "length"):
        if col not in ds.column_names:
            raise UserError(f"{dataset_dir}: tokenized dataset has no '{col}' column (columns: {ds.column_names})")
    ds_len = int_column(ds, "length")
    if len(ds_len) != plan.num_samples or np.any(ds_len != plan.lengths):
        raise UserError(f"{dataset_dir}: 'length' column ({len(ds_len)} rows) does not match the plan's lengths "
                        f"({plan.num_samples}); re-plan from this dataset")
    # The token columns stay in their memory-mapped files: each batch of packs gathers its own rows, so the
    # writer's memory is a batch's, whatever the dataset's size.
    columns = open_list_columns(ds, ["input_ids", "labels"])
    if any(np.any(columns.lengths[c] != ds_len) for c in ("input_ids", "labels")):
        raise UserError(f"{dataset_dir}: input_ids/labels lengths disagree with the 'length' column")
    return _write(plan, columns, ds_len, out_dir, progress, num_shards, plan_format)


def write_shards_from_packed(plan: Plan, packed_dir: str | Path, out_dir: str | Path, progress: bool = False,
                             plan_format: str = "json") -> dict[int, int]:
    """``write_shards`` with the samples taken from the packed shards of another plan over the same samples
    (``packed_dir``, e.g. the plan a run was started with) instead of the tokenized dataset: a re-plan (a resume on
    another number of ranks, planning/replan.py) re-packs them without the tokenized data."""
    return _write(plan, PackedSamples(packed_dir, plan.lengths), plan.lengths, out_dir, progress, None, plan_format)


class PackedSamples:
    """The samples of a packed-shard folder, addressed by their index in its plan: sample i's tokens and labels are
    the slice of the row of the pack that holds it that its ``cu_seqlens`` bound (the row's ``sample_indices``
    say which samples it holds). ``gather`` is the interface of ``columns.open_list_columns``' readers, read in
    place from the groups' memory-mapped files. UserError (one line) when a row's samples do not have the lengths
    the plan gives them (stale shards)."""

    def __init__(self, packed_dir: str | Path, lengths: np.ndarray):
        import datasets

        from hbp_train.batches.columns import list_column

        n = len(lengths)
        self.group_of = np.full(n, -1, np.int64)
        self.row_of = np.zeros(n, np.int64)
        self.offset_of = np.zeros(n, np.int64)
        self.readers = {}
        for gdir in sorted(Path(packed_dir).glob("group_*")):
            g = int(gdir.name.split("_", 1)[1])
            ds = datasets.load_from_disk(str(gdir))
            idx_ptr, idx = list_column(ds, "sample_indices")
            cu_ptr, cu = list_column(ds, "cu_seqlens")
            idx, cu = idx.astype(np.int64), cu.astype(np.int64)
            # A row's n samples have n + 1 cu_seqlens: every entry but a row's last starts a sample.
            starts = np.ones(len(cu), bool)
            starts[cu_ptr[1:] - 1] = False
            first = np.flatnonzero(starts)
            if len(first) != len(idx) or np.any((idx < 0) | (idx >= n)) or \
                    np.any(cu[first + 1] - cu[first] != lengths[idx]):
                raise UserError(f"{gdir}: its rows' samples do not have the lengths the plan gives them (stale "
                                f"shards): rewrite them with data_tools.pack --shards {packed_dir}")
            self.group_of[idx] = g
            self.row_of[idx] = np.repeat(np.arange(len(ds), dtype=np.int64), np.diff(idx_ptr))
            self.offset_of[idx] = cu[first]
            self.readers[g] = open_list_columns(ds, ["input_ids", "labels"])

    def gather(self, names: list[str], samples: np.ndarray, lengths: np.ndarray) -> list[np.ndarray]:
        """For each column of ``names``: the values of ``samples`` (``lengths`` their token counts), concatenated
        in order."""
        group = self.group_of[samples]
        if np.any(group < 0):
            raise UserError(f"sample {int(samples[group < 0][0])} is in no row of the packed shards: they hold "
                            "another plan's samples")
        outs = [np.empty(int(lengths.sum()), np.int32) for _ in names]
        dest = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        for g in np.unique(group).tolist():  # a few groups, never a loop per sample
            sel = np.flatnonzero(group == g)
            at = gather_ranges(dest[sel], lengths[sel])
            values = self.readers[g].gather(names, self.row_of[samples[sel]], lengths[sel],
                                            self.offset_of[samples[sel]])
            for out, v in zip(outs, values):
                out[at] = v
        return outs


def _write(plan: Plan, columns, lengths: np.ndarray, out_dir: str | Path, progress: bool, num_shards: int | None,
           plan_format: str) -> dict[int, int]:
    """The packed shards of ``plan`` from ``columns`` (a reader of every sample's input_ids and labels, its
    ``gather(names, samples, lengths)``; ``lengths``: every sample's token count): write_shards' body."""
    import datasets
    from tqdm.auto import tqdm

    out_dir = Path(out_dir)
    packs_by_group, step_rows = group_row_order(plan)
    tokens = plan.pack_tokens
    features = datasets.Features({
        "input_ids": datasets.Sequence(datasets.Value("int32")),
        "labels": datasets.Sequence(datasets.Value("int32")),
        "position_ids": datasets.Sequence(datasets.Value("int32")),
        "cu_seqlens": datasets.Sequence(datasets.Value("int32")),
        "sample_indices": datasets.Sequence(datasets.Value("int64")),
        "num_loss_tokens": datasets.Value("int32"),
    })
    from datasets.arrow_writer import ArrowWriter

    rows_written = {}
    bar = tqdm(total=int(tokens.sum()), unit="tok", unit_scale=True, desc="packed shards",
               disable=None if progress else True)  # None: off when stderr is no terminal (a log file)
    # The whole new set is built beside OUT and swapped in at the end: an interrupt or error never leaves new
    # groups next to an earlier plan.json (a mix the trainer would read without complaint).
    staged = staging_dir(out_dir)
    try:
        with tempfile.TemporaryDirectory(dir=staged, prefix=".tmp_") as tmp:
            for g, packs in sorted(packs_by_group.items()):
                cache = Path(tmp) / f"group_{g}.arrow"
                writer = ArrowWriter(features=features, path=str(cache))
                ctok = np.cumsum(tokens[packs])
                start = 0
                while start < len(packs):
                    stop = max(start + 1, int(np.searchsorted(ctok, (ctok[start - 1] if start else 0) + CHUNK_TOKENS)))
                    batch = _pack_batch(plan, packs[start:stop], lengths, columns)
                    writer.write_table(pa.Table.from_batches([batch]))
                    bar.update(int(tokens[packs[start:stop]].sum()))
                    start = stop
                writer.finalize()
                part = datasets.Dataset.from_file(str(cache))
                shards = num_shards or max(1, int(tokens[packs].sum() // (256 << 20)) + 1)
                part.save_to_disk(str(staged / f"group_{g}"), num_shards=min(shards, max(1, len(packs))))
                rows_written[g] = len(packs)
                del part
        if not plan.metrics:  # a plan read back by Plan.from_dict
            with_metrics(plan)
        if plan_format == "npz":
            from hbp_train.planning.plan_npz import write_npz

            pack_row = np.zeros(plan.num_packs, np.int64)
            for packs in packs_by_group.values():
                pack_row[packs] = np.arange(len(packs))
            write_npz(plan, staged / "plan.npz", pack_row=pack_row)
        else:
            plan.to_json(staged / "plan.json", step_rows=step_rows)
        write_checksums(staged)  # last: it covers every other file
        replace_dir(staged, out_dir)
    finally:
        bar.close()
        shutil.rmtree(staged, ignore_errors=True)  # gone after replace_dir; what an error or interrupt left
    return rows_written


def file_checksum(path: str | Path) -> str:
    """xxh3_64 of a whole file, as hex. Hashed through a read-only memory map, READ_CHUNK bytes at a time: no copy
    into Python (about 30 GB/s from the page cache here, against 5 with read()), and the pages it brings in are
    those the loader memory-maps next."""
    import mmap

    import xxhash

    digest = xxhash.xxh3_64()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size:  # an empty file cannot be mapped; its hash is the empty one
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                view = memoryview(mapped)
                try:
                    for start in range(0, size, READ_CHUNK):
                        digest.update(view[start:start + READ_CHUNK])
                        if hasattr(mmap, "MADV_DONTNEED"):  # out of this process's RSS; the page cache keeps them
                            mapped.madvise(mmap.MADV_DONTNEED, start, min(READ_CHUNK, size - start))
                finally:
                    view.release()
    return digest.hexdigest()


def _shard_files(folder: Path) -> list:
    """Every file below ``folder`` but checksums.json, as sorted POSIX paths relative to it."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*")
                  if p.is_file() and p.name != CHECKSUMS)


def write_checksums(folder: str | Path) -> dict:
    """Write ``folder``/checksums.json: {"algorithm", "files": {relative path: {"bytes", "xxh3_64"}}} for every
    other file below ``folder`` (by rename, so a half-written list is never read). Returns the file map."""
    folder = Path(folder)
    files = {rel: {"bytes": (folder / rel).stat().st_size, CHECKSUM_ALGORITHM: file_checksum(folder / rel)}
             for rel in _shard_files(folder)}
    tmp = folder / f".{CHECKSUMS}.tmp"
    tmp.write_text(json.dumps({"algorithm": CHECKSUM_ALGORITHM, "files": files}, indent=1))
    os.replace(tmp, folder / CHECKSUMS)
    return files


def read_checksums(folder: str | Path) -> Optional[dict]:
    """The file map of ``folder``/checksums.json; None when the folder has none (shards from an older hbp-pack).
    UserError for a list that cannot be read or names an unknown algorithm."""
    path = Path(folder) / CHECKSUMS
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        files, algorithm = record["files"], record["algorithm"]
        if not isinstance(files, dict) or not all(isinstance(e, dict) for e in files.values()):
            raise TypeError("files is not a mapping of file entries")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UserError(f"{path}: unreadable ({getattr(exc, 'strerror', None) or exc}); {_REPACK.format(folder)}") \
            from None
    if algorithm != CHECKSUM_ALGORITHM:
        raise UserError(f"{path}: checksums of kind {algorithm!r}, this hbp-train knows {CHECKSUM_ALGORITHM!r}; "
                        f"{_REPACK.format(folder)}")
    return files


_REPACK = ("re-run hbp-pack (data_tools.pack --dataset TOKENIZED_DIR --shards {0}), or copy the folder again if "
           "it is a copy")


def share_of_files(files: dict, rank: int, world_size: int) -> list:
    """The files ``rank`` hashes when ``world_size`` ranks share the work: largest first, each to the rank with the
    fewest bytes so far (ties to the lowest rank), the same answer on every rank."""
    load = [0] * world_size
    mine = []
    for rel in sorted(files, key=lambda r: (-int(files[r].get("bytes", 0)), r)):
        who = min(range(world_size), key=lambda r: (load[r], r))
        load[who] += int(files[rel].get("bytes", 0))
        if who == rank:
            mine.append(rel)
    return mine


def file_problem(folder: Path, rel: str, entry: dict, hash_it: bool = True) -> Optional[str]:
    """What is wrong with one listed file (a phrase naming it), or None: missing, another size, another hash."""
    path = folder / rel
    if not path.is_file():
        return f"{path} is missing"
    size = path.stat().st_size
    if size != entry.get("bytes"):
        return f"{path} has {size} bytes, {CHECKSUMS} says {entry.get('bytes')} (truncated or overwritten)"
    if hash_it and file_checksum(path) != entry.get(CHECKSUM_ALGORITHM):
        return f"{path} is damaged (its {CHECKSUM_ALGORITHM} differs from {CHECKSUMS})"
    return None


def verify_checksums(folder: str | Path, rank: int = 0, world_size: int = 1,
                     gather: Callable[[object], list] = lambda x: [x]) -> Optional[dict]:
    """Check every file ``folder``/checksums.json lists: present, its size, its hash. Raises UserError naming the
    first bad file and the fix; returns {"files", "bytes", "seconds"} (this rank's share), or None for shards
    without checksums.json (the caller warns).

    Every rank stats every file (cheap: a missing or cut file is found by all alike); the hashing is shared,
    ``share_of_files``, and ``gather`` (all ranks' values, e.g. a torch.distributed all_gather_object) brings the
    problems together so that every rank raises the same error. Collective when ``world_size`` > 1."""
    folder = Path(folder)
    files = read_checksums(folder)
    if files is None:
        return None
    for rel, entry in sorted(files.items()):
        why = file_problem(folder, rel, entry, hash_it=False)
        if why:
            raise UserError(f"{why}; {_REPACK.format(folder)}")
    start = time.perf_counter()
    mine = share_of_files(files, rank, world_size)
    found = [(rel, why) for rel in mine if (why := file_problem(folder, rel, files[rel]))]
    stats = {"files": len(mine), "bytes": sum(int(files[r]["bytes"]) for r in mine),
             "seconds": time.perf_counter() - start}
    problems = sorted(p for part in gather(found) for p in part)
    if problems:
        raise UserError(f"{problems[0][1]}; {_REPACK.format(folder)}")
    return stats


def build_parser():
    from hbp_train.common.cli import ArgumentParser, existing_dir

    p = ArgumentParser(prog="python -m hbp_train.batches.shards",
                       description="Verify a packed-shard folder against its checksums.json (every file's size and "
                       "xxh3_64, as the trainer does before training) and say how long it took. Exit 2 with one line "
                       "naming the first damaged file.")
    p.add_argument("shards", metavar="OUT", type=existing_dir, help="a folder written by data_tools.pack --shards")
    return p


def main(argv=None) -> int:
    from hbp_train.common.errors import EXIT_USER_ERROR

    args = build_parser().parse_args(argv)
    try:
        stats = verify_checksums(args.shards)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    if stats is None:
        print(f"error: {args.shards} has no {CHECKSUMS} (written by an older hbp-pack); {_REPACK.format(args.shards)}",
              file=sys.stderr)
        return EXIT_USER_ERROR
    gb = stats["bytes"] / 1e9
    print(f"{args.shards}: {stats['files']} files, {gb:.3f} GB verified in {stats['seconds']:.2f} s "
          f"({gb / max(stats['seconds'], 1e-9):.2f} GB/s, {CHECKSUM_ALGORITHM})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
