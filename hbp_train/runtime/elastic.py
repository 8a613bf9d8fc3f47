"""Resuming on another number of ranks: a checkpoint saved by R ranks continues on R' ranks with its model,
optimizer state and LR schedule, and the samples of the epoch it has not trained re-planned for R'.

``prepare(cfg, ckpt_root, tag, saved, world_size)`` runs before the model is built (every rank calls it; rank 0
does the writing while the others wait) and says where the resumed run's data and engine state come from:

* the same world size, a run that was never re-planned: data.shards as planned, the checkpoint as saved;
* the same world size, a run that was resumed on another number of ranks before: the re-plan it trained from,
  opened again from its record in resume.json (batches/replanned.py);
* another world size: the checkpoint is converted to DeepSpeed's universal format (``ds_to_universal``, in a
  subprocess on rank 0, into RUN_DIR/elastic/<tag>/universal; deleted once every rank has loaded it) and the engine
  is built with ``"checkpoint": {"load_universal": true}``, which loads the weights, the Adam moments, the step
  count and the LR schedule's position on any number of ranks at ZeRO-1/2/3. The samples of the current epoch that
  the sample ledger (runtime/ledger.py) does not list are re-planned from the plan the run was started with
  (data.shards) by planning/replan.py, with the plan's own strategy, and re-packed from data.shards' rows into
  RUN_DIR/elastic/<tag>/world<R'>/ (batches/shards.write_shards_from_packed). Held-out shards of another world size
  are re-planned whole beside them.

What cannot resume is one line with the way forward (planning/replan.config_at: an SP degree that does not divide
R'; a plan without sample lengths). docs/reliability.md, "Resuming on another number of GPUs".
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import torch.distributed as dist

from hbp_train.batches.loader import PackedData
from hbp_train.batches.replanned import ReplannedData
from hbp_train.common.errors import UserError
from hbp_train.common.library_bars import datasets_bars_off
from hbp_train.runtime import checkpoint, resume_config
from hbp_train.runtime.ledger import SampleLedger

ELASTIC_DIR = "elastic"
"""Under the run directory: per checkpoint resumed on another world size, its re-plans and its universal copy."""


@dataclass
class ResumeSource:
    """Where a resumed run's data and engine state come from (``prepare``)."""

    ckpt_root: str
    tag: str
    saved_world_size: int
    data: Optional[PackedData] = None
    """The training shards to use instead of data.shards (a re-plan), or None."""
    eval_data: Optional[PackedData] = None
    """The held-out shards to use instead of data.eval_shards (a re-plan), or None."""
    universal: Optional[str] = None
    """The folder of the checkpoint converted to DeepSpeed's universal format (another world size), or None."""
    ledger: Optional[SampleLedger] = None
    """The checkpoint's sample ledger (None: saved without one; ``load`` rebuilds it from the plan)."""
    messages: list = field(default_factory=list)
    """Lines for the run's log (rank 0)."""

    def build_args(self) -> dict:
        """build.build's keyword arguments for this resume."""
        return {"data": self.data, "eval_data": self.eval_data, "load_universal": self.universal is not None}

    def load(self, run) -> tuple:
        """Load the checkpoint into ``run``'s engine and restore the RNG state: (checkpoint.Resumed, the sample
        ledger to continue, complete up to the resumed step). Every rank calls it."""
        engine_state = (os.path.dirname(self.universal), os.path.basename(self.universal)) if self.universal else None
        resumed = checkpoint.load(run.engine, self.ckpt_root, self.tag, engine_state,
                                  self.saved_world_size if self.universal else None)
        # This run's optimizer settings and LR schedule, not the saved ones (a changed train.lr applies: resume_config)
        resume_config.apply(run.engine, run.cfg.train)
        if self.universal:  # every rank has it in memory now: the copy (12 bytes a parameter) goes
            _barrier()
            if _rank() == 0:
                shutil.rmtree(self.universal, ignore_errors=True)
        ledger = self.ledger or rebuild_ledger(run.data, resumed.next_step)
        return resumed, ledger


