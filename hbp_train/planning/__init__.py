"""Planning: pure numpy decisions of what runs where (no torch, no torch.distributed).

Entry point: ``make_plan(lengths, config) -> Plan``. Strategies are a plain if/elif on ``config.strategy``:

* ``hbp`` — hierarchical balance packing (GroupData, packing, GreedyFill, balanced steps, curriculum), hbp.py
* ``isf`` — naive packing baseline (OmniBal's iterative shuffle-and-fill into the largest pack length),
  baselines/isf.py; ``sorted`` — LongAlign sorted batching, baselines/sorted.py; ``wlb`` — WLB-LLM variable-length
  packing with outlier delay, baselines/wlb.py; ``bytescale`` — unequal micro-batch counts per replica (ZeRO 0/1
  only), baselines/bytescale.py; ``bfd`` — best-fit decreasing into the largest pack length (TRL / ms-swift
  packing, the strongest single-group baseline), baselines/bfd.py; ``kk`` — veRL-style Karmarkar-Karp partition of
  every step's samples across the replicas, baselines/kk.py

Equal optimisation (``config.step_tokens="real"``, the default): every strategy's plan has the same number of
optimizer steps of (nearly) the same real tokens, equal_steps.py. make_plan re-cuts the steps of the strategies
that build slots (hbp, isf, bfd, sorted); wlb re-cuts its own (its delays are counted in the new steps), and kk and
bytescale cut their sample stream to the budget themselves.

Shared pieces other strategies can reuse, bottom layer first: ``csr`` (CSR helpers), ``plan.Plan`` (the types and
their JSON), ``balance.build_steps`` (packs -> balanced steps with the tail rule), ``curriculum.order_steps``,
``metrics.with_metrics`` (fills a plan's metrics; above ``plan``, which never imports it).

May import: perf's cost models and common; never torch (import-linter keeps it so). Plans become packed shards in
hbp_train/batches/shards.py.
"""

from __future__ import annotations

from hbp_train.common.errors import UserError
from hbp_train.planning.balance import default_pack_cost
from hbp_train.planning.metrics import with_metrics
from hbp_train.planning.plan import DROP_TOO_LONG, GroupSpec, PackCostFn, Plan, PlanConfig, check_lengths

__all__ = ["make_plan", "Plan", "PlanConfig", "GroupSpec", "PackCostFn", "DROP_TOO_LONG", "check_lengths",
           "default_pack_cost", "with_metrics"]


# Every strategy make_plan knows (the first two are documented above; the others in their modules).
ALL_STRATEGIES = ("hbp", "isf", "bfd", "sorted", "wlb", "bytescale", "kk")
# Strategies that meet the real-token step budget themselves (see the module docstring).
CUT_OWN_STEPS = ("wlb", "bytescale", "kk")


def make_plan(lengths, config: PlanConfig) -> Plan:
    """Plan the training steps for samples of the given token ``lengths`` (index i = dataset row i).

    Samples longer than the largest group's pack_len are dropped ("longer_than_max_pack_len"); a length <= 0
    or an unknown strategy raises UserError. The returned plan has its metrics computed and passes ``Plan.validate()``.
    """
    lengths = check_lengths(lengths)
    if config.strategy == "hbp":
        from hbp_train.planning.hbp import plan_hbp

        plan = plan_hbp(lengths, config)
    elif config.strategy == "isf":
        from hbp_train.planning.baselines.isf import plan_isf

        plan = plan_isf(lengths, config)
    elif config.strategy == "bfd":
        from hbp_train.planning.baselines.bfd import plan_bfd

        plan = plan_bfd(lengths, config)
    elif config.strategy == "sorted":
        from hbp_train.planning.baselines.sorted import plan_sorted

        plan = plan_sorted(lengths, config)
    elif config.strategy == "wlb":
        from hbp_train.planning.baselines.wlb import plan_wlb

        plan = plan_wlb(lengths, config)
    elif config.strategy == "bytescale":
        from hbp_train.planning.baselines.bytescale import plan_bytescale

        plan = plan_bytescale(lengths, config)
    elif config.strategy == "kk":
        from hbp_train.planning.baselines.kk import plan_kk

        plan = plan_kk(lengths, config)
    else:
        raise UserError(f"strategy must be one of {', '.join(map(repr, ALL_STRATEGIES))}, got {config.strategy!r}")
    if config.step_tokens == "real" and config.strategy not in CUT_OWN_STEPS:
        from hbp_train.planning.equal_steps import equal_steps

        plan = equal_steps(plan, config.curriculum_steps)
    return with_metrics(plan)

