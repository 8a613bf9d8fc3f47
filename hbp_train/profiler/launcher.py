"""The profiler's SP > 1 measurements on the node's devices: one torchrun per SP degree (the parent's side).

For each SP degree the search needs (search.Profiler._launched_degrees) that this node can run, `SpLauncher.run`
writes a job file, starts

    python -m hbp_train.launch --standalone --nproc_per_node=SP -m hbp_train.profiler.worker JOB.json

(worker.py: every rank builds the model with the Ulysses attention at that degree and runs GreedyProfileCkpt for
the lengths it is given), waits for it, and reads back the measurements rank 0 streamed to a JSON-lines file; they
are `Measurement`s like the in-process ones, with `ranks = sp` and `estimated = False`.

Failures: a rank that runs out of memory leaves a marker (worker.py) and ends the torchrun; the configuration is
recorded as OOM and the torchrun is started again for the rest (the measurements so far are passed in, so it
resumes where it stopped). Any other failure, or a torchrun still running after the time budget left plus
`profile.worker_timeout_s`, keeps what was measured and leaves the rest of that degree to the single-GPU estimate,
with one warning naming the degree, the reason and the log file (a profile is still written: a user who asked
for 8 GPUs gets every point that could be measured, and the report says which are estimated).

Where the files go: `<output stem>.sp_runs/` beside profile.output (sp<N>.job.json, sp<N>.jsonl, sp<N>.log).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Optional

from hbp_train.common.errors import UserError
from hbp_train.profiler.backends import Measurement
from hbp_train.perf.profile_config import ProfileConfig
from hbp_train.profiler.nvml import nvml_used_bytes

EXIT_OOM = 3  # a worker rank ran out of memory inside an SP configuration (worker.py)
MAX_ATTEMPTS = 32  # torchruns per degree (each OOM ends one); a bound, never reached by a sane profile


def measuring_devices(pcfg: ProfileConfig) -> int:
    """How many devices of this machine measure SP > 1 together (1 = none launched: every sp > 1 estimated)."""
    if pcfg.dry_run:
        return 1
    if pcfg.device == "cpu":
        return pcfg.measure_devices or 1
    import torch

    present = torch.cuda.device_count()
    if pcfg.measure_devices is not None and pcfg.measure_devices > present:
        raise UserError(f"profile.measure_devices={pcfg.measure_devices} but this machine shows {present} CUDA "
                        "device(s) (CUDA_VISIBLE_DEVICES); lower it or leave it unset")
    return pcfg.measure_devices or present


def launched_degrees(sp_degrees: list[int], devices: int, gpus_per_node: int) -> list[int]:
    """The SP degrees > 1 measured by a torchrun: those this machine has devices for and that stay inside one node
    of the training job (a group spanning nodes talks over the slower inter-node links, which one node cannot
    measure: the estimate's communication model covers it)."""
    return [sp for sp in sp_degrees if 1 < sp <= min(devices, gpus_per_node)]


def launch_command(sp: int, job_path: str) -> list[str]:
    """The torchrun that measures degree `sp`: `sp` local ranks, its own rendezvous port (--standalone)."""
    return [sys.executable, "-m", "hbp_train.launch", "--standalone", f"--nproc_per_node={sp}",
            "-m", "hbp_train.profiler.worker", str(job_path)]


def worker_env(device: str) -> dict:
    """The worker's environment: this checkout of hbp_train first on its path (the same code as the parent's)."""
    import hbp_train

    env = dict(os.environ)
    root = str(Path(hbp_train.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if device == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")  # sp processes share the cores (torchrun would say so, noisily)
    return env


def device_excess_bytes(num_devices: int, device: str) -> Optional[list]:
    """Per measuring device, the NVML used memory it holds beyond the idlest of them, read just before a torchrun
    starts: on GPU 0 the parent profiler's own CUDA context and allocator cache (its model waits on the CPU), which
    the torchrun's rank there would otherwise count as its own (a group's memory is its fullest rank's). The
    worker subtracts it from that rank's NVML readings. None on the CPU or without NVML readings."""
    if device != "cuda":
        return None
    used = [nvml_used_bytes(i) for i in range(num_devices)]
    if any(u is None for u in used):
        return None
    return [u - min(used) for u in used]


def measurement_from_dict(d: dict) -> Measurement:
    """A Measurement from its JSON form (unknown keys ignored)."""
    names = {f.name for f in fields(Measurement)}
    return Measurement(**{k: v for k, v in d.items() if k in names})


def read_results(path: Path) -> tuple[list[Measurement], Optional[dict]]:
    """The measurements a worker streamed (one JSON object per line) and its closing record (None when it did not
    finish: a failure or a stop). A line cut short by a kill is ignored."""
    measurements, done = [], None
    if not path.exists():
        return measurements, done
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "measurement" in record:
            measurements.append(measurement_from_dict(record["measurement"]))
        elif "done" in record:
            done = record
    return measurements, done


def read_oom(run_dir: Path, sp: int) -> Optional[dict]:
    """The configuration a rank of degree `sp` ran out of memory in (worker.py's marker), or None."""
    for marker in sorted(run_dir.glob(f"sp{sp}.oom*.json")):
        try:
            return json.loads(marker.read_text())
        except (OSError, json.JSONDecodeError):
            continue
    return None


@dataclass
class LaunchResult:
    """What one degree's torchrun(s) gave: its measurements and whether it finished."""

    sp: int
    status: str
    """"measured" (finished), "failed" or "timeout" (the rest of the degree is estimated)."""
    measurements: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    """The launcher's own: a failed or stopped torchrun (one line naming the degree, the reason and the log)."""
    log: str = ""
    wall_s: float = 0.0
    attempts: int = 0

    def summary(self) -> dict:
        """The entry of profile.json's profiler.sp_runs."""
        return {"sp": self.sp, "ranks": self.sp, "status": self.status, "measured": len(self.measurements),
                "attempts": self.attempts, "wall_s": round(self.wall_s, 3), "log": self.log}


class SpLauncher:
    """Runs one torchrun per SP degree (`degrees`) for `search.Profiler`; see the module docstring."""

    def __init__(self, overrides: list[str], pcfg: ProfileConfig, degrees: list[int], vocab_size: Optional[int],
                 device_memory_bytes: int, run_dir: Optional[Path] = None):
        self.overrides, self.pcfg, self.degrees = list(overrides), pcfg, list(degrees)
        self.vocab_size, self.device_memory_bytes = vocab_size, int(device_memory_bytes)
        out = Path(pcfg.output)
        self.run_dir = Path(run_dir) if run_dir is not None else out.parent / f"{out.stem}.sp_runs"

    def job(self, sp: int, lengths: list[int], deadline: float, known: list[Measurement]) -> dict:
        """The worker's job file: the run config (the parent's overrides), the degree, the lengths in order, the
        wall-clock deadline of the time budget, the measurements already known and where to write."""
        return {"overrides": self.overrides, "sp": sp, "lengths": [int(l) for l in lengths],
                "vocab_size": self.vocab_size, "device_memory_bytes": self.device_memory_bytes,
                "device_excess_bytes": device_excess_bytes(sp, self.pcfg.device),
                "deadline": deadline, "known": [asdict(m) for m in known],
                "results": str(self.run_dir / f"sp{sp}.jsonl"), "oom_marker": str(self.run_dir / f"sp{sp}.oom")}

    def run(self, sp: int, lengths: list[int], budget_left_s: float, known: list[Measurement]) -> LaunchResult:
        """Measure degree `sp` for `lengths` on `sp` ranks; relaunched after each OOM, never raises for a failed
        worker (the result says so and carries a warning)."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log = self.run_dir / f"sp{sp}.log"
        results = self.run_dir / f"sp{sp}.jsonl"
        result = LaunchResult(sp, "failed", log=str(log))
        deadline = time.time() + max(budget_left_s, 0.0)
        known = list(known)
        t0 = time.monotonic()
        log.write_text("")
        while result.attempts < MAX_ATTEMPTS:
            result.attempts += 1
            for stale in [results, *self.run_dir.glob(f"sp{sp}.oom*.json")]:
                stale.unlink(missing_ok=True)
            job_path = self.run_dir / f"sp{sp}.job.json"
            job_path.write_text(json.dumps(self.job(sp, lengths, deadline, known + result.measurements)))
            timeout = max(deadline - time.time(), 0.0) + self.pcfg.worker_timeout_s
            code = self._start(sp, job_path, log, timeout)
            new, done = read_results(results)
            result.measurements.extend(new)
            if done is not None:  # finished (a crash while tearing down after that loses nothing)
                # Its skips and warnings are not copied: the parent's replay of the same search meets them again.
                result.status = "measured"
                break
            oom = read_oom(self.run_dir, sp) if code == EXIT_OOM else None
            if oom is not None:
                note = f"out of memory on rank {oom['rank']} of {sp} (torchrun started again for the rest)"
                result.measurements.append(Measurement(oom["pack_len"], sp, oom["ckpt_layers"], None, None, None,
                                                       oom=True, source=self.pcfg.device.replace("cuda", "gpu"),
                                                       ranks=sp, note=note, tiled_mlp=oom.get("tiled_mlp", False),
                                                       offload_activations=oom.get("offload_activations", False)))
                continue
            result.status = "timeout" if code is None else "failed"
            why = (f"still running after {timeout:.0f} s (time budget left + profile.worker_timeout_s)"
                   if code is None else f"exit code {code}: {_last_line(log)}")
            result.warnings.append(f"sp={sp}: measuring on {sp} ranks failed ({why}); {len(result.measurements)} "
                                   f"point(s) kept, the rest estimated; log: {log}")
            break
        result.wall_s = time.monotonic() - t0
        return result

    def _start(self, sp: int, job_path: Path, log: Path, timeout: float) -> Optional[int]:
        """Run the torchrun, its output appended to `log`; its exit code, or None when stopped at `timeout`."""
        with open(log, "a") as out:
            out.write(f"$ {' '.join(launch_command(sp, str(job_path)))}\n")
            out.flush()
            proc = subprocess.Popen(launch_command(sp, str(job_path)), stdout=out, stderr=subprocess.STDOUT,
                                    env=worker_env(self.pcfg.device), start_new_session=True)
            try:
                return proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                _stop(proc)
                return None
            except BaseException:  # Ctrl-C in the parent: take the torchrun (its own session) down with it
                _stop(proc)
                raise


def _stop(proc: subprocess.Popen) -> None:
    """Stop the torchrun and its ranks (its process group): SIGTERM, then SIGKILL after 10 s."""
    for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def _last_line(log: Path) -> str:
    """The log's last non-empty line (the launcher's one-line failure, or the worker's last error line)."""
    try:
        lines = [l.strip() for l in log.read_text(errors="replace").splitlines() if l.strip()]
    except OSError:
        return "no log"
    return lines[-1][:300] if lines else "no output"
