"""Tests for hbp_train/perf/memory.py: the analytic per-rank memory model (ZeRO states, activations, recompute,
loss chunk) and the trainer's preflight warnings."""

from __future__ import annotations

import pytest

from hbp_train.perf.memory import (JobSettings, analytic_memory_bytes, memory_preflight,
                                   model_state_bytes)
from hbp_train.perf.shape import MODEL_SHAPES, parse_model_shape


def test_analytic_memory_model_orders():
    shape = parse_model_shape("llama3-8b")
    job = JobSettings(zero_stage=2)
    mem = [analytic_memory_bytes(shape, 32768, 1, c, 8, job) for c in range(0, 33, 8)]
    assert all(a > b for a, b in zip(mem, mem[1:])), "more checkpointing must need less memory"
    # Per rank, an SP degree of 4 on 128K holds the activations of a 32K pack.
    assert analytic_memory_bytes(shape, 131072, 4, 8, 8, job) == pytest.approx(mem[1], rel=1e-3)
    z3 = analytic_memory_bytes(shape, 32768, 1, 8, 8, JobSettings(zero_stage=3))
    off = analytic_memory_bytes(shape, 32768, 1, 8, 8, JobSettings(zero_stage=2, offload_optimizer=True))
    assert z3 < mem[1] and off < mem[1]


@pytest.mark.parametrize("stage,offload", [(0, False), (1, False), (2, False), (3, False), (2, True), (3, True)])
def test_model_state_bytes_follow_the_zero_papers_accounting(stage, offload):
    """Per GPU, bf16 mixed precision (ZeRO paper Fig. 1, plus DeepSpeed's fp32 gradient partition): params 2 B
    (sharded from stage 3), grads 2 B (from stage 2), fp32 master + Adam m, v + fp32 grads 16 B (from stage 1;
    none on the GPU with optimizer offload)."""
    params, world = 1_000_000, 8
    shard = {k: (world if stage >= k else 1) for k in (1, 2, 3)}
    want = 2 * params / shard[3] + 2 * params / shard[2] + (0 if offload else 4 * 4 * params / shard[1])
    got = model_state_bytes(params, world, JobSettings(zero_stage=stage, offload_optimizer=offload))
    assert got == int(want)


def test_analytic_memory_counts_one_recomputed_layer_only_with_checkpointing():
    """Checkpointing the first layer swaps its full activations for its input (2h B/token) but adds the one layer
    rebuilt in backward (full activations); each further checkpointed layer only saves full - 2h."""
    shape = parse_model_shape("llama3-8b")
    job, tokens = JobSettings(zero_stage=2), 8192
    kv = shape.num_kv_heads * shape.head_dim
    full = (2 * (4 * shape.hidden + 3 * shape.num_heads * shape.head_dim + 2 * kv + 4 * shape.ffn)  # the docstring's
            + 8 * shape.hidden + 4 * shape.num_heads + 8)                                           # list
    kept = 2 * shape.hidden
    mem = [analytic_memory_bytes(shape, tokens, 1, c, 8, job) for c in range(4)]
    assert mem[1] - mem[0] == tokens * kept
    assert mem[2] - mem[1] == mem[3] - mem[2] == tokens * (kept - full)


def test_memory_preflight_names_the_groups_that_will_not_fit():
    shape, job, gpu = MODEL_SHAPES["llama3-8b"], JobSettings(zero_stage=2), 80 * 2**30
    groups = [{"pack_len": 16384, "sp": 1, "ckpt_layers": 32}, {"pack_len": 131072, "sp": 8, "ckpt_layers": None},
              {"pack_len": 131072, "sp": 8, "ckpt_layers": 32}]
    warnings = memory_preflight(groups, shape, 32, job, gpu)
    need = [analytic_memory_bytes(shape, g["pack_len"], g["sp"], g["ckpt_layers"] or 0, 32, job) for g in groups]
    assert [need_g > 0.95 * gpu for need_g in need] == [False, True, False]  # the model's own verdict
    assert len(warnings) == 1 and warnings[0].startswith("group 1 (131072 tokens, sp=8, 0 checkpointed layers)")
    assert "raise its ckpt_layers" in warnings[0]
    assert memory_preflight(groups[:1], shape, 32, job, 2**30)[0].startswith("group 0")  # a 1 GiB GPU fits nothing


# Shapes whose saved activations are counted with autograd's hooks; MoE and MLA shapes slot in here once
# perf/shape.py reads them (each entry: HF config fields of a Llama-style model).
SAVED_TENSOR_SHAPES = {
    "dense": {"hidden_size": 256, "intermediate_size": 704, "num_attention_heads": 4, "num_key_value_heads": 4},
    "gqa": {"hidden_size": 256, "intermediate_size": 704, "num_attention_heads": 8, "num_key_value_heads": 2},
}


def _saved_bytes(fn, exclude) -> int:
    """Bytes of the distinct storages autograd saves for backward while fn() runs (parameters excluded)."""
    import torch

    seen = {}

    def pack(t):
        ptr = t.untyped_storage().data_ptr()
        if ptr not in exclude:
            seen[ptr] = max(seen.get(ptr, 0), t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("name", sorted(SAVED_TENSOR_SHAPES))
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("ckpt_layers", [0, 1, 2])
def test_activation_bytes_match_what_autograd_saves(name, dtype, ckpt_layers):
    """The memory model's kept activations against the bytes autograd saves (saved-tensor hooks, CPU, sdpa_block
    backend), whole decoder, two packed documents: within 5%. A checkpointed layer keeps only its input."""
    import torch

    from hbp_train.model import ModelConfig, build_model, forward_hidden, set_checkpointed_layers
    from hbp_train.perf.memory import activation_bytes_per_token_layer

    cfg = dict(SAVED_TENSOR_SHAPES[name], num_hidden_layers=2, vocab_size=512, max_position_embeddings=2048)
    model = build_model(ModelConfig(config=cfg, dtype=dtype, attention_backend="sdpa_block"), vocab_size=512)
    set_checkpointed_layers(model, ckpt_layers)
    model.train()
    shape, b, tokens = parse_model_shape(model.config), (4 if dtype == "fp32" else 2), 512
    ids = torch.randint(0, 512, (1, tokens))
    pos = torch.cat([torch.arange(320), torch.arange(192)])[None]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    layers = model.model.layers

    def decoder():  # the layers only: the embedding output is the first layer's input, counted there
        hidden = model.model.embed_tokens(ids)
        emb = model.model.rotary_emb(hidden, pos)
        for layer in layers:
            out = layer(hidden, position_ids=pos, position_embeddings=emb)
            hidden = out[0] if isinstance(out, tuple) else out

    measured = _saved_bytes(decoder, params)
    kept = b * shape.hidden  # a checkpointed layer's input
    full = activation_bytes_per_token_layer(shape, b)
    predicted = tokens * ((shape.num_layers - ckpt_layers) * full + ckpt_layers * kept)
    assert predicted == pytest.approx(measured, rel=0.05), (measured / tokens, predicted / tokens)
