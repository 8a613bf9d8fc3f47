"""hbp_train/model/rope.py: every sample of a pack gets the RoPE its model gives it alone.

(a) the rotary embedding's cos/sin, for every RoPE type transformers ships (ROPE_INIT_FUNCTIONS and the default), on
a single module and per layer type (Gemma 3), at SP 1, 2 and 3 (the slices ulysses.split_for_sp cuts, padding
included), equal HF's own module run on each sample alone (a fresh one: dynamic keeps state); for the types that
read the length (longrope, dynamic) HF's call on the pack or the slice gives other values (the test could fail);
(b) through the model, Phi-3 longrope and Llama dynamic with sharpened q/k (so that RoPE moves the loss): our
per-sample losses, chunked and fused, and their gradients equal each sample's loss from the model's own HF
``forward(labels=...)`` alone, where the pack-level RoPE of transformers gives other losses; (c) the same at SP=2 on
2 gloo processes (slow); (d) with Liger's RoPE function in place of HF's (a stand-in: Liger's kernel needs CUDA),
the per-sample cos/sin reach it.
"""

from __future__ import annotations

import types

import pytest
import torch

from hbp_train.model.packed_lm import PackedCausalLM
from hbp_train.common.labels import IGNORE_INDEX
from hbp_train.model import kernels
from hbp_train.model.families import tiny_config
from hbp_train.model.hf_model import ModelConfig, build_model, forward_hidden
from hbp_train.model.loss import chunked_token_losses, token_loss_weights
from hbp_train.model.rope import PackSlice, install_per_sample_rope, per_sample
from hbp_train.model.ulysses import split_for_sp
from tests.test_families import VOCAB, hf_reference, hf_losses, make_samples, pack_of, per_sample_means

# the positions each RoPE was made for (original_max_position_embeddings; dynamic: max_position_embeddings)
ORIGINAL = 64
# Short and long samples (long: beyond ORIGINAL, of distinct lengths, so dynamic's base differs between them);
# ORIGINAL and ORIGINAL + 1 sit on longrope's threshold.
UNIT_LENGTHS = (20, 150, 9, 100, ORIGINAL, ORIGINAL + 1, 33)
# Through the model: short samples beside long ones of distinct lengths. At SP=2 (311 tokens + 1 padding, 156 per
# rank) rank 0 holds the three short samples and the first 36 positions of the 100-token one, so that its slice
# alone would choose the short factors (dynamic: the original base) for them; rank 1 the rest of it and the
# 91-token sample, which its slice would give the 100-token sample's base.
MODEL_LENGTHS = (40, 30, 50, 100, 91)
HEAD_DIM = 16

