"""Simulator on tiny hand-built plans with a toy cost model (slot times computed by hand), the ZeRO communication
model (collective and optimizer seconds computed by hand from its formulas), and the CLIs."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from hbp_train.common.errors import UserError
from hbp_train.perf.cost_model import CostModel, StepCosts
from hbp_train.planning.csr import pack_csr
from hbp_train.planning.metrics import with_metrics
from hbp_train.planning.plan import GroupSpec, Plan, PlanConfig
from hbp_train.planning.simulator import COMPUTE_ONLY, SimConfig, simulate, speedup, zero_comm_seconds
from tests.cli_exit import exit_code


class SquareCost:
    """Toy cost model: a pack costs sum(len^2) / sp + 10 * ckpt_layers seconds (no comm); 1e9 parameters; no step
    costs."""

    shape = SimpleNamespace(num_layers=4, num_params=10**9)
    step_costs = StepCosts()

    def pack_times(self, lengths, offsets, sp, ckpt_layers=0, *args):
        lengths = np.asarray(lengths, np.float64)
        sq = np.concatenate([[0.0], np.cumsum(lengths ** 2)])
        per_pack = sq[offsets[1:]] - sq[offsets[:-1]]
        return per_pack / np.asarray(sp) + 10.0 * np.asarray(ckpt_layers)


def make_plan(lengths, groups, world_size, steps, extra=None) -> Plan:
    """steps: [(group, [[pack, ...] per replica])] with packs as sample-index lists (slot-major built here)."""
    packs, pack_group, step_sizes, step_group = [], [], [], []
    for g, replicas in steps:
        m = max(len(r) for r in replicas)
        for k in range(m):
            for r in replicas:
                packs.append(r[k] if k < len(r) else [])
                pack_group.append(g)
        step_sizes.append(m * len(replicas))
        step_group.append(g)
    ptr, flat = pack_csr(packs)
    cfg = PlanConfig(world_size=world_size, groups=[GroupSpec(*g) for g in groups], strategy="test")
    return with_metrics(Plan(config=cfg, lengths=np.asarray(lengths, np.int64), pack_ptr=ptr, pack_samples=flat,
                             pack_group=np.asarray(pack_group, np.int32),
                             step_ptr=np.concatenate([[0], np.cumsum(step_sizes)]).astype(np.int64),
                             step_packs=np.arange(len(packs), dtype=np.int64),
                             step_group=np.asarray(step_group, np.int32), extra=extra or {}))


LENGTHS = [4, 2, 3, 1, 1, 2]


def plan_a() -> Plan:
    # W=2, one group (pack_len 10, sp 1): R=2. Step 0: replica 0 runs [0] then [1]; replica 1 runs [2] then [3,4].
    # Step 1: replica 0 [5], replica 1 [] (empty).
    return make_plan(LENGTHS, [(10, 1, 0)], 2, [(0, [[[0], [1]], [[2], [3, 4]]]), (0, [[[5]], [[]]])])


def plan_b() -> Plan:
    # W=2, groups (4, sp1) and (10, sp2, ckpt 1). Step 0 in group 1 (R=1): [0, 1] then [2, 5].
    # Step 1 in group 0 (R=2): replica 0 [3], replica 1 [4].
    return make_plan(LENGTHS, [(4, 1, 0), (10, 2, 1)], 2, [(1, [[[0, 1], [2, 5]]]), (0, [[[3]], [[4]]])])


def test_hand_computed_micro_sync():
    res = simulate(plan_a(), SquareCost())
    # Pack costs: [0]=16, [2]=9 | [1]=4, [3,4]=2 | [5]=4, []=0.
    np.testing.assert_allclose(res.replica_seconds, [16, 9, 4, 2, 4, 0])
    np.testing.assert_allclose(res.slot_seconds, [16, 4, 4])
    np.testing.assert_allclose(res.step_seconds, [20, 4])
    assert res.total_seconds == pytest.approx(24)
    # Busy per replica on average: (16+9+4+2)/2 + (4+0)/2 = 17.5 of 24.
    assert res.idle_fraction == pytest.approx(1 - 17.5 / 24)
    assert res.tokens == sum(LENGTHS)
    slots = res.slots()
    assert [(s["step"], s["slot"]) for s in slots] == [(0, 0), (0, 1), (1, 0)]
    assert slots[0]["replica_seconds"] == [16, 9] and slots[0]["slot_seconds"] == 16
    # The default models no communication: nothing added, and the summary says so.
    assert res.step_comm_seconds is None and res.optimizer_seconds_per_step == 0.0
    summary = res.summary()
    assert summary["comm_seconds"] == 0.0 and summary["optimizer_seconds"] == 0.0
    assert summary["comm_model"] == COMPUTE_ONLY
    explicit = simulate(plan_a(), SquareCost(), SimConfig(zero_stage=None, comm_overlap=0.0))
    np.testing.assert_array_equal(explicit.step_seconds, res.step_seconds)


def test_hand_computed_sp_ckpt_and_speedup():
    res = simulate(plan_b(), SquareCost())
    # Group 1 packs at sp=2 with 1 checkpointed layer: (16+4)/2+10 = 20, (9+4)/2+10 = 16.5. Group 0: 1, 1.
    np.testing.assert_allclose(res.slot_seconds, [20, 16.5, 1])
    assert res.total_seconds == pytest.approx(37.5)
    assert res.idle_fraction == pytest.approx(0.0)
    assert speedup(simulate(plan_a(), SquareCost()), res) == pytest.approx(24 / 37.5)
    # A null ckpt_layers takes the simulator's default.
    p = make_plan(LENGTHS, [(10, 1, None)], 2, [(0, [[[0, 1]], [[2, 3, 4, 5]]])])
    assert simulate(p, SquareCost(), SimConfig(ckpt_layers=2)).total_seconds == pytest.approx(20 + 20)


def test_hand_computed_step_sync_unequal_micro_batches():
    # Replica 0 runs one heavy pack; replica 1 runs three light ones (bytescale-style, unequal counts).
    p = make_plan(LENGTHS, [(10, 1, 0)], 2, [(0, [[[0]], [[1], [2], [3, 4, 5]]])],
                  extra={"unequal_micro_batches": True})
    res = simulate(p, SquareCost())
    assert res.sync == "step"
    # Replica sums: 16 vs 4 + 9 + 6 = 19 -> step 19; busy mean (16+19)/2.
    assert res.total_seconds == pytest.approx(19)
    assert res.idle_fraction == pytest.approx(1 - 17.5 / 19)
    # The same plan under per-micro-batch sync: slots max(16,4) + max(0,9) + max(0,6) = 31.
    assert simulate(p, SquareCost(), SimConfig(sync="micro")).total_seconds == pytest.approx(31)


# Step costs on plan_a: compute x2, 1 s per pack (the empty one too: the trainer's dummy), 0.5 s per micro-batch,
# 3 s per step, data 0.25 s per step + 0.125 s per micro-batch.
COSTS = StepCosts(compute_scale=2.0, pack_s=1.0, micro_batch_s=0.5, step_s=3.0, data_step_s=0.25,
                  data_micro_batch_s=0.125, source="test")


def test_step_costs_hand_computed():
    res = simulate(plan_a(), SquareCost(), SimConfig(step_costs=COSTS))
    # Replicas: step 0 slot 0: 2*16+1 = 33 | 2*9+1 = 19; slot 1: 2*4+1 = 9 | 2*2+1 = 5; step 1: 2*4+1 = 9 | 0+1 = 1.
    np.testing.assert_allclose(res.replica_seconds, [33, 19, 9, 5, 9, 1])
    np.testing.assert_allclose(res.slot_seconds, [33, 9, 9])
    # Per step: (0.5 + 0.125) per micro-batch, 3 + 0.25 per step.
    np.testing.assert_allclose(res.step_cost_seconds, [2 * 0.625 + 3.25, 0.625 + 3.25])
    np.testing.assert_allclose(res.step_seconds, [33 + 9 + 4.5, 9 + 3.875])
    # Busy: the replicas' mean time (33 + 19 + 9 + 5) / 2 + (9 + 1) / 2 and every step cost.
    assert res.idle_fraction == pytest.approx(1 - (38 + 8.375) / 59.375)
    assert res.summary()["step_cost_seconds"] == pytest.approx(8.375) and "1e+03 ms/pack" in res.summary()["step_costs"]
    # The cost model's own step costs are used unless the config gives others; none: compute only, as before.
    model = SquareCost()
    model.step_costs = COSTS
    assert simulate(plan_a(), model).total_seconds == pytest.approx(59.375)
    assert simulate(plan_a(), model, SimConfig(step_costs=StepCosts())).total_seconds == pytest.approx(24)
    assert simulate(plan_a(), SquareCost()).step_cost_seconds is None
    # With ZeRO-2 on top (INTRA below: 1 s per reduce-scatter per slot, 1 s all-gather and 1 s optimizer per step).
    zero = simulate(plan_a(), SquareCost(), SimConfig(step_costs=COSTS, zero_stage=2, **INTRA))
    np.testing.assert_allclose(zero.step_seconds, [46.5 + 2 + 1 + 1, 12.875 + 1 + 1 + 1])


def test_step_costs_skip_the_packs_a_replica_does_not_run():
    """Unequal micro-batch counts (ZeRO-0/1): a replica runs only its own packs, no dummy for the padding."""
    p = make_plan(LENGTHS, [(10, 1, 0)], 2, [(0, [[[0]], [[1], [2], [3, 4, 5]]])],
                  extra={"unequal_micro_batches": True})
    res = simulate(p, SquareCost(), SimConfig(step_costs=StepCosts(pack_s=1.0, micro_batch_s=0.5)))
    # Replica sums: 16 + 1 vs (4 + 1) + (9 + 1) + (6 + 1) = 22; 3 micro-batches of 0.5.
    assert res.total_seconds == pytest.approx(22 + 1.5)


def test_step_costs_refuse_bad_values():
    with pytest.raises(UserError, match="step_costs.pack_s must be a number >= 0"):
        StepCosts(pack_s=-1.0)
    with pytest.raises(UserError, match="compute_scale must be > 0"):
        StepCosts(compute_scale=0.0)
    with pytest.raises(UserError, match="calibration X: step_costs: step_costs.step_s must be"):
        StepCosts.from_dict({"step_s": "fast"}, "calibration X: step_costs")
    assert StepCosts.from_dict({"step_s": 0.5, "fitted_steps": 20}).step_s == 0.5  # the fit's record is ignored


# ZeRO model on plan_a (W=2): P = 1e9 bf16 params = 2e9 bytes. Within a node at 1 GB/s one ring reduce-scatter or
# all-gather is 2e9 * (2-1)/2 / 1e9 = 1 s (across nodes at 0.5 GB/s: 2 s). Optimizer: 32 B * P/W / 16 GB/s = 1 s
# (stage 0 updates all P: 2 s). Compute (micro sync): slots [16, 4 | 4], 2 slots in step 0 and 1 in step 1;
# (step sync): replica sums step 0 max(16+4, 9+2) = 20, step 1 max(4, 0) = 4.
INTRA = dict(intra_node_gbps=1.0, inter_node_gbps=0.5, hbm_gbps=16.0)


@pytest.mark.parametrize("stage, overlap, gpus_per_node, sync, steps", [
    # stage 0: all-reduce (2 rings) per step + optimizer on all P.
    (0, 0.0, 8, "step", [20 + 2 + 2, 4 + 2 + 2]),
    # stage 1: reduce-scatter + all-gather per step + optimizer on P/W.
    (1, 0.0, 8, "step", [20 + 2 + 1, 4 + 2 + 1]),
    # stage 2: a reduce-scatter per slot (exposed share 1 - overlap) + an all-gather per step + optimizer.
    (2, 0.0, 8, "micro", [20 + 2 * 1 + 1 + 1, 4 + 1 + 1 + 1]),
    (2, 1.0, 8, "micro", [20 + 0 + 1 + 1, 4 + 0 + 1 + 1]),
    (2, 0.5, 8, "micro", [20 + 2 * 0.5 + 1 + 1, 4 + 0.5 + 1 + 1]),
    # stage 3: two all-gathers and a reduce-scatter per slot, nothing else per step but the optimizer.
    (3, 0.0, 8, "micro", [20 + 2 * 3 + 1, 4 + 3 + 1]),
    (3, 1.0, 8, "micro", [20 + 1, 4 + 1]),
    # W=2 across nodes (1 GPU per node): every ring at the inter-node 0.5 GB/s takes 2 s.
    (2, 0.0, 1, "micro", [20 + 2 * 2 + 2 + 1, 4 + 2 + 2 + 1]),
    (0, 0.0, 1, "step", [20 + 4 + 2, 4 + 4 + 2]),
])
def test_zero_stages_hand_computed(stage, overlap, gpus_per_node, sync, steps):
    cfg = SimConfig(gpus_per_node=gpus_per_node, zero_stage=stage, comm_overlap=overlap, **INTRA)
    res = simulate(plan_a(), SquareCost(), cfg)
    assert res.sync == sync, "the sync follows the stage"
    np.testing.assert_allclose(res.step_seconds, steps)
    opt = 2.0 if stage == 0 else 1.0
    assert res.optimizer_seconds_per_step == pytest.approx(opt)
    np.testing.assert_allclose(res.step_comm_seconds, np.array(steps) - [20, 4] - opt)
    # Collectives and the optimizer are busy time, not idle: busy per replica 17.5 s of compute.
    total = sum(steps)
    assert res.idle_fraction == pytest.approx(1 - (17.5 + sum(steps) - 24) / total)
    summary = res.summary()
    assert summary["simulated_seconds"] == pytest.approx(total)
    assert summary["comm_seconds"] == pytest.approx(total - 24 - 2 * opt)
    assert summary["comm_seconds_per_step"] == pytest.approx(summary["comm_seconds"] / 2)
    assert summary["optimizer_seconds"] == pytest.approx(2 * opt)
    assert f"ZeRO-{stage}" in summary["comm_model"] and f"overlap {overlap:g}" in summary["comm_model"]


def test_zero_comm_seconds_formulas():
    # W=16 on 8-GPU nodes: inter-node; ring = 2P * 15/16 / bw.
    cfg = SimConfig(intra_node_gbps=100.0, inter_node_gbps=25.0, zero_stage=3, hbm_gbps=2000.0)
    p = 8 * 10**9
    ring = 2 * p * 15 / 16 / 25e9
    got = zero_comm_seconds(p, 16, cfg)
    assert got["micro"] == pytest.approx(3 * ring) and got["step"] == 0.0
    assert got["optimizer"] == pytest.approx(32 * p / 16 / 2000e9)
    # W=8 fits the node: intra-node bandwidth.
    assert zero_comm_seconds(p, 8, SimConfig(intra_node_gbps=100.0, zero_stage=0, hbm_gbps=2000.0)) == \
        pytest.approx({"micro": 0.0, "step": 2 * 2 * p * 7 / 8 / 100e9, "optimizer": 32 * p / 2000e9})
    # One rank: no collective, the optimizer still runs.
    one = zero_comm_seconds(p, 1, SimConfig(zero_stage=2))
    assert one["micro"] == 0.0 and one["step"] == 0.0 and one["optimizer"] > 0
    # A real shape's parameter count feeds it (llama3-8b: 8.03e9 with untied embeddings).
    model = CostModel.from_calibration()
    assert model.shape.num_params == 8_030_261_248


def test_zero_config_validation_and_unequal_micro_batches():
    for kwargs, name in [(dict(zero_stage=4), "zero_stage"), (dict(comm_overlap=1.5), "comm_overlap"),
                         (dict(comm_overlap=-0.1), "comm_overlap"), (dict(hbm_gbps=0), "hbm_gbps"),
                         (dict(zero_stage=2, sync="step"), "sync"), (dict(zero_stage=1, sync="micro"), "sync")]:
        with pytest.raises(UserError, match=name):
            SimConfig(**kwargs)
    assert SimConfig(zero_stage=2, sync="micro").sync == "micro"
    # Unequal micro-batch counts (bytescale) cannot run with ZeRO 2/3: refused, naming the stage.
    p = make_plan(LENGTHS, [(10, 1, 0)], 2, [(0, [[[0]], [[1], [2], [3, 4, 5]]])],
                  extra={"unequal_micro_batches": True})
    for stage in (2, 3):
        with pytest.raises(UserError, match=f"stage {stage}"):
            simulate(p, SquareCost(), SimConfig(zero_stage=stage))
    # Stage 1 is fine: step sync, replica sums max(16, 19) = 19, + reduce-scatter and all-gather + optimizer.
    res = simulate(p, SquareCost(), SimConfig(zero_stage=1, **INTRA))
    assert res.sync == "step" and res.total_seconds == pytest.approx(19 + 2 + 1)


def test_real_cost_model_matches_pack_time():
    model = CostModel.from_calibration()
    lengths = [30000, 2000, 1000, 64000, 500, 500]
    p = make_plan(lengths, [(32768, 1, 0), (65536, 2, 3)], 2,
                  [(0, [[[0], [1, 2]], [[4, 5], []]]), (1, [[[3]]])])
    res = simulate(p, model)
    want0 = [model.pack_time([30000]), model.pack_time([500, 500])]
    want1 = [model.pack_time([2000, 1000]), 0.0]
    np.testing.assert_allclose(res.slot_seconds, [max(want0), max(want1), model.pack_time([64000], 2, 3)])


def test_cli_report_and_plot(tmp_path, capsys):
    from data_tools import simulate as cli

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    lengths = [30000, 2000, 1000, 64000, 500, 500]
    pa = make_plan(lengths, [(65536, 2, 0)], 4, [(0, [[[0, 1, 2]], [[3, 4, 5]]])])
    pb = make_plan(lengths, [(32768, 1, 0), (65536, 2, 0)], 4,
                   [(0, [[[0]], [[1]], [[2, 4]], [[5]]]), (1, [[[3]], [[]]])])
    pa.to_json(a)
    pb.to_json(b)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    assert cli.main(["--plan", str(a), "--plan", str(b), "--out", str(out), "--plot", str(png)]) == 0
    text = capsys.readouterr().out
    assert "SIMULATED" in text and "speed-up" in text
    report = json.loads(out.read_text())
    assert report["simulated"] is True and report["cost_model"]["source"] == "measured"
    model = CostModel.from_calibration()
    ta = max(model.pack_time([30000, 2000, 1000], 2), model.pack_time([64000, 500, 500], 2))
    tb = max(model.pack_time(l) for l in ([30000], [2000], [1000, 500], [500])) + model.pack_time([64000], 2)
    assert report["plans"][0]["simulated_seconds"] == pytest.approx(ta, rel=1e-9)
    assert report["plans"][1]["simulated_seconds"] == pytest.approx(tb, rel=1e-9)
    assert report["plans"][1]["speedup"] == pytest.approx(ta / tb, rel=1e-9)
    assert len(report["plans"][1]["slots"]) == 2
    assert png.stat().st_size > 10_000


def test_cli_zero_stage(tmp_path, capsys):
    from data_tools import simulate as cli

    lengths = [30000, 2000, 1000, 64000, 500, 500]
    plan = make_plan(lengths, [(65536, 2, 0)], 4, [(0, [[[0, 1, 2]], [[3, 4, 5]]]), (0, [[[3]], [[0]]])])
    path, out = tmp_path / "a.json", tmp_path / "r.json"
    plan.to_json(path)
    assert cli.main(["--plan", str(path), "--zero-stage", "3", "--comm-overlap", "0.5", "--intra-node-gbps", "100",
                     "--hbm-gbps", "2000", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "comm/step" in text and "ZeRO-3 collectives (overlap 0.5)" in text
    model = CostModel.from_calibration()
    p = model.shape.num_params
    ring = 2 * p * 3 / 4 / 100e9  # W=4 within an 8-GPU node
    per_step = 0.5 * 3 * ring + 32 * p / 4 / 2000e9  # one slot per step
    # The Ulysses all-to-alls use the same --intra-node-gbps.
    compute = (max(model.pack_time([30000, 2000, 1000], 2, 0, 100.0), model.pack_time([64000, 500, 500], 2, 0, 100.0))
               + max(model.pack_time([64000], 2, 0, 100.0), model.pack_time([30000], 2, 0, 100.0)))
    report = json.loads(out.read_text())
    row = report["plans"][1]  # the first is isf, planned on the plan's lengths to compare it with
    assert report["comm"]["zero_stage"] == 3 and row["sync"] == "micro"
    assert row["simulated_seconds"] == pytest.approx(compute + 2 * per_step, rel=1e-9)
    assert row["comm_seconds_per_step"] == pytest.approx(0.5 * 3 * ring, rel=1e-9)
    # Bad values: one line naming the field, exit 2; a bytescale-style plan with stage 2 names the stage.
    assert exit_code(cli.main, ["--plan", str(path), "--zero-stage", "2", "--comm-overlap", "1.5"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--comm-overlap: 1.5 is out of range" in err
    unequal = make_plan(LENGTHS, [(10, 1, 0)], 2, [(0, [[[0]], [[1], [2], [3, 4, 5]]])],
                        extra={"unequal_micro_batches": True, "requires_zero_stage": [0, 1]})
    unequal.config.strategy = "bytescale"
    unequal.to_json(path)
    assert exit_code(cli.main, ["--plan", str(path), "--zero-stage", "2"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "stage 2" in err
    assert cli.main(["--plan", str(path), "--zero-stage", "1"]) == 0


def test_cli_one_plan_is_compared_with_isf_on_its_lengths_and_tiny_times_show(tmp_path, capsys):
    """hbp-simulate --plan P alone: isf is planned on P's lengths (W, largest group, step budget, seed) and P's
    speed-up is over it, as data_tools.compare computes it; a tiny model's times print in a unit that shows them
    (no 0.000 in a time column)."""
    from data_tools import simulate as cli
    from data_tools.simulation.strategies import plan_strategies, simulate_strategies
    from data_tools.simulation.tables import format_seconds

    rng = np.random.default_rng(4)
    lengths = np.minimum(rng.lognormal(5, 1.2, 400).astype(int) + 1, 2048)
    cfg = dict(world_size=4, groups=[GroupSpec(256, 1), GroupSpec(2048, 1)], global_tokens=4 * 2048, seed=3)
    from hbp_train.planning import make_plan as plan_lengths

    path = tmp_path / "hbp.json"
    plan_lengths(lengths, PlanConfig(strategy="hbp", **cfg)).to_json(path)
    tiny = json.dumps({"name": "tiny", "hidden": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "ffn": 64,
                       "vocab": 512})
    out = tmp_path / "r.json"
    assert cli.main(["--plan", str(path), "--model-shape", tiny, "--zero-stage", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    rows = json.loads(out.read_text())["plans"]
    assert [r["name"] for r in rows] == ["isf (planned here)", "hbp:hbp.json"] and rows[0]["strategy"] == "isf"
    # The same speed-up as compare's, which plans isf and hbp on the same lengths itself.
    model = CostModel.from_calibration(None, tiny)
    kwargs = {k: v for k, v in cfg.items()}
    cmp_rows, _ = simulate_strategies(plan_strategies(lengths, kwargs, model, SimConfig(zero_stage=2), ("isf", "hbp"),
                                                      progress=False), model, SimConfig(zero_stage=2))
    want = {r["name"]: r for r in cmp_rows}
    assert rows[0]["simulated_seconds"] == pytest.approx(want["isf"]["simulated_seconds"], rel=1e-9)
    assert rows[1]["speedup"] == pytest.approx(want["hbp"]["speedup"], rel=1e-9) and rows[1]["speedup"] != 1.0
    assert "baseline: isf planned here on the plan's 400 lengths" in text
    # The step time is microseconds to milliseconds here: every time column shows it, none reads 0.000.
    assert 0 < rows[1]["simulated_seconds"] < 1.0
    for r in rows:
        for key in ("simulated_seconds", "comm_seconds_per_step", "optimizer_seconds_per_step"):
            assert format_seconds(r[key]) in text and float(format_seconds(r[key]).split()[0]) > 0
    table_rows = [line for line in text.splitlines() if line.startswith(("isf (planned here) ", "hbp:hbp.json "))]
    assert len(table_rows) == 2 and not any("0.000" in line for line in table_rows)


def test_format_seconds_picks_the_unit_that_shows_the_figure():
    from data_tools.simulation.tables import format_seconds

    assert [format_seconds(x) for x in (3.2e-5, 0.0123, 4.5, 600.0, 9000.0, 0.0)] == \
        ["32 µs", "12.3 ms", "4.5 s", "10 min", "2.5 h", "0 s"]


def test_compare_cli_zero_stage(tmp_path, capsys):
    from data_tools import compare

    rng = np.random.default_rng(2)
    lengths = np.minimum(rng.lognormal(6, 1.2, 600).astype(int) + 1, 16000)
    f, out = tmp_path / "lengths.txt", tmp_path / "cmp.json"
    f.write_text("\n".join(map(str, lengths)))
    base = ["--lengths", str(f), "--world-size", "8", "--groups", "2048:1,16384:4", "--global-tokens",
            str(16384 * 4), "--quiet", "--strategies", "isf,hbp,bytescale", "--out", str(out)]
    assert compare.main(base) == 0
    upper = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert "comm/step" not in capsys.readouterr().out
    assert compare.main(base + ["--zero-stage", "2"]) == 0
    captured = capsys.readouterr()
    assert "comm/step" in captured.out and "simulated at ZeRO-1" in captured.err
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["isf"]["zero_stage"] == 2 and rows["hbp"]["sync"] == "micro"
    assert rows["bytescale"]["zero_stage"] == 1 and rows["bytescale"]["sync"] == "step"
    for name, r in rows.items():
        # Same plans; the collectives and optimizer only add time.
        added = r["comm_seconds"] + r["optimizer_seconds"]
        assert added > 0 and r["simulated_seconds"] == pytest.approx(upper[name]["simulated_seconds"] + added)
    # Stage 2 adds a reduce-scatter per slot: hbp (more, smaller micro-batches) gains less than compute-only says.
    assert rows["hbp"]["speedup"] < upper["hbp"]["speedup"]
    # --max-len below some samples: said on stderr, as pack does (they are planned, not dropped)
    assert compare.main(base + ["--max-len", "8000"]) == 0
    longer = int((lengths > 8000).sum())
    assert longer and f"{longer} samples are longer than --max-len 8000" in capsys.readouterr().err
    assert all(r["num_dropped"] == 0 for r in json.loads(out.read_text())["rows"])


def test_cli_bad_input_exits_2(tmp_path, capsys):
    from data_tools import simulate as cli

    bad = tmp_path / "x.json"
    bad.write_text("[1, 2")
    assert exit_code(cli.main, ["--plan", str(bad)]) == 2
    assert "invalid JSON" in capsys.readouterr().err
    assert exit_code(cli.main, ["--plan", str(tmp_path / "missing.json")]) == 2
    assert exit_code(cli.main, ["--plan", str(bad), "--calibration", str(bad)]) == 2
    capsys.readouterr()
    good = tmp_path / "plan.json"
    plan_a().to_json(good)
    # Outputs that cannot be written, and more checkpointed layers than the model has: one line, exit 2.
    for flags in (["--out", str(bad / "r.json")], ["--plot", str(tmp_path)], ["--ckpt-layers", "33"]):
        assert exit_code(cli.main, ["--plan", str(good), *flags]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and "error: " in err


def test_compare_cli_all_strategies(tmp_path, capsys):
    from data_tools import compare
    from data_tools.simulation.strategies import BASELINES, STRATEGIES

    rng = np.random.default_rng(1)
    lengths = np.minimum(rng.lognormal(6, 1.2, 1500).astype(int) + 1, 16000)
    f = tmp_path / "lengths.txt"
    f.write_text("\n".join(map(str, lengths)))
    out, png = tmp_path / "cmp.json", tmp_path / "cmp.png"
    assert compare.main(["--lengths", str(f), "--world-size", "8", "--groups", "2048:1,16384:4", "--global-tokens",
                         str(16384 * 4), "--quiet", "--out", str(out), "--plot", str(png)]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(STRATEGIES)
    assert rows["isf"]["speedup"] == 1.0
    assert rows["bytescale"]["sync"] == "step" and rows["hbp"]["sync"] == "micro"
    for r in rows.values():
        assert r["tokens"] == int(lengths.sum()) and r["simulated_seconds"] > 0
        assert r["speedup"] == pytest.approx(rows["isf"]["simulated_seconds"] / r["simulated_seconds"])
    # Every row is also compared with the fastest of the baselines users run (isf, bfd, sorted), named.
    best = min(BASELINES, key=lambda n: rows[n]["simulated_seconds"])
    for r in rows.values():
        assert r["best_baseline"] == best
        assert r["speedup_best"] == pytest.approx(rows[best]["simulated_seconds"] / r["simulated_seconds"])
    assert rows[best]["speedup_best"] == pytest.approx(1.0)
    assert rows["wlb"]["mean_deferred_wait_steps"] is not None
    printed = capsys.readouterr().out
    assert f"over the best baseline ({best})" in printed
    assert "speed-up" in printed and png.stat().st_size > 10_000
    assert exit_code(compare.main, ["--lengths", str(f), "--world-size", "8", "--groups", "2048:3"]) == 2
    # Groups from a profile (the profiler's JSON), as data_tools.pack reads them.
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"groups": [{"pack_len": 2048, "sp": 1, "ckpt_layers": 0},
                                              {"pack_len": 16384, "sp": 4, "ckpt_layers": 8}]}))
    capsys.readouterr()
    assert compare.main(["--lengths", str(f), "--world-size", "8", "--groups", "auto", "--profile", str(profile),
                         "--strategies", "isf,hbp", "--quiet", "--out", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"isf", "hbp"} and rows["hbp"]["num_steps"] > 0
    assert exit_code(compare.main, ["--lengths", str(f), "--world-size", "8", "--groups", "auto"]) == 2
    assert "--profile" in capsys.readouterr().err
    assert exit_code(compare.main, ["--lengths", str(f), "--world-size", "8", "--groups", "2048:1",
                                    "--strategies", "x"]) == 2


def test_cli_plan_folder_and_outputs_it_may_replace(tmp_path, capsys):
    """--plan accepts a --shards folder (its plan.json); --out replaces only an earlier report, never other data."""
    from data_tools import simulate as cli

    folder = tmp_path / "packed"
    plan_a().to_json(folder / "plan.json")
    out = tmp_path / "r.json"
    for _ in range(2):  # the second run replaces the first run's report
        assert cli.main(["--plan", str(folder), "--out", str(out)]) == 0
    assert json.loads(out.read_text())["plans"][-1]["num_steps"] == plan_a().num_steps
    capsys.readouterr()
    raw = tmp_path / "train.jsonl"
    raw.write_text('{"messages": []}\n')
    assert exit_code(cli.main, ["--plan", str(folder), "--out", str(raw)]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"error: --out {raw}: exists and is not a simulation report written by hbp-train (JSON "
                           'starting with "simulated"); choose another --out or delete the file')
    assert raw.read_text() == '{"messages": []}\n'
    assert exit_code(cli.main, ["--plan", str(tmp_path)]) == 2  # a folder without plan.json
    assert f"{tmp_path}: is a folder with no plan.json" in capsys.readouterr().err


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def test_cli_interrupt_exits_130_with_one_line(tmp_path, capsys, monkeypatch):
    """Ctrl-C in simulate or compare: one line naming what was left as it was, exit code 130, earlier --out kept."""
    from data_tools import compare
    from data_tools import simulate as cli
    import hbp_train.planning.simulator as sim

    path, out = tmp_path / "plan.json", tmp_path / "r.json"
    plan_a().to_json(path)
    assert cli.main(["--plan", str(path), "--out", str(out)]) == 0
    before = out.read_bytes()
    capsys.readouterr()
    monkeypatch.setattr(sim, "simulate", _interrupt)
    assert cli.main(["--plan", str(path), "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert err.splitlines() == [err.strip()] and err.startswith("simulate: interrupted; ")
    assert out.read_bytes() == before
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("100\n200\n")
    monkeypatch.setattr(compare, "compare_strategies", _interrupt)
    assert compare.main(["--lengths", str(lengths), "--world-size", "2", "--groups", "256:1", "--quiet",
                         "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert err.splitlines() == [err.strip()] and err.startswith("compare: interrupted; ")
    assert out.read_bytes() == before
    raw = tmp_path / "train.jsonl"
    raw.write_text("{}\n")
    assert exit_code(compare.main, ["--lengths", str(lengths), "--world-size", "2", "--groups", "256:1", "--quiet",
                         "--out", str(raw)]) == 2  # checked before the (interrupted) work
    assert "exists and is not a comparison report" in capsys.readouterr().err and raw.read_text() == "{}\n"


def test_compare_cost_balancing_strategies_plan_with_the_cost_model():
    """hbp-cost (like wlb and bytescale) plans with the simulator's cost model as pack cost; hbp with sum of len^2."""
    from data_tools.simulation.strategies import plan_strategies
    from hbp_train.perf.cost_model import pack_cost_fn
    from hbp_train.planning import make_plan

    rng = np.random.default_rng(4)
    lengths = np.minimum(rng.lognormal(6, 1.3, 800).astype(int) + 1, 16000)
    model = CostModel.from_calibration()
    sim = SimConfig()
    kwargs = dict(world_size=8, groups=[GroupSpec(2048, 1), GroupSpec(16384, 4)], global_tokens=16384 * 4)
    plans = plan_strategies(lengths, kwargs, model, sim, ("hbp", "hbp-cost"), progress=False)
    cost = pack_cost_fn(model, sim.ckpt_layers, sim.intra_node_gbps, sim.inter_node_gbps, sim.gpus_per_node)
    want = make_plan(lengths, PlanConfig(strategy="hbp", pack_cost=cost, **kwargs))
    plain = make_plan(lengths, PlanConfig(strategy="hbp", **kwargs))
    assert np.array_equal(plans["hbp-cost"][0].pack_samples, want.pack_samples)
    assert np.array_equal(plans["hbp"][0].pack_samples, plain.pack_samples)
    assert not np.array_equal(want.pack_samples, plain.pack_samples), "the two costs must plan differently here"


