"""The LM head and its cross-entropy, never holding T x vocab logits, and the loss normalizers as per-token weights.

Two implementations of the head + loss (``loss.impl``), both one chunk of tokens at a time (memory O(chunk x V)
instead of O(T x V): a 32K pack with a 128K vocabulary would otherwise hold 16 GiB of fp32 logits):

* ``chunked_token_losses`` (chunked): per-token losses with autograd; backward recomputes each chunk's logits.
  Four GEMM passes over [T, V] (forward; backward: recompute, d hidden, d W). Any use of the losses is exact.
* ``fused_token_losses`` (fused): the normalizer's per-token weights are known before the forward
  (``token_loss_weights``), so the weighted sum sum_t w_t loss_t is made together with its gradients w.r.t. hidden,
  W and b, chunk by chunk in the forward: three GEMM passes, no recompute, and the logits' gradient in two
  elementwise passes (a subtraction, then an exponential written in the weights' dtype) where chunked's backward
  recasts the logits and makes five. A weighted sum has a scalar upstream gradient g (DeepSpeed's loss scale, the
  SP loss all-reduce: see ``_FusedCrossEntropy.backward``), so backward only multiplies the stored gradients by g.

Both apply what the model's own head applies between its LM-head matmul and the loss (``LogitHead``: a scale
such as Granite's ``logits_scaling`` or Cohere's ``logit_scale``, and final logit soft-capping c tanh(x / c) as
Gemma 2/3 configure it), so the loss is the model's own; model/compat.py reads them from the config and checks
them against the model's forward.

Tokens whose label is IGNORE_INDEX are skipped entirely. Their count is known on the host (the collate step counts
it), and with ``num_rows`` the trained rows are selected without a host sync (``torch.nonzero`` would read the count
back from the device mid-forward).

``token_loss_weights`` is each normalizer as one weight per token: the weighted sum of one micro-batch's token losses
is the scalar to call backward on, so that after DeepSpeed averages gradients the step's gradient is the one the
normalizer defines (``normalize_loss`` computes that scalar from given losses).

Why not Liger's ``LigerFusedLinearCrossEntropyLoss`` (or cut-cross-entropy) as the GPU kernel: neither takes
per-token weights in the forward. Liger folds only one scalar into the gradients it makes in forward (reduction
sum/mean, plus an ``.item()`` host sync on the loss-token count per call); its reduction="none" gets per-token
gradients by recomputing in backward, as cut-cross-entropy does. sample_mean needs one weight per sample, so
neither expresses every normalizer exactly.

Shape legend: T tokens, N trained tokens (label not IGNORE_INDEX), C tokens of a chunk, H hidden size, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from hbp_train.common.errors import UserError
from hbp_train.common.labels import IGNORE_INDEX

NORMALIZERS = ("ave_token", "token_mean", "sample_mean", "sum")
IMPLS = ("auto", "fused", "chunked")


@dataclass
class LossConfig:
    """How the LM loss is computed and normalized."""

    normalizer: str = "ave_token"
    """How token losses become the step's loss: ave_token (sum over the step / loss tokens of the whole step, all
    replicas), token_mean (mean over data-parallel ranks of each rank's per-token mean), sample_mean (mean over the
    step's samples of each sample's per-token mean), sum (plain sum). See `normalize_loss`."""

    chunk_size: int = 4096
    """Tokens per LM-head chunk: memory is chunk_size x vocab fp32 logits; larger chunks are slightly faster."""

    impl: str = "auto"
    """The LM head + cross-entropy: fused (the gradients made in forward from the normalizer's per-token weights:
    three GEMM passes over the logits instead of four, no recompute in backward), chunked (the logits recomputed in
    backward) or auto (fused on a GPU, chunked on the CPU: the reference path, what CPU runs are checked against).
    Both give the same losses and gradients (tests/test_loss.py) and hold one chunk of logits at a time."""

    def __post_init__(self):
        if self.normalizer not in NORMALIZERS:
            raise UserError(f"loss.normalizer: {self.normalizer!r} is not one of {', '.join(NORMALIZERS)}")
        if not isinstance(self.chunk_size, int) or self.chunk_size < 1:
            raise UserError(f"loss.chunk_size: must be a positive integer, got {self.chunk_size!r}")
        if self.impl not in IMPLS:
            raise UserError(f"loss.impl: {self.impl!r} is not one of {', '.join(IMPLS)}")

    def fused_on(self, device: torch.device) -> bool:
        """Whether the fused head + loss runs on ``device`` (``impl`` resolved)."""
        return self.impl == "fused" or (self.impl == "auto" and torch.device(device).type == "cuda")


@dataclass(frozen=True)
class LogitHead:
    """What a model's own head does to its LM-head output x = hidden @ W.T + b before the loss: z = scale * x,
    then, with ``softcap`` c, z = c * tanh(z / c). The identity for most families."""

    scale: float = 1.0
    """Multiplies the logits: Cohere's ``logit_scale``; 1 / ``logits_scaling`` for Granite (HF divides by it)."""
    softcap: Optional[float] = None
    """Final logit soft-capping (``final_logit_softcapping``), or None."""

    def apply_(self, logits_CV: torch.Tensor) -> torch.Tensor:
        """The head's transform of one chunk of fp32 logits, in place."""
        if self.scale != 1.0:
            logits_CV.mul_(self.scale)
        if self.softcap is not None:
            logits_CV.div_(self.softcap).tanh_().mul_(self.softcap)
        return logits_CV

    def slope(self, logits_CV: torch.Tensor) -> Optional[torch.Tensor]:
        """dz / dx of soft-capping per element (scale * (1 - (z / c)^2)) from the transformed logits z, as a new
        buffer; None without soft-capping (the slope is then the scalar ``scale``, folded into a row factor)."""
        if self.softcap is None:
            return None
        return (logits_CV / self.softcap).square_().neg_().add_(1.0).mul_(self.scale)


