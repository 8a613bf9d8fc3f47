"""Live step metrics: one namespaced dict per step, one rank-0 line, a JSON-lines file, TensorBoard, a tqdm bar.

Only rank 0 writes them. Its line ends with the time this invocation has trained and the ETA of the run's last step
(``time/elapsed_s``, ``time/eta_s``: the mean step time so far over the steps left), so a log that is not a
terminal (a SLURM .out file), where no bar is drawn, still says how far the run is and how long it has to go.

Keys are namespaced (``loss/…``, ``optim/…``, ``perf/…``, ``balance/…``, ``memory/…``, ``plan/…``, ``tokens/…``;
the trainer adds ``sp/…`` and ``time/…`` from hbp_train/model/ulysses.py and ``loss/eval`` from heldout.py). The balance
figures compare what the plan predicted (its step ABR/DBR) with what the ranks measured: every rank's compute time
for the step is all-gathered (one small vector per rank, also carrying the flags the ranks must agree on) and the
live imbalance is max/mean over ranks; ``balance/live_BR`` applies the plan's ABR formula (1 - mean/max) to the
measured times so the two can be compared directly.

``mix/…`` (``StepLengthMix``) is the length mix of the samples a step trains on, all replicas together: the token
share per length bucket and ``mix/tv``, its total-variation distance to the whole plan's mix (0 = the data's mix,
1 = lengths the data has none of; hbp_train/planning/metrics.py). A run whose steps sit far above the plan report's
isf mix_TV trains on length-skewed batches, which costs quality (bench/bench_quality.py).

``sp/token_share/sp<d>`` and ``sp/time_share/sp<d>`` split a step by SP degree: the share of its tokens and of its
compute time (all ranks) that ran at degree d. A step that mixes packing groups (hbp step_mix="mixed") runs
several degrees; ``plan/sp_degrees`` and ``plan/groups`` list what it ran, and the rank-0 line shows each degree
with its shares. Each rank times its degrees with ``SPMixTimer`` (a device sync where the degree changes).

MFU counts attention FLOPs per sample (sum of len^2 over the samples of a pack, not T^2): a packed pack of short
samples does far less attention work than one long sample of the same T.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
import torch.distributed as dist

from hbp_train.common.errors import UserError

# Dense bf16 peak FLOP/s per device, by a substring of torch.cuda.get_device_name(). Used when peak_flops is 0.
KNOWN_PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "A800": 312e12, "L40S": 362e12}


@dataclass
class LoggingConfig:
    """What is reported each step and where."""

    log_every: int = 1
    """Print the rank-0 line every this many steps (the JSON-lines file and TensorBoard get every step)."""
    jsonl: bool = True
    """Write RUN_DIR/metrics.jsonl, one JSON object per step."""
    tensorboard: bool = True
    """Write TensorBoard events to RUN_DIR/tb."""
    progress_bar: bool = True
    """Show a tqdm bar on rank 0 when its output is a terminal (the per-step line is then written through
    tqdm.write). In a log file (a SLURM .out) there is no bar, whose redraws would be joined by carriage returns:
    the per-step lines carry the elapsed time and the ETA, with or without it."""
    peak_flops: float = 0.0
    """Peak FLOP/s of one device for MFU, e.g. 989e12 for an H100 in bf16. 0 = look the GPU up in
    KNOWN_PEAK_FLOPS; on a CPU (or an unknown GPU) with 0, MFU is reported as n/a."""
    exclude_comm_wait: bool = True
    """Per-rank compute times (balance/*, time/compute_s/rank<r>) leave out the time this rank spent inside
    DeepSpeed's collectives (the gradient reduction), where a fast rank waits for the slowest: without this the
    waiting counts as compute and the live imbalance reads near 0 whatever the plan. Timing a wait needs a device
    sync around each collective, which serialises ZeRO's overlap of reduction and backward, so on a GPU only
    every ``comm_wait_every``-th step is timed (see there). False: every step's times include the waits."""
    comm_wait_every: int = 10
    """With exclude_comm_wait, on a GPU: time the waits on steps 0, N, 2N, … (N = this); the steps between run
    with nothing wrapped or synchronised (full speed) and report the per-rank compute times and the measured
    balance/* figures as n/a (null). 1 = every step (every step loses the overlap). On a CPU every step is timed:
    there is no device to synchronise and DeepSpeed does not overlap there."""
    wandb: bool = False
    """Also log every step to Weights & Biases (rank 0, the same namespaced keys; needs the `wandb` extra:
    pip install 'hbp-train[wandb]'). WANDB_MODE=offline writes the run under RUN_DIR/wandb for `wandb sync`."""
    wandb_project: str = "hbp-train"
    """W&B project of the run (logging.wandb)."""
    wandb_run_name: Optional[str] = None
    """W&B run name (logging.wandb); None = W&B's generated name."""

    def __post_init__(self):
        if self.log_every < 1:
            raise UserError(f"logging.log_every={self.log_every}: must be >= 1")
        if self.comm_wait_every < 1:
            raise UserError(f"logging.comm_wait_every={self.comm_wait_every}: must be >= 1 (1 = every step)")
        if self.peak_flops < 0:
            raise UserError(f"logging.peak_flops={self.peak_flops}: must be >= 0 (0 = auto)")
        if not str(self.wandb_project).strip():
            raise UserError("logging.wandb_project: must be a non-empty W&B project name")


def keep_rows_before(path: str, step: int) -> None:
    """Rewrite a metrics.jsonl keeping only the rows of steps before ``step`` (and dropping a line cut short by a
    crash); atomic, so a crash here leaves the old file."""
    if not os.path.isfile(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("plan/step"), int) and row["plan/step"] < step:
                kept.append(line if line.endswith("\n") else line + "\n")
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


RANK_TIME_PREFIX = "time/compute_s/"  # time/compute_s/rank<r>: model/ulysses.py's per-rank compute times


def sp_mix_metrics(col: dict) -> dict:
    """``sp/token_share/sp<d>``, ``sp/time_share/sp<d>`` for every degree of the run and ``plan/sp_degrees`` (those
    the step ran), from the gathered sp_mix_columns (``col``: column name -> [W] values); {} without them."""
    degrees = sorted(int(name[len("tokens_sp"):]) for name in col if name.startswith("tokens_sp"))
    if not degrees:
        return {}
    tokens = {d: float(col[f"tokens_sp{d}"].sum()) for d in degrees}
    seconds = {d: float(col[f"compute_time_sp{d}"].sum()) for d in degrees}
    total_tokens, total_seconds = sum(tokens.values()), sum(seconds.values())
    metrics = {"plan/sp_degrees": [d for d in degrees if tokens[d] > 0 or seconds[d] > 0]}
    for d in degrees:
        metrics[f"sp/token_share/sp{d}"] = tokens[d] / total_tokens if total_tokens > 0 else 0.0
        metrics[f"sp/time_share/sp{d}"] = seconds[d] / total_seconds if total_seconds > 0 else 0.0
    return metrics


def _start_wandb(cfg: LoggingConfig, run_dir: str):
    """The W&B run (rank 0 only); UserError when the package is missing."""
    try:
        import wandb
    except ImportError:
        raise UserError("logging.wandb=true needs the wandb package: pip install 'hbp-train[wandb]' (or wandb)") from None
    return wandb.init(project=cfg.wandb_project, name=cfg.wandb_run_name, dir=run_dir, resume="allow",
                      config={"run_dir": os.path.abspath(run_dir)})


def resolve_peak_flops(configured: float) -> Optional[float]:
    """The peak FLOP/s used for MFU, or None when unknown (CPU without a configured figure)."""
    if configured > 0:
        return configured
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name()
        for key, value in KNOWN_PEAK_FLOPS.items():
            if key in name:
                return value
    return None


def peak_memory_gib() -> float:
    """Peak memory of this rank: CUDA max allocated on a GPU, else the process's peak RSS."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def is_oom(exc: BaseException) -> bool:
    """An out-of-memory error: the caching allocator's OutOfMemoryError, or one a library reports as a plain
    RuntimeError (cuBLAS failing to allocate its workspace, a raw "CUDA error: out of memory"). The profiler and
    the trainer benchmark record such a trial as infeasible instead of stopping."""
    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "CUBLAS_STATUS_ALLOC_FAILED" in text)


def reset_peak_memory() -> None:
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


def all_gather_floats(values: list, device: torch.device) -> torch.Tensor:
    """[world_size, len(values)] float64 tensor (on the host) of every rank's values (one collective).

    A value is a number or a one-element tensor on ``device`` (a sum the step kept there): the row is put together
    once on the device, gathered, and read back in one transfer; at world size 1 only the device values travel."""
    on_device = [i for i, v in enumerate(values) if isinstance(v, torch.Tensor)]
    host = torch.tensor([0.0 if isinstance(v, torch.Tensor) else float(v) for v in values], dtype=torch.float64)
    kept = torch.stack([values[i].detach().reshape(()).double() for i in on_device]) if on_device else None
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        if kept is not None:
            host[on_device] = kept.cpu()
        return host[None]
    local = host.to(device, non_blocking=True)
    if kept is not None:
        local[on_device] = kept.to(device)
    out = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(out, local)
    return torch.stack(out).cpu()


class StepLengthMix:
    """``mix/…`` metrics of a plan step, from the plan the packed shards hold (its sample lengths and the samples of
    every step's packs, all replicas): the step's token share per length bucket (``mix/le_<edge>``: samples of at
    most that many tokens and more than the bucket below) and ``mix/tv``, its distance to the plan's whole mix (the
    plan's "data_mix"; planning/metrics.py). ``data`` is a ``data.PackedData``; {} for a plan without lengths."""

    def __init__(self, data):
        from hbp_train.planning.metrics import mix_edges, token_mix

        self.data = data
        self.lengths = data.sample_lengths()
        if self.lengths is None:
            return
        metrics = data.plan.get("metrics") or {}
        self.edges = np.asarray(metrics.get("mix_edges") or mix_edges([g["pack_len"] for g in data.groups]), np.int64)
        reference = metrics.get("data_mix")
        known = reference is not None and len(reference) == len(self.edges)
        self.reference = np.asarray(reference, np.float64) if known else token_mix(self.lengths, self.edges)
        self.names = [f"mix/le_{int(e)}" for e in self.edges]

    def __call__(self, plan_step: int) -> dict:
        from hbp_train.planning.metrics import mix_distance, token_mix

        if self.lengths is None or not 0 <= plan_step < self.data.num_steps:
            return {}
        mix = token_mix(self.lengths[self.data.step_samples(plan_step)], self.edges)
        return {"mix/tv": float(mix_distance(mix, self.reference)[0]), **dict(zip(self.names, mix.tolist()))}


class MetricsLogger:
    """Builds the step's metric dict on rank 0 and fans it out (stdout line, JSON lines, TensorBoard, tqdm)."""

    def __init__(self, cfg: LoggingConfig, run_dir: str, rank: int, total_steps: int, start_step: int = 0):
        self.cfg = cfg
        self.rank = rank
        self.run_dir = run_dir
        self.peak_flops = resolve_peak_flops(cfg.peak_flops)
        self.jsonl = None
        self.tb = None
        self.wandb = None
        self.rank_times: dict = {}  # rank -> [(step, compute seconds)]: one line per rank at the end (W&B)
        self.bar = None
        self.started = time.monotonic()  # elapsed time and ETA count from here: this invocation's training
        self.start_step = start_step
        if rank != 0:
            return
        os.makedirs(run_dir, exist_ok=True)
        if cfg.jsonl:
            # A resumed run continues the file without the rows of the steps it re-runs (as TensorBoard's
            # purge_step does); a fresh one replaces what an earlier, unsaved attempt left.
            path = os.path.join(run_dir, "metrics.jsonl")
            if start_step > 0:
                keep_rows_before(path, start_step)
            self.jsonl = open(path, "a" if start_step > 0 else "w")
        if cfg.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides events an earlier attempt logged from start_step on (they are re-run now)
            self.tb = SummaryWriter(os.path.join(run_dir, "tb"), purge_step=start_step)
        if cfg.wandb:
            self.wandb = _start_wandb(cfg, run_dir)
        if cfg.progress_bar and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True,
                            file=sys.stderr)

    def step_metrics(self, *, step: int, total_steps: int, gathered: torch.Tensor, columns: list, lr: float,
                     grad_norm: Optional[float], step_time: float, data_time: float, group: int, sp: int,
                     num_micro_batches: int, plan_metrics: dict, skipped: bool, num_skipped: int,
                     pack_len: Optional[int] = None, num_packs: Optional[int] = None,
                     groups: Optional[list] = None, steps_per_epoch: Optional[int] = None) -> dict:
        """The namespaced metric dict of one step from every rank's gathered values.

        With the group's ``pack_len`` and the step's ``num_packs`` (all replicas, empty ones included) it adds the
        paper's plan metrics as lived: ``tokens/ave_t`` (tokens per GPU this step) and ``tokens/pad_ratio``.
        ``step`` and ``epoch`` count from 1, as the log line does (``plan/step`` is the same step from 0);
        ``steps_per_epoch``: the plan's optimizer steps (None: every step is of epoch 1).
        ``groups``: every group the step ran (a step that mixes groups), else [group]; with sp_mix_columns among
        ``columns``, ``plan/sp`` is the largest degree the step ran and ``plan/group`` its largest group."""
        col = {name: gathered[:, i] for i, name in enumerate(columns)}
        elapsed = time.monotonic() - self.started
        compute = col["compute_time"]
        timed = bool(torch.isfinite(compute).all())  # NaN: a step between timed ones (comm_wait_mode "skip")
        loss_tokens = float(col["loss_tokens"].sum())
        tokens = float(col["tokens"].sum())
        flops = float(col["flops"].sum())
        world = gathered.shape[0]
        mean_compute = float(compute.mean())
        metrics = {
            "step": step + 1,
            "epoch": step // steps_per_epoch + 1 if steps_per_epoch else 1,
            "loss/train": float(col["loss_sum"].sum()) / max(loss_tokens, 1.0),
            "loss/tokens": loss_tokens,
            "optim/lr": lr,
            "optim/grad_norm": grad_norm if grad_norm is not None else float("nan"),
            "optim/skipped": int(skipped),
            "optim/skipped_total": num_skipped,
            "perf/step_time_s": step_time,
            "perf/tokens_per_s": tokens / step_time if step_time > 0 else 0.0,
            "perf/tflops_per_device": flops / world / step_time / 1e12 if step_time > 0 else 0.0,
            "perf/mfu": (flops / (world * self.peak_flops * step_time)) if self.peak_flops and step_time > 0
            else None,
            "perf/data_wait_pct": 100.0 * data_time / step_time if step_time > 0 else 0.0,
            "balance/compute_time_max_s": float(compute.max()) if timed else None,
            "balance/compute_time_mean_s": mean_compute if timed else None,
            "balance/imbalance": (float(compute.max()) / mean_compute if mean_compute > 0 else 1.0) if timed else None,
            # The plan's ABR/DBR formula, sum_r (max - v_r) / (max * N) = 1 - mean/max, on measured compute times.
            "balance/live_BR": (1.0 - mean_compute / float(compute.max()) if float(compute.max()) > 0 else 0.0)
            if timed else None,
            "balance/plan_ABR": plan_metrics.get("ABR"),
            "balance/plan_DBR": plan_metrics.get("DBR"),
            "memory/peak_gib": float(col["peak_mem_gib"].max()),
            "plan/step": step,
            "plan/total_steps": total_steps,
            "plan/group": max(groups) if groups else group,
            "plan/groups": sorted(groups) if groups else [group],
            "plan/sp": sp,
            "plan/micro_batches": num_micro_batches,
            "tokens/ave_t": tokens / world,
            "time/elapsed_s": elapsed,
            # The mean step time of this invocation so far, over the steps left.
            "time/eta_s": elapsed / (step + 1 - self.start_step) * (total_steps - step - 1)
            if step + 1 > self.start_step else None,
        }
        metrics.update(sp_mix_metrics(col))
        if metrics.get("plan/sp_degrees"):
            metrics["plan/sp"] = max(metrics["plan/sp_degrees"])
        if "aux_sum" in col and float(col["aux_sum"].sum()) > 0:  # MoE router loss (hbp_train/model/moe.py)
            metrics["loss/aux"] = float(col["aux_sum"].sum()) / max(loss_tokens, 1.0)
        if pack_len and num_packs:
            metrics["tokens/pad_ratio"] = 1.0 - tokens / (pack_len * num_packs)
        return metrics

    def log(self, metrics: dict) -> None:
        """Write one step's metrics (rank 0 only)."""
        if self.rank != 0:
            return
        step = metrics["plan/step"]
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"time": time.time(), **metrics}) + "\n")
            self.jsonl.flush()
        scalars = {k: v for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        per_rank = {k: v for k, v in scalars.items() if k.startswith(RANK_TIME_PREFIX)}
        if self.tb is not None:
            for key, value in scalars.items():
                if key not in per_rank and key not in ("plan/step", "step"):
                    self.tb.add_scalar(key, value, step)
            if per_rank:  # one chart, one line per rank
                self.tb.add_scalars(RANK_TIME_PREFIX.rstrip("/"), {k[len(RANK_TIME_PREFIX):]: v
                                                                   for k, v in per_rank.items()}, step)
        if self.wandb is not None:
            # "step" is W&B's own key (a user key of that name loses the row); its step axis is plan/step
            self.wandb.log({k: v for k, v in scalars.items() if k != "step"}, step=step)
        for key, value in per_rank.items():
            self.rank_times.setdefault(key[len(RANK_TIME_PREFIX):], []).append((step, value))
        line = format_line(metrics)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix_str(f"loss {metrics['loss/train']:.4f}")
        if step % self.cfg.log_every == 0 or step + 1 == metrics["plan/total_steps"] or "loss/eval" in metrics:
            if self.bar is not None:
                self.bar.write(line)
            else:
                print(line, flush=True)

    def message(self, text: str) -> None:
        """A rank-0 message that does not break the progress bar."""
        if self.rank != 0:
            return
        if self.bar is not None:
            self.bar.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        if self.jsonl is not None:
            self.jsonl.close()
            self._plot()
        if self.tb is not None:
            self.tb.close()
        if self.wandb is not None:
            if self.rank_times:  # the per-rank compute times as one chart with one line per rank
                import wandb

                ranks = sorted(self.rank_times, key=lambda r: int(r.removeprefix("rank")))
                self.wandb.log({"time/compute_s_per_rank": wandb.plot.line_series(
                    xs=[step for step, _ in self.rank_times[ranks[0]]],
                    ys=[[v for _, v in self.rank_times[r]] for r in ranks], keys=ranks,
                    title="compute seconds per rank", xname="step")})
            self.wandb.finish()

    def _plot(self) -> None:
        """RUN_DIR/metrics.png (hbp_train/observe/metrics_plot.py); a failure to draw is reported, never fatal to the run."""
        from hbp_train.observe.metrics_plot import plot_run

        try:
            print(f"[train] metrics plot: {plot_run(self.run_dir)}", flush=True)
        except Exception as exc:  # the run's results are saved already; a plot is not worth a traceback
            print(f"[train] no metrics plot ({type(exc).__name__}: {exc}); python -m hbp_train.run_plot "
                  f"{self.run_dir} redraws it", flush=True)


def _fmt(value, spec: str, missing: str = "n/a") -> str:
    if value is None or (isinstance(value, float) and value != value):
        return missing
    return format(value, spec)


def _groups_and_degrees(m: dict) -> str:
    """``group 0 sp=1``; a step that mixes groups names them all, and, if it ran several SP degrees, each degree's
    share of the step's tokens and compute time: ``groups 0+1 sp=1 (T1% tokens, S1% time) + sp=2 (T2%, S2%)``."""
    groups = m.get("plan/groups") or [m["plan/group"]]
    degrees = m.get("plan/sp_degrees") or [m["plan/sp"]]
    where = f"group {groups[0]}" if len(groups) == 1 else "groups " + "+".join(map(str, groups))
    if len(degrees) == 1:
        return f"{where} sp={degrees[0]}"
    shares = [(d, 100 * m[f"sp/token_share/sp{d}"], 100 * m[f"sp/time_share/sp{d}"]) for d in degrees]
    first, rest = shares[0], shares[1:]
    return (f"{where} sp={first[0]} ({first[1]:.0f}% tokens, {first[2]:.0f}% time)"
            + "".join(f" + sp={d} ({tok:.0f}%, {sec:.0f}%)" for d, tok, sec in rest))


def format_line(m: dict) -> str:
    """The rank-0 line of one step."""
    mfu = m["perf/mfu"]
    return (
        f"step {m['plan/step'] + 1}/{m['plan/total_steps']} | loss {m['loss/train']:.4f}"
        f"{' (skipped)' if m['optim/skipped'] else ''} | lr {m['optim/lr']:.2e} | gnorm {_fmt(m['optim/grad_norm'], '.3f')}"
        f" | {m['perf/tokens_per_s']:,.0f} tok/s | mfu {'n/a' if mfu is None else format(100 * mfu, '.1f') + '%'}"
        f" | imb {_fmt(m['balance/imbalance'], '.3f')} (BR live {_fmt(m['balance/live_BR'], '.3f')}, plan ABR {_fmt(m['balance/plan_ABR'], '.3f')}"
        f" DBR {_fmt(m['balance/plan_DBR'], '.3f')}) | mem {m['memory/peak_gib']:.2f} GiB"
        f" | {_groups_and_degrees(m)} m {m['plan/micro_batches']}"
        f"{' cr ' + format(m['sp/cr'], '.2f') if m.get('sp/cr') is not None else ''}"
        f"{' | mix tv ' + format(m['mix/tv'], '.2f') if m.get('mix/tv') is not None else ''}"
        f" | data {m['perf/data_wait_pct']:.1f}%"
        f"{' | eval loss ' + format(m['loss/eval'], '.4f') if 'loss/eval' in m else ''}"
        f"{_times(m)}"
    )


def clock(seconds: Optional[float]) -> str:
    """``1:02:03`` (or ``2:03`` under an hour) for a duration in seconds; ``?`` when unknown."""
    if seconds is None or not seconds == seconds or seconds < 0:
        return "?"
    minutes, secs = divmod(int(round(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def _times(m: dict) -> str:
    """`` | 1:02 elapsed, ETA 10:00``: the line's own progress figures (no bar is needed to read them)."""
    if "time/elapsed_s" not in m:
        return ""
    return f" | {clock(m['time/elapsed_s'])} elapsed, ETA {clock(m.get('time/eta_s'))}"
