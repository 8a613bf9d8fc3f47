"""Tests for hbp_train/perf/memory.py: the analytic per-rank memory model (ZeRO states, activations, recompute,
loss chunk) and the trainer's preflight warnings."""

from __future__ import annotations

import pytest

from hbp_train.perf.memory import (JobSettings, analytic_memory_bytes, memory_preflight,
                                   model_state_bytes)
from hbp_train.perf.shape import MODEL_SHAPES, parse_model_shape


def test_a_tied_lm_head_is_counted_once():
    """Llama-3.2-1B ties its LM head to the embedding: 1.236B parameters, not 1.498B; the untied 8B keeps both."""
    tied, untied = MODEL_SHAPES["llama3.2-1b"], MODEL_SHAPES["llama3-8b"]
    assert tied.tie_word_embeddings and tied.num_params == 1_235_814_400
    assert not untied.tie_word_embeddings and untied.num_params == 8_030_261_248
    assert parse_model_shape({**tied.__dict__, "name": "x", "tie_word_embeddings": False}).num_params == \
        tied.num_params + tied.vocab * tied.hidden


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


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("fp32_accum", [False, True])
@pytest.mark.parametrize("offload", [False, True])
def test_model_state_bytes_follow_deepspeeds_allocations(stage, fp32_accum, offload):
    """Per GPU, bf16 params: params 2 B (sharded from stage 3), gradients 2 B or 4 B with fp32 accumulation
    (sharded from stage 2), fp32 master + Adam m, v 12 B (from stage 1). With optimizer offload the optimizer state
    and the gradient partitions are on the CPU (DeepSpeed 0.19 copies each bucket's reduced gradients there): only
    the parameters stay. The fp32 gradient partition DeepSpeed builds inside step() counts only there (tests below
    measure all of it); the reduction buckets are counted when the job says how large they are."""
    params, world = 1_000_000, 8
    shard = {k: (world if stage >= k else 1) for k in (1, 2, 3)}
    job = JobSettings(zero_stage=stage, offload_optimizer=offload, grad_accum_fp32=fp32_accum)
    grads = (4 if fp32_accum else 2) * params / shard[2]
    want = 2 * params / shard[3] + (0 if offload else grads + 12 * params / shard[1])
    assert model_state_bytes(params, world, job) == int(want)
    in_step = model_state_bytes(params, world, job, in_step=True)
    if offload or (fp32_accum and stage < 3):  # nothing new in step(): the accumulated gradient is already fp32
        assert in_step == int(want)
    elif stage == 3:  # its gradient partition stays; step() copies it into a new fp32 one
        assert in_step == int(want + 4 * params / world)
    else:  # the bf16 gradients are replaced by this rank's partition in fp32
        assert in_step == int(2 * params + 16 * params / shard[1])
    bucket = JobSettings(zero_stage=stage, offload_optimizer=offload, grad_accum_fp32=fp32_accum,
                         grad_bucket_bytes=1000)
    assert model_state_bytes(params, world, bucket) == int(want) + 1000


def test_zero3_parameter_offload_and_gathered_parameters():
    """ZeRO-3 with parameter offload keeps no parameter partition on the GPU; it holds what it gathers for the module
    that runs (a decoder layer's widest matrix plus the prefetch bucket; the LM head and its gradient in the loss)."""
    from hbp_train.perf.memory import ZERO3_PREFETCH_ELEMENTS, zero3_working_bytes

    shape = MODEL_SHAPES["llama3-8b"]
    z3, off = JobSettings(zero_stage=3, grad_accum_fp32=False), JobSettings(zero_stage=3, grad_accum_fp32=False,
                                                                          offload_param=True)
    assert model_state_bytes(shape.num_params, 8, z3) - model_state_bytes(shape.num_params, 8, off) == \
        2 * shape.num_params // 8
    assert zero3_working_bytes(shape, z3) == 2 * (shape.hidden * shape.ffn + ZERO3_PREFETCH_ELEMENTS)
    assert zero3_working_bytes(shape, z3, loss=True) == 4 * shape.vocab * shape.hidden
    assert zero3_working_bytes(shape, JobSettings(zero_stage=2)) == 0


