"""Hierarchical balance packing (paper Alg. 2 and appendix J): GroupData, packing, GreedyFill, balanced steps.

For groups i = n..1 (largest first):

1. **GroupData**: sample x goes to group i when l_{i-1} < len(x) <= l_i (l_0 = 0).
2. **Packing** group i's remaining samples into packs of l_i tokens (``fill_bins`` with new bins allowed).
3. **GreedyFill**: top up group i's packs with samples still unpacked in the groups below (``fill_bins`` with no
   new bins); those samples leave their group. The paper walks D_{i-1}, ..., D_1 in turn; we sweep all lower
   groups together from the largest size class down, which fills at least as tightly (first-fit decreasing).
4. **Balance**: steps are built per group by ``balance.build_steps`` (cost-sorted slots, dealt to steps one per
   cost stratum so that every step spans the group's lengths), then ordered by ``curriculum.order_steps``
   (seeded shuffle, curriculum, interleave).

``fill_bins`` is a vectorised first-fit-decreasing: samples are bucketed into size classes [2^(c/2), 2^((c+1)/2))
and processed from the largest class down, in random (seeded) order within a class. For a class whose largest
sample is ``hi``, every pack with gap g can take floor(g / hi) samples of that class for sure, so a whole class
is placed with a few numpy passes (repeat pack ids by their slot counts, assign in order) instead of a
per-sample Python loop. Samples no pack can take open new packs (cap // hi each). Waste per pack ends up below
the smallest samples that were left when it was topped up.
"""

from __future__ import annotations

import time

import numpy as np

from hbp_train.planning.balance import build_steps, reorder_steps
from hbp_train.planning.curriculum import mix_group_steps, order_steps, sample_levels
from hbp_train.planning.plan import DROP_TOO_LONG, Plan, PlanConfig

# Size classes per doubling of length: 2 -> classes [2^(c/2), 2^((c+1)/2)), samples within 1.41x of each other.
CLASSES_PER_OCTAVE = 2
# Longest sample for which size_classes uses a lookup table (32 MB); beyond it, a float log2 per sample.
SIZE_CLASS_TABLE_MAX = 1 << 22


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


