"""The dynsp upper bound (planning/dynsp.py): the smallest fitting SP degree per sample from the memory model,
and the GPU-seconds a per-sample SP choice would save over an hbp plan, checked against the cost model by hand."""

from __future__ import annotations

import numpy as np
import pytest

from hbp_train.perf.cost_model import CostModel
from hbp_train.planning import GroupSpec, PlanConfig, make_plan
from hbp_train.planning.dynsp import dynsp_bound, min_fitting_group
from hbp_train.planning.simulator import SimConfig

MODEL = CostModel.from_calibration()


def mix(n=3000, seed=0):
    rng = np.random.default_rng(seed)
    short = np.clip(rng.lognormal(np.log(600), 1.2, n), 16, 8000).astype(np.int64)
    docs = rng.integers(20_000, 64_000, n // 50)
    return np.r_[short, docs]


def test_min_fitting_group_takes_the_smallest_degree_that_fits():
    plan = make_plan(mix(300), PlanConfig(world_size=8, groups=[GroupSpec(16384, 1), GroupSpec(65536, 8)],
                                          global_tokens=1 << 19))
    lengths = np.array([1, 8000, 16384, 16385, 40_000, 65536])
    got = min_fitting_group(lengths, plan, MODEL.shape, SimConfig())
    # 16K tokens on one rank need about what 64K need on eight: the short ones fit SP1, the long ones only SP8.
    assert got[0] == got[1] == 0 and got[-2] == got[-1] == 1
    assert np.all(np.diff(got) >= 0)


def test_bound_is_one_without_a_lower_degree_and_matches_the_cost_model_by_hand():
    lengths = mix()
    single = make_plan(lengths, PlanConfig(world_size=8, groups=[GroupSpec(65536, 4)], global_tokens=1 << 19))
    b = dynsp_bound(single, MODEL, SimConfig())
    assert b["share_of_tokens_at_lower_sp"] == 0.0 and b["speedup_bound"] == pytest.approx(1.0)

    cfg = PlanConfig(world_size=8, groups=[GroupSpec(16384, 1), GroupSpec(65536, 8)], global_tokens=1 << 19)
    plan = make_plan(lengths, cfg)
    b = dynsp_bound(plan, MODEL, SimConfig())
    group = min_fitting_group(lengths, plan, MODEL.shape, SimConfig())
    sp = np.array([1, 8])[group]
    by_hand = sum(MODEL.pack_time([int(x)], int(s)) * s for x, s in zip(lengths, sp))
    assert b["dynsp_gpu_seconds"] == pytest.approx(by_hand, rel=1e-9)
    hbp_by_hand = sum(MODEL.pack_time(plan.lengths[plan.pack(p)].tolist(), cfg.groups[g].sp) * cfg.groups[g].sp
                      for p, g in enumerate(plan.pack_group.tolist()))
    assert b["hbp_gpu_seconds"] == pytest.approx(hbp_by_hand, rel=1e-9)
    # GreedyFill put short samples into SP8 packs: running them at SP1 saves their all-to-all, so the bound is > 1.
    assert b["share_of_tokens_at_lower_sp"] > 0 and b["hbp_gpu_seconds"] > b["dynsp_gpu_seconds"]
    assert b["speedup_bound"] > 1.0
    assert b["dynsp_seconds_bound"] == pytest.approx(
        b["hbp_seconds"] - (b["hbp_gpu_seconds"] - b["dynsp_gpu_seconds"]) / 8)