def test_the_step_peak_counts_only_when_it_exceeds_backward():
    """analytic_memory_bytes is the larger of backward (states + activations) and the optimizer step (states with
    the fp32 gradient partition, no activations): a long pack is backward's, a 1-token pack the step's when
    step() builds a new fp32 partition (bf16 accumulation) larger than the 1-token forward's LM-head gradient
    buffer (vocab x hidden); with fp32 accumulation the partition already exists."""
    shape = parse_model_shape("llama3-8b")
    job = JobSettings(zero_stage=2, grad_accum_fp32=False)
    step = model_state_bytes(shape.num_params, 8, job, in_step=True)
    assert step > model_state_bytes(shape.num_params, 8, job)
    assert analytic_memory_bytes(shape, 1, 1, 0, 8, job) == step
    assert analytic_memory_bytes(shape, 16384, 1, 0, 8, job) > step
    fp32 = JobSettings(zero_stage=2, grad_accum_fp32=True)
    assert model_state_bytes(shape.num_params, 8, fp32, in_step=True) == model_state_bytes(shape.num_params, 8, fp32)


def test_checkpointing_moves_each_moment_by_what_a_layer_keeps():
    """Each checkpointed layer swaps its full activations for its input (2h B/token) at the end of the forward and at
    the first plain layer's backward; the first checkpointed layer's backward holds every checkpointed input plus
    one layer rebuilt in full, so it grows by 2h per checkpointed layer (and exists only with checkpointing)."""
    from hbp_train.perf.memory import activation_bytes_per_token_layer, memory_breakdown

    shape = parse_model_shape("llama3-8b")
    job, tokens = JobSettings(zero_stage=2), 8192
    kv = shape.num_kv_heads * shape.head_dim
    full = (2 * (4 * shape.hidden + 2 * shape.num_heads * shape.head_dim + 2 * kv + 4 * shape.ffn)  # the docstring's
            + 8 * shape.hidden + 4 * shape.num_heads + 8)                                           # list (varlen)
    assert full == activation_bytes_per_token_layer(shape)
    kept = 2 * shape.hidden
    m = [memory_breakdown(shape, tokens, 1, c, 8, job) for c in range(4)]
    assert m[0].backward_ckpt == 0 and m[1].backward_ckpt > 0
    for a, b in zip(m, m[1:]):
        assert a.loss - b.loss == a.backward_plain - b.backward_plain == tokens * (full - kept)
    assert m[3].backward_ckpt - m[2].backward_ckpt == m[2].backward_ckpt - m[1].backward_ckpt == tokens * kept
    every = memory_breakdown(shape, tokens, 1, shape.num_layers, 8, job)
    assert every.backward_plain == 0 and every.moment in ("loss", "backward_ckpt")


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


# Shapes whose saved activations are counted with autograd's hooks (HF config fields of a Llama-style model): MHA,
# GQA, and the Llama-3.2-1B ratios (ffn = 4h, 4 query heads per kv head, head_dim h/8). MoE and MLA shapes slot in
# here once perf/shape.py reads them.
SAVED_TENSOR_SHAPES = {
    "dense": {"hidden_size": 256, "intermediate_size": 704, "num_attention_heads": 4, "num_key_value_heads": 4},
    "gqa": {"hidden_size": 256, "intermediate_size": 704, "num_attention_heads": 8, "num_key_value_heads": 2},
    "llama3.2-1b-ratios": {"hidden_size": 256, "intermediate_size": 1024, "num_attention_heads": 8,
                           "num_key_value_heads": 2},
}


