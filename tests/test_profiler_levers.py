"""The auto group selection's memory levers and ZeRO stage (hbp_train/profiler/search.py, zero_choice.py) on the
analytic back-end: per pack length it searches SP degree x checkpointed layers x tiled MLP x activation offload by
predicted time under the memory limit, and it picks the run's ZeRO stage."""

from __future__ import annotations

import pytest

from hbp_train.perf.cost_model import CostModel
from hbp_train.perf.memory import JobSettings, analytic_memory_bytes
from hbp_train.perf.profile_config import ProfileConfig
from hbp_train.perf.shape import MODEL_SHAPES
from hbp_train.profiler.backends import AnalyticBackend
from hbp_train.profiler.search import Profiler
from hbp_train.profiler.zero_choice import ZeroChoice, ZeroSetup, candidate_setups

SHAPE = MODEL_SHAPES["llama3-8b"]
JOB = JobSettings(zero_stage=3, loss_chunk_tokens=2048, grad_accum_fp32=False)


def profile(device_gb: float, **fields) -> tuple[dict, Profiler]:
    cfg = ProfileConfig(**{"max_len": 131072, "min_len": 8192, "world_size": 8, "dry_run": True,
                           "device_memory_gb": device_gb, "progress": False, "zero_stages": [3], **fields})
    backend = AnalyticBackend(SHAPE, cfg, CostModel.from_calibration(model_shape=SHAPE), JOB)
    profiler = Profiler(backend, cfg, zero=ZeroChoice(candidate_setups(cfg, JOB), JOB, SHAPE, cfg))
    return profiler.run(), profiler


def fits_without_offload(pack_len: int, budget: int) -> bool:
    """Any SP degree, checkpointing and tiling that fits the budget without offload (ZeRO-3, as the profile)."""
    return any(analytic_memory_bytes(SHAPE, pack_len, sp, c, 8, JOB, tiled, False) <= budget
               for sp in (1, 2, 4, 8) for c in range(SHAPE.num_layers + 1) for tiled in (False, True))


