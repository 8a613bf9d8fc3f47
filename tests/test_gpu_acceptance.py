"""Tests for bench/gpu_acceptance.py: the GPU acceptance command runs end to end on the CPU (--dry-run), writes
its JSON and markdown report with every check, and judges figures against their targets only on a real run."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import bench.gpu_acceptance as acc


def test_verdicts_compare_with_the_target_only_on_a_real_run():
    assert acc.verdict("tokens_per_s_ratio", 1.3, dry_run=False)["met"] is True
    assert acc.verdict("tokens_per_s_ratio", 1.1, dry_run=False)["met"] is False
    assert acc.verdict("cost_model_error", 0.08, dry_run=False)["met"] is True
    assert acc.verdict("cost_model_error", 0.12, dry_run=False)["met"] is False
    assert acc.verdict("cost_model_error", 0.12, dry_run=True)["met"] is None
    assert acc.verdict("mfu", None, dry_run=False)["met"] is None
    v = acc.verdict("backend_grad_cosine", 0.98, dry_run=False, target=0.99)
    assert v["met"] is False and v["target"] == ">= 0.99"


def test_unknown_check_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert acc.main(["--dry-run", "--out", str(tmp_path), "--checks", "backends,speed"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "unknown speed" in err[0]


@pytest.mark.slow
def test_dry_run_runs_every_check_end_to_end_on_the_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # main() sets these for a dry run; restored after the test
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    # The trainer check sets up a 1-process group in this process (RANK, MASTER_PORT, ...): recorded here so they
    # are removed after the test, and the group torn down, or a later subprocess inherits a port in use.
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.setenv(name, "unset")
        monkeypatch.delenv(name)
    try:
        assert acc.main(["--dry-run", "--out", str(tmp_path)]) == 0
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    report = json.loads((tmp_path / "acceptance.json").read_text())
    assert report["complete"] and report["dry_run"] and set(report["checks"]) == set(acc.CHECKS)
    failed = {name: r["error"] for name, r in report["checks"].items() if "error" in r}
    assert not failed
    checks = report["checks"]
    # every backend available on the CPU, and the decoder kernels a run gets by default, matched the eager
    # per-document reference in loss and gradients; each backend was timed and auto's choice compared with them
    rows = checks["backends"]["backends"]
    assert set(rows) == {"sdpa_block", "kernels=none"}
    assert all(r["loss_rel_error"] < 1e-4 and r["grad_min_cosine"] > 0.9999 for r in rows.values())
    assert rows["sdpa_block"]["attention_fwd_bwd_ms"] > 0 and checks["backends"]["auto"] == "sdpa_block"
    assert checks["backends"]["verdict"]["value"] == 1.0  # the one backend here is the fastest one
    # the step profile: the HF path and ours, every category, the table in the report
    profile = checks["step_profile"]["profile"]["paths"]
    assert set(profile) == {"hf_sdpa", "ours"} and all("error" not in t and t["kernel_ms"] > 0 for t in profile.values())
    # both HF paths, named, at 16K; the speed path at 4x the pack length
    for name, hf in (("trainer", {"hf_sdpa", "hf_sdpa_amp"}), ("trainer_64k", {"hf_sdpa"})):
        paths = checks[name]["paths"]
        assert set(paths) == {"ours"} | hf and not any(p["error"] for p in paths.values())
        assert paths["hf_sdpa"]["label"].startswith("HF speed path")
        assert paths["ours"]["decoder_kernels"].startswith("none") and "sdpa_block" in paths["ours"]["attention_kernel"]
    assert checks["trainer"]["paths"]["hf_sdpa_amp"]["label"].startswith("HF accuracy path")
    assert checks["trainer_64k"]["settings"]["pack_len"] == 4 * checks["trainer"]["settings"]["pack_len"]
    assert checks["trainer_64k"]["settings"]["baseline_ckpt"]
    assert checks["trainer"]["ours_tokens_per_s"] > 0 and checks["longest_pack"]["longest_pack_by_ckpt_layers"]
    assert checks["memory"]["packs"] and checks["calibration"]["packs"] and checks["profiler"]["exit_code"] == 0
    verdicts = acc.all_verdicts(report)
    assert len(verdicts) >= 7 and all(v["met"] is None for _, v in verdicts)  # a dry run judges nothing
    md = (tmp_path / "acceptance.md").read_text()
    for label, v in verdicts:
        assert f"| {label} | {v['what']} |" in md
    assert "| category | hf_sdpa | ours |" in md and "| hf_sdpa_amp | HF accuracy path" in md
    assert (tmp_path / "calibration.json").exists() and (tmp_path / "profile.json").exists()
    assert (tmp_path / "step_profile.json").exists() and (tmp_path / "step_profile.md").exists()


def test_the_plan_spends_the_default_budget_on_the_headline_first():
    """Each check is held to its own budget; the plan adds them up in the order of value. The default budget is spent
    on the headline first: the 16K comparison, whose HF path gets the time flex's first compile took on an H200
    (100-150 s, its model's build and steps on top) while ours keeps its own seconds, then the step profile; the rest
    run if earlier checks finish early. The search and the profiler are held to their own flag's seconds when those
    are fewer, and --check-budget gives a check more."""
    import bench.gpu.checks as checks

    args = acc.build_parser().parse_args(["--out", "x"])
    plan = acc.make_plan(list(acc.CHECKS), acc.budgets_of(args, False), args, acc.STARTUP_S)
    assert [(row["check"], row["fits"]) for row in plan] == [
        ("trainer", True), ("step_profile", True), ("trainer_64k", False), ("memory", True), ("calibration", False),
        ("backends", False), ("longest_pack", False), ("profiler", False)]
    ctx = SimpleNamespace(share_s=acc.BUDGET_S["trainer"])
    assert checks.inner_budget(ctx) - checks.OURS_RESERVE_S >= 200  # HF's share of the trainer check
    assert plan[1]["starts_at_s"] == acc.STARTUP_S + acc.BUDGET_S["trainer"]
    args = acc.build_parser().parse_args(["--out", "x", "--budget-s", "2000", "--profile-budget-s", "50",
                                          "--check-budget", "trainer=600"])
    plan = acc.make_plan(list(acc.CHECKS), acc.budgets_of(args, False), args, acc.STARTUP_S)
    assert all(row["fits"] for row in plan) and plan[-1]["budget_s"] == 50 and plan[0]["budget_s"] == 600
    with pytest.raises(acc.UserError, match="--check-budget speed=5: give NAME=SECONDS"):
        acc.budgets_of(acc.build_parser().parse_args(["--out", "x", "--check-budget", "speed=5"]), False)


def test_the_default_run_fits_one_15_minute_window_with_the_start_and_the_wheels(tmp_path, capsys):
    """A GPU comes in 15-minute windows, a fresh machine's start and the wheels' installation included: --plan-only
    prints the window plan, the default run fits it, and what is left lets a check be rerun alone."""
    assert acc.main(["--plan-only", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    window = {line[:19].strip(): float(line[19:].split()[0]) for line in out.splitlines()[1:6]}
    assert list(window) == ["machine start", "wheels installed", "this command", "files back", "left"]
    assert window["this command"] == acc.DEFAULT_BUDGET_S and window["machine start"] >= 120
    assert sum(v for k, v in window.items() if k != "left") + window["left"] == acc.WINDOW_S == 900
    assert window["left"] >= acc.STARTUP_S + acc.BUDGET_S["step_profile"]  # room to rerun the profile, say
    assert "a rerun of one check alone fits: step_profile" in out
    assert acc.main(["--plan-only", "--out", str(tmp_path), "--budget-s", "900"]) == 0
    assert "over the window: lower --budget-s" in capsys.readouterr().out


def test_a_tiny_budget_skips_checks_and_reports_them_as_skipped(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    # a budget that is spent before the first check: nothing runs, every check is reported as skipped
    assert acc.main(["--dry-run", "--out", str(tmp_path), "--budget-s", "0"]) == 0
    report = json.loads((tmp_path / "acceptance.json").read_text())
    assert report["complete"] and set(report["checks"]) == set(acc.CHECKS)
    assert all("budget_skipped" in r for r in report["checks"].values())
    verdicts = dict(acc.all_verdicts(report))
    assert set(verdicts) == set(acc.CHECKS) and all(v["met"] == "skipped" for v in verdicts.values())
    md = (tmp_path / "acceptance.md").read_text()
    assert md.count("**skipped**") == len(acc.CHECKS) and "| met |" not in md
    assert capsys.readouterr().out.count(": skipped (") == len(acc.CHECKS)


def test_a_check_whose_budget_does_not_fit_what_is_left_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(acc, "DRY_BUDGET_S", dict(acc.DRY_BUDGET_S, backends=10_000))
    assert acc.main(["--dry-run", "--out", str(tmp_path), "--budget-s", "600", "--checks", "backends,memory"]) == 0
    report = json.loads((tmp_path / "acceptance.json").read_text())
    checks = report["checks"]
    assert list(checks) == ["memory", "backends"]  # the order of value, whatever order --checks gave
    assert "its budget is 10000 s" in checks["backends"]["budget_skipped"]
    assert dict(acc.all_verdicts(report))["backends"]["met"] == "skipped"


# ------------------------------------------------------------------------------------- the plan and its budgets
def _cpu_only(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)


def test_the_plan_is_printed_first_in_the_order_of_value_with_each_checks_budget(tmp_path, monkeypatch, capsys):
    """What a lent GPU runs, in order: ours vs the best HF path at 16K, the step profile, 64K, the memory model, the
    calibration, then the rest; each with the seconds it is held to. --plan-only prints a GPU run's plan and stops."""
    _cpu_only(monkeypatch)
    assert list(acc.CHECKS[:5]) == ["trainer", "step_profile", "trainer_64k", "memory", "calibration"]
    assert acc.main(["--plan-only", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.strip()[:2].rstrip(".").isdigit()]
    assert [r[1] for r in rows] == list(acc.CHECKS)
    assert [float(r[2]) for r in rows] == [float(acc.BUDGET_S[c]) for c in acc.CHECKS]
    assert out.index("window plan") < out.index("1. trainer")
    assert not (tmp_path / "acceptance.json").exists()
    # a dry run prints its own plan (the CPU's budgets) before anything runs
    assert acc.main(["--dry-run", "--out", str(tmp_path), "--budget-s", "0"]) == 0
    out = capsys.readouterr().out
    assert out.index("plan") < out.index("trainer: skipped") and f"trainer {acc.DRY_BUDGET_S['trainer']:.0f} s" in \
        " ".join(out.split())


def test_a_check_that_runs_past_its_budget_is_stopped_there_and_the_next_one_runs(tmp_path, monkeypatch):
    import time

    _cpu_only(monkeypatch)

    def stuck(ctx):  # a first compile that does not end within the check's budget
        while True:
            time.sleep(0.01)

    monkeypatch.setitem(acc.CHECK_FNS, "trainer", stuck)
    monkeypatch.setitem(acc.CHECK_FNS, "calibration", lambda ctx: {"ran": True})
    monkeypatch.setattr(acc, "DRY_BUDGET_S", dict(acc.DRY_BUDGET_S, trainer=1, calibration=1))
    t0 = time.monotonic()
    assert acc.main(["--dry-run", "--out", str(tmp_path), "--checks", "trainer,memory,calibration"]) == 0
    assert time.monotonic() - t0 < 10
    checks = json.loads((tmp_path / "acceptance.json").read_text())["checks"]
    assert "stopped after its 1 s" in checks["trainer"]["over_budget"] and checks["trainer"]["seconds"] < 3
    assert checks["calibration"] == {"ran": True, "seconds": checks["calibration"]["seconds"]}
    assert "needs" in checks["memory"]["skipped_check"]  # nothing measured a peak for it
    verdicts = dict(acc.all_verdicts(json.loads((tmp_path / "acceptance.json").read_text())))
    assert verdicts["trainer"]["met"] == "stopped"


def test_the_trainer_checks_run_no_parity_steps_and_hold_their_budget(monkeypatch, tmp_path):
    """The 16K and 64K comparisons pass their budget down (the accuracy path gives way to ours when time is short)
    and run no sp=1 parity steps; the 64K one runs the HF implementation that ran at 16K, speed path only."""
    from types import SimpleNamespace

    import bench.gpu.checks as checks

    seen = []

    def fake_bench(ctx, argv):
        seen.append(argv)
        hf = {"ran": True, "attention": "flex_attention", "precision": "bf16", "tokens_per_s": 1.0}
        return {"paths": {"hf_flex_attention": hf}, "ratios": {}, "settings": {}, "notes": []}

    monkeypatch.setattr(checks, "_bench_trainer", fake_bench)
    ctx = SimpleNamespace(dry_run=False, pack_len=16384, share_s=200.0, out=tmp_path, hf_config={"num_hidden_layers": 16},
                          args=SimpleNamespace(baselines="best,best:amp"), best_hf_impl="flex_attention")
    checks.check_trainer(ctx)
    checks.check_trainer_64k(ctx)
    for argv in seen:
        assert "--no-sp1-check" in argv and float(argv[argv.index("--time-budget-s") + 1]) < 200
    assert seen[1][seen[1].index("--baselines") + 1] == "flex_attention"


def test_backends_skip_flex_once_a_varlen_kernel_passed():
    """flex's compile costs minutes on a GPU and auto never picks it over a varlen kernel that passed: once one
    did, flex is neither checked nor timed, and the report says so."""
    import bench.gpu.backends_check as checks

    checked, timed = [], []

    def check(backend):
        checked.append(backend)
        return {"loss": 1.0} if backend != "fa4" else {"error": "RuntimeError: no kernel"}

    rows, times, skipped = checks.backend_rows(["fa4", "torch_varlen", "flex", "sdpa_block"], check,
                                               lambda b: timed.append(b) or 1.0)
    assert checked == ["fa4", "torch_varlen", "sdpa_block"] and timed == ["torch_varlen", "sdpa_block"]
    assert "flex" not in rows and len(skipped) == 1 and skipped[0].startswith("flex: torch_varlen passed")
    rows, _, skipped = checks.backend_rows(["flex", "sdpa_block"], check, lambda b: 1.0)
    assert "flex" in rows and not skipped  # no varlen kernel here: flex is what auto would pick


def test_no_ratio_at_64k_when_hf_runs_out_of_memory_is_said_not_raised(monkeypatch):
    """HF's full fp32 logits at 64K (~120 GB for a 128K vocabulary) may not fit: the check reports why there is no
    ratio, with ours' figures, instead of failing."""
    from types import SimpleNamespace

    import bench.gpu.checks as checks

    ours = {"ran": True, "tokens_per_s": 1000.0, "mfu": 0.4, "peak_mem_gib": 50.0}
    results = {"paths": {"ours": ours, "hf_flex_attention": {"ran": False, "error": "out of memory"}},
               "ratios": {}, "settings": {"pack_len": 65536}, "notes": []}
    monkeypatch.setattr(checks, "_bench_trainer", lambda ctx, argv: results)
    ctx = SimpleNamespace(dry_run=False, pack_len=16384, share_s=150.0, hf_config={"num_hidden_layers": 16},
                          args=SimpleNamespace(baselines="best"), best_hf_impl=None)
    result = checks.check_trainer_64k(ctx)
    v = result["verdicts"]["tokens_per_s_ratio"]
    assert v["value"] is None and v["met"] is None
    assert v["what"].startswith("no ratio: no HF path ran") and "hf_flex_attention: out of memory" in v["what"]
    assert result["ours_tokens_per_s"] == 1000.0


def test_the_memory_check_models_the_run_that_was_measured():
    """Ours is built as a one-micro-batch run (bf16 gradient accumulation) with the decoder kernels and attention
    backend the trainer check names: the memory check predicts that run, not a default one."""
    from types import SimpleNamespace

    import bench.gpu.checks as checks
    from hbp_train.perf.memory import JobSettings, analytic_memory_bytes
    from hbp_train.perf.shape import parse_model_shape

    config = {  # the Llama-3.2-1B shape as bench_trainer records it
        "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
        "num_key_value_heads": 8, "vocab_size": 128256, "head_dim": 64, "tie_word_embeddings": True}
    ours = {"ran": True, "peak_mem_gib": 40.0, "backend": "fa4", "fused_kernels": ["rms_norm", "rope", "swiglu"]}
    trainer = {"model": {"config": config}, "paths": {"ours": ours},
               "settings": {"pack_len": 16384, "ckpt_layers": 0, "loss_chunk": 4096, "grad_accum_fp32": False}}
    ctx = SimpleNamespace(dry_run=False, device=SimpleNamespace(type="cuda"), trainer_results=trainer)
    (row,) = checks.check_memory(ctx)["packs"]
    job = JobSettings(zero_stage=2, loss_chunk_tokens=4096, grad_accum_fp32=False, attention_out_shared=True,
                      fused_rms_norm=True, fused_swiglu=True)
    assert row["predicted_gib"] == pytest.approx(analytic_memory_bytes(parse_model_shape(config), 16384, 1, 0, 1, job)
                                                 / 2**30)


def test_a_stopped_comparison_keeps_what_it_wrote_and_the_memory_check_uses_it(tmp_path, monkeypatch):
    """bench_trainer writes its results after every path: a trainer check stopped at its budget (the accuracy path
    still compiling, say) reports ours and the HF path that ran, and the memory check models ours' peak."""
    import time

    import bench.gpu.checks as checks
    from bench.trainer.workload import parse_shape

    _cpu_only(monkeypatch)
    config = parse_shape("tiny")[2]
    ours = {"ran": True, "tokens_per_s": 100.0, "mfu": None, "peak_mem_gib": 0.5, "backend": "sdpa_block",
            "fused_kernels": [], "label": "ours"}
    hf = {"ran": True, "tokens_per_s": 80.0, "attention": "sdpa", "precision": "bf16", "label": "HF speed path"}
    written = {"model": {"config": config}, "paths": {"ours": ours, "hf_sdpa": hf}, "ratios": {},
               "settings": {"pack_len": 256, "ckpt_layers": 0, "loss_chunk": 4096, "grad_accum_fp32": False}}

    def stuck_bench(ctx, argv):
        (ctx.out / "trainer.json").write_text(json.dumps(written))
        while True:
            time.sleep(0.01)

    monkeypatch.setattr(checks, "_bench_trainer", stuck_bench)
    monkeypatch.setattr(acc, "DRY_BUDGET_S", dict(acc.DRY_BUDGET_S, trainer=1))
    assert acc.main(["--dry-run", "--out", str(tmp_path), "--checks", "trainer,memory"]) == 0
    checks_done = json.loads((tmp_path / "acceptance.json").read_text())["checks"]
    assert checks_done["trainer"]["over_budget"].startswith("trainer: stopped after its 1 s")
    assert set(checks_done["trainer"]["paths"]) == {"ours", "hf_sdpa"}
    (row,) = checks_done["memory"]["packs"]
    assert row["measured_gib"] == 0.5 and row["pack_len"] == 256


# ------------------------------------------------------------------------ what each check keeps and leaves to others
def _stuck(*args, **kwargs):
    import time

    while True:
        time.sleep(0.01)


def test_the_64k_check_says_cannot_fit_on_80_gb_without_trying(monkeypatch):
    """On an 80 GB GPU the 1B shape's 64K HF path needs 78.3 GiB of logits and 9.2 GiB of model states: it is not
    built, its first step never compiles, ours runs alone and the report says "cannot fit" in place of the ratio."""
    import torch

    import bench.gpu.checks as checks
    import bench.trainer.bench_trainer as bench
    import bench.trainer.paths as paths
    from bench.trainer.workload import parse_shape

    monkeypatch.setattr(paths, "free_device_bytes", lambda device: 79 * 2**30)
    monkeypatch.setattr(bench, "measure_hf_best", lambda *a, **k: pytest.fail("the HF path was tried"))
    name, architecture, config = parse_shape("llama3.2-1b")
    args = bench.resolve_args(bench.build_parser().parse_args(
        ["--device", "cpu", "--pack-len", "65536", "--baselines", "flex_attention", "--time-budget-s", "45"]))
    args.deadline = bench.Deadline(45)
    results = {"device": {"name": "NVIDIA H100 80GB HBM3"}, "paths": {}, "skipped": [], "ratios": {}}
    baseline = paths.Baseline("flex_attention", "bf16")
    bench._run_baseline(args, results, baseline, architecture, config, [], torch.device("cuda"), None, reserve=40.0)
    results["paths"] = {"ours": {"ran": True, "tokens_per_s": 30000.0, "mfu": 0.3, "peak_mem_gib": 40.0},
                        **results["paths"]}
    bench._judge(results)
    v = checks._ratio_verdict("tokens_per_s_ratio_64k", results, dry_run=False)
    assert v["value"] is None and v["met"] is None
    assert v["what"].startswith("no ratio: no HF path ran: hf_flex_attention: not run: cannot fit: its full logits "
                                "need at least 78.3 GiB") and "model states 9.2 GiB" in v["what"]


def test_the_step_profile_keeps_a_share_for_ours(tmp_path, monkeypatch):
    """An HF path whose first step compiles past the profile's budget is stopped before ours' share: ours is
    profiled whatever HF does."""
    import bench.gpu.step_profile as gp
    import bench.trainer.paths as paths
    import hbp_train.distributed.groups

    monkeypatch.setattr(hbp_train.distributed.groups, "init_distributed", lambda backend=None: None)
    monkeypatch.setattr(paths, "measure_hf_best", _stuck)
    monkeypatch.setattr(gp, "_profile_ours", lambda *a: {"ms": {}, "decoder_kernels": "none (eager HF modules)"})
    args = gp.resolve(gp.build_parser().parse_args(["--device", "cpu", "--out", str(tmp_path), "--baseline", "sdpa",
                                                    "--time-budget-s", "3", "--ours-reserve-s", "1.5"]))
    seen = []
    result = gp.profile_paths(args, on_path=lambda r: seen.append(sorted(r["paths"])))
    assert "stopped" in result["paths"]["hf_sdpa"]["error"] and "error" not in result["paths"]["ours"]
    assert seen == [["hf_sdpa"], ["hf_sdpa", "ours"]]  # written after each path


def test_the_step_profile_runs_no_hf_path_when_none_finished_in_the_trainer_check(tmp_path, monkeypatch):
    """When the trainer check's HF path never finished, "best" would compile flex again for the whole profile: the
    profile then runs ours only, and says why; later checks take the HF path that did finish."""
    import bench.gpu.checks as checks

    ctx = SimpleNamespace(dry_run=False, trainer_results={"paths": {}}, best_hf_impl=None)
    assert checks.hf_baseline(ctx) == "none"
    ctx.best_hf_impl = "flex_attention"
    assert checks.hf_baseline(ctx) == "flex_attention"
    assert checks.hf_baseline(SimpleNamespace(dry_run=False)) is None  # no trainer check ran: each check's default
    import bench.gpu.step_profile as gp
    import hbp_train.distributed.groups

    monkeypatch.setattr(hbp_train.distributed.groups, "init_distributed", lambda backend=None: None)
    monkeypatch.setattr(gp, "_profile_ours", lambda *a: {"ms": {}, "decoder_kernels": "none (eager HF modules)"})
    args = gp.resolve(gp.build_parser().parse_args(["--device", "cpu", "--out", str(tmp_path), "--baseline", "none"]))
    result = gp.profile_paths(args)
    assert list(result["paths"]) == ["ours"] and result["skipped"][0].startswith("hf: --baseline none")


def _run_stopped(monkeypatch, tmp_path, check: str, *extra) -> dict:
    _cpu_only(monkeypatch)
    monkeypatch.setattr(acc, "DRY_BUDGET_S", dict(acc.DRY_BUDGET_S, **{check: 2}))
    assert acc.main(["--dry-run", "--out", str(tmp_path), "--checks", check, *extra]) == 0
    return json.loads((tmp_path / "acceptance.json").read_text())["checks"][check]


def test_the_longest_pack_search_ends_itself_and_keeps_its_attempts_when_stopped(tmp_path, monkeypatch):
    """The search's budget is what its check has left after the engine's build (the bench's --time-budget-s), not the
    check's whole share; stopped from outside, the check keeps the attempts written after each one."""
    import bench.gpu.checks as checks

    seen = []

    def searching(ctx, argv):
        seen.append(argv)
        search = {"attempts": [{"pack_len": 512, "ckpt_layers": 0, "ok": True, "oom": False, "peak_mem_gib": 1.0}],
                  "skipped": [], "longest_ok": 512}
        out = argv[argv.index("--out") + 1]
        checks.write_json(__import__("pathlib").Path(out), {"settings": {"search_budget_s": 1.0}, "paths": {},
                                                            "ratios": {}, "pack_search": search})
        _stuck()

    monkeypatch.setattr(checks, "_bench_trainer", searching)
    result = _run_stopped(monkeypatch, tmp_path, "longest_pack")
    (argv,) = seen
    assert float(argv[argv.index("--time-budget-s") + 1]) < 2 and "--search-budget-s" not in argv
    assert result["over_budget"].startswith("longest_pack: stopped") and result["longest_pack_by_ckpt_layers"] == {"0": 512}


def test_a_stopped_calibration_keeps_the_calibration_it_made(tmp_path, monkeypatch):
    import hbp_train.perf.calibrate.layer as layer
    import hbp_train.perf.calibrate.validation as validation
    from hbp_train.perf.cost_model import CostModel

    monkeypatch.setattr(layer, "calibrate", lambda *a: {"linear_fwdbwd_ms_per_32768_tokens": 7.0,
                                                        "head_fwdbwd_ms_per_32768_tokens": 3.0})
    monkeypatch.setattr(validation, "validate", _stuck)
    monkeypatch.setattr(CostModel, "from_calibration", classmethod(lambda cls, path, shape: None))
    result = _run_stopped(monkeypatch, tmp_path, "calibration")
    assert result["linear_ms_per_32768"] == 7.0 and result["validation"] == "stopped before it ended"
    assert json.loads((tmp_path / "calibration.json").read_text())["head_fwdbwd_ms_per_32768_tokens"] == 3.0


def test_a_stopped_profiler_keeps_its_measurements_and_ends_itself_before_its_check(tmp_path, monkeypatch):
    import bench.gpu.checks as checks
    import hbp_train.profiler.cli as cli
    from hbp_train.profiler.backends import Measurement

    def measuring(argv, on_measurement=None):
        budget = float(next(a for a in argv if a.startswith("profile.time_budget_s=")).split("=")[1])
        assert budget < 2
        on_measurement(Measurement(4096, 1, 0, 0.5, 2**30, None))
        _stuck()

    monkeypatch.setattr(cli, "main", measuring)
    result = _run_stopped(monkeypatch, tmp_path, "profiler")
    assert result["measurements"] == [{"pack_len": 4096, "sp": 1, "ckpt_layers": 0, "time_s": 0.5, "oom": False}]
    assert checks.profiler_time_budget_s(SimpleNamespace(share_s=120, dry_run=False)) == pytest.approx(
        120 - 6 - checks.PROFILER_SETUP_S - checks.PROFILER_TAIL_S)


def test_a_torn_results_file_does_not_kill_the_report(tmp_path, monkeypatch):
    """A check stopped while a file it reads back was half written (written in place, before): the report is still
    written, every check in it."""
    import bench.gpu.checks as checks

    def torn(ctx, argv):
        out = argv[argv.index("--out") + 1]
        __import__("pathlib").Path(out).write_text('{"paths": {"ours": {"ran": tr')
        _stuck()

    monkeypatch.setattr(checks, "_bench_trainer", torn)
    result = _run_stopped(monkeypatch, tmp_path, "trainer")
    assert result["over_budget"].startswith("trainer: stopped")
    report = json.loads((tmp_path / "acceptance.json").read_text())
    assert report["complete"]
