"""Auto group selection: profile (SP degree, checkpointed layers) per pack length and pick the HBP packing groups.

The HBP paper's Alg. 1 (hierarchical group auto-selection), Alg. 3 (FindBestSpCkpt) and Alg. 4
(GreedyProfileCkpt, appendix I), on top of a *measurement backend* that answers one question: how long does one
fwd+bwd of a pack of `pack_len` tokens take on an SP group of `sp` GPUs with `ckpt_layers` checkpointed layers,
and how much memory does one rank use?

  GreedyProfileCkpt(l, sp)  measure memory with all layers checkpointed and with fewer (the probe), fit the memory
                            each checkpointed layer saves, take the fewest checkpointed layers whose predicted
                            memory fits `headroom` x device memory, then verify that count by a measurement
                            (over budget / OOM: step up 1, 2, 4, ... layers; all layers is known to fit).
  FindBestSpCkpt(l)         for each SP degree, its GreedyProfileCkpt count and the time at that count; keep the
                            best throughput in tokens/s per GPU (pack_len / (time x sp)).
  Alg. 1                    over candidate lengths (powers of two from min_len up to max_len, max_len first), the
                            best-throughput length l_best and the longest feasible one l_max with their strategies,
                            then the communication-free lengths l1 = l_best/sp_best and l2 = l_max/sp_max (run at
                            sp=1 with their own checkpoint count): groups [l1, l_best, l2, l_max] when
                            l2 > l_best, else [l1, l_best, l_max] (deduplicated, ascending).

Backends (one small interface, `MeasureBackend.measure(pack_len, sp, ckpt_layers, iters) -> Measurement`):
  GpuBackend       the real model (hbp_train.model) on this machine's GPU: fwd+bwd with the chunked loss on a
                   synthetic pack; torch peak-allocated and NVML used memory; an OOM is caught and recorded.
                   SP degrees above the GPUs present are *estimated* from the per-rank slice (pack_len/sp on one
                   GPU) plus the cost model's attention and all-to-all terms (docs/profiler.md states the model).
  AnalyticBackend  no GPU (--dry-run): hbp_train.perf.cost_model for time, an analytic memory model for memory.
  CurveBackend     injected time/memory curves, for tests and what-if studies.

Entry point: ``python -m hbp_train.profiler [model=...] profile.max_len=131072 profile.dry_run=true ...`` writes
profile.json (read by ``data_tools.pack --groups auto --profile profile.json``) and prints every measurement.
"""

from __future__ import annotations

import gc
import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional, Protocol

import numpy as np

from hbp_train.perf.cost_model import CostModel, ModelShape, parse_model_shape

log = logging.getLogger("hbp_train.profiler.search")

GIB = 1024 ** 3
PROFILE_VERSION = 1
ROLES = ("l1", "l_best", "l2", "l_max")  # the group names of Alg. 1, in ascending length


