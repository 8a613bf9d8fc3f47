"""The trainer's gradients on 2 CPU processes (gloo, DeepSpeed ZeRO-2/3, gradient accumulation with m varying per
step, an empty pack) equal each loss normalizer's formula, computed here by a single-process reference that runs
every sample on its own (no packing) through the plain HF model.

One spawn serves every case: each rank builds an engine per (ZeRO stage, normalizer), runs the fixture's 3 plan
steps (m = 2, 1, 2), and returns, per step, the full parameters before the step and the full gradient DeepSpeed
hands the optimizer. First, a ZeRO-1 engine runs a bytescale-shaped plan whose ranks run different numbers of
micro-batches (each only its own packs): its gradients must equal the same reference. The last (ZeRO-3) engine also saves a sharded checkpoint for the export round trip. The
ZeRO-3 builds (from a config and from_pretrained) are checked to be partitioned before deepspeed.initialize.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.assets.packed_fixture import (BYTESCALE_PLAN, BYTESCALE_STEPS, TINY_LLAMA, TWO_RANK_STEPS,
                                        reference_normalized_loss, synthetic_samples, write_packed)
from tests.distributed import run_distributed

VOCAB = 4096  # the shipped tokenizer's
CASES = [(2, "ave_token"), (2, "token_mean"), (2, "sample_mean"), (2, "sum"), (3, "ave_token"), (3, "sample_mean")]


def overrides(shards: str, out: str, zero_stage: int, normalizer: str) -> list:
    model_cfg = json.dumps(TINY_LLAMA).replace('"', "").replace(" ", "")
    return ["experiment=cpu_demo", f"data.shards={shards}", f"train.out_dir={out}", "logging=quiet",
            f"model.config={model_cfg}", f"deepspeed.zero_stage={zero_stage}", f"loss.normalizer={normalizer}",
            "train.warmup_steps=0", "train.lr=1e-2", "train.grad_clip=0"]


def _steps_with_grads(run, rank, equal_counts=True) -> list:
    """Run every plan step; per step: full params before it, the full gradient it produced, its micro-batch count."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from hbp_train import trainer

    named = list(run.engine.module.named_parameters())
    per_step = []
    for step in range(run.data.num_steps):
        params = {n: safe_get_full_fp32_param(p).clone() for n, p in named}
        step_batch = run.data.step_batch(step, rank, equal_counts=equal_counts)
        trainer.forward_backward(run, step_batch)
        grads = {n: safe_get_full_grad(p).clone() for n, p in named}
        run.engine.step()
        per_step.append({"params": params, "grads": grads, "m": len(step_batch.micro_batches)})
    return per_step


