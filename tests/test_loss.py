"""Chunked LM-head loss equals full-logits cross-entropy without T x V memory; normalizers match their formulas."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hbp_train.common.errors import UserError
from hbp_train.common.labels import IGNORE_INDEX
from hbp_train.model.loss import (NORMALIZERS, LogitHead, LossConfig, chunked_token_losses, fused_token_losses,
                                  normalize_loss, token_loss_weights)


def _problem(num_tokens=37, hidden=16, vocab=50, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    hidden_TH = torch.randn(num_tokens, hidden, generator=gen).to(dtype).requires_grad_()
    weight_VH = (torch.randn(vocab, hidden, generator=gen) * 0.3).to(dtype).requires_grad_()
    bias_V = torch.randn(vocab, generator=gen).to(dtype).requires_grad_()
    labels_T = torch.randint(0, vocab, (num_tokens,), generator=gen)
    labels_T[torch.rand(num_tokens, generator=gen) < 0.3] = IGNORE_INDEX
    labels_T[-1] = IGNORE_INDEX
    return hidden_TH, weight_VH, bias_V, labels_T


@pytest.mark.parametrize("chunk_size", [1, 5, 16, 37, 4096])
@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_losses_and_grads_equal_full_cross_entropy(chunk_size, with_bias):
    hidden_TH, weight_VH, bias_V, labels_T = _problem()
    bias = bias_V if with_bias else None
    loss_T = chunked_token_losses(hidden_TH, weight_VH, labels_T, chunk_size=chunk_size, lm_head_bias=bias)
    ref_T = F.cross_entropy(F.linear(hidden_TH, weight_VH, bias), labels_T, reduction="none")
    torch.testing.assert_close(loss_T, ref_T, atol=1e-5, rtol=1e-5)
    assert (loss_T[labels_T == IGNORE_INDEX] == 0).all()
    # a non-uniform upstream gradient, as normalize_loss produces for sample_mean
    weights_T = torch.linspace(0.5, 2.0, labels_T.numel())
    inputs = (hidden_TH, weight_VH, bias_V) if with_bias else (hidden_TH, weight_VH)
    grads = torch.autograd.grad((loss_T * weights_T).sum(), inputs)
    ref_grads = torch.autograd.grad((ref_T * weights_T).sum(), inputs)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_chunked_losses_accept_batched_shapes_and_all_ignored_labels():
    hidden_TH, weight_VH, _, labels_T = _problem()
    loss_T = chunked_token_losses(hidden_TH[None], weight_VH, labels_T[None], chunk_size=8)
    assert loss_T.shape == labels_T.shape
    ignored_T = torch.full_like(labels_T, IGNORE_INDEX)
    loss_T = chunked_token_losses(hidden_TH, weight_VH, ignored_T, chunk_size=8)
    assert (loss_T == 0).all()
    grad_hidden, grad_weight = torch.autograd.grad(loss_T.sum(), (hidden_TH, weight_VH))
    assert (grad_hidden == 0).all() and (grad_weight == 0).all()


def test_chunked_losses_bf16_close_to_hf_style_upcast_loss():
    hidden_TH, weight_VH, _, labels_T = _problem(dtype=torch.bfloat16)
    loss_T = chunked_token_losses(hidden_TH, weight_VH, labels_T, chunk_size=8)
    assert loss_T.dtype == torch.float32
    ref_T = F.cross_entropy((hidden_TH @ weight_VH.t()).float(), labels_T, reduction="none")
    torch.testing.assert_close(loss_T, ref_T, atol=1e-4, rtol=1e-4)
    grad, = torch.autograd.grad(loss_T.sum(), hidden_TH)
    ref_grad, = torch.autograd.grad(ref_T.sum(), hidden_TH)
    torch.testing.assert_close(grad.float(), ref_grad.float(), atol=2e-2, rtol=2e-2)


def test_bf16_lm_head_weight_gradient_is_as_accurate_in_many_chunks_as_in_one():
    """The LM-head weight gradient of a bf16 head summed over 64 chunks is as close to the float64 gradient as the
    one-chunk result (one bf16 rounding of the whole product): the chunks are summed in fp32. A bf16 running sum
    (what it did before) rounds at every chunk and came out ~3x further off here."""
    torch.manual_seed(0)
    hidden_NH = torch.randn(2048, 64).bfloat16()
    weight_VH = (torch.randn(512, 64) * 0.05).bfloat16().requires_grad_()
    labels_N = torch.randint(0, 512, (2048,))
    exact_VH = weight_VH.detach().double().requires_grad_()
    F.cross_entropy(hidden_NH.double() @ exact_VH.t(), labels_N, reduction="sum").backward()

    def error(chunk_size):
        grad_VH, = torch.autograd.grad(chunked_token_losses(hidden_NH, weight_VH, labels_N, chunk_size).sum(),
                                       weight_VH)
        assert grad_VH.dtype == torch.bfloat16
        return float((grad_VH.double() - exact_VH.grad).norm() / exact_VH.grad.norm())

    one_chunk, many_chunks = error(2048), error(32)
    assert many_chunks <= 1.5 * one_chunk, (one_chunk, many_chunks)


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any aten op produces (forward and backward run under the mode)."""

    def __init__(self):
        super().__init__()
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor):
                self.max_numel = max(self.max_numel, tensor.numel())
        return out