# ============================================================================================== configuration
@dataclass
class ProfileConfig:
    """Settings of the auto group selection profiler (the `profile` config group)."""

    max_len: int = 131072
    """Longest pack length to consider: the longest sample the training data holds (l_max of Alg. 1)."""
    min_len: int = 8192
    """Shortest candidate pack length; candidates are the powers of two from here up to max_len, plus max_len."""
    lengths: list[int] = field(default_factory=list)
    """Explicit candidate pack lengths (overrides min_len and the powers of two; max_len is always added)."""
    world_size: int = 8
    """GPUs the training job will use. SP degrees are the powers of two dividing it; ZeRO shards over it."""
    sp_degrees: list[int] = field(default_factory=list)
    """SP degrees to try (each a power of two dividing world_size); empty = all of them."""
    gpus_per_node: int = 8
    """GPUs per node of the training job: SP groups larger than this use the inter-node bandwidth (cost model)."""
    headroom: float = 0.9
    """Fraction of device memory a configuration may use; the rest absorbs fragmentation and spikes."""
    memory_metric: str = "nvml"
    """Memory compared with the budget: "nvml" (device used memory, as the paper) or "torch" (peak allocated).
    "nvml" falls back to "torch" for a measurement without an NVML reading (no NVML, analytic, estimated)."""
    ckpt_probe_layers: Optional[int] = None
    """The 'fewer checkpointed layers' point of Alg. 4 (all layers is the other); None = half the layers."""
    warmup_iters: int = 1
    """Untimed iterations before each measurement (allocator warm-up, kernel selection)."""
    iters: int = 3
    """Timed iterations per measurement; the median is recorded."""
    time_budget_s: float = 300.0
    """Stop starting new measurements after this many seconds; the choice is made from what was measured."""
    prune: bool = True
    """Skip larger SP degrees for a length once one needs no checkpointing: more SP then only adds communication."""
    docs: str = "single"
    """Documents in the synthetic pack: "single" (one document of the pack length: the worst-case attention), or
    a tokenized dataset directory (its `length` column) or a .npy/.json/.txt file of sample lengths to draw from."""
    seed: int = 0
    """Seed for drawing document lengths."""
    dry_run: bool = False
    """No GPU: estimate everything analytically (cost model + memory model); the output says "analytic"."""
    calibration: str = ""
    """Cost-model calibration JSON (empty = the shipped H100 Llama-3-8B layer); scaled to the model's shape."""
    device_memory_gb: float = 80.0
    """Device memory in GB (1e9 bytes) assumed by --dry-run (the GPU backend reads the real one)."""
    output: str = "profile.json"
    """Where to write the profile (groups, every measurement, hardware, model shape, profiler timings)."""
    progress: bool = True
    """Show a tqdm progress bar."""

    def __post_init__(self):
        if self.max_len < 2:
            raise ValueError(f"profile.max_len must be >= 2, got {self.max_len}")
        if not 1 <= self.min_len <= self.max_len:
            raise ValueError(f"profile.min_len must be in [1, max_len={self.max_len}], got {self.min_len}")
        if any(int(x) < 1 or int(x) > self.max_len for x in self.lengths):
            raise ValueError(f"profile.lengths must be in [1, max_len={self.max_len}], got {list(self.lengths)}")
        if self.world_size < 1:
            raise ValueError(f"profile.world_size must be >= 1, got {self.world_size}")
        for sp in self.sp_degrees:
            if sp < 1 or sp & (sp - 1) or self.world_size % sp:
                raise ValueError(f"profile.sp_degrees: {sp} is not a power of two dividing world_size="
                                 f"{self.world_size}")
        if self.gpus_per_node < 1:
            raise ValueError(f"profile.gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if not 0 < self.headroom <= 1:
            raise ValueError(f"profile.headroom must be in (0, 1], got {self.headroom}")
        if self.memory_metric not in ("nvml", "torch"):
            raise ValueError(f"profile.memory_metric must be 'nvml' or 'torch', got {self.memory_metric!r}")
        if self.ckpt_probe_layers is not None and self.ckpt_probe_layers < 0:
            raise ValueError(f"profile.ckpt_probe_layers must be >= 0 or null, got {self.ckpt_probe_layers}")
        if self.warmup_iters < 0:
            raise ValueError(f"profile.warmup_iters must be >= 0, got {self.warmup_iters}")
        if self.iters < 1:
            raise ValueError(f"profile.iters must be >= 1, got {self.iters}")
        if self.time_budget_s <= 0:
            raise ValueError(f"profile.time_budget_s must be > 0, got {self.time_budget_s}")
        if self.docs != "single" and not Path(self.docs).exists():
            raise ValueError(f"profile.docs: {self.docs!r} is neither 'single' nor an existing file/directory")
        if self.device_memory_gb <= 0:
            raise ValueError(f"profile.device_memory_gb must be > 0, got {self.device_memory_gb}")
        if not self.output:
            raise ValueError("profile.output must name a file")

    def candidate_lengths(self) -> list[int]:
        """Candidate pack lengths, ascending: explicit `lengths` or powers of two in [min_len, max_len]; + max_len."""
        if self.lengths:
            found = {int(x) for x in self.lengths}
        else:
            found = set()
            length = 1 << max(0, (self.min_len - 1).bit_length())  # smallest power of two >= min_len
            while length <= self.max_len:
                found.add(length)
                length *= 2
        found.add(self.max_len)
        return sorted(found)

    def sp_candidates(self) -> list[int]:
        """SP degrees to try, ascending."""
        if self.sp_degrees:
            return sorted({int(s) for s in self.sp_degrees})
        return [s for s in (1 << i for i in range(self.world_size.bit_length())) if self.world_size % s == 0]


@dataclass
class JobSettings:
    """What the profiler takes from the rest of the run config (not profile.*): it must match the training job."""

    zero_stage: int = 2
    """deepspeed.zero_stage: which model states are sharded over profile.world_size."""
    offload_optimizer: bool = False
    """deepspeed.offload_optimizer: optimizer states live on the CPU (not counted on the GPU)."""
    loss_chunk_tokens: int = 4096
    """loss.chunk_size: tokens per chunk of the chunked LM-head loss."""


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
    """Not measured as such: sp exceeds the GPUs present, derived from the per-rank slice + a comm model."""
    source: str = "gpu"
    """Where the numbers come from: "gpu", "analytic" or "curve"."""
    purpose: str = ""
    """Why it was measured: "ckpt-all", "ckpt-probe", "verify" (Alg. 4)."""
    wall_s: float = 0.0
    """Seconds the measurement itself took (profiler cost, not the configuration's speed)."""
    note: str = ""
    """Anything worth knowing (e.g. how an estimate was made)."""

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
    """"gpu", "analytic" or "curve": written next to every measurement."""
    num_layers: int
    """Decoder layers of the model (the range of ckpt_layers)."""
    device_memory_bytes: int
    """Memory of one device; the budget is headroom x this."""
    num_gpus: int
    """GPUs that can be measured together; larger SP degrees are estimated."""

    def measure(self, pack_len: int, sp: int, ckpt_layers: int, iters: int) -> Measurement:
        """Run (or model) the configuration; an OOM is returned as Measurement(oom=True), never raised."""
        ...

    def hardware(self) -> dict:
        """Description of the device(s) for the report."""
        ...


# ================================================================================================ the algorithm
@dataclass
class CkptChoice:
    """Result of GreedyProfileCkpt for one (pack_len, sp)."""

    pack_len: int
    sp: int
    status: str
    """"ok", "infeasible" (does not fit even with every layer checkpointed) or "skipped" (time budget)."""
    ckpt_layers: Optional[int] = None
    """Fewest checkpointed layers that fit (verified), when status is "ok"."""
    measurement: Optional[Measurement] = None
    """The verifying measurement at ckpt_layers (its time is ProfileTime of Alg. 3)."""
    bytes_per_layer: Optional[float] = None
    """Fitted memory saved per checkpointed layer (None when only one point could be measured)."""


@dataclass
class Strategy:
    """Best (sp, ckpt) for one pack length (Alg. 3's result)."""

    pack_len: int
    sp: int
    ckpt_layers: int
    time_s: float
    tokens_per_s_per_gpu: float
    estimated: bool
    source: str

    def as_dict(self) -> dict:
        return asdict(self)


class ProfileError(RuntimeError):
    """Nothing usable was measured (every length infeasible or skipped)."""


class Profiler:
    """Runs Alg. 4 → 3 → 1 against a backend, within a time budget, remembering every measurement.

    The clock is injectable so the time budget can be tested with simulated time.
    """

    def __init__(self, backend: MeasureBackend, cfg: ProfileConfig, clock: Callable[[], float] = time.monotonic,
                 sp_degrees: Optional[list[int]] = None):
        self.backend = backend
        self.cfg = cfg
        self.clock = clock
        self.sp_degrees = sorted(sp_degrees) if sp_degrees else cfg.sp_candidates()
        self.budget_bytes = int(cfg.headroom * backend.device_memory_bytes)
        self.measurements: list[Measurement] = []
        self.skipped: list[dict] = []
        self.warnings: list[str] = []
        self._cache: dict[tuple[int, int, int], Measurement] = {}
        self._start: Optional[float] = None
        self._bar = None

    # ---- bookkeeping ----------------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return 0.0 if self._start is None else self.clock() - self._start

    def budget_exhausted(self) -> bool:
        return self.elapsed() >= self.cfg.time_budget_s

    def _warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)
            log.warning(message)

    def _measure(self, pack_len: int, sp: int, ckpt: int, purpose: str) -> Optional[Measurement]:
        """A cached measurement, or None when the time budget forbids starting a new one (recorded as skipped)."""
        key = (pack_len, sp, ckpt)
        if key in self._cache:
            return self._cache[key]
        if self.budget_exhausted():
            self.skipped.append({"pack_len": pack_len, "sp": sp, "ckpt_layers": ckpt, "purpose": purpose,
                                 "reason": f"time budget of {self.cfg.time_budget_s:g} s exhausted"})
            return None
        started = self.clock()
        m = self.backend.measure(pack_len, sp, ckpt, self.cfg.iters)
        m.purpose = m.purpose or purpose
        m.wall_s = self.clock() - started
        self._cache[key] = m
        self.measurements.append(m)
        if self._bar is not None:
            self._bar.set_postfix_str(f"l={pack_len} sp={sp} ckpt={ckpt} {_status(m, self)}", refresh=True)
        return m

    def fits(self, m: Measurement) -> bool:
        """Ran without OOM and within headroom x device memory."""
        mem = m.memory_bytes(self.cfg.memory_metric)
        return not m.oom and m.time_s is not None and mem is not None and mem <= self.budget_bytes

    # ---- Alg. 4 ---------------------------------------------------------------------------------------------
    def greedy_profile_ckpt(self, pack_len: int, sp: int) -> CkptChoice:
        """Fewest checkpointed layers for (pack_len, sp) that fit the memory budget, verified by a measurement."""
        metric = self.cfg.memory_metric
        c_max = self.backend.num_layers
        top = self._measure(pack_len, sp, c_max, "ckpt-all")
        if top is None:
            return CkptChoice(pack_len, sp, "skipped")
        if not self.fits(top):
            return CkptChoice(pack_len, sp, "infeasible", measurement=top)
        probe_at = self.cfg.ckpt_probe_layers
        c_min = c_max // 2 if probe_at is None else min(probe_at, c_max)
        # The probe may itself run out of memory: move it halfway towards c_max until it runs.
        low = None
        while c_min < c_max:
            low = self._measure(pack_len, sp, c_min, "ckpt-probe")
            if low is None:
                break  # budget: decide from the all-checkpointed point alone
            if not low.oom and low.memory_bytes(metric) is not None:
                break
            c_min = (c_min + c_max + 1) // 2
            low = None
        bytes_per_layer = None
        if low is None or c_min >= c_max:
            guess = c_max
        else:
            bytes_per_layer = (low.memory_bytes(metric) - top.memory_bytes(metric)) / (c_max - c_min)
            if bytes_per_layer <= 0:
                guess = 0  # checkpointing saves nothing measurable here: none is needed
            else:
                spare = self.budget_bytes - top.memory_bytes(metric)
                guess = c_max - math.floor(spare / bytes_per_layer)
        guess = int(min(max(guess, 0), c_max))
        # Verify; over budget or OOM → step up 1, 2, 4, ... layers (all layers is known to fit).
        step = 1
        while True:
            m = self._measure(pack_len, sp, guess, "verify")
            if m is None:
                # No time to verify: fall back to the most conservative measured count that fits.
                fitting = [x for x in self.measurements
                           if (x.pack_len, x.sp) == (pack_len, sp) and self.fits(x) and x.ckpt_layers >= guess]
                best = min(fitting, key=lambda x: x.ckpt_layers)
                self._warn(f"l={pack_len} sp={sp}: no time to verify ckpt={guess}; using measured "
                           f"ckpt={best.ckpt_layers}")
                return CkptChoice(pack_len, sp, "ok", best.ckpt_layers, best, bytes_per_layer)
            if self.fits(m):
                return CkptChoice(pack_len, sp, "ok", guess, m, bytes_per_layer)
            guess = min(guess + step, c_max)
            step *= 2

    # ---- Alg. 3 ---------------------------------------------------------------------------------------------
    def find_best_sp_ckpt(self, pack_len: int) -> Optional[Strategy]:
        """Best-throughput (sp, ckpt) for one pack length, or None when nothing fits / nothing was measured."""
        best: Optional[Strategy] = None
        degrees = [sp for sp in self.sp_degrees if pack_len % sp == 0]  # Ulysses cuts a pack into sp equal slices
        for done, sp in enumerate(degrees, start=1):
            choice = self.greedy_profile_ckpt(pack_len, sp)
            if self._bar is not None:
                self._bar.update(len(degrees) - done + 1 if self.cfg.prune and choice.ckpt_layers == 0 else 1)
            if choice.status != "ok":
                continue
            m = choice.measurement
            cand = Strategy(pack_len, sp, choice.ckpt_layers, m.time_s, m.tokens_per_s_per_gpu, m.estimated,
                            m.source)
            if best is None or cand.tokens_per_s_per_gpu > best.tokens_per_s_per_gpu:
                best = cand
            if self.cfg.prune and choice.ckpt_layers == 0:
                break  # nothing left to save by more SP, only communication to add
        return best

    # ---- Alg. 1 ---------------------------------------------------------------------------------------------
    def run(self) -> dict:
        """Profile every candidate length (longest first: l_max is the one group training cannot do without),
        then derive the groups. Returns the profile dict written to profile.json."""
        self._start = self.clock()
        lengths = self.cfg.candidate_lengths()
        strategies: dict[int, Strategy] = {}
        total = sum(1 for l in lengths for sp in self.sp_degrees if l % sp == 0)
        self._bar = _progress(total, self.cfg.progress)
        try:
            for length in reversed(lengths):
                if self.budget_exhausted():
                    self.skipped.append({"pack_len": length, "purpose": "length",
                                         "reason": f"time budget of {self.cfg.time_budget_s:g} s exhausted"})
                    continue
                strat = self.find_best_sp_ckpt(length)
                if strat is not None:
                    strategies[length] = strat
                elif not any(s.get("pack_len") == length for s in self.skipped):
                    self._warn(f"pack length {length}: does not fit in {self.cfg.headroom:g} x device memory at "
                               f"any SP degree in {self.sp_degrees}")
            if not strategies:
                raise ProfileError(
                    "no candidate pack length fits in memory at any SP degree (or the time budget ran out before "
                    "one was measured); raise profile.world_size / time_budget_s or lower profile.max_len")
            groups = self.select_groups(strategies)
        finally:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
        return self._report(strategies, groups)

    def select_groups(self, strategies: dict[int, Strategy]) -> list[dict]:
        """Alg. 1 stage 2: [l1, l_best, (l2,) l_max], each with its own sp and ckpt_layers."""
        l_max = max(strategies)
        if l_max < self.cfg.max_len:
            self._warn(f"max_len {self.cfg.max_len} could not be profiled as trainable; the longest group is "
                       f"{l_max}: samples longer than that would be dropped")
        # Best throughput; ties go to the longer length (fewer, larger packs).
        l_best = max(strategies, key=lambda l: (strategies[l].tokens_per_s_per_gpu, l))
        s_best, s_max = strategies[l_best], strategies[l_max]
        if self.cfg.docs == "single" and l_best == min(strategies) < l_max:
            # One document per pack: attention per token grows with the length, so the shortest candidate wins
            # unless fixed per-pack costs outweigh that. Real packs hold many shorter documents.
            self._warn(f"l_best={l_best} is the shortest candidate: with profile.docs=single (one document per "
                       "pack) attention per token grows with the pack length; set profile.docs to the tokenized "
                       "dataset to profile packs like the training data")
        l1, l2 = l_best // s_best.sp, l_max // s_max.sp
        roles = {l_best: ["l_best"], l_max: ["l_max"]} if l_best != l_max else {l_max: ["l_best", "l_max"]}
        groups: dict[int, dict] = {}
        for length, names in roles.items():
            strat = strategies[length]
            groups[length] = _group(strat.pack_len, strat.sp, strat.ckpt_layers, ",".join(names), strat.time_s,
                                    strat.tokens_per_s_per_gpu, strat.estimated, strat.source)
        extra = [(l1, "l1", s_best)] + ([(l2, "l2", s_max)] if l2 > l_best else [])
        for length, role, parent in extra:
            if length in groups:
                groups[length]["role"] = ",".join(sorted(groups[length]["role"].split(",") + [role], key=ROLES.index))
                continue
            # l1 / l2: communication-free, sp = 1, with their own checkpoint count.
            choice = self.greedy_profile_ckpt(length, 1)
            if choice.status == "ok":
                m = choice.measurement
                groups[length] = _group(length, 1, choice.ckpt_layers, role, m.time_s, m.tokens_per_s_per_gpu,
                                        m.estimated, m.source)
            elif choice.status == "skipped":
                # Same tokens per rank as the parent: its checkpoint count is a safe, unmeasured stand-in.
                self._warn(f"{role}={length}: not measured (time budget); using ckpt_layers="
                           f"{parent.ckpt_layers} of its parent length {parent.pack_len}")
                groups[length] = _group(length, 1, parent.ckpt_layers, role, None, None, True, "inherited")
            else:
                self._warn(f"{role}={length} does not fit at sp=1; group dropped")
        return [groups[k] for k in sorted(groups)]

    def _report(self, strategies: dict[int, Strategy], groups: list[dict]) -> dict:
        l_best = max(strategies, key=lambda l: (strategies[l].tokens_per_s_per_gpu, l))
        return {
            "version": PROFILE_VERSION,
            "source": self.backend.name,
            "groups": groups,
            "l_best": l_best,
            "l_max": max(strategies),
            "strategies": [strategies[k].as_dict() for k in sorted(strategies)],
            "measurements": [asdict(m) for m in self.measurements],
            "skipped": self.skipped,
            "warnings": self.warnings,
            "memory_budget_bytes": self.budget_bytes,
            "memory_metric": self.cfg.memory_metric,
            "profiler": {"wall_s": round(self.elapsed(), 3),
                         "measure_s": round(sum(m.wall_s for m in self.measurements), 3),
                         "num_measurements": len(self.measurements),
                         "time_budget_s": self.cfg.time_budget_s,
                         "budget_exhausted": bool(self.skipped)},
        }