def test_the_long_group_offloads_and_the_short_groups_do_not_pay_for_it():
    """On 27.2 GiB GPUs (loss chunks of 2048 tokens) a 128K pack of Llama-3-8B fits only with its checkpointed layers'
    inputs offloaded (16K tokens per rank at sp=8: the loss's moment holds every input otherwise); groups with fewer
    tokens per rank fit without, so they run without offload and their predicted time has no copy in it."""
    data, profiler = profile(27.2)
    budget = data["memory_budget_bytes"]
    assert not fits_without_offload(131072, budget)
    top = data["groups"][-1]
    assert top["pack_len"] == 131072 and top.get("offload_activations") and top["ckpt_layers"] >= 1
    assert analytic_memory_bytes(SHAPE, 131072, top["sp"], top["ckpt_layers"], 8, JOB, bool(top.get("tiled_mlp")),
                                 True) <= budget
    per_rank = 131072 // top["sp"]
    short = [g for g in data["groups"] if g["pack_len"] // g["sp"] < per_rank]
    assert short and not any(g.get("offload_activations") for g in short)
    for g in short:  # no offload cost in their time: the plain pack time at their own sp, checkpointing, tiling
        plain = profiler.backend.cost_model.pack_time([g["pack_len"]], g["sp"], g["ckpt_layers"],
                                                      tiled_mlp=bool(g.get("tiled_mlp")))
        assert g["time_s"] == pytest.approx(plain)
    offloaded = profiler.backend.cost_model.pack_time([131072], top["sp"], top["ckpt_layers"],
                                                      tiled_mlp=bool(top.get("tiled_mlp")), offload_activations=True)
    assert top["time_s"] == pytest.approx(offloaded) and offloaded > profiler.backend.cost_model.pack_time(
        [131072], top["sp"], top["ckpt_layers"], tiled_mlp=bool(top.get("tiled_mlp")))
    # The same GPUs with the levers off: the 128K pack does not fit at all.
    without, _ = profile(27.2, levers=False)
    assert without["l_max"] < 131072 and any("131072" in w for w in without["warnings"])


def test_a_lever_only_where_the_group_would_checkpoint_without_it():
    """On 80 GiB GPUs the same job offloads nowhere, and a group runs the tiled MLP only where, untiled, it would
    have to checkpoint (the tiled MLP's recompute is cheaper than recomputing whole layers): a lever costs time and
    only saves memory."""
    data, _ = profile(80)
    budget = data["memory_budget_bytes"]
    assert not any(g.get("offload_activations") for g in data["groups"])
    tiled = [g for g in data["groups"] if g.get("tiled_mlp")]
    assert tiled, "the long groups gain from the tiled MLP here"
    for g in tiled:
        assert analytic_memory_bytes(SHAPE, g["pack_len"], g["sp"], 0, 8, JOB) > budget
    for g in data["groups"]:
        if analytic_memory_bytes(SHAPE, g["pack_len"], g["sp"], 0, 8, JOB) <= budget:
            assert not g.get("tiled_mlp") and g["ckpt_layers"] == 0


def test_the_zero_stage_is_the_one_that_trains_the_longest_then_the_fastest():
    """Stages 1-3 on 8 GPUs of 80 GiB: all reach 128K and ZeRO-1 (no per-micro-batch collectives) is the fastest
    summed over the lengths; on 30 GiB only ZeRO-3's sharded states leave room for 128K, so it is chosen. The profile
    names the stage and every candidate's reach."""
    data, _ = profile(80, zero_stages=[1, 2, 3])
    reach = {c["zero_stage"]: c["l_max"] for c in data["zero_candidates"]}
    assert reach == {1: 131072, 2: 131072, 3: 131072}
    per_token = {c["zero_stage"]: sum(c["seconds_per_token"].values()) for c in data["zero_candidates"]}
    assert data["zero_stage"] == min(per_token, key=per_token.get) == 1
    tight, _ = profile(30, zero_stages=[1, 2, 3])
    reach = {c["zero_stage"]: c["l_max"] for c in tight["zero_candidates"]}
    assert reach[3] == 131072 > max(reach[1] or 0, reach[2] or 0)
    assert tight["zero_stage"] == 3 and tight["zero"]["name"] == "ZeRO-3"


def test_a_stage_moves_a_measurement_by_its_model_states():
    """A measurement made for the job's settings is costed under another setup by the difference of what each holds
    per GPU (states and ZeRO-3's gathered LM head); its time gets that setup's collectives per pack."""
    cfg = ProfileConfig(world_size=8, dry_run=True, progress=False)
    zero = ZeroChoice(candidate_setups(cfg, JOB), JOB, SHAPE, cfg)
    assert [s.stage for s in zero.setups] == [1, 2, 3] and zero.memory_delta(ZeroSetup(3)) == 0
    from hbp_train.perf.memory import model_state_bytes, zero3_working_bytes

    stage2 = ZeroSetup(2).job(JOB)
    assert zero.memory_delta(ZeroSetup(2)) == (model_state_bytes(SHAPE.num_params, 8, stage2)
                                               - model_state_bytes(SHAPE.num_params, 8, JOB)
                                               - zero3_working_bytes(SHAPE, JOB, loss=True))
    assert zero.memory_delta(ZeroSetup(1)) > zero.memory_delta(ZeroSetup(2)) > 0  # stage 1 keeps whole gradients
    # ZeRO-3 pays three collectives every micro-batch, ZeRO-1 two per step spread over the step's micro-batches.
    assert zero.pack_seconds(ZeroSetup(3), 8192, 1) > zero.pack_seconds(ZeroSetup(1), 8192, 1) > 0


def test_the_plan_carries_the_levers_and_the_stage_and_training_refuses_another(tmp_path, capsys):
    """The profile of the first test, through hbp-pack --groups auto: the plan's long groups offload, the shorter
    ones do not, and it records the chosen ZeRO stage; hbp-simulate takes that stage and lists the levers, and its
    short packs cost their plain time; the config check (before any worker) refuses another deepspeed.zero_stage in
    one line and accepts the plan's."""
    import json
    from types import SimpleNamespace

    import numpy as np

    from data_tools.pack import main as pack
    from data_tools.simulate import main as simulate
    from hbp_train.config import ConfigError, check_zero_stage
    from hbp_train.planning.plan import Plan

    data, _ = profile(27.2)
    (tmp_path / "profile.json").write_text(json.dumps(data))
    rng = np.random.default_rng(0)
    lengths = np.concatenate([rng.integers(100, 8000, 3000), rng.integers(60000, 131072, 12)])
    np.save(tmp_path / "lengths.npy", lengths)
    shards = tmp_path / "packed"
    shards.mkdir()
    assert pack(["--lengths", str(tmp_path / "lengths.npy"), "--groups", "auto", "--profile",
                 str(tmp_path / "profile.json"), "--world-size", "8", "--out", str(shards / "plan.json"),
                 "--no-baseline", "--quiet"]) == 0
    plan = Plan.from_json(shards / "plan.json")
    assert plan.extra["zero_stage"] == data["zero_stage"] == 3
    groups = plan.config.groups
    assert groups[-1].offload_activations and not any(g.offload_activations for g in groups
                                                      if g.pack_len // g.sp < 131072 // groups[-1].sp)
    capsys.readouterr()
    assert simulate(["--plan", str(shards / "plan.json"), "--model-shape", "llama3-8b"]) == 0
    out = capsys.readouterr().out
    assert "ZeRO stage: 3, the plan's" in out and f"131072:{groups[-1].sp}:" in out and ":offload" in out
    cfg = lambda stage: SimpleNamespace(data=SimpleNamespace(shards=str(shards)),  # noqa: E731
                                        deepspeed=SimpleNamespace(zero_stage=stage))
    check_zero_stage(cfg(3))
    with pytest.raises(ConfigError) as err:
        check_zero_stage(cfg(2))
    assert len(str(err.value).splitlines()) == 1 and "made for ZeRO-3" in str(err.value)
    assert "deepspeed.zero_stage=3" in str(err.value)