# Every RoPE type's parameters for a head of HEAD_DIM (ROPE_INIT_FUNCTIONS' keys and the default).
ROPE_PARAMS = {
    "default": {},
    "linear": {"factor": 4.0},
    "dynamic": {"factor": 4.0},
    "yarn": {"factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "longrope": {"short_factor": [1.0] * (HEAD_DIM // 2), "long_factor": [1.0 + 2 * i for i in range(HEAD_DIM // 2)],
                 "original_max_position_embeddings": ORIGINAL, "factor": 4.0},
    "llama3": {"factor": 4.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": ORIGINAL},
    "proportional": {"partial_rotary_factor": 0.5},
}
LENGTH_DEPENDENT = ("dynamic", "longrope")  # the types transformers' dynamic_rope_update changes with the length


def test_every_rope_type_transformers_ships_is_covered():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    assert set(ROPE_PARAMS) == {"default", *ROPE_INIT_FUNCTIONS}


def rotary_module(rope_type: str, per_layer_type: bool):
    """A fresh HF rotary embedding of ``rope_type``: Llama's, or Gemma 3's with the type on its full-attention
    layers and the default on its sliding ones."""
    from transformers import Gemma3TextConfig, LlamaConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    positions = ORIGINAL if rope_type == "dynamic" else 4 * ORIGINAL  # dynamic grows from max_position_embeddings
    params = {"rope_type": rope_type, "rope_theta": 10000.0, **ROPE_PARAMS[rope_type]}
    shape = dict(hidden_size=4 * HEAD_DIM, num_attention_heads=4, head_dim=HEAD_DIM, max_position_embeddings=positions)
    if not per_layer_type:
        return LlamaRotaryEmbedding(LlamaConfig(**shape, rope_parameters=params))
    config = Gemma3TextConfig(**shape, num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                              rope_parameters={"full_attention": params,
                                               "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}})
    return Gemma3RotaryEmbedding(config)


def _call(module, positions, layer_type):
    x = torch.zeros(1, positions.shape[-1], 4 * HEAD_DIM)
    return module(x, positions) if layer_type is None else module(x, positions, layer_type)


def _pack(lengths) -> dict:
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()], dtype=torch.int32)
    return {"input_ids": torch.zeros_like(positions), "position_ids": positions, "cu_seqlens": cu,
            "shift_labels": torch.full_like(positions, IGNORE_INDEX)}


@pytest.mark.parametrize("per_layer_type", [False, True], ids=["module", "per_layer_type"])
@pytest.mark.parametrize("rope_type", sorted(ROPE_PARAMS))
def test_cos_sin_are_hfs_on_each_sample_alone_at_every_sp_slice(rope_type, per_layer_type):
    layer_types = ["full_attention", "sliding_attention"] if per_layer_type else [None]
    module = rotary_module(rope_type, per_layer_type)
    assert install_per_sample_rope(module) == (rope_type in LENGTH_DEPENDENT)  # length-free types stay HF's as is
    pack = _pack(UNIT_LENGTHS)
    moved = False
    for sp in (1, 2, 3):  # one module through all of them: dynamic's state carried between calls must not leak
        num_pad = -pack["input_ids"].shape[1] % sp
        for layer_type in layer_types:
            # each sample (and the padding's dummy sample) alone, on a fresh module: the reference
            alone = [_call(rotary_module(rope_type, per_layer_type), torch.arange(n)[None], layer_type)
                     for n in (*UNIT_LENGTHS, *([num_pad] if num_pad else []))]
            expected = [torch.cat([a[i] for a in alone], dim=1) for i in (0, 1)]
            for rank in range(sp):
                local = split_for_sp(pack, sp, rank)
                piece = local["pack_slice"]
                with per_sample(piece):
                    ours = _call(module, local["position_ids"], layer_type)
                for got, want in zip(ours, expected):
                    torch.testing.assert_close(got, want[:, piece.start:piece.end], rtol=0, atol=1e-6,
                                               msg=f"{rope_type} {layer_type} sp={sp} rank={rank}")
                hf_slice = _call(rotary_module(rope_type, per_layer_type), local["position_ids"], layer_type)
                moved |= not torch.allclose(hf_slice[0], expected[0][:, piece.start:piece.end], atol=1e-3)
    # HF's own call on a pack (or a rank's slice) differs from its per-sample values exactly for these types
    assert moved == (rope_type in LENGTH_DEPENDENT), rope_type


def test_pack_slice_spans_cover_the_slice_with_each_samples_full_length():
    pack = _pack((5, 3, 4))  # 12 tokens; at sp=5: 3 padding tokens, 3 per rank
    spans = [tuple(map(list, split_for_sp(pack, 5, r)["pack_slice"].spans())) for r in range(5)]
    # (first token, end token, sample length) per rank; the padding is a sample of 3
    assert spans == [([0], [3], [5]), ([0, 2], [2, 3], [5, 3]), ([0, 2], [2, 3], [3, 4]), ([0], [3], [4]),
                     ([0], [3], [3])]
    assert tuple(map(list, PackSlice.from_position_ids(pack["position_ids"]).spans())) == ([0, 5, 8], [5, 8, 12],
                                                                                           [5, 3, 4])


# ---------------------------------------------------------------------------------------- (b) the model
def rope_model(case: str):
    """The tiny model of ``case`` (Phi-3 longrope, Llama dynamic) with q and k sharpened: at initialisation the
    attention is nearly uniform and RoPE barely moves the loss; scaled q/k weights make it matter."""
    if case == "phi3_longrope":
        config = tiny_config("phi3", max_position_embeddings=16 * ORIGINAL, original_max_position_embeddings=ORIGINAL,
                             rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                              **{k: ROPE_PARAMS["longrope"][k] for k in ("short_factor",
                                                                                           "long_factor")}})
    else:
        config = tiny_config("llama", max_position_embeddings=ORIGINAL,
                             rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0})
    model = build_model(ModelConfig(config=config, architecture=case.partition("_")[0], seed=3), vocab_size=VOCAB)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if hasattr(attn, "qkv_proj"):  # Phi-3: q and k are the first rows of the fused projection
                attn.qkv_proj.weight[: (4 + 2) * HEAD_DIM] *= 8.0
            else:
                attn.q_proj.weight *= 8.0
                attn.k_proj.weight *= 8.0
    return model


