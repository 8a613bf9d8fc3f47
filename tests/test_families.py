"""The support matrix (hbp_train/model/families.py): every tested family trains correctly under packing and SP.

(a) one pack of several samples gives the same per-token losses and gradients as each sample run alone (no
attention across samples, no state leaking between them); (b) SP=2 equals SP=1 on 2 gloo processes (slow);
(c) a short run of the trainer over a plan with sp=1 and sp=2 groups (slow); (d) the loss is the model's own: at
initialisation our per-sample losses on a packed micro-batch equal each sample's loss from the model's HF
``forward(labels=...)`` run alone, at SP=1 (both loss paths, with gradients) and at SP=2 (slow, the spawn of (b)).
No test branches on a family name.
"""

from __future__ import annotations

import pytest
import torch

from hbp_train.model.packed_lm import PackedCausalLM
from hbp_train.model.families import FAMILIES, tiny_config
from hbp_train.common.labels import IGNORE_INDEX
from hbp_train.model.lora import LoraSettings
from hbp_train.model.loss import token_loss_weights
from hbp_train.model.hf_model import ModelConfig, build_model
from hbp_train.model.moe import pack_aux_loss, router_aux_of

VOCAB = 128
LENGTHS = (7, 12, 5)  # samples of one pack
AUX_COEF = 0.5  # MoE router loss weight in the SP test (large, so that a wrong aux gradient shows)
# The router-loss keys each MoE family's checkpoints carry: DeepSeek-V3's own (its sequence-wise loss over the
# experts its sigmoid, group-limited router chose), HF's load-balancing weight for the others.
ROUTER_LOSS = {"deepseek_v3": {"aux_loss_alpha": AUX_COEF, "seq_aux": True, "scoring_func": "sigmoid"}}


def router_loss_keys(family: str) -> dict:
    return ROUTER_LOSS.get(family.partition("+")[0], {"router_aux_loss_coef": AUX_COEF})


def aux_per_token(wrapper, aux_cfg, num_real: int, sample_ids, num_samples: int, sum_over_sp) -> torch.Tensor:
    """The router loss of each token of a pack (or of this rank's slice: ``sample_ids``, its first ``num_real``
    tokens real) of ``num_samples`` samples, as the trainer computes it (moe.py)."""
    aux = pack_aux_loss(wrapper.router_logits, num_real, aux_cfg, sum_over_sp, wrapper.router_choices, sample_ids,
                        num_samples)
    return aux.expand(sample_ids.shape[-1]) if aux.dim() == 0 else aux


def tiny_model(family: str, **overrides):
    """The tiny model of ``family``; "<family>+lora" / "<family>+dora": with LoRA / DoRA adapters (rank 4) on the
    default targets (hbp_train/model/lora.py)."""
    family, _, adapter = family.partition("+")
    assert adapter in ("", "lora", "dora"), adapter
    lora = LoraSettings(r=4, dora=adapter == "dora") if adapter else LoraSettings()
    return build_model(ModelConfig(config=tiny_config(family, **overrides), architecture=family, seed=3, lora=lora),
                       vocab_size=VOCAB)


def make_samples(lengths=LENGTHS, seed=0):
    """Token ids and per-sample shifted labels (a prompt of 2 tokens not trained on) for each sample."""
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for n in lengths:
        ids = torch.randint(0, VOCAB, (n,), generator=gen)
        labels = ids.clone()
        labels[:2] = IGNORE_INDEX
        samples.append((ids, torch.cat([labels[1:], torch.tensor([IGNORE_INDEX])])))
    return samples


def pack_of(samples):
    ids = torch.cat([s[0] for s in samples])[None]
    labels = torch.cat([s[1] for s in samples])[None]
    positions = torch.cat([torch.arange(len(s[0])) for s in samples])[None]
    cu = torch.tensor([0, *torch.cumsum(torch.tensor([len(s[0]) for s in samples]), 0).tolist()], dtype=torch.int32)
    sample_ids = torch.repeat_interleave(torch.arange(len(samples)), torch.tensor([len(s[0]) for s in samples]))[None]
    return ids, positions, labels, cu, max(len(s[0]) for s in samples), sample_ids