def _group(pack_len, sp, ckpt, role, time_s, tps, estimated, source) -> dict:
    return {"pack_len": int(pack_len), "sp": int(sp), "ckpt_layers": int(ckpt), "role": role,
            "time_s": time_s, "tokens_per_s_per_gpu": tps, "estimated": bool(estimated), "source": source}


def _status(m: Measurement, prof: Optional[Profiler] = None) -> str:
    if m.oom:
        return "OOM"
    if prof is not None and not prof.fits(m):
        return "over budget"
    return "ok"


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="profile (length, sp)", unit="cfg", file=sys.stderr, dynamic_ncols=True)


# ============================================================================================ NVML (optional)
_nvml = {"state": None}  # None = not tried yet, True = initialised, False = unavailable (logged once)


def nvml_available() -> bool:
    """Initialise NVML once. Without a GPU/driver nvmlInit raises NVMLError_LibraryNotFound (~1 ms): degrade to
    torch's counters and say so in one log line, not once per measurement."""
    if _nvml["state"] is None:
        try:
            import pynvml  # the nvidia-ml-py package
        except ImportError:
            _nvml["state"] = False
            log.warning("NVML unavailable (nvidia-ml-py not installed): memory from torch counters only")
            return False
        try:
            pynvml.nvmlInit()
            _nvml["state"] = True
        except pynvml.NVMLError as exc:
            _nvml["state"] = False
            log.warning("NVML unavailable (%s): memory from torch counters only", type(exc).__name__)
    return bool(_nvml["state"])


