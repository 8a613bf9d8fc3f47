"""Plan metrics (paper Sec. 3.1), per micro-batch slot, per step and plan-wide.

A *slot* is the set of packs the N replicas of a step run at the same micro-batch index (they run in lock-step
under DeepSpeed ZeRO, docs/planning.md). With T_r the tokens and A_r = sum of len^2 of replica r's pack:

* ABR = mean over slots of sum_r (A_max - A_r) / (A_max * N)   (attention balance ratio)
* DBR = mean over slots of sum_r (T_max - T_r) / (T_max * N)   (data/dist balance ratio)
* PR  = 1 - sum tokens / sum over packs of its group's pack_len  (padding ratio)
* CR  = tokens in steps whose group has sp > 1 / sum tokens      (communication ratio)
* AveT = sum tokens / (number of optimizer steps * world_size)  (average tokens per rank per step)
* step_tokens_target / _min / _max / _mean: real tokens per optimizer step — the equal-optimisation target
  T / max(1, round(T / global_tokens)) and the plan's spread around it (planning/equal_steps.py)
* sp_required_share = share of tokens in samples longer than the largest sp=1 group's pack_len (they must use
  SP whatever the plan; 1.0 when no group has sp=1) — the floor CR is compared with.
* length mix: samples fall into MIX_BUCKETS octave buckets of length below the largest pack_len (``mix_edges``);
  a step's mix is its token share per bucket (``step_mix``), and its mix_TV (step_metrics) the total-variation distance
  0.5 * sum_b |share_b(step) - share_b(all packed tokens)|: 0 when the step holds the data's length mix, 1 when it
  holds only lengths the data has none of. Plan mix_TV = mean over steps. A plan whose steps are homogeneous in
  length (sorted batching ~0.8) skews every gradient step; a random fill (isf) only has sampling noise (~0.2 at
  8K tokens per step in the demo, less with larger steps).

A step's ABR/DBR is the mean over its slots. A slot whose packs are all empty counts as balanced (0).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from hbp_train.planning.balance import default_pack_cost, pack_costs
from hbp_train.planning.csr import gather_ranges, segment_sums
from hbp_train.planning.equal_steps import step_budget
from hbp_train.planning.plan import Plan


# Octave buckets of the length mix: (0, top/2^(B-1)], ..., (top/4, top/2], (top/2, top] with top the largest pack_len.
MIX_BUCKETS = 8


def mix_edges(pack_lens) -> np.ndarray:
    """Upper edges (ascending, int64) of the length-mix buckets; a length l is in bucket searchsorted(edges, l)."""
    top = int(max(pack_lens))
    return np.unique(np.array([max(1, top >> k) for k in range(MIX_BUCKETS - 1, -1, -1)], np.int64))


# Samples per pass of the plan-wide sums below: their temporaries stay ~50 MB however large the plan.
CHUNK = 1 << 21


def length_buckets(lengths: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """int8 length-mix bucket of every length: ``searchsorted(edges, l, "left")``, lengths above the top edge in the
    last bucket. A lookup table over 0..top (one byte per length) is far cheaper than a search per sample."""
    lengths = np.asarray(lengths)
    top = int(edges[-1])
    if top > 1 << 24:  # a table that large would cost more than it saves
        return np.minimum(np.searchsorted(edges, lengths, side="left"), len(edges) - 1).astype(np.int8)
    table = np.minimum(np.searchsorted(edges, np.arange(top + 1), side="left"), len(edges) - 1).astype(np.int8)
    return table[np.clip(lengths, 0, top)]


def _bucket_tokens(lengths: np.ndarray, edges: np.ndarray, group: np.ndarray | None, num_groups: int) -> np.ndarray:
    """Tokens per (group, bucket), [num_groups, B] float64 (exact: integer counts below 2^53), summed CHUNK samples
    at a time."""
    b = len(edges)
    tokens = np.zeros(num_groups * b)
    for start in range(0, len(lengths), CHUNK):
        part = lengths[start:start + CHUNK]
        key = length_buckets(part, edges).astype(np.int64)
        if group is not None:
            key += np.asarray(group[start:start + CHUNK], np.int64) * b
        tokens += np.bincount(key, weights=part, minlength=num_groups * b)
    return tokens.reshape(num_groups, b)


def token_mix(lengths: np.ndarray, edges: np.ndarray, group: np.ndarray | None = None,
              num_groups: int = 1) -> np.ndarray:
    """Token share per length bucket of ``lengths`` ([B]); with ``group`` (an id in [0, num_groups) per length) one
    row per group ([num_groups, B]; all zeros for a group without tokens)."""
    tokens = _bucket_tokens(np.asarray(lengths), edges, group, num_groups if group is not None else 1)
    total = tokens.sum(axis=1, keepdims=True)
    share = np.divide(tokens, total, out=np.zeros_like(tokens), where=total > 0)
    return share if group is not None else share[0]


def mix_distance(mix: np.ndarray, reference: np.ndarray) -> np.ndarray:
    """Total-variation distance 0.5 * sum_b |mix_b - reference_b| of every row of ``mix`` to ``reference``."""
    return 0.5 * np.abs(np.atleast_2d(mix) - reference).sum(axis=-1)


def step_mix(plan: Plan, sample_len: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(token share per length bucket of every OPTIMIZER step [num_optimizer_steps, B], the whole plan's mix [B]).

    An optimizer step's mix is that of all samples its plan steps train on (one plan step per optimizer step
    unless the plan mixes groups, ``Plan.optimizer_step``). ``sample_len``: ``lengths[pack_samples]`` when the
    caller has it already. The result is kept on the plan while its step and pack arrays are the same objects:
    compute_metrics and the report (mix_report) then pass over the samples once."""
    key = (id(plan.pack_samples), id(plan.step_packs), id(plan.optimizer_step))
    cached = getattr(plan, "_step_mix", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    edges = mix_edges([g.pack_len for g in plan.config.groups])
    if sample_len is None:
        sample_len = plan.lengths[plan.pack_samples]
    step_of_pack = np.zeros(plan.num_packs, np.int64)
    step_of_pack[plan.step_packs] = np.repeat(plan.optimizer_steps(), np.diff(plan.step_ptr))
    b, num_steps = len(edges), plan.num_optimizer_steps
    tokens = np.zeros(num_steps * b)
    sizes = np.diff(plan.pack_ptr)
    # CHUNK samples at a time, whole packs: the per-sample keys stay in cache (one pass over the samples).
    cut = np.searchsorted(plan.pack_ptr, np.arange(0, len(sample_len), CHUNK)[1:])
    for lo, hi in zip(np.r_[0, cut], np.r_[cut, plan.num_packs]):
        part = sample_len[plan.pack_ptr[lo]:plan.pack_ptr[hi]]
        sample_key = length_buckets(part, edges).astype(np.int64)
        sample_key += np.repeat(step_of_pack[lo:hi] * b, sizes[lo:hi])
        tokens += np.bincount(sample_key, weights=part, minlength=num_steps * b)
    tokens = tokens.reshape(num_steps, b)
    total = tokens.sum(axis=1, keepdims=True)
    data = tokens.sum(axis=0)
    result = (np.divide(tokens, total, out=np.zeros_like(tokens), where=total > 0),
              data / data.sum() if data.sum() else data)
    plan._step_mix = (key, result)
    return result


def mix_report(plan: Plan, name: str = "") -> str:
    """A few lines for a plan report: the data's token share per length bucket, then the mean share of the optimizer
    steps and how far they are from the data's mix (mix_TV mean and worst step): per group for steps of one group,
    in one row for optimizer steps that mix the groups."""
    if not plan.num_steps or "mix_TV" not in plan.step_metrics:
        return ""
    mix, data_mix = step_mix(plan)
    tv = mix_distance(mix, data_mix)
    edges = plan.metrics["mix_edges"]
    lines = [f"{'length mix (token share)':<34}" + "".join(f"{'<=' + str(e):>7}" for e in edges)
             + "   mix_TV mean / max"]
    lines.append(f"{'  data':<34}" + "".join(f"{x:>7.2f}" for x in data_mix))
    opt = plan.optimizer_steps()
    first = np.r_[True, np.diff(opt) != 0] if len(opt) else np.zeros(0, bool)
    mixed = np.bincount(opt, minlength=len(mix)) > 1  # optimizer steps of several plan steps (groups)
    rows = [(f"{int(mixed.sum())} steps mixing the groups", mixed)] if mixed.any() else []
    group_of = plan.step_group[first]
    rows += [(f"group {int(g)} ({int(np.sum(~mixed & (group_of == g)))} steps)", ~mixed & (group_of == g))
             for g in np.unique(group_of[~mixed])]
    for label, sel in rows:
        label = f"  {name + ' ' if name else ''}{label}"
        lines.append(f"{label:<34}" + "".join(f"{x:>7.2f}" for x in mix[sel].mean(axis=0))
                     + f"   {tv[sel].mean():.3f} / {tv[sel].max():.3f}")
    return "\n".join(lines)


def slot_imbalance(values: np.ndarray) -> np.ndarray:
    """[num_slots, N] -> [num_slots]: sum_r (max - v_r) / (max * N), 0 where max == 0."""
    mx = values.max(axis=1)
    n = values.shape[1]
    with np.errstate(invalid="ignore", divide="ignore"):
        out = (mx[:, None] - values).sum(axis=1) / (mx * n)
    return np.where(mx > 0, out, 0.0)


def with_metrics(plan: Plan, sample_len: np.ndarray | None = None) -> Plan:
    """Fill ``plan.metrics`` and ``plan.step_metrics`` from its steps; returns the plan. ``sample_len``:
    ``lengths[pack_samples]`` when the caller has it (a gather of every sample saved)."""
    plan.metrics, plan.step_metrics = compute_metrics(plan, sample_len)
    return plan


def compute_metrics(plan: Plan, sample_len: np.ndarray | None = None) -> tuple[dict, dict]:
    """(plan-wide metrics, per-step metric arrays) for ``plan``; ``sample_len``: ``lengths[pack_samples]`` when the
    caller has it."""
    cfg = plan.config
    if sample_len is None:
        sample_len = plan.lengths[plan.pack_samples]
    pack_t = segment_sums(sample_len, plan.pack_ptr, np.int64)
    pack_a = default_pack_cost(sample_len, plan.pack_ptr)  # sum of len^2
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
    required = int(sample_len[sample_len > limit].sum())
    slot_abr = np.concatenate(slot_abr_all) if slot_abr_all else np.zeros(0)
    slot_dbr = np.concatenate(slot_dbr_all) if slot_dbr_all else np.zeros(0)
    metrics = {
        "DBR": float(slot_dbr.mean()) if len(slot_dbr) else 0.0,
        "PR": float(1.0 - total / capacity) if capacity else 0.0,
        "ABR": float(slot_abr.mean()) if len(slot_abr) else 0.0,
        "CR": float(sp_tokens / total) if total else 0.0,
        "AveT": float(total / (plan.num_optimizer_steps * cfg.world_size)) if num_steps else 0.0,
        "sp_required_share": float(required / total) if total else 0.0,
        "tokens": total,
        "num_steps": plan.num_optimizer_steps,  # optimizer steps (plan steps of several groups may share one)
        **optimizer_step_tokens(plan, step_tokens, total),
        "num_plan_steps": num_steps,
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
    mix, data_mix = step_mix(plan, sample_len)
    opt_tv = mix_distance(mix, data_mix) if num_steps else np.zeros(0)
    step_tv = opt_tv[plan.optimizer_steps()] if num_steps else np.zeros(0)  # a plan step: its optimizer step's
    metrics["mix_TV"] = float(opt_tv.mean()) if num_steps else 0.0
    metrics["mix_edges"] = mix_edges([g.pack_len for g in cfg.groups]).tolist()
    metrics["data_mix"] = data_mix.tolist()
    reps = np.array([cfg.replicas(g) for g in range(len(cfg.groups))], np.int64)
    step_metrics = {
        "group": plan.step_group.astype(np.int64),
        "ABR": step_abr,
        "DBR": step_dbr,
        "tokens": step_tokens,
        "micro_batches": step_sizes // reps[plan.step_group] if num_steps else np.zeros(0, np.int64),
        "mix_TV": step_tv,
    }
    return metrics, step_metrics


def optimizer_step_tokens(plan: Plan, step_tokens: np.ndarray, total: int) -> dict:
    """What an optimizer step holds, in real tokens: the equal-optimisation target T / max(1, round(T / G))
    (equal_steps.step_budget: what every strategy's steps hold under step_tokens="real", whatever its padding) and
    the plan's min, max and mean per optimizer step. ``step_tokens``: real tokens per plan step."""
    per_step = np.bincount(plan.optimizer_steps(), step_tokens, minlength=plan.num_optimizer_steps)
    if len(per_step) == 0:
        return {"step_tokens_target": 0.0, "step_tokens_min": 0, "step_tokens_max": 0, "step_tokens_mean": 0.0}
    return {"step_tokens_target": float(step_budget(total, plan.config.global_tokens)[1]),
            "step_tokens_min": int(per_step.min()), "step_tokens_max": int(per_step.max()),
            "step_tokens_mean": float(per_step.mean())}


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