def _wrapper(model, aux_cfg):
    return PackedCausalLM(model, chunk_size=16, router_aux=aux_cfg is not None,
                          router_choices=aux_cfg is not None and aux_cfg.deepseek)


def losses_and_grads(model, runs, with_aux=False):
    """Per-token losses of each forward in ``runs`` (input_ids, position_ids, shift_labels, cu, max_len,
    sample_ids), and the gradients of their sum (``with_aux``: plus an MoE model's router loss, coef x each loss
    token's aux; the per-token aux comes first)."""
    aux_cfg = router_aux_of(model.config) if with_aux else None
    wrapper = _wrapper(model, aux_cfg)
    model.zero_grad(set_to_none=True)
    out = []
    for ids, positions, labels, cu, max_len, sample_ids in runs:
        loss_T = wrapper(ids, positions, labels, cu, max_len)
        objective = loss_T.sum()
        if aux_cfg is not None:
            aux_T = aux_per_token(wrapper, aux_cfg, ids.shape[1], sample_ids, int(sample_ids.max()) + 1, lambda t: t)
            objective = objective + aux_cfg.coef * (aux_T * (labels[0] != IGNORE_INDEX)).sum()
            out.append(aux_T.detach())
        objective.backward()
        out.append(loss_T.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return torch.cat(out), grads


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("boundaries", ["cu_seqlens", "position_ids"])
def test_packed_equals_per_sample(family, boundaries):
    model = tiny_model(family)
    samples = make_samples()
    ids, positions, labels, cu, max_len, _ = pack_of(samples)
    if boundaries == "position_ids":  # what the attention sees under Ulysses: boundaries from position restarts
        cu = max_len = None
    packed_loss, packed_grads = losses_and_grads(model, [(ids, positions, labels, cu, max_len, None)])
    alone = [pack_of([s]) for s in samples]
    single_loss, single_grads = losses_and_grads(model, alone)
    assert (labels != IGNORE_INDEX).sum() > 0 and packed_loss.abs().sum() > 0
    torch.testing.assert_close(packed_loss, single_loss, rtol=1e-5, atol=1e-5)
    assert packed_grads.keys() == single_grads.keys() and len(packed_grads) > 0
    for name, grad in packed_grads.items():
        torch.testing.assert_close(grad, single_grads[name], rtol=1e-4, atol=1e-5, msg=f"{family}: {name}")


# ------------------------------------------------------------------------ (d) our loss is the model's own
def hf_reference(model):
    """The same weights in the family's own HF causal LM: eager attention, no packed attention, its own forward and
    loss (what a user's evaluation of the export runs); eval mode, no router loss added to the LM loss."""
    import copy

    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    if hasattr(config, "output_router_logits"):
        config.output_router_logits = False
    reference = AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    missing, unexpected = reference.load_state_dict(model.state_dict(), strict=False)
    assert not unexpected and all("lm_head" in k for k in missing), (missing, unexpected)  # tied heads: the same
    return reference.eval()


def hf_losses(reference, samples) -> list:
    """Each sample's loss from the model's own ``forward(labels=...)`` on the sample alone (HF shifts the labels)."""
    out = []
    for ids, shift_labels in samples:
        labels = torch.cat([torch.tensor([IGNORE_INDEX]), shift_labels[:-1]])
        out.append(reference(input_ids=ids[None], labels=labels[None]).loss)
    return out


def per_sample_means(loss_T, samples) -> torch.Tensor:
    """The mean of each sample's token losses in a pack's per-token losses (samples in pack order)."""
    means, start = [], 0
    for ids, shift_labels in samples:
        trained = shift_labels != IGNORE_INDEX
        means.append(loss_T[start:start + len(ids)][trained].sum() / trained.sum())
        start += len(ids)
    return torch.stack(means)


def assert_own_loss(model, samples, what: str, grad_close=None) -> None:
    """Each sample's mean token loss from our LM-head loss on one pack of ``samples`` (chunked and fused) equals the
    loss the model's own HF forward(labels=...) gives the sample alone, and the gradient of their sum equals that of
    the sum of HF's losses (``grad_close(ours, ref, what)``; default: assert_close at rtol 1e-4)."""
    reference = hf_reference(model)
    assert reference.config._attn_implementation == "eager"
    theirs = torch.stack(hf_losses(reference, samples))
    theirs.sum().backward()
    theirs = theirs.detach()
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.grad is not None}
    ids, positions, labels, cu, max_len, sample_ids = pack_of(samples)
    # sample_mean's weights (one micro-batch, one rank): the weighted sum is the sum of the samples' mean losses
    weights = token_loss_weights(labels, sample_ids, "sample_mean", global_num_samples=1)
    for fused in (False, True):
        wrapper = PackedCausalLM(model, chunk_size=16, fused_loss=fused)
        model.zero_grad(set_to_none=True)
        total, loss_T = wrapper(ids, positions, labels, cu, max_len, loss_weights=weights)
        total.backward()
        ours = per_sample_means(loss_T.detach(), samples)
        path = "fused" if fused else "chunked"
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5,
                                   msg=f"{what} {path}: ours {ours.tolist()} vs HF {theirs.tolist()}")
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert ref_grads and grads.keys() >= ref_grads.keys()
        for name, ref in ref_grads.items():
            if grad_close is None:
                torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-6, msg=f"{what} {path}: {name}")
            else:
                grad_close(grads[name], ref, f"{what} {path}: {name}")


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_our_per_sample_losses_are_the_models_own_loss(family):
    """At initialisation, one pack of three samples: our per-sample losses and gradients are those of the model's
    own HF forward: whatever the family's head does to the logits (Granite's logits_scaling, Cohere's logit_scale)
    is in our loss too."""
    assert_own_loss(tiny_model(family), make_samples(), family)