def _worker(rank, world_size, shards, out, bytescale_shards):
    import deepspeed

    from hbp_train import build as builder
    from hbp_train import config
    from hbp_train.distributed.groups import init_distributed

    init_distributed()
    results = {}
    plain_build_engine = builder.build_engine
    at_engine = {}

    def build_engine(cfg, model, *args):
        # The model as build() hands it to deepspeed.initialize: which parameters are already ZeRO-3 partitions
        # (empty here, a 1/world_size share in ds_tensor) and how many elements this rank holds.
        at_engine["partitioned"] = {n: hasattr(p, "ds_id") and p.numel() == 0 and p.ds_numel > 0
                                    for n, p in model.named_parameters()}
        at_engine["local_numel"] = sum(p.ds_tensor.numel() if hasattr(p, "ds_id") else p.numel()
                                       for p in model.parameters())
        return plain_build_engine(cfg, model, *args)

    # ZeRO-1 on a bytescale plan: each rank runs only its own packs (1 vs 3, then 2 vs 1), meeting once per step.
    cfg = config.load(overrides(bytescale_shards, f"{out}/bytescale", 1, "ave_token"))
    bytescale = _steps_with_grads(builder.build(cfg), rank, equal_counts=False)
    m_all = [None] * world_size
    torch.distributed.all_gather_object(m_all, [s["m"] for s in bytescale])
    results["bytescale"] = bytescale, m_all
    builder.build_engine = build_engine
    for zero_stage, normalizer in CASES:
        cfg = config.load(overrides(shards, f"{out}/{zero_stage}_{normalizer}", zero_stage, normalizer))
        run = builder.build(cfg)
        results[(zero_stage, normalizer, "at_engine")] = dict(at_engine)
        results[(zero_stage, normalizer)] = _steps_with_grads(run, rank)
    # The last engine is ZeRO-3: save its sharded checkpoint and the trained model's logits for the export check.
    from hbp_train.runtime import checkpoint

    checkpoint.save(run.engine, f"{out}/z3/checkpoints", run.data.num_steps, "", run.model, run.tokenizer)
    with torch.no_grad():  # every rank runs the forward: ZeRO-3 gathers each layer's weights collectively
        ids = torch.arange(3, 40)[None]
        results["z3_logits"] = run.model.eval()(input_ids=ids, position_ids=torch.arange(ids.shape[1])[None]).logits
    deepspeed.comm.barrier()
    # from_pretrained under ZeRO-3 loads straight into partitions; growing the vocabulary keeps the loaded rows.
    from hbp_train.model.hf_model import ModelConfig, build_model

    if rank == 0:
        build_model(ModelConfig(config=dict(TINY_LLAMA)), vocab_size=VOCAB - 8).save_pretrained(f"{out}/pretrained")
    deepspeed.comm.barrier()
    ds_config = builder.deepspeed_config(cfg.deepspeed, cfg.train, 3, world_size, bf16=False)
    for vocab_size in (None, VOCAB):
        loaded = build_model(ModelConfig(name_or_path=f"{out}/pretrained"), vocab_size, zero3_config=ds_config)
        partitioned = {n: hasattr(p, "ds_id") and p.numel() == 0 for n, p in loaded.named_parameters()}
        with deepspeed.zero.GatheredParameters(list(loaded.parameters())):
            full = {n: p.detach().clone() for n, p in loaded.named_parameters()}
        results["z3_pretrained", vocab_size] = partitioned, full, type(loaded.lm_head).__name__, loaded.training
    return results if rank == 0 else None


@pytest.mark.slow
def test_normalizer_gradients_match_reference_two_ranks(tmp_path, tokenizer_dir):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.set_num_threads(1)  # the reference is tiny; more threads only contend with other work on 2 cores
    samples = synthetic_samples(14, VOCAB, seed=3)
    shards = write_packed(str(tmp_path / "packed"), samples, TWO_RANK_STEPS, world_size=2)
    bytescale_samples = synthetic_samples(14, VOCAB, seed=5)
    bytescale_shards = write_packed(str(tmp_path / "bytescale"), bytescale_samples, BYTESCALE_STEPS, world_size=2,
                                    plan_extra=BYTESCALE_PLAN)
    results = run_distributed(_worker, 2, shards, str(tmp_path / "runs"), bytescale_shards)[0]
    at_engine = {key[:2]: results.pop(key) for key in list(results) if key[-1] == "at_engine"}
    bytescale, m_per_rank = results.pop("bytescale")
    pretrained = {key[1]: results.pop(key) for key in list(results) if key[0] == "z3_pretrained"}

    model = AutoModelForCausalLM.from_config(
        LlamaConfig(**TINY_LLAMA, vocab_size=VOCAB, use_cache=False), attn_implementation="eager")
    z3_logits = results.pop("z3_logits")
    # ZeRO-3 builds the model partitioned: every parameter is already a ZeRO-3 partition before deepspeed.initialize
    # and the rank holds half of the elements (ZeRO-2 builds it whole) -- with the same initial weights as the
    # unpartitioned build from the same model.seed.
    total = sum(p.numel() for p in model.parameters())
    for (zero_stage, normalizer), built in at_engine.items():
        assert all(built["partitioned"].values()) if zero_stage == 3 else not any(built["partitioned"].values())
        assert built["local_numel"] == (total if zero_stage == 2 else pytest.approx(total / 2, rel=0.01))
        first = results[zero_stage, normalizer][0]["params"]
        assert all(torch.equal(first[k], v) for k, v in results[2, "ave_token"][0]["params"].items()), zero_stage
    cases = [(case, per_step, samples, TWO_RANK_STEPS) for case, per_step in results.items()]
    cases.append(((1, "ave_token"), bytescale, bytescale_samples, BYTESCALE_STEPS))
    assert m_per_rank == [[1, 2], [3, 1]]  # ZeRO-1: each rank ran only its own packs, no padding
    for (zero_stage, normalizer), per_step, step_samples, steps in cases:
        if zero_stage > 1:
            assert [s["m"] for s in per_step] == [2, 1, 2]  # m varies by step; step 2 holds an empty pack
        for step_index, got in enumerate(per_step):
            model.load_state_dict({k.removeprefix("model."): v for k, v in got["params"].items()})
            model.zero_grad()
            reference_normalized_loss(model, step_samples, steps[step_index], normalizer).backward()
            ref = {"model." + k: p.grad for k, p in model.named_parameters()}
            scale = max(float(g.abs().max()) for g in ref.values())
            err = max(float((got["grads"][k] - ref[k]).abs().max()) for k in ref)
            assert err <= 1e-4 * scale, (zero_stage, normalizer, step_index, err, scale)
        # The engine did update the weights between steps (the reference followed them).
        assert any(not torch.equal(per_step[0]["params"][k], per_step[1]["params"][k]) for k in per_step[0]["params"])

    saved = AutoModelForCausalLM.from_pretrained(str(tmp_path / "runs" / "pretrained")).state_dict()
    for vocab_size in (None, VOCAB):
        partitioned, full, head_type, training = pretrained[vocab_size]
        assert all(partitioned.values()) and head_type == "Linear" and training, vocab_size
        assert full["lm_head.weight"].shape[0] == (vocab_size or VOCAB - 8)
        assert all(torch.equal(full[k][:VOCAB - 8], v) for k, v in saved.items()), vocab_size

    # Export consolidates the ZeRO-3 shards of both ranks: the HF model's logits equal the trained model's.
    from hbp_train.export import export

    export(str(tmp_path / "runs" / "z3" / "checkpoints"), str(tmp_path / "hf"))
    loaded = AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        logits = loaded(input_ids=torch.arange(3, 40)[None]).logits
    assert float((logits - z3_logits).abs().max()) < 1e-5


