"""Simulator on tiny hand-built plans with a toy cost model (slot times computed by hand), and its CLI."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from hbp_train.cost_model import CostModel
from hbp_train.planning.plan import GroupSpec, Plan, PlanConfig, pack_csr
from hbp_train.planning.simulate import SimConfig, simulate, speedup


class SquareCost:
    """Toy cost model: a pack costs sum(len^2) / sp + 10 * ckpt_layers seconds (no comm)."""

    shape = SimpleNamespace(num_layers=4)

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
    return Plan(config=cfg, lengths=np.asarray(lengths, np.int64), pack_ptr=ptr, pack_samples=flat,
                pack_group=np.asarray(pack_group, np.int32),
                step_ptr=np.concatenate([[0], np.cumsum(step_sizes)]).astype(np.int64),
                step_packs=np.arange(len(packs), dtype=np.int64), step_group=np.asarray(step_group, np.int32),
                extra=extra or {})


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


def test_cli_bad_input_exits_2(tmp_path, capsys):
    from data_tools import simulate as cli

    bad = tmp_path / "x.json"
    bad.write_text("[1, 2")
    assert cli.main(["--plan", str(bad)]) == 2
    assert "invalid JSON" in capsys.readouterr().err
    assert cli.main(["--plan", str(tmp_path / "missing.json")]) == 2
    assert cli.main(["--plan", str(bad), "--calibration", str(bad)]) == 2
    capsys.readouterr()
    good = tmp_path / "plan.json"
    plan_a().to_json(good)
    # Outputs that cannot be written, and more checkpointed layers than the model has: one line, exit 2.
    for flags in (["--out", str(bad / "r.json")], ["--plot", str(tmp_path)], ["--ckpt-layers", "33"]):
        assert cli.main(["--plan", str(good), *flags]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and err.startswith("error:")


def test_compare_cli_all_strategies(tmp_path, capsys):
    from data_tools import compare

    rng = np.random.default_rng(1)
    lengths = np.minimum(rng.lognormal(6, 1.2, 1500).astype(int) + 1, 16000)
    f = tmp_path / "lengths.txt"
    f.write_text("\n".join(map(str, lengths)))
    out, png = tmp_path / "cmp.json", tmp_path / "cmp.png"
    assert compare.main(["--lengths", str(f), "--world-size", "8", "--groups", "2048:1,16384:4", "--global-tokens",
                         str(16384 * 4), "--quiet", "--out", str(out), "--plot", str(png)]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == set(compare.STRATEGIES)
    assert rows["isf"]["speedup"] == 1.0
    assert rows["bytescale"]["sync"] == "step" and rows["hbp"]["sync"] == "micro"
    for r in rows.values():
        assert r["tokens"] == int(lengths.sum()) and r["simulated_seconds"] > 0
        assert r["speedup"] == pytest.approx(rows["isf"]["simulated_seconds"] / r["simulated_seconds"])
    assert rows["wlb"]["mean_deferred_wait_steps"] is not None
    assert "speed-up" in capsys.readouterr().out and png.stat().st_size > 10_000
    assert compare.main(["--lengths", str(f), "--world-size", "8", "--groups", "2048:3"]) == 2
    # Groups from a profile (the profiler's JSON), as data_tools.pack reads them.
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps({"groups": [{"pack_len": 2048, "sp": 1, "ckpt_layers": 0},
                                              {"pack_len": 16384, "sp": 4, "ckpt_layers": 8}]}))
    capsys.readouterr()
    assert compare.main(["--lengths", str(f), "--world-size", "8", "--groups", "auto", "--profile", str(profile),
                         "--strategies", "isf,hbp", "--quiet", "--out", str(out)]) == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"isf", "hbp"} and rows["hbp"]["num_steps"] > 0
    assert compare.main(["--lengths", str(f), "--world-size", "8", "--groups", "auto"]) == 2
    assert "--profile" in capsys.readouterr().err
    assert compare.main(["--lengths", str(f), "--world-size", "8", "--groups", "2048:1", "--strategies", "x"]) == 2
