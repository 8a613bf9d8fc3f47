"""Measurement back-ends of the profiler: how long one fwd+bwd of a pack takes and how much memory a rank uses.

One small interface, `MeasureBackend.measure(pack_len, sp, ckpt_layers, iters) -> Measurement`; an OOM is a
result (Measurement(oom=True)), never an exception.

  GpuBackend       (profiler/gpu_backend.py) the real model (hbp_train.model.hf_model) on this machine's GPU: fwd+bwd of a synthetic pack through
                   the program training runs (the trainer's PackedCausalLM: the attention backend and decoder kernels
                   the model was built with, the pack's boundaries handed over, the LM-head loss training resolves,
                   fused on a GPU, its trained rows counted on the host); torch peak-allocated and NVML used memory (on the CPU, device=cpu: the bytes
                   autograd saves). In one process every sp > 1 is *estimated* from the per-rank slice (pack_len/sp
                   on one GPU) plus the cost model's attention and all-to-all terms (docs/profiler.md states the
                   model); in a measuring torchrun (profiler/worker.py, `use_sequence_parallel`) each rank runs its
                   slice of the pack through the Ulysses attention of model/ulysses.py: measured.
  AnalyticBackend  no GPU (profile.dry_run): hbp_train.perf.cost_model for time, hbp_train.perf.memory for memory.
  CurveBackend     injected time/memory curves, for tests and what-if studies.

The synthetic packs they time are built in profiler/packs.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol


from hbp_train.profiler.packs import load_doc_lengths, synthetic_docs
from hbp_train.perf.cost_model import CostModel
from hbp_train.perf.memory import JobSettings, analytic_memory_bytes
from hbp_train.perf.shape import ModelShape
from hbp_train.perf.profile_config import ProfileConfig
from hbp_train.profiler.zero_choice import pcie_gbps


# =============================================================================================== measurements
@dataclass
class Measurement:
    """One profiled configuration: a pack of `pack_len` tokens run by an SP group of `sp` GPUs."""

    pack_len: int
    """Tokens in the pack (all SP ranks together)."""
    sp: int
    """SP degree."""
    ckpt_layers: int
    """Number of decoder layers with activation checkpointing."""
    time_s: Optional[float]
    """Seconds of one fwd+bwd of the pack (median over the timed iterations); None when it did not run (OOM)."""
    peak_mem_bytes: Optional[int]
    """Peak memory of one rank from torch's counters (max_memory_allocated), incl. the model-state correction to
    the training job's ZeRO stage and world size; for analytic/curve backends the modelled peak."""
    nvml_used_bytes: Optional[int]
    """Device used memory from NVML after the iterations (None without NVML or when not measured on a GPU)."""
    oom: bool = False
    """The configuration ran out of memory: infeasible."""
    estimated: bool = False
    """Not measured as such: sp exceeds the GPUs measured together, derived from the per-rank slice + a comm model."""
    source: str = "gpu"
    """Where the numbers come from: "gpu", "cpu", "analytic" or "curve"."""
    ranks: int = 1
    """Processes that ran it: sp when an SP group of sp ranks measured it (one torchrun per degree), else 1."""
    purpose: str = ""
    """Why it was measured: "ckpt-all", "ckpt-probe", "verify" (Alg. 4)."""
    wall_s: float = 0.0
    """Seconds the measurement itself took (profiler cost, not the configuration's speed)."""
    note: str = ""
    """Anything worth knowing (e.g. how an estimate was made)."""
    tiled_mlp: bool = False
    """Memory lever: the MLPs ran tiled over the sequence (hbp_train/model/levers.py)."""
    offload_activations: bool = False
    """Memory lever: the checkpointed layers' inputs waited in host memory."""

    def memory_bytes(self, metric: str = "torch") -> Optional[int]:
        """The memory compared with the budget: NVML used when asked and present, else torch's peak."""
        if metric == "nvml" and self.nvml_used_bytes is not None:
            return self.nvml_used_bytes
        return self.peak_mem_bytes

    @property
    def tokens_per_s_per_gpu(self) -> Optional[float]:
        """Throughput normalised per GPU, the quantity Alg. 1 and 3 maximise."""
        if self.oom or not self.time_s:
            return None
        return self.pack_len / (self.time_s * self.sp)


class MeasureBackend(Protocol):
    """What the profiler needs from a way of measuring. Implementations: GpuBackend, AnalyticBackend, CurveBackend."""

    name: str
    """"gpu", "cpu", "analytic" or "curve": written next to every measurement."""
    num_layers: int
    """Decoder layers of the model (the range of ckpt_layers)."""
    device_memory_bytes: int
    """Memory of one device; the budget is headroom x this."""
    num_gpus: int
    """GPUs that can be measured together; larger SP degrees are estimated."""

    def measure(self, pack_len: int, sp: int, ckpt_layers: int, iters: int, tiled_mlp: bool = False,
                offload_activations: bool = False) -> Measurement:
        """Run (or model) the configuration with the given memory levers (only asked of a backend whose
        ``supports_levers`` is true); an OOM is returned as Measurement(oom=True), never raised."""
        ...

    def hardware(self) -> dict:
        """Description of the device(s) for the report."""
        ...


