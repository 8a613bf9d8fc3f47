"""Plan metrics (paper Sec. 3.1), per micro-batch slot, per step and plan-wide.

A *slot* is the set of packs the N replicas of a step run at the same micro-batch index (they run in lock-step
under DeepSpeed ZeRO, docs/planning.md). With T_r the tokens and A_r = sum of len^2 of replica r's pack:

* ABR = mean over slots of sum_r (A_max - A_r) / (A_max * N)   (attention balance ratio)
* DBR = mean over slots of sum_r (T_max - T_r) / (T_max * N)   (data/dist balance ratio)
* PR  = 1 - sum tokens / sum over packs of its group's pack_len  (padding ratio)
* CR  = tokens in steps whose group has sp > 1 / sum tokens      (communication ratio)
* AveT = sum tokens / (number of steps * world_size)            (average tokens per rank per step)
* sp_required_share = share of tokens in samples longer than the largest sp=1 group's pack_len (they must use
  SP whatever the plan; 1.0 when no group has sp=1) — the floor CR is compared with.

A step's ABR/DBR is the mean over its slots. A slot whose packs are all empty counts as balanced (0).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import numpy as np

from hbp_train.planning.balance import pack_costs
from hbp_train.planning.csr import gather_ranges

if TYPE_CHECKING:  # annotations only: Plan.compute_metrics calls this module
    from hbp_train.planning.plan import Plan


def slot_imbalance(values: np.ndarray) -> np.ndarray:
    """[num_slots, N] -> [num_slots]: sum_r (max - v_r) / (max * N), 0 where max == 0."""
    mx = values.max(axis=1)
    n = values.shape[1]
    with np.errstate(invalid="ignore", divide="ignore"):
        out = (mx[:, None] - values).sum(axis=1) / (mx * n)
    return np.where(mx > 0, out, 0.0)


def compute_metrics(plan: Plan) -> tuple[dict, dict]:
    """(plan-wide metrics, per-step metric arrays) for ``plan``."""
    cfg = plan.config
    lengths = plan.lengths
    sample_len = lengths[plan.pack_samples]
    csum_t = np.concatenate([[0], np.cumsum(sample_len)])
    csum_a = np.concatenate([[0.0], np.cumsum(sample_len.astype(np.float64) ** 2)])
    pack_t = csum_t[plan.pack_ptr[1:]] - csum_t[plan.pack_ptr[:-1]]
    pack_a = csum_a[plan.pack_ptr[1:]] - csum_a[plan.pack_ptr[:-1]]
    num_steps = plan.num_steps
    step_sizes = np.diff(plan.step_ptr)
    step_abr = np.zeros(num_steps)
    step_dbr = np.zeros(num_steps)
    step_tokens = np.zeros(num_steps, np.int64)
    slot_abr_all, slot_dbr_all = [], []
    for g in range(len(cfg.groups)):
        steps = np.flatnonzero(plan.step_group == g)
        if len(steps) == 0:
            continue
        r = cfg.replicas(g)
        idx = gather_ranges(plan.step_ptr[steps], step_sizes[steps])
        packs = plan.step_packs[idx].reshape(-1, r)
        abr = slot_imbalance(pack_a[packs])
        dbr = slot_imbalance(pack_t[packs].astype(np.float64))
        slots_per_step = step_sizes[steps] // r
        slot_step = np.repeat(np.arange(len(steps)), slots_per_step)
        step_abr[steps] = np.bincount(slot_step, abr, len(steps)) / slots_per_step
        step_dbr[steps] = np.bincount(slot_step, dbr, len(steps)) / slots_per_step
        step_tokens[steps] = np.bincount(slot_step, pack_t[packs].sum(axis=1), len(steps)).astype(np.int64)
        slot_abr_all.append(abr)
        slot_dbr_all.append(dbr)
    total = int(pack_t.sum())
    cap = np.array([g.pack_len for g in cfg.groups], np.int64)
    sp = np.array([g.sp for g in cfg.groups], np.int64)
    capacity = int(cap[plan.pack_group].sum())
    sp_tokens = int(step_tokens[sp[plan.step_group] > 1].sum())
    sp1 = cap[sp == 1]
    limit = int(sp1.max()) if len(sp1) else 0
    packed_len = lengths[plan.pack_samples]
    required = int(packed_len[packed_len > limit].sum())
    slot_abr = np.concatenate(slot_abr_all) if slot_abr_all else np.zeros(0)
    slot_dbr = np.concatenate(slot_dbr_all) if slot_dbr_all else np.zeros(0)
    metrics = {
        "DBR": float(slot_dbr.mean()) if len(slot_dbr) else 0.0,
        "PR": float(1.0 - total / capacity) if capacity else 0.0,
        "ABR": float(slot_abr.mean()) if len(slot_abr) else 0.0,
        "CR": float(sp_tokens / total) if total else 0.0,
        "AveT": float(total / (num_steps * cfg.world_size)) if num_steps else 0.0,
        "sp_required_share": float(required / total) if total else 0.0,
        "tokens": total,
        "num_steps": num_steps,
        "num_packs": plan.num_packs,
        "num_slots": int(len(slot_abr)),
        "num_samples": plan.num_samples,
        "num_dropped": int(len(plan.dropped)),
        "empty_packs": plan.num_empty_packs,
        "steps_per_group": np.bincount(plan.step_group, minlength=len(cfg.groups)).tolist(),
        # Strategies that delay samples (wlb): how many, and how many steps a delayed sample waits on average.
        "num_deferred": len(plan.deferred),
        "mean_deferred_wait_steps": float(np.mean([d["waited_steps"] for d in plan.deferred])) if plan.deferred else 0.0,
    }
    reps = np.array([cfg.replicas(g) for g in range(len(cfg.groups))], np.int64)
    step_metrics = {
        "group": plan.step_group.astype(np.int64),
        "ABR": step_abr,
        "DBR": step_dbr,
        "tokens": step_tokens,
        "micro_batches": step_sizes // reps[plan.step_group] if num_steps else np.zeros(0, np.int64),
    }
    return metrics, step_metrics


def cost_balance_ratio(plan: Plan, pack_cost) -> float:
    """Mean over slots of sum_r (C_max - C_r) / (C_max * N) for a per-pack cost (e.g. predicted seconds from
    hbp_train.perf.cost_model): the ABR formula applied to the cost a cost model balances instead of sum len^2."""
    cost = pack_costs(plan.lengths, plan.pack_ptr, plan.pack_samples, plan.pack_group,
                      replace(plan.config, pack_cost=pack_cost))
    sizes = np.diff(plan.step_ptr)
    ratios = []
    for g in range(len(plan.config.groups)):
        steps = np.flatnonzero(plan.step_group == g)
        if len(steps):
            packs = plan.step_packs[gather_ranges(plan.step_ptr[steps], sizes[steps])].reshape(-1, plan.config.replicas(g))
            ratios.append(slot_imbalance(cost[packs]))
    return float(np.concatenate(ratios).mean()) if ratios else 0.0
