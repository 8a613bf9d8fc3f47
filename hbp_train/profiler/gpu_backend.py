"""The profiler's measuring back-end: the real model, fwd+bwd of a synthetic pack through the program training
runs, on this machine's GPU (or its CPU), one configuration (pack length, SP degree, checkpointed layers, levers) at
a time. The interface it implements and the other back-ends: profiler/backends.py.
"""

from __future__ import annotations

import gc
import time
from contextlib import nullcontext
from typing import Optional

import numpy as np

from hbp_train.profiler.packs import load_doc_lengths, slice_docs, synthetic_docs
from hbp_train.common.labels import IGNORE_INDEX
from hbp_train.perf.cost_model import CostModel
from hbp_train.perf.memory import JobSettings, model_state_bytes
from hbp_train.perf.profile_config import ProfileConfig
from hbp_train.profiler.nvml import nvml_hardware, nvml_used_bytes
from hbp_train.profiler.backends import Measurement


class GpuBackend:
    """Measure on this machine's first GPU (one process). sp=1 runs the whole pack; sp > 1 cannot be run on one
    GPU and is estimated from the per-rank slice (see `_estimate`) -- unless this process is one rank of a
    measuring torchrun (`use_sequence_parallel`): then its degree is run for real, each rank its slice of the pack
    through the Ulysses attention, and the group's reading is the slowest rank's time and the largest rank's memory.

    Each measurement: build a synthetic pack on the host (random token ids, position_ids restarting per document,
    labels on every token but each document's last; at sp > 1 this rank's slice, cut as the trainer cuts it), count
    its trained tokens there, set the checkpointed layers, run `warmup_iters` + `iters` fwd+bwd of the trainer's
    forward (model/packed_lm.PackedCausalLM: sample boundaries passed at sp=1, the loss of ``loss_impl`` as training resolves
    it: fused on a GPU, chunked on the CPU, with the trained rows' count so that neither reads it back from the
    device), time each with CUDA events (median), read torch's peak allocated memory and NVML used memory. Model states:
    the GPU holds the bf16 params and grads in full; the training job holds its ZeRO shards plus fp32 optimizer
    states, so `model_state_bytes(...) - 4 x params` is added to both memory readings (no optimizer is built:
    its step costs the same per token for every configuration).

    On the CPU (device="cpu", profile.device=cpu: groups for training on this CPU, and the tests) there is no
    allocator peak: memory is the model states plus the bytes autograd saves for backward in the first iteration
    (counted with saved-tensor hooks), which leaves out transient buffers (a recomputed layer, a loss chunk's
    logits).
    """

    def __init__(self, model_cfg, cfg: ProfileConfig, cost_model: CostModel, job: JobSettings,
                 vocab_size: Optional[int] = None, device=None, loss_impl: str = "auto"):
        import torch

        from hbp_train.model.packed_lm import PackedCausalLM
        from hbp_train.model.hf_model import build_model, decoder_layers
        from hbp_train.model.hf_model import num_params as model_num_params
        from hbp_train.model.loss import LossConfig

        self.torch = torch
        self.cfg, self.cost_model, self.loss_chunk = cfg, cost_model, job.loss_chunk_tokens
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.on_gpu = self.device.type == "cuda"
        self.name = "gpu" if self.on_gpu else "cpu"
        # A model from a config is initialised where it runs: a 1B model's random init on the host takes most of a
        # minute (pretrained weights are loaded on the host and moved, as transformers does by default).
        with torch.device(self.device) if model_cfg.name_or_path is None else nullcontext():
            self.model = build_model(model_cfg, vocab_size=vocab_size).to(self.device)
        self._on_device = True
        self.sequence_parallel = None  # this rank's SequenceParallel inside a measuring torchrun
        # NVML used memory on this device that is another process's (the parent profiler's, in a measuring
        # torchrun: launcher.device_excess_bytes), left out of this process's readings.
        self.nvml_offset_bytes = 0
        self.measured_sp = 1  # the SP degree this process runs for real (with its peers); others are estimated
        self.model.train()
        # what training runs on the model: its forward and LM-head loss (loss.impl resolved for this device)
        self.fused_loss = LossConfig(chunk_size=self.loss_chunk, impl=loss_impl).fused_on(self.device)
        self.program = PackedCausalLM(self.model, self.loss_chunk, fused_loss=self.fused_loss)
        self.num_layers = len(decoder_layers(self.model))
        self.params = model_num_params(self.model)
        elem = next(self.model.parameters()).element_size()
        self.state_correction = model_state_bytes(self.params, cfg.world_size, job) - 2 * elem * self.params
        if self.on_gpu:
            self.device_memory_bytes = int(torch.cuda.get_device_properties(self.device).total_memory)
        else:  # CPU: no device memory to read; the budget is the one profile.device_memory_gb states (GiB)
            self.device_memory_bytes = int(cfg.device_memory_gb * 2**30)
        self.num_gpus = 1
        self.vocab = self.model.get_output_embeddings().weight.shape[0]
        self.pool = load_doc_lengths(cfg.docs)

    def hardware(self) -> dict:
        torch = self.torch
        loss = "fused" if self.fused_loss else "chunked"
        if not self.on_gpu:
            return {"backend": "cpu", "device": str(self.device), "threads": torch.get_num_threads(), "loss": loss,
                    "note": "CPU run: this CPU's times and autograd-saved activation memory, not a GPU's"}
        props = torch.cuda.get_device_properties(self.device)
        info = {"backend": "gpu", "gpu_name": props.name, "device_memory_bytes": int(props.total_memory),
                "gpus_measured": 1, "torch": torch.__version__, "cuda": torch.version.cuda, "loss": loss}
        info["nvml"] = nvml_hardware()
        return info

    def use_sequence_parallel(self, pstate, sp: int) -> None:
        """Make this process one rank of an SP group of degree `sp` (inside a measuring torchrun, every rank calls
        it): the model's attention becomes the Ulysses attention of model/ulysses.py on `pstate`'s groups
        (distributed/groups.py), and `measure(l, sp, ...)` runs this rank's slice for real."""
        from hbp_train.model.ulysses import setup_sequence_parallel

        self.sequence_parallel = setup_sequence_parallel(self.model, pstate)
        self.sequence_parallel.set_active(sp)
        self.measured_sp = self.num_gpus = sp

    def release(self) -> None:
        """Free this process's GPU for the measuring torchruns (they use GPUs 0..sp-1 too): the model waits in host
        memory until the next measurement here."""
        if self.on_gpu and self._on_device:
            self.model.to("cpu")
            self._on_device = False
            self.torch.cuda.empty_cache()

    @property
    def supports_levers(self) -> bool:
        """The memory levers are measured on a GPU, as training installs them (hbp_train/model/levers.py); on the CPU
        activation offload moves nothing (DeepSpeed has no device to free there), so a CPU profile tries none."""
        return self.on_gpu

    def measure(self, pack_len: int, sp: int, ckpt_layers: int, iters: int, tiled_mlp: bool = False,
                offload_activations: bool = False) -> Measurement:
        docs = synthetic_docs(pack_len, self.pool, self.cfg.seed)
        self._set_levers(pack_len, sp, tiled_mlp, offload_activations)
        if sp > self.num_gpus:
            return self._estimate(pack_len, docs, sp, ckpt_layers, iters)
        if sp != self.measured_sp:
            raise ValueError(f"this process measures sp={self.measured_sp} (with its peers), not sp={sp}")
        t, peak, used = self._run(docs, ckpt_layers, iters, sp)
        note = f"measured on {sp} ranks (one torchrun)" if sp > 1 else ""
        return self._measurement(pack_len, sp, ckpt_layers, t, peak, used, estimated=False, note=note)

    def _set_levers(self, pack_len: int, sp: int, tiled_mlp: bool, offload: bool) -> None:
        """The levers the next runs use: the tiled MLP's tile count of the group (perf.shape.mlp_tiles: the same on a
        rank's slice as in the SP group), and offload. Installed on the model at first use."""
        self._lever_flags = (tiled_mlp, offload)
        if not (tiled_mlp or offload or getattr(self, "_levers", None)):
            return
        from hbp_train.model.levers import Levers, install_levers
        from hbp_train.perf.shape import mlp_tiles

        self._levers = install_levers(self.model)
        hidden = self.model.config.hidden_size
        self._levers.set(Levers(mlp_tiles=mlp_tiles(hidden, pack_len, sp) if tiled_mlp else 1, offload=offload))

    def _micro_batch(self):
        """The context each iteration's forward and backward run in: the levers' (offload's hooks), or none."""
        levers = getattr(self, "_levers", None)
        return levers.micro_batch() if levers is not None else nullcontext()

    def _measurement(self, pack_len, sp, ckpt, t, peak, used, estimated, note="") -> Measurement:
        ranks = sp if sp > 1 and not estimated else 1
        tiled, offload = getattr(self, "_lever_flags", (False, False))
        if t is None:
            return Measurement(pack_len, sp, ckpt, None, None, None, oom=True, estimated=estimated,
                               source=self.name, ranks=ranks, note=note, tiled_mlp=tiled,
                               offload_activations=offload)
        fix = self.state_correction
        return Measurement(pack_len, sp, ckpt, t, None if peak is None else peak + fix,
                           None if used is None else used + fix, estimated=estimated, source=self.name,
                           ranks=ranks, note=note, tiled_mlp=tiled, offload_activations=offload)

    def _estimate(self, pack_len, docs, sp, ckpt, iters) -> Measurement:
        """One rank of an SP group runs pack_len/sp tokens through the linear layers and LM head, and attention of
        the WHOLE pack for 1/sp of the heads, plus 4 all-to-alls per layer forward (again in backward and in each
        recompute). Run the slice (documents shrunk by sp) on this GPU, then swap the slice's attention for the
        pack's per-rank share and add the all-to-alls, both from the cost model (scaled to this shape)."""
        part = slice_docs(docs, sp)
        t, peak, used = self._run(part, ckpt, iters)
        note = f"estimated from a {sum(part)}-token slice on 1 GPU + cost-model attention/all-to-all"
        if t is None:
            return self._measurement(pack_len, sp, ckpt, None, None, None, True, note)
        cm, layers = self.cost_model, self.num_layers
        attn = cm.attention_fwdbwd(docs).sum() / sp - cm.attention_fwdbwd(part).sum()
        recompute = cm.attention_fwd(docs).sum() / sp - cm.attention_fwd(part).sum()
        a2a = float(cm.a2a_seconds(pack_len, sp, gpus_per_node=self.cfg.gpus_per_node))
        t = t + layers * attn + ckpt * recompute + (2 * layers + ckpt) * a2a
        # All-to-all send + receive buffers of one layer's q, k, v, out for this rank's tokens.
        buffers = 2 * (pack_len // sp) * cm.shape.a2a_width(sp) * 2
        return self._measurement(pack_len, sp, ckpt, float(t), None if peak is None else peak + buffers,
                                 None if used is None else used + buffers, True, note)

    def _run(self, docs: list[int], ckpt: int, iters: int, sp: int = 1):
        """(median seconds, peak allocated bytes, NVML used bytes) of fwd+bwd on one pack, or (None,)*3 on OOM.
        sp > 1 (a measuring torchrun): this rank's slice of the pack, the group's loss summed over the SP group,
        and the readings agreed over the group (slowest time, largest memory); an OOM raises RankOutOfMemory,
        since this rank cannot tell its peers that are waiting in an all-to-all."""
        torch = self.torch
        from hbp_train.model.hf_model import set_checkpointed_layers

        if not self._on_device:
            self.model.to(self.device)
            self._on_device = True
        batch = self._pack(docs, sp)
        set_checkpointed_layers(self.model, ckpt)
        times, oom = [], False
        self.model.zero_grad(set_to_none=True)
        if self.on_gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        saved = None if self.on_gpu else _SavedBytes(torch, self.model)  # CPU: no allocator peak to read
        try:
            for i in range(self.cfg.warmup_iters + iters):
                timer = _Timer(torch, self.on_gpu)
                with self._micro_batch():  # the levers' context spans forward and backward (offload restores)
                    with saved if (saved is not None and i == 0) else nullcontext():
                        loss, _ = self.program(**batch)  # the trainer's forward and loss (its weighted sum)
                        if sp > 1:  # every rank back-propagates its group's loss, as in training
                            loss = self.sequence_parallel.reduce_loss(loss)
                    loss.backward()
                timer.stop()
                del loss
                if i >= self.cfg.warmup_iters:
                    times.append(timer)
            if self.on_gpu:
                torch.cuda.synchronize(self.device)
        except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is one; metrics.is_oom knows the others
            from hbp_train.observe.telemetry import is_oom

            if not is_oom(exc):
                raise
            if sp > 1:
                raise RankOutOfMemory(sum(docs), sp, ckpt, *getattr(self, "_lever_flags", (False, False))) from None
            oom = True
        loss = None  # noqa: F841  (drop the last iteration's graph if the OOM left it bound)
        # Outside the except block, so the exception's frames (holding activations) are gone before freeing.
        if oom:
            result = (None, None, None)
        elif self.on_gpu:
            used = nvml_used_bytes(self.device.index or 0)
            result = (float(np.median([t.seconds() for t in times])),
                      int(torch.cuda.max_memory_allocated(self.device)),
                      None if used is None else used - self.nvml_offset_bytes)
        else:  # the model's params and grads as a GPU would hold them, plus what autograd saved
            held = sum(2 * p.numel() * p.element_size() for p in self.model.parameters())
            result = (float(np.median([t.seconds() for t in times])), held + saved.bytes, None)
        if sp > 1 and not oom:
            result = self._agree(result, sp)
        self.model.zero_grad(set_to_none=True)
        if oom:
            gc.collect()  # reference cycles through the exception's frames may still hold activations
        if self.on_gpu:
            torch.cuda.empty_cache()
        return result


    def _pack(self, docs: list[int], sp: int) -> dict:
        """The keyword arguments of the trainer's forward (model/packed_lm.PackedCausalLM) for a synthetic pack of ``docs``,
        made and cut on the host as the trainer's collate step does, then moved to the device: sample boundaries at
        sp=1 (under SP the Ulysses attention has the pack's own, from ``split``), the trained tokens counted on the
        host, a weight of 1 / tokens on each (a mean over the pack)."""
        from hbp_train.model.rope import PackSlice

        torch = self.torch
        tokens = sum(docs)
        gen = torch.Generator(device="cpu").manual_seed(self.cfg.seed)
        input_ids = torch.randint(0, self.vocab, (1, tokens), generator=gen)
        position_ids = torch.cat([torch.arange(d) for d in docs])[None]
        # Labels shifted within each document: the last token of a document has no target.
        labels = torch.roll(input_ids, -1, dims=1)
        labels[0, torch.tensor(np.cumsum(docs) - 1)] = IGNORE_INDEX
        cu_seqlens = torch.tensor(np.concatenate([[0], np.cumsum(docs)]), dtype=torch.int32)
        pack = {"input_ids": input_ids, "position_ids": position_ids, "shift_labels": labels,
                "cu_seqlens": cu_seqlens, "max_seqlen": max(docs)}
        if sp > 1:  # this rank's slice, exactly as the trainer cuts it (and the pack's boundaries for every layer)
            pack = self.sequence_parallel.split(pack)
        # each sample's own RoPE where the model's depends on the length, as in training
        pack_slice = pack["pack_slice"] if sp > 1 else PackSlice.whole(cu_seqlens)
        trained = pack["shift_labels"] != IGNORE_INDEX
        to = lambda t: t.to(self.device, non_blocking=True)  # noqa: E731
        return {"input_ids": to(pack["input_ids"]), "position_ids": to(pack["position_ids"]),
                "shift_labels": to(pack["shift_labels"]),
                "cu_seqlens": to(cu_seqlens) if sp == 1 else None, "max_seqlen": max(docs) if sp == 1 else None,
                "loss_weights": to(trained.to(torch.float32) / tokens), "num_loss_tokens": int(trained.sum()),
                "pack_slice": pack_slice}

    def _agree(self, result, sp: int):
        """One reading for the SP group: every rank gets the slowest rank's time and the largest rank's memory."""
        import torch.distributed as dist

        torch = self.torch
        values = torch.tensor([-1.0 if v is None else float(v) for v in result], dtype=torch.float64,
                              device=self.device)
        dist.all_reduce(values, op=dist.ReduceOp.MAX, group=self.sequence_parallel.pstate.sp_group(sp))
        t, peak, used = values.tolist()
        return t, None if peak < 0 else int(peak), None if used < 0 else int(used)


class RankOutOfMemory(RuntimeError):
    """This rank of a measuring torchrun ran out of memory inside an SP configuration. Its peers may be waiting in
    a collective it will never join, so the worker records the configuration and ends the torchrun (worker.py);
    the parent relaunches it for the rest."""

    def __init__(self, pack_len: int, sp: int, ckpt_layers: int, tiled_mlp: bool = False,
                 offload_activations: bool = False):
        super().__init__(f"out of memory at pack_len={pack_len} sp={sp} ckpt_layers={ckpt_layers}"
                         + "".join(f" {n}" for n, on in (("tiled_mlp", tiled_mlp), ("offload", offload_activations))
                                   if on))
        self.pack_len, self.sp, self.ckpt_layers = pack_len, sp, ckpt_layers
        self.tiled_mlp, self.offload_activations = tiled_mlp, offload_activations


class _SavedBytes:
    """While active: the bytes of the distinct storages autograd saves for backward, parameters excluded (the
    activation memory a GPU would hold at the end of the forward; the CPU has no allocator peak to read)."""

    def __init__(self, torch, model):
        self.torch = torch
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.sizes: dict[int, int] = {}
        self._hooks = None

    @property
    def bytes(self) -> int:
        return sum(self.sizes.values())

    def _pack(self, t):
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.params:  # a storage saved twice (or as views) counts once
            self.sizes[ptr] = max(self.sizes.get(ptr, 0), storage.nbytes())
        return t

    def __enter__(self):
        self.sizes = {}
        self._hooks = self.torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


class _Timer:
    """Seconds of one iteration: CUDA events on a GPU (no sync inside the loop), perf_counter on the CPU."""

    def __init__(self, torch, on_gpu: bool):
        self.on_gpu = on_gpu
        if on_gpu:
            self.start, self.end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def stop(self) -> None:
        if self.on_gpu:
            self.end.record()
        else:
            self.t1 = time.perf_counter()

    def seconds(self) -> float:
        return self.start.elapsed_time(self.end) / 1e3 if self.on_gpu else self.t1 - self.t0