@pytest.fixture(scope="module")
def cpu_varlen():
    """torch's varlen_attn (the GPU kernel behind model.attention_backend=torch_varlen) made to run on the CPU: a
    CPU kernel for its op, computed per document in float; torch's own autograd glue around it decides what is
    saved (q, k, v, the output, the log-sum-exp, the RNG state), so the count is the GPU path's."""
    import torch

    lib = torch.library.Library("torch_attn", "FRAGMENT")

    def varlen_on_cpu(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, scale=None,
                      window_size=None, enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        num_tokens, heads, head_dim = query.shape
        out = torch.empty_like(query)
        lse = torch.empty(heads, num_tokens, dtype=torch.float32)
        bounds = cu_seq_q.tolist()
        for a, b in zip(bounds[:-1], bounds[1:]):
            q, k, v = (x[a:b].transpose(0, 1).float().repeat_interleave(heads // x.shape[1], 0)
                       for x in (query, key, value))
            scores = (q @ k.transpose(1, 2)) * (scale or head_dim ** -0.5)
            scores = scores.masked_fill(torch.ones(b - a, b - a, dtype=torch.bool).triu(1), float("-inf"))
            lse[:, a:b] = torch.logsumexp(scores, -1)
            out[a:b] = (scores.softmax(-1) @ v).transpose(0, 1).to(query.dtype)
        return out, lse, torch.zeros(2, dtype=torch.uint64)

    torch.library.register_kernel("torch_attn::_varlen_attn", "cpu", varlen_on_cpu, lib=lib)
    yield
    lib._destroy()


def _liger_stand_ins(model) -> None:
    """Liger's RMSNorm and SwiGLU on a CPU model, as far as memory goes: each norm (the decoder's and the final one)
    and each gated MLP gets a forward bound on the instance, as liger_kernel's apply functions bind theirs, through an
    autograd function that saves what Liger's does (liger-kernel 0.8's source: LigerRMSNormFunction saves the input X,
    the weight and RSTD, one fp32 value per row, in casting mode llama; LigerSiLUMulFunction saves a and b, and the
    MLP's down_proj keeps its input). The values are the eager modules' (the backward recomputes them)."""
    import types

    import torch

    class RMSNorm(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, weight, eps):
            x32 = x.float()
            rstd = torch.rsqrt(x32.pow(2).mean(-1) + eps)
            ctx.save_for_backward(x, weight, rstd)
            ctx.eps = eps
            return weight * (x32 * rstd[..., None]).to(x.dtype)

        @staticmethod
        def backward(ctx, grad):
            x, weight, _ = ctx.saved_tensors
            with torch.enable_grad():
                x_, w_ = x.detach().requires_grad_(), weight.detach().requires_grad_()
                x32 = x_.float()
                y = w_ * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + ctx.eps)).to(x.dtype)
                return (*torch.autograd.grad(y, (x_, w_), grad), None)

    class SiLUMul(torch.autograd.Function):
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return torch.nn.functional.silu(a) * b

        @staticmethod
        def backward(ctx, grad):
            a, b = ctx.saved_tensors
            with torch.enable_grad():
                a_, b_ = a.detach().requires_grad_(), b.detach().requires_grad_()
                return torch.autograd.grad(torch.nn.functional.silu(a_) * b_, (a_, b_), grad)

    def norm_forward(self, x):
        return RMSNorm.apply(x, self.weight, self.variance_epsilon)

    def mlp_forward(self, x):
        return self.down_proj(SiLUMul.apply(self.gate_proj(x), self.up_proj(x)))

    base = model.model
    for norm in [base.norm] + [m for layer in base.layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]:
        norm.forward = types.MethodType(norm_forward, norm)
    for layer in base.layers:
        layer.mlp.forward = types.MethodType(mlp_forward, layer.mlp)