ROPE_CASES = ("phi3_longrope", "llama_dynamic")


def hf_per_sample(model, samples):
    """Each sample's loss from the model's own HF forward(labels=...) on the sample alone, each on a fresh model
    (dynamic RoPE keeps state between calls), and the gradient of their sum (summed over the fresh models)."""
    losses, grads = [], {}
    for sample in samples:
        reference = hf_reference(model)
        (loss,) = hf_losses(reference, [sample])
        loss.backward()
        losses.append(loss.detach())
        for name, param in reference.named_parameters():
            if param.grad is not None:
                grads[name] = grads.get(name, 0) + param.grad
    return torch.stack(losses), grads


@pytest.fixture(scope="module")
def references():
    """{case: (HF per-sample losses, their gradients)} on MODEL_LENGTHS' samples."""
    samples = make_samples(MODEL_LENGTHS, seed=2)
    return {case: hf_per_sample(rope_model(case), samples) for case in ROPE_CASES}


@pytest.mark.parametrize("case", ROPE_CASES)
def test_per_sample_losses_and_gradients_are_hfs_own_on_each_sample_alone(case, references):
    model = rope_model(case)
    samples = make_samples(MODEL_LENGTHS, seed=2)
    ids, positions, labels, cu, max_len, sample_ids = pack_of(samples)
    theirs, ref_grads = references[case]
    # transformers' RoPE of the whole pack (what a packed forward without per-sample RoPE computes): other losses
    with torch.no_grad():
        hidden = forward_hidden(model, ids, positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max_len,
                                max_length_k=max_len)
        pack_level = per_sample_means(chunked_token_losses(hidden, model.lm_head.weight, labels, 64), samples)
    assert (pack_level - theirs).abs().max() > 1e-3, f"{case}: RoPE scaling does not move the loss here"
    weights = token_loss_weights(labels, sample_ids, "sample_mean", global_num_samples=1)
    for fused in (False, True):
        wrapper = PackedCausalLM(model, chunk_size=64, fused_loss=fused)
        for pack_slice in (PackSlice.whole(cu), None):  # given by the SP split, or found in position_ids
            model.zero_grad(set_to_none=True)
            total, loss_T = wrapper(ids, positions, labels, cu, max_len, loss_weights=weights, pack_slice=pack_slice)
            total.backward()
            ours = per_sample_means(loss_T.detach(), samples)
            how = f"{case} {'fused' if fused else 'chunked'} pack_slice={'given' if pack_slice else 'found'}"
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5,
                                       msg=f"{how}: ours {ours.tolist()} vs HF {theirs.tolist()}")
            grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
            assert grads.keys() == ref_grads.keys()
            for name, ref in ref_grads.items():
                torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-6, msg=f"{how}: {name}")


# ------------------------------------------------------------------------------------------- (c) SP=2
def _sp_worker(rank, world_size):
    """Each case at sp=2, chunked and fused: each rank's slice forward with its pack slice, the SP loss all-reduce
    and backward as the trainer does; returns the gathered token losses and the rank-summed gradients."""
    import torch.distributed as dist

    from hbp_train.distributed.groups import build_parallel_state, init_distributed
    from hbp_train.model.ulysses import setup_sequence_parallel

    init_distributed()
    pstate = build_parallel_state([1, 2])
    ids, positions, labels, cu, max_len, sample_ids = pack_of(make_samples(MODEL_LENGTHS, seed=2))
    batch = {"input_ids": ids, "position_ids": positions, "shift_labels": labels, "cu_seqlens": cu,
             "max_seqlen": max_len,
             "loss_weights": token_loss_weights(labels, sample_ids, "sample_mean", global_num_samples=1)[None]}
    out = {}
    for case in ROPE_CASES:
        model = rope_model(case)
        sp = setup_sequence_parallel(model, pstate)
        sp.set_active(2)
        local = sp.split(batch)
        for fused in (False, True):
            wrapper = PackedCausalLM(model, chunk_size=64, fused_loss=fused)
            model.zero_grad(set_to_none=True)
            total, loss_T = wrapper(local["input_ids"], local["position_ids"], local["shift_labels"],
                                    loss_weights=local["loss_weights"], pack_slice=local["pack_slice"])
            sp.reduce_loss(total).backward()
            pieces = [torch.empty_like(loss_T) for _ in range(world_size)]
            dist.all_gather(pieces, loss_T.detach())
            grads = {}
            for name, param in model.named_parameters():
                grad = param.grad.clone() if param.grad is not None else torch.zeros_like(param)
                dist.all_reduce(grad)  # DeepSpeed's average over the W ranks (the loss above is the group's)
                grads[name] = grad / world_size
            out[case, fused] = (torch.cat(pieces)[: ids.shape[1]], grads)
        sp.uninstall(model)
    return out if rank == 0 else None


