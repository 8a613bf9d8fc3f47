"""Sliding windows and soft-capping train the model's own objective: our loss = the model's HF loss, per feature.

Each case is a tiny model of a family that has the feature, made so that the feature binds and moves HF's own loss
(asserted first, so that each test can fail): samples longer than the window packed beside short ones, queries and
keys scaled up so that attention is peaked (a window then hides keys that mattered) and the logits pass the cap.

* window: Mistral's one window in every layer;
* per-layer windows: Gemma 3's sliding and full layers, Qwen2's ``use_sliding_window`` with ``max_window_layers``;
* soft-cap: Gemma 2's ``attn_logit_softcapping`` (its window longer than every sample), then both together.

At SP=1 (one process): each sample's mean token loss from our loss, chunked and fused, equals the loss of the
model's own HF ``forward(labels=...)`` (eager attention) on the sample alone, and so do the gradients. At SP=2 (2
gloo processes, one spawn for every case; full tier): the same losses and the single-process gradients, the window
applied to the gathered pack, and Ulysses sized by a GPT-NeoX's real heads despite a stray num_key_value_heads. The
FlexAttention path's forward is checked on the CPU too (it has no CPU backward).
"""

from __future__ import annotations

import pytest
import torch

from hbp_train.model.packed_lm import PackedCausalLM
from hbp_train.model.families import tiny_config
from hbp_train.model.hf_model import ModelConfig, build_model
from tests.test_families import VOCAB, assert_own_loss, hf_losses, hf_reference, make_samples, pack_of, per_sample_means

LENGTHS = (24, 5, 19, 3)  # two samples longer than the windows, two shorter
WINDOW = 8
SHARPEN = 4.0  # queries and keys scaled by this: peaked attention, logits past the caps below
FAR = 10**6  # a window no sample reaches: the feature off, nothing else changed
# case: (family, HF config fields that turn the feature on, the same with it off)
CASES = {
    "window": ("mistral", {"sliding_window": WINDOW}, {"sliding_window": FAR}),
    "per_layer_windows": ("gemma3_text", {"sliding_window": WINDOW, "query_pre_attn_scalar": 1},
                          {"sliding_window": FAR}),
    "qwen2_window_layers": ("qwen2", {"use_sliding_window": True, "max_window_layers": 1, "sliding_window": WINDOW},
                            {"sliding_window": FAR}),
    "softcap": ("gemma2", {"sliding_window": FAR, "attn_logit_softcapping": 1.0, "query_pre_attn_scalar": 1},
                {"attn_logit_softcapping": None}),
    "softcap_and_windows": ("gemma2", {"sliding_window": WINDOW, "attn_logit_softcapping": 1.0,
                                       "query_pre_attn_scalar": 1},
                            {"sliding_window": FAR, "attn_logit_softcapping": None}),
}


def sharpen(model, factor: float = SHARPEN) -> None:
    """Scale every layer's queries and keys by ``factor`` through their projections (Gemma 3 normalises them after
    the projection: its cases sharpen through query_pre_attn_scalar=1 instead, 4x the default's logits)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                param.mul_(factor)


# Issue 43, item 5: a GPT-NeoX config carrying a num_key_value_heads the family does not read (its layers have 4 kv
# heads, the field says 2): under SP=2 DeepSpeed's all-to-all must be sized by the layers' heads.
STRAY_KV_HEADS = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=512)


def case_model(case: str, feature: bool = True):
    """The tiny model of ``case`` (seeded, sharpened), with its feature on or off (same weights)."""
    if case == "stray_kv_heads":
        model = build_model(ModelConfig(config=STRAY_KV_HEADS, architecture="gpt_neox", seed=3), vocab_size=VOCAB)
        sharpen(model)
        return model
    family, on, off = CASES[case]
    fields = {**on, **(off if not feature else {})}
    model = build_model(ModelConfig(config=tiny_config(family, **fields), architecture=family, seed=3),
                        vocab_size=VOCAB)
    sharpen(model)
    return model


def assert_grad_close(ours, ref, what: str) -> None:
    """Equal within fp32 rounding at the tensor's own scale: HF's eager attention takes its softmax in fp32 and ours
    SDPA's, and peaked attention magnifies the difference (Gemma's tied, scaled embeddings' gradients reach ~40)."""
    scale = float(ref.abs().max())
    error = float((ours - ref).abs().max())
    assert error <= 1e-6 + 1e-5 * scale, f"{what}: off by {error:.3g} at a scale of {scale:.3g}"


def assert_feature_moves_hf_loss(case: str, samples) -> torch.Tensor:
    """HF's own per-sample losses with the feature, after checking that they differ from those without it."""
    with torch.no_grad():
        on = torch.stack(hf_losses(hf_reference(case_model(case)), samples))
        off = torch.stack(hf_losses(hf_reference(case_model(case, feature=False)), samples))
    assert float((on - off).abs().max()) > 1e-3, f"{case}: the feature does not move HF's loss ({on} vs {off})"
    return on


