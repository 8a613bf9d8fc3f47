"""Hierarchical balance packing (paper Alg. 2 and appendix J): GroupData, packing, GreedyFill, balanced steps.

For groups i = n..1 (largest first):

1. **GroupData**: sample x goes to group i when l_{i-1} < len(x) <= l_i (l_0 = 0).
2. **Packing** group i's remaining samples into packs of l_i tokens (``GroupPacks.place`` with new packs allowed).
3. **GreedyFill**: top up group i's packs with samples still unpacked in the groups below (``place`` with no new
   packs); those samples leave their group. The paper walks D_{i-1}, ..., D_1 in turn; we sweep all lower
   groups together from the largest size class down, which fills at least as tightly (first-fit decreasing).
4. **Balance**: steps are built per group by ``balance.build_steps`` (cost-sorted slots, dealt to steps one per
   cost stratum so that every step spans the group's lengths), then ordered by ``curriculum.order_steps``
   (seeded shuffle, curriculum, interleave).

Packing is a vectorised first-fit-decreasing over *segments*: the samples of one group and one size class
[2^(c/2), 2^((c+1)/2)) (samples within 1.41x of each other), largest class first (``fill_order``). For a segment
whose largest sample is ``hi``, every pack with gap g surely takes floor(g / hi) of its samples, so a whole segment
is placed with a few numpy passes (repeat pack ids by their slot counts, assign in order) instead of a per-sample
Python loop. Samples no pack can take open new packs (cap // hi each). Waste per pack ends up below the smallest
samples that were left when it was topped up.

The order within a segment is seeded and spreads every run of it over the whole segment: the segment's samples,
in dataset order, are laid out as rows of about sqrt(m) samples, the rows are shuffled and the layout is read
column by column. A pack, or the part of a segment a GreedyFill takes, thus draws its samples from across the
dataset, not from one stretch of it (a corpus stored source by source would otherwise give packs of one source).
This needs no permutation of all samples: the samples are counted into segments a cache-sized chunk at a time
(a radix sort of one-byte keys and an in-cache gather), and only the rows of each segment are shuffled. At 10M
samples that is a few tenths of a second, where a global seeded permutation and the random gathers it implies
took seconds (docs/planning.md, "10M samples").
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from hbp_train.planning.balance import build_steps, reorder_steps
from hbp_train.planning.curriculum import mix_group_steps, order_steps, sample_levels
from hbp_train.planning.plan import DROP_TOO_LONG, Plan, PlanConfig

# Size classes per doubling of length: 2 -> classes [2^(c/2), 2^((c+1)/2)), samples within 1.41x of each other.
CLASSES_PER_OCTAVE = 2
# Longest sample for which size_classes uses a lookup table (32 MB); beyond it, a float log2 per sample.
SIZE_CLASS_TABLE_MAX = 1 << 22
# Samples counted into segments at a time by fill_order: the chunk's sort keys, order and lengths stay in cache.
SORT_CHUNK = 1 << 20


def size_classes(sizes: np.ndarray) -> np.ndarray:
    """int16 size class of every size (larger size -> larger class): floor(2 * log2(size))."""
    sizes = np.asarray(sizes)
    if len(sizes) and sizes.min() < 1:  # planner lengths are >= 1 already: no 10M-element copy for them
        sizes = np.maximum(sizes, 1)
    top = int(sizes.max()) if len(sizes) else 1
    if top > SIZE_CLASS_TABLE_MAX:
        # Absurdly long samples: a table over 1..top would need 8 * top bytes (3e9 tokens -> 24 GB). Same formula.
        return np.floor(np.log2(sizes.astype(np.float64)) * CLASSES_PER_OCTAVE).astype(np.int16)
    # A lookup table over 1..max length is far cheaper than a float log2 per sample.
    table = np.floor(np.log2(np.arange(1, top + 1, dtype=np.float64)) * CLASSES_PER_OCTAVE).astype(np.int16)
    return table[sizes - 1]


def group_data(lengths: np.ndarray, kept: np.ndarray, pack_lens) -> list[np.ndarray]:
    """GroupData: indices (from ``kept``) of each group's samples, l_{i-1} < len <= l_i (l_0 = 0)."""
    level = sample_levels(lengths[kept], pack_lens)
    return [kept[level == i] for i in range(len(pack_lens))]


