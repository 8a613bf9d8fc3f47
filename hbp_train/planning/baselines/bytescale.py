"""ByteScale-style balance scheduling: lighter replicas run MORE micro-batches so that all replicas finish together.

All samples go to the largest group (one pack length, its SP degree). The data (seeded shuffle) is cut into
global batches of ``global_tokens`` real tokens (``step_tokens="real"``, the budget every strategy meets,
equal_steps.py; R·m·pack_len with "capacity") at the sample boundaries nearest to the budget's multiples. Within a
step, samples are dealt to the R replicas heaviest first, each to the replica with the least predicted time so far
(LPT on ``config.pack_cost`` per sample, default the cost model with the shipped calibration — additive per
sample), and each replica packs its samples first-fit-decreasing into packs of pack_len. Replicas therefore get
*different numbers of micro-batches*; the plan records ``"unequal_micro_batches": true`` (in memory the shorter
replicas are padded at the end with empty packs, which the JSON omits).

This only pays off — and is only correct to run — when ranks synchronise once per step: with ZeRO stage 2/3 every
micro-batch ends in a gradient reduce-scatter (and stage 3 gathers parameters in each forward), collectives that
every rank must join the same number of times. ``ZERO_STAGES`` lists the stages where gradients are reduced only
at the gradient-accumulation boundary (DeepSpeed: engine.py ``DeepSpeedEngine.allreduce_gradients``;
docs/simulator.md has the details), and the plan records it as ``"requires_zero_stage"``; ``check_zero_stage``
is what the pack CLI and the trainer call to refuse other stages. The trainer runs such plans with
``deepspeed.zero_stage=1``, each rank running only its own packs.
"""

from __future__ import annotations

import heapq
import time

import numpy as np

from hbp_train.common.errors import UserError
from hbp_train.planning.curriculum import order_steps, sample_levels
from hbp_train.planning.equal_steps import even_positions, nearest_cuts, step_budget
from hbp_train.planning.plan import DROP_TOO_LONG, Plan, PlanConfig
from hbp_train.planning.baselines.wlb import first_fit_decreasing, sample_costs

# ZeRO stages that reduce gradients only at the gradient-accumulation boundary (0: plain data parallel, 1).
ZERO_STAGES = (0, 1)


def check_zero_stage(plan, zero_stage: int) -> None:
    """UserError (one line) when a plan with unequal micro-batch counts is run with a ZeRO stage that
    synchronises every micro-batch. ``plan``: a Plan or its JSON dict."""
    extra = plan if isinstance(plan, dict) else plan.extra
    # A plan marked only "unequal_micro_batches" (no "requires_zero_stage") has the same constraint.
    required = extra.get("requires_zero_stage", list(ZERO_STAGES) if extra.get("unequal_micro_batches") else None)
    if required is not None and int(zero_stage) not in required:
        raise UserError(
            f"this plan has unequal micro-batch counts per replica (strategy bytescale) and needs ZeRO stage "
            f"{' or '.join(str(s) for s in required)}; stage {zero_stage} reduces gradients every micro-batch "
            "and would deadlock: set the ZeRO stage to 1 or plan with another strategy")


def deal_to_replicas(items: np.ndarray, cost: np.ndarray, num_replicas: int) -> list[list[int]]:
    """LPT: heaviest first, each sample to the replica with the least total cost so far."""
    order = items[np.argsort(-cost[items], kind="stable")]
    heap = [(0.0, r) for r in range(num_replicas)]
    out: list[list[int]] = [[] for _ in range(num_replicas)]
    for i, c in zip(order.tolist(), cost[order].tolist()):
        load, r = heapq.heappop(heap)
        out[r].append(i)
        heapq.heappush(heap, (load + c, r))
    return out


def plan_bytescale(lengths: np.ndarray, config: PlanConfig) -> Plan:
    """The bytescale strategy (see the module docstring). ``lengths`` already checked (int64, all >= 1)."""
    t0 = time.perf_counter()
    rng = np.random.default_rng(config.seed)
    g = len(config.groups) - 1
    cap = config.groups[g].pack_len
    num_r = config.replicas(g)
    # Real tokens per step: global_tokens (step_tokens="real", the same for every strategy) or R·m·pack_len.
    budget = config.global_tokens if config.step_tokens == "real" else num_r * config.micro_batches(g) * cap
    too_long = lengths > cap
    kept, dropped = np.flatnonzero(~too_long), np.flatnonzero(too_long)
    stream = kept[rng.permutation(len(kept))]
    cost = np.zeros(len(lengths))
    cost[stream] = sample_costs(lengths, stream, config, g)
    # Steps: the stream cut at the sample boundaries nearest to multiples of its tokens / round(tokens / budget).
    total = int(lengths[stream].sum())
    cuts = nearest_cuts(lengths[stream], even_positions(total, step_budget(total, budget)[0]))[1:-1]
    pack_sizes, flat, step_sizes, step_flat = [], [], [], []
    imbalance = []
    for items in np.split(stream, cuts) if len(stream) else []:
        per_replica = [first_fit_decreasing(np.asarray(s, np.int64), lengths, cap) if s else []
                       for s in deal_to_replicas(items, cost, num_r)]
        loads = np.array([cost[[i for p in packs for i in p]].sum() if packs else 0.0 for packs in per_replica])
        imbalance.append(float(1.0 - loads.mean() / loads.max()) if loads.max() > 0 else 0.0)
        m = max(len(packs) for packs in per_replica)
        for k in range(m):  # slot-major, shorter replicas padded with empty packs at the end
            for packs in per_replica:
                pack = packs[k] if k < len(packs) else []
                step_flat.append(len(pack_sizes))
                pack_sizes.append(len(pack))
                flat.extend(pack)
        step_sizes.append(m * num_r)
    pack_ptr = np.concatenate([[0], np.cumsum(pack_sizes)]).astype(np.int64)
    step_ptr = np.concatenate([[0], np.cumsum(step_sizes)]).astype(np.int64)
    step_packs = np.asarray(step_flat, np.int64)
    step_group = np.full(len(step_sizes), g, np.int32)
    if config.curriculum_steps > 0 and len(step_sizes):
        from hbp_train.planning.balance import reorder_steps

        step_max = np.array([lengths[np.asarray(s, np.int64)].max() for s in np.split(stream, cuts)])
        level = sample_levels(step_max, [gr.pack_len for gr in config.groups])
        step_ptr, step_packs, step_group = reorder_steps(
            step_ptr, step_packs, step_group, order_steps(level, config.curriculum_steps, rng))
    return Plan(
        config=config, lengths=lengths, pack_ptr=pack_ptr, pack_samples=np.asarray(flat, np.int64),
        pack_group=np.full(len(pack_sizes), g, np.int32), step_ptr=step_ptr, step_packs=step_packs,
        step_group=step_group, dropped=dropped, dropped_reason=[DROP_TOO_LONG] * len(dropped),
        extra={"planning_seconds": time.perf_counter() - t0, "unequal_micro_batches": True,
               "requires_zero_stage": list(ZERO_STAGES),
               "bytescale": {"mean_step_replica_imbalance": float(np.mean(imbalance)) if imbalance else 0.0}},
    )
