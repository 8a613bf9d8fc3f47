"""Best-fit decreasing (BFD) packing: the strongest single-group baseline, as TRL and ms-swift pack SFT data.

All samples go to the largest group (one pack length, one SP degree, like isf and sorted):

1. samples are taken longest first (ties in a seeded random order) and each goes into the open pack whose free
   space is the SMALLEST that still fits it (best fit); a sample no pack fits opens a new pack. This is TRL's
   ``pack_dataset(strategy="bfd")`` (and ms-swift's packing): padding is only the slack BFD cannot close, far
   below isf's next-fit on long-tailed data.
2. the packs are shuffled (seeded), as the trainer's sampler shuffles a packed dataset in TRL, so a step mixes
   long-sample and short-sample packs instead of running all the longest documents first;
3. steps take packs in that shuffled order, **plainly, with no balancing** (balance.build_steps with
   balance=False, like isf): TRL does not balance attention across data-parallel ranks. The tail rule is
   build_steps'. Steps are then ordered with the shared curriculum order (curriculum.order_steps, level = the
   group of a step's longest sample), as sorted does.

Best fit keeps the free spaces of the open packs in one sorted Python list of keys ``gap << 32 | pack``: bisect
finds the smallest gap >= the sample's length, the pack's key moves to its new gap. Each sample costs a bisect
and a list insert/delete (memmove over the open packs, C speed); a run of samples of one length whose candidate
packs all drop below that length after one sample (gap < 2 x length) is placed in one slice operation.
"""

from __future__ import annotations

import time
from bisect import bisect_left, insort

import numpy as np

from hbp_train.planning.balance import build_steps
from hbp_train.planning.baselines.sorted import length_sorted, single_group_plan
from hbp_train.planning.plan import Plan, PlanConfig

_SHIFT = 32  # key = gap << 32 | pack id: sorting the keys sorts by gap, then by pack id (deterministic ties)
_MASK = (1 << _SHIFT) - 1


def best_fit_decreasing(order: np.ndarray, lengths: np.ndarray, cap: int) -> np.ndarray:
    """Pack of every sample of ``order`` (already longest first, each <= cap) under best fit: int64 [len(order)]."""
    sizes = lengths[order].tolist()
    out = np.empty(len(sizes), np.int64)
    keys: list[int] = []  # sorted keys of open packs that still have free space
    num_packs = 0
    i, n = 0, len(sizes)
    while i < n:
        size = sizes[i]
        j = i + 1
        while j < n and sizes[j] == size:
            j += 1
        # Samples i..j-1 share one length; place them in as few Python steps as possible.
        while i < j:
            pos = bisect_left(keys, size << _SHIFT)
            # Candidates keys[pos:pos + run] whose gap is < 2 * size take one sample each and then fit no further
            # sample of this run; their new keys (gap - size < size) all sort before position pos.
            run = 0
            limit = min(j - i, len(keys) - pos)
            while run < limit and (keys[pos + run] >> _SHIFT) < 2 * size:
                run += 1
            if run > 1:
                taken = keys[pos:pos + run]
                del keys[pos:pos + run]
                for k in taken:
                    out[i] = k & _MASK
                    i += 1
                    if (k >> _SHIFT) > size:
                        insort(keys, (((k >> _SHIFT) - size) << _SHIFT) | (k & _MASK))
                continue
            if pos < len(keys):  # best fit: the smallest gap that holds the sample
                k = keys.pop(pos)
                gap, pack = (k >> _SHIFT) - size, k & _MASK
            else:  # no open pack fits: open one
                gap, pack = cap - size, num_packs
                num_packs += 1
            out[i] = pack
            i += 1
            if gap > 0:
                insort(keys, (gap << _SHIFT) | pack)
    return out


def plan_bfd(lengths: np.ndarray, config: PlanConfig) -> Plan:
    """The bfd strategy (see the module docstring). ``lengths`` already checked (int64, all >= 1)."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(config.seed)
    last = len(config.groups) - 1
    order, dropped = length_sorted(lengths, config, rng, descending=True)
    pack_of = best_fit_decreasing(order, lengths, config.groups[last].pack_len)
    num_packs = int(pack_of.max()) + 1 if len(pack_of) else 0
    # Shuffle the packs (TRL's sampler shuffles the packed dataset), then lay them out as CSR in that order.
    rank = np.empty(num_packs, np.int64)
    rank[rng.permutation(num_packs)] = np.arange(num_packs)
    by_pack = np.argsort(rank[pack_of], kind="stable")
    pack_samples = order[by_pack].astype(np.int64)
    pack_ptr = np.concatenate([[0], np.cumsum(np.bincount(rank[pack_of], minlength=num_packs))]).astype(np.int64)
    pack_group = np.full(num_packs, last, np.int32)
    pack_ptr, pack_samples, pack_group, step_ptr, step_packs, step_group = build_steps(
        lengths, pack_ptr, pack_samples, pack_group, config, balance=False
    )
    return single_group_plan(config, lengths, pack_ptr, pack_samples, pack_group, step_ptr, step_packs,
                             step_group, dropped, rng, t0)
