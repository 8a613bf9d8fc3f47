"""Tests for hbp_train/profiler/search.py: Alg. 4 / 3 / 1 against brute force on injected curves, OOM handling,
the time budget (simulated clock), and the choice of groups."""

from __future__ import annotations

import json
import math

import pytest

from hbp_train.common.errors import UserError
from hbp_train.profiler.backends import CurveBackend, Measurement
from hbp_train.profiler.report import format_table
from hbp_train.profiler.search import Profiler, ProfileError, Strategy, _status
from tests.profiler_curves import (GB, LAYERS, FakeClock, backend, brute_min_ckpt, cfg, compute_time,
                                   linear_mem)


@pytest.mark.parametrize("l,sp", [(8192, 1), (32768, 1), (65536, 2), (131072, 1), (131072, 4), (131072, 8)])
def test_greedy_ckpt_on_linear_memory_is_the_fewest_that_fit(l, sp):
    mem = linear_mem()
    b = backend(mem_fn=mem)
    p = Profiler(b, cfg())
    choice = p.greedy_profile_ckpt(l, sp)
    want = brute_min_ckpt(mem, l, sp, p.budget_bytes)
    if want is None:
        assert choice.status == "infeasible"
    else:
        assert choice.status == "ok" and choice.ckpt_layers == want
        assert choice.measurement.ckpt_layers == want and p.fits(choice.measurement)
        # Linear memory: the fit is exact, so the first verified count is right (no step-up), whatever number
        # of probes ran out of memory before one ran.
        assert sum(m.purpose == "verify" for m in p.measurements) <= 1
        probes = [m for m in p.measurements if m.purpose == "ckpt-probe"]
        assert all(m.oom for m in probes[:-1])


def test_greedy_ckpt_covers_every_case_of_the_linear_curve():
    """The parametrised lengths include a no-checkpointing case, an intermediate one and an infeasible one."""
    mem, budget = linear_mem(), int(0.9 * 80 * GB)
    wants = {brute_min_ckpt(mem, l, sp, budget) for l, sp in [(8192, 1), (32768, 1), (131072, 1), (131072, 8)]}
    assert 0 in wants and None in wants and any(w not in (0, None, LAYERS) for w in wants)


def test_greedy_ckpt_steps_up_when_the_linear_fit_is_too_optimistic():
    # Memory grows faster than linearly as checkpointing is removed: extrapolating the line through the points
    # at 16 and 8 checkpointed layers below 8 underestimates, so the first verified count does not fit.
    def mem(l, sp, c):
        plain = LAYERS - c
        return 20 * GB + (l / sp) * (plain * 1e5 + plain ** 2 * 2e4)
    b = backend(mem_fn=mem)
    p = Profiler(b, cfg())
    choice = p.greedy_profile_ckpt(16384, 1)
    assert choice.status == "ok" and p.fits(choice.measurement)
    want = brute_min_ckpt(mem, 16384, 1, p.budget_bytes)
    over = [m for m in p.measurements if m.purpose == "verify" and not p.fits(m)]
    assert over, "the first verified count must have been over budget"
    assert want <= choice.ckpt_layers < LAYERS
    # Step-up goes 1, 2, 4, ... layers: it overshoots the true minimum by less than the last step.
    assert choice.ckpt_layers - want < max(1, 2 ** (len(over) - 1))


def test_oom_is_recorded_as_infeasible_not_raised():
    # On a 60 GB device the probe at half the layers runs out of memory for 32K at sp=1.
    mem = linear_mem()
    b = backend(mem_fn=mem, device=60 * GB)
    p = Profiler(b, cfg())
    choice = p.greedy_profile_ckpt(32768, 1)
    ooms = [m for m in p.measurements if m.oom]
    assert ooms and all(m.time_s is None and m.peak_mem_bytes is None for m in ooms)
    assert choice.status == "ok" and choice.ckpt_layers == brute_min_ckpt(mem, 32768, 1, p.budget_bytes)
    # Every layer checkpointed and still out of memory: infeasible, again without an exception.
    choice = p.greedy_profile_ckpt(131072, 1)
    assert choice.status == "infeasible" and choice.measurement.oom
    assert "OOM" in _status(choice.measurement)


