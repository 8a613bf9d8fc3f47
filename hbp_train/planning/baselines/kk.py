"""veRL-style Karmarkar-Karp workload balancing across data-parallel replicas: a baseline strategy ("kk").

veRL's SFT trainer (verl/utils/seqlen_balancing.py) balances every global batch across its data-parallel ranks by
Karmarkar-Karp largest differencing on a workload of 24576·s + s² per sample (a linear term for the projections and
MLP, the quadratic attention term), with equal sample counts per rank, and then cuts each rank's samples into the
same number of micro-batches on every rank. Here, all samples go to the largest group (one pack length and SP
degree, like isf):

1. **Steps**: the kept samples in a seeded random order (a shuffled sampler, isf's first round) are cut into
   optimizer steps at the sample boundaries nearest to the real-token budget's multiples (equal_steps.py): every
   strategy's step count. Budget: ``global_tokens`` real tokens (``step_tokens="real"``) or R·m·pack_len.
2. **Replicas**: each step's samples are partitioned across the R replicas by Karmarkar-Karp with **equal counts**
   (veRL's ``equal_size=True``; counts differ by one when R does not divide them) on the workload
   24576·s + s², or ``config.pack_cost`` of every sample alone when a calibrated cost model is given.
3. **Micro-batches**: every replica of a step gets m = max over replicas of ceil(tokens / pack_len) packs (veRL's
   micro-batch count, the same on every rank). veRL splits a rank's samples by Karmarkar-Karp on their lengths
   with a soft token limit; pack_len is a hard capacity here, so they are dealt longest first into the lightest
   pack they fit (``fill_packs``), and a step where that leaves a sample out gets m + 1. Every replica's packs
   run heaviest workload first (veRL's dynamic-batch balance), so slot k pairs the k-th heaviest pack of every
   replica. A step too small to give every replica m non-empty packs (fewer samples than R·m, only when steps
   hold a few samples near pack_len) takes the samples it lacks from the next step (the last one from the step
   before), so the plan keeps every strategy's step count; where that cannot work (a step left with no sample),
   it is merged with the next one, and data too small for even one such step is planned as isf plans it (its
   tail rule may then add empty packs).
4. **Curriculum**: as isf, the first ``curriculum_steps`` steps whose longest sample fits the smallest group move
   to the front.

``karmarkar_karp`` partitions all steps at once: every iteration merges, in every step, the two states of largest
spread (a state: k partial sums, sorted), found through per-block maxima of 64 states, so an iteration costs
O(steps · (states / 64 + 64 + k)); which set of which state ends in which final set is resolved top-down from the
merge tree after the last merge. ``fill_packs`` deals all (step, replica) pairs at once, one item column a pass.
"""

from __future__ import annotations

import time

import numpy as np

from hbp_train.planning.balance import reorder_steps
from hbp_train.planning.curriculum import sample_levels
from hbp_train.planning.equal_steps import equal_steps, even_positions, nearest_cuts, step_budget
from hbp_train.planning.plan import DROP_TOO_LONG, Plan, PlanConfig

# veRL's calculate_workload: 24576 * s + s^2 (24576: the linear layers' share, relative to attention's s^2).
LINEAR_WORKLOAD = 24576
# States per block of the largest-spread search (see the module docstring).
BLOCK = 64
# Most merge-tree cells (instances x 2 x items) of one karmarkar_karp call, ~32 MB per int64 array; more are chunked.
MAX_CELLS = 1 << 22


def sample_workload(lengths: np.ndarray, items: np.ndarray, config: PlanConfig, group: int) -> np.ndarray:
    """Workload of every sample in ``items``: config.pack_cost of the sample alone, else 24576·s + s² (veRL)."""
    if config.pack_cost is None:
        s = lengths[items].astype(np.float64)
        return LINEAR_WORKLOAD * s + s * s
    ptr = np.arange(len(items) + 1, dtype=np.int64)
    return np.asarray(config.pack_cost(lengths[items], ptr, config.groups[group]), np.float64)