# (ZeRO stage, deepspeed.grad_accum_dtype) of the bf16 runs: micro-batch gradients summed in bf16, then in fp32.
ACCUM_CASES = [(2, "bf16"), (2, "auto"), (3, "bf16"), (3, "auto")]
ACCUM_MICRO_BATCHES = 32  # per rank, in one step: hbp's steps of short packs have this many


def _accum_worker(rank, world_size, shards, out):
    """Per case: the gradient of plan step 0 (every pack, summed by DeepSpeed over the micro-batches) and the
    gradients of the plan steps after it (one pack each, the same packs), at the same weights (lr ~ 0)."""
    from deepspeed.utils import safe_get_full_grad

    from hbp_train import build as builder
    from hbp_train import config, trainer
    from hbp_train.distributed.groups import init_distributed

    init_distributed()
    results = {}
    for zero_stage, accum in ACCUM_CASES:
        cfg = config.load(["experiment=cpu_demo", f"data.shards={shards}", f"train.out_dir={out}/{zero_stage}{accum}",
                           "logging=quiet", "model.config=" + json.dumps(TINY_LLAMA).replace('"', "").replace(" ", ""),
                           "model.dtype=bf16", f"deepspeed.zero_stage={zero_stage}",
                           f"deepspeed.grad_accum_dtype={accum}", "loss.normalizer=sum", "train.grad_clip=0",
                           "train.lr=1e-30", "train.warmup_steps=0"])
        run = builder.build(cfg)
        grads = []
        for step in range(run.data.num_steps):
            trainer.forward_backward(run, run.data.step_batch(step, rank))
            grads.append(torch.cat([safe_get_full_grad(p).double().flatten() for p in run.engine.module.parameters()]))
            run.engine.step()
        results[zero_stage, accum] = grads[0], torch.stack(grads[1:]).sum(0)
        run.engine.destroy()
        del run
    return results if rank == 0 else None


