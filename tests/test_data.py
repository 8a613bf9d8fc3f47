"""The packed-shard loader: per-sample label shift, sample ids, this rank's packs for a step, the step's global
counts from metadata, empty packs, and one-line errors for shards that do not fit the run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from hbp_train.batches.collate import collate_pack, empty_micro_batch
from hbp_train.batches.loader import DataConfig, PackedData
from hbp_train.model.ulysses import split_for_sp
from hbp_train.common.errors import UserError
from hbp_train.common.labels import IGNORE_INDEX
from tests.assets.packed_fixture import TWO_RANK_STEPS, loss_tokens, synthetic_samples, write_packed

SAMPLES = synthetic_samples(14, 100, seed=5)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_packed(str(tmp_path_factory.mktemp("packed")), SAMPLES, TWO_RANK_STEPS, world_size=2)


def test_collate_shifts_inside_each_sample():
    a_ids, a_lab = [5, 6, 7, 8], [-100, -100, 7, 8]
    b_ids, b_lab = [9, 10, 11], [-100, 10, 11]
    batch = collate_pack({"input_ids": a_ids + b_ids, "labels": a_lab + b_lab, "position_ids": [0, 1, 2, 3, 0, 1, 2],
                          "cu_seqlens": [0, 4, 7], "num_loss_tokens": 4})
    assert batch["shift_labels"].tolist() == [[-100, 7, 8, IGNORE_INDEX, 10, 11, IGNORE_INDEX]]
    assert batch["sample_ids"].tolist() == [[0, 0, 0, 0, 1, 1, 1]]
    assert batch["sample_loss_tokens"].tolist() == [[2, 2, 2, 2, 2, 2, 2]]
    assert batch["num_loss_tokens"] == 4 and batch["num_samples"] == 2 and batch["max_seqlen"] == 4
    assert batch["cu_seqlens"].dtype == torch.int32 and batch["input_ids"].shape == (1, 7)
    with pytest.raises(UserError, match="num_loss_tokens=5"):
        collate_pack({"input_ids": a_ids, "labels": a_lab, "position_ids": [0, 1, 2, 3], "cu_seqlens": [0, 4],
                      "num_loss_tokens": 5}, where="x")


def test_collate_trains_a_samples_first_label_only_inside_it():
    # Sample b has no prompt: its first label is a real token. The last token of a must still not predict it, and
    # the per-sample counts must come from the shifted labels. Reference: each sample shifted on its own.
    a_ids, a_lab = [5, 6, 7, 8], [-100, -100, 7, 8]
    b_ids, b_lab = [9, 10, 11], [9, 10, 11]
    batch = collate_pack({"input_ids": a_ids + b_ids, "labels": a_lab + b_lab, "position_ids": [0, 1, 2, 3, 0, 1, 2],
                          "cu_seqlens": [0, 4, 7]}, check_counts=False)
    per_sample = [lab[1:] + [IGNORE_INDEX] for lab in (a_lab, b_lab)]
    assert batch["shift_labels"].tolist() == [per_sample[0] + per_sample[1]]
    counts = [sum(x != IGNORE_INDEX for x in lab) for lab in per_sample]
    assert batch["sample_loss_tokens"].tolist() == [[counts[0]] * 4 + [counts[1]] * 3]
    assert batch["num_loss_tokens"] == sum(counts)


def test_step_batches_follow_the_plan(shards):
    data = PackedData(shards)
    assert data.num_steps == 3 and data.world_size == 2 and data.sp_degrees() == [1]
    for step, entry in enumerate(TWO_RANK_STEPS):
        all_samples = [i for replica in entry["replicas"] for pack in replica for i in pack]
        global_tokens = sum(loss_tokens(SAMPLES[i][1]) for i in all_samples)
        for rank in range(2):
            sb = data.step_batch(step, rank)
            packs = entry["replicas"][rank]
            assert sb.replica == rank and len(sb.micro_batches) == len(packs) and sb.dp_size == 2
            assert sb.global_loss_tokens == global_tokens and sb.global_num_samples == len(all_samples)
            assert sb.rank_num_samples == sum(len(p) for p in packs)
            assert sb.rank_loss_tokens == sum(loss_tokens(SAMPLES[i][1]) for p in packs for i in p)
            for pack, mb in zip(packs, sb.micro_batches):
                expected_ids = [t for i in pack for t in SAMPLES[i][0]]
                if not pack:  # an empty pack becomes a one-token dummy without loss
                    assert mb["num_samples"] == 0 and mb["num_loss_tokens"] == 0 and mb["input_ids"].shape == (1, 1)
                else:
                    assert mb["input_ids"][0].tolist() == expected_ids
                    assert mb["seq_lens"] == [len(SAMPLES[i][0]) for i in pack]
    # Without shuffle_epochs, epochs replay the plan.
    assert data.step_batch(4, 1).plan_step == 1 and data.step_batch(4, 1).step == 4


def test_later_epochs_run_the_steps_in_a_seeded_order(shards):
    shuffled = PackedData(shards, shuffle_epochs=True, seed=3)
    n = shuffled.num_steps
    orders = [[shuffled.plan_step(e * n + i) for i in range(n)] for e in range(6)]
    assert orders[0] == list(range(n))  # the first epoch follows the plan (its curriculum)
    assert all(sorted(o) == list(range(n)) for o in orders)  # every epoch runs every step once
    assert len({tuple(o) for o in orders[1:]}) > 1  # and later epochs are reordered, not one fixed order
    again = PackedData(shards, shuffle_epochs=True, seed=3)  # a resumed run (new process) sees the same order
    assert [again.plan_step(s) for s in range(6 * n)] == [s for o in orders for s in o]
    other = PackedData(shards, shuffle_epochs=True, seed=4)
    assert [other.plan_step(s) for s in range(n, 6 * n)] != [s for o in orders[1:] for s in o]
    # the step's packs follow its plan step, whatever the epoch
    step = 2 * n + 1
    assert shuffled.step_batch(step, 0).plan_step == orders[2][1] and shuffled.step_batch(step, 0).step == step


def test_split_for_sp_is_identity_at_sp1_and_slices_beyond():
    # SP (issue #6): the split itself is tested in tests/test_ulysses.py; here it meets the loader's dummy micro-batch.
    batch = empty_micro_batch()
    same = split_for_sp(batch, 1, 0)
    assert all(same[k] is batch[k] for k in batch) and same["num_local_tokens"] == 1
    halves = [split_for_sp(batch, 2, r) for r in range(2)]  # 1 token + 1 padding token
    assert [h["input_ids"].shape[1] for h in halves] == [1, 1] and [h["num_local_tokens"] for h in halves] == [1, 0]


def test_bad_shards_fail_with_a_message(tmp_path, shards):
    with pytest.raises(UserError, match="no plan.json"):
        PackedData(str(tmp_path))
    tokenized = tmp_path / "tok"  # a preprocess output (report.json) given where packed shards belong
    tokenized.mkdir()
    (tokenized / "report.json").write_text("{}")
    with pytest.raises(UserError, match="it is a tokenized dataset: plan and pack it first"):
        PackedData(str(tokenized))
    plan = json.loads(open(f"{shards}/plan.json").read())
    for step in plan["steps"]:
        del step["rows"]
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(UserError, match="not packed shards"):
        PackedData(str(tmp_path))
    (tmp_path / "plan.json").write_text(json.dumps({**plan, "version": 0}))
    with pytest.raises(UserError, match="plan.json: not a version-1 plan; rewrite the shards"):
        PackedData(str(tmp_path))
    (tmp_path / "plan.json").write_text("{")
    with pytest.raises(UserError, match="plan.json: invalid JSON at line 1"):
        PackedData(str(tmp_path))
    with pytest.raises(UserError, match="data.shards"):
        DataConfig(shards="???")
    with pytest.raises(UserError, match="data.epochs"):
        DataConfig(shards="x", epochs=0)


def test_damaged_or_stale_shards_fail_at_open_naming_the_group(tmp_path, shards):
    import shutil

    truncated = tmp_path / "truncated"
    shutil.copytree(shards, truncated)
    arrow = sorted((truncated / "group_0").glob("*.arrow"))[0]
    arrow.write_bytes(arrow.read_bytes()[:100])
    with pytest.raises(UserError, match=r"group_0: cannot read the packed shard .*rewrite it with data_tools.pack"):
        PackedData(str(truncated))
    stale = tmp_path / "stale"
    shutil.copytree(shards, stale)
    plan = json.loads((stale / "plan.json").read_text())
    plan["steps"][0]["rows"][0][0] = 10_000  # a row the shard does not have: the plan and shards disagree
    (stale / "plan.json").write_text(json.dumps(plan))
    with pytest.raises(UserError, match=r"group_\d+: plan.json reads row 10000 but the shard has \d+ rows"):
        PackedData(str(stale))


def test_reads_the_planner_writer_format(tmp_path):
    """Shards written by hbp_train.batches.shards (the real writer) load the same way."""
    shards_mod = pytest.importorskip("hbp_train.batches.shards")
    from datasets import Dataset

    from hbp_train.planning.plan import Plan

    lengths = np.array([len(s[0]) for s in SAMPLES])
    Dataset.from_dict({"input_ids": [s[0] for s in SAMPLES], "labels": [s[1] for s in SAMPLES],
                       "length": lengths.tolist()}).save_to_disk(str(tmp_path / "tok"))
    plan = Plan.from_dict(_plan_dict(lengths))
    shards_mod.write_shards(plan, tmp_path / "tok", tmp_path / "out", progress=False)
    data = PackedData(str(tmp_path / "out"))
    for step, entry in enumerate(TWO_RANK_STEPS):
        for rank in range(2):
            sb = data.step_batch(step, rank)
            for pack, mb in zip(entry["replicas"][rank], sb.micro_batches):
                assert mb["input_ids"][0].tolist() == ([t for i in pack for t in SAMPLES[i][0]] if pack else [0])
                assert mb["num_loss_tokens"] == sum(loss_tokens(SAMPLES[i][1]) for i in pack)


def _plan_dict(lengths):
    return {"version": 1, "world_size": 2, "strategy": "test", "seed": 0, "max_len": int(lengths.max() * 3),
            "global_tokens": 1000, "groups": [{"pack_len": int(lengths.max() * k), "sp": 1, "ckpt_layers": None} for k in (3, 4)],
            "steps": TWO_RANK_STEPS, "dropped": [], "deferred": [], "num_samples": len(lengths),
            "lengths": lengths.tolist()}


def test_optimizer_steps_that_mix_groups(tmp_path):
    """Plan steps sharing an "optimizer_step" are one StepBatch: the micro-batches of each plan step in turn, tagged
    with its group's sp, group and ckpt_layers; global counts over all; the plan's step metrics combined (ABR over
    the slots); num_steps counts optimizer steps, later epochs permute them whole; token_mean gets one divisor per
    SP group; a plan numbering them out of order is refused in one line."""
    steps = [{"group": 0, "replicas": [[[0, 1], [2]], [[3], [4, 5]]]},  # sp=1: two replicas
             {"group": 1, "replicas": [[[6, 7]]]},                         # sp=2: one replica over both ranks
             {"group": 0, "replicas": [[[8]], [[9, 10]]]}]
    shards = write_packed(str(tmp_path / "p"), SAMPLES, steps, world_size=2)
    with open(f"{shards}/plan.json") as f:
        plan = json.load(f)
    plan["groups"][1].update(sp=2, ckpt_layers=1)
    plan["step_metrics"] = [{"ABR": 0.1, "micro_batches": 2, "tokens": 10}, {"ABR": 0.4, "micro_batches": 1,
                                                                              "tokens": 5}, {"ABR": 0.0}]
    for step, k in zip(plan["steps"], [0, 0, 1]):
        step["optimizer_step"] = k
    with open(f"{shards}/plan.json", "w") as f:
        json.dump(plan, f)
    data = PackedData(shards, shuffle_epochs=True, seed=3)
    assert data.num_steps == 2 and data.num_plan_steps == 3 and list(data.plan_steps_of(0)) == [0, 1]
    lt = {i: loss_tokens(SAMPLES[i][1]) for i in range(11)}
    for rank in (0, 1):
        batch = data.step_batch(0, rank)
        assert [(mb["group"], mb["sp"], mb["ckpt_layers"]) for mb in batch.micro_batches] == \
            [(0, 1, None), (0, 1, None), (1, 2, 1)]
        assert batch.global_loss_tokens == sum(lt[i] for i in range(8))
        assert batch.global_num_samples == 8 and batch.num_packs == 4 + 1
        assert batch.capacity_tokens == 4 * plan["groups"][0]["pack_len"] + plan["groups"][1]["pack_len"]
        assert batch.plan_metrics["ABR"] == pytest.approx((2 * 0.1 + 0.4) / 3) and batch.plan_metrics["tokens"] == 15
        # token_mean: rank r counts its own sp=1 packs and the sp=2 pack; the sp=2 pack's divisor is shared
        own = [lt[0] + lt[1] + lt[2], lt[3] + lt[4] + lt[5]]
        shared = lt[6] + lt[7]
        counts = [own[0] + shared, own[1] + shared]
        assert [mb["rank_loss_tokens"] for mb in batch.micro_batches[:2]] == pytest.approx([counts[rank]] * 2)
        assert batch.micro_batches[2]["rank_loss_tokens"] == pytest.approx(2 / (1 / counts[0] + 1 / counts[1]))
    single = data.step_batch(1, 0)
    assert [mb["sp"] for mb in single.micro_batches] == [1] and "rank_loss_tokens" not in single.micro_batches[0]
    later = sorted(data.plan_step(s) for s in range(2, 4))
    assert later == [0, 1]  # epoch 2 runs both optimizer steps once
    for step, k in zip(plan["steps"], [0, 2, 2]):
        step["optimizer_step"] = k
    with open(f"{shards}/plan.json", "w") as f:
        json.dump(plan, f)
    with pytest.raises(UserError, match="optimizer_step must count 0, 1, 2"):
        PackedData(shards)


@pytest.mark.parametrize("plan_format", ["json", "npz"])
def test_max_micro_batches_is_the_longest_step_of_a_replica(tmp_path, plan_format):
    """The most packs a replica runs in one optimizer step (empty packs count: every replica runs the step's
    largest count), from plan.json or the memory-mapped plan.npz: 2 for TWO_RANK_STEPS, 1 for a plan of one pack
    per replica per step; plan steps that share an optimizer step add up."""
    from datasets import Dataset

    from hbp_train.planning.plan import Plan
    from hbp_train.batches.shards import write_shards

    lengths = np.array([len(s[0]) for s in SAMPLES])
    Dataset.from_dict({"input_ids": [s[0] for s in SAMPLES], "labels": [s[1] for s in SAMPLES],
                       "length": lengths.tolist()}).save_to_disk(str(tmp_path / "tok"))
    single = [{"group": 0, "replicas": [[[2 * s]], [[2 * s + 1]]]} for s in range(7)]
    for name, steps, want in (("two", TWO_RANK_STEPS, 2), ("single", single, 1)):
        plan = Plan.from_dict({**_plan_dict(lengths), "steps": steps})
        write_shards(plan, tmp_path / "tok", tmp_path / name, progress=False, plan_format=plan_format)
        assert PackedData(str(tmp_path / name)).max_micro_batches() == want, name
    mixed = [{**step, "optimizer_step": k} for step, k in zip(TWO_RANK_STEPS, [0, 0, 1])]
    assert PackedData(write_packed(str(tmp_path / "mixed"), SAMPLES, mixed, world_size=2)).max_micro_batches() == 3
