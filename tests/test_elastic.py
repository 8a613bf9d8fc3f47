"""Resume on another number of ranks: the re-plan of the untrained samples (planning/replan.py), their re-pack from
the run's packed shards, the re-plan's step numbering, the sample ledger, and, with a real DeepSpeed engine on gloo,
a 2-rank run stopped mid-epoch and resumed on 1 and on 4 ranks (universal checkpoint: the Adam moments, the step
count and the LR carried; the ledger shows every sample of every epoch trained exactly once)."""

from __future__ import annotations

import json
import os
import shutil

import datasets
import numpy as np
import pytest
import torch

from data_tools.pack import main as pack
from hbp_train.batches.replanned import ReplannedData
from hbp_train.batches.shards import write_shards_from_packed
from hbp_train.common.errors import UserError
from hbp_train.planning import PlanConfig, make_plan
from hbp_train.planning.plan_npz import load_plan
from hbp_train.planning.replan import TRAINED, replan
from hbp_train.runtime.ledger import SampleLedger
from tests.assets.packed_fixture import TINY_LLAMA
from tests.distributed import run_distributed

NUM_SAMPLES = 48
GROUPS = [{"pack_len": 64, "sp": 1}, {"pack_len": 256, "sp": 2}]


def _trained_by_first_steps(plan, steps: int) -> np.ndarray:
    """The samples of the plan's first ``steps`` optimizer steps (what a run stopped there has trained)."""
    plan_steps = np.flatnonzero(plan.optimizer_steps() < steps)
    packs = np.concatenate([plan.step_packs[plan.step_ptr[s]:plan.step_ptr[s + 1]] for s in plan_steps])
    return np.concatenate([plan.pack(p) for p in packs])


@pytest.mark.parametrize("strategy", ["hbp", "isf", "bfd", "sorted", "wlb", "kk", "bytescale"])
def test_replan_plans_the_untrained_samples_once_with_the_plans_own_strategy(strategy):
    rng = np.random.default_rng(0)
    lengths = np.r_[rng.integers(5, 60, 300), rng.integers(100, 250, 20), [400]]  # the last is too long: dropped
    cfg = PlanConfig(world_size=2, groups=GROUPS, strategy=strategy, global_tokens=1500, seed=3,
                     step_mix="stratified", balance="sort")
    plan = make_plan(lengths, cfg)
    total, done = plan.num_optimizer_steps, plan.num_optimizer_steps // 3
    trained = _trained_by_first_steps(plan, done)
    rest, head_steps = replan(plan, trained, 4, done)
    rest.validate()  # the plan contract: every sample once, in a pack or dropped
    assert head_steps == 0
    assert sorted(rest.pack_samples.tolist()) == sorted(set(plan.pack_samples.tolist()) - set(trained.tolist()))
    reasons = dict(zip(rest.dropped.tolist(), rest.dropped_reason))
    assert {i for i, r in reasons.items() if r == TRAINED} == set(trained.tolist())
    assert reasons[len(lengths) - 1] == "longer_than_max_pack_len"  # the original plan's drop, its reason kept
    # The plan's own strategy and settings, at the new world size; the epoch keeps its length (the LR schedule's).
    assert (rest.config.strategy, rest.config.world_size, rest.config.step_mix, rest.config.balance) == \
        (strategy, 4, "stratified", "sort")
    assert rest.config.groups == plan.config.groups
    assert rest.num_optimizer_steps == total - done
    assert bool(rest.extra.get("unequal_micro_batches")) == (strategy == "bytescale")
    # With more epochs to come: a whole epoch, the trained samples first (the head), then the rest.
    whole, head_steps = replan(plan, trained, 4, done, with_head=True)
    assert head_steps == done and whole.num_optimizer_steps == total
    assert sorted(whole.pack_samples.tolist()) == sorted(plan.pack_samples.tolist())
    assert sorted(_trained_by_first_steps(whole, head_steps).tolist()) == sorted(trained.tolist())


