"""What data_tools.pack prints about a plan: the metrics table (strategies side by side), the optimizer-step line,
and the notes and warnings that keep it honest: balance metrics that compare nothing read n/a, plans of other
replica counts are said to be so, a plan of too few optimizer steps is warned about with what makes more.
"""

from __future__ import annotations

import sys

import numpy as np

from hbp_train.planning.equal_steps import MIN_STEPS, auto_global_tokens, slot_tokens, step_budget


METRIC_ROWS = [("ABR", "{:.4f}"), ("DBR", "{:.4f}"), ("PR", "{:.4f}"), ("CR", "{:.4f}"), ("mix_TV", "{:.4f}"),
               ("sp_required_share", "{:.4f}"), ("AveT", "{:.0f}"), ("num_steps", "{}"),
               ("step_tokens_target", "{:.0f}"), ("step_tokens_min", "{}"), ("step_tokens_max", "{}"),
               ("step_tokens_mean", "{:.0f}"),
               ("num_packs", "{}"), ("num_dropped", "{}"), ("empty_packs", "{}")]


def step_line(plan, global_tokens: int, step_tokens: str) -> str:
    """What an optimizer step holds, in one line (docs/planning.md "Equal optimisation")."""
    m = plan.metrics
    line = (f"optimizer steps: {m['num_steps']}, each of {m['step_tokens_min']}..{m['step_tokens_max']} real tokens "
            f"(mean {m['step_tokens_mean']:.0f}; target {m['step_tokens_target']:.0f} = the real tokens / "
            f"round(real tokens / --global-tokens {global_tokens}))")
    if step_tokens == "capacity":
        line += "; --step-tokens capacity: steps sized by pack capacity, so strategies differ in step count"
    elif m["num_steps"] < step_budget(m["tokens"], global_tokens)[0]:
        line += ("; fewer steps than the target: a step holds at least one micro-batch of every replica, more "
                 "than --global-tokens here")
    return line


def warn_if_few_steps(plan, global_tokens: int) -> None:
    """On stderr: a plan of fewer than MIN_STEPS optimizer steps, and what makes more."""
    steps, tokens = plan.num_optimizer_steps, int(plan.metrics["tokens"])
    if steps >= MIN_STEPS:
        return
    one_slot_each = slot_tokens(plan.config.world_size, plan.config.groups)
    auto = auto_global_tokens(tokens, one_slot_each)
    if steps < step_budget(tokens, global_tokens)[0]:  # the data fills fewer steps than asked for
        fix = ("a step holds at least one pack per replica: shorter groups (--groups) or a smaller --world-size make "
               "more steps, or train several epochs (data.epochs)")
    elif global_tokens > auto:
        fix = (f"lower --global-tokens (now {global_tokens:,}; without it, {auto:,}: about "
               f"{step_budget(tokens, auto)[0]} steps), or train several epochs (data.epochs)")
    else:
        fix = (f"one pack of every group per replica holds {one_slot_each:,} tokens: shorter groups (--groups) or a "
               "smaller --world-size make more steps (a lower --global-tokens, steps of one group each), or train "
               "several epochs (data.epochs)")
    print(f"warning: only {steps} optimizer steps of {tokens:,} tokens, too few updates to train on; {fix}",
          file=sys.stderr)


def replicas_of(plan) -> list[int]:
    """The replica counts of the plan's steps (W / sp of each group it uses), ascending."""
    return sorted({plan.config.replicas(int(g)) for g in np.unique(plan.step_group)})


# Metrics of the balance between the replicas of a step: nothing to compare when every step has one replica.
BALANCE_METRICS = ("ABR", "DBR")


def metrics_table(plans: dict) -> str:
    """Plans side by side: one row per metric, one column per strategy (with planning wall time). A balance metric
    of a plan whose every step has one replica reads n/a: there is nothing to balance, which is not balanced."""
    names = list(plans)
    lines = [f"{'metric':<20}" + "".join(f"{n:>14}" for n in names)]
    for key, fmt in METRIC_ROWS:
        cells = ["n/a" if key in BALANCE_METRICS and replicas_of(plans[n]) == [1] else fmt.format(plans[n].metrics[key])
                 for n in names]
        lines.append(f"{key:<20}" + "".join(f"{c:>14}" for c in cells))
    lines.append(f"{'planning_seconds':<20}" + "".join(f"{plans[n].extra['wall_seconds']:>14.3f}" for n in names))
    return "\n".join(lines)


def replicas_note(plans: dict) -> str:
    """One line under the table when the plans' steps have different replica counts (isf runs every pack at the
    largest group's SP degree): their balance metrics then compare different numbers of replicas."""
    if len({tuple(replicas_of(plan)) for plan in plans.values()}) < 2:
        return ""
    parts = []
    for name, plan in plans.items():
        sps = sorted({plan.config.groups[int(g)].sp for g in np.unique(plan.step_group)})
        parts.append(f"{name} " + ", ".join(f"sp={sp}: {plan.config.world_size // sp} replica"
                                            f"{'s' if plan.config.world_size // sp > 1 else ''}" for sp in sps))
    return (f"note: replicas per step: {'; '.join(parts)}. ABR and DBR compare the replicas of a step, so plans "
            "with other replica counts are not compared like for like (n/a: one replica, nothing to balance); CR "
            "is the share of tokens that pay SP communication")
