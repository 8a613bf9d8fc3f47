"""Single-process trainer checks, all in one spawned process (DeepSpeed imports are paid once):
resume reproduces the uninterrupted loss trace exactly; on_nan=skip drops a NaN step without touching the weights
and on_nan=abort stops; the exported HF model's logits equal the trained model's. And, in a subprocess through the
real entry point, SIGTERM finishes the step, saves a loadable checkpoint and exits 0."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from tests.assets.packed_fixture import ONE_RANK_STEPS, TINY_LLAMA, synthetic_samples, write_packed
from tests.distributed import run_distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCAB = 4096


def overrides(shards: str, out: str, *extra) -> list:
    model_cfg = json.dumps(TINY_LLAMA).replace('"', "").replace(" ", "")
    return ["experiment=cpu_demo", f"data.shards={shards}", f"train.out_dir={out}", "logging=quiet",
            f"model.config={model_cfg}", "train.warmup_steps=2", "train.lr=1e-2", *extra]


def _params(run) -> dict:
    return {n: p.detach().clone() for n, p in run.model.named_parameters()}


def _single_process_checks(rank, world_size, shards, out):
    from hbp_train import config, trainer
    from hbp_train.export import export
    from hbp_train.parallel import init_distributed

    init_distributed()
    result = {}
    # 1. Resume: 6 steps straight vs 3 steps (checkpoint), then resume=auto for the rest.
    full = trainer.train(config.load(overrides(shards, f"{out}/full", "train.save_final=false")))
    first = trainer.train(config.load(overrides(shards, f"{out}/split", "train.exit_after_steps=3")))
    second = trainer.train(config.load(overrides(shards, f"{out}/split", "train.resume=auto")))
    result["full"], result["first"], result["second"] = full["losses"], first["losses"], second["losses"]
    result["ended"] = (first["ended"], second["ended"], second["start_step"])

    # Per-group activation checkpointing (here: all layers of group 0, one of group 1) changes memory, not math.
    ckpt_run = trainer.train(config.load(overrides(shards, f"{out}/ckpt", "train.ckpt_layers=[2,1]",
                                                   "train.exit_after_steps=2")))
    result["ckpt_losses"] = ckpt_run["losses"]
    result["ckpt_flags"] = [layer.gradient_checkpointing for layer in ckpt_run["run"].model.model.layers]

    # 2. Export round trip of the resumed run's final checkpoint: logits equal the trained model's.
    from transformers import AutoModelForCausalLM

    trained = second["run"].model.eval()
    export(f"{out}/split/checkpoints", f"{out}/hf")
    loaded = AutoModelForCausalLM.from_pretrained(f"{out}/hf").eval()
    ids = torch.arange(3, 40)[None]
    with torch.no_grad():
        a = trained(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits
        b = loaded(input_ids=ids).logits
    result["export_logit_err"] = float((a - b).abs().max())
    result["export_files"] = sorted(os.listdir(f"{out}/hf"))

    # 3. on_nan: a NaN loss in step 1 is skipped (weights untouched), the next step trains again.
    run = trainer.build(config.load(overrides(shards, f"{out}/nan")))
    real_losses = trainer.chunked_token_losses
    poison = {"on": False}

    def maybe_nan(*args, **kwargs):
        loss = real_losses(*args, **kwargs)
        return loss * float("nan") if poison["on"] else loss

    trainer.chunked_token_losses = maybe_nan
    try:
        _, skipped0, _ = trainer.train_step(run, run.data.step_batch(0, 0))
        before = _params(run)
        poison["on"] = True
        _, skipped1, _ = trainer.train_step(run, run.data.step_batch(1, 0))
        after_nan = _params(run)
        poison["on"] = False
        _, skipped2, _ = trainer.train_step(run, run.data.step_batch(2, 0))
        after = _params(run)
        result["nan_skips"] = (skipped0, skipped1, skipped2)
        result["nan_untouched"] = all(torch.equal(before[k], after_nan[k]) for k in before)
        result["nan_recovered"] = all(torch.isfinite(v).all() for v in after.values()) and any(
            not torch.equal(before[k], after[k]) for k in before)
        abort_run = trainer.build(config.load(overrides(shards, f"{out}/abort", "train.on_nan=abort")))
        poison["on"] = True
        try:
            trainer.train_step(abort_run, abort_run.data.step_batch(0, 0))
            result["abort"] = "no error"
        except FloatingPointError as e:
            result["abort"] = str(e)
    finally:
        trainer.chunked_token_losses = real_losses
    return result


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("packed1")
    return write_packed(str(out), synthetic_samples(12, VOCAB, seed=1), ONE_RANK_STEPS, world_size=1)


@pytest.mark.slow
def test_resume_nan_and_export_single_process(shards, tmp_path):
    r = run_distributed(_single_process_checks, 1, shards, str(tmp_path))[0]
    # Resume continues at the exact plan step with the same state: the loss trace is reproduced exactly.
    assert len(r["full"]) == 6 and len(r["first"]) == 3 and len(r["second"]) == 3
    assert r["first"] + r["second"] == r["full"]
    assert r["ended"][0].startswith("stopped after train.exit_after_steps") and r["ended"][1:] == ("finished", 3)
    assert r["ckpt_losses"] == pytest.approx(r["full"][:2], rel=1e-6)
    assert r["ckpt_flags"] == [True, False]  # the last step ran group 1 with one checkpointed layer
    # Export round trip.
    assert r["export_logit_err"] < 1e-5
    assert "model.safetensors" in r["export_files"] and "tokenizer.json" in r["export_files"]
    # on_nan.
    assert r["nan_skips"] == (False, True, False)
    assert r["nan_untouched"] and r["nan_recovered"]
    assert "NaN/inf" in r["abort"] and "on_nan" in r["abort"]


@pytest.mark.slow
def test_sigterm_saves_loadable_checkpoint_and_exits_zero(shards, tmp_path):
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "hbp_train.train", *overrides(shards, str(out), "data.epochs=100")]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = out / "metrics.jsonl"
    deadline = time.time() + 150
    while time.time() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            break
        time.sleep(0.2)
    assert proc.poll() is None, proc.stdout.read()
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    assert "stopped by SIGTERM" in output
    steps_done = len(metrics.read_text().splitlines())
    assert 2 <= steps_done < 600
    # The checkpoint holds the step to resume at and loads (consolidated by DeepSpeed's own reader).
    from hbp_train.checkpoint import resolve
    from hbp_train.export import export

    root, tag = resolve(str(out / "checkpoints"))
    assert tag == f"step_{steps_done:08d}"
    state = torch.load(os.path.join(root, tag, "mp_rank_00_model_states.pt"), weights_only=False)
    assert state["next_step"] == steps_done
    assert (out / "config.yaml").exists() and os.path.isfile(os.path.join(root, tag, "config.yaml"))
    export(str(out / "checkpoints"), str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "model.safetensors").exists()
