"""LM-head cross-entropy that never holds T x vocab logits, and the loss normalizers.

`chunked_token_losses` runs the LM head and the cross-entropy one chunk of tokens at a time and recomputes each
chunk's logits in backward, so forward and backward memory is O(chunk x V) instead of O(T x V) (a 32K pack with a
128K vocabulary would otherwise hold 16 GiB of fp32 logits). Tokens whose label is IGNORE_INDEX are skipped entirely.

`normalize_loss` turns one micro-batch's per-token losses into the scalar to call backward on, so that after
DeepSpeed averages gradients the step's gradient is the one the chosen normalizer defines (see its docstring).

Shape legend: T tokens, H hidden size, V vocabulary size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from hbp_train.errors import UserError
from hbp_train.labels import IGNORE_INDEX

NORMALIZERS = ("ave_token", "token_mean", "sample_mean", "sum")


@dataclass
class LossConfig:
    """How the LM loss is computed and normalized."""

    normalizer: str = "ave_token"
    """How token losses become the step's loss: ave_token (sum over the step / loss tokens of the whole step, all
    replicas), token_mean (mean over data-parallel ranks of each rank's per-token mean), sample_mean (mean over the
    step's samples of each sample's per-token mean), sum (plain sum). See `normalize_loss`."""

    chunk_size: int = 4096
    """Tokens per LM-head chunk: memory is chunk_size x vocab fp32 logits; larger chunks are slightly faster."""

    def __post_init__(self):
        if self.normalizer not in NORMALIZERS:
            raise UserError(f"loss.normalizer: {self.normalizer!r} is not one of {', '.join(NORMALIZERS)}")
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise UserError(f"loss.chunk_size: must be a positive integer, got {self.chunk_size!r}")


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token CE of (hidden @ W.T + b) for the given rows; saves only hidden, W, b and the logsumexp per row."""

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, bias_V, labels_N, chunk_size):
        num_rows = hidden_NH.shape[0]
        loss_N = torch.empty(num_rows, dtype=torch.float32, device=hidden_NH.device)
        lse_N = torch.empty_like(loss_N)
        for start in range(0, num_rows, chunk_size):
            end = min(start + chunk_size, num_rows)
            logits_CV = _chunk_logits(hidden_NH[start:end], weight_VH, bias_V)
            lse_C = torch.logsumexp(logits_CV, dim=-1)
            target_C = logits_CV.gather(1, labels_N[start:end, None])[:, 0]
            loss_N[start:end] = lse_C - target_C
            lse_N[start:end] = lse_C
            del logits_CV
        ctx.save_for_backward(hidden_NH, weight_VH, bias_V, labels_N, lse_N)
        ctx.chunk_size = chunk_size
        return loss_N

    @staticmethod
    def backward(ctx, grad_loss_N):
        hidden_NH, weight_VH, bias_V, labels_N, lse_N = ctx.saved_tensors
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        grad_hidden_NH = torch.empty_like(hidden_NH) if need_hidden else None
        grad_weight_VH = torch.zeros_like(weight_VH) if need_weight else None
        # Several chunks of a bf16 weight: each chunk's product (rounded once, in grad_weight_VH) is summed in an
        # fp32 V x H buffer, as a bf16 running sum would round at every chunk (the memory model counts it).
        num_chunks = -(-hidden_NH.shape[0] // ctx.chunk_size)
        sum_VH = (torch.zeros_like(weight_VH, dtype=torch.float32)
                  if need_weight and num_chunks > 1 and weight_VH.dtype != torch.float32 else None)
        grad_bias_V = torch.zeros(weight_VH.shape[0], dtype=torch.float32, device=weight_VH.device) if need_bias else None
        grad_loss_N = grad_loss_N.float()
        for start in range(0, hidden_NH.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden_NH.shape[0])
            # d loss / d logits = softmax - onehot(label), times the incoming gradient of each row's loss.
            grad_logits_CV = _chunk_logits(hidden_NH[start:end], weight_VH, bias_V)
            grad_logits_CV.sub_(lse_N[start:end, None]).exp_()
            rows = torch.arange(end - start, device=grad_logits_CV.device)
            grad_logits_CV[rows, labels_N[start:end]] -= 1.0
            grad_logits_CV.mul_(grad_loss_N[start:end, None])
            if need_bias:
                grad_bias_V += grad_logits_CV.sum(0)
            grad_logits_CV = grad_logits_CV.to(weight_VH.dtype)
            if need_hidden:
                grad_hidden_NH[start:end] = grad_logits_CV @ weight_VH
            if sum_VH is not None:
                torch.mm(grad_logits_CV.t(), hidden_NH[start:end], out=grad_weight_VH)
                sum_VH += grad_weight_VH
            elif need_weight:
                grad_weight_VH.addmm_(grad_logits_CV.t(), hidden_NH[start:end])
            del grad_logits_CV
        if sum_VH is not None:
            grad_weight_VH.copy_(sum_VH)
        if need_bias:
            grad_bias_V = grad_bias_V.to(bias_V.dtype)
        return grad_hidden_NH, grad_weight_VH, grad_bias_V, None, None


def _chunk_logits(hidden_CH, weight_VH, bias_V):
    """fp32 logits of one chunk; the matmul runs in the model's dtype as the HF LM head does."""
    logits_CV = hidden_CH @ weight_VH.t()
    if bias_V is not None:
        logits_CV = logits_CV + bias_V
    return logits_CV.float()


def chunked_token_losses(hidden_TH, lm_head_weight_VH, shift_labels_T, chunk_size: int = 4096, lm_head_bias=None):
    """Per-token cross-entropy loss_T (fp32) of the LM head applied to hidden_TH; 0 where shift_labels is IGNORE_INDEX.

    Equals F.cross_entropy(hidden @ W.T + b, labels, reduction="none") with gradients to hidden, W and b, but
    holds at most chunk_size x V logits at a time in forward and in backward (backward recomputes them).
    hidden_TH may also be [1, T, H] and shift_labels_T [1, T]; the result is always [T].
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    hidden_TH = hidden_TH.reshape(-1, hidden_TH.shape[-1])
    shift_labels_T = shift_labels_T.reshape(-1)
    if hidden_TH.shape[0] != shift_labels_T.shape[0]:
        raise ValueError(f"hidden has {hidden_TH.shape[0]} tokens but shift_labels has {shift_labels_T.shape[0]}")
    # Prompt tokens (label IGNORE_INDEX) cost nothing: only the trained rows go through the LM head.
    rows_N = torch.nonzero(shift_labels_T != IGNORE_INDEX, as_tuple=False).flatten()
    loss_N = _ChunkedCrossEntropy.apply(
        hidden_TH.index_select(0, rows_N), lm_head_weight_VH, lm_head_bias, shift_labels_T[rows_N].long(), chunk_size
    )
    loss_T = torch.zeros(shift_labels_T.shape[0], dtype=torch.float32, device=hidden_TH.device)
    return loss_T.index_put((rows_N,), loss_N)


def normalize_loss(
    loss_T,
    shift_labels_T,
    sample_ids_T,
    mode,
    *,
    global_loss_tokens=None,
    rank_loss_tokens=None,
    global_num_samples=None,
    rank_num_samples=None,
    dp_world_size=1,
    num_micro_batches=1,
    sample_loss_tokens_T=None,
):
    """The scalar to call backward on for ONE micro-batch on ONE data-parallel rank.

    Assumption about the engine (DeepSpeed's default): the step's gradient is
        grad = 1 / (dp_world_size * num_micro_batches) * sum over ranks and micro-batches of d(returned)/d(params),
    i.e. DeepSpeed averages gradients over the dp_world_size ranks and `engine.backward` divides each micro-batch
    loss by gradient_accumulation_steps (= num_micro_batches). Pass num_micro_batches=1 if the engine does not
    divide (scale_wrt_gas=False), and dp_world_size=1 if it sums instead of averaging. The returned scalar carries
    the factor dp_world_size * num_micro_batches that undoes this averaging, so that the gradient is that of:
        ave_token:   sum of all token losses of the step / global_loss_tokens (all replicas, all micro-batches)
        token_mean:  mean over dp ranks of (sum of the rank's token losses / rank_loss_tokens over its micro-batches)
        sample_mean: mean over the step's global_num_samples samples of (sample's loss sum / sample's loss tokens)
        sum:         sum of all token losses of the step
    Every token loss must be on exactly one rank's loss_T. Under sequence parallelism a sample is split over the
    ranks of its SP group: reducing the loss across that group is ulysses.py's job, and for sample_mean the
    collate step must pass sample_loss_tokens_T (per token: its whole sample's loss tokens), since counting them
    from this rank's slice would be wrong. Without it, the counts are taken from this micro-batch
    (sample_ids_T: per token, any id of its sample; samples must not span micro-batches).
    rank_num_samples is only checked against global_num_samples (no normalizer needs it).
    """
    if mode not in NORMALIZERS:
        raise ValueError(f"loss normalizer {mode!r} is not one of {', '.join(NORMALIZERS)}")
    loss_T = loss_T.reshape(-1)
    valid_T = shift_labels_T.reshape(-1) != IGNORE_INDEX
    token_sum = torch.where(valid_T, loss_T, torch.zeros_like(loss_T)).sum()
    undo_average = float(dp_world_size * num_micro_batches)
    if mode == "sum":
        return token_sum * undo_average
    if mode == "ave_token":
        _require_positive("global_loss_tokens", global_loss_tokens, mode)
        return token_sum * (undo_average / global_loss_tokens)
    if mode == "token_mean":
        # DeepSpeed's mean over ranks is already the mean the normalizer asks for: undo only the 1/num_micro_batches.
        _require_positive("rank_loss_tokens", rank_loss_tokens, mode)
        return token_sum * (num_micro_batches / rank_loss_tokens)
    _require_positive("global_num_samples", global_num_samples, mode)
    if rank_num_samples is not None and rank_num_samples > global_num_samples:
        raise ValueError(f"rank_num_samples ({rank_num_samples}) exceeds global_num_samples ({global_num_samples})")
    if sample_loss_tokens_T is None:
        _, inverse_T = torch.unique(sample_ids_T.reshape(-1), return_inverse=True)
        counts_S = torch.zeros(int(inverse_T.max()) + 1 if inverse_T.numel() else 0, device=loss_T.device)
        counts_S.index_add_(0, inverse_T, valid_T.float())
        sample_loss_tokens_T = counts_S[inverse_T]
    per_token_weight_T = torch.where(valid_T, 1.0 / sample_loss_tokens_T.reshape(-1).float().clamp(min=1), 0.0)
    return (loss_T * per_token_weight_T).sum() * (undo_average / global_num_samples)


def _require_positive(name, value, mode):
    if value is None or value <= 0:
        raise ValueError(f"normalizer {mode!r} needs {name} > 0, got {value!r}")