IDENTITY = LogitHead()


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Per-token CE of head(hidden @ W.T + b) for the given rows; saves only hidden, W, b and the logsumexp per row."""

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, bias_V, labels_N, chunk_size, head=IDENTITY):
        num_rows = hidden_NH.shape[0]
        loss_N = torch.empty(num_rows, dtype=_loss_dtype(weight_VH.dtype), device=hidden_NH.device)
        lse_N = torch.empty_like(loss_N)
        for start in range(0, num_rows, chunk_size):
            end = min(start + chunk_size, num_rows)
            logits_CV, lse_C, target_C = _chunk_cross_entropy(hidden_NH[start:end], weight_VH, bias_V,
                                                              labels_N[start:end], head)
            loss_N[start:end] = lse_C - target_C
            lse_N[start:end] = lse_C
            del logits_CV
        ctx.save_for_backward(hidden_NH, weight_VH, bias_V, labels_N, lse_N)
        ctx.chunk_size = chunk_size
        ctx.head = head
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
        wide_dtype = _loss_dtype(weight_VH.dtype)
        sum_VH = (torch.zeros_like(weight_VH, dtype=wide_dtype)
                  if need_weight and num_chunks > 1 and weight_VH.dtype != wide_dtype else None)
        grad_bias_V = torch.zeros(weight_VH.shape[0], dtype=wide_dtype, device=weight_VH.device) if need_bias else None
        head = ctx.head
        # the head's scale is a factor of every row's gradient (soft-capping's slope is per element, below)
        grad_loss_N = grad_loss_N.to(wide_dtype) * (head.scale if head.softcap is None else 1.0)
        for start in range(0, hidden_NH.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden_NH.shape[0])
            # d loss / d logits = softmax - onehot(label), times the incoming gradient of each row's loss (and
            # the head's slope dz / dx: d loss / d x is what the matmul's gradients take).
            grad_logits_CV = _chunk_logits(hidden_NH[start:end], weight_VH, bias_V, head)
            slope_CV = head.slope(grad_logits_CV)
            grad_logits_CV.sub_(lse_N[start:end, None]).exp_()
            rows = torch.arange(end - start, device=grad_logits_CV.device)
            grad_logits_CV[rows, labels_N[start:end]] -= 1.0
            grad_logits_CV.mul_(grad_loss_N[start:end, None])
            if slope_CV is not None:
                grad_logits_CV.mul_(slope_CV)
                del slope_CV
            if need_bias:
                grad_bias_V += grad_logits_CV.sum(0)
            grad_logits_CV = grad_logits_CV.to(weight_VH.dtype)
            if need_hidden:
                grad_hidden_NH[start:end] = grad_logits_CV @ weight_VH
            if sum_VH is not None:
                _add_product_fp32(sum_VH, grad_logits_CV.t(), hidden_NH[start:end], grad_weight_VH)
            elif need_weight:
                grad_weight_VH.addmm_(grad_logits_CV.t(), hidden_NH[start:end])
            del grad_logits_CV
        if sum_VH is not None:
            grad_weight_VH.copy_(sum_VH)
        if need_bias:
            grad_bias_V = grad_bias_V.to(bias_V.dtype)
        return grad_hidden_NH, grad_weight_VH, grad_bias_V, None, None, None


# Devices where addmm adds a bf16/fp16 product into an fp32 matrix in the GEMM itself (out_dtype=float32: CUDA);
# switched off on the first call a torch refuses (a release whose kernel wants the added matrix in the inputs' dtype).
_FP32_OUT_ADDMM = {"cuda": True}


def _add_product_fp32(sum_VH, a_VC, b_CH, scratch_VH=None):
    """sum_VH (fp32) += a_VC @ b_CH (the weights' dtype), a chunk's d W into the sum over chunks. Where addmm can write
    fp32 from half inputs the product is accumulated and added in fp32 by the GEMM (no rounded copy, no extra pass
    over V x H); elsewhere it is rounded once into ``scratch_VH`` (made if None) and added. Returns the scratch."""
    device = sum_VH.device.type
    if _FP32_OUT_ADDMM.get(device):
        try:
            torch.addmm(sum_VH, a_VC, b_CH, out_dtype=sum_VH.dtype, out=sum_VH)
            return scratch_VH
        except (RuntimeError, NotImplementedError):  # no such kernel here: the rounded path, from now on
            _FP32_OUT_ADDMM[device] = False
    if scratch_VH is None:
        scratch_VH = torch.empty(sum_VH.shape, dtype=a_VC.dtype, device=sum_VH.device)
    torch.mm(a_VC, b_CH, out=scratch_VH)
    sum_VH += scratch_VH
    return scratch_VH


def _chunk_logits(hidden_CH, weight_VH, bias_V, head=IDENTITY):
    """The logits of one chunk in fp32 (float64 for float64 weights), the model's head transform applied; the matmul
    runs in the model's dtype as the HF LM head does."""
    logits_CV = hidden_CH @ weight_VH.t()
    if bias_V is not None:
        logits_CV = logits_CV + bias_V
    return head.apply_(logits_CV.to(_loss_dtype(weight_VH.dtype)))  # a new tensor: transformed in place


def _chunk_cross_entropy(hidden_CH, weight_VH, bias_V, labels_C, head=IDENTITY):
    """One chunk's (logits, log-sum-exp, target logit): its cross-entropy is lse - target."""
    logits_CV = _chunk_logits(hidden_CH, weight_VH, bias_V, head)
    return logits_CV, torch.logsumexp(logits_CV, dim=-1), logits_CV.gather(1, labels_C[:, None])[:, 0]


def _loss_dtype(dtype: torch.dtype) -> torch.dtype:
    """What the losses are computed in: fp32, or the weights' dtype if wider (float64 in exactness tests)."""
    return torch.promote_types(dtype, torch.float32)


class _FusedCrossEntropy(torch.autograd.Function):
    """sum_i w_i CE_i of head(hidden @ W.T + b) for the given rows, with its gradients made in forward (no recompute).

    Returns (the weighted sum, the per-row losses; the latter carries no gradient). Saves no input for backward,
    only the gradients: d hidden [N, H] in the hidden's dtype (what chunked saves instead is hidden itself), d W and
    d b. Per chunk: the logits in the model's dtype, one cast to fp32, their log-sum-exp, then d logits =
    w (softmax - onehot) as exp(logits - lse + log w), the exponential written in the weights' dtype (w (p - 1) at the
    target, from fp32, so every element is rounded once), and the two GEMMs of d hidden and d W. The head's scale s
    is folded into the weights (w s (p - onehot)); soft-capping's slope, per element, multiplies the fp32 gradient
    before its one rounding (one more chunk-sized fp32 buffer, for soft-capped models only)."""

    @staticmethod
    def forward(ctx, hidden_NH, weight_VH, bias_V, labels_N, weights_N, chunk_size, head=IDENTITY):
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        num_rows, dtype, wide_dtype = hidden_NH.shape[0], weight_VH.dtype, _loss_dtype(weight_VH.dtype)
        loss_N = torch.empty(num_rows, dtype=wide_dtype, device=hidden_NH.device)
        grad_hidden_NH = torch.empty_like(hidden_NH) if need_hidden else None
        # Several chunks of a bf16 weight: each chunk's d W (rounded once) is summed in an fp32 V x H buffer, as in
        # chunked's backward; it stays fp32 until backward has scaled it, then is rounded once more.
        wide = need_weight and num_rows > chunk_size and dtype != wide_dtype
        grad_weight_VH = (torch.zeros(weight_VH.shape, dtype=wide_dtype if wide else dtype,
                                      device=weight_VH.device) if need_weight else None)
        chunk_grad_VH = None  # the rounded product of a chunk, where it cannot go straight into the fp32 sum
        grad_bias_V = torch.zeros(weight_VH.shape[0], dtype=wide_dtype, device=weight_VH.device) if need_bias else None
        for start in range(0, num_rows, chunk_size):
            end = min(start + chunk_size, num_rows)
            logits_CV, lse_C, target_C = _chunk_cross_entropy(hidden_NH[start:end], weight_VH, bias_V,
                                                              labels_N[start:end], head)
            loss_N[start:end] = lse_C - target_C
            if not (need_hidden or need_weight or need_bias):
                continue
            slope_CV = head.slope(logits_CV)  # soft-capping: d z / d x per element, before z is overwritten
            # d loss / d x = w s (p - onehot): without soft-capping the head's scale s is a factor of the weight
            w_C = weights_N[start:end] * (head.scale if slope_CV is None else 1.0)
            # w softmax = exp(logits - lse + log w): the weight folded into the exponent (w >= 0; w = 0 gives 0).
            logits_CV.sub_((lse_C - w_C.log())[:, None])
            if dtype == wide_dtype or slope_CV is not None:
                grad_logits_CV = logits_CV.exp_()
            else:
                # fp32 math, rounded once on the store; a new buffer per chunk, so that none is held while the
                # next chunk's log-sum-exp has its temporaries
                grad_logits_CV = torch.exp(logits_CV, out=torch.empty(logits_CV.shape, dtype=dtype,
                                                                      device=logits_CV.device))
            rows = torch.arange(end - start, device=logits_CV.device)
            # the target's w (p - 1), from fp32 (expm1: exact as p -> 1), rounded once
            target_grad_C = w_C * torch.expm1(target_C - lse_C)
            if slope_CV is None:
                grad_logits_CV[rows, labels_N[start:end]] = target_grad_C.to(dtype)
            else:  # soft-capping's slope multiplies in fp32, then the one rounding to the weights' dtype
                grad_logits_CV[rows, labels_N[start:end]] = target_grad_C
                grad_logits_CV = grad_logits_CV.mul_(slope_CV).to(dtype)
                del slope_CV
            del logits_CV
            if need_bias:
                grad_bias_V += grad_logits_CV.sum(0, dtype=wide_dtype)
            if need_hidden:
                torch.mm(grad_logits_CV, weight_VH, out=grad_hidden_NH[start:end])
            if wide:
                chunk_grad_VH = _add_product_fp32(grad_weight_VH, grad_logits_CV.t(), hidden_NH[start:end],
                                                  chunk_grad_VH)
            elif need_weight:
                grad_weight_VH.addmm_(grad_logits_CV.t(), hidden_NH[start:end])
            del grad_logits_CV  # before the next chunk's logits exist
        del chunk_grad_VH
        ctx.grads = (grad_hidden_NH, grad_weight_VH, grad_bias_V)
        ctx.dtypes = (weight_VH.dtype, None if bias_V is None else bias_V.dtype)
        ctx.mark_non_differentiable(loss_N)
        return (loss_N * weights_N.to(wide_dtype)).sum(), loss_N

    @staticmethod
    def backward(ctx, grad_sum, grad_loss_N):
        """The stored gradients times the scalar upstream gradient g. A bf16 gradient that left forward already
        rounded (d hidden; d W of one chunk) is then exact when g is a power of two, as it is under DeepSpeed (bf16:
        loss scale 1; fp16: power-of-two scales) and the SP loss all-reduce (g = sp for the usual sp = 2^k); d W of
        several chunks and d b are scaled in fp32 and rounded once."""
        if ctx.grads is None:
            raise RuntimeError("the fused LM-head loss was back-propagated twice; its gradients were made once")
        grad_hidden_NH, grad_weight_VH, grad_bias_V = ctx.grads
        ctx.grads = None
        weight_dtype, bias_dtype = ctx.dtypes
        if grad_hidden_NH is not None:
            grad_hidden_NH.mul_(grad_sum)
        if grad_weight_VH is not None:
            grad_weight_VH = grad_weight_VH.mul_(grad_sum).to(weight_dtype)
        if grad_bias_V is not None:
            grad_bias_V = grad_bias_V.mul_(grad_sum).to(bias_dtype)
        return grad_hidden_NH, grad_weight_VH, grad_bias_V, None, None, None, None


def _trained_rows(shift_labels_T, num_rows):
    """Indices of the tokens with a label. ``num_rows`` (their count, known on the host): selected without a host
    sync (``nonzero_static``); None: ``nonzero``, which reads the count back from the device."""
    valid_T = shift_labels_T != IGNORE_INDEX
    if num_rows is None:
        return torch.nonzero(valid_T, as_tuple=False).flatten()
    return torch.nonzero_static(valid_T, size=int(num_rows)).flatten()


def _flat_inputs(hidden_TH, shift_labels_T, chunk_size):
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    hidden_TH = hidden_TH.reshape(-1, hidden_TH.shape[-1])
    shift_labels_T = shift_labels_T.reshape(-1)
    if hidden_TH.shape[0] != shift_labels_T.shape[0]:
        raise ValueError(f"hidden has {hidden_TH.shape[0]} tokens but shift_labels has {shift_labels_T.shape[0]}")
    return hidden_TH, shift_labels_T


def chunked_token_losses(hidden_TH, lm_head_weight_VH, shift_labels_T, chunk_size: int = 4096, lm_head_bias=None,
                         num_rows=None, logit_head: LogitHead = IDENTITY):
    """Per-token cross-entropy loss_T (fp32; float64 for float64 weights) of the LM head applied to hidden_TH; 0 where
    shift_labels is IGNORE_INDEX.

    Equals F.cross_entropy(head(hidden @ W.T + b), labels, reduction="none") with gradients to hidden, W and b
    (``logit_head``: the model's own transform of the logits, default none), but holds at most chunk_size x V logits
    at a time in forward and in backward (backward recomputes them). hidden_TH may also be [1, T, H] and
    shift_labels_T [1, T]; the result is always [T]. ``num_rows``: how many labels are not IGNORE_INDEX, if known (no
    host sync then; it must be exact).
    """
    hidden_TH, shift_labels_T = _flat_inputs(hidden_TH, shift_labels_T, chunk_size)
    # Prompt tokens (label IGNORE_INDEX) cost nothing: only the trained rows go through the LM head.
    rows_N = _trained_rows(shift_labels_T, num_rows)
    loss_N = _ChunkedCrossEntropy.apply(
        hidden_TH.index_select(0, rows_N), lm_head_weight_VH, lm_head_bias, shift_labels_T[rows_N].long(), chunk_size,
        logit_head)
    loss_T = torch.zeros(shift_labels_T.shape[0], dtype=loss_N.dtype, device=hidden_TH.device)
    return loss_T.index_put((rows_N,), loss_N)


def fused_token_losses(hidden_TH, lm_head_weight_VH, shift_labels_T, weights_T, chunk_size: int = 4096,
                       lm_head_bias=None, num_rows=None, logit_head: LogitHead = IDENTITY):
    """(sum_t weights_T[t] loss_t, loss_T): the weighted sum of the per-token cross-entropy of the LM head, with
    its gradients to hidden, W and b made in forward (``_FusedCrossEntropy``), and the per-token losses (as there, 0
    where shift_labels is IGNORE_INDEX, no gradient) for the statistics.

    The sum and its gradients equal those of ``(chunked_token_losses(...) * weights_T).sum()`` (tests/test_loss.py);
    only the sum may be back-propagated, once. weights_T: [T] or [1, T], >= 0 (``token_loss_weights``); tokens
    labelled IGNORE_INDEX are skipped whatever their weight. ``num_rows`` and ``logit_head`` as in
    ``chunked_token_losses``.
    """
    hidden_TH, shift_labels_T = _flat_inputs(hidden_TH, shift_labels_T, chunk_size)
    rows_N = _trained_rows(shift_labels_T, num_rows)
    weighted, loss_N = _FusedCrossEntropy.apply(
        hidden_TH.index_select(0, rows_N), lm_head_weight_VH, lm_head_bias, shift_labels_T[rows_N].long(),
        weights_T.reshape(-1)[rows_N], chunk_size, logit_head)
    loss_T = torch.zeros(shift_labels_T.shape[0], dtype=loss_N.dtype, device=hidden_TH.device)
    return weighted, loss_T.index_put((rows_N,), loss_N)


def token_loss_weights(
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
    """Per-token weights w_T (fp32 [T], 0 where the label is IGNORE_INDEX) of ONE micro-batch on ONE data-parallel
    rank: sum_t w_t loss_t is the scalar to call backward on (``normalize_loss``).

    Assumption about the engine (DeepSpeed's default): the step's gradient is
        grad = 1 / (dp_world_size * num_micro_batches) * sum over ranks and micro-batches of d(scalar)/d(params),
    i.e. DeepSpeed averages gradients over the dp_world_size ranks and `engine.backward` divides each micro-batch
    loss by gradient_accumulation_steps (= num_micro_batches). Pass num_micro_batches=1 if the engine does not
    divide (scale_wrt_gas=False), and dp_world_size=1 if it sums instead of averaging. The weights carry the factor
    dp_world_size * num_micro_batches that undoes this averaging, so that the gradient is that of:
        ave_token:   sum of all token losses of the step / global_loss_tokens (all replicas, all micro-batches)
        token_mean:  mean over dp ranks of (sum of the rank's token losses / rank_loss_tokens over its micro-batches)
        sample_mean: mean over the step's global_num_samples samples of (sample's loss sum / sample's loss tokens)
        sum:         sum of all token losses of the step
    Every token loss must be on exactly one rank's loss_T. Under sequence parallelism a sample is split over the
    ranks of its SP group: reducing the loss across that group is ulysses.py's job, and for sample_mean the
    collate step must pass sample_loss_tokens_T (per token: its whole sample's loss tokens), since counting them
    from this rank's slice would be wrong. Without it, the counts are taken from this micro-batch
    (sample_ids_T: per token, any id of its sample; samples must not span micro-batches; a host sync).
    rank_num_samples is only checked against global_num_samples (no normalizer needs it). No weight needs the
    losses, so the weights exist before the forward (the fused LM-head loss needs them there).
    """
    if mode not in NORMALIZERS:
        raise ValueError(f"loss normalizer {mode!r} is not one of {', '.join(NORMALIZERS)}")
    valid_T = shift_labels_T.reshape(-1) != IGNORE_INDEX
    undo_average = float(dp_world_size * num_micro_batches)
    if mode == "sum":
        scale = undo_average
    elif mode == "ave_token":
        _require_positive("global_loss_tokens", global_loss_tokens, mode)
        scale = undo_average / global_loss_tokens
    elif mode == "token_mean":
        # DeepSpeed's mean over ranks is already the mean the normalizer asks for: undo only the 1/num_micro_batches.
        _require_positive("rank_loss_tokens", rank_loss_tokens, mode)
        scale = num_micro_batches / rank_loss_tokens
    else:
        _require_positive("global_num_samples", global_num_samples, mode)
        if rank_num_samples is not None and rank_num_samples > global_num_samples:
            raise ValueError(f"rank_num_samples ({rank_num_samples}) exceeds global_num_samples ({global_num_samples})")
        if sample_loss_tokens_T is None:
            _, inverse_T = torch.unique(sample_ids_T.reshape(-1), return_inverse=True)
            counts_S = torch.zeros(int(inverse_T.max()) + 1 if inverse_T.numel() else 0, device=valid_T.device)
            counts_S.index_add_(0, inverse_T, valid_T.float())
            sample_loss_tokens_T = counts_S[inverse_T]
        per_sample_T = 1.0 / sample_loss_tokens_T.reshape(-1).float().clamp(min=1)
        return torch.where(valid_T, per_sample_T * (undo_average / global_num_samples), 0.0)
    return torch.where(valid_T, scale, 0.0).float()


def normalize_loss(loss_T, shift_labels_T, sample_ids_T, mode, **counts):
    """The scalar to call backward on for ONE micro-batch on ONE data-parallel rank: sum_t w_t loss_t with the
    weights of ``token_loss_weights`` (same arguments; see there for what the step's gradient then is). Losses at
    IGNORE_INDEX labels are left out whatever they hold."""
    weights_T = token_loss_weights(shift_labels_T, sample_ids_T, mode, **counts)
    loss_T = loss_T.reshape(-1)
    valid_T = shift_labels_T.reshape(-1) != IGNORE_INDEX
    return torch.where(valid_T, loss_T * weights_T, torch.zeros_like(loss_T)).sum()


def _require_positive(name, value, mode):
    if value is None or value <= 0:
        raise ValueError(f"normalizer {mode!r} needs {name} > 0, got {value!r}")
