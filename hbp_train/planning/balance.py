"""Step building: packs of one group -> optimizer steps of R replicas x m micro-batches, balanced per slot.

Under DeepSpeed ZeRO every micro-batch ends in collectives across all ranks (docs/planning.md), so the k-th
packs of all R replicas of a step run in lock-step: a *slot*. Balancing therefore targets every slot, not only
each replica's sum. ``balance=True`` sorts packs by cost and cuts the sorted order into slots of R consecutive
packs (the paper's attention-balance sorting); with ``refine`` every slot still uneven after that gets a local
search that moves or swaps single samples between its packs (``refine_slot``). Sorting alone cannot fix the
top of the cost distribution, where neighbouring packs differ a lot; re-forming packs can.
``mix_steps`` deals the sorted slots to steps one per cost stratum (``stratify_slots``) instead of m consecutive
ones, so steps are not homogeneous in length (#16); the slots, hence the balance, stay the same.
``balance=False`` keeps the packs' order (the isf baseline).

Tail rule (every sample is trained, no step has uneven replicas): a group whose pack count is not a multiple of
R*m gets one smaller final step with m' = ceil(r/R) micro-batches built from the r least-filled packs (with
balancing, whole slots of cost neighbours but for r mod R packs: ``split_tail``). With balancing, their samples
are dealt afresh into R*m' packs by attention cost (``_lpt_repack``); otherwise (or if that cannot fill every
pack) the R*m' - r missing packs are made by splitting multi-sample packs of that step in two (largest first);
only when no pack of the step has two samples left does the step get empty packs ([]), counted in
plan["empty_packs"] — the trainer runs a zero-loss dummy micro-batch for them.
"""

from __future__ import annotations

import numpy as np

from hbp_train.planning.csr import gather_ranges, pack_tokens, segment_sums
from hbp_train.planning.plan import GroupSpec, PlanConfig


def default_pack_cost(pack_lengths: np.ndarray, pack_ptr: np.ndarray, group: GroupSpec | None = None) -> np.ndarray:
    """Attention cost of every pack: sum of len^2 over its samples (float64)."""
    squares = pack_lengths.astype(np.float64)
    np.multiply(squares, squares, out=squares)
    return segment_sums(squares, pack_ptr)


def pack_costs(lengths, pack_ptr, pack_samples, pack_group, config: PlanConfig,
               pack_lengths: np.ndarray | None = None) -> np.ndarray:
    """float64 [num_packs]: the cost the balancer equalises (config.pack_cost per group, default sum len^2).
    ``pack_lengths``: ``lengths[pack_samples]`` when the caller has it."""
    flat = lengths[pack_samples] if pack_lengths is None else pack_lengths
    if config.pack_cost is None:
        return default_pack_cost(flat, pack_ptr)
    cost = np.zeros(len(pack_ptr) - 1)
    for g, spec in enumerate(config.groups):
        ids = np.flatnonzero(pack_group == g)
        if len(ids) == 0:
            continue
        sizes = pack_ptr[ids + 1] - pack_ptr[ids]
        sub_ptr = np.concatenate([[0], np.cumsum(sizes)])
        sub_flat = flat[gather_ranges(pack_ptr[ids], sizes)]
        cost[ids] = np.asarray(config.pack_cost(sub_flat, sub_ptr, spec), np.float64)
    return cost