@pytest.mark.slow
@pytest.mark.full  # 32 micro-batches on 2 ranks
def test_bf16_gradients_are_summed_in_fp32_over_many_micro_batches(tmp_path):
    """2 ranks, bf16 weights, a step of 32 micro-batches per rank, then the same packs one per step: DeepSpeed's
    sum over the micro-batches matches the float64 sum of the one-pack gradients (normalizer sum, unchanged
    weights) far better when it sums in fp32 (the default at ZeRO-2/3) than in bf16, which rounds the running sum
    at every micro-batch."""
    num_packs = 2 * ACCUM_MICRO_BATCHES
    samples = synthetic_samples(num_packs, VOCAB, seed=7, min_len=8, max_len=24)
    whole = {"group": 0, "replicas": [[[i] for i in range(r, num_packs, 2)] for r in range(2)]}
    singles = [{"group": 0, "replicas": [[[i]], [[i + 1]]]} for i in range(0, num_packs, 2)]
    shards = write_packed(str(tmp_path / "packed"), samples, [whole, *singles], world_size=2)
    results = run_distributed(_accum_worker, 2, shards, str(tmp_path / "runs"))[0]
    error = {case: float((summed - exact).norm() / exact.norm()) for case, (summed, exact) in results.items()}
    for stage in (2, 3):
        assert error[stage, "auto"] < 1e-3 < error[stage, "bf16"], error


# ------------------------------------------------------------------------------ the fused LM-head loss, SP > 1
# (ZeRO stage, normalizer, model dtype) of the fused runs; the plan of tests/test_ulysses.py (group 1 at sp=2 with a
# checkpointed layer); a 16-token LM-head chunk, so a pack's loss runs in several chunks.
FUSED_CASES = [(2, "ave_token", "fp32"), (2, "token_mean", "fp32"), (2, "sample_mean", "fp32"), (2, "sum", "fp32"),
               (3, "sample_mean", "fp32"), (2, "ave_token", "bf16")]


def _fused_worker(rank, world_size, shards, out):
    """Per case: every optimizer step's weights before it and its gradients through trainer.forward_backward with
    loss.impl=fused (and, for bf16, the same with loss.impl=chunked at a learning rate that leaves the weights as
    they are), and how often the fused loss ran."""
    from hbp_train import build as builder
    from hbp_train import config
    from hbp_train.distributed.groups import init_distributed
    from hbp_train.model import packed_lm

    init_distributed()
    calls, plain = [], packed_lm.fused_token_losses
    packed_lm.fused_token_losses = lambda *a, **k: calls.append(1) or plain(*a, **k)
    results = {}
    model_cfg = json.dumps(TINY_LLAMA).replace('"', "").replace(" ", "")
    for zero_stage, normalizer, dtype in FUSED_CASES:
        for impl in ("fused", "chunked") if dtype == "bf16" else ("fused",):
            calls.clear()
            cfg = config.load(["experiment=cpu_demo", f"data.shards={shards}", f"train.out_dir={out}/{impl}",
                               "logging=quiet", f"model.config={model_cfg}", f"deepspeed.zero_stage={zero_stage}",
                               f"loss.normalizer={normalizer}", f"loss.impl={impl}", "loss.chunk_size=16",
                               f"model.dtype={dtype}", "train.warmup_steps=0", "train.grad_clip=0",
                               # bf16: both paths' gradients at the same (unchanged) weights
                               f"train.lr={1e-2 if dtype == 'fp32' else 1e-30}"])
            run = builder.build(cfg)
            results[zero_stage, normalizer, dtype, impl] = _steps_with_grads(run, rank), len(calls)
            run.engine.destroy()
    return results if rank == 0 else None


