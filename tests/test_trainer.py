"""Single-process trainer checks, all in one spawned process (DeepSpeed imports are paid once):
resume reproduces the uninterrupted loss trace exactly; on_nan=skip drops a NaN step without touching the weights
and on_nan=abort stops; the exported HF model's logits equal the trained model's. And, in a subprocess through the
real entry point, SIGTERM finishes the step, saves a loadable checkpoint and exits 0."""

from __future__ import annotations

import json
import os
import shutil
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
    from hbp_train import build as builder
    from hbp_train import config, trainer
    from hbp_train.runtime import checkpoint
    from hbp_train.export import export
    from hbp_train.distributed.groups import init_distributed

    init_distributed()
    result = {}
    # 1. Resume: 6 steps straight vs 3 steps (checkpoint), then resume=auto for the rest.
    full = trainer.train(config.load(overrides(shards, f"{out}/full", "train.save_final=false",
                                               "train.save_every=2", "train.keep_last=3")))
    result["full_tags"] = checkpoint.list_tags(f"{out}/full/checkpoints")
    result["token_totals"] = [full["run"].sp.stats.totals()]
    first = trainer.train(config.load(overrides(shards, f"{out}/split", "train.exit_after_steps=3")))
    result["token_totals"].append(first["run"].sp.stats.totals())
    second = trainer.train(config.load(overrides(shards, f"{out}/split", "train.resume=auto")))
    result["token_totals"].append(second["run"].sp.stats.totals())  # counted on from the checkpoint, not from zero
    result["full"], result["first"], result["second"] = full["losses"], first["losses"], second["losses"]
    result["ended"] = (first["ended"], second["ended"], second["start_step"])

    # Per-group activation checkpointing (here: all layers of group 0, one of group 1) changes memory, not math.
    ckpt_run = trainer.train(config.load(overrides(shards, f"{out}/ckpt", "train.ckpt_layers=[2,1]",
                                                   "train.exit_after_steps=2")))
    result["ckpt_losses"] = ckpt_run["losses"]
    result["ckpt_flags"] = [layer.gradient_checkpointing for layer in ckpt_run["run"].model.model.layers]
    # Without the override, k comes from the plan's groups[g].ckpt_layers, and follows each step's group.
    plan_dir = f"{out}/plan_ckpt"
    shutil.copytree(shards, plan_dir)
    with open(f"{plan_dir}/plan.json") as f:
        plan = json.load(f)
    plan["groups"][0]["ckpt_layers"], plan["groups"][1]["ckpt_layers"] = 1, 2
    with open(f"{plan_dir}/plan.json", "w") as f:
        json.dump(plan, f)
    plan_run = builder.build(config.load(overrides(plan_dir, f"{out}/plan_ckpt_run")))
    result["plan_ckpt_flags"] = []
    for step in range(3):
        trainer.forward_backward(plan_run, plan_run.data.step_batch(step, 0))
        plan_run.engine.step()
        result["plan_ckpt_flags"].append([layer.gradient_checkpointing for layer in plan_run.model.model.layers])

    # The logged throughput of the uninterrupted run: tokens and FLOPs (attention: sum of len^2 per sample).
    from hbp_train.perf.flops import pack_flops
    from hbp_train.perf.shape import parse_model_shape

    with open(f"{out}/full/metrics.jsonl") as f:
        result["logged"] = [json.loads(line) for line in f]
    batches = [full["run"].data.step_batch(step, 0).micro_batches for step in range(6)]
    result["step_tokens"] = [sum(mb["input_ids"].shape[1] for mb in mbs) for mbs in batches]
    shape = parse_model_shape(full["run"].model.config)
    result["step_flops"] = [sum(pack_flops(shape, mb["seq_lens"]) for mb in mbs) for mbs in batches]
    result["step_flops_if_T2"] = [sum(pack_flops(shape, [sum(mb["seq_lens"])]) for mb in mbs) for mbs in batches]

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
    run = builder.build(config.load(overrides(shards, f"{out}/nan")))
    from hbp_train.model import packed_lm

    real_losses = packed_lm.chunked_token_losses
    poison = {"on": False}

    def maybe_nan(*args, **kwargs):
        loss = real_losses(*args, **kwargs)
        return loss * float("nan") if poison["on"] else loss

    packed_lm.chunked_token_losses = maybe_nan
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
        abort_run = builder.build(config.load(overrides(shards, f"{out}/abort", "train.on_nan=abort")))
        poison["on"] = True
        try:
            trainer.train_step(abort_run, abort_run.data.step_batch(0, 0))
            result["abort"] = "no error"
        except FloatingPointError as e:
            result["abort"] = str(e)
        # 4. A diverged run (every loss NaN): with the default train.max_skipped (5% of 6 steps -> 1) the second
        # skipped step stops it with a checkpoint and an error, instead of "finished".
        try:
            trainer.train(config.load(overrides(shards, f"{out}/diverged")))
            result["diverged"] = "no error"
        except FloatingPointError as e:
            result["diverged"] = str(e)
        result["diverged_tags"] = checkpoint.list_tags(f"{out}/diverged/checkpoints")
    finally:
        packed_lm.chunked_token_losses = real_losses
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
    full_totals, first_totals, resumed_totals = r["token_totals"]
    assert 0 < first_totals[0] < full_totals[0] and resumed_totals == full_totals  # live CR's counts survive resume
    assert r["full_tags"] == ["step_00000002", "step_00000004"]  # save_every=2 (no final save), and saving
    # did not perturb the trace (checked just above)
    assert r["ckpt_losses"] == pytest.approx(r["full"][:2], rel=1e-6)
    assert r["ckpt_flags"] == [True, False]  # the last step ran group 1 with one checkpointed layer
    assert r["plan_ckpt_flags"] == [[True, False], [True, True], [True, False]]  # groups 0, 1, 0 of the plan
    # Live metrics: tokens/s and FLOPs (MFU's numerator) per step match the packs; attention FLOPs are per sample.
    logged = r["logged"]
    assert [m["plan/step"] for m in logged] == list(range(6))
    for step, m in enumerate(logged):
        tokens, flops, flops_t2 = r["step_tokens"][step], r["step_flops"][step], r["step_flops_if_T2"][step]
        assert m["perf/tokens_per_s"] * m["perf/step_time_s"] == pytest.approx(tokens, rel=1e-9)
        assert m["tokens/ave_t"] == tokens and 0 <= m["tokens/pad_ratio"] < 1  # live Ave-T (one rank) and PR
        assert m["perf/tflops_per_device"] * 1e12 * m["perf/step_time_s"] == pytest.approx(flops, rel=1e-9)
        # ONE_RANK_STEPS: odd steps hold one two-sample pack, where sum of len^2 < T^2; even steps one-sample packs
        assert (flops < flops_t2) == (step % 2 == 1) and flops <= flops_t2
        assert m["time/compute_s/rank0"] > 0 and m["balance/imbalance"] == 1.0  # one rank: max/mean = 1
    # The schedule (lr=1e-2, warmup_steps=2, cpu_demo's min_lr_ratio=0.1): linear warm-up from lr/2, then cosine.
    lrs = [m["optim/lr"] for m in logged]
    assert lrs[0] == pytest.approx(0.5e-2) and lrs[0] < lrs[1] < lrs[2] <= 1e-2
    assert all(a > b for a, b in zip(lrs[2:], lrs[3:])) and lrs[-1] >= 0.1e-2
    # Export round trip.
    assert r["export_logit_err"] < 1e-5
    assert "model.safetensors" in r["export_files"] and "tokenizer.json" in r["export_files"]
    # on_nan.
    assert r["nan_skips"] == (False, True, False)
    assert r["nan_untouched"] and r["nan_recovered"]
    assert "NaN/inf" in r["abort"] and "on_nan" in r["abort"]
    assert r["diverged"].startswith("2 steps skipped for a NaN/inf loss or gradient, more than train.max_skipped=1")
    assert r["diverged_tags"] == ["step_00000002"]  # stopped after its second step, with a checkpoint