def nvml_used_bytes(index: int = 0) -> Optional[int]:
    """Used memory of GPU `index` as the driver sees it (all processes, allocator cache, CUDA context)."""
    if not nvml_available():
        return None
    import pynvml

    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index)).used)
    except pynvml.NVMLError as exc:  # e.g. a virtualised GPU that hides it: fall back to torch's counters
        _nvml["state"] = False
        log.warning("NVML memory reading failed (%s): memory from torch counters only", type(exc).__name__)
        return None


def nvml_hardware() -> Optional[dict]:
    """GPU names, memory, count and driver version from NVML, or None without NVML."""
    if not nvml_available():
        return None
    import pynvml

    try:
        count = pynvml.nvmlDeviceGetCount()
        gpus = []
        for i in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(handle)
            gpus.append({"index": i, "name": name.decode() if isinstance(name, bytes) else name,
                         "memory_bytes": int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)})
        driver = pynvml.nvmlSystemGetDriverVersion()
    except pynvml.NVMLError as exc:  # called after all the measuring: never lose the profile over it
        log.warning("NVML hardware query failed (%s)", type(exc).__name__)
        return None
    return {"gpu_count": count, "gpus": gpus, "driver": driver.decode() if isinstance(driver, bytes) else driver}


# ========================================================================================= synthetic packs
def load_doc_lengths(spec: str) -> Optional[np.ndarray]:
    """Sample lengths to draw synthetic documents from (None for "single"); ValueError names the file."""
    if spec == "single":
        return None
    path = Path(spec)
    try:
        if path.is_dir():
            from datasets import load_from_disk

            lengths = np.asarray(load_from_disk(str(path))["length"])
        elif path.suffix == ".npy":
            lengths = np.load(path)
        elif path.suffix == ".json":
            data = json.loads(path.read_text())
            lengths = np.asarray(data["lengths"] if isinstance(data, dict) else data)
        else:
            lengths = np.loadtxt(path, ndmin=1)
    except (OSError, ValueError, KeyError) as exc:
        raise ValueError(f"profile.docs={spec}: cannot read sample lengths ({exc}); give a tokenized dataset dir "
                         "or a .npy/.json/.txt list of lengths") from None
    lengths = np.asarray(lengths, dtype=np.float64).ravel()
    if lengths.size == 0 or (lengths < 1).any() or (lengths != np.round(lengths)).any():
        raise ValueError(f"profile.docs={spec}: sample lengths must be a non-empty list of positive integers")
    return lengths.astype(np.int64)