@pytest.mark.parametrize("num_tokens", [1024, 4096])
def test_no_tensor_grows_with_tokens_times_vocab(num_tokens):
    vocab, hidden, chunk = 1000, 8, 128
    hidden_TH, weight_VH, _, labels_T = _problem(num_tokens=num_tokens, hidden=hidden, vocab=vocab)
    with _LargestTensor() as mode:
        loss_T = chunked_token_losses(hidden_TH, weight_VH, labels_T, chunk_size=chunk)
        loss_T.sum().backward()
    # the biggest tensors are one chunk of logits, the weight (and its grad), or the hidden states: never T x V
    assert mode.max_numel == max(chunk * vocab, vocab * hidden, num_tokens * hidden)
    assert mode.max_numel <= num_tokens * vocab / 8


# ------------------------------------------------------------------------------------------------ normalizers
def _step(seed=0, dp_world_size=2, num_micro_batches=3):
    """One optimizer step: per rank, per micro-batch (loss_T leaf, shift_labels_T, sample_ids_T)."""
    gen = torch.Generator().manual_seed(seed)
    step = []
    for _ in range(dp_world_size):
        micro_batches = []
        for _ in range(num_micro_batches):
            lengths = torch.randint(2, 9, (int(torch.randint(1, 4, (1,), generator=gen)),), generator=gen).tolist()
            sample_ids_T = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
            labels_T = torch.randint(0, 100, (sum(lengths),), generator=gen)
            labels_T[torch.rand(sum(lengths), generator=gen) < 0.3] = IGNORE_INDEX
            ends = torch.tensor(lengths).cumsum(0) - 1
            labels_T[ends] = IGNORE_INDEX  # a sample's last token predicts nothing
            labels_T[ends - 1] = 7  # ... and each sample keeps at least one loss token
            loss_T = (torch.rand(sum(lengths), generator=gen) * 5).requires_grad_()
            micro_batches.append((loss_T, labels_T, sample_ids_T))
        step.append(micro_batches)
    return step


def _direct_objective(step, mode):
    """The normalizer's definition, computed straight from the token losses of the whole step."""
    valid = lambda labels: labels != IGNORE_INDEX  # noqa: E731
    if mode == "sum":
        return sum(loss[valid(lab)].sum() for rank in step for loss, lab, _ in rank)
    if mode == "ave_token":
        total = sum(loss[valid(lab)].sum() for rank in step for loss, lab, _ in rank)
        return total / sum(int(valid(lab).sum()) for rank in step for _, lab, _ in rank)
    if mode == "token_mean":
        per_rank = [
            sum(loss[valid(lab)].sum() for loss, lab, _ in rank) / sum(int(valid(lab).sum()) for _, lab, _ in rank)
            for rank in step
        ]
        return sum(per_rank) / len(step)
    sample_means = [
        loss[(ids == s) & valid(lab)].mean()
        for rank in step for loss, lab, ids in rank for s in ids.unique().tolist()
    ]
    return sum(sample_means) / len(sample_means)


