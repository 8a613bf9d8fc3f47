"""Length mix of plan steps (#16): the mix metrics (token share per length bucket, mix_TV)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from hbp_train.planning import GroupSpec, PlanConfig, make_plan
from hbp_train.planning.metrics import mix_distance, mix_edges, token_mix


def test_mix_edges_token_mix_and_distance():
    assert mix_edges([1024, 2048]).tolist() == [16, 32, 64, 128, 256, 512, 1024, 2048]
    assert mix_edges([4]).tolist() == [1, 2, 4]  # no bucket narrower than a token, none twice
    edges = np.array([10, 100])
    assert token_mix(np.array([10, 30, 60]), edges).tolist() == pytest.approx([0.1, 0.9])  # 10 <= 10: bucket 0
    rows = token_mix(np.array([10, 30, 60, 5]), edges, np.array([0, 0, 1, 2]), 4)
    np.testing.assert_allclose(rows, [[0.25, 0.75], [0.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    assert mix_distance(rows[:3], np.array([0.25, 0.75])).tolist() == pytest.approx([0.0, 0.25, 0.75])


def test_plan_mix_metrics():
    """step_metrics["mix"]: each step's token share per bucket; mix_TV: 0 when every step holds the data's mix."""
    lengths = np.array([100, 900, 100, 900], np.int64)  # two equal steps: each one short and one long sample
    cfg = PlanConfig(world_size=1, groups=[GroupSpec(1000, 1)], global_tokens=1000)
    plan = make_plan(lengths, cfg)
    assert plan.num_steps == 2
    assert plan.metrics["mix_TV"] == pytest.approx(0.0)
    assert plan.step_metrics["mix"].sum(axis=1) == pytest.approx([1.0, 1.0])
    edges = plan.metrics["mix_edges"]
    assert plan.metrics["data_mix"][int(np.searchsorted(edges, 900))] == pytest.approx(0.9)
    # One step of the long samples, one of the short ones: each step is far from the data's 10/90 mix.
    plan = make_plan(np.array([900, 900, 100, 100], np.int64), replace(cfg, global_tokens=1800,
                                                                      groups=[GroupSpec(1800, 1)]))
    tv = plan.step_metrics["mix_TV"]
    assert sorted(tv.tolist()) == pytest.approx([0.1, 0.9])
    assert plan.metrics["mix_TV"] == pytest.approx(0.5)
    d = plan.to_dict()
    assert len(d["step_metrics"][0]["mix"]) == len(edges) and d["metrics"]["mix_TV"] == pytest.approx(0.5)