# ================================================================================================ backends
class CurveBackend:
    """Injected curves: time_fn(l, sp, ckpt) -> s and mem_fn(l, sp, ckpt) -> bytes. A configuration whose memory
    exceeds the device is an OOM. `sleep(seconds)` is called with the simulated cost of each measurement
    ((warmup + iters) x time), so a fake clock can test the time budget."""

    name = "curve"

    def __init__(self, time_fn, mem_fn, num_layers: int, device_memory_bytes: int, num_gpus: int = 1,
                 warmup_iters: int = 1, sleep: Optional[Callable[[float], None]] = None, nvml_fn=None):
        self.time_fn, self.mem_fn, self.nvml_fn = time_fn, mem_fn, nvml_fn
        self.num_layers = num_layers
        self.device_memory_bytes = int(device_memory_bytes)
        self.num_gpus = num_gpus
        self.warmup_iters = warmup_iters
        self.sleep = sleep
        self.calls: list[tuple[int, int, int]] = []

    def measure(self, pack_len: int, sp: int, ckpt_layers: int, iters: int) -> Measurement:
        self.calls.append((pack_len, sp, ckpt_layers))
        mem = int(self.mem_fn(pack_len, sp, ckpt_layers))
        oom = mem > self.device_memory_bytes
        t = None if oom else float(self.time_fn(pack_len, sp, ckpt_layers))
        if self.sleep is not None:
            self.sleep((self.warmup_iters + iters) * (t if t is not None else 0.0) + 0.1)
        nvml = None if (oom or self.nvml_fn is None) else int(self.nvml_fn(pack_len, sp, ckpt_layers))
        return Measurement(pack_len, sp, ckpt_layers, t, None if oom else mem, nvml, oom=oom,
                           estimated=sp > self.num_gpus, source=self.name)

    def hardware(self) -> dict:
        return {"backend": "curve", "device_memory_bytes": self.device_memory_bytes, "gpu_count": self.num_gpus}


class AnalyticBackend:
    """--dry-run: time from hbp_train.perf.cost_model (calibrated and scaled, or analytic), memory from
    `analytic_memory_bytes`, the memory levers included. Nothing runs; every number is labelled "analytic"."""

    name = "analytic"
    supports_levers = True

    def __init__(self, shape: ModelShape, cfg: ProfileConfig, cost_model: CostModel, job: JobSettings):
        self.shape, self.cfg, self.cost_model, self.job = shape, cfg, cost_model, job
        self.num_layers = shape.num_layers
        self.device_memory_bytes = int(cfg.device_memory_gb * 2**30)
        self.num_gpus = cfg.world_size  # nothing is measured, so nothing is "estimated" beyond being analytic
        self.pool = load_doc_lengths(cfg.docs)

    def measure(self, pack_len: int, sp: int, ckpt_layers: int, iters: int, tiled_mlp: bool = False,
                offload_activations: bool = False) -> Measurement:
        cfg = self.cfg
        mem = analytic_memory_bytes(self.shape, pack_len, sp, ckpt_layers, cfg.world_size, self.job, tiled_mlp,
                                    offload_activations)
        oom = mem > self.device_memory_bytes  # under the job's own settings; another ZeRO setup: memory_for
        docs = synthetic_docs(pack_len, self.pool, cfg.seed)
        t = self.cost_model.pack_time(docs, sp, ckpt_layers, gpus_per_node=cfg.gpus_per_node,
                                                       tiled_mlp=tiled_mlp, offload_activations=offload_activations,
                                                       pcie_gbps=pcie_gbps(cfg))
        return Measurement(pack_len, sp, ckpt_layers, t, mem, None, oom=oom, source="analytic",
                           note=f"cost model: {self.cost_model.source}", tiled_mlp=tiled_mlp,
                           offload_activations=offload_activations)

    def memory_for(self, m: Measurement, job: JobSettings) -> int:
        """The modelled memory of a configuration under other job settings (another ZeRO setup)."""
        return analytic_memory_bytes(self.shape, m.pack_len, m.sp, m.ckpt_layers, self.cfg.world_size, job,
                                     m.tiled_mlp, m.offload_activations)

    def hardware(self) -> dict:
        return {"backend": "analytic", "device_memory_bytes": self.device_memory_bytes,
                "gpu_count": self.cfg.world_size, "gpus_per_node": self.cfg.gpus_per_node,
                "cost_model": self.cost_model.describe()["note"], "note": "assumed, nothing measured (--dry-run)"}
