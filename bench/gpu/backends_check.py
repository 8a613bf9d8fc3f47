"""The GPU acceptance's backends check (bench/gpu/checks.py lists it with the others): every packed attention backend
installed here and our default decoder kernels against a reference, the same weights in fp32 with HF's eager
attention run one document at a time (loss and every parameter's gradient), each backend's attention time, and
whether ``attention_backend=auto`` chose the fastest."""

from __future__ import annotations

import time

from bench.gpu.report import verdict


def _attention_ms(backend: str, shape, lengths: list[int], device, dtype, iters: int) -> float:
    """Forward + backward of one packed attention call of the model's head shape over the pack, ms (mean of
    ``iters`` after one untimed call: compiles and JIT builds happen there)."""
    import torch

    from hbp_train.model.attention import packed_attention

    gen = torch.Generator().manual_seed(0)
    num_tokens = sum(lengths)
    q, k, v = (torch.randn(num_tokens, heads, dim, generator=gen, device="cpu").to(device, dtype).requires_grad_()
               for heads, dim in ((shape.num_heads, shape.head_dim), (shape.num_kv_heads, shape.head_dim),
                                  (shape.num_kv_heads, shape.v_head_dim)))
    cu = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
    grad = torch.randn(num_tokens, shape.num_heads, shape.v_head_dim, generator=gen, device="cpu").to(device, dtype)
    times = []
    for i in range(iters + 1):
        sync_device(device)
        t0 = time.perf_counter()
        out = packed_attention(q, k, v, cu, max(lengths), backend)
        torch.autograd.grad(out, (q, k, v), grad)
        sync_device(device)
        if i:
            times.append(time.perf_counter() - t0)
    return 1e3 * sum(times) / len(times)