@pytest.mark.slow
def test_sigterm_saves_loadable_checkpoint_and_exits_zero(shards, tmp_path):
    out = tmp_path / "run"
    # A process of its own: none of this test process's distributed settings (another test may have set them).
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1")
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
    from hbp_train.runtime.checkpoint import plan_fingerprint, resolve
    from hbp_train.export import export

    root, tag = resolve(str(out / "checkpoints"))
    assert tag == f"step_{steps_done:08d}"
    state = torch.load(os.path.join(root, tag, "mp_rank_00_model_states.pt"), weights_only=False)
    assert state["next_step"] == steps_done
    assert state["total_steps"] > steps_done  # the run's length, so a resume can warn when the LR schedule changes
    assert state["counters"]["num_skipped"] == 0 and state["counters"]["sp_token_totals"][0] > 0
    with open(os.path.join(root, tag, "resume.json")) as f:  # what a resume is checked against, before building
        assert json.load(f) == {"next_step": steps_done, "world_size": 1, "data_shards": shards,
                                "plan_sha256": plan_fingerprint(shards), "epoch": steps_done // len(ONE_RANK_STEPS)}
    # What a resume on another number of ranks needs: DeepSpeed's conversion key, and the samples each step trained.
    assert state["universal_checkpoint_info"] == {"universal_checkpoint_version": 0.2}
    from hbp_train.runtime.ledger import SampleLedger

    ledger = SampleLedger.load(os.path.join(root, tag))
    assert ledger.arrays()["step"].tolist() == list(range(steps_done))
    for epoch in range(steps_done // len(ONE_RANK_STEPS)):  # every whole epoch: each of the 12 samples once
        assert ledger.counts(12, epoch).tolist() == [1] * 12
    assert ledger.counts(12, steps_done // len(ONE_RANK_STEPS)).max() <= 1
    assert (out / "config.yaml").exists() and os.path.isfile(os.path.join(root, tag, "config.yaml"))
    export(str(out / "checkpoints"), str(tmp_path / "hf"))
    assert (tmp_path / "hf" / "model.safetensors").exists()


def test_unusable_attention_backend_fails_before_the_model_is_built(shards, tmp_path, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("flash_varlen may be usable on this GPU")
    from hbp_train import config
    from hbp_train.model import hf_model as model
    from hbp_train.build import build
    from hbp_train.common.errors import UserError

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before the backend was checked")

    monkeypatch.setattr(model, "build_model", no_model)
    cfg = config.load(overrides(shards, str(tmp_path), "model.attention_backend=flash_varlen"))
    with pytest.raises(UserError, match=r"^model.attention_backend=flash_varlen: .*not available on cpu"):
        build(cfg)


def test_deepspeed_config_asks_for_torchs_fused_adamw_on_a_gpu_only(monkeypatch):
    import torch

    from hbp_train.build import DeepSpeedConfig, deepspeed_config
    from hbp_train.trainer import TrainConfig

    def params(on_gpu: bool, **ds):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: on_gpu)
        return deepspeed_config(DeepSpeedConfig(**ds), TrainConfig(), total_steps=10, world_size=2,
                                bf16=on_gpu)["optimizer"]["params"]

    assert params(True)["fused"] is True and params(True)["torch_adam"] is True
    assert "fused" not in params(False)  # the CPU: plain torch AdamW
    assert "fused" not in params(True, zero_stage=3, offload_optimizer=True)  # DeepSpeed's CPU Adam takes no flag


def test_deepspeed_config_follows_the_run_config():
    from hbp_train.build import DeepSpeedConfig, deepspeed_config
    from hbp_train.common.errors import UserError
    from hbp_train.trainer import TrainConfig

    train = TrainConfig(lr=3e-4, warmup_steps=5, min_lr_ratio=0.3, grad_clip=0.5, betas=[0.9, 0.99], weight_decay=0.1)
    ds = DeepSpeedConfig(zero_stage=3, offload_optimizer=True,
                         extra={"zero_optimization": {"stage3_max_live_parameters": 7}})
    config = deepspeed_config(ds, train, total_steps=100, world_size=4, bf16=True)
    # torch AdamW (no FusedAdam JIT build), one pack per micro-batch, accumulation driven by the trainer.
    assert config["optimizer"] == {"type": "AdamW", "params": {"lr": 3e-4, "betas": [0.9, 0.99], "eps": 1e-8,
                                                               "weight_decay": 0.1, "torch_adam": True}}
    assert (config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"],
            config["train_batch_size"]) == (1, 1, 4)
    assert config["gradient_clipping"] == 0.5 and config["bf16"]["enabled"]
    params = config["scheduler"]["params"]
    assert config["scheduler"]["type"] == "WarmupCosineLR" and params["total_num_steps"] == 100
    # warm-up from lr/5, cosine down to lr * 0.3
    assert (params["warmup_num_steps"], params["warmup_min_ratio"], params["cos_min_ratio"]) == (5, 1 / 5, 0.3)
    # Made at iteration 0: at DeepSpeed's -1 its constructor logged "Attempting to get learning rate from scheduler
    # before it has started" on every rank of every run (build_engine sets iteration 0's rate).
    assert params["last_batch_iteration"] == 0
    # A run no longer than its warm-up (it ran "step 1/1 ... lr 2.00e-06" at the first warm-up rate): a tenth of it.
    from hbp_train.trainer import TrainConfig

    assert [TrainConfig(warmup_steps=10).warmup_for(n) for n in (50, 11, 10, 4, 1)] == [10, 10, 1, 0, 0]
    short = deepspeed_config(ds, train, total_steps=4, world_size=4, bf16=True)["scheduler"]["params"]
    assert (short["warmup_num_steps"], short["warmup_min_ratio"]) == (1, 1.0)  # no warm-up: train.lr from step 1
    zero = config["zero_optimization"]
    assert zero["stage"] == 3 and zero["offload_optimizer"]["device"] == "cpu" and "offload_param" not in zero
    assert zero["stage3_max_live_parameters"] == 7 and zero["reduce_bucket_size"] == ds.reduce_bucket_size  # merged
    # bf16 gradients are summed over the micro-batches in fp32 at ZeRO-2/3 (auto), in bf16 at ZeRO-1 or when asked
    assert config["data_types"] == {"grad_accum_dtype": "fp32"}
    assert "data_types" not in deepspeed_config(ds, train, 100, 4, bf16=False)  # fp32 weights: fp32 anyway
    for stage, accum in ((1, "auto"), (2, "bf16")):
        assert "data_types" not in deepspeed_config(DeepSpeedConfig(zero_stage=stage, grad_accum_dtype=accum),
                                                    train, 100, 4, bf16=True)
    with pytest.raises(UserError, match="grad_accum_dtype=fp32 needs deepspeed.zero_stage 2 or 3"):
        DeepSpeedConfig(zero_stage=1, grad_accum_dtype="fp32")


def test_deepspeed_config_of_a_lean_step():
    """Nothing in DeepSpeed's config times or synchronises the step (its throughput timer is on by default); the
    bf16 overflow check (a pass over every gradient, a host sync) only where on_nan=skip needs it; bf16 gradients
    summed in fp32 under auto only where a step of the plan has several micro-batches per replica (DeepSpeed fixes
    the dtype at initialize; with one micro-batch there is no sum to round)."""
    from deepspeed.runtime.config import DeepSpeedConfig as DSConfig

    from hbp_train.build import DeepSpeedConfig, deepspeed_config
    from hbp_train.trainer import TrainConfig

    config = deepspeed_config(DeepSpeedConfig(), TrainConfig(), 100, 1, bf16=True)
    parsed = DSConfig(config)  # DeepSpeed reads the keys as meant (world size 1: this process's)
    assert not parsed.timers_config.enabled and not parsed.timers_config.synchronized
    assert not parsed.wall_clock_breakdown
    assert config["bf16"]["check_grad_overflow"] is True
    assert deepspeed_config(DeepSpeedConfig(), TrainConfig(on_nan="abort"), 100, 4, True)["bf16"] == \
        {"enabled": True, "check_grad_overflow": False}
    for stage, micro_batches, fp32 in ((2, None, True), (2, 4, True), (2, 1, False), (3, 1, False), (3, 2, True)):
        got = deepspeed_config(DeepSpeedConfig(zero_stage=stage), TrainConfig(), 100, 4, True, micro_batches)
        assert ("data_types" in got) == fp32 == DeepSpeedConfig(zero_stage=stage).grad_accum_fp32(micro_batches)
    assert "data_types" in deepspeed_config(DeepSpeedConfig(grad_accum_dtype="fp32"), TrainConfig(), 100, 4, True, 1)


def test_resume_with_another_plan_fails_before_building(shards, tmp_path, monkeypatch):
    import shutil

    from hbp_train import config, trainer

    from hbp_train.runtime import checkpoint

    from hbp_train.runtime import manifest
    from hbp_train.common.errors import UserError

    monkeypatch.setattr(trainer, "build", lambda *a, **k: pytest.fail("built before checking the checkpoint"))
    tag_dir = tmp_path / "run" / "checkpoints" / checkpoint.tag_for(3)
    tag_dir.mkdir(parents=True)
    (tag_dir.parent / "latest").write_text(checkpoint.tag_for(3))
    (tag_dir / "resume.json").write_text(json.dumps({"next_step": 3, "world_size": 1, "data_shards": shards,
                                                     "plan_sha256": checkpoint.plan_fingerprint(shards)}))
    torch.save(checkpoint.rng_state(), tag_dir / "rng_rank0.pt")
    manifest.write(str(tag_dir), 3, 1)
    replanned = str(tmp_path / "replanned")
    shutil.copytree(shards, replanned)
    with open(f"{replanned}/plan.json") as f:
        plan = json.load(f)
    plan["steps"].reverse()
    with open(f"{replanned}/plan.json", "w") as f:
        json.dump(plan, f)
    cfg = config.load(overrides(replanned, str(tmp_path / "run"), "train.resume=auto"))
    with pytest.raises(UserError, match=r"^train.resume=auto: .*step_00000003 was saved with another plan"):
        trainer.train(cfg)


def test_bad_resume_path_fails_before_building(shards, tmp_path, monkeypatch):
    from hbp_train import config, trainer
    from hbp_train.common.errors import UserError

    monkeypatch.setattr(trainer, "build", lambda *a, **k: pytest.fail("built before checking train.resume"))
    cfg = config.load(overrides(shards, str(tmp_path / "run"), f"train.resume={tmp_path / 'nothing'}"))
    with pytest.raises(UserError, match=r"^train.resume=.*nothing: no such directory"):
        trainer.train(cfg)


def test_a_fresh_run_refuses_a_run_dir_holding_another_runs_checkpoints(shards, tmp_path, monkeypatch):
    # Its saves would mix with the earlier run's: pruning would rank them by step and delete the new ones.
    from hbp_train import config, trainer
    from hbp_train.runtime import checkpoint
    from hbp_train.common.errors import UserError

    monkeypatch.setattr(trainer, "build", lambda *a, **k: pytest.fail("built before checking train.out_dir"))
    (tmp_path / "run" / "checkpoints" / checkpoint.tag_for(40)).mkdir(parents=True)
    cfg = config.load(overrides(shards, str(tmp_path / "run")))
    with pytest.raises(UserError, match=r"already holds checkpoints of an earlier run \(newest step_00000040\): "
                                         r"continue it with train.resume=auto"):
        trainer.train(cfg)


def test_a_bytescale_plan_needs_zero_stage_1_and_says_so(tmp_path):
    from hbp_train import config
    from hbp_train.build import build
    from hbp_train.common.errors import UserError

    shards = write_packed(str(tmp_path / "bs"), synthetic_samples(4, VOCAB, seed=1),
                          [{"group": 0, "replicas": [[[0, 1], [2, 3]]]}], world_size=1,
                          plan_extra={"strategy": "bytescale", "unequal_micro_batches": True,
                                      "requires_zero_stage": [0, 1]})
    cfg = config.load(overrides(shards, str(tmp_path / "run"), "deepspeed.zero_stage=2"))
    with pytest.raises(UserError, match=r"bs/plan.json: .*needs ZeRO stage 0 or 1.*\(deepspeed.zero_stage=1\)"):
        build(cfg)
    assert config.load(overrides(shards, str(tmp_path / "run"), "deepspeed.zero_stage=1")).deepspeed.zero_stage == 1


def test_gpu_memory_preflight_warns_per_group_before_the_engine(monkeypatch, capsys):
    """On a GPU the trainer warns, before allocating the engine, about groups the memory model says cannot fit
    (CUDA faked here: the check itself is arithmetic)."""
    from types import SimpleNamespace

    from transformers import LlamaConfig

    from hbp_train.build import DeepSpeedConfig, _warn_if_groups_may_not_fit, ckpt_layers_for

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # 80 GiB, of which the CUDA context, NCCL's communicators and another process hold 3 GiB and torch 1 GiB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (76 * 2**30, 80 * 2**30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda: 2**30)
    cfg = SimpleNamespace(deepspeed=DeepSpeedConfig(zero_stage=2), loss=SimpleNamespace(chunk_size=4096))
    groups = [{"pack_len": 16384, "sp": 1}, {"pack_len": 131072, "sp": 8}]
    model = SimpleNamespace(config=LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                               num_attention_heads=32, num_key_value_heads=8, vocab_size=128256))
    _warn_if_groups_may_not_fit(cfg, groups, model, 32, [32, 0])
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("[train] warning: group 1 (131072 tokens, sp=8, 0 checkpointed")
    assert "of the 77.0 GiB the GPU has for it" in out[0]  # free + torch's own, not the total
    all_32 = [ckpt_layers_for([32], g, None) for g in range(len(groups))]  # train.ckpt_layers=[32]: every group
    _warn_if_groups_may_not_fit(cfg, groups, model, 32, all_32)  # both fit
    assert capsys.readouterr().out == ""


def test_build_refuses_ckpt_layers_that_do_not_match_the_plan_or_model(shards, tmp_path):
    """Checked before DeepSpeed starts (no process spawned): one value per plan group (or one for all), and never
    more checkpointed layers than the model has."""
    from hbp_train import config
    from hbp_train.build import build
    from hbp_train.batches.loader import PackedData
    from hbp_train.common.errors import UserError

    num_groups = len(PackedData(shards).groups)
    bad = ",".join(["0"] * (num_groups + 1))
    with pytest.raises(UserError, match=f"train.ckpt_layers has {num_groups + 1} values but the plan has "
                                         f"{num_groups} groups"):
        build(config.load(overrides(shards, str(tmp_path / "a"), f"train.ckpt_layers=[{bad}]")))
    too_many = TINY_LLAMA["num_hidden_layers"] + 1
    with pytest.raises(UserError, match=f"the model has only {TINY_LLAMA['num_hidden_layers']} decoder layers"):
        build(config.load(overrides(shards, str(tmp_path / "b"), f"train.ckpt_layers=[{too_many}]")))


def _lean_step_worker(rank, world_size, shards, out):
    """Three train_steps: which values the forward and backward read back to the host (aten ops that do: on a GPU
    each is a sync), how often DeepSpeed synchronises the device per step, and the gathered gradient norm against
    the engine's; then three with DeepSpeed's default throughput timer (it synchronises from its third step)."""
    import collections
    import traceback

    from deepspeed.accelerator import get_accelerator
    from deepspeed.utils.config import DeepSpeedThroughputTimerConfig
    from torch.utils._python_dispatch import TorchDispatchMode

    from hbp_train import config, trainer
    from hbp_train.build import build
    from hbp_train.distributed.groups import init_distributed

    class HostReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.origins = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.__name__.startswith(("_local_scalar_dense", "nonzero.", "is_nonzero")):
                ours = [f for f in traceback.extract_stack() if "hbp_train" in f.filename]
                self.origins[(func.__name__, ours[-1].line if ours else None)] += 1
            return func(*args, **(kwargs or {}))

    init_distributed()
    run = build(config.load(overrides(shards, out)))
    syncs, plain_sync = [], get_accelerator().synchronize
    get_accelerator().synchronize = lambda *a, **k: syncs.append(1) or plain_sync(*a, **k)
    reads, plain_fb = HostReads(), trainer.forward_backward

    def forward_backward(*args, **kwargs):
        with reads:
            return plain_fb(*args, **kwargs)

    trainer.forward_backward = forward_backward
    result = {"syncs": [], "norms": []}
    for step in range(6):
        if step == 3:  # DeepSpeed's default throughput timer, synchronising
            run.engine.tput_timer.config = DeepSpeedThroughputTimerConfig()
        syncs.clear()
        gathered, skipped, _ = trainer.train_step(run, run.data.step_batch(step, 0))
        result["syncs"].append(len(syncs))
        result["norms"].append((float(gathered[0, trainer.STAT_COLUMNS.index("grad_norm")]),
                                float(run.engine.get_global_grad_norm())))
    trainer.forward_backward = plain_fb
    result["reads"] = dict(reads.origins)
    return result


@pytest.mark.slow
def test_the_step_reads_nothing_back_in_forward_backward_and_deepspeed_never_synchronises(shards, tmp_path):
    """A lean step on the CPU: forward and backward read no value back to the host (on a GPU each would be a sync)
    except attention.py's CPU-only boundary check; DeepSpeed synchronises the device at no step, while its default
    throughput timer would at every one from its third; the gradient norm rides in the step's one stats transfer."""
    result = run_distributed(_lean_step_worker, 1, shards, str(tmp_path / "lean"), timeout=300)[0]
    assert result["syncs"][:3] == [0, 0, 0] and result["syncs"][5] >= 2, result["syncs"]
    cpu_only = "assert int(cu_seqlens[-1]) == q_THD.shape[0], \"cu_seqlens[-1] must equal the number of tokens\""
    assert set(result["reads"]) == {("_local_scalar_dense.default", cpu_only)}, result["reads"]
    assert all(g == pytest.approx(e, rel=1e-6) and g > 0 for g, e in result["norms"]), result["norms"]