def _engine_objective(step, mode):
    """What DeepSpeed's gradient corresponds to: mean over ranks and micro-batches of the returned scalars."""
    dp_world_size, num_micro_batches = len(step), len(step[0])
    global_loss_tokens = sum(int((lab != IGNORE_INDEX).sum()) for rank in step for _, lab, _ in rank)
    global_num_samples = sum(int(ids.unique().numel()) for rank in step for _, _, ids in rank)
    total = 0.0
    for rank in step:
        rank_loss_tokens = sum(int((lab != IGNORE_INDEX).sum()) for _, lab, _ in rank)
        for loss_T, labels_T, sample_ids_T in rank:
            total = total + normalize_loss(
                loss_T, labels_T, sample_ids_T, mode,
                global_loss_tokens=global_loss_tokens, rank_loss_tokens=rank_loss_tokens,
                global_num_samples=global_num_samples, dp_world_size=dp_world_size,
                num_micro_batches=num_micro_batches,
            )
    return total / (dp_world_size * num_micro_batches)


@pytest.mark.parametrize("mode", NORMALIZERS)
def test_normalizer_gradient_after_engine_averaging_equals_definition(mode):
    step = _step()
    leaves = [loss for rank in step for loss, _, _ in rank]
    engine, direct = _engine_objective(step, mode), _direct_objective(step, mode)
    torch.testing.assert_close(engine, direct)
    for got, want in zip(torch.autograd.grad(engine, leaves), torch.autograd.grad(direct, leaves)):
        torch.testing.assert_close(got, want)


def test_sample_mean_with_sample_token_counts_splits_like_sequence_parallel():
    """Two SP slices of one pack, given whole-sample counts, add up to the unsplit micro-batch's loss."""
    (loss_T, labels_T, sample_ids_T), = _step(seed=3, dp_world_size=1, num_micro_batches=1)[0]
    whole = normalize_loss(loss_T, labels_T, sample_ids_T, "sample_mean", global_num_samples=5)
    counts_T = torch.stack([((sample_ids_T == s) & (labels_T != IGNORE_INDEX)).sum() for s in sample_ids_T.tolist()])
    cut = labels_T.numel() // 2
    halves = [
        normalize_loss(loss_T[part], labels_T[part], sample_ids_T[part], "sample_mean", global_num_samples=5,
                       sample_loss_tokens_T=counts_T[part])
        for part in (slice(0, cut), slice(cut, None))
    ]
    torch.testing.assert_close(halves[0] + halves[1], whole)


@pytest.mark.parametrize(
    "mode, kwargs, match",
    [
        ("mean", {}, "'mean'"),
        ("ave_token", {}, "global_loss_tokens"),
        ("token_mean", {"rank_loss_tokens": 0}, "rank_loss_tokens"),
        ("sample_mean", {}, "global_num_samples"),
        ("sample_mean", {"global_num_samples": 2, "rank_num_samples": 3}, "rank_num_samples"),
    ],
)
def test_normalize_loss_errors(mode, kwargs, match):
    loss_T = torch.ones(3)
    with pytest.raises(ValueError, match=match):
        normalize_loss(loss_T, torch.zeros(3, dtype=torch.long), torch.zeros(3, dtype=torch.long), mode, **kwargs)


def test_loss_config_validation():
    assert LossConfig().normalizer == "ave_token" and LossConfig().chunk_size == 4096
    with pytest.raises(UserError, match="loss.normalizer"):
        LossConfig(normalizer="mean")
    with pytest.raises(UserError, match="loss.chunk_size"):
        LossConfig(chunk_size=0)


# ------------------------------------------------------------------------------------------- the fused loss
def _weights(labels_T, mode, seed=0):
    """The normalizer's per-token weights for one micro-batch of 3-ish samples (as the trainer passes them)."""
    gen = torch.Generator().manual_seed(seed)
    sample_ids_T = torch.sort(torch.randint(0, 4, labels_T.shape, generator=gen)).values
    counts_T = torch.stack([((sample_ids_T == s) & (labels_T != IGNORE_INDEX)).sum() for s in sample_ids_T.tolist()])
    return token_loss_weights(labels_T, sample_ids_T, mode, global_loss_tokens=91, rank_loss_tokens=40,
                              global_num_samples=7, dp_world_size=2, sample_loss_tokens_T=counts_T)


