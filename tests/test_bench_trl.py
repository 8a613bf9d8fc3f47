"""bench/trl/bench_trl.py works (it does NOT check speed: the bench prints the figures). TRL's schedule is our
trainer's DeepSpeed schedule; both sides read the same documents the same way; the report's marks and its block of
docs/benchmarks.md against the committed results file; and ``--quick``: TRL (in its own venv, built from the package index, or
the test is skipped with the reason) and ours trained side by side with every check passing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench import results_file
from bench.trl import bench_trl, report, trl_side, venv

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("steps", [3, 40])
def test_trls_schedule_is_our_trainers_deepspeed_schedule(steps):
    """The spec bench_trl hands TRL, through trl_side's LambdaLR formula, gives every step the learning rate that
    DeepSpeed's WarmupCosineLR gives our trainer with hbp_train/build.py's settings (short runs included, where the
    warm-up falls back to a tenth of the run)."""
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    from hbp_train.build import DeepSpeedConfig, deepspeed_config
    from hbp_train.trainer import TrainConfig

    setup = bench_trl.SETUPS["full"]
    spec = bench_trl.schedule_spec(setup, steps)
    train = TrainConfig(lr=setup.lr, warmup_steps=setup.warmup_steps, min_lr_ratio=spec["cos_min_ratio"])
    config = deepspeed_config(DeepSpeedConfig(), train, steps, world_size=1, bf16=False)
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=setup.lr)
    ds = WarmupCosineLR(opt, **config["scheduler"]["params"])
    ratio = trl_side.schedule(spec)
    ours = []
    for _ in range(steps):
        ours.append(ds.get_lr()[0])
        ds.step()
    assert [setup.lr * ratio(i) for i in range(steps)] == pytest.approx(ours, rel=1e-12)
    assert len(set(ours)) > 1  # the schedule moves: the check could fail


def test_both_sides_hash_a_document_from_its_ids_and_trained_targets():
    """TRL's padding-free batch (position ids restart per document, each document's first label masked) and our
    packed row of the same two documents give the same hashes; a different target mask gives another."""
    ids = [5, 6, 7, 8, 9, 10, 11]
    labels = [-100, -100, 7, 8, -100, 10, 11]
    trl_batch = {"input_ids": torch.tensor([ids]), "labels": torch.tensor([labels]),
                 "position_ids": torch.tensor([[0, 1, 2, 3, 0, 1, 2]])}
    docs = trl_side.documents(trl_batch)
    assert [d[1:] for d in docs] == [(4, 2), (3, 2)]
    assert docs[0][0] == trl_side.doc_hash([5, 6, 7, 8], [0, 1, 1])
    assert docs[1][0] == trl_side.doc_hash([9, 10, 11], [1, 1])  # the first label is never a target
    assert trl_side.doc_hash([5, 6, 7, 8], [0, 0, 1]) != docs[0][0]


def _rounds(ours_speed):
    def run(tps, loss):
        return {"tokens_per_s": tps, "heldout_loss": loss, "loss_max_abs_diff_vs_trl": 2e-7}

    return [{"trl": run(100, 6.5), "trl_block": run(200, 6.5), "ours": run(s, 6.45 + 0.01 * i)}
            for i, s in enumerate(ours_speed)]


def test_the_report_splits_the_ratio_into_attention_and_the_rest_and_bolds_only_every_round():
    figs = report.figures(_rounds([250, 260, 240]))
    assert figs["ours"]["over_trl"]["median"] == pytest.approx(2.5)
    assert figs["ours"]["over_trl_block"]["median"] == pytest.approx(1.25)
    assert figs["trl_block"]["over_trl"]["median"] == pytest.approx(2.0)
    results = {"figures": figs, "rounds": [0, 1, 2], "wall_s": 1500, "trl_version": "1.16.0",
               "setup": {"shape": {"hidden": 128, "layers": 4}, "max_len": 4096, "threads": 2},
               "checks": {"documents": 200, "tokens": 180000, "steps": 45, "lr_max_rel_diff": 0.0},
               "provenance": {"commit": "abcdef0123456", "dirty": False, "date": "2026-12-05",
                              "machine": {"cpu": "Test CPU", "cores": 2}}}
    text = report.render(results)
    assert "| ours (hbp_train) | 250 | **2.50× [2.40–2.60]** |" in text and "the attention is 2.00×" in text
    assert "1.25× [1.20–1.30] (ours over TRL with our attention)" in text and "commit abcdef0123," in text
    assert "TRL with it trains the same losses" in text and "Not equalised:" in text
    one = report.render({**results, "figures": report.figures(_rounds([250])), "rounds": [0]})
    assert "**" not in one.split("| run |")[1]  # one round: no spread, no bold


def test_the_pages_trl_block_is_what_the_committed_results_file_renders():
    block = results_file.read_block(bench_trl.NAME)
    results = results_file.read_results(bench_trl.NAME)
    if results is None:
        assert "Not yet rendered from a results file" in block
        return
    assert block == report.render(results), "run: python bench/trl/bench_trl.py (or re-render from its results)"


@pytest.mark.slow
@pytest.mark.full
def test_quick_run_trains_trl_and_ours_on_the_same_documents_and_steps(tmp_path):
    try:
        venv.ensure()
    except venv.VenvError as err:
        pytest.skip(f"TRL's venv cannot be built here: {err}")
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "trl" / "bench_trl.py"), "--quick", "--work",
                           str(tmp_path), "--threads", "1"], cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)),
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "quick" / "results.json").read_text())
    checks, (round_,) = results["checks"], results["rounds"]
    assert checks["documents"] > 10 and checks["lr_max_rel_diff"] < 1e-6
    assert {round_[v]["steps"] for v in report.VARIANTS} == {checks["steps"]}
    # our attention inside TRL trains TRL's losses (the same data order): the split of the ratio is sound
    assert round_["trl_block"]["loss_max_abs_diff_vs_trl"] < 1e-4
    assert all(round_[v]["tokens_per_s"] > 0 and 0 < round_[v]["heldout_loss"] < 20 for v in report.VARIANTS)
    assert "Not equalised:" in proc.stdout