# ------------------------------------------------------------------------------------ (b) SP=2 == SP=1
def _pack_batch(seed: int) -> dict:
    ids, positions, labels, cu, max_len, sample_ids = pack_of(make_samples(seed=seed))
    return {"input_ids": ids, "position_ids": positions, "shift_labels": labels, "cu_seqlens": cu,
            "max_seqlen": max_len, "sample_ids": sample_ids}


def _sp_worker(rank, world_size, families):
    """Every family at sp=2 then sp=1 on the same weights: each rank's slice forward, the SP loss all-reduce and
    backward as the trainer does; returns the gathered token losses and the rank-summed gradients."""
    import torch.distributed as dist

    from hbp_train.distributed.groups import build_parallel_state, init_distributed
    from hbp_train.model.ulysses import setup_sequence_parallel

    init_distributed()
    pstate = build_parallel_state([1, 2])
    out = {}
    for family in families:
        model = tiny_model(family, **router_loss_keys(family))  # MoE: the router loss, made to matter
        aux_cfg = router_aux_of(model.config)
        sp = setup_sequence_parallel(model, pstate)
        wrapper = _wrapper(model, aux_cfg)
        batch = _pack_batch(seed=1)
        for degree in (2, 1):  # sp=1 after sp=2: nothing the SP step changed in the model may leak
            sp.set_active(degree)
            model.zero_grad(set_to_none=True)
            local = sp.split(batch)
            whole = degree == 1
            loss_T = wrapper(local["input_ids"], local["position_ids"], local["shift_labels"],
                             local["cu_seqlens"] if whole else None, local["max_seqlen"] if whole else None)
            objective = loss_T.sum()
            aux_T = None
            if aux_cfg is not None:  # as the trainer: the pack's (sample's) aux, summed over the SP group, per token
                aux_T = aux_per_token(wrapper, aux_cfg, local["num_local_tokens"], local["sample_ids"],
                                      len(batch["cu_seqlens"]) - 1, sp.reduce_loss)
                objective = objective + aux_cfg.coef * (aux_T * (local["shift_labels"][0] != IGNORE_INDEX)).sum()
            sp.reduce_loss(objective).backward()

            def gathered(values):
                pieces = [torch.empty_like(values) for _ in range(world_size)]
                dist.all_gather(pieces, values.detach())
                return torch.cat(pieces)[: batch["input_ids"].shape[1]] if degree > 1 else values.detach()

            grads = {}
            for name, param in model.named_parameters():
                if not param.requires_grad:  # frozen (LoRA): no gradient may appear
                    assert param.grad is None, name
                    continue
                grad = param.grad.clone() if param.grad is not None else torch.zeros_like(param)
                dist.all_reduce(grad)  # DeepSpeed's average over the W ranks (the loss above is the group's)
                grads[name] = grad / world_size
            losses = gathered(loss_T)
            if aux_T is not None:
                losses = torch.cat([gathered(aux_T), losses])
            out[family, degree] = (losses, grads)
        sp.uninstall(model)
    return out if rank == 0 else None


