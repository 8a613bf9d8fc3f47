"""Tests for hbp_train/model/ulysses.py: the SP collate split, the head limits, Ulysses with SP sizes switched per step
inside one DeepSpeed engine (4 gloo processes, ZeRO-2 and ZeRO-3) against a single-process reference, and the same
through the trainer (2 processes, a plan with groups at sp=1 and sp=2, every loss normalizer's gradient)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hbp_train.model.attention import cu_seqlens_from_position_ids
from hbp_train.model.ulysses import check_sp_heads, padded_cu_seqlens, split_for_sp
from hbp_train.common.errors import UserError
from hbp_train.common.labels import IGNORE_INDEX
from tests.distributed import run_distributed

VOCAB = 64
SP_SCHEDULE = [1, 2, 4, 2, 1]  # the SP degree of each step
MICRO_BATCHES = [2, 1, 2, 1, 1]  # micro-batches per replica in each step
KV_HEADS = (4, 2, 1)  # MHA, and GQA with kv replication at sp=4 (2 kv heads) and sp >= 2 (1 kv head)


# ------------------------------------------------------------------------------------------- data helpers
def make_pack(rng: np.random.Generator, num_samples: int, max_len: int = 12) -> dict:
    """One collated pack as data.py hands it over: per-sample shifted labels, position_ids restarting per sample."""
    lengths = rng.integers(1, max_len + 1, size=num_samples)
    input_ids, shift_labels, position_ids, sample_ids = [], [], [], []
    for i, n in enumerate(lengths):
        ids = rng.integers(0, VOCAB, size=n)
        labels = ids.copy()
        labels[: rng.integers(0, n)] = IGNORE_INDEX  # a prompt that is not trained on
        input_ids.append(ids)
        shift_labels.append(np.append(labels[1:], IGNORE_INDEX))  # the last token of a sample predicts nothing
        position_ids.append(np.arange(n))
        sample_ids.append(np.full(n, i))
    cat = lambda parts: torch.as_tensor(np.concatenate(parts), dtype=torch.long)[None]  # noqa: E731
    return {
        "input_ids": cat(input_ids), "shift_labels": cat(shift_labels), "position_ids": cat(position_ids),
        "sample_ids": cat(sample_ids),
        "cu_seqlens": torch.as_tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32),
        "max_seqlen": int(lengths.max()), "num_samples": num_samples,
    }


def step_data(step: int, world_size: int) -> list[list[dict]]:
    """Every replica's micro-batches of one step (the same on every rank): [replica][micro_batch] -> pack."""
    rng = np.random.default_rng(1000 + step)
    num_replicas = world_size // SP_SCHEDULE[step]
    return [
        [make_pack(rng, int(rng.integers(1, 5))) for _ in range(MICRO_BATCHES[step])] for _ in range(num_replicas)
    ]


# ----------------------------------------------------------------------------------------- split_for_sp
@pytest.mark.parametrize("sp", [1, 2, 4])
def test_split_for_sp_pads_only_to_a_multiple_and_reassembles(sp):
    rng = np.random.default_rng(sp)
    for _ in range(20):
        pack = make_pack(rng, int(rng.integers(1, 6)))
        num_tokens = pack["input_ids"].shape[1]
        slices = [split_for_sp(pack, sp, r) for r in range(sp)]
        pad = slices[0]["num_pad_tokens"]
        assert 0 <= pad < sp and (num_tokens + pad) % sp == 0
        assert sum(s["num_local_tokens"] for s in slices) == num_tokens
        assert len({s["input_ids"].shape for s in slices}) == 1  # equal slices: the all-to-all needs them
        whole = {k: torch.cat([s[k] for s in slices], dim=1) for k in ("input_ids", "shift_labels", "position_ids")}
        for key in whole:
            assert torch.equal(whole[key][:, :num_tokens], pack[key])
        # padding: no loss, position_ids 0.. so it is a sample of its own and the real boundaries are kept
        assert (whole["shift_labels"][0, num_tokens:] == IGNORE_INDEX).all()
        cu, _ = cu_seqlens_from_position_ids(whole["position_ids"])
        expected = pack["cu_seqlens"].tolist() + ([num_tokens + pad] if pad else [])
        assert cu.tolist() == expected
        # what SequenceParallel.split hands every layer instead of searching the gathered position_ids
        assert padded_cu_seqlens(pack["cu_seqlens"], pad).tolist() == expected
        # whole-pack fields are untouched
        assert torch.equal(slices[-1]["cu_seqlens"], pack["cu_seqlens"])