@pytest.mark.slow
def test_fused_loss_gradients_match_reference_through_the_trainer_with_sp(tmp_path):
    """2 ranks, steps at sp=1 and sp=2 (the SP loss all-reduce hands the fused loss's backward an upstream gradient
    of 2), ZeRO-2 and 3, every normalizer: with loss.impl=fused every step's gradient is the normalizer's
    single-process gradient; in bf16 it is the chunked path's within bf16 rounding."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.test_ulysses import SP_TRAINER_STEPS

    torch.set_num_threads(1)
    samples = synthetic_samples(14, VOCAB, seed=5)
    shards = write_packed(str(tmp_path / "packed"), samples, SP_TRAINER_STEPS, world_size=2,
                          groups={1: {"sp": 2, "ckpt_layers": 1}})
    results = run_distributed(_fused_worker, 2, shards, str(tmp_path / "runs"), timeout=600)[0]
    model = AutoModelForCausalLM.from_config(
        LlamaConfig(**TINY_LLAMA, vocab_size=VOCAB, use_cache=False), attn_implementation="eager")
    for (zero_stage, normalizer, dtype, impl), (per_step, fused_calls) in results.items():
        micro_batches = sum(len(s["replicas"][0]) for s in SP_TRAINER_STEPS)  # rank 0's packs, all steps
        assert fused_calls == (micro_batches if impl == "fused" else 0), (zero_stage, normalizer, impl)
        if dtype == "bf16":
            continue
        for k, got in enumerate(per_step):
            model.load_state_dict({n.removeprefix("model."): v for n, v in got["params"].items()})
            model.zero_grad()
            reference_normalized_loss(model, samples, SP_TRAINER_STEPS[k], normalizer).backward()
            for name, param in model.named_parameters():
                rel = float((got["grads"]["model." + name] - param.grad).norm() / param.grad.norm())
                assert rel <= 1e-5, (zero_stage, normalizer, k, name, rel)
    fused, chunked = results[2, "ave_token", "bf16", "fused"][0], results[2, "ave_token", "bf16", "chunked"][0]
    for k, (a, b) in enumerate(zip(fused, chunked)):
        for name in b["grads"]:
            rel = float((a["grads"][name].float() - b["grads"][name].float()).norm() / b["grads"][name].float().norm())
            assert rel <= 2e-2, (k, name, rel)


# ------------------------------------------------------------------ bf16 gradients of one micro-batch per step
def _one_micro_batch_worker(rank, world_size, shards, out):
    """Per ZeRO stage and deepspeed.grad_accum_dtype (fp32, auto): the accumulation dtype DeepSpeed was given and the
    full weights after every step of a plan with one pack per replica per step (bf16 model)."""
    from deepspeed.utils import safe_get_full_fp32_param

    from hbp_train import build as builder
    from hbp_train import config, trainer
    from hbp_train.distributed.groups import init_distributed

    init_distributed()
    results = {}
    model_cfg = json.dumps(TINY_LLAMA).replace('"', "").replace(" ", "")
    for zero_stage in (2, 3):
        for accum in ("fp32", "auto"):
            cfg = config.load(["experiment=cpu_demo", f"data.shards={shards}",
                               f"train.out_dir={out}/{zero_stage}{accum}", "logging=quiet", f"model.config={model_cfg}", "model.dtype=bf16",
                               f"deepspeed.zero_stage={zero_stage}", f"deepspeed.grad_accum_dtype={accum}",
                               "train.warmup_steps=0", "train.lr=1e-2"])
            run = builder.build(cfg)
            weights = []
            for step in range(run.data.num_steps):
                trainer.train_step(run, run.data.step_batch(step, rank))
                weights.append({n: safe_get_full_fp32_param(p).clone()
                                for n, p in run.engine.module.named_parameters()})
            results[zero_stage, accum] = str(run.engine._config.grad_accum_dtype), weights
            run.engine.destroy()
    return results if rank == 0 else None


@pytest.mark.slow
def test_one_micro_batch_steps_accumulate_bf16_gradients_in_bf16_with_the_same_updates(tmp_path):
    """A plan whose steps have one pack per replica: deepspeed.grad_accum_dtype=auto gives DeepSpeed bf16 (no zeroed
    fp32 partition to fill every step), and the fp32 master weights after each of 3 steps are bit for bit those of
    fp32 accumulation (one micro-batch: nothing is summed), at ZeRO-2 and 3."""
    samples = synthetic_samples(6, VOCAB, seed=11)
    steps = [{"group": 0, "replicas": [[[2 * s]], [[2 * s + 1]]]} for s in range(3)]
    shards = write_packed(str(tmp_path / "packed"), samples, steps, world_size=2)
    results = run_distributed(_one_micro_batch_worker, 2, shards, str(tmp_path / "runs"), timeout=600)[0]
    for zero_stage in (2, 3):
        (fp32_dtype, fp32), (auto_dtype, auto) = results[zero_stage, "fp32"], results[zero_stage, "auto"]
        assert (fp32_dtype, auto_dtype) == ("fp32", "None")  # None: the weights' dtype, bf16
        assert any(not torch.equal(fp32[0][k], fp32[-1][k]) for k in fp32[0])  # the weights did move
        for step, (a, b) in enumerate(zip(fp32, auto)):
            assert all(torch.equal(a[k], b[k]) for k in a), (zero_stage, step)