# with adapters (LoRA on the MoE family: attention, router and fused experts; DoRA on a dense one, whose kv head is
# replicated at sp=2): only the adapters get gradients
SP_FAMILIES = [*sorted(FAMILIES), "qwen3_moe+lora", "mistral+dora"]


@pytest.fixture(scope="module")
def sp_runs():
    """One spawn of 2 gloo processes for every family of SP_FAMILIES (_sp_worker), shared by the SP=2 tests."""
    from tests.distributed import run_distributed

    return run_distributed(_sp_worker, 2, SP_FAMILIES, timeout=900)[0]


@pytest.mark.slow
def test_sp2_equals_sp1_for_every_family(sp_runs):
    """2 gloo processes, every family in one spawn: SP=2 (kv heads split or replicated; MLA's unequal head dims;
    MoE with the router loss summed over the SP group) and the following SP=1 step give the single-process losses
    (and router loss) and gradients."""
    result = sp_runs
    for family in SP_FAMILIES:
        model = tiny_model(family, **router_loss_keys(family))
        ref_loss, ref_grads = losses_and_grads(model, [tuple(_pack_batch(seed=1).values())], with_aux=True)
        for degree in (2, 1):
            loss, grads = result[family, degree]
            torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5, msg=f"{family} sp={degree}")
            assert grads.keys() == ref_grads.keys(), family
            for name, ref in ref_grads.items():
                torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-5,
                                           msg=f"{family} sp={degree}: {name}")


@pytest.mark.slow
def test_sp2_losses_are_the_models_own_loss_for_every_family(sp_runs):
    """(d) at SP=2: each sample of the pack split over 2 ranks, its mean token loss gathered from both equals the
    loss of the model's own HF forward(labels=...) on the sample alone (the spawn of (b); the token losses are the
    last ones of each result, after an MoE family's router loss)."""
    samples = make_samples(seed=1)
    num_tokens = sum(len(ids) for ids, _ in samples)
    differ = []  # every family that differs, named together
    for family in sorted(FAMILIES):
        with torch.no_grad():
            theirs = torch.stack(hf_losses(hf_reference(tiny_model(family, **router_loss_keys(family))), samples))
        for degree in (2, 1):
            ours = per_sample_means(sp_runs[family, degree][0][-num_tokens:], samples)
            if not torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5):
                differ.append(f"{family} sp={degree}: ours {[round(x, 5) for x in ours.tolist()]} vs HF "
                              f"{[round(x, 5) for x in theirs.tolist()]}")
    assert not differ, "\n".join(differ)


# ------------------------------------------------------------------------ (c) the trainer over an SP1/SP2 plan
# Two ranks; group 0 at sp=1 (two replicas), group 1 at sp=2 (one replica split over both ranks).
SP_PLAN_STEPS = [
    {"group": 0, "replicas": [[[0, 1], [2]], [[3], [4, 5]]]},
    {"group": 1, "replicas": [[[6, 7], [8]]]},
    {"group": 0, "replicas": [[[9]], [[10, 11]]]},
    {"group": 1, "replicas": [[[12, 13]]]},
]
TRAIN_FAMILIES = ("mistral", "mixtral", "deepseek_v3")  # dense (1 kv head, replicated at sp=2), MoE, MLA
# DeepSeek-V3 with its checkpoints' router-loss keys (transformers' config has none); Mixtral's config has its own.
TRAIN_ROUTER_LOSS = {"deepseek_v3": {"aux_loss_alpha": 0.001, "seq_aux": True, "scoring_func": "sigmoid"}}
TRAIN_STEPS = 10


def _hydra_value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_hydra_value(v) for v in value) + "]"
    return str(value).lower() if isinstance(value, bool) else str(value)