def prepare(cfg, ckpt_root: str, tag: str, saved: dict, world_size: int) -> ResumeSource:
    """How to resume from ``ckpt_root/tag`` (``saved``: its resume.json) on ``world_size`` ranks (module docstring).
    Collective: every rank calls it and gets the same answer, or the same one-line UserError."""
    saved_world = int(saved.get("world_size") or world_size)
    tag_dir = os.path.join(ckpt_root, tag)
    source = ResumeSource(ckpt_root, tag, saved_world, ledger=SampleLedger.load(tag_dir))
    replanned = saved.get("replan")
    next_step = int(saved["next_step"])
    if saved_world == world_size:
        if replanned:  # a run re-planned before: its re-plan again, if it covers the run's epochs
            source.data = _open_replanned(cfg, replanned, next_step)
            if source.data.has_head or cfg.data.epochs <= source.data.epoch + 1:
                if saved.get("eval_replan"):
                    source.eval_data = PackedData(saved["eval_replan"], cfg.data.check_counts)
                return source
        else:
            return source
    run_dir = os.path.dirname(os.path.abspath(ckpt_root))
    out = os.path.join(run_dir, ELASTIC_DIR, tag)
    ledger = source.ledger
    if ledger is None:  # saved before the ledger existed: the original plan's steps say what ran (never re-planned)
        ledger = source.ledger = rebuild_ledger(PackedData(cfg.data.shards, cfg.data.check_counts,
                                                           cfg.data.shuffle_epochs, cfg.train.seed), next_step)
    epoch = int(saved["epoch"]) if "epoch" in saved else _epoch_of(cfg, next_step)
    shards_dir = os.path.join(out, f"world{world_size}", "shards")
    eval_dir = os.path.join(out, f"world{world_size}", "eval")

    def work() -> list:
        return _replan_and_convert(cfg, tag_dir, saved_world, world_size, epoch, ledger, shards_dir, eval_dir,
                                   out if saved_world != world_size else None)

    source.messages = _on_rank0(work)
    source.data = ReplannedData(shards_dir, next_step, epoch, check_counts=cfg.data.check_counts,
                                shuffle_epochs=cfg.data.shuffle_epochs, seed=cfg.train.seed)
    if cfg.data.eval_shards and os.path.isdir(eval_dir):
        source.eval_data = PackedData(eval_dir, cfg.data.check_counts)
    if saved_world != world_size:
        source.universal = os.path.join(out, "universal")
    return source


def record(run, next_step: int) -> dict:
    """What resume.json records about the run's data at ``next_step``: its epoch, and the re-plan it trains from."""
    out = {"epoch": run.data.epoch_of(next_step)}
    if isinstance(run.data, ReplannedData):
        out["replan"] = run.data.record()
        if run.eval_data is not None and run.cfg.data.eval_shards and \
                os.path.abspath(run.eval_data.path) != os.path.abspath(run.cfg.data.eval_shards):
            out["eval_replan"] = run.eval_data.path
    return out


def rebuild_ledger(data: PackedData, next_step: int) -> SampleLedger:
    """The ledger of a run that trained ``data``'s steps 0 .. next_step - 1 as planned (a checkpoint saved without
    one; skipped steps cannot be told apart, and count as consumed like any other)."""
    ledger = SampleLedger()
    for step in range(next_step):
        ledger.record(step, data.epoch_of(step), data.step_samples(data.plan_step(step)))
    return ledger


def _open_replanned(cfg, replanned: dict, next_step: int) -> ReplannedData:
    path = replanned["shards"]
    if not os.path.isdir(path):
        raise UserError(f"the re-planned shards this checkpoint trained from, {path}, are gone: resume from the "
                        "checkpoint the re-plan was made for, or on another number of ranks (a new re-plan)")
    return ReplannedData(path, int(replanned["start"]), int(replanned["epoch"]), check_counts=cfg.data.check_counts,
                         shuffle_epochs=cfg.data.shuffle_epochs, seed=cfg.train.seed)


def _epoch_of(cfg, next_step: int) -> int:
    """The epoch of ``next_step`` in a run of data.shards as planned (checkpoints saved before resume.json had it)."""
    return PackedData(cfg.data.shards, cfg.data.check_counts).epoch_of(next_step)