def test_replan_refuses_only_what_cannot_run_in_one_line():
    lengths = np.random.default_rng(1).integers(5, 200, 100)
    plan = make_plan(lengths, PlanConfig(world_size=2, groups=GROUPS, global_tokens=2000))
    replan(plan, [], 8)  # more ranks: fine; the sp=2 group has 4 replicas
    with pytest.raises(UserError, match=r"^the plan's group of pack_len 256 runs at SP degree 2, which cannot run on "
                                        r"1 rank .*: resume on a multiple of 2 ranks, or re-pack with smaller SP"):
        replan(plan, [], 1)
    with pytest.raises(UserError, match="names sample 100, which the plan's 100 samples do not have"):
        replan(plan, [100], 4)


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory):
    """48 samples of 8..59 tokens, a prompt (not trained) then an answer."""
    rng = np.random.default_rng(0)
    rows = {"input_ids": [], "labels": [], "length": []}
    for n in rng.integers(8, 60, NUM_SAMPLES):
        ids = rng.integers(3, 4000, n).astype(np.int32)
        rows["input_ids"].append(ids.tolist())
        rows["labels"].append(np.where(np.arange(n) >= n // 3, ids, -100).tolist())
        rows["length"].append(int(n))
    path = tmp_path_factory.mktemp("elastic") / "tok"
    datasets.Dataset.from_dict(rows).save_to_disk(str(path), num_shards=2)
    return path, rows


def _pack(tokenized, out, world_size, *extra) -> str:
    assert pack(["--dataset", str(tokenized[0]), "--shards", str(out), "--world-size", str(world_size),
                 "--groups", "64:1,128:1", "--global-tokens", "256", "--quiet", "--no-baseline", *extra]) == 0
    return str(out)


@pytest.mark.parametrize("plan_format", ["json", "npz"])
def test_the_re_plan_is_packed_from_the_runs_own_shards_and_numbered_after_the_resumed_step(tokenized, tmp_path,
                                                                                             plan_format):
    src = _pack(tokenized, tmp_path / "packed2", 2, "--plan-format", plan_format)
    plan = load_plan(f"{src}/plan.{plan_format}")
    trained = _trained_by_first_steps(plan, 2)
    whole, head_steps = replan(plan, trained, 4, 2, with_head=True)
    write_shards_from_packed(whole, src, tmp_path / "re4", plan_format=plan_format)
    # Every row is its samples' tokens and labels, as the tokenized dataset has them.
    rows = tokenized[1]
    seen = []
    for gdir in sorted((tmp_path / "re4").glob("group_*")):
        for row in datasets.load_from_disk(str(gdir)):
            assert row["input_ids"] == [t for i in row["sample_indices"] for t in rows["input_ids"][i]]
            assert row["labels"] == [t for i in row["sample_indices"] for t in rows["labels"][i]]
            seen += row["sample_indices"]
    assert sorted(seen) == list(range(NUM_SAMPLES))
    # Resumed at global step 2 of epoch 0, two epochs: the rest in plan order, then whole epochs.
    data = ReplannedData(str(tmp_path / "re4"), start=2, epoch=0, shuffle_epochs=True, seed=5)
    assert data.world_size == 4 and data.head_steps == head_steps == 2 and data.rest_steps == data.num_steps - 2
    end = data.run_steps(2)
    assert end == 2 + data.rest_steps + data.num_steps
    consumed = {0: list(trained)}
    for step in range(2, end):
        consumed.setdefault(data.epoch_of(step), []).extend(data.step_samples(data.plan_step(step)).tolist())
    assert sorted(consumed[0]) == sorted(consumed[1]) == list(range(NUM_SAMPLES))  # each sample once an epoch
    assert ReplannedData(str(tmp_path / "re4"), start=end, epoch=2).run_steps(2) == end  # the run had ended
    assert [data.plan_step(s) for s in range(2, 2 + data.rest_steps)] == list(range(2, data.num_steps))
    # A stale source (a sample's length changed) is refused in one line naming the group.
    broken = load_plan(f"{src}/plan.{plan_format}")
    broken.lengths = broken.lengths.copy()
    broken.lengths[0] += 1
    with pytest.raises(UserError, match=r"group_0: its rows' samples do not have the lengths the plan gives them"):
        write_shards_from_packed(broken, src, tmp_path / "stale")


def test_ledger_round_trip(tmp_path):
    ledger = SampleLedger()
    ledger.record(0, 0, [3, 1])
    ledger.record(1, 0, [0, 2], skipped=True)
    ledger.record(2, 1, [1, 0, 2, 3])
    with open(tmp_path / "ledger.npz", "wb") as f:
        ledger.save(f)
    back = SampleLedger.load(str(tmp_path))
    assert {k: v.tolist() for k, v in back.arrays().items()} == {k: v.tolist() for k, v in ledger.arrays().items()}
    assert back.counts(4, 0).tolist() == back.counts(4, 1).tolist() == [1, 1, 1, 1]
    assert back.epoch_steps(0) == 2 and SampleLedger.load(str(tmp_path / "none")) is None
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "ledger.npz").write_bytes(b"not a zip")
    with pytest.raises(UserError, match="ledger.npz: not a sample ledger"):
        SampleLedger.load(str(tmp_path / "bad"))


def _overrides(shards, out, stage, *extra) -> list:
    model_cfg = json.dumps(TINY_LLAMA).replace('"', "").replace(" ", "")
    return ["experiment=cpu_demo", f"data.shards={shards}", f"train.out_dir={out}", "logging=quiet",
            f"model.config={model_cfg}", "train.warmup_steps=2", "train.lr=1e-2", f"deepspeed.zero_stage={stage}",
            *extra]


def _optimizer_view(engine) -> dict:
    """One parameter's Adam moments (exp_avg, exp_avg_sq) and fp32 weight, gathered whole (collective), and the
    schedule's position."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    param = dict(engine.module.named_parameters())["model.model.layers.0.mlp.up_proj.weight"]
    return {"exp_avg": safe_get_full_optimizer_state(param, "exp_avg").clone(),
            "exp_avg_sq": safe_get_full_optimizer_state(param, "exp_avg_sq").clone(),
            "weight": safe_get_full_fp32_param(param).clone(), "lr": engine.get_lr()[0],
            "global_steps": engine.global_steps, "iteration": engine.lr_scheduler.last_batch_iteration}


def _elastic_worker(rank, world_size, shards, out, stage, extra):
    """trainer.train with the optimizer state caught where it is saved and where it is loaded."""
    from hbp_train import config, trainer
    from hbp_train.distributed.groups import init_distributed
    from hbp_train.runtime import checkpoint

    init_distributed()
    seen = {"saved": [], "loaded": []}
    real_save, real_load = checkpoint.save, checkpoint.load

    def save(engine, *args, **kwargs):
        seen["saved"].append(_optimizer_view(engine))
        return real_save(engine, *args, **kwargs)

    def load(engine, ckpt_root, tag, engine_state=None, saved_world_size=None):
        resumed = real_load(engine, ckpt_root, tag, engine_state, saved_world_size)
        if engine_state is not None:  # a universal checkpoint (DeepSpeed links the fragments it gathers only then)
            seen["loaded"].append(_optimizer_view(engine))
        return resumed

    checkpoint.save, checkpoint.load = save, load
    try:
        result = trainer.train(config.load(_overrides(shards, out, stage, *extra)))
    finally:
        checkpoint.save, checkpoint.load = real_save, real_load
    return {**seen, "start": result["start_step"], "end": result["end_step"], "total": result["run"].total_steps}


def _final_ledger(out) -> SampleLedger:
    root = os.path.join(out, "checkpoints")
    with open(os.path.join(root, "latest")) as f:
        return SampleLedger.load(os.path.join(root, f.read().strip()))


@pytest.mark.slow
@pytest.mark.parametrize("stage", [2, *(pytest.param(s, marks=pytest.mark.full) for s in (1, 3))])
def test_a_two_rank_run_resumes_on_one_and_four_ranks_with_its_optimizer_state(tokenized, tmp_path, stage):
    shards = _pack(tokenized, tmp_path / "packed2", 2)
    out1, out4 = str(tmp_path / "run"), str(tmp_path / "run4")
    # Two epochs of 6 steps planned for 2 ranks, stopped after 2 steps (mid-epoch) with a checkpoint.
    first = run_distributed(_elastic_worker, 2, shards, out1, stage, ["data.epochs=2", "train.exit_after_steps=2"])
    saved = first[0]["saved"][-1]
    assert first[0]["end"] == 2 and first[0]["total"] == 12
    shutil.copytree(out1, out4)
    # On 1 rank, both epochs (the re-plan is then a whole epoch: the trained samples first); in the full tier
    # stopped once more mid-epoch and resumed on 1 rank again (the re-plan opened again from its record, as in
    # test_a_re_planned_run_resumed_on_as_many_ranks_reopens_its_re_plan). On 4 ranks, one epoch.
    chain = stage == 3
    on1 = run_distributed(_elastic_worker, 1, shards, out1, stage,
                          ["data.epochs=2", "train.resume=auto", *(["train.exit_after_steps=3"] if chain else [])])
    if chain:
        again = run_distributed(_elastic_worker, 1, shards, out1, stage, ["data.epochs=2", "train.resume=auto"])
        assert (on1[0]["end"], again[0]["start"], again[0]["end"], again[0]["total"]) == (5, 5, 12, 12)
        assert again[0]["loaded"] == []  # the same world size: DeepSpeed's own load of the checkpoint as saved
    else:
        assert on1[0]["end"] == 12
    # The 4-rank run also logs a held-out loss on shards planned for 2 ranks: they are re-planned whole for 4.
    on4 = run_distributed(_elastic_worker, 4, shards, out4, stage, ["train.resume=auto", f"data.eval_shards={shards}"])
    for result in on1 + on4:
        loaded = result["loaded"][0]
        # both Adam moments, gathered, are the saved ones (and were trained: not the zeros of a fresh optimizer)
        assert torch.equal(loaded["exp_avg"], saved["exp_avg"]) and saved["exp_avg"].abs().sum() > 0
        assert torch.equal(loaded["exp_avg_sq"], saved["exp_avg_sq"]) and saved["exp_avg_sq"].abs().sum() > 0
        assert torch.equal(loaded["weight"], saved["weight"])
        assert loaded["lr"] == saved["lr"] and loaded["global_steps"] == loaded["iteration"] == 2
        assert result["start"] == 2
    assert on1[0]["total"] == 12 and on4[0]["end"] == on4[0]["total"] == 6
    # The ledgers: the 2 steps run on 2 ranks, then every step once, and every sample once in every epoch.
    for out, epochs, total in ((out1, 2, 12), (out4, 1, 6)):
        ledger = _final_ledger(out)
        assert ledger.arrays()["step"].tolist() == list(range(total))
        for epoch in range(epochs):
            assert ledger.counts(NUM_SAMPLES, epoch).tolist() == [1] * NUM_SAMPLES
    before = SampleLedger.load(os.path.join(out4, "checkpoints", "step_00000002"))
    assert before.arrays()["samples"].tolist() == _final_ledger(out4).arrays()["samples"][:len(before.arrays()[
        "samples"])].tolist()
    held_out = json.loads(open(os.path.join(out4, "elastic", "step_00000002", "world4", "eval", "plan.json")).read())
    assert held_out["world_size"] == 4 and held_out["replanned"]["trained"] == 0
    with open(os.path.join(out4, "metrics.jsonl")) as f:
        assert np.isfinite([json.loads(line) for line in f][-1]["loss/eval"])
    # The universal copy is gone once loaded; the re-planned shards stay for the checkpoints that train from them.
    assert not os.path.exists(os.path.join(out4, "elastic", "step_00000002", "universal"))
    assert os.path.isfile(os.path.join(out4, "elastic", "step_00000002", "world4", "shards", "plan.json"))


def test_a_checkpoint_whose_groups_cannot_exist_on_the_new_world_size_is_refused_before_building(tokenized, tmp_path,
                                                                                                monkeypatch):
    from hbp_train import config, trainer
    from hbp_train.runtime import checkpoint, manifest

    shards = str(tmp_path / "packed2")
    assert pack(["--dataset", str(tokenized[0]), "--shards", shards, "--world-size", "2", "--groups", "64:1,128:2",
                 "--global-tokens", "256", "--quiet", "--no-baseline"]) == 0
    monkeypatch.setattr(trainer, "build", lambda *a, **k: pytest.fail("built before refusing the resume"))
    tag_dir = tmp_path / "run" / "checkpoints" / checkpoint.tag_for(2)
    tag_dir.mkdir(parents=True)
    (tag_dir.parent / "latest").write_text(checkpoint.tag_for(2))
    (tag_dir / "resume.json").write_text(json.dumps({"next_step": 2, "world_size": 2, "data_shards": shards,
                                                     "plan_sha256": checkpoint.plan_fingerprint(shards), "epoch": 0}))
    for r in range(2):
        torch.save(checkpoint.rng_state(), tag_dir / f"rng_rank{r}.pt")
    with open(tag_dir / "ledger.npz", "wb") as f:
        SampleLedger().save(f)
    manifest.write(str(tag_dir), 2, 2)
    cfg = config.load(_overrides(shards, str(tmp_path / "run"), 2, "train.resume=auto"))
    with pytest.raises(UserError, match=r"^train.resume=auto: cannot resume on 1 rank from .*step_00000002: the "
                                        r"plan's group of pack_len 128 runs at SP degree 2, which cannot run on 1 "
                                        r"rank .*resume on a multiple of 2 ranks"):
        trainer.train(cfg)
    assert not (tmp_path / "run" / "elastic" / "step_00000002" / "universal").exists()  # refused before converting


def test_a_re_planned_run_resumed_on_as_many_ranks_reopens_its_re_plan(tokenized, tmp_path):
    """A checkpoint of a run that trains a re-plan records it; a resume on the same number of ranks opens it again
    at the same place (no new re-plan, no conversion), and refuses in one line when it is gone."""
    from hbp_train import config
    from hbp_train.runtime import checkpoint, elastic

    shards = _pack(tokenized, tmp_path / "packed2", 2)
    plan = load_plan(f"{shards}/plan.json")
    whole, _ = replan(plan, _trained_by_first_steps(plan, 2), 1, 2, with_head=True)
    replanned = str(tmp_path / "run" / "elastic" / "step_00000002" / "world1" / "shards")
    write_shards_from_packed(whole, shards, replanned)
    cfg = config.load(_overrides(shards, str(tmp_path / "run"), 2, "data.epochs=2"))
    data = ReplannedData(replanned, start=2, epoch=0, shuffle_epochs=cfg.data.shuffle_epochs, seed=cfg.train.seed)
    run = type("Run", (), {"data": data, "eval_data": None, "cfg": cfg})()
    saved = {"next_step": 5, "world_size": 1, **elastic.record(run, 5)}
    assert saved["replan"] == {"shards": replanned, "start": 2, "epoch": 0} and saved["epoch"] == 0
    root = str(tmp_path / "run" / "checkpoints")
    source = elastic.prepare(cfg, root, checkpoint.tag_for(5), saved, 1)
    assert source.universal is None and source.messages == []
    assert [source.data.plan_step(s) for s in range(5, 12)] == [data.plan_step(s) for s in range(5, 12)]
    assert source.data.run_steps(2) == data.run_steps(2)
    shutil.rmtree(replanned)
    with pytest.raises(UserError, match=r"the re-planned shards this checkpoint trained from, .*world1/shards, are "
                                        r"gone: resume from the checkpoint the re-plan was made for"):
        elastic.prepare(cfg, root, checkpoint.tag_for(5), saved, 1)