def _planned(tmp_path, name, lengths, model=None):
    """A plan of ``lengths`` by data_tools.pack (hbp, W=4, groups 256:1,1024:2), with --model when given."""
    from data_tools import pack

    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(map(str, lengths)))
    out = tmp_path / name
    flags = ["--model", str(model)] if model else []
    assert pack.main(["--lengths", str(path), "--world-size", "4", "--groups", "256:1,1024:2", "--global-tokens",
                      "8192", "--quiet", "--no-baseline", "--out", str(out), *flags]) == 0
    return out


def test_simulate_costs_the_model_the_plan_records_and_says_when_it_costs_another(tmp_path, capsys):
    """A plan packed with --model: hbp-simulate costs that model's shape (its time is the cost model's for that
    shape, not for the calibration's Llama-3-8B), naming it; --model-shape another shape costs that one with one
    warning line naming the plan's model; a plan without a record is costed on the calibration's shape with one
    warning line saying so; plans of different models are refused in one line."""
    from data_tools import simulate as cli
    from data_tools.simulation.plans import load_plan
    from tests.test_planning_cli import save_model_config

    lengths = np.random.default_rng(3).integers(10, 1024, 400)
    mine = save_model_config(tmp_path / "my-qwen", hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                             num_hidden_layers=3)
    recorded = _planned(tmp_path, "recorded.json", lengths, mine)
    plain = _planned(tmp_path, "plain.json", lengths)
    capsys.readouterr()

    def run(plan, *flags):
        out = tmp_path / "report.json"
        assert cli.main(["--plan", str(plan), "--out", str(out), *flags]) == 0
        captured = capsys.readouterr()
        report = json.loads(out.read_text())
        return report["cost_model"]["model_shape"], report["plans"][1]["simulated_seconds"], captured

    shape, seconds, captured = run(recorded)
    assert shape["name"] == "my-qwen" and (shape["hidden"], shape["num_heads"], shape["num_layers"]) == (96, 6, 3)
    assert not captured.err and "model: my-qwen (llama, 6 heads, 2 kv heads;" in captured.out
    assert "shape my-qwen" in captured.out
    expected = CostModel.from_calibration(None, shape)
    assert seconds == pytest.approx(simulate(load_plan(str(recorded)), expected).summary()["simulated_seconds"])

    shape, other_seconds, captured = run(recorded, "--model-shape", "llama3-8b")
    assert shape["name"] == "llama3-8b" and other_seconds > 100 * seconds  # an 8B model, not the user's
    assert captured.err.count("\n") == 1 and captured.err.startswith(
        "warning: costing --model-shape llama3-8b, not the model of ") and "my-qwen (llama, 6 heads" in captured.err

    shape, plain_seconds, captured = run(plain)
    assert shape["name"] == "llama3-8b" and plain_seconds == pytest.approx(other_seconds, rel=1e-9)
    assert captured.err.count("\n") == 1 and captured.err.startswith(
        "warning: the plan records no model: costing llama3-8b (the calibration's shape)"), captured.err

    other = _planned(tmp_path, "other.json", lengths, save_model_config(tmp_path / "other", num_hidden_layers=2))
    capsys.readouterr()
    assert exit_code(cli.main, ["--plan", str(recorded), "--plan", str(other)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "made for different models (my-qwen" in err and "give --model-shape" in err


def test_compare_costs_and_checks_the_model_given(tmp_path, capsys):
    """hbp-compare --model DIR: its SP degrees checked against the model's heads, its shape costed; without it,
    one warning line names the calibration's shape it costs instead."""
    from data_tools import compare
    from tests.test_planning_cli import save_model_config

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(map(str, np.random.default_rng(4).integers(10, 1024, 200))))
    base = ["--lengths", str(lengths), "--world-size", "4", "--groups", "256:1,1024:2", "--strategies", "isf,hbp",
            "--global-tokens", "8192", "--quiet", "--out", str(tmp_path / "cmp.json")]
    five = save_model_config(tmp_path / "five", hidden_size=40, num_attention_heads=5, num_key_value_heads=5)
    assert exit_code(compare.main, [*base, "--model", str(five)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--groups 1024:2: sp=2 does not divide the model's 5 attention heads" in err
    assert compare.main([*base, "--model", str(save_model_config(tmp_path / "mine"))]) == 0
    captured = capsys.readouterr()
    assert not captured.err and "shape mine" in captured.out
    assert json.loads((tmp_path / "cmp.json").read_text())["cost_model"]["model_shape"]["name"] == "mine"
    assert compare.main(base) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("warning: no --model given: costing llama3-8b"), err