def _held_bytes(name, dtype, backend, num_tokens, num_layers, ckpt_layers=0, liger=False,
                mlp_tiles=1) -> tuple[int, int]:
    """(bytes the forward of our engine module keeps for backward, the pack's trained tokens): PackedCausalLM with
    the fused LM-head loss on a pack of two documents. Kept = the distinct storages autograd saves (saved-tensor
    hooks, parameters excluded) plus the gradient of the hidden rows the fused loss made in forward. ``liger``: with
    Liger's RMSNorm and SwiGLU (their CPU stand-ins); ``mlp_tiles``: the tiled MLP as training installs it
    (model/levers.py)."""
    import torch

    from hbp_train.model import attention_backends as attention
    from hbp_train.model.packed_lm import PackedCausalLM
    from hbp_train.model.loss import token_loss_weights
    from hbp_train.model.hf_model import ModelConfig, build_model, set_checkpointed_layers

    cfg = dict(SAVED_TENSOR_SHAPES[name], num_hidden_layers=num_layers, vocab_size=512, max_position_embeddings=2048)
    model = build_model(ModelConfig(config=cfg, dtype=dtype, attention_backend="sdpa_block"), vocab_size=512)
    if liger:
        _liger_stand_ins(model)
    set_checkpointed_layers(model, ckpt_layers)
    if mlp_tiles > 1:
        from hbp_train.model.levers import Levers, install_levers

        install_levers(model).set(Levers(mlp_tiles=mlp_tiles))
    model.train()
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (1, num_tokens), generator=gen)
    cut = num_tokens * 5 // 8
    pos = torch.cat([torch.arange(cut), torch.arange(num_tokens - cut)])[None]
    labels = torch.randint(0, 512, (1, num_tokens), generator=gen)
    labels[0, [cut - 1, num_tokens - 1]] = -100  # a document's last token predicts nothing
    trained = num_tokens - 2
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    module = PackedCausalLM(model, chunk_size=64, fused_loss=True)
    plain = attention._BACKEND_FNS["sdpa_block"]
    if backend == "torch_varlen":  # the varlen glue of attention_backends.py, on the CPU kernel of the cpu_varlen fixture
        attention._BACKEND_FNS["sdpa_block"] = attention._torch_varlen
    try:
        objective = None

        def forward():
            nonlocal objective
            objective, _ = module(ids, pos, labels, torch.tensor([0, cut, num_tokens], dtype=torch.int32), cut,
                                  loss_weights=token_loss_weights(labels, None, "sum"), num_loss_tokens=trained)

        saved = _saved_bytes(forward, params)
    finally:
        attention._BACKEND_FNS["sdpa_block"] = plain
    grad_hidden = objective.grad_fn.grads[0]  # the fused loss's ctx: the gradients it made in forward
    return saved + grad_hidden.untyped_storage().nbytes(), trained


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


# What a forward keeps whatever its length: varlen's RNG state per layer (16 B), the pack's boundaries.
CONSTANT_BYTES = 64