def karmarkar_karp(weights: np.ndarray, k: int) -> np.ndarray:
    """Largest differencing (Karmarkar-Karp) partition of every row of ``weights`` [B, n] into k sets of equal
    counts (veRL's ``equal_size=True``): int64 [B, n], the set (0 = heaviest) of every item. Items are taken k at a
    time in ascending order, each group of k one state (one item per set); the two states of largest spread
    (max - min set sum) are merged, the heaviest set of one with the lightest of the other, until one is left.
    Items of weight 0 are padding (rows of different lengths); real items must weigh more than 0, and a row's real
    items then split into sets whose counts differ by at most one."""
    weights = np.asarray(weights, np.float64)
    rows, n = weights.shape
    if k == 1 or n == 0 or rows == 0:
        return np.zeros((rows, n), np.int64)
    pad = (-n) % k
    per_row = 2 * (n + pad)  # cells of the merge tree's two [2 * states, k] arrays per row, about
    if rows * per_row > MAX_CELLS and rows > 1:
        step = max(1, MAX_CELLS // per_row)
        return np.concatenate([karmarkar_karp(weights[i:i + step], k) for i in range(0, rows, step)])
    order = np.argsort(weights, axis=1, kind="stable")  # ascending: padding (0) first
    w = np.concatenate([np.zeros((rows, pad)), np.take_along_axis(weights, order, axis=1)], axis=1)
    sums = w.reshape(rows, -1, k)[:, :, ::-1].copy()  # a group's items, heaviest first: set j holds item k-1-j
    q = np.arange(n) + pad
    final = _differencing(sums)
    out = np.empty((rows, n), np.int64)
    np.put_along_axis(out, order, final[:, q // k, k - 1 - q % k], axis=1)
    return out


def _differencing(sums: np.ndarray) -> np.ndarray:
    """The merges of largest differencing on states ``sums`` [B, S, k] (each row of k sums sorted descending):
    returns [B, S, k], the final set of every set of every initial state."""
    rows_n, num_states, k = sums.shape
    rows = np.arange(rows_n)
    num_blocks = -(-num_states // BLOCK)
    spread = np.full((rows_n, num_blocks * BLOCK), -np.inf)
    spread[:, :num_states] = sums[:, :, 0] - sums[:, :, -1]
    blocks = spread.reshape(rows_n, num_blocks, BLOCK)  # a view: writes to spread show here
    block_max = blocks.max(axis=2)
    node = np.tile(np.arange(num_states), (rows_n, 1))  # merge-tree node of the state in each slot
    # mapping[b, x]: where set j of node x went in its parent (the state it was merged into), after that sort.
    mapping = np.zeros((rows_n, 2 * num_states - 1, k), np.int64)
    children = np.zeros((max(num_states - 1, 0), 2, rows_n), np.int64)
    ks = np.arange(k)

    def pop():
        blk = block_max.argmax(axis=1)
        slot = blk * BLOCK + blocks[rows, blk].argmax(axis=1)
        spread[rows, slot] = -np.inf
        block_max[rows, blk] = blocks[rows, blk].max(axis=1)
        return slot

    for t in range(num_states - 1):
        a, b = pop(), pop()
        merged = sums[rows, a] + sums[rows, b, ::-1]  # heaviest set of one with the lightest of the other
        perm = np.argsort(-merged, axis=1, kind="stable")
        inv = np.empty_like(perm)
        np.put_along_axis(inv, perm, np.broadcast_to(ks, perm.shape), axis=1)
        na, nb = node[rows, a], node[rows, b]
        mapping[rows, na] = inv
        mapping[rows, nb] = inv[:, ::-1]
        children[t] = na, nb
        new_sums = np.take_along_axis(merged, perm, axis=1)
        sums[rows, a] = new_sums
        node[rows, a] = num_states + t
        spread[rows, a] = new_sums[:, 0] - new_sums[:, -1]
        blk = a // BLOCK
        block_max[rows, blk] = blocks[rows, blk].max(axis=1)
    # Top-down: the root (the last merge) keeps its sets; a child's set j ends where its parent's set mapping[j] does.
    final = np.zeros_like(mapping)
    final[:, -1] = ks
    for t in range(num_states - 2, -1, -1):
        parent = final[:, num_states + t]
        for child in children[t]:
            final[rows, child] = np.take_along_axis(parent, mapping[rows, child], axis=1)
    return final[:, :num_states]


def _ragged(values: np.ndarray, owner: np.ndarray, num_owners: int) -> tuple[np.ndarray, np.ndarray]:
    """(matrix [num_owners, max count] of ``values`` by owner, zero-padded; each value's column). ``owner`` must
    be non-decreasing."""
    counts = np.bincount(owner, minlength=num_owners)
    column = np.arange(len(owner)) - np.repeat(np.cumsum(counts) - counts, counts)
    matrix = np.zeros((num_owners, int(counts.max()) if len(counts) else 0), values.dtype)
    matrix[owner, column] = values
    return matrix, column


def fill_packs(tokens: np.ndarray, num_packs: int, cap: int) -> tuple[np.ndarray, np.ndarray]:
    """Every row's items (``tokens`` [B, n] sorted descending, 0 = padding) into ``num_packs`` packs of at most
    ``cap`` tokens: longest first, each into the lightest pack it fits (LPT with a capacity), all rows at once.
    Returns (pack of every item [B, n], row ok [B]: every item placed). The first items open the packs, so a row
    of at least ``num_packs`` items leaves none empty."""
    rows_n, n = tokens.shape
    rows = np.arange(rows_n)
    load = np.zeros((rows_n, num_packs), np.int64)
    pack = np.zeros((rows_n, n), np.int64)
    ok = np.ones(rows_n, bool)
    for i in range(n):
        t = tokens[:, i]
        room = np.where(load + t[:, None] <= cap, load, np.iinfo(np.int64).max)
        choice = room.argmin(axis=1)
        fits = room[rows, choice] < np.iinfo(np.int64).max
        ok &= fits | (t == 0)
        pack[:, i] = choice
        load[rows, choice] += np.where(fits, t, 0)
    return pack, ok


def partition_steps(stream, bounds, lengths, work, num_r: int, cap: int):
    """Replica and pack of every sample of ``stream`` (steps ``bounds``). Returns ((replica, pack rank within the
    replica (0 = heaviest workload), m per step), None), or (None, (the steps that cannot give every replica m
    non-empty packs, their m))."""
    num_steps = len(bounds) - 1
    if num_steps == 0:  # nothing kept
        return (np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.int64)), None
    step_of = np.repeat(np.arange(num_steps), np.diff(bounds))
    tok = lengths[stream]
    matrix, column = _ragged(work[stream], step_of, num_steps)
    replica = karmarkar_karp(matrix, num_r)[step_of, column]
    owner = step_of * num_r + replica  # one owner per (step, replica)
    owner_tokens = np.bincount(owner, tok, minlength=num_steps * num_r).reshape(num_steps, num_r)
    owner_count = np.bincount(owner, minlength=num_steps * num_r).reshape(num_steps, num_r)
    m = np.maximum(1, -(-owner_tokens.max(axis=1).astype(np.int64) // cap))
    # Every owner's items longest first: the order fill_packs takes them in.
    by_owner = np.lexsort((-tok, owner))
    pack = np.zeros(len(stream), np.int64)
    todo = np.arange(num_steps)
    while len(todo):
        bad = todo[m[todo] > owner_count[todo].min(axis=1)]
        if len(bad):
            return None, (bad, m[bad])
        failed = []
        for mv in np.unique(m[todo]).tolist():
            steps = todo[m[todo] == mv]
            owners = (steps[:, None] * num_r + np.arange(num_r)).ravel()
            items = by_owner[np.isin(owner[by_owner], owners)]
            local = np.searchsorted(owners, owner[items])
            mat, col = _ragged(tok[items], local, len(owners))
            packs, ok = fill_packs(mat, mv, cap)
            pack[items] = packs[local, col]
            failed.append(steps[~ok.reshape(len(steps), num_r).all(axis=1)])
        todo = np.sort(np.concatenate(failed))
        m[todo] += 1
    # Heaviest workload first within every replica (veRL's dynamic-batch balance): the rank of each pack.
    width = int(m.max())
    pack_key = owner * width + pack
    load = np.bincount(pack_key, work[stream], minlength=num_steps * num_r * width).reshape(-1, width)
    load[np.arange(width)[None, :] >= np.repeat(m, num_r)[:, None]] = -np.inf  # packs past a step's m
    rank = np.argsort(np.argsort(-load, axis=1, kind="stable"), axis=1, kind="stable")
    return (replica, rank.ravel()[pack_key], m), None


def borrow_samples(bounds: np.ndarray, bad: np.ndarray, micro: np.ndarray, num_r: int, moved: dict) -> np.ndarray:
    """New step bounds for the ``bad`` steps, whose ``micro`` (m) packs per replica need R·m samples (equal counts)
    and which have fewer (partition_steps): each takes the samples it lacks from the next step (the last step
    from the one before) by moving the cut between them. A cut moved the other way before (two steps pulling at
    it), or a move that would empty the lending step, merges the two steps instead. ``moved`` (cut -> direction
    it moved) is updated."""
    bounds = bounds.copy()
    merge = []
    last = len(bounds) - 2
    for step, m in zip(bad.tolist(), micro.tolist()):
        need = num_r * m - (bounds[step + 1] - bounds[step])
        cut, way = (step + 1, 1) if step < last else (step, -1)
        new = bounds[cut] + way * need
        if moved.get(cut, way) != way or not bounds[cut - 1] < new < bounds[cut + 1]:
            merge.append(cut)
        else:
            bounds[cut] = new
            moved[cut] = way
    if merge:  # drop those cuts: fewer steps, and the cuts after them are renumbered
        bounds = np.delete(bounds, np.unique(merge))
        moved.clear()
    return bounds


def plan_kk(lengths: np.ndarray, config: PlanConfig) -> Plan:
    """The kk strategy (see the module docstring). ``lengths`` already checked (int64, all >= 1)."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(config.seed)
    g = len(config.groups) - 1
    cap, num_r = config.groups[g].pack_len, config.replicas(g)
    too_long = lengths > cap
    kept, dropped = np.flatnonzero(~too_long), np.flatnonzero(too_long)
    stream = kept[rng.permutation(len(kept))]
    work = np.zeros(len(lengths))
    work[stream] = sample_workload(lengths, stream, config, g)
    budget = config.global_tokens if config.step_tokens == "real" else num_r * config.micro_batches(g) * cap
    total = int(lengths[stream].sum())
    bounds = nearest_cuts(lengths[stream], even_positions(total, step_budget(total, budget)[0]))
    moved = {}  # cut -> the way it moved (+1 later, -1 earlier): a pull the other way merges instead
    while True:
        result, bad = partition_steps(stream, bounds, lengths, work, num_r, cap)
        if result is not None:
            break
        if len(bounds) == 2:  # all the data is one step and still too few samples: isf's tail rule
            from hbp_train.planning.baselines.isf import plan_isf

            plan = plan_isf(lengths, config)
            return equal_steps(plan, config.curriculum_steps) if config.step_tokens == "real" else plan
        bounds = borrow_samples(bounds, *bad, num_r, moved)
    replica, rank, m = result
    num_steps = len(bounds) - 1
    step_of = np.repeat(np.arange(num_steps), np.diff(bounds))
    step_ptr = np.concatenate([[0], np.cumsum(m * num_r)]).astype(np.int64)
    pack_id = step_ptr[step_of] + rank * num_r + replica  # slot-major: micro-batch k of replica r
    by_pack = np.argsort(pack_id, kind="stable")
    num_packs = int(step_ptr[-1])
    pack_ptr = np.concatenate([[0], np.cumsum(np.bincount(pack_id, minlength=num_packs))]).astype(np.int64)
    step_packs = np.arange(num_packs, dtype=np.int64)
    step_group = np.full(num_steps, g, np.int32)
    if config.curriculum_steps > 0 and num_steps:
        # As isf: the first K steps whose longest sample fits the smallest group move to the front.
        step_max = np.maximum.reduceat(lengths[stream], bounds[:-1])
        level = sample_levels(step_max, [gr.pack_len for gr in config.groups])
        first = np.flatnonzero(level == level.min())[:config.curriculum_steps]
        rest = np.setdiff1d(np.arange(num_steps), first)
        step_ptr, step_packs, step_group = reorder_steps(step_ptr, step_packs, step_group, np.r_[first, rest])
    return Plan(
        config=config, lengths=lengths, pack_ptr=pack_ptr, pack_samples=stream[by_pack].astype(np.int64),
        pack_group=np.full(num_packs, g, np.int32), step_ptr=step_ptr, step_packs=step_packs,
        step_group=step_group, dropped=dropped, dropped_reason=[DROP_TOO_LONG] * len(dropped),
        extra={"planning_seconds": time.perf_counter() - t0},
    )
