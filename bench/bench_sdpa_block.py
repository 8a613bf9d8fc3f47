"""sdpa_block: one SDPA call with a block-diagonal mask against one is_causal SDPA call per document (issue 19,
defect 8), forward+backward, on the packs of several layouts, in one process.

    python bench/bench_sdpa_block.py                      # CPU, fp32 (the sizes below)
    python bench/bench_sdpa_block.py --device cuda        # a GPU, bf16

The mask path materialises a T x T mask per pack and, with GQA or a mask, SDPA falls back to its math kernel on
GPUs; the loop runs the flash/efficient kernel per document. Prints each layout's time per path and the ratio
mask/loop (> 1: the loop is faster). hbp_train.model.attention's sdpa_block runs the loop (the mask path is kept here
only as the baseline being compared).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LAYOUTS = {  # name -> document lengths of one pack
    "1 doc": [4096],
    "4 docs": [1024] * 4,
    "16 docs": [256] * 16,
    "64 docs": [64] * 64,
    "long tail": [2048, 1024, 512, 256, 128, 64, 32, 16, 16],
    "256 docs": [16] * 256,
}


def mask_path(q, k, v, cu, scale):
    """The former sdpa_block below its size threshold: one call with a block-diagonal causal bool mask."""
    import torch
    import torch.nn.functional as F

    from hbp_train.model.attention_flex import document_ids as _document_ids

    num_tokens = q.shape[0]
    doc = _document_ids(cu, num_tokens)
    pos = torch.arange(num_tokens, device=q.device)
    mask = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])
    out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
                                         attn_mask=mask, scale=scale, enable_gqa=k.shape[1] != q.shape[1])
    return out[0].transpose(0, 1)


def main(argv=None) -> int:
    import torch

    from hbp_train.model.attention import packed_attention

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    def timed(fn):
        times = []
        for i in range(args.repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i:  # the first call warms up
                times.append(time.perf_counter() - t0)
        return statistics.median(times)

    print(f"sdpa_block on {device} ({dtype}), {args.heads} q heads / {args.kv_heads} kv heads, head dim "
          f"{args.head_dim}: fwd+bwd ms per pack, median of {args.repeats}")
    print(f"{'layout':<12}{'tokens':>8}{'mask ms':>10}{'loop ms':>10}{'mask/loop':>11}")
    for name, lengths in LAYOUTS.items():
        num_tokens = sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        q = torch.randn(num_tokens, args.heads, args.head_dim, device=device, dtype=dtype, requires_grad=True)
        k, v = (torch.randn(num_tokens, args.kv_heads, args.head_dim, device=device, dtype=dtype, requires_grad=True)
                for _ in range(2))
        scale = args.head_dim ** -0.5

        def step(fn):
            return lambda: torch.autograd.grad(fn().sum(), (q, k, v))

        mask_s = timed(step(lambda: mask_path(q, k, v, cu, scale)))
        loop_s = timed(step(lambda: packed_attention(q, k, v, cu, max(lengths), "sdpa_block", scale=scale)))
        print(f"{name:<12}{num_tokens:>8}{1e3 * mask_s:>10.2f}{1e3 * loop_s:>10.2f}{mask_s / loop_s:>10.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
