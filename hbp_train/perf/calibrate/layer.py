"""The calibration: one decoder layer's attention by document length (forward and forward+backward), its linear
part (the layer, with the decoder kernels training uses, and an elementwise stand-in for the attention core) and the
LM head with the trainer's loss, each per 32768 tokens (the cost model's table).
"""

from __future__ import annotations

from datetime import date

from hbp_train.common.errors import UserError
from hbp_train.perf.calibrate import timing
from hbp_train.perf.cost_model import TABLE_TOKENS
from hbp_train.perf.shape import ModelShape

DEFAULT_DOC_LENS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
NOOP_ATTENTION = "hbp_calibrate_noop"


def _noop_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Stand-in for the attention core: elementwise, touches q, k and v so every projection gets a gradient."""
    groups = query.shape[1] // key.shape[1]
    mixed = query + (key + value).repeat_interleave(groups, dim=1)
    return mixed.transpose(1, 2), None


def parse_doc_lens(text: str, tokens: int) -> list[int]:
    """The --doc-lens list; UserError naming the flag."""
    try:
        doc_lens = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:  # int() of a piece that is not a number
        raise UserError(f"--doc-lens must be comma-separated integers, got {text!r}") from None
    if not doc_lens or any(l < 1 or l > tokens for l in doc_lens):
        raise UserError(f"--doc-lens must be positive and <= --tokens ({tokens}), got {text}")
    return doc_lens


def calibrate(shape: ModelShape, args, device, dtype) -> dict:
    """Measure the attention table, the linear part and the LM head with the program training runs here
    (``timing.training_program``: the backend, the decoder kernels, the loss); returns the calibration dict."""
    import torch
    from transformers import AttentionInterface
    from transformers.models.llama.modeling_llama import LlamaModel

    from hbp_train.model import kernels
    from hbp_train.model.attention import packed_attention

    timed = timing.timer(device)
    backend, chosen, fused = timing.training_program(args, device, dtype, shape)
    doc_lens = parse_doc_lens(args.doc_lens, args.tokens)
    gen = torch.Generator(device="cpu").manual_seed(args.seed)
    fwdbwd, fwd = {}, {}
    for length in doc_lens:
        num_docs = args.tokens // length
        tokens = num_docs * length
        cu = timing.cu_seqlens_for([length] * num_docs, device)

        def make(heads):
            return torch.randn(tokens, heads, shape.head_dim, generator=gen, device="cpu").to(device, dtype)

        q, k, v = (make(heads).requires_grad_() for heads in (shape.num_heads, shape.num_kv_heads, shape.num_kv_heads))
        grad = make(shape.num_heads)

        def forward():
            with torch.no_grad():
                packed_attention(q, k, v, cu, length, backend)

        def forward_backward():
            out = packed_attention(q, k, v, cu, length, backend)
            torch.autograd.grad(out, (q, k, v), grad)

        scale = TABLE_TOKENS / tokens
        fwd[str(length)] = round(timed(forward, args.iters, args.warmup) * scale, 3)
        fwdbwd[str(length)] = round(timed(forward_backward, args.iters, args.warmup) * scale, 3)
        print(f"attention doc_len {length:>6}: fwd {fwd[str(length)]:.3f} ms, fwd+bwd {fwdbwd[str(length)]:.3f} ms "
              f"per {TABLE_TOKENS} tokens", flush=True)
        del q, k, v, grad
    # Linear part: one layer with the attention core replaced by an elementwise stand-in, with the decoder kernels
    # training uses (applied to a one-layer model, as they are to the trained model; no vocabulary to speak of).
    AttentionInterface.register(NOOP_ATTENTION, _noop_attention)
    cfg = timing.llama_config(shape, NOOP_ATTENTION)
    cfg.num_hidden_layers, cfg.vocab_size = 1, 8
    torch.manual_seed(args.seed)
    net = LlamaModel(cfg).to(device, dtype)
    phrase = kernels.apply_kernels(net, chosen, net.layers)
    layer, rope = net.layers[0], net.rotary_emb
    hidden = torch.randn(1, args.tokens, shape.hidden, generator=gen, device="cpu").to(device, dtype).requires_grad_()
    position_ids = torch.arange(args.tokens, device=device)[None]
    pos_emb = rope(hidden, position_ids)

    def layer_step():
        out = layer(hidden, position_ids=position_ids, position_embeddings=pos_emb)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))

    linear = round(timed(layer_step, args.iters, args.warmup) * TABLE_TOKENS / args.tokens, 3)
    print(f"linear part (layer without attention core, decoder kernels {phrase}): {linear:.3f} ms per "
          f"{TABLE_TOKENS} tokens", flush=True)
    del net, layer, hidden, pos_emb
    loss_impl = "fused" if fused else "chunked"
    head = round(time_head(shape, args, device, dtype, timed, gen, fused) * TABLE_TOKENS / args.tokens, 3)
    print(f"LM head + {loss_impl} loss: {head:.3f} ms per {TABLE_TOKENS} tokens", flush=True)
    return {
        "what": f"One transformer layer shaped like {shape.name} (hidden {shape.hidden}, {shape.num_heads} q heads, "
                f"{shape.num_kv_heads} kv heads, head dim {shape.head_dim}, ffn {shape.ffn}), {str(dtype)[6:]}, "
                f"fwd+bwd, attention backend {backend} (causal, packed), decoder kernels {phrase}, {loss_impl} "
                "LM-head loss. T = tokens in the pack.",
        "backend": backend, "decoder_kernels": phrase, "loss_impl": loss_impl,
        "measured": f"{date.today().isoformat()}, median of {args.iters} timed iterations after {args.warmup} "
                    f"warm-ups, {args.tokens} tokens per timed pack",
        **timing.device_fields(device, dtype, args.procs),
        "torch": torch.__version__,
        "model_shape": {k: getattr(shape, k) for k in ("name", "hidden", "num_layers", "num_heads",
                                                        "num_kv_heads", "ffn", "vocab", "head_dim")},
        "linear_fwdbwd_ms_per_32768_tokens": linear,
        "head_fwdbwd_ms_per_32768_tokens": head,
        "head_loss_chunk": timing.VALIDATE_LOSS_CHUNK,
        "attention_fwdbwd_ms_32768_tokens_by_doc_len": fwdbwd,
        "attention_fwd_ms_32768_tokens_by_doc_len": fwd,
    }


def calibrate_or_explain(shape: ModelShape, args, device, dtype) -> dict:
    """``calibrate``; running out of memory is one line naming the flag to lower (the free memory is in it)."""
    import torch

    from hbp_train.observe.telemetry import is_oom

    try:
        return calibrate(shape, args, device, dtype)
    except (torch.cuda.OutOfMemoryError, RuntimeError) as exc:
        if not is_oom(exc):
            raise
    free = timing.free_gpu_bytes()
    raise UserError(f"out of memory timing packs of --tokens {args.tokens} (the GPU has "
                    f"{'?' if free is None else f'{free / 2**30:.1f} GiB'} free): rerun with --tokens "
                    f"{max(args.tokens // 2, 1)} (results are written per {TABLE_TOKENS} tokens either way)")


def time_head(shape: ModelShape, args, device, dtype, timed, gen, fused: bool = False) -> float:
    """Milliseconds of the LM head with the trainer's loss (hbp_train/model/loss.py: the fused one, or the chunked
    one), fwd+bwd, for --tokens tokens: three or four vocab x hidden matmuls plus fp32 passes over every chunk's
    logits, which the layer's FLOP rate does not predict (the cost model's head term)."""
    import torch

    def host(*size, scale=1.0):
        return torch.randn(*size, generator=gen, device="cpu") * scale

    hidden = host(args.tokens, shape.hidden).to(device, dtype).requires_grad_()
    weight = host(shape.vocab, shape.hidden, scale=0.02).to(device, dtype).requires_grad_()
    labels = torch.randint(0, shape.vocab, (args.tokens,), generator=gen, device="cpu").to(device)

    def head_step():
        loss = timing.head_loss(hidden, weight, labels, fused)
        torch.autograd.grad(loss, (hidden, weight))

    return timed(head_step, args.iters, args.warmup)