def _reference(hidden_TH, weight_VH, bias_V, labels_T, weights_T):
    """Full-logits cross-entropy (F.cross_entropy), weighted."""
    loss_T = F.cross_entropy(F.linear(hidden_TH, weight_VH, bias_V), labels_T, reduction="none")
    return (loss_T * weights_T).sum(), loss_T


@pytest.mark.parametrize("mode", NORMALIZERS)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("chunk_size", [1, 5, 16, 37, 4096])
@pytest.mark.parametrize("with_bias", [False, True])
def test_fused_loss_and_gradients_equal_full_cross_entropy(mode, dtype, tol, chunk_size, with_bias):
    """Every normalizer's weighted sum, per-token losses and gradients of hidden, W and b against F.cross_entropy on
    the full logits: chunk boundaries anywhere (1 token, not dividing N, one chunk), ignored labels skipped, and an
    upstream gradient that is not 1 (SP's all-reduce and DeepSpeed's loss scale multiply it)."""
    hidden_TH, weight_VH, bias_V, labels_T = _problem(dtype=dtype)
    bias = bias_V if with_bias else None
    weights_T = _weights(labels_T, mode).to(dtype)
    total, loss_T = fused_token_losses(hidden_TH, weight_VH, labels_T, weights_T, chunk_size, lm_head_bias=bias)
    ref_total, ref_T = _reference(hidden_TH, weight_VH, bias, labels_T, weights_T)
    torch.testing.assert_close(total.double(), ref_total.double(), atol=tol, rtol=tol)
    torch.testing.assert_close(loss_T.double(), torch.where(labels_T == IGNORE_INDEX, 0, ref_T).double(),
                               atol=tol, rtol=tol)
    assert not loss_T.requires_grad  # statistics only: the gradient goes through the weighted sum
    inputs = (hidden_TH, weight_VH, bias_V) if with_bias else (hidden_TH, weight_VH)
    grads = torch.autograd.grad(3.0 * total, inputs)
    ref_grads = torch.autograd.grad(3.0 * ref_total, inputs)
    for got, want in zip(grads, ref_grads):
        assert got.dtype == want.dtype
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


HEADS = {"granite": LogitHead(scale=1 / 16), "cohere": LogitHead(scale=0.0625), "scale 3": LogitHead(scale=3.0),
         "softcap": LogitHead(softcap=1.5), "scale + softcap": LogitHead(scale=0.5, softcap=2.0)}


def _head_reference(hidden_TH, weight_VH, bias_V, labels_T, head):
    """HF's order: logits = head(hidden @ W.T + b) (logits / logits_scaling, logits * logit_scale, then c tanh(z / c))
    and F.cross_entropy on the full logits, by autograd."""
    logits_TV = F.linear(hidden_TH, weight_VH, bias_V) * head.scale
    if head.softcap is not None:
        logits_TV = torch.tanh(logits_TV / head.softcap) * head.softcap
    return F.cross_entropy(logits_TV, labels_T, reduction="none")