def model_overrides(family: str, **overrides) -> list:
    """The command-line overrides that train the tiny ``family`` model (``++``: set or add each HF field)."""
    config = tiny_config(family, **overrides)
    return [f"model.architecture={family}", *(f"++model.config.{k}={_hydra_value(v)}" for k, v in config.items())]


def _train_worker(rank, world_size, shards, out):
    from hbp_train import config, trainer
    from hbp_train.distributed.groups import init_distributed

    init_distributed()
    ended = {}
    for family in TRAIN_FAMILIES:
        cfg = config.load(["experiment=cpu_demo", f"data.shards={shards}", f"train.out_dir={out}/{family}",
                           "logging=quiet", "data.epochs=3", f"train.max_steps={TRAIN_STEPS}", "train.lr=1e-2",
                           "train.warmup_steps=0", "train.save_final=false",
                           *model_overrides(family, **TRAIN_ROUTER_LOSS.get(family, {}))])
        summary = trainer.train(cfg)
        ended[family] = (summary["ended"], summary["end_step"])
    return ended


@pytest.mark.slow
@pytest.mark.full  # every family through the trainer; test_sp2_equals_sp1_for_every_family stays in the default tier
def test_trainer_runs_every_kind_over_an_sp1_sp2_plan(tmp_path, tokenizer_dir):
    """10 steps of the trainer on 2 ranks for a dense, an MoE and the MLA family over a plan whose groups run at
    sp=1 and sp=2: every step finite, the SP degree switches, the loss falls, both MoE families log their router
    loss (Mixtral HF's, DeepSeek-V3 its own sequence-wise one)."""
    import json

    from tests.assets.packed_fixture import synthetic_samples, write_packed
    from tests.distributed import run_distributed

    shards = write_packed(str(tmp_path / "packed"), synthetic_samples(14, 4096, seed=7), SP_PLAN_STEPS, world_size=2,
                          groups={1: {"sp": 2}})
    ended = run_distributed(_train_worker, 2, shards, str(tmp_path / "runs"), timeout=900)
    for family in TRAIN_FAMILIES:
        assert ended[0][family] == ended[1][family] == ("finished", TRAIN_STEPS), family
        with open(tmp_path / "runs" / family / "metrics.jsonl") as f:
            logged = [json.loads(line) for line in f]
        assert len(logged) == TRAIN_STEPS and sorted({m["plan/sp"] for m in logged}) == [1, 2], family
        losses = [m["loss/train"] for m in logged]
        assert all(0 < x < 20 for x in losses) and not any(m["optim/skipped"] for m in logged), (family, losses)
        # the same four plan steps, once per epoch (shuffled): the later epochs' loss is lower
        assert sum(losses[4:8]) < sum(losses[:4]), (family, losses)
        has_aux = ["loss/aux" in m for m in logged]
        assert all(has_aux) if family in ("mixtral", "deepseek_v3") else not any(has_aux), family
        assert all(m["loss/aux"] > 0 for m in logged if "loss/aux" in m)


@pytest.mark.slow
@pytest.mark.full  # tests/test_compat.py proves the refusal itself
def test_an_unsupported_feature_stops_the_trainer_before_the_model_in_one_line(tmp_path, tokenizer_dir):
    """python -m hbp_train.train with a feature the packed path refuses (Gemma 3 made bidirectional): exit 2, one
    line, nothing built (the config check every rank runs first)."""
    import os
    import subprocess
    import sys

    from tests.assets.packed_fixture import ONE_RANK_STEPS, synthetic_samples, write_packed

    shards = write_packed(str(tmp_path / "packed"), synthetic_samples(12, 4096, seed=1), ONE_RANK_STEPS, world_size=1)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "hbp_train.train", "experiment=cpu_demo", f"data.shards={shards}",
         f"train.out_dir={tmp_path / 'run'}", "logging=quiet",
         *model_overrides("gemma3_text", use_bidirectional_attention=True)],
        cwd=repo, env=dict(os.environ, PYTHONPATH=repo, OMP_NUM_THREADS="1"), capture_output=True, text=True,
        timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error" in line]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert "gemma3_text" in lines[0] and "bidirectional attention" in lines[0], lines[0]