@dataclass
class FillOrder:
    """The kept samples in the order the packer takes them: segment after segment (group descending, then size class
    descending), each in its seeded spread order (module docstring)."""

    samples: np.ndarray
    """Sample index of every kept sample in fill order (int32 below 2^31 samples)."""
    sizes: np.ndarray
    """Their lengths, in the same order."""
    seg_ptr: np.ndarray
    """Segment s holds positions seg_ptr[s] .. seg_ptr[s + 1] - 1 (empty segments left out)."""
    seg_level: np.ndarray
    """The group of every segment."""


def segment_keys(pack_lens) -> tuple[np.ndarray, int]:
    """(key of every length 0..top + 1, number of keys): ascending key = fill order (group descending, then size
    class descending); lengths above the largest pack_len (top + 1 stands for all of them) get the last key."""
    top = int(pack_lens[-1])
    lengths = np.arange(top + 2)
    level = sample_levels(lengths, pack_lens).astype(np.int64)
    cls = size_classes(np.maximum(lengths, 1)).astype(np.int64)
    top_class = int(cls[: top + 1].max())
    key = (len(pack_lens) - 1 - level) * (top_class + 1) + (top_class - cls)
    num_keys = len(pack_lens) * (top_class + 1)
    key[top + 1] = num_keys
    return key.astype(np.uint8 if num_keys < 255 else np.uint16), num_keys


def fill_order(lengths: np.ndarray, pack_lens, rng: np.random.Generator) -> tuple[FillOrder, np.ndarray]:
    """The FillOrder of the samples no longer than the largest pack_len, and the indices of the others (dropped).

    Counting sort by segment, SORT_CHUNK samples at a time (numpy's stable sort of one-byte keys is a radix sort),
    then every segment's rows shuffled and read by columns (module docstring). Linear in the number of samples."""
    top = int(pack_lens[-1])
    n = len(lengths)
    index_type = np.int32 if n < 2**31 else np.int64
    size_type = np.int32 if top < 2**31 else np.int64
    if top > SIZE_CLASS_TABLE_MAX:  # a table over every length would be huge: one key per distinct length instead
        values, inverse = np.unique(np.minimum(lengths, top + 1), return_inverse=True)
        table_of_values, num_keys = _keys_of(values, pack_lens)
        keys = table_of_values[inverse]
    else:
        table, num_keys = segment_keys(pack_lens)
        keys = table[np.minimum(lengths, top + 1)] if n and int(lengths.max()) > top else table[lengths]
    starts = list(range(0, n, SORT_CHUNK))
    counts = np.stack([np.bincount(keys[s:s + SORT_CHUNK], minlength=num_keys + 1) for s in starts]) if n else \
        np.zeros((1, num_keys + 1), np.int64)
    seg_total = counts.sum(axis=0)
    key_ptr = np.concatenate([[0], np.cumsum(seg_total)])
    # Where chunk c's part of key k goes: after the parts of the chunks before it (dataset order within a key).
    at = key_ptr[:-1] + np.cumsum(counts, axis=0) - counts
    staged_samples = np.empty(n, index_type)
    staged_sizes = np.empty(n, size_type)
    for c, s in enumerate(starts):
        part = np.argsort(keys[s:s + SORT_CHUNK], kind="stable")
        part_sizes = lengths[s:s + SORT_CHUNK][part]
        bounds = np.concatenate([[0], np.cumsum(counts[c])])
        for k in np.flatnonzero(counts[c]).tolist():
            lo, hi, dst = int(bounds[k]), int(bounds[k + 1]), int(at[c, k])
            staged_samples[dst:dst + hi - lo] = part[lo:hi] + s
            staged_sizes[dst:dst + hi - lo] = part_sizes[lo:hi]
    num_kept = int(key_ptr[num_keys])
    samples, sizes = np.empty(num_kept, index_type), np.empty(num_kept, size_type)
    for k in np.flatnonzero(seg_total[:num_keys]).tolist():
        lo, hi = int(key_ptr[k]), int(key_ptr[k + 1])
        _spread(staged_samples[lo:hi], staged_sizes[lo:hi], samples[lo:hi], sizes[lo:hi], rng)
    dropped = staged_samples[num_kept:].astype(np.int64)  # in dataset order: the sort is stable
    present = np.flatnonzero(seg_total[:num_keys])
    top_class = num_keys // len(pack_lens) - 1
    seg_level = len(pack_lens) - 1 - present // (top_class + 1)
    seg_ptr = np.concatenate([[0], np.cumsum(seg_total[present])]).astype(np.int64)
    return FillOrder(samples, sizes, seg_ptr, seg_level.astype(np.int64)), dropped


