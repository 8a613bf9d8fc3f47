"""One SP degree measured on sp ranks: `python -m hbp_train.profiler.worker JOB.json`, under torchrun.

Started by launcher.py (one torchrun per degree, `--nproc_per_node=sp`). Every rank loads the run config from the
parent's overrides, builds the model (GpuBackend: on cuda:LOCAL_RANK, or the CPU with gloo for profile.device=cpu),
makes the SP groups (distributed/groups.py) and the Ulysses attention at the degree (model/ulysses.py), and
runs the profiler's own GreedyProfileCkpt (search.Profiler) for each length of the job. All ranks must take the
same decisions, so every reading is agreed over the group (slowest time, largest memory: GpuBackend._agree) and
the time budget is read from rank 0's clock (`SharedClock`). The measurements the parent already has are passed in
and answered from the cache, so a relaunch resumes where the last run stopped.

Rank 0 appends each new measurement to the job's `results` file as one JSON line, then a closing
{"done": true, "skipped", "warnings", "hardware"} line. A rank that runs out of memory (RankOutOfMemory) cannot
tell its peers, which may be waiting in an all-to-all: it writes `<oom_marker><rank>.json` naming the
configuration and ends with exit code launcher.EXIT_OOM, and torchrun stops the others.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

log = logging.getLogger(__name__)


class SharedClock:
    """Rank 0's monotonic clock, broadcast: every rank sees the same time, so the time budget stops all ranks
    before the same measurement (a collective: every rank calls it at the same points, which the search does)."""

    def __init__(self, device):
        self.device = device

    def __call__(self) -> float:
        import torch
        import torch.distributed as dist

        now = torch.tensor([time.monotonic()], dtype=torch.float64, device=self.device)
        dist.broadcast(now, src=0)
        return float(now.item())


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    job = json.loads(Path(argv[0]).read_text())
    sp = int(job["sp"])

    import torch

    from hbp_train import config as run_config
    from hbp_train.distributed.groups import build_parallel_state, init_distributed, rank
    from hbp_train.perf.cost_model import CostModel
    from hbp_train.perf.memory import JobSettings
    from hbp_train.perf.shape import model_shape_of
    from hbp_train.profiler.gpu_backend import GpuBackend, RankOutOfMemory
    from hbp_train.profiler.launcher import EXIT_OOM, measurement_from_dict
    from hbp_train.profiler.search import Profiler
    from hbp_train.profiler.zero_choice import ZeroChoice, candidate_setups

    run = run_config.load(job["overrides"])
    on_cpu = run.profile.device == "cpu"
    init_distributed("gloo" if on_cpu else "nccl")
    device = torch.device("cpu") if on_cpu else torch.device("cuda", torch.cuda.current_device())  # init's choice
    # The budget is the parent's: its wall-clock deadline, whatever start-up cost here.
    pcfg = replace(run.profile, progress=False, time_budget_s=max(job["deadline"] - time.time(), 1e-3))
    job_settings = JobSettings.of_run(run)
    shape = model_shape_of(run.model, job["vocab_size"])
    cost_model = CostModel.from_calibration(pcfg.calibration or None, model_shape=shape)
    backend = GpuBackend(run.model, pcfg, cost_model, job_settings, vocab_size=job["vocab_size"], device=device,
                         loss_impl=run.loss.impl)
    backend.device_memory_bytes = int(job["device_memory_bytes"])  # the parent's budget: the same decisions
    if job.get("device_excess_bytes") and not on_cpu:  # GPU 0 also holds the parent profiler's context
        backend.nvml_offset_bytes = int(job["device_excess_bytes"][device.index])
    backend.use_sequence_parallel(build_parallel_state([sp]), sp)
    me = rank()
    results = Path(job["results"])

    def stream(m) -> None:
        if me == 0:
            with open(results, "a") as f:
                f.write(json.dumps({"measurement": asdict(m)}) + "\n")

    zero = ZeroChoice(candidate_setups(pcfg, job_settings), job_settings, shape, pcfg)  # the parent's setups
    profiler = Profiler(backend, pcfg, clock=SharedClock(device), sp_degrees=[sp], on_measurement=stream, zero=zero)
    profiler.add_measurements([measurement_from_dict(m) for m in job["known"]])
    try:
        profiler.measure_degree(sp, [int(l) for l in job["lengths"]])
    except RankOutOfMemory as oom:
        Path(f"{job['oom_marker']}{me}.json").write_text(json.dumps(
            {"pack_len": oom.pack_len, "sp": oom.sp, "ckpt_layers": oom.ckpt_layers, "rank": me,
             "tiled_mlp": oom.tiled_mlp, "offload_activations": oom.offload_activations}))
        log.error("rank %d: %s; ending this torchrun (the profiler starts it again for the rest)", me, oom)
        _leave(EXIT_OOM)
    if me == 0:
        with open(results, "a") as f:
            f.write(json.dumps({"done": True, "skipped": profiler.skipped, "warnings": profiler.warnings,
                                "hardware": backend.hardware()}) + "\n")
    import torch.distributed as dist

    dist.barrier()  # no rank tears the group down while a peer still talks to it
    _leave(0)
    return 0


def _leave(code: int) -> None:
    """Exit without the interpreter's teardown of gloo/NCCL threads (seen to abort after a clean run); the results
    are on disk already."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