def sync_device(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def check_backends(ctx) -> dict:
    """Every available backend and our decoder kernels vs fp32 eager attention, one forward per document: loss and
    parameter grads; every backend's attention time, and whether "auto" chose the fastest."""
    import torch

    from hbp_train.model.attention_setup import HeadShape, available_backends, describe_backend, select_backend
    from hbp_train.model.kernels import restore_hf_modules
    from hbp_train.model.loss import chunked_token_losses
    from hbp_train.model.hf_model import ModelConfig, build_model, forward_hidden
    from hbp_train.model.rope import PackSlice
    from hbp_train.common.labels import IGNORE_INDEX

    device, dtype = ctx.device, ctx.dtype
    cfg = dict(ctx.hf_config, num_hidden_layers=2)  # two layers of the shape: the attention is what is checked
    cfg.pop("model_type", None)
    lengths = [ctx.pack_len // 2, ctx.pack_len // 4, ctx.pack_len // 8, ctx.pack_len - ctx.pack_len // 2
               - ctx.pack_len // 4 - ctx.pack_len // 8]
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, cfg["vocab_size"], (ctx.pack_len,), generator=gen)
    labels = torch.cat([torch.cat([ids[s + 1:s + n], torch.tensor([IGNORE_INDEX])])
                        for s, n in zip(torch.tensor([0, *lengths]).cumsum(0).tolist(), lengths)])
    position_ids = torch.cat([torch.arange(n) for n in lengths])
    cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)

    def run(model, packed: bool):
        model.zero_grad(set_to_none=True)
        dev = next(model.parameters()).device
        weight = model.get_output_embeddings().weight
        if packed:
            hidden = forward_hidden(model, ids[None].to(dev), position_ids[None].to(dev), cu_seq_lens_q=cu.to(dev),
                                    cu_seq_lens_k=cu.to(dev), max_length_q=max(lengths), max_length_k=max(lengths),
                                    pack_slice=PackSlice.whole(cu))  # each document's own RoPE, as the trainer's
        else:  # the reference: each document alone, HF's own causal mask
            hidden = torch.cat([forward_hidden(model, ids[None, s:s + n].to(dev), torch.arange(n)[None].to(dev))
                                for s, n in zip(cu[:-1].tolist(), lengths)], dim=1)
        loss = chunked_token_losses(hidden[0], weight, labels.to(dev)).float().sum() / (labels != IGNORE_INDEX).sum()
        loss.backward()
        return float(loss.detach()), {n: p.grad.detach().float().cpu() for n, p in model.named_parameters()
                                      if p.grad is not None}

    restore_hf_modules()  # the reference is HF's own code, whatever an earlier check built
    torch.manual_seed(0)
    with torch.device(device):  # initialised on the device: the 128K-vocabulary embeddings take long on the host
        ref_model = build_model(ModelConfig(config=cfg, dtype="fp32", attention_backend="sdpa_block", kernels="none"),
                                vocab_size=cfg["vocab_size"])
    ref_model.set_attn_implementation("eager")
    ref_loss, ref_grads = run(ref_model, packed=False)
    state = {k: v.cpu() for k, v in ref_model.state_dict().items()}
    shape = HeadShape.of(ref_model.config)
    del ref_model
    tol, min_cos = (2e-2, 0.99) if dtype != torch.float32 else (1e-4, 0.99999)  # bf16 against an fp32 reference
    model_dtype = "bf16" if dtype == torch.bfloat16 else "fp32"

    def against_reference(backend: str, kernels: str) -> tuple[dict, object]:
        try:
            with torch.device(device):
                model = build_model(ModelConfig(config=cfg, dtype=model_dtype, attention_backend=backend,
                                                kernels=kernels), vocab_size=cfg["vocab_size"])
            model.load_state_dict(state)
            loss, grads = run(model, packed=True)
        except Exception as exc:  # noqa: BLE001 - a backend that fails here is the finding
            return {"error": f"{type(exc).__name__}: {exc}".splitlines()[0]}, None
        phrase = model._hbp_kernels
        del model
        cos = min(float(torch.nn.functional.cosine_similarity(grads[n].flatten(), g.flatten(), dim=0))
                  for n, g in ref_grads.items())
        rel = max(float((grads[n] - g).norm() / g.norm().clamp_min(1e-12)) for n, g in ref_grads.items())
        return {"loss": loss, "loss_rel_error": abs(loss / ref_loss - 1), "grad_min_cosine": cos,
                "grad_max_rel_error": rel,
                "verdicts": {"loss": verdict("backend_loss_rel_error", abs(loss / ref_loss - 1), ctx.dry_run, tol),
                             "grads": verdict("backend_grad_cosine", cos, ctx.dry_run, min_cos)}}, phrase

    def check(backend):
        row, _ = against_reference(backend, "none")
        if "error" not in row:
            row["kernel"] = describe_backend(backend, device)
        return row

    rows, times, skipped = backend_rows(available_backends(device, dtype), check, lambda backend: _attention_ms(
        backend, shape, lengths, device, dtype, iters=1 if ctx.dry_run else 5))
    auto = select_backend("auto", device, dtype, shape)
    # The decoder kernels a run gets by default (model.kernels=auto: Liger on a GPU where installed; none on the
    # CPU, where the row still proves the path), on the backend auto chose.
    row, phrase = against_reference(auto, "auto" if not ctx.dry_run else "none")
    rows[f"kernels={(phrase or 'auto').split()[0]}"] = dict(row, decoder_kernels=phrase, backend=auto)
    restore_hf_modules()  # the later checks' HF baselines run HF's own RoPE
    fastest = min(times, key=times.get) if times else None
    ratio = times[auto] / times[fastest] if fastest and auto in times else None
    return {"reference": {"what": "fp32, HF eager attention, one forward per document", "loss": ref_loss},
            "pack_lengths": lengths, "dtype": str(dtype), "backends": rows, "auto": auto, "fastest": fastest,
            "skipped": skipped, "verdict": verdict("auto_backend_fastest", ratio, ctx.dry_run)}


def backend_rows(available: list, check, time_it) -> tuple[dict, dict, list]:
    """(rows, times, skipped) over the ``available`` backends in preference order: ``check(backend)`` -> its row
    (with "error" when it failed), ``time_it(backend)`` -> ms for each that passed. flex is skipped once a varlen
    kernel passed: auto never picks it over one, and its compile (minutes on a GPU) would eat the budget."""
    from hbp_train.model.attention import VARLEN_KERNELS

    rows, times, skipped = {}, {}, []
    for backend in available:
        passed = [b for b, row in rows.items() if b in VARLEN_KERNELS and "error" not in row]
        if backend == "flex" and passed:
            skipped.append(f"flex: {passed[0]} passed, which auto picks first; flex's compile is not worth the budget")
            continue
        rows[backend] = check(backend)
        if "error" in rows[backend]:
            continue
        try:
            times[backend] = rows[backend]["attention_fwd_bwd_ms"] = time_it(backend)
        except Exception as exc:  # noqa: BLE001 - reported beside its correctness figures
            rows[backend]["timing_error"] = f"{type(exc).__name__}: {exc}".splitlines()[0]
    return rows, times, skipped
