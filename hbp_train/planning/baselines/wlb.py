"""WLB-LLM packing (paper Sec. 4): workload-balanced variable-length packs with outlier-delay queues.

All samples go to the largest group (one pack length, its SP degree). Steps are made in data order, one global
batch at a time, with N = R·m packs per step (R replicas x m micro-batches, as every strategy):

1. **Draw** samples from a seeded shuffle of the data until the step holds about ``FILL_TARGET``·N·pack_len
   tokens (counting samples carried over from the previous step and popped outliers).
2. **Outlier delay**: a sample of length >= L_1 is an outlier and waits in queue i when L_i <= len < L_{i+1}
   (defaults L = pack_len/4, pack_len/2; ``OUTLIER_FRACTIONS``). When a queue holds N samples, they are popped
   together at the start of the next step (so the draw can count their tokens) and the heaviest-first greedy
   below puts them one per pack.
3. **Greedy variable-length packing**: the step's samples, heaviest workload first, each go to the pack with the
   smallest workload that still has room (pack_len); samples that fit nowhere carry over to the next step.
   "Variable length": packs are not filled to a token count, they are equalised in predicted time. The paper
   lets a pack exceed the context window; here pack_len is a hard capacity (the trainer's memory bound).
4. The N packs are sorted by workload and cut into slots of R (similar packs run in the same slot).

Workload = ``config.pack_cost`` per sample (additive), default the cost model with the shipped calibration at
the group's sp and ckpt_layers (attention + linear + Ulysses comm, WLB's W_a + W_l). When the data runs out,
everything still queued or carried is packed first-fit-decreasing and built into steps by balance.build_steps
(its tail rule). Steps keep data order (that is WLB's point: only outliers move), so ``curriculum_steps`` is
ignored (with a warning). With ``step_tokens="real"`` the steps are then re-cut, in order, to the real-token
budget (equal_steps.py). Every delayed sample is listed in ``plan.deferred`` as {"index", "waited_steps"}
(optimizer steps between the one it was drawn in and the one it is trained in).
"""

from __future__ import annotations

import heapq
import time
import warnings

import numpy as np

from hbp_train.planning.balance import build_steps
from hbp_train.planning.equal_steps import equal_steps
from hbp_train.planning.plan import DROP_TOO_LONG, Plan, PlanConfig

# Outlier queue thresholds as fractions of pack_len: queue i holds L_i <= len < L_{i+1}, the last up to pack_len.
OUTLIER_FRACTIONS = (0.25, 0.5)
# A step draws this fraction of N * pack_len tokens. Packs are equalised in workload, not filled: packs of short
# samples need more tokens than packs of long ones for the same time, and without headroom the capacity cuts
# the balance and most samples end up carried over (a standing backlog that delays everything).
FILL_TARGET = 0.9


def sample_costs(lengths: np.ndarray, items: np.ndarray, config: PlanConfig, group: int) -> np.ndarray:
    """Workload of every sample in ``items`` run alone in ``group`` (config.pack_cost, default the cost model)."""
    cost_fn = config.pack_cost
    if cost_fn is None:
        from hbp_train.perf.cost_model import CostModel, pack_cost_fn

        cost_fn = pack_cost_fn(CostModel.from_calibration())
    ptr = np.arange(len(items) + 1, dtype=np.int64)
    return np.asarray(cost_fn(lengths[items], ptr, config.groups[group]), np.float64)


def first_fit_decreasing(items: np.ndarray, lengths: np.ndarray, cap: int) -> list[list[int]]:
    """Pack ``items`` (each <= cap) first-fit by length descending; returns the packs as index lists."""
    order = items[np.argsort(-lengths[items], kind="stable")]
    packs: list[list[int]] = []
    room: list[int] = []
    for i, size in zip(order.tolist(), lengths[order].tolist()):
        for j, r in enumerate(room):
            if r >= size:
                packs[j].append(i)
                room[j] -= size
                break
        else:
            packs.append([i])
            room.append(cap - size)
    return packs


def balance_into_packs(items: list[int], cost: np.ndarray, lengths: np.ndarray, num_packs: int, cap: int):
    """Greedy: heaviest first, each to the least-loaded pack with room. Returns (packs, pack work, left over)."""
    order = sorted(items, key=lambda i: -cost[i])
    packs: list[list[int]] = [[] for _ in range(num_packs)]
    room = [cap] * num_packs
    work = [0.0] * num_packs
    heap = [(0.0, j) for j in range(num_packs)]
    left: list[int] = []
    for i in order:
        size = int(lengths[i])
        skipped = []
        while heap and room[heap[0][1]] < size:
            skipped.append(heapq.heappop(heap))
        if heap:
            _, j = heapq.heappop(heap)
            packs[j].append(i)
            room[j] -= size
            work[j] += cost[i]
            heapq.heappush(heap, (work[j], j))
        else:
            left.append(i)
        for entry in skipped:
            # A pack with less room than the smallest possible sample (1 token) is full for good.
            if room[entry[1]] > 0:
                heapq.heappush(heap, entry)
    return packs, np.asarray(work), left