def test_split_for_sp_rejects_bad_arguments():
    pack = make_pack(np.random.default_rng(0), 2)
    with pytest.raises(ValueError, match="sp_rank"):
        split_for_sp(pack, 2, 2)
    del pack["shift_labels"]
    with pytest.raises(ValueError, match="shift_labels"):
        split_for_sp(pack, 2, 0)


# -------------------------------------------------------------------------------------------- head limits
def test_check_sp_heads_limits():
    check_sp_heads(8, 2, [1, 2, 4, 8])  # split kv at 2, replicate at 4 and 8
    check_sp_heads(4, 1, [1, 2, 4])
    with pytest.raises(UserError, match="does not divide the model's 6 attention heads"):
        check_sp_heads(6, 6, [1, 2, 4])
    with pytest.raises(UserError, match="3 key/value heads"):
        check_sp_heads(12, 3, [1, 2])


def test_sequence_parallel_state_is_its_own_object():
    """Without a model (no attention): tokens are booked as non-SP tokens, the split follows the active degree,
    a degree without Ulysses attention is refused, and two objects share nothing."""
    from hbp_train.distributed.groups import build_parallel_state
    from hbp_train.model.ulysses import SequenceParallel

    sp = SequenceParallel(build_parallel_state([1]))
    sp.begin_micro_batch(7)
    sp.begin_micro_batch(5)
    other = SequenceParallel(build_parallel_state([1]))
    assert sp.stats.take_step_counts() == (12, 0) and sp.stats.take_step_counts() == (0, 0)
    assert other.stats.take_step_counts() == (0, 0)
    pack = make_pack(np.random.default_rng(0), 3)
    assert sp.split(pack)["num_local_tokens"] == pack["input_ids"].shape[1]
    with pytest.raises(ValueError, match="sp=2 has no Ulysses attention"):
        sp.set_active(2)
    assert sp.active_sp == 1


def test_the_packs_longest_sample_bounds_its_padding_too(monkeypatch):
    """Under SP the pack is padded to a multiple of sp and the padding is a sample of its own, which the core attention
    sees with the pack's boundaries. Tiny samples at sp >= 4 can be shorter than that padding: max_seqlen must still
    bound every sample, or a flash kernel skips the padding's rows and leaves them uninitialised (NaN x 0 in the
    weight gradient). Checked on every rank, at the boundaries the core attention is handed."""
    from types import SimpleNamespace

    from hbp_train.model import ulysses

    handed = []
    monkeypatch.setattr(ulysses, "hf_packed_attention", lambda *args, **kwargs: handed.append(kwargs) or (None, None))
    ones = torch.ones(1, 5, dtype=torch.long)
    pack = {"input_ids": ones, "shift_labels": ones, "position_ids": torch.zeros(1, 5, dtype=torch.long),
            "cu_seqlens": torch.arange(6, dtype=torch.int32), "max_seqlen": 1}  # five one-token samples
    for rank in range(4):
        sp = ulysses.SequenceParallel(SimpleNamespace(sp_degrees=[1, 4], sp_rank=lambda degree, rank=rank: rank))
        sp.active_sp = 4  # a stand-in that only cuts packs: no Ulysses attention is built without a model
        local = sp.split(pack)
        assert local["num_pad_tokens"] == 3  # 5 tokens padded to 8: a padding sample of 3 tokens
        sp._core_attention(None, torch.empty(1), None, None, None)
        bounds = handed[-1]["cu_seq_lens_q"]
        assert bounds.tolist() == [0, 1, 2, 3, 4, 5, 8]
        assert handed[-1]["max_length_q"] >= int((bounds[1:] - bounds[:-1]).max()), rank


