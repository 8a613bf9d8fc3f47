"""The one FLOPs formula of a decoder-only transformer, used by MFU (trainer, benchmarks) and the cost model.

Forward FLOPs are 2 per multiply-add. Per token the linear parts are 2 per weight a token uses
(``ModelShape.linear_params(active=True)``: q, k, v, o projections or MLA's down/up projections, the gated MLP, or
an MoE layer's router, top-k experts and shared experts); the LM head is one more matmul (also when tied to the
embeddings). Causal attention of a document of length l costs, per layer forward, QK^T and PV over the l²/2
visible pairs: l²·heads·(head_dim + v_head_dim) (= 2·l²·heads·head_dim when v and q/k heads are as wide). Documents of a pack never attend to each other, so attention sums l² per document, never T².
Training (forward + backward) is 3 x forward: backward computes the input and the weight gradients. Embedding
lookups, norms, biases and the recompute of checkpointed layers are not counted (the MFU convention).

Pure numpy: the planner and the simulator use it through the cost model.
"""

from __future__ import annotations

import numpy as np

from hbp_train.perf.shape import ModelShape

# Training FLOPs per forward FLOP (backward = input gradients + weight gradients, each as costly as the forward).
TRAIN_OVER_FORWARD = 3.0


def linear_fwd_flops_per_token(shape: ModelShape) -> float:
    """Forward FLOPs per token of one layer's linear parts (the mean over layers when MoE and dense layers mix):
    2 per weight the token goes through."""
    return 2.0 * shape.linear_params(active=True) / shape.num_layers


def head_fwd_flops_per_token(shape: ModelShape) -> float:
    """Forward FLOPs per token of the LM head."""
    return 2.0 * shape.hidden * shape.vocab


def attention_fwd_flops(shape: ModelShape, lengths) -> np.ndarray:
    """Forward FLOPs of causal attention in ONE layer, for each document length (an array like ``lengths``)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    return lengths * lengths * float(shape.attn_width + shape.out_width)


def flops_per_token(shape: ModelShape) -> float:
    """Training FLOPs per token of every layer's linear parts and the LM head (attention is per document)."""
    return TRAIN_OVER_FORWARD * (shape.num_layers * linear_fwd_flops_per_token(shape) + head_fwd_flops_per_token(shape))


def attention_flops(shape: ModelShape, seq_lens) -> float:
    """Training FLOPs of causal attention in every layer for a pack of documents of lengths ``seq_lens``."""
    return TRAIN_OVER_FORWARD * shape.num_layers * float(attention_fwd_flops(shape, seq_lens).sum())


def pack_flops(shape: ModelShape, seq_lens) -> float:
    """Training FLOPs of one pack: linear FLOPs for all its tokens plus its per-document attention FLOPs."""
    return flops_per_token(shape) * float(sum(seq_lens)) + attention_flops(shape, seq_lens)