@pytest.mark.parametrize("head", HEADS.values(), ids=HEADS.keys())
@pytest.mark.parametrize("impl", ["chunked", "fused"])
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 2e-6), (torch.float64, 1e-12)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_the_models_logit_transform_is_exact_in_both_paths(head, impl, dtype, tol, with_bias):
    """A scale of the logits and soft-capping, as the model's own head applies them: per-token losses, the weighted
    sum and its gradients of hidden, W and b equal autograd on the full transformed logits, over several chunks
    (the logits span a few units, so a cap of 1.5 bites)."""
    hidden_TH, weight_VH, bias_V, labels_T = _problem(dtype=dtype)
    bias = bias_V if with_bias else None
    weights_T = _weights(labels_T, "sample_mean").to(dtype)
    if impl == "fused":
        total, loss_T = fused_token_losses(hidden_TH, weight_VH, labels_T, weights_T, 16, lm_head_bias=bias,
                                           logit_head=head)
    else:
        loss_T = chunked_token_losses(hidden_TH, weight_VH, labels_T, 16, lm_head_bias=bias, logit_head=head)
        total = (loss_T * weights_T).sum()
    ref_T = _head_reference(hidden_TH, weight_VH, bias, labels_T, head)
    ref_total = (ref_T * weights_T).sum()
    torch.testing.assert_close(loss_T.double(), torch.where(labels_T == IGNORE_INDEX, 0, ref_T).double(),
                               atol=tol, rtol=tol)
    torch.testing.assert_close(total.double(), ref_total.double(), atol=tol, rtol=tol)
    plain_T = chunked_token_losses(hidden_TH, weight_VH, labels_T, 16, lm_head_bias=bias)
    assert (plain_T - loss_T).abs().max() > 1e-2  # the transform matters on this problem
    inputs = (hidden_TH, weight_VH, bias_V) if with_bias else (hidden_TH, weight_VH)
    for got, want in zip(torch.autograd.grad(2.0 * total, inputs), torch.autograd.grad(2.0 * ref_total, inputs)):
        torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("head", [HEADS["granite"], HEADS["scale + softcap"]], ids=["granite", "scale + softcap"])
def test_the_logit_transform_in_bf16_fused_equals_chunked(head):
    """bf16 weights with the head's transform: fused against chunked (the reference path of the same precision)."""
    hidden_TH, weight_VH, bias_V, labels_T = _problem(num_tokens=300, hidden=32, vocab=97, dtype=torch.bfloat16)
    weights_T = _weights(labels_T, "sample_mean")
    inputs = (hidden_TH, weight_VH, bias_V)
    total, _ = fused_token_losses(hidden_TH, weight_VH, labels_T, weights_T, 64, lm_head_bias=bias_V,
                                  logit_head=head)
    ref_total = (chunked_token_losses(hidden_TH, weight_VH, labels_T, 64, lm_head_bias=bias_V, logit_head=head)
                 * weights_T).sum()
    torch.testing.assert_close(total, ref_total, atol=1e-5, rtol=1e-5)
    for got, want in zip(torch.autograd.grad(total, inputs), torch.autograd.grad(ref_total, inputs)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2 * float(want.abs().max()), rtol=2e-2)


def test_fused_loss_equals_chunked_loss_times_weights_in_bf16():
    """bf16 weights: the fused sum and its gradients against the chunked path's weighted losses (the reference path
    of the same precision) within bf16 rounding; the gradients come back in bf16."""
    hidden_TH, weight_VH, bias_V, labels_T = _problem(num_tokens=300, hidden=32, vocab=97, dtype=torch.bfloat16)
    weights_T = _weights(labels_T, "sample_mean")
    inputs = (hidden_TH, weight_VH, bias_V)
    total, _ = fused_token_losses(hidden_TH, weight_VH, labels_T, weights_T, 64, lm_head_bias=bias_V)
    ref_total = (chunked_token_losses(hidden_TH, weight_VH, labels_T, 64, lm_head_bias=bias_V) * weights_T).sum()
    torch.testing.assert_close(total, ref_total, atol=1e-5, rtol=1e-5)
    for got, want in zip(torch.autograd.grad(total, inputs), torch.autograd.grad(ref_total, inputs)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2 * float(want.abs().max()), rtol=2e-2)