# ------------------------------------------------------------------------------- distributed vs reference
def _tiny_llama(num_kv_heads: int, attn: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=num_kv_heads, head_dim=8, max_position_embeddings=64, use_cache=False,
        attn_implementation=attn,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def _reference(ref_model, packs: list[dict], num_loss_tokens: int):
    """Single process, one sample at a time (no packing, no SP): per-pack logits and the step's gradient."""
    ref_model.zero_grad()
    logits_per_pack = []
    for pack in packs:
        bounds = pack["cu_seqlens"].tolist()
        pack_logits = []
        for start, end in zip(bounds[:-1], bounds[1:]):
            logits = ref_model(input_ids=pack["input_ids"][:, start:end]).logits[0]
            loss = torch.nn.functional.cross_entropy(
                logits, pack["shift_labels"][0, start:end], ignore_index=IGNORE_INDEX, reduction="sum"
            )
            (loss / num_loss_tokens).backward()
            pack_logits.append(logits.detach())
        logits_per_pack.append(torch.cat(pack_logits))
    return logits_per_pack, {n: p.grad.clone() for n, p in ref_model.named_parameters()}


def _switching_worker(rank, world_size, zero_stages):
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from hbp_train.model import ulysses
    from hbp_train.model.attention_setup import register_packed_attention
    from hbp_train.model.loss import normalize_loss
    from hbp_train.observe.telemetry import all_gather_floats
    from hbp_train.distributed.groups import build_parallel_state, init_distributed

    init_distributed()
    pstate = build_parallel_state(sorted(set(SP_SCHEDULE)))
    report = {}
    for zero_stage, num_kv_heads in [(stage, kv) for stage in zero_stages for kv in KV_HEADS]:
        model = _tiny_llama(num_kv_heads, "sdpa")
        register_packed_attention(model, "sdpa_block")
        sp_state = ulysses.setup_sequence_parallel(model, pstate)
        ref_model = _tiny_llama(num_kv_heads, "eager")
        ds_config = {
            "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_optimization": {"stage": zero_stage}, "steps_per_print": 10**9,
        }
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
        worst_logits, worst_grad, kv_groups = 0.0, 0.0, []
        for step, sp in enumerate(SP_SCHEDULE):
            sp_state.set_active(sp)
            replicas = step_data(step, world_size)
            all_packs = [pack for replica in replicas for pack in replica]
            num_loss_tokens = sum(int((p["shift_labels"] != IGNORE_INDEX).sum()) for p in all_packs)
            # The reference sees the engine's current weights (collective under ZeRO-3: every rank calls it).
            with torch.no_grad():
                for name, param in engine.module.named_parameters():
                    ref_model.get_parameter(name).copy_(safe_get_full_fp32_param(param))
            ref_logits, ref_grads = _reference(ref_model, all_packs, num_loss_tokens)
            my_packs = replicas[pstate.dp_rank(sp)]
            my_ref_logits = ref_logits[pstate.dp_rank(sp) * len(my_packs):]
            for k, pack in enumerate(my_packs):
                local = ulysses.split_for_sp(pack, sp, pstate.sp_rank(sp))
                sp_state.begin_micro_batch(local["num_local_tokens"])
                engine.set_gradient_accumulation_boundary(k == len(my_packs) - 1)
                logits = engine(input_ids=local["input_ids"], position_ids=local["position_ids"]).logits[0]
                loss_T = torch.nn.functional.cross_entropy(
                    logits, local["shift_labels"][0].clamp(min=0), reduction="none"
                )
                loss = normalize_loss(
                    loss_T, local["shift_labels"], None, "ave_token", global_loss_tokens=num_loss_tokens,
                    dp_world_size=pstate.dp_size(sp),
                )
                engine.backward(sp_state.reduce_loss(loss))
                # logits of this rank's slice vs the per-sample reference (padding excluded)
                start = pstate.sp_rank(sp) * logits.shape[0]
                real = local["num_local_tokens"]
                expected = my_ref_logits[k][start:start + real]
                worst_logits = max(worst_logits, float((logits[:real].detach() - expected).abs().max()))
            kv_groups.append(sorted({m.num_key_value_groups for m in engine.module.modules()
                                     if hasattr(m, "num_key_value_groups")}))
            for name, param in engine.module.named_parameters():
                grad = safe_get_full_grad(param)
                ref = ref_grads[name]
                rel = float((grad - ref).norm() / ref.norm().clamp(min=1e-30))
                worst_grad = max(worst_grad, rel)
            engine.step()
            # the trainer's per-step all-gather: fake compute times, the live token counts
            table = all_gather_floats([0.01 * (rank + 1), *sp_state.stats.take_step_counts()], torch.device("cpu"))
            metrics = sp_state.stats.step_metrics(table[:, 0].tolist(), table[:, 1].tolist(), table[:, 2].tolist())
            metrics["counted_tokens"] = float(table[:, 1].sum())
            report.setdefault((zero_stage, num_kv_heads, "metrics"), []).append(metrics)
            report.setdefault("tokens", {})[step] = sum(p["input_ids"].shape[1] for p in all_packs)
        report[zero_stage, num_kv_heads] = {"logits": worst_logits, "grad": worst_grad, "kv_groups": kv_groups}
        sp_state.set_active(1)
        del engine
    return report


@pytest.mark.slow
@pytest.mark.full  # the trainer's own SP switch is proven in the default tier (test_trainer_switches_sp...)
def test_sp_switching_matches_single_process():
    """One engine per ZeRO stage (2, 3) and model, sp 1 -> 2 -> 4 -> 2 -> 1 with 1-2 micro-batches per step; MHA
    and GQA with 2 and 1 kv heads: logits match the per-sample reference and every step's gradient matches the
    single-process gradient of the step's data. One spawn for everything (each costs ~15 s of imports)."""
    reports = run_distributed(_switching_worker, 4, (2, 3))
    tokens = [reports[0]["tokens"][step] for step in range(len(SP_SCHEDULE))]
    sp_tokens = sum(t for t, sp in zip(tokens, SP_SCHEDULE) if sp > 1)
    for rank, report in enumerate(reports):
        for zero_stage in (2, 3):
            for num_kv_heads in KV_HEADS:
                r = report[zero_stage, num_kv_heads]
                where = (rank, zero_stage, num_kv_heads, r)
                assert r["logits"] < 1e-5 and r["grad"] < 1e-5, where
                # num_key_value_groups is back to H/K after each switch to sp=1 (the wrapper changes it under
                # kv replication)
                for sp, groups in zip(SP_SCHEDULE, r["kv_groups"]):
                    if sp == 1:
                        assert groups == [4 // num_kv_heads], where
                metrics = report[zero_stage, num_kv_heads, "metrics"]
                assert [m["sp/cr_step"] for m in metrics] == [float(sp > 1) for sp in SP_SCHEDULE]
                assert metrics[-1]["time/compute_s/rank3"] == pytest.approx(0.04)
                # every step's tokens are counted once (slices, no padding) and CR accumulates over steps
                assert [m["counted_tokens"] for m in metrics] == tokens
                assert metrics[-1]["sp/cr"] == pytest.approx(sp_tokens / sum(tokens))


# --------------------------------------------------------------------- through the trainer (integration)
# Two ranks; group 0 at sp=1 (two replicas), group 1 at sp=2 (one replica split over both ranks); m varies.
SP_TRAINER_STEPS = [
    {"group": 0, "replicas": [[[0, 1], [2]], [[3], [4, 5]]]},
    {"group": 1, "replicas": [[[6, 7], [8]]]},
    {"group": 0, "replicas": [[[9]], [[10, 11]]]},
    {"group": 1, "replicas": [[[12, 13]]]},
]
TRAINER_CASES = [(2, "ave_token"), (2, "sample_mean"), (2, "token_mean"), (3, "ave_token")]
TOKENIZER_VOCAB = 4096  # the shipped tokenizer's


def _trainer_worker(rank, world_size, shards, out, cases, loop_overrides):
    """For every (ZeRO stage, normalizer) case: the held-out loss at the initial weights, then every optimizer
    step's weights before it, its gradients and the SP degree of each micro-batch; then the whole loop once (with
    ``loop_overrides``) for the step metrics and the log line."""
    import deepspeed
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad

    from hbp_train import config, trainer
    from hbp_train.build import build
    from hbp_train.distributed.groups import init_distributed
    from hbp_train.observe.heldout import evaluate
    from tests.assets.packed_fixture import TINY_LLAMA

    from hbp_train.model import attention

    init_distributed()
    model_cfg = "{" + ",".join(f"{k}:{str(v).lower()}" for k, v in TINY_LLAMA.items()) + "}"
    results = {}
    # Boundaries found from position_ids (a nonzero() and an .item() each, host syncs on a GPU): the trainer hands
    # every layer the pack's cu_seqlens instead, in forward and in recompute, at sp=1 and under Ulysses.
    searched = []
    find_boundaries = attention.cu_seqlens_from_position_ids
    attention.cu_seqlens_from_position_ids = lambda *a: searched.append(1) or find_boundaries(*a)
    for zero_stage, normalizer in cases:
        cfg = config.load([
            "experiment=cpu_demo", f"data.shards={shards}", f"train.out_dir={out}/{zero_stage}_{normalizer}",
            "logging=quiet", f"model.config={model_cfg}", f"deepspeed.zero_stage={zero_stage}",
            f"loss.normalizer={normalizer}", "train.warmup_steps=0", "train.lr=1e-2", "train.grad_clip=0",
        ])
        run = build(cfg)
        named = list(run.engine.module.named_parameters())
        # Held-out loss over the same shards at the initial weights (sp=1 and sp=2 steps; ZeRO-2 and ZeRO-3).
        results[(zero_stage, normalizer, "eval")] = evaluate(run, run.data)["loss/eval"]
        per_step = []
        for step in range(run.data.num_steps):
            params = {n: safe_get_full_fp32_param(p).clone() for n, p in named}
            step_batch = run.data.step_batch(step, rank)
            trainer.forward_backward(run, step_batch)
            per_step.append({"params": params, "grads": {n: safe_get_full_grad(p).clone() for n, p in named},
                             "sp": [mb["sp"] for mb in step_batch.micro_batches]})
            run.engine.step()
        results[(zero_stage, normalizer)] = per_step
        del run
    results["boundary_searches"] = len(searched)
    attention.cu_seqlens_from_position_ids = find_boundaries
    cfg = config.load(["experiment=cpu_demo", f"data.shards={shards}", f"train.out_dir={out}/loop", "logging=quiet",
                       *loop_overrides])
    trainer.train(cfg)
    deepspeed.comm.barrier()
    return results if rank == 0 else None


def _check_against_single_process(results, samples, reference_step):
    """Each case's held-out loss is the token mean over every sample run alone, and each optimizer step's gradient
    the normalizer's single-process gradient over ``reference_step(k, normalizer)`` (its packs as
    reference_normalized_loss takes them)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from tests.assets.packed_fixture import TINY_LLAMA, reference_normalized_loss

    model = AutoModelForCausalLM.from_config(
        LlamaConfig(**TINY_LLAMA, vocab_size=TOKENIZER_VOCAB, use_cache=False), attn_implementation="eager")
    every_pack = {"replicas": [[p for s in SP_TRAINER_STEPS for r in s["replicas"] for p in r]]}
    for case, per_step in results.items():
        if case[-1] == "eval":
            continue
        zero_stage, normalizer = case
        model.load_state_dict({k.removeprefix("model."): v for k, v in per_step[0]["params"].items()})
        with torch.no_grad():
            reference = float(reference_normalized_loss(model, samples, every_pack, "ave_token"))
        assert results[case + ("eval",)] == pytest.approx(reference, rel=1e-5), case
        for k, got in enumerate(per_step):
            model.load_state_dict({n.removeprefix("model."): v for n, v in got["params"].items()})
            model.zero_grad()
            reference_normalized_loss(model, samples, reference_step(k, normalizer), normalizer).backward()
            for name, param in model.named_parameters():
                ref, grad = param.grad, got["grads"]["model." + name]
                rel = float((grad - ref).norm() / ref.norm())
                assert rel <= 1e-5, (zero_stage, normalizer, k, name, rel)


@pytest.mark.slow
def test_trainer_switches_sp_with_exact_gradients(tmp_path, tokenizer_dir):
    """trainer.forward_backward on 2 ranks with a plan whose groups run at sp=1 and sp=2: every step's gradient is
    the normalizer's single-process gradient (ZeRO-2 and 3); the full loop logs the SP degree, CR and rank times."""
    import json

    from hbp_train.observe.telemetry import format_line
    from tests.assets.packed_fixture import synthetic_samples, write_packed

    samples = synthetic_samples(14, TOKENIZER_VOCAB, seed=5)
    assert sum(len(samples[i][0]) for i in (6, 7)) % 2 == 1  # an sp=2 pack that needs a padding token
    # group 1 at sp=2 with activation recompute, which re-runs the all-to-all in backward
    shards = write_packed(str(tmp_path / "packed"), samples, SP_TRAINER_STEPS, world_size=2,
                          groups={1: {"sp": 2, "ckpt_layers": 1}})
    results = run_distributed(_trainer_worker, 2, shards, str(tmp_path / "runs"), TRAINER_CASES,
                              [f"data.eval_shards={shards}", "train.eval_every=3"])[0]
    assert results.pop("boundary_searches") == 0  # no layer (forward, recompute, held-out) searched position_ids
    _check_against_single_process(results, samples, lambda k, normalizer: SP_TRAINER_STEPS[k])

    with open(tmp_path / "runs" / "loop" / "metrics.jsonl") as f:
        logged = [json.loads(line) for line in f]
    assert [m["plan/sp"] for m in logged] == [1, 2, 1, 2]
    assert [m["plan/sp_degrees"] for m in logged] == [[1], [2], [1], [2]]
    assert [m["sp/token_share/sp2"] for m in logged] == [0.0, 1.0, 0.0, 1.0]
    # data.eval_shards with train.eval_every=3: held-out loss after step 3 and after the last one
    assert ["loss/eval" in m for m in logged] == [False, False, True, True]
    assert all(m["loss/eval"] > 0 and m["eval/loss_tokens"] == logged[2]["eval/loss_tokens"] for m in logged[2:])
    assert [m["sp/cr_step"] for m in logged] == [0.0, 1.0, 0.0, 1.0]
    tokens = [sum(len(samples[i][0]) for r in s["replicas"] for p in r for i in p) for s in SP_TRAINER_STEPS]
    assert logged[-1]["sp/cr"] == pytest.approx((tokens[1] + tokens[3]) / sum(tokens))
    assert all(m["time/compute_s/rank0"] > 0 and m["time/compute_s/rank1"] > 0 for m in logged)
    assert "sp=2" in format_line(logged[1]) and "sp=1" in format_line(logged[0])


# Two optimizer steps that each mix the groups (hbp step_mix="mixed"): plan steps 0 (sp=1) + 1 (sp=2), then 2 + 3.
MIXED_OPTIMIZER_STEP = [0, 0, 1, 1]
MIXED_CASES = [(2, "ave_token"), (2, "token_mean"), (3, "sample_mean")]


@pytest.mark.slow
def test_trainer_runs_optimizer_steps_that_mix_groups_with_exact_gradients(tmp_path, tokenizer_dir):
    """A plan whose optimizer steps each hold a plan step at sp=1 and one at sp=2 (plan.json "optimizer_step"): on 2
    ranks the trainer runs both in one step, switching the SP degree between micro-batches, and every optimizer
    step's gradient is the normalizer's single-process gradient over all its samples (token_mean: per rank, its
    own sp=1 packs and the sp=2 packs it shares); the held-out loss is the token mean; the loop logs 2 steps, each
    with both SP degrees and their shares of its tokens and compute time (JSON rows, rank-0 line, metrics.png)."""
    import json

    from hbp_train.observe.telemetry import format_line
    from tests.assets.packed_fixture import synthetic_samples, write_packed

    samples = synthetic_samples(14, TOKENIZER_VOCAB, seed=5)
    steps = [{**step, "optimizer_step": k} for step, k in zip(SP_TRAINER_STEPS, MIXED_OPTIMIZER_STEP)]
    shards = write_packed(str(tmp_path / "packed"), samples, steps, world_size=2, groups={1: {"sp": 2}})
    results = run_distributed(_trainer_worker, 2, shards, str(tmp_path / "runs"), MIXED_CASES, [])[0]
    assert results.pop("boundary_searches") == 0  # the degree switches mid-step: each micro-batch its boundaries

    def reference_step(k, normalizer):
        """The optimizer step's samples as reference_normalized_loss takes them."""
        parts = [s for s, o in zip(SP_TRAINER_STEPS, MIXED_OPTIMIZER_STEP) if o == k]
        sp1, sp2 = [p for p in parts if len(p["replicas"]) == 2], [p for p in parts if len(p["replicas"]) == 1]
        shared = [pk for p in sp2 for pk in p["replicas"][0]]
        if normalizer == "token_mean":  # each rank: its sp=1 replica's packs and the sp=2 packs of its SP group
            return {"replicas": [[pk for p in sp1 for pk in p["replicas"][r]] + shared for r in range(2)]}
        return {"replicas": [[pk for p in parts for rep in p["replicas"] for pk in rep]]}

    for case, per_step in results.items():
        if case[-1] != "eval":  # both degrees in each optimizer step
            assert len(per_step) == 2 and all(set(s["sp"]) == {1, 2} for s in per_step), case
    _check_against_single_process(results, samples, reference_step)
    with open(tmp_path / "runs" / "loop" / "metrics.jsonl") as f:
        logged = [json.loads(line) for line in f]
    assert [m["plan/step"] for m in logged] == [0, 1] and [m["plan/micro_batches"] for m in logged] == [4, 2]

    def tokens(plan_step):
        return sum(len(samples[i][0]) for r in SP_TRAINER_STEPS[plan_step]["replicas"] for p in r for i in p)

    assert logged[-1]["sp/cr"] == pytest.approx((tokens(1) + tokens(3)) / sum(map(tokens, range(4))))
    # What each mixed step really ran: both degrees, each one's share of its tokens and of its compute time.
    for k, m in enumerate(logged):
        assert m["plan/sp_degrees"] == [1, 2] and m["plan/groups"] == [0, 1] and m["plan/sp"] == 2
        assert m["sp/token_share/sp2"] == pytest.approx(tokens(2 * k + 1) / (tokens(2 * k) + tokens(2 * k + 1)))
        assert m["sp/token_share/sp1"] + m["sp/token_share/sp2"] == pytest.approx(1.0)
        assert 0 < m["sp/time_share/sp2"] < 1 and m["sp/time_share/sp1"] + m["sp/time_share/sp2"] == pytest.approx(1.0)
        assert f"groups 0+1 sp=1 ({100 * m['sp/token_share/sp1']:.0f}% tokens, " in format_line(m)
        assert f"+ sp=2 ({100 * m['sp/token_share/sp2']:.0f}%, {100 * m['sp/time_share/sp2']:.0f}%)" in format_line(m)
    assert (tmp_path / "runs" / "loop" / "metrics.png").stat().st_size > 0