@pytest.mark.parametrize("case", sorted(CASES))
def test_our_losses_and_gradients_are_the_models_own_with_the_feature(case):
    samples = make_samples(LENGTHS, seed=4)
    assert_feature_moves_hf_loss(case, samples)
    assert_own_loss(case_model(case), samples, case, grad_close=assert_grad_close)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_forward_applies_gemma2s_windows_and_softcap_on_cpu(monkeypatch):
    """The flex backend's mask and score_mod in a whole model: per-sample logits equal HF eager's (forward only:
    FlexAttention has no CPU backward, so its probe is stood in for)."""
    from hbp_train.model import attention, attention_setup

    monkeypatch.setattr(attention_setup, "available_backends", lambda device, dtype=None: ["flex", "sdpa_block"])
    monkeypatch.setattr(attention_setup, "probe_backend", lambda *args: None)
    try:
        model = case_model("softcap_and_windows").eval()
        assert attention.get_backend() == "flex"
        samples = make_samples(LENGTHS, seed=4)
        ids, positions, _, cu, max_len, _ = pack_of(samples)
        reference = hf_reference(model)
        with torch.no_grad():
            packed = model(input_ids=ids, position_ids=positions).logits[0]
            alone = torch.cat([reference(input_ids=s[0][None]).logits[0] for s in samples])
    finally:
        attention.set_backend("sdpa_block")
    torch.testing.assert_close(packed, alone, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------------------------- SP = 2
def _batch(samples) -> dict:
    ids, positions, labels, cu, max_len, sample_ids = pack_of(samples)
    return {"input_ids": ids, "position_ids": positions, "shift_labels": labels, "cu_seqlens": cu,
            "max_seqlen": max_len, "sample_ids": sample_ids}


def _sp_worker(rank, world_size, cases):
    """Every case at sp=2 then sp=1 on the same weights, as the trainer runs a pack: each rank's slice, the SP loss
    all-reduce, backward; returns the gathered token losses and the rank-averaged gradients."""
    import torch.distributed as dist

    from hbp_train.distributed.groups import build_parallel_state, init_distributed
    from hbp_train.model.ulysses import setup_sequence_parallel

    init_distributed()
    pstate = build_parallel_state([1, 2])
    batch = _batch(make_samples(LENGTHS, seed=4))
    out = {}
    for case in cases:
        model = case_model(case)
        sp = setup_sequence_parallel(model, pstate)
        wrapper = PackedCausalLM(model, chunk_size=16)
        for degree in (2, 1):
            sp.set_active(degree)
            model.zero_grad(set_to_none=True)
            local = sp.split(batch)
            whole = degree == 1
            loss_T = wrapper(local["input_ids"], local["position_ids"], local["shift_labels"],
                             local["cu_seqlens"] if whole else None, local["max_seqlen"] if whole else None)
            sp.reduce_loss(loss_T.sum()).backward()
            pieces = [torch.empty_like(loss_T) for _ in range(world_size)]
            dist.all_gather(pieces, loss_T.detach())
            losses = torch.cat(pieces)[: batch["input_ids"].shape[1]] if degree > 1 else loss_T.detach()
            grads = {}
            for name, param in model.named_parameters():
                grad = param.grad.clone() if param.grad is not None else torch.zeros_like(param)
                dist.all_reduce(grad)  # DeepSpeed's average over the ranks (the loss above is the group's)
                grads[name] = grad / world_size
            out[case, degree] = (losses, grads)
        sp.uninstall(model)
    return out if rank == 0 else None


# A window in every layer (Mistral: its 1 kv head replicated at sp=2), sliding and full layers, soft-cap with windows,
# and the stray kv-heads field (no feature: its losses are checked against HF's, not moved).
SP_CASES = ("window", "per_layer_windows", "softcap_and_windows", "stray_kv_heads")


@pytest.mark.slow
@pytest.mark.full  # ~20 s; the default tier's SP=2 matrix (tests/test_families.py) has Mistral's, Gemma 2's and
# Gemma 3's windows binding on its samples, and Gemma 2's soft-cap
def test_sp2_gives_the_models_own_losses_and_the_sp1_gradients_with_the_feature():
    """2 gloo processes, every SP case in one spawn: at sp=2 then sp=1, each sample's loss is HF's own and the
    token losses and gradients are the single process's."""
    from tests.distributed import run_distributed

    result = run_distributed(_sp_worker, 2, SP_CASES, timeout=900)[0]
    samples = make_samples(LENGTHS, seed=4)
    batch = _batch(samples)
    differ = []
    for case in SP_CASES:
        model = case_model(case)
        if case in CASES:
            theirs = assert_feature_moves_hf_loss(case, samples)
        else:
            with torch.no_grad():
                theirs = torch.stack(hf_losses(hf_reference(model), samples))
        wrapper = PackedCausalLM(model, chunk_size=16)
        model.zero_grad(set_to_none=True)
        ref_loss = wrapper(batch["input_ids"], batch["position_ids"], batch["shift_labels"], batch["cu_seqlens"],
                           batch["max_seqlen"])
        ref_loss.sum().backward()
        ref_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        for degree in (2, 1):
            losses, grads = result[case, degree]
            ours = per_sample_means(losses, samples)
            if not torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5):
                differ.append(f"{case} sp={degree}: ours {ours.tolist()} vs HF {theirs.tolist()}")
            torch.testing.assert_close(losses, ref_loss.detach(), rtol=1e-5, atol=1e-5, msg=f"{case} sp={degree}")
            for name, ref in ref_grads.items():
                assert_grad_close(grads[name], ref, f"{case} sp={degree}: {name}")
    assert not differ, "\n".join(differ)