def test_fused_bf16_weight_gradient_is_as_accurate_in_many_chunks_as_in_one():
    """As for the chunked path: a bf16 LM head's weight gradient over 64 chunks is summed in fp32 (held so until
    backward has scaled it), as close to the float64 gradient as the one-chunk result."""
    torch.manual_seed(0)
    hidden_NH = torch.randn(2048, 64).bfloat16()
    weight_VH = (torch.randn(512, 64) * 0.05).bfloat16().requires_grad_()
    labels_N = torch.randint(0, 512, (2048,))
    exact_VH = weight_VH.detach().double().requires_grad_()
    F.cross_entropy(hidden_NH.double() @ exact_VH.t(), labels_N, reduction="sum").backward()

    def error(chunk_size):
        total, _ = fused_token_losses(hidden_NH, weight_VH, labels_N, torch.ones(2048), chunk_size)
        grad_VH, = torch.autograd.grad(total, weight_VH)
        assert grad_VH.dtype == torch.bfloat16
        return float((grad_VH.double() - exact_VH.grad).norm() / exact_VH.grad.norm())

    one_chunk, many_chunks = error(2048), error(32)
    assert many_chunks <= 1.5 * one_chunk, (one_chunk, many_chunks)


class _OpLog(TorchDispatchMode):
    """Every aten op run under the mode, with the shapes of its tensor arguments."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        shapes = [tuple(a.shape) for a in args if isinstance(a, torch.Tensor)]
        self.ops.append((func, shapes))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("head", [LogitHead(), HEADS["scale + softcap"]], ids=["plain", "scale + softcap"])
@pytest.mark.parametrize("impl, gemms", [("chunked", 4), ("fused", 3)])
def test_fused_loss_makes_three_gemm_passes_over_the_logits_and_no_host_sync(impl, gemms, head):
    """Per chunk the fused path runs three GEMMs that touch the vocabulary (logits, d hidden, d W), the chunked one
    four (the logits again in backward). Given the trained-token count, neither reads a value back to the host
    (aten._local_scalar_dense, what .item() / int() / nonzero's count run) in forward or backward; the model's logit
    transform (a scale, soft-capping) adds neither."""
    vocab, chunk = 50, 8
    hidden_TH, weight_VH, _, labels_T = _problem(num_tokens=40, hidden=16, vocab=vocab)
    num_rows = int((labels_T != IGNORE_INDEX).sum())
    weights_T = _weights(labels_T, "ave_token")
    with _OpLog() as log:
        if impl == "fused":
            total, _ = fused_token_losses(hidden_TH, weight_VH, labels_T, weights_T, chunk, num_rows=num_rows,
                                          logit_head=head)
        else:
            total = (chunked_token_losses(hidden_TH, weight_VH, labels_T, chunk, num_rows=num_rows,
                                          logit_head=head) * weights_T).sum()
        total.backward()
    names = [func.__name__ for func, _ in log.ops]
    assert not [n for n in names if n.startswith(("_local_scalar_dense", "nonzero.")) or n == "item"], names
    vocab_gemms = [shapes for func, shapes in log.ops if func.__name__.split(".")[0] in ("mm", "addmm", "addmm_")
                   and any(vocab in s for s in shapes)]
    assert len(vocab_gemms) == gemms * -(-num_rows // chunk)


@pytest.mark.parametrize("num_tokens", [1024, 4096])
def test_fused_loss_holds_no_tensor_of_tokens_times_vocab(num_tokens):
    vocab, hidden, chunk = 1000, 8, 128
    hidden_TH, weight_VH, _, labels_T = _problem(num_tokens=num_tokens, hidden=hidden, vocab=vocab)
    with _LargestTensor() as mode:
        total, _ = fused_token_losses(hidden_TH, weight_VH, labels_T, torch.ones(num_tokens), chunk)
        total.backward()
    assert mode.max_numel == max(chunk * vocab, vocab * hidden, num_tokens * hidden)


def test_fused_loss_edge_cases():
    """All labels ignored: sum 0 and zero gradients; a given trained-token count selects the same rows as counting
    them; a second backward through the stored gradients is refused."""
    hidden_TH, weight_VH, _, labels_T = _problem()
    ignored_T = torch.full_like(labels_T, IGNORE_INDEX)
    total, loss_T = fused_token_losses(hidden_TH, weight_VH, ignored_T, torch.ones(37), 8, num_rows=0)
    grad_hidden, grad_weight = torch.autograd.grad(total, (hidden_TH, weight_VH))
    assert float(total.detach()) == 0 and (loss_T == 0).all() and (grad_hidden == 0).all() and (grad_weight == 0).all()
    weights_T = _weights(labels_T, "sum")
    counted, _ = fused_token_losses(hidden_TH, weight_VH, labels_T, weights_T, 8)
    given, _ = fused_token_losses(hidden_TH, weight_VH, labels_T, weights_T, 8,
                                  num_rows=int((labels_T != IGNORE_INDEX).sum()))
    assert torch.equal(counted, given)
    given.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="twice"):
        given.backward()


def test_token_loss_weights_are_the_normalizers():
    """normalize_loss is the weighted sum with token_loss_weights, which vanish at ignored labels, and LossConfig
    checks loss.impl."""
    (loss_T, labels_T, sample_ids_T), = _step(seed=5, dp_world_size=1, num_micro_batches=1)[0]
    for mode in NORMALIZERS:
        counts = dict(global_loss_tokens=9, rank_loss_tokens=4, global_num_samples=3, dp_world_size=2)
        weights_T = token_loss_weights(labels_T, sample_ids_T, mode, **counts)
        assert (weights_T[labels_T == IGNORE_INDEX] == 0).all() and (weights_T[labels_T != IGNORE_INDEX] > 0).all()
        torch.testing.assert_close(normalize_loss(loss_T, labels_T, sample_ids_T, mode, **counts),
                                   (loss_T * weights_T).sum())
    assert LossConfig().impl == "auto" and not LossConfig().fused_on("cpu") and LossConfig().fused_on("cuda")
    assert LossConfig(impl="fused").fused_on("cpu") and not LossConfig(impl="chunked").fused_on("cuda")
    with pytest.raises(UserError, match="loss.impl"):
        LossConfig(impl="liger")


@pytest.mark.gpu
@pytest.mark.parametrize("head", [LogitHead(), HEADS["granite"], HEADS["scale + softcap"]],
                         ids=["plain", "granite", "scale + softcap"])
@pytest.mark.parametrize("impl", ["fused", "chunked"])
def test_gpu_loss_forward_and_backward_never_synchronise(impl, head):
    """On a GPU, with the trained-token count given (as the trainer gives it), neither head + loss synchronises the
    host with the device (CUDA's sync debug mode raises on any op that would), and the fused sum and gradients are
    the chunked path's within bf16 rounding, with the model's logit transform too."""
    cuda = torch.device("cuda")
    hidden_TH, weight_VH, _, labels_T = (x.detach().to(cuda) for x in _problem(
        num_tokens=3000, hidden=64, vocab=5000, dtype=torch.bfloat16))
    hidden_TH.requires_grad_()
    weight_VH.requires_grad_()
    num_rows = int((labels_T != IGNORE_INDEX).sum())
    weights_T = _weights(labels_T.cpu(), "sample_mean").to(cuda)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        if impl == "fused":
            total, _ = fused_token_losses(hidden_TH, weight_VH, labels_T, weights_T, 512, num_rows=num_rows,
                                          logit_head=head)
        else:
            total = (chunked_token_losses(hidden_TH, weight_VH, labels_T, 512, num_rows=num_rows,
                                          logit_head=head) * weights_T).sum()
        grads = torch.autograd.grad(total, (hidden_TH, weight_VH))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    reference = (chunked_token_losses(hidden_TH, weight_VH, labels_T, 512, logit_head=head) * weights_T).sum()
    torch.testing.assert_close(total, reference, atol=1e-4, rtol=1e-4)
    for got, want in zip(grads, torch.autograd.grad(reference, (hidden_TH, weight_VH))):
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2 * float(want.abs().max()), rtol=2e-2)


class _WrittenOps(TorchDispatchMode):
    """Every aten op run under it, with the shapes and dtypes of what it wrote (its outputs)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        self.ops.append((str(func), [(tuple(t.shape), t.dtype) for t in outs if isinstance(t, torch.Tensor)]))
        return out


def _bf16_head_grads(device, vocab=64, hidden=16, tokens=256, chunk=64):
    """d W of the fused and of the chunked loss, a bf16 head over tokens / chunk chunks, on ``device``."""
    gen = torch.Generator().manual_seed(0)
    hidden_NH = torch.randn(tokens, hidden, generator=gen).to(device, torch.bfloat16)
    weight_VH = (0.05 * torch.randn(vocab, hidden, generator=gen)).to(device, torch.bfloat16).requires_grad_()
    labels_N = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    weighted, _ = fused_token_losses(hidden_NH, weight_VH, labels_N, torch.ones(tokens, device=device), chunk,
                                     num_rows=tokens)
    fused, = torch.autograd.grad(weighted, weight_VH)
    chunked, = torch.autograd.grad(chunked_token_losses(hidden_NH, weight_VH, labels_N, chunk, num_rows=tokens).sum(),
                                   weight_VH)
    return fused, chunked


def test_on_cuda_each_chunks_weight_gradient_is_added_to_the_fp32_sum_by_its_gemm(monkeypatch):
    """A bf16 head over several chunks: on CUDA each chunk's d W goes into the fp32 sum through addmm with
    out_dtype=float32 (the GEMM adds it in fp32), not written rounded to bf16 and added in a second pass over V x H.
    Run on meta tensors (torch's meta kernels check every shape and dtype) with the CUDA path enabled for them."""
    from hbp_train.model import loss

    monkeypatch.setitem(loss._FP32_OUT_ADDMM, "meta", True)
    vocab, hidden, chunks = 64, 16, 4
    with torch.device("meta"), _WrittenOps() as log:
        fused, chunked = _bf16_head_grads("meta", vocab, hidden, tokens=64 * chunks)
    assert fused.dtype == chunked.dtype == torch.bfloat16
    into_sum = [op for op, outs in log.ops if op.startswith("aten.addmm.dtype") and outs == [((vocab, hidden),
                                                                                            torch.float32)]]
    assert len(into_sum) == 2 * chunks  # every chunk of both losses
    rounded = [op for op, outs in log.ops if op.startswith("aten.mm") and outs == [((vocab, hidden), torch.bfloat16)]]
    assert not rounded


def test_a_torch_that_cannot_add_into_fp32_falls_back_to_the_same_gradient(monkeypatch):
    """Where addmm with out_dtype is refused (the CPU has no kernel for it; some torch releases want the added
    matrix in the inputs' dtype), the first chunk falls back to the rounded product and the fp32 sum, for good,
    and the gradient is the one that path always gave."""
    from hbp_train.model import loss

    expected = _bf16_head_grads("cpu")
    monkeypatch.setitem(loss._FP32_OUT_ADDMM, "cpu", True)
    got = _bf16_head_grads("cpu")
    assert loss._FP32_OUT_ADDMM["cpu"] is False
    for want, have in zip(expected, got):
        assert torch.equal(want, have)


@pytest.mark.gpu
def test_gpu_weight_gradient_summed_by_the_gemm_matches_float64():
    """On a GPU the chunks' d W go into the fp32 sum through addmm(out_dtype=float32, out=the sum): the result must
    be the float64 gradient within one bf16 rounding, for both losses, and the path must have been taken (a torch
    that refused it falls back, which the flag records)."""
    from hbp_train.model import loss

    cuda = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    hidden_NH = torch.randn(4096, 64, generator=gen).bfloat16().to(cuda)
    weight_VH = (0.05 * torch.randn(512, 64, generator=gen)).bfloat16().to(cuda).requires_grad_()
    labels_N = torch.randint(0, 512, (4096,), generator=gen).to(cuda)
    exact_VH = weight_VH.detach().double().requires_grad_()
    F.cross_entropy(hidden_NH.double() @ exact_VH.t(), labels_N, reduction="sum").backward()
    weighted, _ = fused_token_losses(hidden_NH, weight_VH, labels_N, torch.ones(4096, device=cuda), 256,
                                     num_rows=4096)
    chunked = chunked_token_losses(hidden_NH, weight_VH, labels_N, 256, num_rows=4096).sum()
    for total in (weighted, chunked):
        grad_VH, = torch.autograd.grad(total, weight_VH)
        assert float((grad_VH.double() - exact_VH.grad).norm() / exact_VH.grad.norm()) < 1e-2
    assert loss._FP32_OUT_ADDMM["cuda"], "this torch refused addmm(out_dtype=float32): the rounded path ran"