def plan_wlb(lengths: np.ndarray, config: PlanConfig) -> Plan:
    """The wlb strategy (see the module docstring). ``lengths`` already checked (int64, all >= 1)."""
    t0 = time.perf_counter()
    if config.curriculum_steps:
        warnings.warn("wlb keeps data order (only outliers are delayed): curriculum_steps is ignored", stacklevel=2)
    rng = np.random.default_rng(config.seed)
    g = len(config.groups) - 1
    cap = config.groups[g].pack_len
    num_r = config.replicas(g)
    num_packs = num_r * config.micro_batches(g)
    budget = int(FILL_TARGET * num_packs * cap)
    too_long = lengths > cap
    kept, dropped = np.flatnonzero(~too_long), np.flatnonzero(too_long)
    stream = kept[rng.permutation(len(kept))]
    cost = np.zeros(len(lengths))
    cost[stream] = sample_costs(lengths, stream, config, g)
    bounds = [int(f * cap) for f in OUTLIER_FRACTIONS] + [cap + 1]
    stream_len = lengths[stream]
    level = np.searchsorted(bounds, stream_len, side="right") - 1  # -1: not an outlier
    # Tokens of non-outliers along the stream: the draw stops when the step's budget is met.
    cs_normal = np.concatenate([[0], np.cumsum(np.where(level < 0, stream_len, 0))])
    arrival = np.full(len(lengths), -1, np.int64)
    trained = np.full(len(lengths), -1, np.int64)
    queues: list[list[int]] = [[] for _ in range(len(bounds) - 1)]
    carry: list[int] = []
    packs: list[list[int]] = []
    steps: list[list[int]] = []
    pos = 0
    while pos < len(stream):
        step = len(steps)
        # Queues that filled up in earlier steps pop now, so the draw below can count their tokens.
        pending = list(carry)
        for q in range(len(queues)):
            if len(queues[q]) >= num_packs:
                pending.extend(queues[q][:num_packs])
                queues[q] = queues[q][num_packs:]
        have = int(lengths[pending].sum()) if pending else 0
        end = int(np.searchsorted(cs_normal, cs_normal[pos] + max(budget - have, 0), side="left"))
        end = min(max(end, pos + 1), len(stream))
        new = stream[pos:end]
        arrival[new] = step
        new_level = level[pos:end]
        pending.extend(new[new_level < 0].tolist())
        for q in range(len(queues)):
            queues[q].extend(new[new_level == q].tolist())
        pos = end
        if len(pending) < num_packs:
            carry = pending  # not enough samples for one per pack yet: draw more
            continue
        step_packs, work, carry = balance_into_packs(pending, cost, lengths, num_packs, cap)
        order = np.argsort(-work, kind="stable")  # heaviest packs share the first slots
        ids = []
        for j in order.tolist():
            trained[step_packs[j]] = step
            ids.append(len(packs))
            packs.append(step_packs[j])
        steps.append(ids)
    num_main_steps = len(steps)
    # Flush: whatever is still carried or queued, packed first-fit-decreasing and built into balanced steps.
    rest = np.asarray(carry + [i for q in queues for i in q], np.int64)
    pack_sizes = [len(p) for p in packs]
    flat = [i for p in packs for i in p]
    step_sizes = [len(s) for s in steps]
    step_flat = [p for s in steps for p in s]
    if len(rest):
        tail = first_fit_decreasing(rest, lengths, cap)
        t_ptr = np.concatenate([[0], np.cumsum([len(p) for p in tail])]).astype(np.int64)
        t_flat = np.asarray([i for p in tail for i in p], np.int64)
        t_ptr, t_flat, _, ts_ptr, ts_packs, _ = build_steps(
            lengths, t_ptr, t_flat, np.full(len(tail), g, np.int32), config, balance=True)
        for s in range(len(ts_ptr) - 1):
            for p in ts_packs[ts_ptr[s]:ts_ptr[s + 1]].tolist():
                trained[t_flat[t_ptr[p]:t_ptr[p + 1]]] = num_main_steps + s
        pack_sizes += np.diff(t_ptr).tolist()
        flat += t_flat.tolist()
        step_sizes += np.diff(ts_ptr).tolist()
        step_flat += (ts_packs + len(packs)).tolist()
    pack_ptr = np.concatenate([[0], np.cumsum(pack_sizes)]).astype(np.int64)
    step_ptr = np.concatenate([[0], np.cumsum(step_sizes)]).astype(np.int64)
    plan = Plan(
        config=config, lengths=lengths, pack_ptr=pack_ptr, pack_samples=np.asarray(flat, np.int64),
        pack_group=np.full(len(pack_sizes), g, np.int32), step_ptr=step_ptr,
        step_packs=np.asarray(step_flat, np.int64), step_group=np.full(len(step_sizes), g, np.int32),
        dropped=dropped, dropped_reason=[DROP_TOO_LONG] * len(dropped),
        extra={"wlb": {"outlier_thresholds": bounds[:-1], "packs_per_step": num_packs,
                       "flush_steps": len(step_sizes) - num_main_steps}},
    )
    if config.step_tokens == "real" and len(kept):
        # Re-cut to the real-token budget (equal_steps keeps the packs and their order), and count every wait in
        # the new steps: a sample drawn in old step a is drawn in the optimizer step that holds a's first pack.
        old_first_pack = plan.step_packs[plan.step_ptr[:-1]]
        plan = equal_steps(plan)
        step_of_pack = np.empty(plan.num_packs, np.int64)
        step_of_pack[plan.step_packs] = np.repeat(plan.optimizer_steps(), np.diff(plan.step_ptr))
        new_of_old = step_of_pack[old_first_pack]
        trained[kept] = new_of_old[trained[kept]]
        arrival[kept] = new_of_old[arrival[kept]]
    waited = trained[kept] - arrival[kept]
    delayed = np.flatnonzero(waited > 0)
    plan.deferred = [{"index": int(i), "waited_steps": int(w)} for i, w in zip(kept[delayed], waited[delayed])]
    plan.extra["planning_seconds"] = time.perf_counter() - t0
    return plan
