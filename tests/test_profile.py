"""Tests for hbp_train/profiler/search.py: Alg. 4 / 3 / 1 on injected curves, OOM and time-budget handling, the NVML
fallback, the real measurement code path on a tiny CPU model, and the CLI (--dry-run, no GPU)."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest

from hbp_train.profiler import search as prof
from hbp_train.profiler.search import CurveBackend, ProfileConfig, Profiler

GB = 10 ** 9
LAYERS = 16


class FakeClock:
    """Simulated seconds; the curve backend advances it by the simulated cost of each measurement."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def linear_mem(base=20 * GB, full=3e5, kept=5e4):
    """Bytes per rank: fixed states + per-token activations, full for plain layers, `kept` for checkpointed."""
    return lambda l, sp, c: base + (l / sp) * ((LAYERS - c) * full + c * kept)


def compute_time(comm_per_token=2e-7, recompute=0.3):
    """Seconds per pack: work/sp (attention quadratic), recompute for checkpointed layers, comm growing with sp."""
    def time_fn(l, sp, c):
        work = LAYERS * (1e-6 * l + 2e-12 * l * l)
        return work * (1 + recompute * c / LAYERS) / sp + (comm_per_token * l * (sp - 1) / sp if sp > 1 else 0)
    return time_fn


def cfg(**kw) -> ProfileConfig:
    base = dict(max_len=131072, min_len=8192, world_size=8, headroom=0.9, memory_metric="torch", iters=2,
                progress=False, time_budget_s=1e9)
    base.update(kw)
    return ProfileConfig(**base)


def backend(time_fn=None, mem_fn=None, device=80 * GB, num_gpus=8, clock=None):
    return CurveBackend(time_fn or compute_time(), mem_fn or linear_mem(), LAYERS, device, num_gpus=num_gpus,
                        sleep=clock.advance if clock else None)


def brute_min_ckpt(mem_fn, l, sp, budget):
    """The fewest checkpointed layers whose memory fits, by trying every count (None if none fits)."""
    return next((c for c in range(LAYERS + 1) if mem_fn(l, sp, c) <= budget), None)


# ------------------------------------------------------------------------------------------------- Alg. 4
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
    assert "OOM" in prof._status(choice.measurement)


# ------------------------------------------------------------------------------------------------- Alg. 3
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


# ------------------------------------------------------------------------------------------------- Alg. 1
def strategies(spec):
    """{length: Strategy} from {length: (sp, ckpt, tokens/s/GPU)}."""
    return {l: prof.Strategy(l, sp, c, l / (tps * sp), tps, False, "curve") for l, (sp, c, tps) in spec.items()}


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
    assert "pack_len" in prof.format_table(out) and "chosen groups" in prof.format_table(out)


def test_estimated_marks_for_sp_beyond_the_gpus_present():
    p = Profiler(backend(num_gpus=2), cfg())
    out = p.run()
    for m in out["measurements"]:
        assert m["estimated"] == (m["sp"] > 2)
    for g in out["groups"]:
        assert g["estimated"] == (g["sp"] > 2)
    assert any(g["estimated"] for g in out["groups"]), "the 128K group needs sp > 2 on these curves"
    assert "estimated" in prof.format_table(out)


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
    with pytest.raises(prof.ProfileError, match="no candidate pack length fits"):
        p.run()


def test_memory_metric_nvml_is_used_when_present():
    # NVML reads 10 GB more than torch (allocator cache): fewer layers fit than torch's peak says.
    mem = linear_mem()
    b = CurveBackend(compute_time(), mem, LAYERS, 80 * GB, nvml_fn=lambda l, sp, c: mem(l, sp, c) + 10 * GB)
    nv = Profiler(b, cfg(memory_metric="nvml")).greedy_profile_ckpt(32768, 1)
    to = Profiler(backend(mem_fn=mem), cfg(memory_metric="torch")).greedy_profile_ckpt(32768, 1)
    assert nv.ckpt_layers > to.ckpt_layers


# ---------------------------------------------------------------------------------------------- config
def test_candidate_lengths_and_sp_degrees():
    c = cfg(max_len=100000, min_len=5000, world_size=12)
    assert c.candidate_lengths() == [8192, 16384, 32768, 65536, 100000]
    assert c.sp_candidates() == [1, 2, 4]
    assert cfg(lengths=[4096, 12288]).candidate_lengths() == [4096, 12288, 131072]