def fill_bins(
    items: np.ndarray,
    item_class: np.ndarray,
    lengths: np.ndarray,
    gaps: np.ndarray,
    cap: int,
    allow_new: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """Place samples ``items`` (indices into ``lengths``, each <= cap) into packs with free space ``gaps``.

    ``items`` must come ordered by size class descending (``item_class``, non-increasing), in random order within
    a class. Returns ``(item_bin, gaps)``: the pack of every item (-1 = not placed; only when ``allow_new`` is
    False) and the updated free space, including packs opened here (ids continue after the existing ones)."""
    gaps = np.asarray(gaps, np.int64).copy()
    item_bin = np.full(len(items), -1, np.int32 if len(items) < 2**31 else np.int64)  # pack ids < number of items
    if len(items) == 0:
        return item_bin, gaps
    sizes = lengths[items]
    starts = np.flatnonzero(np.r_[True, item_class[1:] != item_class[:-1]])
    ends = np.r_[starts[1:], len(items)]
    seg_max = np.maximum.reduceat(sizes, starts)
    for s, e, hi in zip(starts.tolist(), ends.tolist(), seg_max.tolist()):
        pos = s
        while pos < e:
            need = e - pos
            k = gaps // hi
            nz = np.flatnonzero(k)
            if len(nz):
                counts = k[nz]
                ck = np.cumsum(counts)
                cut = int(np.searchsorted(ck, need))  # first pack where the running slot count reaches `need`
                if cut < len(ck):
                    nz, counts = nz[:cut + 1], counts[:cut + 1]
                    counts[-1] -= ck[cut] - need
                slot_bins = np.repeat(nz, counts)
                take = slice(pos, pos + len(slot_bins))
                item_bin[take] = slot_bins
                if len(slot_bins) < 256:  # few items: a scattered subtract beats a full-length bincount
                    np.subtract.at(gaps, slot_bins, sizes[take])
                else:
                    gaps -= np.bincount(slot_bins, weights=sizes[take], minlength=len(gaps)).astype(np.int64)
                pos += len(slot_bins)
                continue
            if not allow_new:
                break
            # No pack can surely take another sample of this class: open packs for the rest, cap // hi each.
            per_bin = max(1, cap // hi)
            new_bin = len(gaps) + np.arange(e - pos, dtype=item_bin.dtype) // per_bin
            item_bin[pos:e] = new_bin
            num_new = int(new_bin[-1] - len(gaps) + 1)
            filled = np.bincount(new_bin - len(gaps), weights=sizes[pos:e], minlength=num_new).astype(np.int64)
            gaps = np.concatenate([gaps, cap - filled])
            pos = e
    return item_bin, gaps


def pack_hierarchical(lengths: np.ndarray, kept: np.ndarray, config: PlanConfig, rng: np.random.Generator):
    """GroupData + Packing + GreedyFill for all groups. Returns (pack_ptr, pack_samples, pack_group)."""
    pack_lens = [g.pack_len for g in config.groups]
    # One global order serves every fill: size class descending, random within a class. Each group's items and
    # each GreedyFill pool are subsequences of it, taken with masks (O(n), no further sorting).
    cls_all = size_classes(lengths[kept])
    perm = rng.permutation(len(kept))
    perm = perm[np.argsort(-cls_all[perm], kind="stable")]  # int16 keys: numpy's stable sort is a radix sort
    # int32 indices (num_samples < 2^31) halve the memory of the 10M-sample working set; temporaries freed early.
    order = kept[perm].astype(np.int32) if len(kept) < 2**31 else kept[perm]
    order_cls = cls_all[perm]
    del perm, cls_all
    level = sample_levels(lengths[order], pack_lens)  # GroupData (see group_data), int8
    free = np.ones(len(order), bool)  # not yet packed
    group_items, group_bins = [None] * len(pack_lens), [None] * len(pack_lens)
    for i in range(len(pack_lens) - 1, -1, -1):
        cap = pack_lens[i]
        own = np.flatnonzero(free & (level == i))  # what higher groups' GreedyFill left of group i
        item_bin, gaps = fill_bins(order[own], order_cls[own], lengths, np.zeros(0, np.int64), cap, True)
        items, bins = [order[own]], [item_bin]
        free[own] = False
        if i > 0 and len(gaps):
            pool = np.flatnonzero(free & (level < i))  # GreedyFill from all lower groups
            fill_bin, gaps = fill_bins(order[pool], order_cls[pool], lengths, gaps, cap, False)
            placed = fill_bin >= 0
            items.append(order[pool[placed]])
            bins.append(fill_bin[placed])
            free[pool[placed]] = False
        group_items[i] = np.concatenate(items)
        group_bins[i] = np.concatenate(bins)
    ptrs, flats, groups, offset = [], [], [], 0
    for i in range(len(pack_lens)):
        items, bins = group_items[i], group_bins[i]
        if len(items) == 0:
            continue
        bin_order = np.argsort(bins, kind="stable")
        counts = np.bincount(bins)
        assert np.all(counts > 0), "every opened pack holds a sample"
        flats.append(items[bin_order])
        ptrs.append(offset + np.cumsum(counts))
        groups.append(np.full(len(counts), i, np.int32))
        offset += len(items)
    pack_ptr = np.concatenate([[0]] + ptrs).astype(np.int64)
    pack_samples = np.concatenate(flats).astype(np.int64) if flats else np.zeros(0, np.int64)
    pack_group = np.concatenate(groups) if groups else np.zeros(0, np.int32)
    return pack_ptr, pack_samples, pack_group


def progress_bar(config: PlanConfig, num_samples: int, total: int, desc: str):
    """A tqdm bar over planning phases, shown only when asked for and the input is large (>= 100K samples)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="phase", disable=not config.progress or num_samples < 100_000)


def plan_hbp(lengths: np.ndarray, config: PlanConfig) -> Plan:
    """The hbp strategy (see the module docstring). ``lengths`` already checked (int64, all >= 1)."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(config.seed)
    too_long = lengths > config.groups[-1].pack_len
    kept, dropped = np.flatnonzero(~too_long), np.flatnonzero(too_long)
    bar = progress_bar(config, len(lengths), total=3, desc="hbp planning")
    pack_ptr, pack_samples, pack_group = pack_hierarchical(lengths, kept, config, rng)
    bar.update()
    pack_ptr, pack_samples, pack_group, step_ptr, step_packs, step_group = build_steps(
        lengths, pack_ptr, pack_samples, pack_group, config, balance=True,
        mix_steps=config.step_mix == "stratified", rng=rng,
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
    return Plan(
        config=config, lengths=lengths, pack_ptr=pack_ptr, pack_samples=pack_samples, pack_group=pack_group,
        step_ptr=step_ptr, step_packs=step_packs, step_group=step_group, optimizer_step=optimizer_step, dropped=dropped,
        dropped_reason=[DROP_TOO_LONG] * len(dropped), extra={"planning_seconds": time.perf_counter() - t0},
    )