@pytest.mark.parametrize("name, backend", [(name, "torch_varlen") for name in sorted(SAVED_TENSOR_SHAPES)]
                         + [("gqa", "sdpa_block")])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_activation_bytes_equal_what_autograd_saves(name, dtype, backend, cpu_varlen):
    """The memory model's per-token bytes against what our engine module's forward keeps for backward, counted
    (saved-tensor hooks; CPU; the GPU's varlen kernel through torch's own autograd glue, and sdpa_block), exactly:
    one decoder layer (2 layers less 1), everything outside the layers with the fused LM-head loss (1 layer less
    one layer's bytes; the model takes every token as trained, this pack has 2 untrained), and a checkpointed layer
    (only its input), at two pack lengths, up to bytes that do not grow with the pack."""
    from hbp_train.perf.memory import activation_bytes_per_token_layer, outside_layers_bytes_per_token
    from hbp_train.model.hf_model import ModelConfig, hf_config

    shape = parse_model_shape(hf_config(ModelConfig(config=dict(SAVED_TENSOR_SHAPES[name]), dtype=dtype)))
    b = 4 if dtype == "fp32" else 2
    full = activation_bytes_per_token_layer(shape, b, attention_out_shared=backend == "torch_varlen")
    for tokens in (128, 256):
        (one, trained), (two, _) = (_held_bytes(name, dtype, backend, tokens, n) for n in (1, 2))
        layer = two - one
        assert 0 <= layer - tokens * full <= CONSTANT_BYTES, (tokens, layer / tokens, full)
        outside = tokens * outside_layers_bytes_per_token(shape, b) - (tokens - trained) * (b * shape.hidden + 8)
        assert 0 <= (one - layer) - outside <= CONSTANT_BYTES, (tokens, (one - layer) / tokens, outside / tokens)
        checkpointed, _ = _held_bytes(name, dtype, backend, tokens, 2, ckpt_layers=1)
        assert abs(checkpointed - (two - layer + tokens * b * shape.hidden)) <= CONSTANT_BYTES, tokens


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_liger_kernels_keep_what_their_autograd_functions_save(dtype, cpu_varlen):
    """With Liger's RMSNorm and SwiGLU (model.kernels=auto on a GPU) a layer keeps each norm's input in its dtype and
    one fp32 value per token instead of HF's fp32 copy of the input and normalised output, and the gated MLP's gate
    and up outputs without HF's act(gate): counted exactly as above, with Liger's saves (CPU stand-ins)."""
    from hbp_train.perf.memory import activation_bytes_per_token_layer, outside_layers_bytes_per_token
    from hbp_train.model.hf_model import ModelConfig, hf_config

    name = "llama3.2-1b-ratios"
    shape = parse_model_shape(hf_config(ModelConfig(config=dict(SAVED_TENSOR_SHAPES[name]), dtype=dtype)))
    b = 4 if dtype == "fp32" else 2
    fused = dict(fused_rms_norm=True, fused_swiglu=True)
    full = activation_bytes_per_token_layer(shape, b, attention_out_shared=True, **fused)
    assert full < activation_bytes_per_token_layer(shape, b, attention_out_shared=True)
    tokens = 128
    (one, trained), (two, _) = (_held_bytes(name, dtype, "torch_varlen", tokens, n, liger=True) for n in (1, 2))
    layer = two - one
    assert 0 <= layer - tokens * full <= CONSTANT_BYTES, (layer / tokens, full)
    outside = (tokens * outside_layers_bytes_per_token(shape, b, fused_rms_norm=True)
               - (tokens - trained) * (b * shape.hidden + 8))
    assert 0 <= (one - layer) - outside <= CONSTANT_BYTES, ((one - layer) / tokens, outside / tokens)


def test_a_tiled_mlp_layer_keeps_what_the_model_says(cpu_varlen, dtype="bf16"):
    """The tiled MLP as training runs it (model/levers.py: each tile a checkpoint of the MLP): a layer keeps its
    activations less the MLP's gate, up, act and product (the tiles keep only their input, the norm's output the
    layer already keeps), counted exactly as above."""
    from hbp_train.perf.memory import activation_bytes_per_token_layer, mlp_bytes_per_token
    from hbp_train.model.hf_model import ModelConfig, hf_config

    name = "gqa"
    shape = parse_model_shape(hf_config(ModelConfig(config=dict(SAVED_TENSOR_SHAPES[name]), dtype=dtype)))
    b = 4 if dtype == "fp32" else 2
    tiled = activation_bytes_per_token_layer(shape, b, attention_out_shared=True) - mlp_bytes_per_token(shape, b)
    tokens = 256
    (one, _), (two, _) = (_held_bytes(name, dtype, "torch_varlen", tokens, n, mlp_tiles=4) for n in (1, 2))
    layer = two - one
    # the untiled layer keeps tokens * mlp_bytes_per_token more (test above): the lever moves the count
    assert 0 <= layer - tokens * tiled <= CONSTANT_BYTES, (layer / tokens, tiled)


