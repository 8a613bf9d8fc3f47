"""Tests for bench/gpu_acceptance.py: the GPU acceptance command runs end to end on the CPU (--dry-run), writes
its JSON and markdown report with every check, and judges figures against their targets only on a real run."""

from __future__ import annotations

import json

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
    # both HF paths, named, at 16K and at 4x the pack length
    for name in ("trainer", "trainer_64k"):
        paths = checks[name]["paths"]
        assert set(paths) == {"ours", "hf_sdpa", "hf_sdpa_amp"} and not any(p["error"] for p in paths.values())
        assert paths["hf_sdpa"]["label"].startswith("HF speed path")
        assert paths["hf_sdpa_amp"]["label"].startswith("HF accuracy path")
        assert paths["ours"]["decoder_kernels"].startswith("none") and "sdpa_block" in paths["ours"]["attention_kernel"]
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


def test_budget_shares_keep_every_later_checks_minimum():
    args = acc.build_parser().parse_args(["--out", "x"])
    checks = list(acc.CHECKS)
    later = sum(acc.MIN_S[c] for c in checks[1:])
    first = checks[0]
    # the first check gets what is left once the later checks' minimums are set aside
    assert acc.plan_share(first, checks, 1000.0, acc.MIN_S, args) == pytest.approx(1000.0 - later)
    # with less than that it still gets its own minimum: an earlier check never waits for a later one
    assert acc.plan_share(first, checks, acc.MIN_S[first] + 1, acc.MIN_S, args) == acc.MIN_S[first]
    # below its own minimum it is skipped (None), and so is everything once the budget is spent
    assert acc.plan_share("trainer", checks, acc.MIN_S["trainer"] - 1, acc.MIN_S, args) is None
    assert acc.plan_share("memory", checks, 0.0, acc.MIN_S, args) is None
    # the search and the profiler are capped by their own flags, and get what is left when that is less
    assert acc.plan_share("profiler", checks, 1000.0, acc.MIN_S, args) == args.profile_budget_s
    assert acc.plan_share("profiler", checks, 100.0, acc.MIN_S, args) == 100.0
    assert acc.plan_share("longest_pack", checks, 150.0, acc.MIN_S, args) == 150.0 - acc.MIN_S["memory"] - acc.MIN_S["profiler"]


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


def test_a_budget_for_the_first_check_runs_it_and_skips_the_next(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    monkeypatch.setattr(acc, "DRY_MIN_S", dict(acc.DRY_MIN_S, backends=1, trainer=10_000))
    assert acc.main(["--dry-run", "--out", str(tmp_path), "--budget-s", "600", "--checks", "trainer,backends"]) == 0
    report = json.loads((tmp_path / "acceptance.json").read_text())
    checks = report["checks"]
    assert list(checks) == ["backends", "trainer"]  # the order of value, whatever order --checks gave
    assert checks["backends"]["backends"] and "budget_skipped" not in checks["backends"]
    assert "needs at least 10000 s" in checks["trainer"]["budget_skipped"]
    assert dict(acc.all_verdicts(report))["trainer"]["met"] == "skipped"
