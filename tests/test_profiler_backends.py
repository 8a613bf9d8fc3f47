"""Tests for hbp_train/profiler/backends.py and gpu_backend.py: the GPU back-end's real fwd+bwd path on a tiny CPU model (times and
autograd-saved memory), its SP estimate, OOM handling, and the synthetic packs (document lengths, per-rank slices)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hbp_train.common.errors import UserError
from hbp_train.common.labels import IGNORE_INDEX
from hbp_train.perf.memory import JobSettings, model_state_bytes
from hbp_train.perf.shape import model_shape_of
from hbp_train.profiler.gpu_backend import GpuBackend
from hbp_train.profiler.packs import load_doc_lengths, slice_docs, synthetic_docs
from tests.profiler_curves import TINY, cfg


def test_measurement_code_path_on_a_tiny_cpu_model():
    """GpuBackend's real fwd+bwd path (model.py, loss.py, checkpointing, SP estimate) on the CPU: times only."""
    from hbp_train.perf.cost_model import CostModel
    from hbp_train.model.hf_model import ModelConfig, num_params

    model_cfg = ModelConfig(config=dict(TINY), dtype="fp32", attention_backend="sdpa_block")
    shape = model_shape_of(model_cfg, None)
    c = cfg(max_len=512, min_len=128, world_size=2, warmup_iters=0, iters=1)
    b = GpuBackend(model_cfg, c, CostModel.from_calibration(model_shape=shape), JobSettings(),
                        device="cpu")
    assert num_params(b.model) == shape.num_params, "the analytic parameter count must match the model"
    # The measured GPU holds the params and their grads in full, in the model's dtype; the job holds its ZeRO shards.
    held = 2 * sum(p.numel() * p.element_size() for p in b.model.parameters())
    assert b.state_correction == model_state_bytes(shape.num_params, 2, JobSettings()) - held
    assert b.num_layers == 2
    plain = b.measure(128, 1, 0, 1)
    ckpt = b.measure(128, 1, 2, 1)
    est = b.measure(128, 2, 1, 1)
    states = model_state_bytes(shape.num_params, 2, JobSettings())
    for m in (plain, ckpt, est):
        # CPU: the training job's model states plus the bytes autograd saved (no allocator peak, no NVML)
        assert not m.oom and m.time_s > 0 and m.peak_mem_bytes > states and m.nvml_used_bytes is None
        assert m.source == "cpu" and m.ranks == 1
    assert plain.peak_mem_bytes > ckpt.peak_mem_bytes, "checkpointing both layers must save activation memory"
    assert not plain.estimated and est.estimated and "slice" in est.note
    # The estimate's arithmetic, with the slice run replaced by a known reading: slice time + the attention swap
    # (whole-pack attention / sp for the slice's own) + (2L + c) forward all-to-all sets; memory + a2a buffers.
    ran = []

    def fake_run(docs, ckpt_layers, iters):
        ran.append(list(docs))
        return 0.5, 10 ** 9, 2 * 10 ** 9
    b._run = fake_run
    cm, sp, c, L = b.cost_model, 4, 1, 2
    m = b.measure(512, sp, c, 1)
    assert ran == [[128]] and m.estimated
    swap = L * (cm.attention_fwdbwd([512]).sum() / sp - cm.attention_fwdbwd([128]).sum()) + \
        c * (cm.attention_fwd([512]).sum() / sp - cm.attention_fwd([128]).sum())
    a2a = float(cm.a2a_seconds(512, sp))
    assert a2a > 0 and m.time_s == pytest.approx(0.5 + swap + (2 * L + c) * a2a, rel=1e-12)
    buffers = 2 * (512 // sp) * shape.a2a_width(sp) * 2
    assert m.peak_mem_bytes == 10 ** 9 + b.state_correction + buffers
    assert m.nvml_used_bytes == 2 * 10 ** 9 + b.state_correction + buffers


def test_library_oom_is_infeasible_and_other_errors_stop_the_profile(monkeypatch):
    """On a GPU an OOM may also come as a plain RuntimeError (cuBLAS workspace, a raw CUDA error): like torch's
    OutOfMemoryError it marks the configuration infeasible; any other error still stops the profile."""
    import torch

    from hbp_train.model import packed_lm as loss
    from hbp_train.perf.cost_model import CostModel
    from hbp_train.model.hf_model import ModelConfig

    model_cfg = ModelConfig(config=dict(TINY), dtype="fp32", attention_backend="sdpa_block")
    shape = model_shape_of(model_cfg, None)
    b = GpuBackend(model_cfg, cfg(max_len=512, min_len=128, warmup_iters=0, iters=1),
                        CostModel.from_calibration(model_shape=shape), JobSettings(), device="cpu")
    errors = [torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
              RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
              RuntimeError("CUDA error: out of memory")]
    for error in errors:
        def fail(*args, error=error, **kwargs):
            raise error
        monkeypatch.setattr(loss, "chunked_token_losses", fail)
        m = b.measure(128, 1, 0, 1)
        assert m.oom and m.time_s is None, error

    def broken(*args, **kwargs):
        raise RuntimeError("shape mismatch")
    monkeypatch.setattr(loss, "chunked_token_losses", broken)
    with pytest.raises(RuntimeError, match="shape mismatch"):
        b.measure(128, 1, 0, 1)


def test_gpu_backend_pack_restarts_positions_and_masks_labels_per_document(tmp_path, monkeypatch):
    """The synthetic pack of a docs file: position_ids restart at every document and each document's last token
    has no target (labels shifted within the document)."""
    from hbp_train.model import hf_model as model_mod
    from hbp_train.perf.cost_model import CostModel
    from hbp_train.model.hf_model import ModelConfig

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("40\n25\n70\n")
    model_cfg = ModelConfig(config=dict(TINY), dtype="fp32", attention_backend="sdpa_block")
    shape = model_shape_of(model_cfg, None)
    c = cfg(max_len=512, min_len=128, world_size=2, warmup_iters=0, iters=1, docs=str(lengths))
    b = GpuBackend(model_cfg, c, CostModel.from_calibration(model_shape=shape), JobSettings(),
                        device="cpu")
    seen = {}
    real_forward = model_mod.forward_hidden

    def spy(model, input_ids, position_ids, **kw):
        seen["input_ids"], seen["position_ids"] = input_ids.clone(), position_ids.clone()
        return real_forward(model, input_ids, position_ids, **kw)
    from hbp_train.model import packed_lm as loss_mod
    real_chunked = loss_mod.chunked_token_losses

    def loss_spy(hidden, weight, labels, chunk, **kw):
        seen["labels"] = labels.clone()
        return real_chunked(hidden, weight, labels, chunk, **kw)
    monkeypatch.setattr(model_mod, "forward_hidden", spy)
    monkeypatch.setattr(loss_mod, "chunked_token_losses", loss_spy)
    b.measure(256, 1, 0, 1)
    docs = synthetic_docs(256, load_doc_lengths(str(lengths)), c.seed)
    want_pos = np.concatenate([np.arange(d) for d in docs])
    assert seen["position_ids"][0].tolist() == want_pos.tolist()
    ids, labels = seen["input_ids"][0], seen["labels"][0]
    start = 0
    for d in docs:
        assert labels[start:start + d - 1].tolist() == ids[start + 1:start + d].tolist()
        assert int(labels[start + d - 1]) == IGNORE_INDEX
        start += d


@pytest.mark.parametrize("docs,sp", [([100], 4), ([7, 300, 1, 45], 4), ([5, 5, 5, 30], 4), ([1000, 3, 2, 1], 2)])
def test_slice_docs_is_the_pack_shrunk_by_sp(docs, sp):
    part = slice_docs(docs, sp)
    assert sum(part) == sum(docs) // sp and all(d >= 1 for d in part)
    assert len(part) == len(docs)
    assert all(abs(p - d / sp) <= 1 + 1e-9 or d < sp for p, d in zip(part, docs))


def test_slice_docs_of_more_documents_than_slice_tokens_ends():
    # 3 documents, 15 tokens, sp 8: the slice has 1 token, so it cannot keep one token per document
    assert slice_docs([5, 5, 5], 8) == [1]
    assert slice_docs([1] * 10, 4) == [1, 1]


def test_docs_file_draws_documents_from_the_dataset_lengths(tmp_path):
    pool = [3000, 500, 7000, 120]
    for path in (tmp_path / "l.npy", tmp_path / "l.json", tmp_path / "l.txt"):
        if path.suffix == ".npy":
            np.save(path, np.array(pool))
        elif path.suffix == ".json":
            path.write_text(json.dumps({"lengths": pool}))
        else:
            path.write_text("\n".join(map(str, pool)))
        assert load_doc_lengths(str(path)).tolist() == pool
    docs = synthetic_docs(32768, load_doc_lengths(str(tmp_path / "l.txt")), seed=1)
    assert sum(docs) == 32768 and len(docs) > 1
    assert all(d in pool for d in docs[:-1]) and docs[-1] <= max(pool)
    assert synthetic_docs(32768, None) == [32768]
    bad = tmp_path / "bad.txt"
    bad.write_text("12\n0\n")
    with pytest.raises(UserError, match="profile.docs"):
        load_doc_lengths(str(bad))


@pytest.mark.parametrize("impl, fused", [("fused", True), ("auto", False)])
def test_the_gpu_backend_times_the_program_training_runs(monkeypatch, impl, fused):
    """The profiler measures what a training step runs (as the calibration does): the trainer's forward with the pack's
    sample boundaries, and the LM-head loss loss.impl resolves (fused on a GPU, so "fused" here stands for it; chunked
    on the CPU) with the trained rows' count known on the host, so that neither selects its rows with a host sync."""
    import torch

    from hbp_train.model import packed_lm
    from hbp_train.model import hf_model
    from hbp_train.model.hf_model import ModelConfig
    from hbp_train.perf.cost_model import CostModel

    model_cfg = ModelConfig(config=dict(TINY), dtype="fp32", attention_backend="sdpa_block")
    shape = model_shape_of(model_cfg, None)
    b = GpuBackend(model_cfg, cfg(max_len=512, min_len=128, warmup_iters=0, iters=1),
                   CostModel.from_calibration(model_shape=shape), JobSettings(), device="cpu", loss_impl=impl)
    seen = {}

    def spy(name, real):
        def call(*args, **kwargs):
            seen.setdefault(name, kwargs)
            return real(*args, **kwargs)
        return call

    for name in ("fused_token_losses", "chunked_token_losses"):
        monkeypatch.setattr(packed_lm, name, spy(name, getattr(packed_lm, name)))
    monkeypatch.setattr(hf_model, "forward_hidden", spy("forward", hf_model.forward_hidden))
    m = b.measure(256, 1, 0, 1)
    assert not m.oom and m.time_s > 0 and b.hardware()["loss"] == ("fused" if fused else "chunked")
    (used,) = [n for n in ("fused_token_losses", "chunked_token_losses") if n in seen]
    assert used == ("fused_token_losses" if fused else "chunked_token_losses")
    docs = synthetic_docs(256, load_doc_lengths("single"), b.cfg.seed)
    assert seen[used]["num_rows"] == 256 - len(docs)  # every token but each document's last, counted on the host
    cu = seen["forward"]["cu_seq_lens_q"]
    assert cu.tolist() == [0, *np.cumsum(docs).tolist()] and seen["forward"]["max_length_q"] == max(docs)
    assert isinstance(seen[used]["num_rows"], int) and not isinstance(seen[used]["num_rows"], torch.Tensor)


def test_gpu_backend_measures_the_tiled_mlp_as_training_installs_it():
    """A measurement with the tiled MLP runs model/levers.py's tiling on the backend's model (here on the CPU, where
    the saved bytes are the memory): it keeps the MLP's intermediates of no layer, the measurement says so, and the
    next plain measurement runs untiled again."""
    from hbp_train.perf.cost_model import CostModel
    from hbp_train.perf.memory import mlp_bytes_per_token
    from hbp_train.model.hf_model import ModelConfig

    model_cfg = ModelConfig(config=dict(TINY), dtype="fp32", attention_backend="sdpa_block")
    shape = model_shape_of(model_cfg, None)
    b = GpuBackend(model_cfg, cfg(max_len=512, min_len=128, warmup_iters=0, iters=1),
                   CostModel.from_calibration(model_shape=shape), JobSettings(), device="cpu")
    assert not b.supports_levers  # the search tries none on the CPU (offload moves nothing there)
    plain, tiled, again = (b.measure(512, 1, 0, 1, tiled_mlp=t) for t in (False, True, False))
    assert tiled.tiled_mlp and not plain.tiled_mlp and b._levers.levers.mlp_tiles == 1
    saved = plain.peak_mem_bytes - tiled.peak_mem_bytes
    assert saved == 512 * shape.num_layers * mlp_bytes_per_token(shape, 4)
    assert again.peak_mem_bytes == plain.peak_mem_bytes
