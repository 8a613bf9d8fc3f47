"""Simulated training time of a plan: every pack's predicted time, replicas in lock-step, idle time, speed-up.

Pure numpy on a ``Plan`` and a ``CostModel`` (no GPU, nothing runs). Two synchronisation models:

* ``"micro"`` — ZeRO-2/3: gradients are reduced (stage 2) or parameters gathered and gradients reduce-scattered
  (stage 3) in every micro-batch, so micro-batch k of all replicas forms a *slot* that lasts as long as its
  slowest replica; step time = Σ slot times.
* ``"step"`` — ZeRO-0/1 with gradient accumulation: ranks synchronise once, at the step boundary, so a step lasts
  as long as the replica with the largest *sum* of its packs' times. The only mode for plans with unequal
  micro-batch counts per replica (bytescale, ``plan.extra["unequal_micro_batches"]``).

Optional communication model (``SimConfig.zero_stage``; None, the default, leaves it out: compute only, the
upper bound of a speed-up). With P = ``model.shape.num_params`` bf16 parameters (2P bytes), W = the plan's world
size (DeepSpeed reduces over the whole sequence-data-parallel group: every rank, whatever the SP degree) and
bw = ``intra_node_gbps`` if W <= ``gpus_per_node`` else ``inter_node_gbps`` (GB/s per GPU), a ring collective
over W ranks costs

    RS(B) = AG(B) = B · (W−1)/W / bw        (reduce-scatter, all-gather of B bytes)     AR(B) = 2 · RS(B)

    stage   per micro-batch (slot)              per step
    0       —                                   AR(2P)                 gradients all-reduced at the boundary
    1       —                                   RS(2P) + AG(2P)        gradients reduced, updated params gathered
    2       RS(2P)                              AG(2P)                 gradients reduced every micro-batch
    3       AG(2P) fwd + AG(2P) bwd + RS(2P)    —                      params gathered in each forward and backward

plus the optimizer step once per step: AdamW is memory-bound, ~32 bytes read and written per parameter it
updates (fp32 master, m, v, fp32 gradient; bf16 copy) at ``hbm_gbps``: 32 · P/W / hbm (stages >= 1, each rank
updates its partition) or 32 · P / hbm (stage 0). With ``offload_optimizer`` the step runs on the CPU instead
(DeepSpeed's CPU Adam): P/W / ``CPU_ADAM_PARAMS_PER_S`` plus the partition's gradients to the host and its
bf16 parameters back (6 B per parameter over ``pcie_gbps``); with ``offload_param`` (stage 3) every micro-batch's
two gathers first bring the rank's partition from the host (2 x 2P/W bytes over ``pcie_gbps``, per micro-batch).
``comm_overlap`` (0..1, DeepSpeed's overlap_comm) hides that
share of the per-micro-batch collectives behind compute: every slot is longer by (1 − overlap) · its collectives;
per-step collectives and the optimizer add to every step in full. overlap 0 is the pessimistic bound.
With a stage given, sync defaults to "step" for stages 0/1 and "micro" for 2/3, and a plan with unequal
micro-batch counts is refused for stages 2/3 (``bytescale.check_zero_stage``).

Step costs (``CostModel.step_costs``, a calibration's measured "step_costs", or ``SimConfig.step_costs``; all 0
when unknown, as in the shipped H100 calibration): every pack's predicted compute is multiplied by
``compute_scale`` and each pack a replica runs costs ``pack_s`` more (an empty pack too: the trainer runs a
one-token dummy for it; not under unequal micro-batch counts, where a replica runs only its own packs); every
micro-batch (slot) adds ``micro_batch_s`` and ``data_micro_batch_s``, every optimizer step ``step_s`` and
``data_step_s``. With them, and ``zero_stage`` for the collectives, a step's time is the absolute time the
calibrated machine takes, not only a ratio between plans (docs/simulator.md, "Absolute time").

Idle fraction = Σ (synchronised time − a replica's busy time) / (replicas · Σ synchronised time) — the share of
GPU time spent waiting for a slower replica (modelled collectives, optimizer and step costs count as busy). All
times are *simulated* and labelled so in reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from hbp_train.common.errors import UserError
from hbp_train.perf.cost_model import (DEFAULT_INTER_NODE_GBPS, DEFAULT_INTRA_NODE_GBPS, DEFAULT_PCIE_GBPS, CostModel,
                                      StepCosts, group_levers)
from hbp_train.planning.plan import Plan

SYNC_MODES = ("micro", "step")
ZERO_STAGES = (0, 1, 2, 3)
# bf16 parameters and gradients.
PARAM_BYTES = 2
# AdamW per parameter updated: read fp32 master, m, v and fp32 gradient (16 B), write master, m, v (12 B) and the
# bf16 copy (2 B): ~32 B of HBM traffic, no reuse, so the step is memory-bound.
OPTIMIZER_BYTES_PER_PARAM = 32
# H100 SXM HBM3 peak, GB/s.
DEFAULT_HBM_GBPS = 3350.0
# DeepSpeed's CPU Adam with optimizer offload, parameters updated per second per GPU: a node's CPU updates ~2e9
# parameters/s (AVX-512, all cores) shared by its 8 GPUs' partitions (an assumption, not measured here).
CPU_ADAM_PARAMS_PER_S = 2.5e8
COMPUTE_ONLY = "compute only (no ZeRO collectives, no optimizer step: upper bound)"


@dataclass
class SimConfig:
    """How to simulate: links, checkpointing default, the synchronisation model and the (optional) ZeRO model."""

    intra_node_gbps: float = DEFAULT_INTRA_NODE_GBPS
    """All-to-all bandwidth per GPU inside a node, GB/s (gigabytes per second); also ZeRO's collectives when the
    plan's world size fits in one node."""
    inter_node_gbps: float = DEFAULT_INTER_NODE_GBPS
    """All-to-all bandwidth per GPU across nodes (SP groups larger than a node), GB/s; also ZeRO's collectives
    when the plan spans nodes."""
    gpus_per_node: int = 8
    """GPUs per node: an SP group of more ranks than this crosses nodes."""
    ckpt_layers: int = 0
    """Checkpointed layers for groups whose plan entry has ckpt_layers null (the trainer's default)."""
    sync: str | None = None
    """"micro" (ZeRO-2/3), "step" (ZeRO-0/1) or None: from zero_stage when given, else "step" for
    unequal-micro-batch plans and "micro" otherwise."""
    zero_stage: int | None = None
    """ZeRO stage whose collectives and optimizer step are added (0-3), or None: not modelled (compute only, the
    upper bound of a speed-up)."""
    comm_overlap: float = 0.0
    """Share (0..1) of the per-micro-batch collectives hidden behind compute (DeepSpeed overlap_comm); 0 exposes
    them all (the pessimistic bound). Per-step collectives and the optimizer are never hidden."""
    hbm_gbps: float = DEFAULT_HBM_GBPS
    """GPU memory bandwidth in GB/s for the memory-bound optimizer step (default: H100 SXM HBM3)."""
    step_costs: StepCosts | None = None
    """The per-pack, per-micro-batch, per-step and data costs (module docstring), or None: the cost model's own
    (its calibration's "step_costs"; all 0 when it has none)."""
    pcie_gbps: float = DEFAULT_PCIE_GBPS
    """Host <-> GPU bandwidth per GPU and direction, GB/s: the activation offload's copies of groups that use it
    (hbp_train.perf.cost_model)."""
    offload_optimizer: bool = False
    """With zero_stage: the optimizer step runs on the CPU (deepspeed.offload_optimizer; module docstring)."""
    offload_param: bool = False
    """With zero_stage 3: the parameter partitions live on the CPU (deepspeed.offload_param; module docstring)."""

    def __post_init__(self):
        if not (self.intra_node_gbps > 0 and self.inter_node_gbps > 0):  # also refuses NaN
            raise UserError("intra_node_gbps and inter_node_gbps must be > 0")
        if self.gpus_per_node < 1:
            raise UserError(f"gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if self.ckpt_layers < 0:
            raise UserError(f"ckpt_layers must be >= 0, got {self.ckpt_layers}")
        if self.sync is not None and self.sync not in SYNC_MODES:
            raise UserError(f"sync must be one of {SYNC_MODES} or None, got {self.sync!r}")
        if self.zero_stage is not None and self.zero_stage not in ZERO_STAGES:
            raise UserError(f"zero_stage must be one of {ZERO_STAGES} or None, got {self.zero_stage!r}")
        if not 0.0 <= self.comm_overlap <= 1.0:
            raise UserError(f"comm_overlap must be in [0, 1], got {self.comm_overlap}")
        if not self.hbm_gbps > 0:
            raise UserError(f"hbm_gbps must be > 0, got {self.hbm_gbps}")
        if not self.pcie_gbps > 0:
            raise UserError(f"pcie_gbps must be > 0, got {self.pcie_gbps}")
        if self.zero_stage is not None and self.sync is not None and self.sync != stage_sync(self.zero_stage):
            raise UserError(f"sync {self.sync!r} contradicts zero_stage {self.zero_stage} (which synchronises "
                            f"every {'micro-batch' if self.zero_stage >= 2 else 'step'}); leave sync unset")

    def comm_model(self) -> str:
        """One line naming the communication model, for tables, JSON and plot titles."""
        if self.zero_stage is None:
            return COMPUTE_ONLY
        offload = [n for n, on in (("optimizer", self.offload_optimizer), ("parameter", self.offload_param)) if on]
        where = f" + {' & '.join(offload)} offload" if offload else ""
        return f"ZeRO-{self.zero_stage}{where} collectives (overlap {self.comm_overlap:g}) + AdamW step"


def stage_sync(zero_stage: int) -> str:
    """The synchronisation a ZeRO stage imposes: "step" for 0/1 (reduce at the boundary), "micro" for 2/3."""
    return "micro" if zero_stage >= 2 else "step"


def zero_comm_seconds(num_params: int, world_size: int, config: SimConfig) -> dict:
    """Seconds of one ZeRO stage's collectives and optimizer step (module docstring), before overlap.

    Returns {"micro": collectives per micro-batch, "step": collectives per step, "optimizer": AdamW step}.
    """
    stage, w = config.zero_stage, world_size
    if stage is None:
        return {"micro": 0.0, "step": 0.0, "optimizer": 0.0}
    gbps = config.intra_node_gbps if w <= config.gpus_per_node else config.inter_node_gbps
    ring = PARAM_BYTES * num_params * (w - 1) / w / (gbps * 1e9)  # one reduce-scatter or all-gather of 2P bytes
    micro, step = {0: (0.0, 2 * ring), 1: (0.0, 2 * ring), 2: (ring, ring), 3: (3 * ring, 0.0)}[stage]
    touched = num_params / w if stage >= 1 else num_params
    optimizer = OPTIMIZER_BYTES_PER_PARAM * touched / (config.hbm_gbps * 1e9)
    pcie = config.pcie_gbps * 1e9
    if config.offload_optimizer:
        optimizer = touched / CPU_ADAM_PARAMS_PER_S + 6 * touched / pcie
    if config.offload_param and stage == 3:
        micro += 2 * PARAM_BYTES * num_params / w / pcie
    return {"micro": micro, "step": step, "optimizer": optimizer}


@dataclass
class SimResult:
    """Simulated times of one plan (seconds)."""

    sync: str
    """The synchronisation model used ("micro" or "step")."""
    pack_seconds: np.ndarray
    """float64 [num_packs]: predicted time of every pack on its replica."""
    step_seconds: np.ndarray
    """float64 [num_steps]: wall time of every optimizer step (with the modelled collectives and optimizer, if any)."""
    slot_step: np.ndarray
    """int64 [num_slots]: step of every slot (micro-batch k of all replicas of a step)."""
    slot_ptr: np.ndarray
    """int64 [num_slots + 1]: CSR pointer into replica_seconds (a slot has R entries)."""
    replica_seconds: np.ndarray
    """float64: each replica's time in every slot, slot after slot (0 for an empty pack)."""
    slot_seconds: np.ndarray
    """float64 [num_slots]: time of the slowest replica in every slot (compute; collectives are in
    step_comm_seconds)."""
    busy_seconds: float
    """Σ over replicas and packs of the pack time, divided by the replicas of each step (mean busy time)."""
    tokens: int
    """Tokens trained by the plan."""
    comm_model: str = COMPUTE_ONLY
    """The communication model used (SimConfig.comm_model)."""
    step_comm_seconds: np.ndarray | None = None
    """float64 [num_steps]: exposed ZeRO collective seconds in every step (included in step_seconds); None when
    not modelled."""
    optimizer_seconds_per_step: float = 0.0
    """Seconds of the optimizer step, added to every step (included in step_seconds)."""
    step_cost_seconds: np.ndarray | None = None
    """float64 [num_steps]: the step costs outside the slots' packs in every step (per micro-batch, per step,
    data; included in step_seconds); None when there are none."""
    step_costs: str = "no step costs (compute only)"
    """The step costs used (StepCosts.note)."""
    extra: dict = field(default_factory=dict)

    @property
    def total_seconds(self) -> float:
        return float(self.step_seconds.sum())

    @property
    def comm_seconds(self) -> float:
        """Σ exposed collective seconds over all steps."""
        return 0.0 if self.step_comm_seconds is None else float(self.step_comm_seconds.sum())

    @property
    def optimizer_seconds(self) -> float:
        """Σ optimizer seconds over all steps."""
        return self.optimizer_seconds_per_step * len(self.step_seconds)

    @property
    def step_cost_total(self) -> float:
        """Σ over all steps of the step costs outside the slots' packs."""
        return 0.0 if self.step_cost_seconds is None else float(self.step_cost_seconds.sum())

    @property
    def idle_fraction(self) -> float:
        total = self.total_seconds
        busy = self.busy_seconds + self.comm_seconds + self.optimizer_seconds + self.step_cost_total
        return float(1.0 - busy / total) if total > 0 else 0.0

    def summary(self) -> dict:
        """Plan-level figures for tables and JSON."""
        total = self.total_seconds
        return {
            "simulated_seconds": total,
            "simulated_hours": total / 3600.0,
            "idle_fraction": self.idle_fraction,
            "tokens": int(self.tokens),
            "simulated_tokens_per_second": self.tokens / total if total > 0 else 0.0,
            "num_steps": int(len(self.step_seconds)),
            "num_slots": int(len(self.slot_seconds)),
            "sync": self.sync,
            "comm_model": self.comm_model,
            "comm_seconds": self.comm_seconds,
            "comm_seconds_per_step": self.comm_seconds / max(len(self.step_seconds), 1),
            "optimizer_seconds": self.optimizer_seconds,
            "optimizer_seconds_per_step": self.optimizer_seconds_per_step,
            "step_cost_seconds": self.step_cost_total,
            "step_costs": self.step_costs,
            **self.extra,
        }

    def slots(self, limit: int | None = None) -> list[dict]:
        """Per-slot records {"step", "slot", "replica_seconds", "slot_seconds"} (the first ``limit``)."""
        n = len(self.slot_seconds) if limit is None else min(limit, len(self.slot_seconds))
        out, k, prev = [], 0, -1
        rs = [float(f"{x:.6g}") for x in self.replica_seconds.tolist()]  # 6 digits: a tiny model's are µs
        ptr = self.slot_ptr.tolist()
        for i in range(n):
            step = int(self.slot_step[i])
            k = k + 1 if step == prev else 0
            prev = step
            out.append({"step": step, "slot": k, "replica_seconds": rs[ptr[i]:ptr[i + 1]],
                        "slot_seconds": float(f"{self.slot_seconds[i]:.6g}")})
        return out


def plan_pack_seconds(plan: Plan, model: CostModel, config: SimConfig) -> np.ndarray:
    """Predicted seconds of every pack of ``plan`` (with its group's sp and ckpt_layers)."""
    groups = plan.config.groups
    sp = np.array([g.sp for g in groups], np.int64)[plan.pack_group]
    ckpt_of = np.array([config.ckpt_layers if g.ckpt_layers is None else g.ckpt_layers for g in groups], np.int64)
    ckpt = np.minimum(ckpt_of, model.shape.num_layers)[plan.pack_group]
    levers = np.array([group_levers(g) for g in groups], bool).reshape(len(groups), 2)[plan.pack_group]
    return model.pack_times(plan.lengths[plan.pack_samples], plan.pack_ptr, sp, ckpt, config.intra_node_gbps,
                            config.inter_node_gbps, config.gpus_per_node, levers[:, 0], levers[:, 1],
                            config.pcie_gbps)


def simulate(plan: Plan, model: CostModel, config: SimConfig | None = None) -> SimResult:
    """Simulate ``plan`` with ``model``; see the module docstring for the synchronisation models."""
    config = config or SimConfig()
    unequal = bool(plan.extra.get("unequal_micro_batches", False))
    if config.zero_stage is not None:
        from hbp_train.planning.baselines.bytescale import check_zero_stage

        check_zero_stage(plan, config.zero_stage)  # unequal micro-batch counts need ZeRO 0/1
        sync = config.sync or stage_sync(config.zero_stage)
    else:
        sync = config.sync or ("step" if unequal else "micro")
    costs = config.step_costs if config.step_costs is not None else model.step_costs
    pack_s = plan_pack_seconds(plan, model, config)
    reps = np.array([plan.config.replicas(g) for g in range(len(plan.config.groups))], np.int64)
    step_r = reps[plan.step_group]
    step_sizes = np.diff(plan.step_ptr)
    num_steps = plan.num_steps
    # Slots: every R consecutive entries of a step's slot-major pack list.
    slots_per_step = step_sizes // step_r
    slot_step = np.repeat(np.arange(num_steps), slots_per_step)
    slot_ptr = np.concatenate([[0], np.cumsum(np.repeat(step_r, slots_per_step))]).astype(np.int64)
    replica_s = costs.compute_scale * pack_s[plan.step_packs]
    if costs.pack_s:
        # Every pack a replica runs, an empty one too (the trainer's dummy micro-batch), unless replicas run only
        # their own packs (unequal micro-batch counts).
        runs = (np.diff(plan.pack_ptr)[plan.step_packs] > 0) if unequal else np.ones(len(replica_s), bool)
        replica_s = replica_s + costs.pack_s * runs
    if len(replica_s):
        slot_s = np.maximum.reduceat(replica_s, slot_ptr[:-1]) if len(slot_ptr) > 1 else np.zeros(0)
    else:
        slot_s = np.zeros(0)
    # Mean busy time of a replica per step: Σ pack seconds / R.
    busy_per_step = np.bincount(np.repeat(np.arange(num_steps), step_sizes), replica_s, minlength=num_steps) / step_r
    if sync == "micro":
        step_s = np.bincount(slot_step, slot_s, minlength=num_steps)
    else:
        # Σ per replica within each step, then the slowest replica.
        pos = np.arange(len(plan.step_packs)) - np.repeat(plan.step_ptr[:-1], step_sizes)
        replica_of = pos % np.repeat(step_r, step_sizes)
        base = np.concatenate([[0], np.cumsum(step_r)[:-1]])
        key = np.repeat(base, step_sizes) + replica_of
        per_replica = np.bincount(key, replica_s, minlength=int(step_r.sum()))
        step_s = np.maximum.reduceat(per_replica, base) if num_steps else np.zeros(0)
    if plan.optimizer_step is not None:
        # Optimizer steps of several plan steps (groups mixed, hbp step_mix="mixed"): their plan steps run one after
        # the other and share one boundary. Under "step" sync this sums each plan step's slowest replica, an upper
        # bound of the optimizer step's slowest replica.
        opt = plan.optimizer_steps()
        num_steps = plan.num_optimizer_steps
        step_s = np.bincount(opt, step_s, minlength=num_steps)
        slots_per_step = np.bincount(opt, slots_per_step, minlength=num_steps)
        slot_step = opt[slot_step]
    step_cost = None
    if costs.known:
        step_cost = (costs.micro_batch_s + costs.data_micro_batch_s) * slots_per_step + costs.step_s \
            + costs.data_step_s
        step_s = step_s + step_cost
    step_comm, optimizer = None, 0.0
    if config.zero_stage is not None:
        comm = zero_comm_seconds(model.shape.num_params, plan.config.world_size, config)
        # Stages 2/3 (micro sync): every slot is longer by its exposed collectives; stages 0/1 have none per slot.
        step_comm = slots_per_step * (1.0 - config.comm_overlap) * comm["micro"] + comm["step"]
        optimizer = comm["optimizer"]
        step_s = step_s + step_comm + optimizer
    tokens = int(plan.lengths[plan.pack_samples].sum())
    return SimResult(sync=sync, pack_seconds=pack_s, step_seconds=step_s, slot_step=slot_step, slot_ptr=slot_ptr,
                     replica_seconds=replica_s, slot_seconds=slot_s, busy_seconds=float(busy_per_step.sum()),
                     tokens=tokens, comm_model=config.comm_model(), step_comm_seconds=step_comm,
                     optimizer_seconds_per_step=optimizer, step_cost_seconds=step_cost, step_costs=costs.note())


def speedup(baseline: SimResult, other: SimResult) -> float:
    """Simulated throughput of ``other`` over ``baseline`` (tokens/s ratio; = time ratio for equal tokens)."""
    b, o = baseline.summary()["simulated_tokens_per_second"], other.summary()["simulated_tokens_per_second"]
    return float(o / b) if b > 0 else float("nan")


def plot_comparison(names: list[str], results: list[SimResult], path, title: str = "") -> None:
    """PNG: simulated time per plan (with speed-up over the first) and the distribution of step times."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(16, 4.8))
    hours = [r.total_seconds / 3600 for r in results]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    bars = ax1.bar(range(len(names)), hours, color=[colors[i % len(colors)] for i in range(len(names))])
    for i, (b, r) in enumerate(zip(bars, results)):
        label = "baseline" if i == 0 else f"{speedup(results[0], r):.2f}x"
        ax1.annotate(label, (b.get_x() + b.get_width() / 2, b.get_height()), ha="center", va="bottom", fontsize=9)
    ax1.set_xticks(range(len(names)), names, rotation=20, ha="right")
    ax1.set_ylabel("simulated wall-clock hours")
    ax1.set_title("simulated total time (speed-up vs first)")
    ax2.bar(range(len(names)), [100 * r.idle_fraction for r in results],
            color=[colors[i % len(colors)] for i in range(len(names))])
    ax2.set_xticks(range(len(names)), names, rotation=20, ha="right")
    ax2.set_ylabel("idle %")
    ax2.set_title("simulated idle (waiting for slower replicas)")
    for i, (name, r) in enumerate(zip(names, results)):
        s = np.sort(r.step_seconds)
        ax3.plot(s, np.arange(1, len(s) + 1) / max(len(s), 1), label=name, color=colors[i % len(colors)])
    ax3.set_xscale("log")
    ax3.set_xlabel("simulated step time (s)")
    ax3.set_ylabel("fraction of steps")
    ax3.set_title("step-time CDF")
    ax3.legend(fontsize=8)
    # Say which communication model the times include (plans of one figure may differ, e.g. bytescale at ZeRO-1).
    comm = "; ".join(dict.fromkeys(r.comm_model for r in results))
    fig.suptitle(f"SIMULATED — {title}\n{comm}" if title else f"SIMULATED (cost model, nothing was run)\n{comm}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
