"""Plan metrics against hand-computed cases (paper Sec. 3.1), including the paper's ABR example."""

from __future__ import annotations

import numpy as np
import pytest

from hbp_train.planning.csr import pack_csr
from hbp_train.planning.metrics import with_metrics
from hbp_train.planning.plan import GroupSpec, Plan, PlanConfig


def make(lengths, packs, steps, groups, world_size):
    """A plan from explicit packs; ``steps``: list of (group, [pack ids slot-major])."""
    ptr, flat = pack_csr(packs)
    pack_group = np.zeros(len(packs), np.int32)
    for g, ids in steps:
        pack_group[ids] = g
    sizes = [len(ids) for _, ids in steps]
    plan = Plan(
        config=PlanConfig(world_size=world_size, groups=groups), lengths=np.asarray(lengths, np.int64),
        pack_ptr=ptr, pack_samples=flat, pack_group=pack_group,
        step_ptr=np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64),
        step_packs=np.concatenate([ids for _, ids in steps]).astype(np.int64),
        step_group=np.array([g for g, _ in steps], np.int32),
    )
    plan.validate()
    return with_metrics(plan)


def test_paper_abr_example():
    # {1K,1K,1K,1K} vs {2K,2K}: attention 4K^2 vs 8K^2 -> ABR (8-4)/(8*2) = 0.25, tokens equal -> DBR 0.
    k = 1024
    plan = make([k, k, k, k, 2 * k, 2 * k], [[0, 1, 2, 3], [4, 5]], [(0, [0, 1])], [GroupSpec(4 * k, 1)], 2)
    m = plan.metrics
    assert m["ABR"] == pytest.approx(0.25)
    assert m["DBR"] == pytest.approx(0.0)
    assert m["PR"] == pytest.approx(0.0)
    assert m["CR"] == pytest.approx(0.0)
    assert m["AveT"] == pytest.approx(4 * k)  # 8K tokens / (1 step * 2 ranks)


def test_dbr_pr_and_per_slot_mean():
    # One step, 2 replicas x 2 micro-batches. Slot 0: packs 0 (3000 tok) | 1 (4000 tok); slot 1: 2 (4000) | 3 (4000).
    lengths = [3000, 4000, 1000, 3000, 2000, 2000]
    packs = [[0], [1], [2, 3], [4, 5]]
    plan = make(lengths, packs, [(0, [0, 1, 2, 3])], [GroupSpec(4096, 1)], 2)
    m = plan.metrics
    slot0_dbr = (4000 - 3000) / (4000 * 2)
    a = [3000**2, 4000**2, 1000**2 + 3000**2, 2 * 2000**2]
    slot0_abr = (a[1] - a[0]) / (a[1] * 2)
    slot1_abr = (a[2] - a[3]) / (a[2] * 2)
    assert m["DBR"] == pytest.approx(slot0_dbr / 2)
    assert m["ABR"] == pytest.approx((slot0_abr + slot1_abr) / 2)
    assert m["PR"] == pytest.approx(1 - 15000 / (4 * 4096))
    assert plan.step_metrics["ABR"][0] == pytest.approx((slot0_abr + slot1_abr) / 2)
    assert plan.step_metrics["tokens"][0] == 15000
    assert plan.step_metrics["micro_batches"][0] == 2
    # Replica r runs packs [r, r + 2] (slot-major layout) in the JSON.
    assert plan.to_dict()["steps"][0]["replicas"] == [[[0], [2, 3]], [[1], [4, 5]]]


def test_cr_avet_and_sp_required_share():
    # W = 4. Group 0 (pack_len 100, sp 1): 4 replicas; group 1 (pack_len 400, sp 2): 2 replicas.
    lengths = [100, 100, 50, 50, 300, 350, 40]
    packs = [[0], [1], [2, 3], [6], [4], [5]]
    groups = [GroupSpec(100, 1), GroupSpec(400, 2)]
    plan = make(lengths, packs, [(0, [0, 1, 2, 3]), (1, [4, 5])], groups, 4)
    m = plan.metrics
    total = sum(lengths)
    assert m["CR"] == pytest.approx(650 / total)
    assert m["sp_required_share"] == pytest.approx(650 / total)  # 300 and 350 are longer than 100
    assert m["AveT"] == pytest.approx(total / (2 * 4))
    assert m["PR"] == pytest.approx(1 - total / (4 * 100 + 2 * 400))
    assert m["DBR"] == pytest.approx(((100 - 40) / (100 * 4) + (350 - 300) / (350 * 2)) / 2)


def test_plan_wide_balance_is_a_mean_over_slots_and_avet_over_steps():
    # Two steps of 1 and 3 slots (W=2): a mean over steps would weigh the lone slot three times as much.
    # Reference recomputed from the plan's JSON (replica r's packs per slot) with the paper's formulas.
    lengths = [10, 2, 8, 8, 5, 3, 9, 1]
    plan = make(lengths, [[i] for i in range(8)], [(0, [0, 1]), (0, [2, 3, 4, 5, 6, 7])], [GroupSpec(16, 1)], 2)
    d = plan.to_dict()
    dbr, abr = [], []
    for step in d["steps"]:
        replicas = step["replicas"]
        for k in range(len(replicas[0])):
            t = np.array([sum(lengths[i] for i in rep[k]) for rep in replicas], float)
            a = np.array([sum(lengths[i] ** 2 for i in rep[k]) for rep in replicas], float)
            dbr.append((t.max() - t).sum() / (t.max() * len(t)))
            abr.append((a.max() - a).sum() / (a.max() * len(a)))
    assert len(dbr) == 4
    assert plan.metrics["DBR"] == pytest.approx(np.mean(dbr))
    assert plan.metrics["ABR"] == pytest.approx(np.mean(abr))
    assert plan.metrics["AveT"] == pytest.approx(sum(lengths) / (len(d["steps"]) * 2))  # paper: per iteration


def test_empty_pack_counts_as_zero_cost():
    plan = make([8], [[0], []], [(0, [0, 1])], [GroupSpec(8, 1)], 2)
    assert plan.metrics["ABR"] == pytest.approx(0.5)
    assert plan.metrics["DBR"] == pytest.approx(0.5)
    assert plan.metrics["empty_packs"] == 1
    assert plan.metrics["PR"] == pytest.approx(1 - 8 / (2 * 8))  # the empty pack's capacity is padding too


def test_validate_rejects_broken_plans():
    with pytest.raises(ValueError, match="appears 2 times"):
        make([4, 4], [[0, 0], [1]], [(0, [0, 1])], [GroupSpec(8, 1)], 2)
    with pytest.raises(ValueError, match="tokens > pack_len"):
        make([6, 4], [[0, 1], []], [(0, [0, 1])], [GroupSpec(8, 1)], 2)
    with pytest.raises(ValueError, match="tokens > pack_len"):  # one token over
        make([5, 4], [[0, 1], []], [(0, [0, 1])], [GroupSpec(8, 1)], 2)
    with pytest.raises(ValueError, match="multiple of its replica count"):
        make([4, 4, 4], [[0], [1], [2]], [(0, [0, 1, 2])], [GroupSpec(8, 1)], 2)
