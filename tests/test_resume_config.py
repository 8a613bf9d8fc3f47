"""A resume whose command line differs from the checkpoint's run config (hbp_train/runtime/resume_config.py): every
changed setting is named in one line and either applied or refused (exit 2) before any engine is built.

  - the decisions, on checkpoint folders holding what a save writes (config.yaml, hf/config.json, resume.json, a
    manifest): unchanged (no line); applied (lr, save cadence, ZeRO 2 -> 1, the attention backend, a tokenizer
    folder moved with the same tokens); refused (the model's shape, dtype or adapters, the data order, ZeRO-3);
  - the config check (python -m hbp_train.config) refuses the same, with no worker, and the SP degrees of a plan
    resumed on a world size they cannot run on, and a fresh run whose plan is another world size's;
  - with the real trainer (default tier): a changed train.lr takes effect at the resumed step (its rates are those
    of a fresh run with that lr, not the checkpoint's schedule), and a changed model is refused in one line before
    the engine is built.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

from hbp_train import config
from hbp_train.common.errors import UserError
from hbp_train.runtime import resume_config
from tests.assets.packed_fixture import ONE_RANK_STEPS, TINY_LLAMA, TWO_RANK_STEPS, synthetic_samples, write_packed
from tests.distributed import run_distributed

VOCAB = 4096


def _overrides(shards, out, *extra) -> list:
    model_cfg = json.dumps(TINY_LLAMA).replace('"', "").replace(" ", "")
    return ["experiment=cpu_demo", f"data.shards={shards}", f"train.out_dir={out}", "logging=quiet",
            f"model.config={model_cfg}", "train.warmup_steps=2", "train.lr=1e-2", *extra]


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_packed(str(tmp_path_factory.mktemp("resume_packed")), synthetic_samples(12, VOCAB, seed=1),
                        ONE_RANK_STEPS, world_size=1)


def _checkpoint(cfg, out, step: int = 3, world_size: int = 1) -> str:
    """A tag folder as checkpoint.save leaves it, as far as a resume's checks read it: config.yaml, hf/config.json
    (the model the run built), resume.json, manifest.json, latest."""
    from hbp_train.model.hf_model import hf_config_for
    from hbp_train.runtime.checkpoint import plan_fingerprint, tag_for

    root = os.path.join(out, "checkpoints")
    tag_dir = os.path.join(root, tag_for(step))
    os.makedirs(os.path.join(tag_dir, "hf"))
    with open(os.path.join(tag_dir, "config.yaml"), "w") as f:
        f.write(config.resolved_yaml(cfg))
    hf_config_for(cfg.model, resume_config.built_shape(cfg.model).vocab).save_pretrained(os.path.join(tag_dir, "hf"))
    with open(os.path.join(tag_dir, "resume.json"), "w") as f:
        json.dump({"next_step": step, "world_size": world_size, "data_shards": cfg.data.shards,
                   "plan_sha256": plan_fingerprint(cfg.data.shards)}, f)
    with open(os.path.join(tag_dir, "manifest.json"), "w") as f:
        json.dump({"files": {}, "world_size": world_size}, f)
    with open(os.path.join(root, "latest"), "w") as f:
        f.write(tag_for(step))
    return tag_dir


def test_unchanged_applied_and_refused_settings(shards, tmp_path):
    out = tmp_path / "run"
    tag_dir = _checkpoint(config.load(_overrides(shards, out)), str(out))

    def check(*extra):
        return resume_config.check(config.load(_overrides(shards, out, "train.resume=auto", *extra)), tag_dir)

    assert check() is None  # only train.resume differs: nothing to say
    line = check("train.lr=1e-3", "train.save_every=4", "deepspeed.zero_stage=1", "model.attention_backend=auto")
    assert line == (f"[train] resuming {tag_dir} with 4 settings changed since it was saved, applied: "
                    "deepspeed.zero_stage 2 -> 1, model.attention_backend sdpa_block -> auto, train.lr 0.01 -> "
                    "0.001, train.save_every 0 -> 4 (the LR schedule is rebuilt at step 3)")
    # The tokenizer's folder moved (the same tokens): the model is the same, so the new path is taken.
    moved = shutil.copytree(config.load(_overrides(shards, out)).model.tokenizer, tmp_path / "tokenizer")
    assert "applied: model.tokenizer " in check(f"model.tokenizer={moved}")

    refusals = {
        "++model.config.hidden_size=48": "model.config.hidden_size=48 (saved with 32: the model's shape: hidden 32 -> "
                                         "48, head_dim 8 -> 12, v_head_dim 8 -> 12)",
        "model.dtype=bf16": "model.dtype=bf16 (saved with fp32: the dtype of the saved weights and optimizer state)",
        "model.lora.r=4": "model.lora.r=4 (saved with 0: the adapters the checkpoint holds)",
        "train.seed=1": "train.seed=1 (saved with 0: the order of the epochs already planned (data.shuffle_epochs))",
        "deepspeed.zero_stage=3": "deepspeed.zero_stage=3 (saved with 2: ZeRO-3's checkpoint files (1 and 2 load "
                                  "each other's))",
    }
    for override, named in refusals.items():
        with pytest.raises(UserError) as caught:
            check(override, "train.lr=1e-3")
        message = str(caught.value)
        assert message.startswith(f"{tag_dir} cannot resume with {named}: a checkpoint resumes only the model"), message
        assert "\n" not in message and "train.lr" not in message  # the applied ones are not in the refusal


def test_the_config_check_refuses_with_no_worker(shards, tmp_path, capsys, monkeypatch):
    """python -m hbp_train.config, which ./launch.sh train runs before any worker: a changed model; the world size
    it is told (WORLD_SIZE) against a fresh run's plan, and against a resumed plan's SP degrees."""
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # not told: not checked
    out = tmp_path / "run"
    _checkpoint(config.load(_overrides(shards, out)), str(out))
    assert config.main(_overrides(shards, out, "train.resume=auto", "train.lr=1e-3")) == 0
    capsys.readouterr()
    assert config.main(_overrides(shards, out, "train.resume=auto", "++model.config.num_hidden_layers=3")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"config error: train.resume=auto: {out}/checkpoints/step_00000003 "
                                                   "cannot resume with model.config.num_hidden_layers=3 (saved with 2")

    monkeypatch.setenv("WORLD_SIZE", "2")
    # train.resume=auto with nothing to resume yet (as the SLURM script always adds it) is a fresh run
    for fresh in (_overrides(shards, tmp_path / "fresh"), _overrides(shards, tmp_path / "fresh", "train.resume=auto")):
        assert config.main(fresh) == 2
        assert capsys.readouterr().err == (f"config error: data.shards={shards}: planned for world size 1, but this "
                                           "run has 2 ranks: launch 1 processes (NPROC=1 ./launch.sh train ...), or "
                                           "re-plan with data_tools.pack --world-size 2\n")

    # A 2-rank plan with a group at SP degree 2, its checkpoint saved by 2 ranks, resumed on 1.
    sp2 = write_packed(str(tmp_path / "sp2"), synthetic_samples(14, VOCAB, seed=2), TWO_RANK_STEPS, world_size=2,
                       groups={1: {"sp": 2}})
    out2 = tmp_path / "run2"
    _checkpoint(config.load(_overrides(sp2, out2)), str(out2), world_size=2)
    capsys.readouterr()  # datasets' save bars
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert config.main(_overrides(sp2, out2, "train.resume=auto")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"config error: train.resume=auto: cannot resume on 1 rank from "
                                                   f"{out2}/checkpoints/step_00000003 (saved by 2): the plan's group "
                                                   "of pack_len ")
    assert "runs at SP degree 2, which cannot run on 1 rank" in err
    monkeypatch.setenv("WORLD_SIZE", "4")  # another world size its SP degrees divide: the workers re-plan for it
    assert config.main(_overrides(sp2, out2, "train.resume=auto")) == 0


def _lrs(out) -> list:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line)["optim/lr"] for line in f]


def _fresh_rates(cfg, total_steps: int) -> list:
    """The rate of every step of a fresh run of ``cfg``: DeepSpeed's scheduler as build.deepspeed_config configures
    it, stepped as the trainer steps it (iteration 0 before the first step)."""
    import torch
    from deepspeed.runtime.lr_schedules import WarmupCosineLR

    from hbp_train.build import deepspeed_config

    params = deepspeed_config(cfg.deepspeed, cfg.train, total_steps, 1, False)["scheduler"]["params"]
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.train.lr)
    scheduler = WarmupCosineLR(optimizer, **params)
    rates = []
    for step in range(total_steps):
        scheduler.step(step)
        rates.append(optimizer.param_groups[0]["lr"])
    return rates


def _resume_worker(rank, world_size, shards, tmp):
    import contextlib
    import io

    from hbp_train import build, trainer
    from hbp_train.distributed.groups import init_distributed

    init_distributed()
    first = os.path.join(tmp, "run")
    trainer.train(config.load(_overrides(shards, first, "train.exit_after_steps=3")))
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        resumed = trainer.train(config.load(_overrides(shards, first, "train.resume=auto", "train.lr=1e-3")))
    built = []
    real_engine = build.build_engine
    build.build_engine = lambda *a, **k: built.append(1) or real_engine(*a, **k)
    try:
        trainer.train(config.load(_overrides(shards, first, "train.resume=auto", "++model.config.hidden_size=48")))
        refused = None
    except UserError as exc:
        refused = str(exc)
    finally:
        build.build_engine = real_engine
    return {"lrs": _lrs(first), "ref": _fresh_rates(config.load(_overrides(shards, first, "train.lr=1e-3")),
                                                    resumed["run"].total_steps),
            "log": log.getvalue(), "start": resumed["start_step"],
            "refused": refused, "built": len(built)}


@pytest.mark.slow
def test_a_changed_lr_applies_from_the_resumed_step_and_a_changed_model_is_refused_before_the_engine(shards,
                                                                                                     tmp_path):
    result = run_distributed(_resume_worker, 1, shards, str(tmp_path))[0]
    tag = tmp_path / "run" / "checkpoints" / "step_00000003"
    lines = [line for line in result["log"].splitlines() if "changed since it was saved" in line]
    assert lines == [f"[train] resuming {tag} with 2 settings changed since it was saved, applied: "
                     "train.exit_after_steps 3 -> None, train.lr 0.01 -> 0.001 (the LR schedule is rebuilt at step 3)"]
    lrs, ref = result["lrs"], result["ref"]
    assert result["start"] == 3 and len(lrs) == len(ref) == len(ONE_RANK_STEPS)
    # Steps 0-2 ran at lr=1e-2; from step 3 on the rates are a fresh lr=1e-3 run's, as DeepSpeed's scheduler gives
    # them (the checkpoint's schedule gave ten times as much, and DeepSpeed's load alone kept it for step 3).
    assert lrs[3:] == pytest.approx(ref[3:], rel=1e-12) and lrs[2] == pytest.approx(10 * ref[2], rel=1e-12)
    final = tag.parent / "step_00000006"  # the resumed run's last checkpoint
    assert result["refused"].startswith(f"train.resume=auto: {final} cannot resume with model.config.hidden_size=48 "
                                        "(saved with 32: the model's shape: hidden 32 -> 48")
    assert "\n" not in result["refused"] and result["built"] == 0  # refused before any engine was built