def _keys_of(values: np.ndarray, pack_lens) -> tuple[np.ndarray, int]:
    """segment_keys for the given lengths only (for pack lengths too long for a table over every length)."""
    top = int(pack_lens[-1])
    level = sample_levels(values, pack_lens).astype(np.int64)
    cls = size_classes(np.minimum(values, top)).astype(np.int64)
    top_class = int(size_classes(np.array([top]))[0])
    key = (len(pack_lens) - 1 - level) * (top_class + 1) + (top_class - cls)
    num_keys = len(pack_lens) * (top_class + 1)
    key[values > top] = num_keys
    return key.astype(np.uint8 if num_keys < 255 else np.uint16), num_keys


def _spread(src_samples, src_sizes, out_samples, out_sizes, rng: np.random.Generator) -> None:
    """Write one segment (dataset order) in its spread order: rows of ~sqrt(m) samples, rows shuffled, read by
    columns; the < sqrt(m) samples past the last full row go last, shuffled."""
    m = len(src_samples)
    width = max(1, int(np.sqrt(m)))
    rows = m // width
    body = rows * width
    pick = rng.permutation(rows)
    out_samples[:body] = src_samples[:body].reshape(rows, width)[pick].T.ravel()
    out_sizes[:body] = src_sizes[:body].reshape(rows, width)[pick].T.ravel()
    rest = body + rng.permutation(m - body)
    out_samples[body:] = src_samples[rest]
    out_sizes[body:] = src_sizes[rest]