def synthetic_docs(pack_len: int, pool: Optional[np.ndarray], seed: int = 0) -> list[int]:
    """Document lengths of a full synthetic pack: one document, or draws from `pool` (the last one cut to fit)."""
    if pool is None:
        return [int(pack_len)]
    rng = np.random.default_rng([seed, pack_len])
    docs, left = [], int(pack_len)
    while left > 0:
        length = min(int(pool[rng.integers(len(pool))]), left)
        docs.append(length)
        left -= length
    return docs


def slice_docs(docs: list[int], sp: int) -> list[int]:
    """Documents of a pack shrunk by sp (each at least 1 token) summing to sum(docs)//sp: the per-rank stand-in
    used to estimate an SP degree that cannot be measured."""
    target = max(1, sum(docs) // sp)
    if target < len(docs):  # more documents than the slice has tokens: as many 1-token documents as it has
        return [1] * target
    out = [max(1, d // sp) for d in docs]
    # Fix the rounding on the longest documents so the slice has exactly `target` tokens.
    order = np.argsort(out)[::-1]
    diff, i = target - sum(out), 0
    while diff != 0:
        j = order[i % len(order)]
        if diff > 0:
            out[j] += 1
            diff -= 1
        elif out[j] > 1:
            out[j] -= 1
            diff += 1
        i += 1
    return [d for d in out if d > 0]


# ========================================================================================= memory model
def model_state_bytes(params: int, world_size: int, job: JobSettings) -> int:
    """Per-GPU bytes of model states in bf16 mixed precision under ZeRO (the ZeRO paper's accounting):
    bf16 params 2 B (sharded at stage 3), bf16 grads 2 B (stage >= 2), and fp32 master weights, Adam m and v and
    DeepSpeed's fp32 gradient partition 16 B (stage >= 1; none on the GPU with optimizer offload)."""
    w, stage = world_size, job.zero_stage
    optimizer = 0 if job.offload_optimizer else 16 * params / (w if stage >= 1 else 1)
    return int(2 * params / (w if stage >= 3 else 1) + 2 * params / (w if stage >= 2 else 1) + optimizer)


def activation_bytes_per_token_layer(shape: ModelShape) -> int:
    """bf16 activations one non-checkpointed decoder layer keeps per (rank-local) token for backward:
    two RMSNorm inputs+outputs (4h), q, rotated q, attention output (3 x heads*head_dim), k, v, rotated k
    (3 x kv width) and the gated MLP's gate, up, act(gate) and product (4 x ffn). Ulysses moves heads, not
    tokens, so per rank it is the same count at any SP degree."""
    kv_width = shape.num_kv_heads * shape.head_dim
    return 2 * (4 * shape.hidden + 3 * shape.attn_width + 3 * kv_width + 4 * shape.ffn)


def analytic_memory_bytes(shape: ModelShape, pack_len: int, sp: int, ckpt_layers: int, world_size: int,
                          job: JobSettings) -> int:
    """Modelled peak memory of one rank: model states + kept activations + one recomputed layer + loss chunk.

    A checkpointed layer keeps only its bf16 input (2h bytes per token); in backward one checkpointed layer at a
    time is rebuilt in full. The chunked loss holds one chunk of fp32 logits and their gradient (plus a bf16 copy).
    """
    tokens = -(-pack_len // sp)
    full = activation_bytes_per_token_layer(shape)
    kept = 2 * shape.hidden
    layers = shape.num_layers
    acts = tokens * ((layers - ckpt_layers) * full + ckpt_layers * kept)
    recompute = tokens * full if ckpt_layers > 0 else 0
    embed_and_final = tokens * 2 * shape.hidden * 3  # embedding output, final norm in/out
    chunk = min(job.loss_chunk_tokens, tokens)
    loss = chunk * shape.vocab * (4 + 4 + 2)
    states = model_state_bytes(shape.num_params, world_size, job)
    return int(states + acts + recompute + embed_and_final + loss)


def memory_preflight(groups: list[dict], shape: ModelShape, world_size: int, job: JobSettings,
                     device_bytes: int, headroom: float = 0.05) -> list[str]:
    """Warnings for the packing groups that the memory model predicts will not fit one GPU of ``device_bytes``.

    The trainer runs this before it builds anything on a GPU (a 128K group that cannot fit should not cost the
    minutes of loading a large model first); it is advice from analytic_memory_bytes, not a measurement."""
    warnings = []
    for g, group in enumerate(groups):
        pack_len, sp, ckpt = int(group["pack_len"]), int(group.get("sp", 1)), int(group.get("ckpt_layers") or 0)
        need = analytic_memory_bytes(shape, pack_len, sp, ckpt, world_size, job)
        if need > (1.0 - headroom) * device_bytes:
            warnings.append(
                f"group {g} ({pack_len} tokens, sp={sp}, {ckpt} checkpointed layers) is predicted to need "
                f"{need / 2**30:.1f} GiB of the GPU's {device_bytes / 2**30:.1f} GiB: raise its ckpt_layers "
                f"(train.ckpt_layers) or sp, or let python -m hbp_train.profiler choose")
    return warnings


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
    `analytic_memory_bytes`. Nothing runs; every number is labelled "analytic"."""

    name = "analytic"

    def __init__(self, shape: ModelShape, cfg: ProfileConfig, cost_model: CostModel, job: JobSettings):
        self.shape, self.cfg, self.cost_model, self.job = shape, cfg, cost_model, job
        self.num_layers = shape.num_layers
        self.device_memory_bytes = int(cfg.device_memory_gb * 1e9)
        self.num_gpus = cfg.world_size  # nothing is measured, so nothing is "estimated" beyond being analytic
        self.pool = load_doc_lengths(cfg.docs)

    def measure(self, pack_len: int, sp: int, ckpt_layers: int, iters: int) -> Measurement:
        cfg = self.cfg
        mem = analytic_memory_bytes(self.shape, pack_len, sp, ckpt_layers, cfg.world_size, self.job)
        oom = mem > self.device_memory_bytes
        docs = synthetic_docs(pack_len, self.pool, cfg.seed)
        t = None if oom else self.cost_model.pack_time(docs, sp, ckpt_layers, gpus_per_node=cfg.gpus_per_node)
        return Measurement(pack_len, sp, ckpt_layers, t, mem, None, oom=oom, source="analytic",
                           note=f"cost model: {self.cost_model.source}")

    def hardware(self) -> dict:
        return {"backend": "analytic", "device_memory_bytes": self.device_memory_bytes,
                "gpu_count": self.cfg.world_size, "gpus_per_node": self.cfg.gpus_per_node,
                "cost_model": self.cost_model.describe()["note"], "note": "assumed, nothing measured (--dry-run)"}


class GpuBackend:
    """Measure on this machine's first GPU (one process). sp=1 runs the whole pack; sp > 1 cannot be run on one
    GPU and is estimated from the per-rank slice (see `_estimate`).

    Each measurement: build a synthetic pack (random token ids, position_ids restarting per document, labels on
    every token), set the checkpointed layers, run `warmup_iters` + `iters` fwd+bwd with the chunked LM-head loss,
    time each with CUDA events (median), read torch's peak allocated memory and NVML used memory. Model states:
    the GPU holds the bf16 params and grads in full; the training job holds its ZeRO shards plus fp32 optimizer
    states, so `model_state_bytes(...) - 4 x params` is added to both memory readings (no optimizer is built:
    its step costs the same per token for every configuration).
    """

    name = "gpu"

    def __init__(self, model_cfg, cfg: ProfileConfig, cost_model: CostModel, job: JobSettings,
                 vocab_size: Optional[int] = None, device=None):
        import torch

        from hbp_train.model import build_model, decoder_layers
        from hbp_train.model import num_params as model_num_params

        self.torch = torch
        self.cfg, self.cost_model, self.loss_chunk = cfg, cost_model, job.loss_chunk_tokens
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.on_gpu = self.device.type == "cuda"
        self.model = build_model(model_cfg, vocab_size=vocab_size).to(self.device)
        self.model.train()
        self.num_layers = len(decoder_layers(self.model))
        self.params = model_num_params(self.model)
        elem = next(self.model.parameters()).element_size()
        self.state_correction = model_state_bytes(self.params, cfg.world_size, job) - 2 * elem * self.params
        if self.on_gpu:
            self.device_memory_bytes = int(torch.cuda.get_device_properties(self.device).total_memory)
        else:  # CPU: only for exercising this code path in tests; memory is not measured there
            self.device_memory_bytes = int(cfg.device_memory_gb * 1e9)
        self.num_gpus = 1
        self.vocab = self.model.get_output_embeddings().weight.shape[0]
        self.pool = load_doc_lengths(cfg.docs)

    def hardware(self) -> dict:
        torch = self.torch
        if not self.on_gpu:
            return {"backend": "gpu", "device": str(self.device), "note": "CPU run: times only, no memory"}
        props = torch.cuda.get_device_properties(self.device)
        info = {"backend": "gpu", "gpu_name": props.name, "device_memory_bytes": int(props.total_memory),
                "gpus_measured": 1, "torch": torch.__version__, "cuda": torch.version.cuda}
        info["nvml"] = nvml_hardware()
        return info

    def measure(self, pack_len: int, sp: int, ckpt_layers: int, iters: int) -> Measurement:
        docs = synthetic_docs(pack_len, self.pool, self.cfg.seed)
        if sp > self.num_gpus:
            return self._estimate(pack_len, docs, sp, ckpt_layers, iters)
        t, peak, used = self._run(docs, ckpt_layers, iters)
        return self._measurement(pack_len, sp, ckpt_layers, t, peak, used, estimated=False)

    def _measurement(self, pack_len, sp, ckpt, t, peak, used, estimated, note="") -> Measurement:
        if t is None:
            return Measurement(pack_len, sp, ckpt, None, None, None, oom=True, estimated=estimated, note=note)
        fix = self.state_correction
        return Measurement(pack_len, sp, ckpt, t, None if peak is None else peak + fix,
                           None if used is None else used + fix, estimated=estimated, note=note)

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

    def _run(self, docs: list[int], ckpt: int, iters: int):
        """(median seconds, peak allocated bytes, NVML used bytes) of fwd+bwd on one pack, or (None,)*3 on OOM."""
        torch = self.torch
        from hbp_train.loss import chunked_token_losses
        from hbp_train.model import forward_hidden, set_checkpointed_layers

        tokens = sum(docs)
        gen = torch.Generator(device="cpu").manual_seed(self.cfg.seed)
        input_ids = torch.randint(0, self.vocab, (1, tokens), generator=gen).to(self.device)
        position_ids = torch.cat([torch.arange(d) for d in docs])[None].to(self.device)
        # Labels shifted within each document: the last token of a document has no target.
        labels = torch.roll(input_ids, -1, dims=1)
        ends = torch.tensor(np.cumsum(docs) - 1, device=self.device)
        labels[0, ends] = -100
        set_checkpointed_layers(self.model, ckpt)
        weight = self.model.get_output_embeddings().weight
        times, oom = [], False
        self.model.zero_grad(set_to_none=True)
        if self.on_gpu:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            for i in range(self.cfg.warmup_iters + iters):
                timer = _Timer(torch, self.on_gpu)
                hidden = forward_hidden(self.model, input_ids, position_ids)
                loss = chunked_token_losses(hidden, weight, labels, self.loss_chunk).sum() / tokens
                loss.backward()
                timer.stop()
                del hidden, loss
                if i >= self.cfg.warmup_iters:
                    times.append(timer)
            if self.on_gpu:
                torch.cuda.synchronize(self.device)
        except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is one; metrics.is_oom knows the others
            from hbp_train.telemetry import is_oom

            if not is_oom(exc):
                raise
            oom = True
        hidden = loss = None  # noqa: F841  (drop the last iteration's graph if the OOM left it bound)
        # Outside the except block, so the exception's frames (holding activations) are gone before freeing.
        if oom:
            result = (None, None, None)
        elif self.on_gpu:
            result = (float(np.median([t.seconds() for t in times])),
                      int(torch.cuda.max_memory_allocated(self.device)), nvml_used_bytes(self.device.index or 0))
        else:
            result = (float(np.median([t.seconds() for t in times])), None, None)
        self.model.zero_grad(set_to_none=True)
        if oom:
            gc.collect()  # reference cycles through the exception's frames may still hold activations
        if self.on_gpu:
            torch.cuda.empty_cache()
        return result


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


# ============================================================================================ the report
def format_table(profile: dict) -> str:
    """Every measurement, then the chosen groups, as a fixed-width text table."""
    budget = profile["memory_budget_bytes"]
    rows = [f"{'pack_len':>9} {'sp':>3} {'ckpt':>4} {'purpose':<10} {'time ms':>9} {'tok/s/GPU':>10} "
            f"{'peak GiB':>8} {'nvml GiB':>8} {'status':<11} source"]
    for m in profile["measurements"]:
        mem = m["nvml_used_bytes"] if (profile.get("memory_metric") == "nvml" and m["nvml_used_bytes"]) \
            else m["peak_mem_bytes"]
        status = "OOM" if m["oom"] else ("over budget" if mem is None or mem > budget else "ok")
        tps = m["pack_len"] / (m["time_s"] * m["sp"]) if m["time_s"] else None
        source = m["source"] + (" (estimated)" if m["estimated"] else "")
        rows.append(f"{m['pack_len']:>9} {m['sp']:>3} {m['ckpt_layers']:>4} {m['purpose']:<10} "
                    f"{_fmt(m['time_s'], 1e3, '.1f'):>9} {_fmt(tps, 1, ',.0f'):>10} "
                    f"{_fmt(m['peak_mem_bytes'], 1 / GIB, '.1f'):>8} {_fmt(m['nvml_used_bytes'], 1 / GIB, '.1f'):>8} "
                    f"{status:<11} {source}")
    rows.append("")
    label = " (ANALYTIC ESTIMATE, nothing measured)" if profile["source"] == "analytic" else ""
    rows.append(f"chosen groups{label}: l_best={profile['l_best']} l_max={profile['l_max']}")
    for g in profile["groups"]:
        flags = (" estimated" if g["estimated"] else "") + (f" [{g['source']}]" if g["source"] != "gpu" else "")
        rows.append(f"  pack_len={g['pack_len']:>7} sp={g['sp']} ckpt_layers={g['ckpt_layers']:<3} "
                    f"tok/s/GPU={_fmt(g['tokens_per_s_per_gpu'], 1, ',.0f')}  ({g['role']}){flags}")
    for s in profile["skipped"]:
        rows.append(f"skipped: {s}")
    for w in profile["warnings"]:
        rows.append(f"warning: {w}")
    p = profile["profiler"]
    rows.append(f"profiler: {p['num_measurements']} measurements, {p['wall_s']:.1f} s "
                f"(budget {p['time_budget_s']:g} s{', exhausted' if p['budget_exhausted'] else ''})")
    if "predicted_gpu_measure_s" in p:
        rows.append(f"predicted GPU measuring time for this profile: {p['predicted_gpu_measure_s']:.0f} s "
                    "(timed iterations only)")
    return "\n".join(rows)


def _fmt(value, scale, spec) -> str:
    return "-" if value is None else format(value * scale, spec)


# ============================================================================================ entry point
HELP = """usage: python -m hbp_train.profiler [OVERRIDES...]

Auto group selection (HBP Alg. 1/3/4): profile (SP degree, checkpointed layers) for each candidate pack length and
write the packing groups to profile.json for `python -m data_tools.pack --groups auto --profile profile.json`.
The config is the trainer's (conf/config.yaml, Hydra overrides): model=..., deepspeed=... (ZeRO stage, optimizer
offload), loss.chunk_size=..., and the profile.* fields below.

profile.* options (defaults in brackets):
  max_len [131072]          longest pack length (the longest training sample): l_max
  min_len [8192]            shortest candidate; candidates = powers of two in [min_len, max_len] + max_len
  lengths [[]]              explicit candidate lengths instead (e.g. profile.lengths=[4096,8192,16384])
  world_size [8]            GPUs of the training job: SP degrees = powers of two dividing it; ZeRO shards over it
  sp_degrees [[]]           SP degrees to try (default all of the above)
  gpus_per_node [8]         SP groups larger than a node use the inter-node bandwidth (comm model)
  headroom [0.9]            fraction of device memory a configuration may use
  memory_metric [nvml]      nvml (device used memory, as the paper) or torch (peak allocated)
  ckpt_probe_layers [null]  the 'fewer checkpointed layers' probe of Alg. 4 (null = half the layers)
  warmup_iters [1] iters [3]  untimed and timed fwd+bwd iterations per measurement (median recorded)
  time_budget_s [300]       stop starting measurements after this; choose from what was measured
  prune [true]              skip larger SP for a length once one needs no checkpointing
  docs [single]             synthetic pack: one document, or a tokenized dataset dir / .npy/.json/.txt lengths
  seed [0]                  seed for document lengths and token ids
  dry_run [false]           no GPU: analytic estimate (cost model + memory model), labelled "analytic"
  calibration ['']          cost-model calibration JSON (default: the shipped H100 one, scaled to the model)
  device_memory_gb [80]     device memory assumed by dry_run
  output [profile.json]     where to write the profile
  progress [true]           tqdm progress bar

Without a GPU and without profile.dry_run=true: one line and exit code 2. Bad values: one line naming the field,
exit code 2. A dry run needs only the model's config.json (model.name_or_path=DIR holding it; without a tokenizer
the config's vocab_size is used) and no data.shards, e.g.
  python -m hbp_train.profiler experiment=llama3_8b_128k model.name_or_path=DIR profile.dry_run=true
See docs/profiler.md.
"""


def model_shape_of(model_cfg, vocab_size: Optional[int]) -> ModelShape:
    """The ModelShape of a ModelConfig from its HF config alone (no weights are built)."""
    from transformers import AutoConfig

    overrides = dict(model_cfg.config)
    if model_cfg.name_or_path is not None:
        hf = AutoConfig.from_pretrained(model_cfg.name_or_path, **overrides)
        name = Path(model_cfg.name_or_path).name
    else:
        hf = AutoConfig.for_model(model_cfg.architecture, **overrides)
        name = f"{model_cfg.architecture}-from-config"
    fields = hf.to_dict()
    # What build_model does with the tokenizer's vocabulary: a config-built model gets the larger of it and a
    # vocab_size given in model.config; a pretrained one grows to it, never shrinks.
    if vocab_size is not None and model_cfg.name_or_path is None:
        fields["vocab_size"] = max(vocab_size, int(overrides.get("vocab_size") or 0))
    elif vocab_size is not None and vocab_size > fields["vocab_size"]:
        fields["vocab_size"] = vocab_size
    if not fields.get("head_dim"):
        fields.pop("head_dim", None)
    fields["name"] = name
    return parse_model_shape(fields)


def tokenizer_vocab(tokenizer_dir: str, dry_run: bool) -> Optional[int]:
    """The tokenizer's vocabulary size (what build_model sizes the embeddings by). A dry run without a loadable
    tokenizer uses the model config's vocab_size (warned); a GPU run needs it (ValueError naming the field)."""
    from transformers import AutoTokenizer

    try:
        return len(AutoTokenizer.from_pretrained(tokenizer_dir))
    except (OSError, ValueError) as e:
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if not dry_run:
            raise ValueError(f"model.tokenizer: cannot load a tokenizer from {tokenizer_dir!r} ({reason}); set "
                             "model.tokenizer=DIR (e.g. data_tools/assets/tokenizer)") from None
        log.warning("model.tokenizer: no tokenizer in %r; the dry run uses the model config's vocab_size",
                    tokenizer_dir)
        return None


def usable_sp_degrees(candidates: list[int], shape: ModelShape) -> list[int]:
    """The SP degrees Ulysses can run for this model's heads (ulysses.check_sp_heads); says which were dropped."""
    from hbp_train.distributed.ulysses import check_sp_heads

    usable = []
    for sp in candidates:
        try:
            check_sp_heads(shape.num_heads, shape.num_kv_heads, [sp])
            usable.append(sp)
        except ValueError as e:
            log.warning("skipping %s", str(e).split(":")[0])
    return usable


def main(argv: Optional[list] = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a in ("-h", "--help") for a in argv):
        print(HELP, end="")
        return 0
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    t0 = time.monotonic()
    from hbp_train import config as run_config

    overrides = run_config.user_overrides(argv)
    if not any(o.lstrip("+~").startswith("data.shards=") for o in overrides):
        # The profiler reads no data (it runs before packing), but presets such as experiment=llama3_8b_128k
        # leave data.shards required.
        overrides.append("data.shards=unused-by-profiler")
    try:
        run = run_config.load(overrides)
    except run_config.ConfigError as e:
        hint = ""
        if str(e).startswith("model.name_or_path"):
            hint = ("; the profiler needs only the model's config.json (plus a tokenizer, or model.tokenizer=DIR): "
                    "point model.name_or_path (or HBP_MODEL_DIR) at a directory holding it")
        print(f"profile: config error: {e}{hint}", file=sys.stderr)
        return 2
    pcfg: ProfileConfig = run.profile
    job = JobSettings(zero_stage=run.deepspeed.zero_stage, offload_optimizer=run.deepspeed.offload_optimizer,
                      loss_chunk_tokens=run.loss.chunk_size)
    if not pcfg.dry_run:
        import torch

        if not torch.cuda.is_available():
            print("profile: no CUDA GPU found: the profiler measures on a GPU; add profile.dry_run=true for the "
                  "analytic estimate from the model config and the calibration", file=sys.stderr)
            return 2
    path = Path(pcfg.output)
    try:  # fail now, not after the profiling
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_dir():
            raise IsADirectoryError(21, "it is a directory; give a file path such as profile.json")
        if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise PermissionError(13, "permission denied")
    except OSError as e:
        print(f"profile: profile.output={pcfg.output}: cannot write there ({e.strerror})", file=sys.stderr)
        return 2
    try:
        vocab = tokenizer_vocab(run.model.tokenizer, pcfg.dry_run)
        shape = model_shape_of(run.model, vocab)
        cost_model = CostModel.from_calibration(pcfg.calibration or None, model_shape=shape)
        if pcfg.dry_run:
            backend = AnalyticBackend(shape, pcfg, cost_model, job)
        else:
            backend = GpuBackend(run.model, pcfg, cost_model, job, vocab_size=vocab)
    except (ValueError, OSError) as e:
        print(f"profile: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    setup_s = time.monotonic() - t0
    sp_degrees = usable_sp_degrees(pcfg.sp_candidates(), shape)
    profiler = Profiler(backend, pcfg, sp_degrees=sp_degrees)
    try:
        out = profiler.run()
    except ProfileError as e:
        print(f"profile: {e}", file=sys.stderr)
        return 1
    out["hardware"] = backend.hardware()
    out["model"] = {**asdict(shape), "num_params": getattr(backend, "params", shape.num_params)}
    out["job"] = {"world_size": pcfg.world_size, **asdict(job)}
    out["config"] = asdict(pcfg)
    out["profiler"]["setup_s"] = round(setup_s, 3)
    out["profiler"]["total_s"] = round(time.monotonic() - t0, 3)
    if pcfg.dry_run:
        # What the same profile would spend measuring on a GPU (iterations only: no model build, no OOM cost).
        # GpuBackend runs every sp > 1 as its l/sp slice on one GPU: about time/sp of the SP configuration.
        out["profiler"]["predicted_gpu_measure_s"] = round(sum(
            (pcfg.warmup_iters + pcfg.iters) * m["time_s"] / m["sp"] for m in out["measurements"] if m["time_s"]), 1)
    try:
        path.write_text(json.dumps(out, indent=1) + "\n")
    except OSError as e:
        print(f"profile: profile.output={pcfg.output}: cannot write ({e.strerror})", file=sys.stderr)
        return 2
    print(format_table(out))
    print(f"wrote {path}: use it with  python -m data_tools.pack --groups auto --profile {path} "
          f"--world-size {pcfg.world_size} ...")
    return 0


if __name__ == "__main__":
    sys.exit(main())