def test_oom_probe_moves_halfway_towards_all_layers():
    """Alg. 4's probe at half the layers runs out of memory: the next probe is halfway between it and all layers."""
    mem = linear_mem()
    device = 60 * GB
    p = Profiler(backend(mem_fn=mem, device=device), cfg())
    p.greedy_profile_ckpt(32768, 1)
    probes = [m.ckpt_layers for m in p.measurements if m.purpose == "ckpt-probe"]
    want, c = [], LAYERS // 2
    while True:
        want.append(c)
        if mem(32768, 1, c) <= device:
            break
        c = math.ceil((c + LAYERS) / 2)
    assert len(want) >= 3, "the curve must make more than one probe run out of memory"
    assert probes == want


def test_no_time_to_verify_falls_back_to_the_fewest_measured_layers_that_fit():
    """Budget spent after the all-layers point and the probe: the choice is the smallest measured count that fits
    (here the probe at half the layers), not all layers."""
    clock = FakeClock()
    b = backend()
    inner = b.measure

    def measure(*args):
        clock.advance(1.0)
        return inner(*args)
    b.measure = measure
    mem = linear_mem()
    p = Profiler(b, cfg(max_len=16384, lengths=[16384], sp_degrees=[1], time_budget_s=2.0), clock=clock)
    out = p.run()
    measured = [m.ckpt_layers for m in p.measurements]
    assert measured == [LAYERS, LAYERS // 2] and out["skipped"]
    fitting = [c for c in measured if mem(16384, 1, c) <= p.budget_bytes]
    assert out["groups"][-1]["ckpt_layers"] == min(fitting) < LAYERS
    assert brute_min_ckpt(mem, 16384, 1, p.budget_bytes) < min(fitting), "the unverified guess was lower"
    assert any("no time to verify" in w for w in out["warnings"])


def test_fits_is_inclusive_of_the_budget():
    p = Profiler(backend(), cfg())
    at = Measurement(8192, 1, 0, 1.0, p.budget_bytes, None)
    over = Measurement(8192, 1, 0, 1.0, p.budget_bytes + 1, None)
    assert p.fits(at) and not p.fits(over)


def test_memory_metric_nvml_is_used_when_present():
    # NVML reads 10 GB more than torch (allocator cache): fewer layers fit than torch's peak says.
    mem = linear_mem()
    b = CurveBackend(compute_time(), mem, LAYERS, 80 * GB, nvml_fn=lambda l, sp, c: mem(l, sp, c) + 10 * GB)
    nv = Profiler(b, cfg(memory_metric="nvml")).greedy_profile_ckpt(32768, 1)
    to = Profiler(backend(mem_fn=mem), cfg(memory_metric="torch")).greedy_profile_ckpt(32768, 1)
    assert nv.ckpt_layers > to.ckpt_layers


def brute_best_sp(time_fn, mem_fn, l, sps, budget):
    """Best (sp, ckpt) by throughput per GPU over every sp, each at its fewest fitting checkpoint count."""
    best = None
    for sp in sps:
        c = brute_min_ckpt(mem_fn, l, sp, budget)
        if c is None:
            continue
        tps = l / (time_fn(l, sp, c) * sp)
        if best is None or tps > best[2]:
            best = (sp, c, tps)
    return best


@pytest.mark.parametrize("prune", [False, True])
def test_find_best_sp_matches_exhaustive_search(prune):
    time_fn, mem_fn = compute_time(), linear_mem()
    p = Profiler(backend(time_fn, mem_fn), cfg(prune=prune))
    chosen = {}
    for l in [8192, 16384, 32768, 65536, 131072]:
        s = p.find_best_sp_ckpt(l)
        want = brute_best_sp(time_fn, mem_fn, l, [1, 2, 4, 8], p.budget_bytes)
        assert (s.sp, s.ckpt_layers) == want[:2]
        assert s.tokens_per_s_per_gpu == pytest.approx(want[2])
        chosen[l] = s.sp
    # The curves make short packs prefer no SP and long ones need it: the test exercises both outcomes.
    assert chosen[8192] == 1 and chosen[131072] > 1


def test_find_best_sp_trades_recompute_for_communication():
    # Cheap communication: more SP that saves recompute wins; expensive communication: checkpointing wins.
    mem_fn = linear_mem()
    for comm in (1e-9, 5e-6):
        time_fn = compute_time(comm_per_token=comm)
        p = Profiler(backend(time_fn, mem_fn), cfg(prune=False))
        s = p.find_best_sp_ckpt(65536)
        assert (s.sp, s.ckpt_layers) == brute_best_sp(time_fn, mem_fn, 65536, [1, 2, 4, 8], p.budget_bytes)[:2]
    cheap = Profiler(backend(compute_time(1e-9), mem_fn), cfg(prune=False)).find_best_sp_ckpt(65536)
    dear = Profiler(backend(compute_time(5e-6), mem_fn), cfg(prune=False)).find_best_sp_ckpt(65536)
    assert cheap.sp > dear.sp


def test_prune_stops_at_the_first_sp_without_checkpointing():
    mem = linear_mem()
    p = Profiler(backend(mem_fn=mem), cfg(prune=True))
    p.find_best_sp_ckpt(16384)
    first_free = next(sp for sp in [1, 2, 4, 8] if brute_min_ckpt(mem, 16384, sp, p.budget_bytes) == 0)
    assert first_free < 8, "the curve must leave larger degrees to prune"
    assert {m.sp for m in p.measurements} == {sp for sp in [1, 2, 4, 8] if sp <= first_free}


def test_sp_degrees_that_do_not_divide_the_pack_are_not_measured():
    p = Profiler(backend(), cfg(prune=False))
    length = 2 * 6145  # divisible by 2, not by 4 or 8
    p.find_best_sp_ckpt(length)
    assert {m.sp for m in p.measurements} == {1, 2}


def strategies(spec):
    """{length: Strategy} from {length: (sp, ckpt, tokens/s/GPU)}."""
    return {l: Strategy(l, sp, c, l / (tps * sp), tps, False, "curve") for l, (sp, c, tps) in spec.items()}


def test_groups_with_l2_above_l_best():
    # l_best = 32K at sp=2 -> l1 = 16K; l_max = 128K at sp=2 -> l2 = 64K > l_best: four groups.
    p = Profiler(backend(device=100 * GB), cfg())
    groups = p.select_groups(strategies({16384: (1, 4, 900.0), 32768: (2, 2, 1000.0), 65536: (2, 8, 800.0),
                                         131072: (2, 16, 500.0)}))
    assert [(g["pack_len"], g["sp"]) for g in groups] == [(16384, 1), (32768, 2), (65536, 1), (131072, 2)]
    assert [g["role"] for g in groups] == ["l1", "l_best", "l2", "l_max"]
    # l1 and l2 get their own fewest fitting checkpoint count at sp=1.
    for g in groups:
        if g["role"] in ("l1", "l2"):
            assert g["ckpt_layers"] == brute_min_ckpt(linear_mem(), g["pack_len"], 1, p.budget_bytes)


def test_groups_with_l2_below_l_best_and_dedup():
    # l_best = 32K at sp=2 -> l1 = 16K; l_max = 128K at sp=8 -> l2 = 16K <= l_best: three groups, l2 merged.
    p = Profiler(backend(), cfg())
    groups = p.select_groups(strategies({32768: (2, 0, 1000.0), 65536: (4, 0, 700.0), 131072: (8, 4, 600.0)}))
    assert [(g["pack_len"], g["sp"], g["role"]) for g in groups] == \
        [(16384, 1, "l1"), (32768, 2, "l_best"), (131072, 8, "l_max")]


def test_groups_when_best_needs_no_sp():
    # l_best at sp=1 is its own l1 (deduplicated); l_max = 64K at sp=2 -> l2 = 32K > l_best = 16K.
    p = Profiler(backend(), cfg(max_len=65536))
    groups = p.select_groups(strategies({16384: (1, 0, 1000.0), 32768: (1, 8, 900.0), 65536: (2, 8, 800.0)}))
    assert [(g["pack_len"], g["sp"], g["role"]) for g in groups] == \
        [(16384, 1, "l1,l_best"), (32768, 1, "l2"), (65536, 2, "l_max")]


def test_l_best_ties_go_to_the_longer_length():
    p = Profiler(backend(), cfg())
    groups = p.select_groups(strategies({16384: (1, 0, 1000.0), 32768: (1, 0, 1000.0), 131072: (8, 4, 500.0)}))
    assert [g["pack_len"] for g in groups if "l_best" in g["role"]] == [32768]


def test_full_run_writes_consistent_groups(tmp_path):
    time_fn, mem_fn = compute_time(), linear_mem()
    p = Profiler(backend(time_fn, mem_fn), cfg())
    out = p.run()
    best = {l: brute_best_sp(time_fn, mem_fn, l, [1, 2, 4, 8], p.budget_bytes) for l in p.cfg.candidate_lengths()}
    l_best = max(best, key=lambda l: (best[l][2], l))
    assert out["l_best"] == l_best and out["l_max"] == 131072
    lens = [g["pack_len"] for g in out["groups"]]
    assert lens == sorted(set(lens)) and lens[-1] == 131072 and l_best in lens
    assert l_best // best[l_best][0] in lens
    for g in out["groups"]:
        assert p.fits(next(m for m in p.measurements
                           if (m.pack_len, m.sp, m.ckpt_layers) == (g["pack_len"], g["sp"], g["ckpt_layers"])))
    json.dumps(out)  # serialisable as is
    assert "pack_len" in format_table(out) and "chosen groups" in format_table(out)


def test_estimated_marks_for_sp_beyond_the_gpus_present():
    p = Profiler(backend(num_gpus=2), cfg())
    out = p.run()
    for m in out["measurements"]:
        assert m["estimated"] == (m["sp"] > 2)
    for g in out["groups"]:
        assert g["estimated"] == (g["sp"] > 2)
    assert any(g["estimated"] for g in out["groups"]), "the 128K group needs sp > 2 on these curves"
    assert "estimated" in format_table(out)


def test_time_budget_stops_measuring_and_still_chooses():
    clock = FakeClock()
    starts = []
    b = backend(clock=clock)
    inner = b.measure

    def measure(*args):
        starts.append(clock())
        return inner(*args)
    b.measure = measure
    budget = 30.0
    p = Profiler(b, cfg(time_budget_s=budget), clock=clock)
    out = p.run()
    assert out["skipped"] and out["profiler"]["budget_exhausted"]
    assert all(t < budget for t in starts), "no measurement may start after the budget is spent"
    unlimited = Profiler(backend(), cfg())
    unlimited.run()
    assert len(starts) < len(unlimited.measurements)
    # The longest length is profiled first, so the mandatory l_max group is there.
    assert out["groups"][-1]["pack_len"] == 131072
    assert any("time budget" in s["reason"] for s in out["skipped"])


def test_nothing_fits_is_a_clear_error():
    p = Profiler(backend(device=10 * GB), cfg())
    with pytest.raises(ProfileError, match="no candidate pack length fits"):
        p.run()
    assert issubclass(ProfileError, UserError)  # the CLI prints it as one line (settings to change), exit 2
