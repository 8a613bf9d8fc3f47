"""Re-planning for a resume on another number of ranks: the samples of an epoch not yet trained, planned again for
the new world size with the plan's own strategy, so that every sample of the epoch is still trained exactly once.

``replan(plan, trained, world_size, steps_done)`` takes the plan the run was started with, the samples the epoch
has already trained (the sample ledger, hbp_train/runtime/ledger.py) and the new world size, and returns a plan
for the new world size, in the original plan's sample numbering (sample i is still dataset row i):

* the **rest**: the plan's packed samples that were not trained, planned by ``make_plan`` with the original
  config (strategy, groups, balance, step mix, seed, curriculum) at the new world size. Its step budget keeps the
  run's length: with real-token steps (the default) it is cut into the optimizer steps the epoch had left, N - j
  for a plan of N steps of which j ran, so each step holds the tokens a step of the original plan held and the LR
  schedule keeps its length (fewer when the rest has fewer units than that: equal_steps.py);
* with ``with_head`` (more epochs follow), first a **head**: the trained samples planned the same way into j
  steps, so the plan is a whole epoch at the new world size, which the later epochs run; the resumed epoch starts
  at the first step of the rest (batches/replanned.py).

Without a head the trained samples are listed as dropped with reason ``TRAINED`` (the plan's contract: every
sample is packed or dropped, once); samples the original plan dropped keep their reason. What cannot be re-planned
is refused in one line with the way forward (``config_at``): a group whose SP degree does not divide the new world
size, a plan that records no sample lengths. A cost model the plan was balanced with (pack_cost, from a
calibration) is not recorded in the plan: the re-plan balances the attention cost (sum of len^2 per pack).

Pure numpy, like the rest of planning/.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import numpy as np

from hbp_train.common.errors import UserError
from hbp_train.planning.plan import Plan, PlanConfig

TRAINED = "trained_before_resume"
# Keys of Plan.extra that describe one planning run, not the plan: not carried into a re-plan.
_RUN_KEYS = ("planning_seconds", "wall_seconds", "cpu_seconds")


def sp_world_problem(groups, world_size: int) -> Optional[str]:
    """Why a plan's packing ``groups`` (GroupSpecs, or dicts with pack_len and sp) cannot run on ``world_size``
    ranks, with the way forward, or None when every group's SP degree divides it (the config check asks this
    before any worker starts, config_at when it re-plans)."""
    def field(g, name):
        return int(g[name] if isinstance(g, dict) else getattr(g, name))

    bad = [g for g in groups if field(g, "sp") > world_size or world_size % field(g, "sp")]
    if not bad:
        return None
    need = max(field(g, "sp") for g in groups)
    ranks = f"{world_size} rank{'s' if world_size > 1 else ''}"
    return (f"the plan's group of pack_len {field(bad[0], 'pack_len')} runs at SP degree {field(bad[0], 'sp')}, "
            f"which cannot run on {ranks} (an SP degree must divide the number of ranks): resume on a multiple of "
            f"{need} ranks, or re-pack with smaller SP degrees (data_tools.pack --groups) and start a new run from "
            "an export of this checkpoint")


def config_at(plan: Plan, world_size: int) -> PlanConfig:
    """The plan's config at ``world_size`` ranks; UserError (one line, with the way forward) when a group's SP
    degree cannot run there."""
    problem = sp_world_problem(plan.config.groups, world_size)
    if problem:
        raise UserError(problem)
    return replace(plan.config, world_size=int(world_size), pack_cost=None, progress=False)


def replan(plan: Plan, trained, world_size: int, steps_done: int = 0, with_head: bool = False) -> tuple[Plan, int]:
    """(the plan for ``world_size`` ranks, its head's optimizer steps): see the module docstring. ``trained``: the
    sample indices the epoch has trained (any order); ``steps_done``: the optimizer steps of the epoch that ran."""
    from hbp_train.planning.metrics import with_metrics

    if plan.lengths is None or len(plan.lengths) != plan.num_samples or plan.num_samples == 0:
        raise UserError("the plan records no sample lengths, so its samples cannot be planned again: re-pack the "
                        "data with data_tools.pack")
    cfg = config_at(plan, world_size)
    n = plan.num_samples
    trained = np.unique(np.asarray(trained, np.int64))
    if len(trained) and (trained[0] < 0 or trained[-1] >= n):
        raise UserError(f"the sample ledger names sample {int(trained[-1] if trained[-1] >= n else trained[0])}, "
                        f"which the plan's {n} samples do not have: the checkpoint was saved with other data")
    packed = np.zeros(n, bool)
    packed[plan.pack_samples] = True
    is_trained = np.zeros(n, bool)
    is_trained[trained] = True
    if np.any(is_trained & ~packed):
        raise UserError("the sample ledger names samples the plan never packed: the checkpoint was saved with "
                        "another plan")
    rest = np.flatnonzero(packed & ~is_trained)
    head = trained if with_head else np.zeros(0, np.int64)
    total_steps = plan.num_optimizer_steps
    steps_done = int(min(max(steps_done, 0), total_steps))
    parts = []  # (plan over the part's own numbering, the original index of each of its samples)
    if len(head):
        parts.append((_plan_part(plan, cfg, head, max(1, steps_done), cfg.curriculum_steps), head))
    head_steps = parts[0][0].num_optimizer_steps if parts else 0
    if len(rest):
        parts.append((_plan_part(plan, cfg, rest, max(1, total_steps - steps_done),
                                 max(0, cfg.curriculum_steps - steps_done)), rest))
    out = _combine(plan, cfg, parts, trained if not with_head else np.zeros(0, np.int64))
    out.extra["replanned"] = {"from_world_size": int(plan.config.world_size), "trained": int(len(trained)),
                              "rest_samples": int(len(rest)), "steps_done": steps_done, "head_steps": head_steps}
    return with_metrics(out), head_steps


def _plan_part(plan: Plan, cfg: PlanConfig, samples: np.ndarray, num_steps: int, curriculum_steps: int) -> Plan:
    """``samples`` (original indices) planned alone with ``cfg``, in their own numbering 0..len-1; with real-token
    steps, cut into ``num_steps`` optimizer steps where the units allow."""
    from hbp_train.planning import make_plan

    lengths = plan.lengths[samples]
    global_tokens = cfg.global_tokens
    if cfg.step_tokens == "real":
        global_tokens = _budget(int(lengths.sum()), num_steps)
    return make_plan(lengths, replace(cfg, global_tokens=global_tokens, curriculum_steps=curriculum_steps))


def _budget(tokens: int, num_steps: int) -> int:
    """A global_tokens G for which equal_steps makes ``num_steps`` steps of ``tokens`` real tokens
    (max(1, round(tokens / G)) == num_steps), or the nearest when no integer G does."""
    for g in (tokens // num_steps, -(-tokens // num_steps)):
        if g >= 1 and max(1, int(round(tokens / g))) == num_steps:
            return int(g)
    return max(1, int(round(tokens / num_steps)))


def _combine(plan: Plan, cfg: PlanConfig, parts: list, trained_dropped: np.ndarray) -> Plan:
    """One plan over the original numbering from ``parts`` ((plan, original index of its samples) pairs, run one
    after the other). Dropped: the original plan's dropped samples (their reasons kept), ``trained_dropped``
    (TRAINED), and whatever a part dropped."""
    pack_ptr, pack_samples, pack_group, step_ptr, step_packs, step_group, opt = [np.zeros(1, np.int64)], [], [], \
        [np.zeros(1, np.int64)], [], [], []
    dropped = {int(i): r for i, r in zip(plan.dropped.tolist(), plan.dropped_reason)}
    dropped.update({int(i): TRAINED for i in trained_dropped.tolist()})
    deferred, extra = [], {}
    num_packs = num_opt = 0
    for part, index in parts:
        pack_ptr.append(part.pack_ptr[1:] + pack_ptr[-1][-1])
        pack_samples.append(index[part.pack_samples])
        pack_group.append(part.pack_group)
        step_ptr.append(part.step_ptr[1:] + step_ptr[-1][-1])
        step_packs.append(part.step_packs + num_packs)
        step_group.append(part.step_group)
        opt.append(part.optimizer_steps() + num_opt)
        dropped.update({int(index[i]): r for i, r in zip(part.dropped.tolist(), part.dropped_reason)})
        deferred += [{**d, "index": int(index[d["index"]])} for d in part.deferred]
        extra.update({k: v for k, v in part.extra.items() if k not in _RUN_KEYS})
        num_packs += part.num_packs
        num_opt += part.num_optimizer_steps
    extra.update({k: v for k, v in plan.extra.items() if k not in _RUN_KEYS and k != "replanned"})
    order = sorted(dropped)
    opt_all = np.concatenate(opt) if opt else np.zeros(0, np.int64)
    out = Plan(
        config=cfg, lengths=plan.lengths,
        pack_ptr=np.concatenate(pack_ptr).astype(np.int64), pack_samples=_cat(pack_samples, np.int64),
        pack_group=_cat(pack_group, np.int32), step_ptr=np.concatenate(step_ptr).astype(np.int64),
        step_packs=_cat(step_packs, np.int64), step_group=_cat(step_group, np.int32),
        optimizer_step=None if len(opt_all) == 0 or np.all(np.diff(opt_all) == 1) else opt_all,
        dropped=np.asarray(order, np.int64), dropped_reason=[dropped[i] for i in order], deferred=deferred,
        extra=extra)
    # The contract a re-plan must keep whatever the parts did: every sample once, in a pack or dropped.
    seen = np.bincount(np.concatenate([out.pack_samples, out.dropped]), minlength=plan.num_samples)
    if np.any(seen != 1):
        raise ValueError(f"replan: sample {int(np.flatnonzero(seen != 1)[0])} is not exactly once in the re-plan")
    return out


def _cat(arrays: list, dtype) -> np.ndarray:
    return np.concatenate(arrays).astype(dtype) if arrays else np.zeros(0, dtype)