def test_the_memory_model_counts_the_decoder_kernels_the_run_uses():
    """Llama-3.2-1B in bf16 with a varlen kernel: Liger's RMSNorm and SwiGLU keep 32 KiB of the 106 KiB a layer keeps
    per token less (8h for the two norms' fp32 inputs, 2·ffn for act(gate)); the job's settings say which kernels
    run, from the kernels the built model names (kernels.py sets _hbp_fused_kernels)."""
    from types import SimpleNamespace

    from hbp_train.perf.memory import activation_bytes_per_token_layer

    shape = parse_model_shape("llama3.2-1b")
    eager = activation_bytes_per_token_layer(shape)
    liger = activation_bytes_per_token_layer(shape, fused_rms_norm=True, fused_swiglu=True)
    assert (eager, eager - liger) == (108_680, 8 * 2048 + 2 * 8192)
    job = JobSettings(zero_stage=2, grad_accum_fp32=False)
    fused = JobSettings(zero_stage=2, grad_accum_fp32=False, fused_rms_norm=True, fused_swiglu=True)
    saved = analytic_memory_bytes(shape, 16384, 1, 0, 1, job) - analytic_memory_bytes(shape, 16384, 1, 0, 1, fused)
    assert saved == 16384 * (16 * (eager - liger) + 4 * shape.hidden)  # 16 layers, and the final norm's fp32 input
    cfg = SimpleNamespace(deepspeed=SimpleNamespace(zero_stage=2, offload_optimizer=False,
                                                    grad_accum_fp32=lambda n: False),
                          loss=SimpleNamespace(chunk_size=4096), model=SimpleNamespace(attention_backend="fa4"))
    of_run = JobSettings.of_run(cfg, 1, fused_kernels=("rms_norm", "rope", "swiglu"))
    assert of_run.fused_rms_norm and of_run.fused_swiglu and of_run.attention_out_shared
    assert not JobSettings.of_run(cfg, 1).fused_rms_norm  # no model yet: HF's modules (an over-estimate)


# A Llama whose decoder layers outweigh its (tied) embedding, so the model states, not the transient gradients of
# the LM head, are what is measured.
STATES_MODEL = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 8, "num_attention_heads": 4,
                "num_key_value_heads": 2, "max_position_embeddings": 512, "tie_word_embeddings": True}
STATE_CASES = [(1, False), (2, False), (2, True), (3, False), (3, True)]  # (ZeRO stage, fp32 accumulation)


