"""Packed shards round trip: rows equal the concatenated samples, positions restart, cu_seqlens and loss counts
are right, and plan.json's rows point at the right packs."""

from __future__ import annotations

import json

import datasets
import numpy as np
import pytest

from data_tools.pack import main
from hbp_train.batches import shards


@pytest.fixture()
def tokenized(tmp_path):
    rng = np.random.default_rng(1)
    lengths = np.r_[rng.integers(1, 40, 60), rng.integers(70, 200, 6), [300]]
    rows = {"input_ids": [], "labels": [], "length": [], "num_loss_tokens": [], "source": []}
    for i, n in enumerate(lengths):
        ids = rng.integers(0, 1000, n).astype(np.int32)
        labels = np.where(rng.random(n) < 0.5, ids, -100).astype(np.int32)
        rows["input_ids"].append(ids.tolist())
        rows["labels"].append(labels.tolist())
        rows["length"].append(int(n))
        rows["num_loss_tokens"].append(max(1, int(np.count_nonzero(labels[1:] != -100))))
        rows["source"].append(f"test:{i}")
    path = tmp_path / "tok"
    datasets.Dataset.from_dict(rows).save_to_disk(str(path), num_shards=2)
    return path, rows


# 128 replicas of one sp=1 group outnumber the 66 samples: the only step needs empty packs. A 100-token chunk makes
# the writer take its rows from the dataset's two files in many small batches.
@pytest.mark.parametrize("world_size,groups,chunk_tokens", [(4, "64:1,256:2", None), (128, "64:1,256:1", None),
                                                            (4, "64:1,256:2", 100)])
def test_shards_round_trip(tmp_path, tokenized, capsys, monkeypatch, world_size, groups, chunk_tokens):
    src, rows = tokenized
    if chunk_tokens:
        monkeypatch.setattr(shards, "CHUNK_TOKENS", chunk_tokens)
    out = tmp_path / "packed"
    argv = ["--dataset", str(src), "--shards", str(out), "--world-size", str(world_size), "--groups", groups,
            "--global-tokens", "512", "--quiet"]
    assert main(argv) == 0
    plan = json.loads((out / "plan.json").read_text())
    assert plan["dropped"] == [{"index": len(rows["length"]) - 1, "reason": "longer_than_max_pack_len"}]
    groups = {g: datasets.load_from_disk(str(out / f"group_{g}")) for g in {s["group"] for s in plan["steps"]}}
    seen = []
    for step in plan["steps"]:
        ds = groups[step["group"]]
        assert len(step["rows"]) == len(step["replicas"])
        for packs, row_ids in zip(step["replicas"], step["rows"]):
            assert len(packs) == len(row_ids)
            for pack, row_id in zip(packs, row_ids):
                row = ds[row_id]
                assert row["sample_indices"] == pack
                seen.extend(pack)
                assert row["input_ids"] == [t for i in pack for t in rows["input_ids"][i]]
                assert row["labels"] == [t for i in pack for t in rows["labels"][i]]
                assert row["position_ids"] == [p for i in pack for p in range(rows["length"][i])]
                assert row["cu_seqlens"] == np.r_[0, np.cumsum([rows["length"][i] for i in pack])].tolist()
                # Targets after the per-sample shift: a sample's first label never counts.
                want = sum(int(np.count_nonzero(np.asarray(rows["labels"][i][1:]) != -100)) for i in pack)
                assert row["num_loss_tokens"] == want
    assert sorted(seen) == list(range(len(rows["length"]) - 1))
    assert (plan["empty_packs"] > 0) == (world_size == 128)
    assert sum(len(ds) for ds in groups.values()) == sum(len(r) * len(r[0]) for s in plan["steps"] for r in [s["replicas"]])


def test_shards_reject_mismatched_dataset(tmp_path, tokenized, capsys):
    src, _ = tokenized
    bad = tmp_path / "notads"
    bad.mkdir()
    assert main(["--dataset", str(bad), "--shards", str(tmp_path / "o"), "--world-size", "2", "--groups",
                 "256:1", "--quiet"]) == 2
    assert "state.json" in capsys.readouterr().err


