"""Settings of the auto group selection profiler: the `profile` group of the run config (`profile.*` overrides).

Kept apart from the profiler's code so that hbp_train.config can compose it without importing the profiler:
plain dataclass, no torch. Every bad value raises UserError naming the `profile.` field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from hbp_train.common.errors import UserError


@dataclass
class ProfileConfig:
    """Settings of the auto group selection profiler (the `profile` config group)."""

    max_len: int = 131072
    """Longest pack length to consider: the longest sample the training data holds (l_max of Alg. 1)."""
    min_len: int = 8192
    """Shortest candidate pack length; candidates are the powers of two from here up to max_len, plus max_len. Left at
    its default with a shorter max_len, hbp-profile lowers it to max_len (one note); set above max_len, an error."""
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
    """Device memory assumed by --dry-run and by device=cpu (the GPU backend reads the real one): the size a GPU is
    sold as, "80" for an H100 80GB, which is 80 GiB (2^30 bytes; nvidia-smi shows 81559 MiB), so read as GiB."""
    device: str = "cuda"
    """Where measurements run: "cuda" (the GPUs) or "cpu" (the real model on this CPU, gloo between processes, as
    many torch threads as OMP_NUM_THREADS: the groups for training on this CPU; give it a CPU calibration, from
    `hbp_train.perf.calibrate --device cpu`, as profile.calibration for the SP estimates)."""
    measure_devices: Optional[int] = None
    """Devices this machine lends to measuring SP > 1: each SP degree up to it (and up to gpus_per_node) is measured
    by one torchrun of that many ranks; larger degrees are estimated. None = the CUDA devices present (device=cpu:
    1, i.e. estimate every sp > 1); 1 = measure sp=1 only."""
    worker_timeout_s: float = 600.0
    """A measuring torchrun is stopped after the time budget left plus this many seconds (start-up, model load, the
    measurement under way); the points of its SP degree it did not measure are then estimated, with a warning."""
    levers: bool = True
    """Search the memory levers per pack length: the tiled MLP and activation offload (with checkpointing), each
    kept only where it makes a configuration faster under the memory limit (docs/profiler.md)."""
    zero_stages: list[int] = field(default_factory=lambda: [1, 2, 3])
    """ZeRO stages the profiler chooses the run's among (the longest trainable packs first, then the fastest); empty
    = the job's own deepspeed.zero_stage only. The plan names the chosen stage; training refuses another one."""
    zero_offload: bool = False
    """Also consider each stage with optimizer offload, and ZeRO-3 with optimizer and parameter offload (slower;
    for models whose states would not fit the GPUs otherwise)."""
    global_tokens: int = 4194304
    """Tokens per optimizer step of the job (hbp-pack's --global-tokens): ZeRO's per-step collectives and optimizer
    step are spread over the micro-batches a replica runs in such a step."""
    comm_overlap: float = 0.0
    """Share (0..1) of ZeRO's per-micro-batch collectives hidden behind compute when costing a stage (as
    hbp-simulate's --comm-overlap; 0: all exposed)."""
    pcie_gbps: Optional[float] = None
    """Host <-> GPU bandwidth per GPU and direction, GB/s, for activation and ZeRO offload (null: the cost model's
    25, hbp_train/perf/cost_model.py)."""
    output: str = "profile.json"
    """Where to write the profile (groups, every measurement, hardware, model shape, profiler timings)."""
    progress: bool = True
    """Show a tqdm progress bar."""

    def __post_init__(self):
        if self.max_len < 2:
            raise UserError(f"profile.max_len must be >= 2, got {self.max_len}")
        if not 1 <= self.min_len <= self.max_len:
            raise UserError(f"profile.min_len must be in [1, max_len={self.max_len}], got {self.min_len}")
        if any(int(x) < 1 or int(x) > self.max_len for x in self.lengths):
            raise UserError(f"profile.lengths must be in [1, max_len={self.max_len}], got {list(self.lengths)}")
        if self.world_size < 1:
            raise UserError(f"profile.world_size must be >= 1, got {self.world_size}")
        for sp in self.sp_degrees:
            if sp < 1 or sp & (sp - 1) or self.world_size % sp:
                raise UserError(f"profile.sp_degrees: {sp} is not a power of two dividing world_size="
                                f"{self.world_size}")
        if self.gpus_per_node < 1:
            raise UserError(f"profile.gpus_per_node must be >= 1, got {self.gpus_per_node}")
        if not 0 < self.headroom <= 1:
            raise UserError(f"profile.headroom must be in (0, 1], got {self.headroom}")
        if self.memory_metric not in ("nvml", "torch"):
            raise UserError(f"profile.memory_metric must be 'nvml' or 'torch', got {self.memory_metric!r}")
        if self.ckpt_probe_layers is not None and self.ckpt_probe_layers < 0:
            raise UserError(f"profile.ckpt_probe_layers must be >= 0 or null, got {self.ckpt_probe_layers}")
        if self.warmup_iters < 0:
            raise UserError(f"profile.warmup_iters must be >= 0, got {self.warmup_iters}")
        if self.iters < 1:
            raise UserError(f"profile.iters must be >= 1, got {self.iters}")
        if self.time_budget_s <= 0:
            raise UserError(f"profile.time_budget_s must be > 0, got {self.time_budget_s}")
        if self.docs != "single" and not Path(self.docs).exists():
            raise UserError(f"profile.docs: {self.docs!r} is neither 'single' nor an existing file/directory")
        if self.device_memory_gb <= 0:
            raise UserError(f"profile.device_memory_gb must be > 0, got {self.device_memory_gb}")
        if self.device not in ("cuda", "cpu"):
            raise UserError(f"profile.device must be 'cuda' or 'cpu', got {self.device!r}")
        if self.measure_devices is not None and self.measure_devices < 1:
            raise UserError(f"profile.measure_devices must be >= 1 or null, got {self.measure_devices}")
        if self.worker_timeout_s <= 0:
            raise UserError(f"profile.worker_timeout_s must be > 0, got {self.worker_timeout_s}")
        if not self.output:
            raise UserError("profile.output must name a file")
        if any(int(z) not in (1, 2, 3) for z in self.zero_stages):
            raise UserError(f"profile.zero_stages must hold ZeRO stages 1, 2 or 3, got {list(self.zero_stages)}")
        if self.global_tokens < 1:
            raise UserError(f"profile.global_tokens must be >= 1, got {self.global_tokens}")
        if not 0 <= self.comm_overlap <= 1:
            raise UserError(f"profile.comm_overlap must be in [0, 1], got {self.comm_overlap}")
        if self.pcie_gbps is not None and not self.pcie_gbps > 0:
            raise UserError(f"profile.pcie_gbps must be > 0 or null, got {self.pcie_gbps}")
        if self.seed < 0:
            raise UserError(f"profile.seed must be >= 0, got {self.seed}")
        if self.calibration and not Path(self.calibration).is_file():
            raise UserError(f"profile.calibration: {self.calibration!r} is not a file (a calibration JSON from "
                            "hbp_train.perf.calibrate; empty = the shipped one)")

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