def _slot_abr(costs_2d: np.ndarray) -> np.ndarray:
    """Imbalance 1 - mean/max of every row (a slot); 0 for all-zero rows."""
    mx = costs_2d.max(axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        out = 1.0 - costs_2d.mean(axis=1) / mx
    return np.where(mx > 0, out, 0.0)


def _split_pack(samples: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split a pack of >= 2 samples into two with token counts as even as possible (order kept)."""
    cs = np.cumsum(lengths[samples])
    cut = int(np.clip(np.searchsorted(cs, cs[-1] / 2.0), 1, len(samples) - 1))
    # searchsorted finds the first prefix >= half; the previous cut may be closer to even.
    if cut > 1 and abs(cs[cut - 2] - cs[-1] / 2.0) < abs(cs[cut - 1] - cs[-1] / 2.0):
        cut -= 1
    return samples[:cut], samples[cut:]


def _list_costs(packs: list[np.ndarray], lengths: np.ndarray, config: PlanConfig, group: int) -> np.ndarray:
    """Cost of packs given as a list of sample-index arrays."""
    ptr = np.concatenate([[0], np.cumsum([len(p) for p in packs])]).astype(np.int64)
    flat = np.concatenate(packs).astype(np.int64) if packs else np.zeros(0, np.int64)
    fn = config.pack_cost or default_pack_cost
    return np.asarray(fn(lengths[flat], ptr, config.groups[group]), np.float64)


def refine_slot(packs: list[np.ndarray], lengths: np.ndarray, config: PlanConfig, group: int,
                max_moves: int = 6, partners: int = 4) -> list[np.ndarray] | None:
    """Even out the cost of the packs of one slot by moving or swapping single samples between them.

    Repeatedly takes the costliest pack h and picks, over the ``partners`` cheapest packs j at once (vectorised),
    the move of one sample x from h to j, or the swap of x with a sample y of j, that minimises
    max(cost_h', cost_j') within the pack capacity. Candidates are scored with the attention cost (sum len^2,
    exact by a delta formula); with a ``config.pack_cost`` the chosen move is accepted only if the real cost of
    both packs stays below cost_h. Every accepted move strictly lowers the slot maximum while the slot's total
    attention is unchanged, so its imbalance drops. Returns the new packs, or None if nothing improved."""
    cap = config.groups[group].pack_len
    r = len(packs)
    width = max(len(p) for p in packs) + 1  # one spare column so a pack can receive a sample
    ids = np.full((r, width), -1, np.int64)
    for i, p in enumerate(packs):
        ids[i, :len(p)] = p
    lens = np.where(ids >= 0, lengths[np.maximum(ids, 0)], 0).astype(np.float64)
    att = (lens * lens).sum(axis=1)
    tok = lens.sum(axis=1)
    custom = config.pack_cost is not None
    cost = _list_costs(packs, lengths, config, group) if custom else att.copy()
    changed = False
    for _ in range(max_moves):
        h = int(np.argmax(cost))
        cand = np.argsort(cost, kind="stable")[:partners + 1]
        cand = cand[cand != h][:partners]
        move = _best_move(lens, att, tok, h, cand, cap, np.count_nonzero(ids[h] >= 0) == 1)
        if move is None or move[0] >= att[h] * (1 - 1e-9):
            break
        _, xi, ji, yi = move
        j = int(cand[ji])
        new_ids = ids.copy()
        new_ids[h, xi], new_ids[j, yi] = ids[j, yi], ids[h, xi]
        if custom:
            pair = [row[row >= 0] for row in new_ids[[h, j]]]
            new_cost = _list_costs(pair, lengths, config, group)
            if new_cost.max() >= cost[h]:
                break
            cost[h], cost[j] = new_cost
        ids = new_ids
        lens[h, xi], lens[j, yi] = lens[j, yi], lens[h, xi]
        att[h], att[j] = (lens[h] ** 2).sum(), (lens[j] ** 2).sum()
        tok[h], tok[j] = lens[h].sum(), lens[j].sum()
        if not custom:
            cost[h], cost[j] = att[h], att[j]
        changed = True
        if ids[j, -1] >= 0:  # keep a spare column for the next move
            ids = np.pad(ids, ((0, 0), (0, 1)), constant_values=-1)
            lens = np.pad(lens, ((0, 0), (0, 1)))
    if not changed:
        return None
    return [row[row >= 0] for row in ids]


def _best_move(lens: np.ndarray, att: np.ndarray, tok: np.ndarray, h: int, cand: np.ndarray, cap: int,
               single: bool) -> tuple[float, int, int, int] | None:
    """The move or swap of refine_slot: (score, cell of x in pack h, index of the partner in ``cand``, cell of y in
    it; y = 0 is an empty cell, a move) minimising max(att_h - g, att_j + g), g = x^2 - y^2 > 0, with the partner's
    tokens staying within ``cap`` (y >= x - room_j); ``single``: h keeps a sample (y > 0). None if nothing fits.

    For a partner j the score falls until g = (att_h - att_j) / 2 and rises after it, so for every x the best y is
    one of the two feasible values around the y that would hit it (or the smallest feasible y): three candidates
    per (x, partner) found by binary search in the partners' sorted lengths, instead of every (x, y) pair (packs of
    hundreds of short samples made that a tensor of millions of cells per move)."""
    cells = np.flatnonzero(lens[h] > 0)
    if len(cells) == 0:
        return None
    x = lens[h, cells][:, None]  # [X, 1]
    order = np.argsort(lens[cand], axis=1, kind="stable")
    ys = np.take_along_axis(lens[cand], order, axis=1)  # [P, W] each row ascending, empty cells (0) first
    num, width = ys.shape
    band = (np.arange(num) * (2.0 * cap + 4))[None, :]  # row p's values moved to [p * band, p * band + cap]
    flat = (ys + band.T).ravel()  # ascending over all rows: one binary search serves every partner
    low = np.maximum(x - (cap - tok[cand])[None, :], 0.5 if single else 0.0)  # [X, P]
    aim = np.sqrt(np.maximum(x * x - (att[h] - att[cand])[None, :] / 2, 0.0))
    lo, hi, at = (np.searchsorted(flat, (v + band).ravel(), side).reshape(v.shape)
                  for v, side in ((low, "left"), (x + 0 * band, "left"), (aim, "right")))
    valid = hi > lo
    last = np.maximum(hi - 1, lo)
    pick = np.stack([lo, np.clip(at - 1, lo, last), np.clip(at, lo, last)])  # [3, X, P] indices into flat
    pick = np.where(valid, pick, 0)
    y = flat[pick] - band
    gain = x * x - y * y
    score = np.where(valid, np.maximum(att[h] - gain, att[cand][None, :] + gain), np.inf)
    best = np.unravel_index(int(np.argmin(score)), score.shape)
    if not np.isfinite(score[best]):
        return None
    ji = int(best[2])
    return float(score[best]), int(cells[best[1]]), ji, int(order[ji, pick[best] - ji * width])


# Slots whose imbalance (1 - mean/max of the balanced cost) is above this get the refine pass: most sorted
# slots are already within 1e-4 and touching them would only cost time.
REFINE_ABOVE = 1e-3
# At most this many of the most uneven slots per group are refined: the pass is a Python loop per slot and the
# worst slots carry most of the imbalance (bench/bench_planner.py measures the gain).
REFINE_MAX_SLOTS = 64


def build_steps(
    lengths: np.ndarray,
    pack_ptr: np.ndarray,
    pack_samples: np.ndarray,
    pack_group: np.ndarray,
    config: PlanConfig,
    balance: bool = True,
    refine: bool | None = None,
    mix_steps: bool = False,
    rng: np.random.Generator | None = None,
    pack_lengths: np.ndarray | None = None,
):
    """Turn packs into steps, group by group.

    Returns ``(pack_ptr, pack_samples, pack_group, step_ptr, step_packs, step_group)``: the packs (tail packs may
    have been split or empty ones added, refined slots re-formed; see the module docstring) and the steps,
    slot-major (``step_packs[step_ptr[s] + k*R + r]``), ordered group by group (full steps in slot order, then
    the tail). Step order is decided later (curriculum.order_steps). ``refine`` defaults to
    ``config.balance == "refine"`` (only used with ``balance``). ``mix_steps`` (with ``balance``): full steps take
    one slot of each of m cost strata (``stratify_slots``, seeded by ``rng``, which it needs) instead of m
    consecutive slots. Deterministic given the packs (and ``rng``). ``pack_lengths``: ``lengths[pack_samples]`` when
    the caller has it (a gather of every sample saved); the returned tuple then ends with that of the returned packs.
    """
    if refine is None:
        refine = config.balance == "refine"
    if mix_steps and rng is None:
        raise ValueError("build_steps(mix_steps=True) needs the rng that seeds the dealing")
    flat = lengths[pack_samples] if pack_lengths is None else pack_lengths  # one gather for both
    tokens = pack_tokens(lengths, pack_ptr, pack_samples, flat)
    cost = pack_costs(lengths, pack_ptr, pack_samples, pack_group, config, flat) if balance else None
    del flat
    n_packs = len(pack_ptr) - 1
    # Packs made here (tail splits, refined slots) are appended after the existing ones; the packs they replace
    # drop out when the CSR is rebuilt at the end.
    extra_packs: list[np.ndarray] = []
    extra_group: list[int] = []

    def add_pack(samples, g):
        extra_packs.append(np.asarray(samples, np.int64))
        extra_group.append(g)
        return n_packs + len(extra_packs) - 1

    def contents(p):
        return pack_samples[pack_ptr[p]:pack_ptr[p + 1]] if p < n_packs else extra_packs[p - n_packs]

    def refine_layout(layout: np.ndarray, g: int, slot_cost: np.ndarray | None = None) -> np.ndarray:
        """Run refine_slot on every slot of ``layout`` (slot-major pack ids) that is not already even."""
        r = config.replicas(g)
        slots = layout.reshape(-1, r).copy()
        if slot_cost is None:
            slot_cost = cost[slots]
        imbalance = _slot_abr(slot_cost)
        worst = np.argsort(-imbalance, kind="stable")[:REFINE_MAX_SLOTS]
        for k in worst[imbalance[worst] > REFINE_ABOVE]:
            new = refine_slot([contents(p) for p in slots[k]], lengths, config, g)
            if new is not None:
                slots[k] = [add_pack(pk, g) for pk in new]
        return slots.reshape(-1)

    step_chunks, step_sizes, step_groups = [], [], []
    for g in range(len(config.groups)):
        ids = np.flatnonzero(pack_group == g)
        if len(ids) == 0:
            continue
        r, m = config.replicas(g), config.micro_batches(g)
        per_step = r * m
        num_full = len(ids) // per_step
        num_tail = len(ids) - num_full * per_step
        if balance:
            # Paper: sort by cost, cut into slots of R consecutive packs (m slots per step); the tail step takes
            # the least-filled packs and slots (split_tail).
            tail, full = split_tail(ids, tokens, cost, r, num_tail)
            if refine and r > 1 and len(full):
                full = refine_layout(full, g)
            if mix_steps and num_full > 1:
                full = stratify_slots(full, r, m, rng)
        else:
            full, tail = ids[:num_full * per_step], ids[num_full * per_step:]
        if num_full:
            step_chunks.append(full)
            step_sizes.extend([per_step] * num_full)
            step_groups.extend([g] * num_full)
        if num_tail:
            tail_ids = _tail_step(tail, r, lengths, contents, lambda samples: add_pack(samples, g),
                                  config.groups[g].pack_len if balance else None)
            if balance:
                t_cost = _list_costs([contents(p) for p in tail_ids], lengths, config, g)
                order = np.argsort(-t_cost, kind="stable")
                tail_ids, t_cost = tail_ids[order], t_cost[order]
                if refine and r > 1:
                    tail_ids = refine_layout(tail_ids, g, t_cost.reshape(-1, r))
            step_chunks.append(tail_ids)
            step_sizes.append(len(tail_ids))
            step_groups.append(g)
    step_packs = np.concatenate(step_chunks).astype(np.int64) if step_chunks else np.zeros(0, np.int64)
    if extra_packs:
        # Rebuild the CSR with only the packs the steps use (replaced packs drop out), renumbered in order. A few
        # packs change among millions: a mask over the samples keeps the others where they are, no gather.
        keep = np.zeros(n_packs + len(extra_packs), bool)
        keep[step_packs] = True
        old_sizes = np.diff(pack_ptr)
        extra_sizes = np.array([len(p) for p in extra_packs], np.int64)
        extra_flat = np.concatenate(extra_packs)[np.repeat(keep[n_packs:], extra_sizes)]
        kept_samples = np.repeat(keep[:n_packs], old_sizes)
        pack_samples = np.concatenate([pack_samples[kept_samples], extra_flat])
        if pack_lengths is not None:
            pack_lengths = np.concatenate([pack_lengths[kept_samples], lengths[extra_flat]])
        sizes = np.concatenate([old_sizes[keep[:n_packs]], extra_sizes[keep[n_packs:]]])
        pack_ptr = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        pack_group = np.concatenate([pack_group, np.asarray(extra_group, pack_group.dtype)])[keep]
        step_packs = (np.cumsum(keep) - 1)[step_packs]
    step_ptr = np.concatenate([[0], np.cumsum(step_sizes)]).astype(np.int64)
    out = pack_ptr, pack_samples, pack_group.astype(np.int32), step_ptr, step_packs, np.asarray(step_groups, np.int32)
    return out if pack_lengths is None else (*out, pack_lengths)


def split_tail(ids: np.ndarray, tokens: np.ndarray, cost: np.ndarray, r: int, num_tail: int):
    """(tail, full) of a group's packs ``ids``: ``full`` slot-major, sorted by cost, R cost neighbours a slot.

    The tail step gets the least-filled packs (the packer's last, partial bins) but only ``num_tail mod R`` of them
    one by one; the rest of it is whole slots, those with the fewest tokens, cut from the cost order first. Taking
    single packs by fill out of the cost order would leave the full slots pairing packs that were not neighbours:
    when a group has few packs, all about as full (long documents topped up by GreedyFill), the least-filled packs
    are any packs, and the slots around the holes they leave were 20-40% uneven (bench_speed at 4 packs a rank)."""
    by_fill = ids[np.argsort(tokens[ids], kind="stable")]
    loose = num_tail % r
    rest = by_fill[loose:]
    slots = rest[np.argsort(-cost[rest], kind="stable")].reshape(-1, r)
    in_tail = np.zeros(len(slots), bool)
    in_tail[np.argsort(tokens[slots].sum(axis=1), kind="stable")[:(num_tail - loose) // r]] = True
    return np.concatenate([by_fill[:loose], slots[in_tail].reshape(-1)]), slots[~in_tail].reshape(-1)


def stratify_slots(layout: np.ndarray, r: int, m: int, rng: np.random.Generator) -> np.ndarray:
    """Deal cost-sorted slots to steps so that every step holds one slot of each of m cost strata.

    ``layout`` is slot-major (``num_steps * m`` slots of ``r`` packs, sorted by cost, heaviest first). Cutting it into
    runs of m consecutive slots makes every step homogeneous in pack cost, hence in sample length (a step of only
    the shortest samples next to a step of only the longest). Here the sorted slots are cut into m strata of
    ``num_steps`` consecutive slots; step j takes slot ``perm_k[j]`` of stratum k for every k (``perm_k`` a seeded
    permutation). The slots themselves are unchanged, so every slot keeps its balance (ABR, DBR), while every step
    draws its packs from the whole cost range of the group like a random batch would."""
    slots = layout.reshape(m, -1, r)  # [stratum, step, replica]
    num_steps = slots.shape[1]
    pick = np.stack([rng.permutation(num_steps) for _ in range(m)])  # [stratum, step]
    return slots[np.arange(m)[:, None], pick].transpose(1, 0, 2).reshape(-1)


def _lpt_repack(samples: np.ndarray, lengths: np.ndarray, num_bins: int, cap: int) -> list[np.ndarray] | None:
    """The samples dealt into ``num_bins`` packs of at most ``cap`` tokens with even attention cost (sum len^2):
    longest first, each into the cheapest pack it fits (LPT). None if some sample fits nowhere."""
    import heapq

    order = samples[np.argsort(-lengths[samples], kind="stable")]
    heap = [(0.0, i) for i in range(num_bins)]  # (cost, bin)
    tokens = np.zeros(num_bins, np.int64)
    bins: list[list[int]] = [[] for _ in range(num_bins)]
    for s in order.tolist():
        length = int(lengths[s])
        skipped = []
        while heap and tokens[heap[0][1]] + length > cap:
            skipped.append(heapq.heappop(heap))
        if not heap:
            return None
        cost, b = heapq.heappop(heap)
        bins[b].append(s)
        tokens[b] += length
        heapq.heappush(heap, (cost + float(length) ** 2, b))
        for item in skipped:
            heapq.heappush(heap, item)
    return [np.asarray(b, np.int64) for b in bins]


def _tail_step(tail: np.ndarray, r: int, lengths: np.ndarray, contents, add_pack, cap: int | None = None) -> np.ndarray:
    """Pack ids of a group's tail step: the r' = len(tail) packs padded to a multiple of R (see module doc).

    With ``cap`` (balancing on), the tail's samples are first dealt afresh into the R*m' packs by LPT on their
    attention cost: the least-filled packs the packer left are uneven by nature, and splitting them only halves
    the unevenness. If there are at least as many samples as packs, no pack is left empty."""
    m_tail = -(-len(tail) // r)
    need = m_tail * r - len(tail)
    if cap is not None:
        samples = np.concatenate([contents(p) for p in tail]).astype(np.int64)
        if len(samples) >= m_tail * r:
            dealt = _lpt_repack(samples, lengths, m_tail * r, cap)
            if dealt is not None and all(len(pk) for pk in dealt):
                return np.asarray([add_pack(pk) for pk in dealt], np.int64)
    packs = [contents(p) for p in tail]
    is_new = [False] * len(packs)
    while need > 0:
        splittable = [i for i, pk in enumerate(packs) if len(pk) >= 2]
        if not splittable:
            break
        # Split the fullest splittable pack: its halves are the most even fillers.
        i = max(splittable, key=lambda j: int(lengths[packs[j]].sum()))
        packs[i], second = _split_pack(packs[i], lengths)
        is_new[i] = True
        packs.append(second)
        is_new.append(True)
        need -= 1
    # Last resort: too few samples for one pack per replica; the trainer runs a zero-loss dummy for [].
    packs.extend([np.zeros(0, np.int64)] * need)
    is_new.extend([True] * need)
    ids = [add_pack(pk) if new else int(old) for pk, new, old in zip(packs, is_new, list(tail) + [-1] * (len(packs) - len(tail)))]
    return np.asarray(ids, np.int64)


def reorder_steps(step_ptr: np.ndarray, step_packs: np.ndarray, step_group: np.ndarray, order: np.ndarray):
    """Apply a step permutation: returns (step_ptr, step_packs, step_group) with step i = old step order[i]."""
    sizes = np.diff(step_ptr)[order]
    flat = step_packs[gather_ranges(step_ptr[order], sizes)]
    return np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64), flat, step_group[order]