def test_shards_refuse_a_foreign_folder_and_replace_an_earlier_output(tmp_path, tokenized, capsys):
    src, _ = tokenized
    common = ["--dataset", str(src), "--world-size", "2", "--global-tokens", "512", "--quiet"]
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    for target in (foreign, src):  # a folder of other files, or the tokenized dataset itself
        assert main(common + ["--groups", "64:1,512:2", "--shards", str(target)]) == 2
        err = capsys.readouterr().err
        assert f"--shards {target}: directory is not empty" in err and len(err.strip().splitlines()) == 1
    assert sorted(p.name for p in foreign.iterdir()) == ["notes.txt"]
    out = tmp_path / "packed"
    assert main(common + ["--groups", "64:1,512:2", "--shards", str(out)]) == 0
    assert main(common + ["--groups", "512:1", "--shards", str(out)]) == 0  # a re-plan with one group
    captured = capsys.readouterr()
    assert "Saving the dataset" not in captured.err  # --quiet also silences datasets' bars
    assert sorted(p.name for p in out.iterdir()) == ["checksums.json", "group_0", "plan.json"]  # no old group_1
    (out / "notes.txt").write_text("keep me")  # a re-pack replaces the whole folder: refused, not deleted
    assert main(common + ["--groups", "512:1", "--shards", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--shards {out}: holds notes.txt, which is not part of the packed shards" in err
    assert (out / "notes.txt").read_text() == "keep me"


def _tree(folder):
    """{relative path: bytes} of every file below ``folder``."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_interrupted_repack_keeps_the_earlier_shards_whole(tmp_path, tokenized, capsys, monkeypatch):
    """Ctrl-C after the first group of a re-pack was saved: exit 130 with one line, and OUT is still exactly the
    earlier set (it used to hold the new group_0 beside the old plan.json, which the trainer read as one set)."""
    src, _ = tokenized
    out = tmp_path / "packed"
    common = ["--dataset", str(src), "--world-size", "2", "--global-tokens", "512", "--quiet", "--shards", str(out)]
    assert main(common + ["--groups", "64:1,512:2"]) == 0
    before = _tree(out)
    capsys.readouterr()
    save = datasets.Dataset.save_to_disk
    calls = []

    def save_then_interrupt(self, path, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return save(self, path, **kwargs)

    monkeypatch.setattr(datasets.Dataset, "save_to_disk", save_then_interrupt)
    assert main(common + ["--groups", "64:1,512:2", "--seed", "1"]) == 130
    err = capsys.readouterr().err
    assert err.splitlines() == [err.strip()] and err.startswith("pack: interrupted; ")
    assert len(calls) == 2 and _tree(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["packed", "tok"]  # no staging folder left beside it
    monkeypatch.setattr(datasets.Dataset, "save_to_disk", save)
    assert main(common + ["--groups", "64:1,512:2", "--seed", "1"]) == 0  # a complete re-pack replaces it
    assert json.loads((out / "plan.json").read_text())["seed"] == 1 and _tree(out) != before


@pytest.mark.parametrize("strategy", ["hbp", "bfd", "bytescale"])
def test_binary_plan_shards_load_like_json_ones(tmp_path, tokenized, strategy):
    """--plan-format npz writes OUT/plan.npz; the loader memory-maps it and serves every rank of every step the
    same micro-batches, counts and step metrics as from the same shards with plan.json (bytescale: unequal
    micro-batch counts)."""
    import torch

    from hbp_train.runtime.checkpoint import plan_fingerprint
    from hbp_train.batches.loader import PackedData

    src, _ = tokenized
    common = ["--dataset", str(src), "--world-size", "4", "--groups", "64:1,256:2", "--global-tokens", "512",
              "--quiet", "--strategy", strategy]
    assert main(common + ["--shards", str(tmp_path / "j")]) == 0
    assert main(common + ["--shards", str(tmp_path / "b"), "--plan-format", "npz"]) == 0
    assert (tmp_path / "b" / "plan.npz").is_file() and not (tmp_path / "b" / "plan.json").exists()
    a, b = PackedData(str(tmp_path / "j")), PackedData(str(tmp_path / "b"))
    assert b._npz is not None and isinstance(b._npz["pack_samples"], np.memmap)
    assert (a.num_steps, a.world_size, a.sp_degrees()) == (b.num_steps, b.world_size, b.sp_degrees())
    assert b.plan.get("unequal_micro_batches", False) == (strategy == "bytescale")
    assert a.num_plan_steps == b.num_plan_steps
    for step in range(a.num_plan_steps):
        assert a._step_entry(step) == b._step_entry(step)
    for step in range(a.num_steps):
        for rank in range(4):
            x, y = a.step_batch(step, rank), b.step_batch(step, rank)
            assert (x.group, x.sp, x.global_loss_tokens, x.global_num_samples, x.rank_loss_tokens) == \
                (y.group, y.sp, y.global_loss_tokens, y.global_num_samples, y.rank_loss_tokens)
            assert x.plan_metrics == pytest.approx(y.plan_metrics)
            assert len(x.micro_batches) == len(y.micro_batches)
            for mx, my in zip(x.micro_batches, y.micro_batches):
                assert torch.equal(mx["input_ids"], my["input_ids"]) and mx["num_samples"] == my["num_samples"]
    assert plan_fingerprint(str(tmp_path / "b")) != plan_fingerprint(str(tmp_path / "j"))
    assert main(common + ["--shards", str(tmp_path / "b")]) == 0  # an earlier binary output is replaced
    assert (tmp_path / "b" / "plan.json").is_file() and not (tmp_path / "b" / "plan.npz").exists()


@pytest.mark.parametrize("plan_format,step_mix_method", [("json", "sorted"), ("npz", "sorted"), ("json", "mixed"),
                                                          ("npz", "mixed")])
def test_live_length_mix_of_packed_shards_is_the_plans(tmp_path, tokenized, plan_format, step_mix_method):
    """telemetry.StepLengthMix over the loader (plan.json or plan.npz): every optimizer step's token share per length
    bucket (all its plan steps and replicas) and mix/tv equal the plan's own; a plan without lengths gives {}."""
    from hbp_train.batches.loader import PackedData
    from hbp_train.planning.plan_npz import load_plan
    from hbp_train.planning.metrics import mix_distance, step_mix
    from hbp_train.observe.telemetry import StepLengthMix

    src, _ = tokenized
    out = tmp_path / "packed"
    assert main(["--dataset", str(src), "--shards", str(out), "--world-size", "4", "--groups", "64:1,256:2",
                 "--global-tokens", "512", "--quiet", "--plan-format", plan_format, "--out", str(tmp_path / "p.json"),
                 "--step-mix", step_mix_method]) == 0
    plan = load_plan(tmp_path / "p.json")  # the reader every tool uses: metrics recomputed from the steps
    data = PackedData(str(out))
    assert data.num_steps == plan.num_optimizer_steps
    mix = StepLengthMix(data)
    shares, data_mix = step_mix(plan)
    tv = mix_distance(shares, data_mix)
    for s in range(data.num_steps):
        m = mix(s)
        assert m["mix/tv"] == pytest.approx(tv[s])
        assert [m[f"mix/le_{e}"] for e in plan.metrics["mix_edges"]] == pytest.approx(shares[s].tolist())
    if step_mix_method == "sorted":
        assert max(mix(s)["mix/tv"] for s in range(data.num_steps)) > 0.3  # some steps far from the data's mix
    assert mix(data.num_steps) == {}
    if plan_format == "json":
        data.plan.pop("lengths")
        assert StepLengthMix(data)(0) == {}
