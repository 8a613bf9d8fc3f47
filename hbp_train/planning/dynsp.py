"""SP chosen per sample (ByteScale / FlexSP style): what it could win over hbp, as a simulated UPPER BOUND.

hbp fixes the SP degree per packing group: a step runs only packs of one group, and GreedyFill tops the long
groups' packs up with short samples, which then pay that group's all-to-all (CR above the share of tokens that
must use SP). A dynamic-SP planner ("dynsp") would give every pack the smallest SP degree, among the built
groups', whose memory model says it fits, and fill each micro-batch slot with packs of mixed degrees, balanced
on predicted time. Before building that (in the planner, the simulator and the trainer's SP switch per
micro-batch), this module bounds its gain on a plan:

* **hbp's GPU-seconds**: the cost model's time of every pack at its group's SP degree and checkpointing
  (compute / sp + all-to-all, recompute included), times sp;
* **dynsp's ideal GPU-seconds**: every SAMPLE on its own at the smallest built degree that fits it
  (``min_fitting_group``: hbp_train.perf.memory's model, against the memory the largest group needs, which the job
  already affords), times that degree: no short sample pays a long group's all-to-all. Attention is per sample
  in a packed micro-batch and the linear layers and all-to-all are per token, so packing changes neither;
* the bound: hbp's simulated time minus the GPU-seconds saved spread over all W GPUs, with hbp's own idle time
  and collectives kept (a perfectly balanced mixed-degree slot can do no better).

Pure numpy plus the cost and memory models; nothing here plans steps.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from hbp_train.perf.cost_model import group_levers
from hbp_train.perf.memory import JobSettings, analytic_memory_bytes
from hbp_train.planning.plan import Plan


def _ckpt(group, sim_config, num_layers: int) -> int:
    ckpt = sim_config.ckpt_layers if group.ckpt_layers is None else int(group.ckpt_layers)
    return min(int(ckpt), num_layers)


def min_fitting_group(lengths: np.ndarray, plan: Plan, shape, sim_config,
                      job: JobSettings | None = None) -> np.ndarray:
    """int64: for every length, the group (index) with the smallest SP degree among the plan's groups whose
    memory model (at that group's checkpointing) fits a pack of that many tokens within the memory the largest
    group needs (ties: the lower group); the last group when none does. The groups are the ones built for the
    job, so that budget is memory the job has."""
    job = job or JobSettings()
    groups = plan.config.groups
    world = plan.config.world_size
    budget = max(analytic_memory_bytes(shape, g.pack_len, g.sp, _ckpt(g, sim_config, shape.num_layers), world, job,
                                       *group_levers(g)) for g in groups)
    lengths = np.asarray(lengths, np.int64)
    out = np.full(len(lengths), len(groups) - 1, np.int64)
    top = int(lengths.max(initial=1))
    # Worst candidates first, so the best (smallest degree, then lowest group) that fits is written last.
    for i in sorted(range(len(groups)), key=lambda i: (groups[i].sp, i), reverse=True):
        g = groups[i]
        ckpt = _ckpt(g, sim_config, shape.num_layers)
        lo, hi = 0, top
        while lo < hi:  # longest pack that fits at (sp, ckpt): memory grows with tokens, so bisect
            mid = (lo + hi + 1) // 2
            if analytic_memory_bytes(shape, mid, g.sp, ckpt, world, job, *group_levers(g)) <= budget:
                lo = mid
            else:
                hi = mid - 1
        out = np.where(lengths <= lo, i, out)
    return out


def dynsp_bound(plan: Plan, model, sim_config, hbp_seconds: float | None = None) -> dict:
    """The simulated upper bound of dynsp's speed-up over ``plan`` (see the module docstring).

    ``hbp_seconds``: the plan's simulated time (simulated here with ``sim_config`` when None). Returns a dict:
    hbp_gpu_seconds, dynsp_gpu_seconds, saved_share (of hbp's GPU-seconds), hbp_seconds, dynsp_seconds_bound,
    speedup_bound, and share_of_tokens_at_lower_sp (tokens that would run at a lower degree than in hbp)."""
    from hbp_train.planning.simulator import simulate

    if hbp_seconds is None:
        hbp_seconds = simulate(plan, model, replace(sim_config, sync=None)).total_seconds
    cfg, shape = plan.config, model.shape
    links = (sim_config.intra_node_gbps, sim_config.inter_node_gbps, sim_config.gpus_per_node)
    sp_of = np.array([g.sp for g in cfg.groups], np.int64)
    ckpt_of = np.array([_ckpt(g, sim_config, shape.num_layers) for g in cfg.groups], np.int64)
    levers_of = np.array([group_levers(g) for g in cfg.groups], bool).reshape(len(cfg.groups), 2)
    pack_sp, pack_ckpt, pack_levers = sp_of[plan.pack_group], ckpt_of[plan.pack_group], levers_of[plan.pack_group]
    flat = plan.lengths[plan.pack_samples]
    hbp_gpu = float((model.pack_times(flat, plan.pack_ptr, pack_sp, pack_ckpt, *links, pack_levers[:, 0],
                                      pack_levers[:, 1], sim_config.pcie_gbps) * pack_sp).sum())
    # Every packed sample alone in the group of the smallest degree that fits it (that group's checkpointing).
    sample_group = min_fitting_group(flat, plan, shape, sim_config)
    sample_sp, sample_ckpt, sample_levers = sp_of[sample_group], ckpt_of[sample_group], levers_of[sample_group]
    singles = np.arange(len(flat) + 1, dtype=np.int64)
    dyn_gpu = float((model.pack_times(flat, singles, sample_sp, sample_ckpt, *links, sample_levers[:, 0],
                                      sample_levers[:, 1], sim_config.pcie_gbps) * sample_sp).sum())
    saved = hbp_gpu - dyn_gpu
    bound = hbp_seconds - saved / cfg.world_size
    in_pack_sp = np.repeat(pack_sp, np.diff(plan.pack_ptr))
    return {"hbp_gpu_seconds": hbp_gpu, "dynsp_gpu_seconds": dyn_gpu,
            "saved_share": saved / hbp_gpu if hbp_gpu > 0 else 0.0,
            "hbp_seconds": float(hbp_seconds), "dynsp_seconds_bound": float(bound),
            "speedup_bound": float(hbp_seconds / bound) if bound > 0 else float("nan"),
            "share_of_tokens_at_lower_sp": float(flat[sample_sp < in_pack_sp].sum() / max(flat.sum(), 1))}
