"""The ZeRO setups the auto group selection chooses among: what each holds per GPU and what it adds to a pack.

The stage is one choice for the whole run (DeepSpeed fixes it at initialize), so the profiler runs its per-length
search once per setup and keeps the setup that trains the longest packs, then the fastest (``search.Profiler``).
A setup changes two things:

* memory: the model states each GPU holds through forward and backward (``perf.memory.model_state_bytes``: stage 1
  keeps whole bf16 gradients, stage 2 shards them, stage 3 also the parameters, which it gathers per module:
  ``zero3_working_bytes``). A measurement made for the job's own settings is moved to another setup by the
  difference of those terms (activations do not depend on the stage);
* time: ZeRO's collectives per micro-batch and per step and the optimizer step
  (``planning.simulator.zero_comm_seconds``), the per-step part spread over the micro-batches a replica runs in a
  step of ``profile.global_tokens`` tokens. Stage 1 reduces once per step, stage 2 every micro-batch, stage 3
  gathers the parameters twice and reduces once per micro-batch; optimizer or parameter offload move the step and
  the partitions to the host (slower, less GPU memory).

Pure Python over the memory model and the simulator's collective model; nothing runs.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from hbp_train.perf.cost_model import DEFAULT_PCIE_GBPS
from hbp_train.perf.memory import JobSettings, model_state_bytes, zero3_working_bytes
from hbp_train.perf.profile_config import ProfileConfig
from hbp_train.perf.shape import ModelShape


@dataclass(frozen=True)
class ZeroSetup:
    """One ZeRO configuration of the run: the stage and what it offloads to the host."""

    stage: int
    """deepspeed.zero_stage: 1, 2 or 3."""
    offload_optimizer: bool = False
    """deepspeed.offload_optimizer: optimizer state and step on the CPU."""
    offload_param: bool = False
    """deepspeed.offload_param: parameter partitions on the CPU (stage 3 only)."""

    def job(self, base: JobSettings) -> JobSettings:
        """``base`` (the job's memory settings) at this setup. Stage 1 sums gradients in bf16 (DeepSpeed's ZeRO-1 has
        no fp32 accumulation, hbp_train.build.DeepSpeedConfig)."""
        return replace(base, zero_stage=self.stage, offload_optimizer=self.offload_optimizer,
                       offload_param=self.offload_param,
                       grad_accum_fp32=base.grad_accum_fp32 and self.stage >= 2)

    def describe(self) -> str:
        """"ZeRO-2", "ZeRO-3 + optimizer & parameter offload"."""
        return JobSettings(zero_stage=self.stage, offload_optimizer=self.offload_optimizer,
                           offload_param=self.offload_param).describe()

    def as_dict(self) -> dict:
        return {"zero_stage": self.stage, "offload_optimizer": self.offload_optimizer,
                "offload_param": self.offload_param}


@dataclass
class ZeroChoice:
    """The setups to choose among for one job, and how to cost a measurement under each."""

    setups: list[ZeroSetup]
    """Candidates, in the order ties are broken (the first wins)."""
    base: JobSettings
    """The job's settings the backend's memory readings were made for (its state correction)."""
    shape: ModelShape
    """The model (parameter count, ZeRO-3's gathered matrices)."""
    cfg: ProfileConfig
    """world_size, the links and the step size."""

    def memory_delta(self, setup: ZeroSetup) -> int:
        """Bytes a rank holds more (or less) under ``setup`` than under the job's settings through forward and
        backward: model states and ZeRO-3's gathered parameters (the loss's, the larger)."""
        def held(job: JobSettings) -> int:
            return (model_state_bytes(self.shape.num_params, self.cfg.world_size, job)
                    + zero3_working_bytes(self.shape, job, loss=True))
        return held(setup.job(self.base)) - held(self.base)

    def pack_seconds(self, setup: ZeroSetup, pack_len: int, sp: int) -> float:
        """ZeRO's seconds per pack of ``pack_len`` tokens at SP degree ``sp``: the per-micro-batch collectives plus
        the per-step collectives and optimizer step divided by the micro-batches a replica runs in a step of
        ``profile.global_tokens`` tokens (at least one). Collectives exposed as ``profile.comm_overlap`` says."""
        from hbp_train.planning.simulator import SimConfig, zero_comm_seconds

        cfg = self.cfg
        sim = SimConfig(gpus_per_node=cfg.gpus_per_node, zero_stage=setup.stage, comm_overlap=cfg.comm_overlap,
                        pcie_gbps=pcie_gbps(cfg), offload_optimizer=setup.offload_optimizer,
                        offload_param=setup.offload_param)
        comm = zero_comm_seconds(self.shape.num_params, cfg.world_size, sim)
        replicas = max(1, cfg.world_size // sp)
        micro_batches = max(1, round(cfg.global_tokens / (pack_len * replicas)))
        return (1.0 - cfg.comm_overlap) * comm["micro"] + (comm["step"] + comm["optimizer"]) / micro_batches


def pcie_gbps(cfg: ProfileConfig) -> float:
    """The host <-> GPU bandwidth the profile assumes: profile.pcie_gbps, else the cost model's default."""
    return cfg.pcie_gbps if cfg.pcie_gbps is not None else DEFAULT_PCIE_GBPS


def candidate_setups(cfg: ProfileConfig, base: JobSettings) -> list[ZeroSetup]:
    """The setups ``profile.zero_stages`` names (default 1, 2, 3; empty, or measuring on the CPU: the job's own stage
    only), each with the job's optimizer offload; parameter offload only at stage 3 (where the job asks for it).
    ``profile.zero_offload=true`` adds each stage with optimizer offload and stage 3 with both offloads (for models
    whose states do not fit otherwise)."""
    stages = sorted({int(s) for s in cfg.zero_stages}) or [base.zero_stage]
    if cfg.device == "cpu" and not cfg.dry_run:  # groups for CPU training: ZeRO's costs are modelled for GPU links
        stages = [base.zero_stage]
    setups = [ZeroSetup(s, base.offload_optimizer, base.offload_param and s == 3) for s in stages]
    if cfg.zero_offload:
        setups += [ZeroSetup(s, True, False) for s in stages] + ([ZeroSetup(3, True, True)] if 3 in stages else [])
    return list(dict.fromkeys(setups))


def choose_setup(by_setup: dict):
    """The setup (a key of ``by_setup``: setup -> {pack length: search.Strategy}) whose longest feasible length is
    longest, then the least time per token summed over the lengths every such setup trains (ties: the earlier)."""
    reach = max(max(st, default=0) for st in by_setup.values())
    best = [setup for setup, st in by_setup.items() if max(st, default=0) == reach]
    common = set.intersection(*(set(by_setup[s]) for s in best))
    return min(best, key=lambda s: sum(1.0 / by_setup[s][l].tokens_per_s_per_gpu for l in common))