@pytest.mark.parametrize("field,value", [("headroom", 1.5), ("iters", 0), ("sp_degrees", [3]),
                                         ("memory_metric", "rss"), ("time_budget_s", 0), ("docs", "/nonexistent")])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=f"profile.{field}"):
        cfg(**{field: value})


# ------------------------------------------------------------------------------------------------ NVML
def test_no_nvml_degrades_with_one_log_line(monkeypatch, caplog):
    import pynvml

    def fail():
        raise pynvml.NVMLError(pynvml.NVML_ERROR_LIBRARY_NOT_FOUND)
    monkeypatch.setattr(pynvml, "nvmlInit", fail)
    monkeypatch.setitem(prof._nvml, "state", None)
    with caplog.at_level(logging.WARNING, logger="hbp_train.profiler.search"):
        assert prof.nvml_used_bytes(0) is None
        assert prof.nvml_used_bytes(0) is None
        assert prof.nvml_hardware() is None
    lines = [r for r in caplog.records if "NVML" in r.getMessage()]
    assert len(lines) == 1 and "NVMLError_LibraryNotFound" in lines[0].getMessage()


# ------------------------------------------------------------------------------------- memory model
def test_analytic_memory_model_orders():
    shape = prof.parse_model_shape("llama3-8b")
    job = prof.JobSettings(zero_stage=2)
    mem = [prof.analytic_memory_bytes(shape, 32768, 1, c, 8, job) for c in range(0, 33, 8)]
    assert all(a > b for a, b in zip(mem, mem[1:])), "more checkpointing must need less memory"
    # Per rank, an SP degree of 4 on 128K holds the activations of a 32K pack.
    assert prof.analytic_memory_bytes(shape, 131072, 4, 8, 8, job) == pytest.approx(mem[1], rel=1e-3)
    z3 = prof.analytic_memory_bytes(shape, 32768, 1, 8, 8, prof.JobSettings(zero_stage=3))
    off = prof.analytic_memory_bytes(shape, 32768, 1, 8, 8, prof.JobSettings(zero_stage=2, offload_optimizer=True))
    assert z3 < mem[1] and off < mem[1]


TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False, vocab_size=512)