class GroupPacks:
    """The packs of one group while they are filled: the free space of every pack and the runs of samples (ranges of
    fill-order positions) placed in each."""

    def __init__(self, cap: int, gaps=()):
        """``gaps``: free space of packs that exist already (none by default)."""
        self.cap = int(cap)
        self.num = 0
        self.gaps = np.zeros(1024, np.int64)
        self.items = np.zeros(1024, np.int64)  # samples placed in every pack
        self.num_runs = np.zeros(1024, np.int64)  # runs placed in every pack
        self.runs: list[tuple[np.ndarray, ...]] = []  # (first position, count, pack, rank among the pack's runs)
        self._grow(len(gaps))
        self.gaps[:len(gaps)] = gaps
        self.num = len(gaps)

    def _grow(self, extra: int) -> None:
        if self.num + extra > len(self.gaps):
            size = max(2 * len(self.gaps), self.num + extra)
            grow = np.zeros(size - len(self.gaps), np.int64)
            self.gaps, self.items, self.num_runs = (np.concatenate([a, grow]) for a in (self.gaps, self.items,
                                                                                        self.num_runs))

    def place(self, sizes: np.ndarray, start: int, end: int, allow_new: bool) -> int:
        """Place the samples at positions start..end-1 (one segment, all <= cap) in that order; returns the first
        position not placed (``end`` unless ``allow_new`` is False and no pack had room)."""
        if start >= end:
            return start
        hi = int(sizes[start:end].max())
        pos = start
        while pos < end:
            cand = np.flatnonzero(self.gaps[:self.num] >= hi)
            if len(cand):
                counts = self.gaps[cand] // hi  # samples each pack surely takes
                total = np.cumsum(counts)
                need = end - pos
                if total[-1] > need:  # the last packs get what is left
                    cut = int(np.searchsorted(total, need))
                    cand, counts, total = cand[:cut + 1], counts[:cut + 1], total[:cut + 1]
                    counts[-1] -= total[-1] - need
                    total[-1] = need
                first = total - counts
                self.gaps[cand] -= np.add.reduceat(sizes[pos:pos + int(total[-1])], first)
                self.runs.append((pos + first, counts, cand, self.num_runs[cand].copy()))
                self.items[cand] += counts
                self.num_runs[cand] += 1
                pos += int(total[-1])
                continue
            if not allow_new:
                break
            # No pack can surely take another sample of this segment: open packs for the rest, cap // hi each.
            per_pack = max(1, self.cap // hi)
            num_new = -(-(end - pos) // per_pack)
            first = np.arange(num_new, dtype=np.int64) * per_pack
            counts = np.diff(np.append(first, end - pos))
            self._grow(num_new)
            new = np.arange(self.num, self.num + num_new)
            self.gaps[new] = self.cap - np.add.reduceat(sizes[pos:end], first)
            self.items[new] = counts
            self.num_runs[new] = 1
            self.runs.append((pos + first, counts, new, np.zeros(num_new, np.int64)))
            self.num += num_new
            pos = end
        return pos

    def csr(self, order: FillOrder) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(pack_ptr, samples, sample lengths) of the packs: every pack's runs in the order they were placed."""
        ptr = np.concatenate([[0], np.cumsum(self.items[:self.num])]).astype(np.int64)
        if not self.runs:
            return ptr, np.zeros(0, order.samples.dtype), np.zeros(0, order.sizes.dtype)
        first, counts, pack, rank = (np.concatenate(x) for x in zip(*self.runs))
        # Runs grouped by pack (a counting sort: every run knows its rank among its pack's runs), then read in that
        # order: the samples come out pack after pack, each gathered from a run of consecutive positions.
        at = (np.cumsum(self.num_runs[:self.num]) - self.num_runs[:self.num])[pack] + rank
        bits = int(counts.max()).bit_length()
        if int(first.max()) < 1 << (62 - bits):  # both in one int64: one scatter instead of two
            run = np.empty(len(first), np.int64)
            run[at] = first << bits | counts
            taken = _ranges(run >> bits, run & ((1 << bits) - 1))
        else:
            sorted_first, sorted_counts = np.empty_like(first), np.empty_like(counts)
            sorted_first[at], sorted_counts[at] = first, counts
            taken = _ranges(sorted_first, sorted_counts)
        return ptr, order.samples[taken], order.sizes[taken]


def _ranges(starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """starts[i] .. starts[i] + counts[i] - 1 for all i (counts > 0), concatenated: a cumulative sum of steps of 1
    with a jump at every range's start (int32 where the positions fit)."""
    total = int(counts.sum())
    kind = np.int32 if total < 2**31 and int(starts.max()) < 2**31 else np.int64
    head = np.cumsum(counts) - counts
    step = np.ones(total, kind)
    jump = np.empty(len(starts), kind)
    jump[0] = starts[0]
    np.subtract(starts[1:], starts[:-1], out=jump[1:], casting="unsafe")
    jump[1:] -= (counts[:-1] - 1).astype(kind)
    step[head] = jump
    return np.cumsum(step, out=step)


def pack_hierarchical(lengths: np.ndarray, kept: np.ndarray, config: PlanConfig, rng: np.random.Generator):
    """GroupData + Packing + GreedyFill for all groups. Returns (pack_ptr, pack_samples, pack_group).

    ``kept``: the samples to pack (those no longer than the largest pack_len)."""
    sub = np.asarray(lengths)[kept]
    pack_ptr, pack_samples, pack_group, _, _ = pack_groups(sub, config, rng)
    return pack_ptr, np.asarray(kept)[pack_samples].astype(np.int64), pack_group


def pack_groups(lengths: np.ndarray, config: PlanConfig, rng: np.random.Generator):
    """GroupData + Packing + GreedyFill of all samples no longer than the largest pack_len.

    Returns (pack_ptr, pack_samples, pack_group, pack_lengths, dropped): packs group by group (group 0 first),
    ``pack_lengths`` = lengths[pack_samples] (the planner's later passes read it instead of gathering again),
    ``dropped`` the samples longer than the largest pack_len."""
    pack_lens = [g.pack_len for g in config.groups]
    order, dropped = fill_order(lengths, pack_lens, rng)
    start = order.seg_ptr[:-1].copy()  # first position of every segment not yet packed
    end = order.seg_ptr[1:]
    parts = []
    for i in range(len(pack_lens) - 1, -1, -1):
        packs = GroupPacks(pack_lens[i])
        for s in np.flatnonzero(order.seg_level == i).tolist():
            start[s] = packs.place(order.sizes, int(start[s]), int(end[s]), True)
        if i > 0 and packs.num:
            for s in np.flatnonzero(order.seg_level < i).tolist():  # GreedyFill from all lower groups
                start[s] = packs.place(order.sizes, int(start[s]), int(end[s]), False)
        parts.append((i, *packs.csr(order)))
    ptrs, flats, sizes, groups, offset = [], [], [], [], 0
    for i, ptr, flat, size in sorted(parts, key=lambda p: p[0]):
        ptrs.append(ptr[1:] + offset)
        flats.append(flat)
        sizes.append(size)
        groups.append(np.full(len(ptr) - 1, i, np.int32))
        offset += len(flat)
    pack_ptr = np.concatenate([[0]] + ptrs).astype(np.int64)
    return (pack_ptr, np.concatenate(flats).astype(np.int64), np.concatenate(groups), np.concatenate(sizes),
            dropped)


def progress_bar(config: PlanConfig, num_samples: int, total: int, desc: str):
    """A tqdm bar over planning phases, shown only when asked for and the input is large (>= 100K samples)."""
    from tqdm.auto import tqdm

    quiet = not config.progress or num_samples < 100_000
    return tqdm(total=total, desc=desc, unit="phase", disable=True if quiet else None)  # None: off in a log file


def plan_hbp(lengths: np.ndarray, config: PlanConfig) -> Plan:
    """The hbp strategy (see the module docstring). ``lengths`` already checked (int64, all >= 1)."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(config.seed)
    bar = progress_bar(config, len(lengths), total=3, desc="hbp planning")
    pack_ptr, pack_samples, pack_group, pack_lengths, dropped = pack_groups(lengths, config, rng)
    bar.update()
    pack_ptr, pack_samples, pack_group, step_ptr, step_packs, step_group, pack_lengths = build_steps(
        lengths, pack_ptr, pack_samples, pack_group, config, balance=True,
        mix_steps=config.step_mix == "stratified", rng=rng, pack_lengths=pack_lengths,
    )
    bar.update()
    optimizer_step = None
    if config.step_mix == "mixed":
        step_ptr, step_packs, step_group, optimizer_step = mix_group_steps(
            step_ptr, step_packs, step_group, config, rng, empty_pack=np.diff(pack_ptr) == 0)
        if np.all(np.diff(optimizer_step) > 0):
            optimizer_step = None  # one group: every optimizer step is one plan step
    else:
        order = order_steps(step_group, config.curriculum_steps, rng)
        step_ptr, step_packs, step_group = reorder_steps(step_ptr, step_packs, step_group, order)
    bar.update()
    bar.close()
    plan = Plan(
        config=config, lengths=lengths, pack_ptr=pack_ptr, pack_samples=pack_samples, pack_group=pack_group,
        step_ptr=step_ptr, step_packs=step_packs, step_group=step_group, optimizer_step=optimizer_step, dropped=dropped,
        dropped_reason=[DROP_TOO_LONG] * len(dropped), extra={"planning_seconds": time.perf_counter() - t0},
    )
    return plan  # make_plan fills the metrics once the steps are final (equal_steps may re-cut them)
