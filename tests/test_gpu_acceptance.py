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
    # every backend available on the CPU matched the eager per-document reference in loss and gradients
    assert checks["backends"]["backends"] and all(r["loss_rel_error"] < 1e-4 and r["grad_min_cosine"] > 0.9999
                                                  for r in checks["backends"]["backends"].values())
    assert checks["trainer"]["ours_tokens_per_s"] > 0 and checks["trainer"]["longest_pack_by_ckpt_layers"]
    assert checks["memory"]["packs"] and checks["calibration"]["packs"] and checks["profiler"]["exit_code"] == 0
    verdicts = acc.all_verdicts(report)
    assert len(verdicts) >= 7 and all(v["met"] is None for _, v in verdicts)  # a dry run judges nothing
    md = (tmp_path / "acceptance.md").read_text()
    for label, v in verdicts:
        assert f"| {label} | {v['what']} |" in md
    assert (tmp_path / "calibration.json").exists() and (tmp_path / "profile.json").exists()