def test_measurement_code_path_on_a_tiny_cpu_model():
    """GpuBackend's real fwd+bwd path (model.py, loss.py, checkpointing, SP estimate) on the CPU: times only."""
    from hbp_train.perf.cost_model import CostModel
    from hbp_train.model import ModelConfig, num_params

    model_cfg = ModelConfig(config=dict(TINY), dtype="fp32", attention_backend="sdpa_block")
    shape = prof.model_shape_of(model_cfg, None)
    c = cfg(max_len=512, min_len=128, world_size=2, warmup_iters=0, iters=1)
    b = prof.GpuBackend(model_cfg, c, CostModel.from_calibration(model_shape=shape), prof.JobSettings(),
                        device="cpu")
    assert num_params(b.model) == shape.num_params, "the analytic parameter count must match the model"
    # The measured GPU holds the params and their grads in full, in the model's dtype; the job holds its ZeRO shards.
    held = 2 * sum(p.numel() * p.element_size() for p in b.model.parameters())
    assert b.state_correction == prof.model_state_bytes(shape.num_params, 2, prof.JobSettings()) - held
    assert b.num_layers == 2
    plain = b.measure(128, 1, 0, 1)
    ckpt = b.measure(128, 1, 2, 1)
    est = b.measure(128, 2, 1, 1)
    for m in (plain, ckpt, est):
        assert not m.oom and m.time_s > 0 and m.peak_mem_bytes is None
    assert not plain.estimated and est.estimated and "slice" in est.note
    # The estimate's arithmetic, with the slice run replaced by a known reading: slice time + the attention swap
    # (whole-pack attention / sp for the slice's own) + (2L + c) forward all-to-all sets; memory + a2a buffers.
    ran = []

    def fake_run(docs, ckpt_layers, iters):
        ran.append(list(docs))
        return 0.5, 10 ** 9, 2 * 10 ** 9
    b._run = fake_run
    cm, sp, c, L = b.cost_model, 4, 1, 2
    m = b.measure(512, sp, c, 1)
    assert ran == [[128]] and m.estimated
    swap = L * (cm.attention_fwdbwd([512]).sum() / sp - cm.attention_fwdbwd([128]).sum()) + \
        c * (cm.attention_fwd([512]).sum() / sp - cm.attention_fwd([128]).sum())
    a2a = float(cm.a2a_seconds(512, sp))
    assert a2a > 0 and m.time_s == pytest.approx(0.5 + swap + (2 * L + c) * a2a, rel=1e-12)
    buffers = 2 * (512 // sp) * shape.a2a_width(sp) * 2
    assert m.peak_mem_bytes == 10 ** 9 + b.state_correction + buffers
    assert m.nvml_used_bytes == 2 * 10 ** 9 + b.state_correction + buffers


def test_library_oom_is_infeasible_and_other_errors_stop_the_profile(monkeypatch):
    """On a GPU an OOM may also come as a plain RuntimeError (cuBLAS workspace, a raw CUDA error): like torch's
    OutOfMemoryError it marks the configuration infeasible; any other error still stops the profile."""
    import torch

    from hbp_train import loss
    from hbp_train.perf.cost_model import CostModel
    from hbp_train.model import ModelConfig

    model_cfg = ModelConfig(config=dict(TINY), dtype="fp32", attention_backend="sdpa_block")
    shape = prof.model_shape_of(model_cfg, None)
    b = prof.GpuBackend(model_cfg, cfg(max_len=512, min_len=128, warmup_iters=0, iters=1),
                        CostModel.from_calibration(model_shape=shape), prof.JobSettings(), device="cpu")
    errors = [torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
              RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
              RuntimeError("CUDA error: out of memory")]
    for error in errors:
        def fail(*args, error=error, **kwargs):
            raise error
        monkeypatch.setattr(loss, "chunked_token_losses", fail)
        m = b.measure(128, 1, 0, 1)
        assert m.oom and m.time_s is None, error

    def broken(*args, **kwargs):
        raise RuntimeError("shape mismatch")
    monkeypatch.setattr(loss, "chunked_token_losses", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        b.measure(128, 1, 0, 1)


def test_nvml_reading_failure_degrades_to_torch_counters(monkeypatch, caplog):
    import pynvml

    def fail(*args):
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)
    monkeypatch.setitem(prof._nvml, "state", True)  # NVML initialised, but this GPU hides its memory reading
    monkeypatch.setattr(pynvml, "nvmlDeviceGetHandleByIndex", lambda index: object())
    monkeypatch.setattr(pynvml, "nvmlDeviceGetMemoryInfo", fail)
    with caplog.at_level(logging.WARNING, logger="hbp_train.profiler.search"):
        assert prof.nvml_used_bytes(0) is None
        assert prof.nvml_used_bytes(0) is None and prof.nvml_hardware() is None
    assert len([r for r in caplog.records if "NVML" in r.getMessage()]) == 1


# ----------------------------------------------------------------------------------------------- CLI
def run_cli(argv, capsys):
    rc = prof.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_dry_run_writes_a_profile_pack_reads(tmp_path, capsys):
    from data_tools.pack import parse_groups

    path = tmp_path / "profile.json"
    rc, out, _ = run_cli(["model=tiny_llama", "profile.dry_run=true", f"profile.output={path}",
                          "profile.max_len=65536", "profile.world_size=4", "profile.progress=false",
                          "profile.device_memory_gb=0.25"], capsys)
    assert rc == 0
    data = json.loads(path.read_text())
    assert data["source"] == "analytic" and all(m["source"] == "analytic" for m in data["measurements"])
    assert "ANALYTIC" in out and "chosen groups" in out
    assert data["model"]["num_layers"] == 2 and data["job"]["zero_stage"] == 2
    for key in ("hardware", "config", "profiler", "strategies", "warnings"):
        assert key in data
    specs = parse_groups("auto", str(path), 4)
    assert [(g.pack_len, g.sp, g.ckpt_layers) for g in specs] == \
        [(g["pack_len"], g["sp"], g["ckpt_layers"]) for g in data["groups"]]
    # A quarter GB device: 64K packs need SP, so the round trip carries an sp > 1 group.
    assert any(g.sp > 1 for g in specs)


def test_cli_without_gpu_is_one_line_and_exit_2(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, _, err = run_cli(["model=tiny_llama", "profile.progress=false"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "profile.dry_run=true" in err


def test_cli_bad_value_is_one_line_and_exit_2(capsys):
    rc, _, err = run_cli(["profile.headroom=2", "profile.dry_run=true"], capsys)
    assert rc == 2 and "profile.headroom" in err and len(err.strip().splitlines()) == 1
    rc, out, _ = run_cli(["--help"], capsys)
    assert rc == 0 and "dry_run" in out and "time_budget_s" in out


def test_sp_degrees_limited_to_what_ulysses_can_split():
    shape = prof.parse_model_shape({"hidden": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "ffn": 176,
                                    "vocab": 512})
    assert prof.usable_sp_degrees([1, 2, 4, 8], shape) == [1, 2, 4]
    p = Profiler(backend(), cfg(), sp_degrees=[1, 2, 4])
    p.find_best_sp_ckpt(131072)
    assert {m.sp for m in p.measurements} <= {1, 2, 4}


LLAMA8B_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
                  "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
                  "rope_theta": 500000.0, "tie_word_embeddings": False}


def test_cli_dry_run_8b_from_a_config_json_alone(tmp_path, capsys):
    """The 128K experiment preset on a machine without the weights: a folder with only config.json (no tokenizer:
    the config's vocabulary is used), no data.shards (the profiler reads no data). The l_max group's checkpoint
    count is the fewest layers that fit the analytic memory model."""
    from data_tools.pack import parse_groups

    model_dir = tmp_path / "llama8b"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(LLAMA8B_CONFIG))
    path = tmp_path / "p8.json"
    rc, out, err = run_cli(["experiment=llama3_8b_128k", f"model.name_or_path={model_dir}", "profile.dry_run=true",
                            "profile.progress=false", f"profile.output={path}"], capsys)
    assert rc == 0, err
    data = json.loads(path.read_text())
    assert data["model"]["vocab"] == 128256 and data["model"]["num_layers"] == 32
    assert data["job"]["zero_stage"] == 3 and data["job"]["loss_chunk_tokens"] == 8192
    top = data["groups"][-1]
    assert top["pack_len"] == 131072 and top["role"].endswith("l_max")
    shape = prof.parse_model_shape(data["model"])
    job = prof.JobSettings(3, False, 8192)
    fits = [c for c in range(33)
            if prof.analytic_memory_bytes(shape, 131072, top["sp"], c, 8, job) <= data["memory_budget_bytes"]]
    assert top["ckpt_layers"] == min(fits) and 0 < top["ckpt_layers"] < 32
    # One document per pack makes the shortest candidate the best: said in the output.
    assert data["l_best"] == 8192 and any("profile.docs" in w for w in data["warnings"])
    # Every sp > 1 would run as its 1/sp slice on one GPU.
    want = sum(4 * m["time_s"] / m["sp"] for m in data["measurements"] if m["time_s"])
    assert data["profiler"]["predicted_gpu_measure_s"] == pytest.approx(want, abs=0.1)
    assert [(g.pack_len, g.sp, g.ckpt_layers) for g in parse_groups("auto", str(path), 8)] == \
        [(g["pack_len"], g["sp"], g["ckpt_layers"]) for g in data["groups"]]


def test_cli_missing_model_dir_and_unwritable_output_are_one_line(tmp_path, capsys):
    rc, _, err = run_cli(["model=llama3_8b", "model.name_or_path=/nonexistent/model", "profile.dry_run=true"],
                         capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "config.json" in err
    blocker = tmp_path / "file"
    blocker.write_text("")
    rc, _, err = run_cli(["profile.dry_run=true", f"profile.output={blocker}/p.json"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "profile.output" in err
    rc, _, err = run_cli(["profile.dry_run=true", "profile.progress=false", f"profile.output={tmp_path}"], capsys)
    assert rc == 2 and err.strip() == f"profile: profile.output={tmp_path}: cannot write there (it is a directory; " \
        "give a file path such as profile.json)"  # found before the profiling, not after it


def test_gpu_run_needs_a_tokenizer(tmp_path):
    with pytest.raises(ValueError, match="model.tokenizer"):
        prof.tokenizer_vocab(str(tmp_path), dry_run=False)
    assert prof.tokenizer_vocab(str(tmp_path), dry_run=True) is None


def test_memory_preflight_names_the_groups_that_will_not_fit():
    from hbp_train.perf.cost_model import MODEL_SHAPES
    from hbp_train.profiler.search import JobSettings, analytic_memory_bytes, memory_preflight

    shape, job, gpu = MODEL_SHAPES["llama3-8b"], JobSettings(zero_stage=2), 80 * 2**30
    groups = [{"pack_len": 16384, "sp": 1, "ckpt_layers": 32}, {"pack_len": 131072, "sp": 8, "ckpt_layers": None},
              {"pack_len": 131072, "sp": 8, "ckpt_layers": 32}]
    warnings = memory_preflight(groups, shape, 32, job, gpu)
    need = [analytic_memory_bytes(shape, g["pack_len"], g["sp"], g["ckpt_layers"] or 0, 32, job) for g in groups]
    assert [need_g > 0.95 * gpu for need_g in need] == [False, True, False]  # the model's own verdict
    assert len(warnings) == 1 and warnings[0].startswith("group 1 (131072 tokens, sp=8, 0 checkpointed layers)")
    assert "raise its ckpt_layers" in warnings[0]
    assert memory_preflight(groups[:1], shape, 32, job, 2**30)[0].startswith("group 0")  # a 1 GiB GPU fits nothing


def test_model_shape_follows_build_model_vocabulary_rule():
    from hbp_train.model import ModelConfig
    from hbp_train.profiler.search import model_shape_of

    tiny = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2}
    assert model_shape_of(ModelConfig(config=tiny), 4096).vocab == 4096  # the tokenizer's, as build_model
    assert model_shape_of(ModelConfig(config={**tiny, "vocab_size": 128256}), 4096).vocab == 128256  # the larger
    assert model_shape_of(ModelConfig(config={**tiny, "vocab_size": 100}), 4096).vocab == 4096


# ---------------------------------------- choices and memory accounting against brute force and the ZeRO paper
@pytest.mark.parametrize("stage,offload", [(0, False), (1, False), (2, False), (3, False), (2, True), (3, True)])
def test_model_state_bytes_follow_the_zero_papers_accounting(stage, offload):
    """Per GPU, bf16 mixed precision (ZeRO paper Fig. 1, plus DeepSpeed's fp32 gradient partition): params 2 B
    (sharded from stage 3), grads 2 B (from stage 2), fp32 master + Adam m, v + fp32 grads 16 B (from stage 1;
    none on the GPU with optimizer offload)."""
    params, world = 1_000_000, 8
    shard = {k: (world if stage >= k else 1) for k in (1, 2, 3)}
    want = 2 * params / shard[3] + 2 * params / shard[2] + (0 if offload else 4 * 4 * params / shard[1])
    got = prof.model_state_bytes(params, world, prof.JobSettings(zero_stage=stage, offload_optimizer=offload))
    assert got == int(want)


def test_analytic_memory_counts_one_recomputed_layer_only_with_checkpointing():
    """Checkpointing the first layer swaps its full activations for its input (2h B/token) but adds the one layer
    rebuilt in backward (full activations); each further checkpointed layer only saves full - 2h."""
    shape = prof.parse_model_shape("llama3-8b")
    job, tokens = prof.JobSettings(zero_stage=2), 8192
    kv = shape.num_kv_heads * shape.head_dim
    full = 2 * (4 * shape.hidden + 3 * shape.num_heads * shape.head_dim + 3 * kv + 4 * shape.ffn)  # the docstring's list
    kept = 2 * shape.hidden
    mem = [prof.analytic_memory_bytes(shape, tokens, 1, c, 8, job) for c in range(4)]
    assert mem[1] - mem[0] == tokens * kept
    assert mem[2] - mem[1] == mem[3] - mem[2] == tokens * (kept - full)


def test_fits_is_inclusive_of_the_budget():
    p = Profiler(backend(), cfg())
    at = prof.Measurement(8192, 1, 0, 1.0, p.budget_bytes, None)
    over = prof.Measurement(8192, 1, 0, 1.0, p.budget_bytes + 1, None)
    assert p.fits(at) and not p.fits(over)


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


def test_l_best_ties_go_to_the_longer_length():
    p = Profiler(backend(), cfg())
    groups = p.select_groups(strategies({16384: (1, 0, 1000.0), 32768: (1, 0, 1000.0), 131072: (8, 4, 500.0)}))
    assert [g["pack_len"] for g in groups if "l_best" in g["role"]] == [32768]


@pytest.mark.parametrize("docs,sp", [([100], 4), ([7, 300, 1, 45], 4), ([5, 5, 5, 30], 4), ([1000, 3, 2, 1], 2)])
def test_slice_docs_is_the_pack_shrunk_by_sp(docs, sp):
    part = prof.slice_docs(docs, sp)
    assert sum(part) == sum(docs) // sp and all(d >= 1 for d in part)
    assert len(part) == len(docs)
    assert all(abs(p - d / sp) <= 1 + 1e-9 or d < sp for p, d in zip(part, docs))


def test_slice_docs_of_more_documents_than_slice_tokens_ends():
    # 3 documents, 15 tokens, sp 8: the slice has 1 token, so it cannot keep one token per document
    assert prof.slice_docs([5, 5, 5], 8) == [1]
    assert prof.slice_docs([1] * 10, 4) == [1, 1]


def test_docs_file_draws_documents_from_the_dataset_lengths(tmp_path):
    pool = [3000, 500, 7000, 120]
    for path in (tmp_path / "l.npy", tmp_path / "l.json", tmp_path / "l.txt"):
        if path.suffix == ".npy":
            np.save(path, np.array(pool))
        elif path.suffix == ".json":
            path.write_text(json.dumps({"lengths": pool}))
        else:
            path.write_text("\n".join(map(str, pool)))
        assert prof.load_doc_lengths(str(path)).tolist() == pool
    docs = prof.synthetic_docs(32768, prof.load_doc_lengths(str(tmp_path / "l.txt")), seed=1)
    assert sum(docs) == 32768 and len(docs) > 1
    assert all(d in pool for d in docs[:-1]) and docs[-1] <= max(pool)
    assert prof.synthetic_docs(32768, None) == [32768]
    bad = tmp_path / "bad.txt"
    bad.write_text("12\n0\n")
    with pytest.raises(ValueError, match="profile.docs"):
        prof.load_doc_lengths(str(bad))


def test_gpu_backend_pack_restarts_positions_and_masks_labels_per_document(tmp_path, monkeypatch):
    """The synthetic pack of a docs file: position_ids restart at every document and each document's last token
    has no target (labels shifted within the document)."""
    from hbp_train import model as model_mod
    from hbp_train.perf.cost_model import CostModel
    from hbp_train.model import ModelConfig

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("40\n25\n70\n")
    model_cfg = ModelConfig(config=dict(TINY), dtype="fp32", attention_backend="sdpa_block")
    shape = prof.model_shape_of(model_cfg, None)
    c = cfg(max_len=512, min_len=128, world_size=2, warmup_iters=0, iters=1, docs=str(lengths))
    b = prof.GpuBackend(model_cfg, c, CostModel.from_calibration(model_shape=shape), prof.JobSettings(),
                        device="cpu")
    seen = {}
    real_forward = model_mod.forward_hidden

    def spy(model, input_ids, position_ids, **kw):
        seen["input_ids"], seen["position_ids"] = input_ids.clone(), position_ids.clone()
        return real_forward(model, input_ids, position_ids, **kw)
    from hbp_train import loss as loss_mod
    real_chunked = loss_mod.chunked_token_losses

    def loss_spy(hidden, weight, labels, chunk):
        seen["labels"] = labels.clone()
        return real_chunked(hidden, weight, labels, chunk)
    monkeypatch.setattr(model_mod, "forward_hidden", spy)
    monkeypatch.setattr(loss_mod, "chunked_token_losses", loss_spy)
    b.measure(256, 1, 0, 1)
    docs = prof.synthetic_docs(256, prof.load_doc_lengths(str(lengths)), c.seed)
    want_pos = np.concatenate([np.arange(d) for d in docs])
    assert seen["position_ids"][0].tolist() == want_pos.tolist()
    ids, labels = seen["input_ids"][0], seen["labels"][0]
    start = 0
    for d in docs:
        assert labels[start:start + d - 1].tolist() == ids[start + 1:start + d].tolist()
        assert int(labels[start + d - 1]) == -100
        start += d