def _live_tensor_bytes() -> int:
    """Bytes of every distinct tensor storage alive in this process (parameters, gradients, optimizer state)."""
    import gc

    import torch

    gc.collect()
    sizes = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
            storage = obj.untyped_storage()
            sizes[storage.data_ptr()] = max(sizes.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(sizes.values())


def _states_worker(rank, world_size, shards, out):
    import json

    from hbp_train import build as builder
    from hbp_train import config, trainer
    from hbp_train.distributed.groups import init_distributed
    from hbp_train.perf.shape import parse_model_shape

    init_distributed()
    results = {}
    for stage, fp32_accum in STATE_CASES:
        # Small buckets, and every ZeRO-3 parameter partitioned, so that buffers do not hide the states.
        extra = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
        compact = lambda d: json.dumps(d).replace('"', "").replace(" ", "")  # noqa: E731
        cfg = config.load(["experiment=cpu_demo", f"data.shards={shards}", f"train.out_dir={out}/{stage}{fp32_accum}",
                           "logging=quiet", f"model.config={compact(STATES_MODEL)}", f"deepspeed.zero_stage={stage}",
                           "model.dtype=bf16", "deepspeed.reduce_bucket_size=4096", "train.warmup_steps=0",
                           f"deepspeed.grad_accum_dtype={'fp32' if fp32_accum else 'bf16'}",
                           f"+deepspeed.extra={compact(extra)}"])
        before = _live_tensor_bytes()
        run = builder.build(cfg)
        inner = run.engine.optimizer.optimizer  # the torch AdamW that DeepSpeed steps with the fp32 partitions
        plain_step, seen = inner.step, {}

        def step(*args, **kwargs):  # inside DeepSpeed's step(): the fp32 gradient partition exists now
            result = plain_step(*args, **kwargs)
            seen["in_step"] = _live_tensor_bytes() - before
            return result

        inner.step = step
        for s in range(2):  # the second step: Adam's m and v exist (torch creates them in the first)
            trainer.forward_backward(run, run.data.step_batch(s, rank, run.pad_token_id))
            seen["after_backward"] = _live_tensor_bytes() - before
            run.engine.step()
        results[stage, fp32_accum] = dict(seen, params=sum(getattr(p, "ds_numel", p.numel())
                                                           for p in run.model.parameters()),
                                          shape_params=parse_model_shape(run.model.config).num_params)
        inner.step = plain_step
        run.engine.destroy()
        del run, inner, plain_step, step
    return results if rank == 0 else None


@pytest.mark.slow
@pytest.mark.full  # the memory model's formulas are proven exactly in the default tier
def test_model_states_match_what_deepspeed_holds_through_backward_and_in_step(tmp_path):
    """Two CPU ranks, bf16 parameters, a tied LM head: the bytes of every tensor alive after the last backward of a
    step and inside its optimizer step equal model_state_bytes within 3% at each ZeRO stage, with bf16 and with
    fp32 gradient accumulation. With bf16 accumulation the fp32 gradient partition exists only inside step()."""
    import numpy as np

    from tests.assets.packed_fixture import write_packed
    from tests.distributed import run_distributed

    rng = np.random.default_rng(0)
    samples = [(ids, ids) for ids in (rng.integers(3, 4096, size=64).tolist() for _ in range(8))]
    steps = [{"group": 0, "replicas": [[[4 * s], [4 * s + 1]], [[4 * s + 2], [4 * s + 3]]]} for s in range(2)]
    shards = write_packed(str(tmp_path / "packed"), samples, steps, world_size=2)
    results = run_distributed(_states_worker, 2, shards, str(tmp_path / "run"), timeout=600)[0]
    for (stage, fp32_accum), got in results.items():
        params = got["params"]
        assert params == got["shape_params"], "the shape counts the tied LM head once, as the model holds it"
        job = JobSettings(zero_stage=stage, grad_accum_fp32=fp32_accum)
        in_step = model_state_bytes(params, 2, job, in_step=True)
        assert got["in_step"] == pytest.approx(in_step, rel=0.03), (stage, fp32_accum, got["in_step"] / params)
        through_backward = model_state_bytes(params, 2, job)
        if stage == 1:  # the whole bf16 gradients until the boundary's reduction: an upper bound after it
            assert got["after_backward"] <= through_backward * 1.03
        else:
            assert got["after_backward"] == pytest.approx(through_backward, rel=0.03), (stage, fp32_accum)
        if not fp32_accum:
            # the fp32 partition (4 B/param over 2 ranks) appears in step(), where the bf16 one (2 B) goes
            assert got["after_backward"] < in_step - 0.5 * params, (stage, got["after_backward"] / params)


def test_tiled_mlp_keeps_no_mlp_intermediate_and_backward_holds_one_tile():
    """The tiled MLP: every plain layer keeps 4 x ffn per token less (gate, up, act, product) at the end of the
    forward; in backward a layer holds its input gradient and one tile's recompute instead of the whole slice's MLP
    gradients."""
    from hbp_train.perf.memory import layer_backward_bytes, memory_breakdown, mlp_bytes_per_token

    shape = parse_model_shape("llama3-8b")
    job, tokens = JobSettings(zero_stage=2), 16384
    plain, tiled = (memory_breakdown(shape, tokens, 1, 0, 8, job, tiled_mlp=t) for t in (False, True))
    mlp = mlp_bytes_per_token(shape)
    assert mlp == 2 * 4 * shape.ffn
    assert plain.loss - tiled.loss == tokens * shape.num_layers * mlp
    untiled_bwd, tiled_bwd = (layer_backward_bytes(shape, tokens, job, t) for t in (False, True))
    assert untiled_bwd == 2 * 2 * shape.hidden * tokens + 2 * 2 * shape.ffn * tokens  # residual + 2 MLP gradients
    # tiled (4 tiles of 4096 tokens): the input gradient, one tile's intermediates and their two gradients, and one
    # bf16 copy of the MLP weights' gradients (summed over the tiles); now above the attention's and HF's fp32 norm
    # backward (16h per token); with 16 tiles the norm's is the largest
    residual = 2 * 2 * shape.hidden * tokens
    tile_phase = 2 * shape.hidden * tokens + 4096 * 2 * 6 * shape.ffn + 2 * 3 * shape.hidden * shape.ffn
    assert tiled_bwd == residual + tile_phase > residual + 16 * shape.hidden * tokens
    assert layer_backward_bytes(shape, 4 * tokens, job, True) == 4 * residual + 4 * 16 * shape.hidden * tokens
    attention = tokens * (2 * (2 * shape.attn_width + 2 * shape.kv_width) + 4 * shape.attn_width)
    liger = JobSettings(zero_stage=2, fused_rms_norm=True, fused_swiglu=True)
    liger_tile = 2 * shape.hidden * tokens + 4096 * 2 * 4 * shape.ffn + 2 * 3 * shape.hidden * shape.ffn
    assert layer_backward_bytes(shape, tokens, liger, True) == residual + max(liger_tile, attention)
    assert plain.backward_plain - tiled.backward_plain == tokens * shape.num_layers * mlp + untiled_bwd - tiled_bwd


def test_offload_leaves_two_inputs_on_the_gpu_and_brings_each_back_for_its_own_layer():
    """Activation offload with every layer checkpointed: at the end of the forward only the newest input and the one
    being copied stay on the GPU (the rest is in host memory; copied inline, as the CPU bench does, only the newest);
    in backward each input comes back for its own layer and is freed after it (model/levers.py), so the checkpointed
    layers' backward holds, beside the rebuilt layer (whose norm keeps its own input), only the other one of the two,
    where without offload the checkpoints keep all the inputs."""
    import hbp_train.perf.memory as memory

    shape = parse_model_shape("llama3-8b")
    h2, tokens, layers = 2 * shape.hidden, 16384, shape.num_layers
    for job, on_device in ((JobSettings(zero_stage=3), memory.OFFLOAD_INPUTS_ON_DEVICE),
                           (JobSettings(zero_stage=3, offload_side_stream=False), 1)):
        for c in (layers, 2, 1):
            kept, offloaded = (memory.memory_breakdown(shape, tokens, 1, c, 8, job, offload_activations=o)
                               for o in (False, True))
            left = min(c, on_device)
            assert kept.loss - offloaded.loss == tokens * (c - left) * h2 == offloaded.host and kept.host == 0
            assert kept.backward_ckpt - offloaded.backward_ckpt == tokens * (c - left + 1) * h2, (c, on_device)


def test_the_peak_moment_and_its_terms():
    """The breakdown names what fills each moment: the terms of the moment that sets the peak sum to the peak."""
    from hbp_train.perf.memory import memory_breakdown

    shape = parse_model_shape("llama3-8b")
    br = memory_breakdown(shape, 131072, 8, 32, 8, JobSettings(zero_stage=3, loss_chunk_tokens=8192))
    assert br.moment == "loss" and sum(br.terms["loss"].values()) == br.peak
    assert max(br.terms["loss"], key=br.terms["loss"].get) == "model states"
    br = memory_breakdown(shape, 1 << 20, 8, 32, 8, JobSettings(zero_stage=3, loss_chunk_tokens=8192), True, True)
    assert br.moment == "backward_ckpt" and sum(br.terms["backward_ckpt"].values()) == br.peak