@pytest.mark.slow
def test_sp2_per_sample_losses_and_gradients_are_hfs_own(references):
    """2 gloo processes: each sample's full length picks its RoPE on both ranks (rank 0 holds short samples and only
    the start of the 100-token one, MODEL_LENGTHS), losses and gradients = HF's on each sample alone."""
    from tests.distributed import run_distributed

    result = run_distributed(_sp_worker, 2, timeout=600)[0]
    samples = make_samples(MODEL_LENGTHS, seed=2)
    for (case, fused), (loss_T, grads) in result.items():
        theirs, ref_grads = references[case]
        how = f"{case} {'fused' if fused else 'chunked'} sp=2"
        ours = per_sample_means(loss_T, samples)
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5,
                                   msg=f"{how}: ours {ours.tolist()} vs HF {theirs.tolist()}")
        for name, ref in ref_grads.items():
            torch.testing.assert_close(grads[name], ref, rtol=1e-4, atol=1e-6, msg=f"{how}: {name}")


# ----------------------------------------------------------------------------------------------- (d) Liger
def test_liger_rope_function_receives_the_per_sample_cos_sin(monkeypatch):
    """Liger replaces the family's apply_rotary_pos_emb, the function that consumes the rotary embedding's cos/sin.
    With a stand-in that does what Liger's apply function does to Phi-3 (swap that function; its kernel needs CUDA,
    so the stand-in applies the same rotation in torch, Liger's signature), the losses stay HF's per sample."""
    from transformers.models.phi3 import modeling_phi3

    hf_rope, seen = modeling_phi3.apply_rotary_pos_emb, []

    def liger_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
        seen.append(cos)
        return hf_rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)

    def apply_liger_kernel_to_phi3(model=None, rope=False, **kwargs):
        if rope:
            modeling_phi3.apply_rotary_pos_emb = liger_rotary_pos_emb

    fake = types.SimpleNamespace(apply_liger_kernel_to_phi3=apply_liger_kernel_to_phi3)
    monkeypatch.setattr(kernels, "liger_module", lambda: fake)
    monkeypatch.setattr(kernels, "_version", lambda dist: "0.8.5")
    model = rope_model("phi3_longrope")
    samples = make_samples(MODEL_LENGTHS[:4], seed=2)
    ids, positions, labels, cu, max_len, _ = pack_of(samples)
    try:
        assert "RoPE" in kernels.apply_kernels(model, "liger", model.model.layers)
        seen.clear()  # what Liger's probe (model/liger_probe.py) ran on its one-layer copy
        loss_T = PackedCausalLM(model, chunk_size=64)(ids, positions, labels, cu, max_len,
                                                      pack_slice=PackSlice.whole(cu))
    finally:
        kernels.restore_hf_modules()
    assert len(seen) == len(model.model.layers)  # Liger's function was what applied the rotation
    expected = torch.cat([_hf_cos(model, n) for n in MODEL_LENGTHS[:4]], dim=1)
    torch.testing.assert_close(seen[0], expected, rtol=0, atol=1e-6)
    with torch.no_grad():
        theirs = torch.stack(hf_losses(hf_reference(model), samples))
    torch.testing.assert_close(per_sample_means(loss_T.detach(), samples), theirs, rtol=1e-5, atol=1e-5)


def _hf_cos(model, length: int) -> torch.Tensor:
    """HF's cos of a sample of ``length`` alone, from a fresh copy of the model's rotary embedding."""
    fresh = type(model.model.rotary_emb)(model.config)
    return fresh(torch.zeros(1, length, model.config.hidden_size), torch.arange(length)[None])[0]