def _replan_and_convert(cfg, tag_dir: str, saved_world: int, world_size: int, epoch: int, ledger: SampleLedger,
                        shards_dir: str, eval_dir: str, convert_into: Optional[str]) -> list:
    """Rank 0's work for ``prepare``: the re-plan's shards (and held-out shards), the universal checkpoint. Returns
    the lines to log."""
    from hbp_train.batches.shards import write_shards_from_packed
    from hbp_train.planning.plan_npz import load_plan
    from hbp_train.planning.replan import replan

    lines = []
    try:  # datasets' "Saving the dataset" bars off: one per group, on every resume
        with datasets_bars_off():
            t0 = time.perf_counter()
            original = load_plan(_plan_path(cfg.data.shards))
            trained = ledger.epoch_samples(epoch)
            with_head = epoch + 1 < cfg.data.epochs
            plan, head_steps = replan(original, trained, world_size, ledger.epoch_steps(epoch), with_head)
            write_shards_from_packed(plan, cfg.data.shards, shards_dir, plan_format=_plan_format(cfg.data.shards))
            rest = plan.num_optimizer_steps - head_steps
            later = f", then later epochs of {plan.num_optimizer_steps} steps" if with_head else ""
            lines.append(f"[train] re-planned for {world_size} rank{'s' if world_size > 1 else ''} "
                         f"({original.config.strategy}): the {plan.extra['replanned']['rest_samples']} samples of "
                         f"epoch {epoch + 1} not yet trained in {rest} optimizer steps{later}, packed into "
                         f"{shards_dir} in {time.perf_counter() - t0:.1f}s")
            if cfg.data.eval_shards:
                held_out = load_plan(_plan_path(cfg.data.eval_shards))
                if held_out.config.world_size != world_size:
                    eval_plan, _ = replan(held_out, [], world_size)
                    write_shards_from_packed(eval_plan, cfg.data.eval_shards, eval_dir,
                                             plan_format=_plan_format(cfg.data.eval_shards))
                else:
                    shutil.rmtree(eval_dir, ignore_errors=True)
    except UserError as exc:
        raise UserError(f"cannot resume on {world_size} rank{'s' if world_size > 1 else ''} from {tag_dir}: "
                        f"{exc}") from None
    if convert_into is not None:
        seconds = convert_to_universal(tag_dir, os.path.join(convert_into, "universal"), saved_world)
        lines.append(f"[train] converted {tag_dir} ({saved_world} ranks) to DeepSpeed's universal checkpoint in "
                     f"{seconds:.1f}s")
    return lines


def convert_to_universal(tag_dir: str, out: str, saved_world: int) -> float:
    """Convert a checkpoint folder to DeepSpeed's universal format in ``out`` (``python -m
    deepspeed.checkpoint.ds_to_universal``, in a subprocess: its memory and its worker processes end with it).
    Written beside ``out`` and renamed, so ``out`` is whole or absent. Returns the seconds it took; a failure is a
    UserError naming the log."""
    tmp = f"{out}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    workers = max(1, min(4, os.cpu_count() or 1))
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", tag_dir,
           "--output_folder", tmp, "--num_extract_workers", str(workers),
           "--num_merge_workers", str(max(1, workers // 2))]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "TQDM_DISABLE": "1"})
    if proc.returncode != 0:
        log = f"{out}.log"
        with open(log, "w") as f:
            f.write(proc.stdout + proc.stderr)
        last = ([line for line in proc.stderr.splitlines() if line.strip()] or ["no output"])[-1].strip()
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"converting {tag_dir} to DeepSpeed's universal checkpoint failed ({last[:200]}; the whole "
                        f"output is in {log}): resume on {saved_world} ranks, the world size that saved it")
    os.replace(tmp, out)
    return time.perf_counter() - t0


def _plan_path(shards: str) -> str:
    npz = os.path.join(shards, "plan.npz")
    return npz if os.path.isfile(npz) else os.path.join(shards, "plan.json")


def _plan_format(shards: str) -> str:
    return "npz" if _plan_path(shards).endswith(".npz") else "json"


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _on_rank0(work):
    """Run ``work()`` on rank 0 while the others wait; every rank gets its result, or the same UserError (an
    unexpected error is raised as it is on rank 0, and as one line naming rank 0 on the others)."""
    result, error, unexpected = None, None, None
    if _rank() == 0:
        try:
            result = work()
        except UserError as exc:
            error = str(exc)
        except BaseException as exc:  # noqa: BLE001 - told to the other ranks, then raised as it is
            unexpected = exc
            error = f"rank 0 failed while preparing the resume ({type(exc).__name__}: {exc})"
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [result, error]
        dist.broadcast_object_list(box, src=0)
        result, error = box
    if unexpected is not None:
        raise unexpected
    if error:
        raise UserError(error)
    return result
