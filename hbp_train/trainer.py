"""The training loop: ``train()`` runs the plan's steps, ``train_step()`` one optimizer step (build.py builds the run).

A plan step has m micro-batches (packs) per replica, and m changes from step to step. DeepSpeed fixes
gradient_accumulation_steps at initialize, so we initialize it with 1 and drive the accumulation boundary
ourselves: ``engine.set_gradient_accumulation_boundary(k == m - 1)`` before micro-batch k, one ``engine.step()``
after the last one. With gradient_accumulation_steps=1, ``engine.backward`` does not divide the loss, and
DeepSpeed only averages gradients over its data-parallel ranks; ``loss.normalize_loss`` is told exactly that
(``num_micro_batches=1``, ``dp_world_size`` = the ranks DeepSpeed averages over), so every step's gradient is the
one the normalizer's formula defines, whatever m (tests/test_trainer_dist.py proves it against a reference).

Per step, in order: the group's activation-checkpointing depth, the SP degree (attention size switch), then per
micro-batch the SP split of the collated pack, the normalizer's per-token loss weights (known before the forward,
so the fused LM-head loss makes its gradients there; loss.py), forward, the SP loss reduction, backward; then the
optimizer step and the metrics (one all-gather of a few floats per rank, which also carries the gradient norm and
the stop and NaN flags every rank must agree on). The forward and backward read no value back from the device: the
loss tokens are counted on the host, the step's sums stay on the device until the one transfer of its statistics,
and the next step's batch is collated (on a GPU, into pinned memory) in a background thread while this one computes
(prefetch.py). A step that mixes packing groups (hbp step_mix="mixed": one plan step per group, data.py) switches
the checkpointing depth and the SP degree where its micro-batches change group; the loss is normalized over the
whole step, each micro-batch scaled for its own group's W/sp replicas; its metrics split the step's tokens and
compute time by SP degree (step_timing.SPMixTimer).
"""

from __future__ import annotations

import math
import os
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Optional

import torch

from hbp_train.batches.collate import StepBatch, to_device
from hbp_train.batches.prefetch import StepPrefetcher
from hbp_train.build import Run, build, step_ckpt_layers
from hbp_train.common.errors import UserError
from hbp_train.common.labels import IGNORE_INDEX
from hbp_train.distributed.groups import rank, world_size
from hbp_train.model.hf_model import set_checkpointed_layers
from hbp_train.model.levers import step_levers
from hbp_train.model.loss import token_loss_weights
from hbp_train.model.moe import pack_aux_loss
from hbp_train.observe import heldout
from hbp_train.observe.run_summary import start_summary
from hbp_train.observe.step_timing import SPMixTimer, comm_wait_mode, comm_wait_timer, sp_mix_columns
from hbp_train.observe.telemetry import (MetricsLogger, StepLengthMix, all_gather_floats, peak_memory_gib,
                                         reset_peak_memory)
from hbp_train.perf.flops import pack_flops
from hbp_train.perf.shape import parse_model_shape
from hbp_train.runtime import checkpoint, elastic
from hbp_train.runtime.ledger import SampleLedger
from hbp_train.runtime.status import RunStatus, ended_by

ON_NAN = ("skip", "abort")


@dataclass
class TrainConfig:
    """The optimization, the schedule and the run's bookkeeping."""

    out_dir: str = "runs/hbp"
    """Run directory: resolved config, metrics.jsonl, TensorBoard events, checkpoints/. Also Hydra's run dir."""
    max_steps: Optional[int] = None
    """Stop after this many optimizer steps in total; None = every step of the plan, data.epochs times."""
    lr: float = 2e-5
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """The cosine decay ends at lr * min_lr_ratio."""
    warmup_steps: int = 10
    """Linear warm-up steps (starting at lr / warmup_steps); 0 = none."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    betas: list = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this (0 = no clipping)."""
    seed: int = 0
    """Seed of python/numpy/torch RNGs on every rank (the model's initial weights use model.seed)."""
    ckpt_layers: Optional[list] = None
    """Activation-checkpointed layers per packing group, overriding the plan's groups[g].ckpt_layers: one value
    per group, or a single value for all groups. None = the plan's value (0 where the plan has none)."""
    save_every: int = 0
    """Save a checkpoint every this many steps (0 = only at the end and on SIGTERM/SIGINT)."""
    save_final: bool = True
    """Save a checkpoint when the run ends."""
    keep_last: int = 2
    """Keep only the newest this many checkpoints (0 = keep all)."""
    resume: Optional[str] = None
    """Resume from a checkpoint: 'auto' (the newest in out_dir/checkpoints, if any) or a checkpoint path."""
    on_nan: str = "skip"
    """A NaN/inf loss or gradient on any rank: 'skip' (drop the step's gradients, no optimizer step, counted in
    metrics; DeepSpeed checks every gradient for it, a pass over them and a host sync per step) or 'abort' (save
    nothing, exit with an error; the loss and the gradient norm are checked, no gradient pass)."""
    max_skipped: Optional[int] = None
    """With train.on_nan=skip: when more steps than this have been skipped (NaN/inf), stop with a checkpoint and
    exit 1 instead of training on a diverged run; None = 5% of the run's steps (at least 1)."""
    exit_after_steps: Optional[int] = None
    """Stop (with a checkpoint) after this many steps in this invocation, e.g. for time-limited job slots;
    resume later with train.resume=auto."""
    eval_every: int = 0
    """With data.eval_shards: log the held-out loss (loss/eval, ppl/eval) every this many steps and after the last
    step (0 = after the last step only)."""

    def warmup_for(self, total_steps: int) -> int:
        """The warm-up a run of ``total_steps`` optimizer steps gets: warmup_steps, or a tenth of the run when the
        run is not longer than the warm-up (the learning rate would never reach lr; build_run warns)."""
        return self.warmup_steps if self.warmup_steps < total_steps else total_steps // 10

    def __post_init__(self):
        if not self.out_dir:
            raise UserError("train.out_dir: must name a folder (the run directory)")
        if os.path.exists(self.out_dir) and not os.path.isdir(self.out_dir):
            raise UserError(f"train.out_dir={self.out_dir}: is a file, not a folder; choose another train.out_dir")
        if self.resume is not None and not self.resume:
            raise UserError("train.resume='': use null (start fresh), auto (the newest checkpoint, if any) or a "
                            "checkpoint path")
        if self.seed < 0:
            raise UserError(f"train.seed={self.seed}: must be >= 0")
        if self.max_steps is not None and self.max_steps < 1:
            raise UserError(f"train.max_steps={self.max_steps}: must be >= 1 (or null for the whole plan)")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise UserError(f"train.lr={self.lr}: must be a positive number")
        if not 0 <= self.min_lr_ratio <= 1:
            raise UserError(f"train.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        if self.warmup_steps < 0:
            raise UserError(f"train.warmup_steps={self.warmup_steps}: must be >= 0")
        if self.weight_decay < 0:
            raise UserError(f"train.weight_decay={self.weight_decay}: must be >= 0")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise UserError(f"train.betas={list(self.betas)}: must be two numbers in [0, 1)")
        if self.eps <= 0:
            raise UserError(f"train.eps={self.eps}: must be > 0")
        if self.grad_clip < 0:
            raise UserError(f"train.grad_clip={self.grad_clip}: must be >= 0 (0 = off)")
        if self.ckpt_layers is not None and (not self.ckpt_layers or any(int(k) < 0 for k in self.ckpt_layers)):
            raise UserError(f"train.ckpt_layers={list(self.ckpt_layers)}: one value >= 0 per group, or null")
        if self.save_every < 0 or self.keep_last < 0:
            raise UserError("train.save_every and train.keep_last must be >= 0")
        if self.on_nan not in ON_NAN:
            raise UserError(f"train.on_nan={self.on_nan!r}: must be one of {', '.join(ON_NAN)}")
        if self.max_skipped is not None and self.max_skipped < 0:
            raise UserError(f"train.max_skipped={self.max_skipped}: must be >= 0 (or null for 5% of the run)")
        if self.exit_after_steps is not None and self.exit_after_steps < 1:
            raise UserError(f"train.exit_after_steps={self.exit_after_steps}: must be >= 1 (or null)")
        if self.eval_every < 0:
            raise UserError(f"train.eval_every={self.eval_every}: must be >= 0 (0 = after the last step only)")


# One row per rank in the per-step all-gather. booked_tokens / sp_tokens: the live CR (tokens the SP attention
# dispatcher booked, and those of them that went through the all-to-all); grad_norm: the step's global gradient norm
# (the same on every rank; NaN where DeepSpeed computed none). After these come the run's SP degrees' columns
# (stat_columns).
STAT_COLUMNS = ["compute_time", "loss_sum", "loss_tokens", "tokens", "flops", "nonfinite", "stop", "peak_mem_gib",
                "booked_tokens", "sp_tokens", "aux_sum", "grad_norm"]


def stat_columns(run: Run) -> list:
    """The all-gather's columns: STAT_COLUMNS, then this rank's tokens and compute seconds at each SP degree the run
    built (step_timing.sp_mix_columns)."""
    return STAT_COLUMNS + sp_mix_columns(run.sp.pstate.sp_degrees)


def train(cfg, config_yaml: str = "", status=None) -> dict:
    """Run (or resume) the whole training; returns a summary (steps run, last loss, how it ended). ``status``: the
    run folder's status.json writer (runtime/status.py; train.py makes it), started once the folder is known to be
    this run's, then rewritten after every step and save."""
    ckpt_root = os.path.join(cfg.train.out_dir, "checkpoints")
    source = None
    try:  # before building anything: a wrong path, a checkpoint of another plan, is one line
        resume = checkpoint.find_resume(cfg.train.resume, ckpt_root,
                                        warn=lambda line: print(line, flush=True) if rank() == 0 else None)
        if resume is not None:
            saved = checkpoint.check_resumable(*resume, world_size(), cfg.data.shards)
            # Another world size: the untrained samples re-planned, the checkpoint made universal (elastic.py).
            source = elastic.prepare(cfg, *resume, saved, world_size())
    except UserError as e:
        raise UserError(f"train.resume={cfg.train.resume}: {e}") from None
    checkpoint.check_fresh_root(ckpt_root, resume)
    status = status or RunStatus(cfg.train.out_dir, rank(), "")
    tag_step = checkpoint.TAG_RE.match(resume[1]) if resume is not None else None
    status.start(int(tag_step.group(1)) if tag_step else 0, None,  # being built
                 os.path.join(*resume) if resume is not None else None)
    run = build(cfg, config_yaml, **(source.build_args() if source else {}))
    start_step, num_skipped, sp_totals = 0, 0, None
    ledger = SampleLedger()  # which samples every step trains (rank 0), saved with every checkpoint
    if resume is not None:
        resumed, ledger = source.load(run)
        start_step = resumed.next_step
        num_skipped = int(resumed.counters.get("num_skipped", 0))
        sp_totals = resumed.counters.get("sp_token_totals")
    run.sp.stats.start_run(sp_totals)  # live CR counts the whole run, across resumes
    status.start(start_step, run.total_steps)
    metrics = MetricsLogger(cfg.logging, cfg.train.out_dir, rank(), run.total_steps, start_step)
    for line in source.messages if source else []:  # a resume on another world size: its re-plan and conversion
        metrics.message(line)
    metrics.message(start_summary(run))  # rank 0: what is about to be trained, on what, how (run_summary.py)
    step_mix = StepLengthMix(run.data)  # mix/...: the length mix of every step (a skew costs quality)
    if resume is not None and resumed.total_steps not in (None, run.total_steps):
        # The cosine schedule is laid out over the run's length: a changed length bends it from here on.
        why = "data.epochs / train.max_steps changed" + (", or the re-plan has other steps" if source.data else "")
        metrics.message(f"[train] warning: this run has {run.total_steps} steps but the checkpoint was saved by a run "
                        f"of {resumed.total_steps} ({why}): the LR schedule changes")
    if resume is not None:
        where = f" on {world_size()} rank{'s' if world_size() > 1 else ''} (saved by {source.saved_world_size})"
        metrics.message(f"[train] resumed from {os.path.join(*resume)} at step {start_step}"
                        + (where if source.universal else ""))
    elif cfg.train.resume == "auto":
        metrics.message(f"[train] train.resume=auto: no checkpoint in {ckpt_root}, starting fresh")
    stop = checkpoint.StopSignal().install()
    max_skipped = skip_limit(cfg.train.max_skipped, run.total_steps)
    diverged = None
    history = []
    step = start_step
    ended = "finished"
    saved_at = None

    def save(next_step):
        nonlocal saved_at
        if saved_at == next_step:
            return
        counters = {"num_skipped": num_skipped, "sp_token_totals": run.sp.stats.totals()}
        checkpoint.save(run.engine, ckpt_root, next_step, run.config_yaml, run.model, run.tokenizer,
                        cfg.train.keep_last, run.total_steps, counters, cfg.data.shards,
                        ledger if rank() == 0 else None, elastic.record(run, next_step))
        saved_at = next_step
        metrics.message(f"[train] checkpoint saved: {os.path.join(ckpt_root, checkpoint.tag_for(next_step))}")
        status.saved(os.path.join(ckpt_root, checkpoint.tag_for(next_step)), next_step)

    # Below ZeRO-2 ranks meet only at the step's end: a replica with fewer packs runs only those.
    batches = StepPrefetcher(lambda s: run.data.step_batch(s, rank(), run.pad_token_id,
                                                           equal_counts=cfg.deepspeed.zero_stage >= 2), run.device)
    try:
        while step < run.total_steps:
            t0 = time.perf_counter()
            step_batch = batches.get(step, step + 1 if step + 1 < run.total_steps else None)
            data_time = time.perf_counter() - t0
            gathered, skipped, lr = train_step(run, step_batch, lambda: stop.requested)
            num_skipped += int(skipped)
            step_time = time.perf_counter() - t0
            norm = float(gathered[0, STAT_COLUMNS.index("grad_norm")])  # the same on every rank
            m = metrics.step_metrics(
                step=step, total_steps=run.total_steps, gathered=gathered, columns=stat_columns(run),
                lr=lr, grad_norm=None if skipped or math.isnan(norm) else norm,
                step_time=step_time, data_time=data_time, group=step_batch.group, sp=step_batch.sp,
                groups=sorted({mb.get("group", step_batch.group) for mb in step_batch.micro_batches}),
                num_micro_batches=len(step_batch.micro_batches), plan_metrics=step_batch.plan_metrics,
                skipped=skipped, num_skipped=num_skipped,
                pack_len=step_batch.capacity_tokens / max(step_batch.num_packs, 1), num_packs=step_batch.num_packs,
                steps_per_epoch=run.data.num_steps)
            m.update(step_mix(step_batch.plan_step))
            m["epoch"] = run.data.epoch_of(step) + 1  # a re-planned run's epochs need not be equally long
            if rank() == 0:
                ledger.record(step, run.data.epoch_of(step), run.data.step_samples(step_batch.plan_step), skipped)
            m.update(run.sp.stats.step_metrics(  # SP: live CR and per-rank compute times
                *(gathered[:, STAT_COLUMNS.index(c)].tolist() for c in ("compute_time", "booked_tokens", "sp_tokens"))))
            if run.eval_data is not None and _eval_due(step, run.total_steps, cfg.train.eval_every):
                m.update(heldout.evaluate(run, run.eval_data))  # every rank: it is collective
            metrics.log(m)
            status.step(step + 1, run.total_steps, m["time/elapsed_s"], m["time/eta_s"])
            if skipped:
                metrics.message(f"[train] step {step}: NaN/inf loss or gradient, step skipped (train.on_nan=skip)")
            history.append(m["loss/train"])
            step += 1
            if num_skipped > max_skipped:
                diverged = (f"{num_skipped} steps skipped for a NaN/inf loss or gradient, more than "
                            f"train.max_skipped={max_skipped}: the run has diverged; lower train.lr (or raise "
                            f"train.max_skipped) and resume from a checkpoint before step {step}")
                ended = "stopped: too many skipped steps"
                break
            if bool(gathered[:, STAT_COLUMNS.index("stop")].max() > 0):
                ended = f"stopped by {stop.received or 'a signal on another rank'}"
                break
            if cfg.train.exit_after_steps is not None and step - start_step >= cfg.train.exit_after_steps:
                ended = f"stopped after train.exit_after_steps={cfg.train.exit_after_steps}"
                break
            if cfg.train.save_every and step % cfg.train.save_every == 0 and step < run.total_steps:
                save(step)
        if ended != "finished" or cfg.train.save_final:
            save(step)
        if ended != "finished" and diverged is None:
            metrics.message(f"[train] {ended} at step {step}/{run.total_steps}; resume with train.resume=auto")
    except BaseException as exc:
        status.end(*ended_by(exc, rank()))
        raise
    finally:
        batches.close()
        stop.uninstall()
        metrics.close()
        run.sp.set_active(1)  # the summary's model runs on its own (no SP group, no last pack's boundaries)
    if diverged is not None:  # after the checkpoint: train.py turns it into one line and exit 1
        status.end(*ended_by(FloatingPointError(diverged), rank()))
        raise FloatingPointError(diverged)
    status.end("finished" if ended == "finished" else "preempted")
    return {"start_step": start_step, "end_step": step, "losses": history, "ended": ended,
            "skipped": num_skipped, "run": run}


def skip_limit(max_skipped: Optional[int], total_steps: int) -> int:
    """The most skipped steps a run may have (train.max_skipped; None = 5% of its steps, at least 1)."""
    return max_skipped if max_skipped is not None else max(1, math.ceil(0.05 * total_steps))


def train_step(run: Run, step_batch: StepBatch, stop_requested=lambda: False) -> tuple:
    """One optimizer step. Returns (gathered per-rank stats [W, len(stat_columns(run))], skipped: bool, lr used).

    The statistics travel once, after the optimizer step: the step's sums stay on the device until then and go in
    one all-gather with the gradient norm DeepSpeed computed in step() (at world size 1 only the device values come
    back). Every rank decides the same about a NaN/inf loss or gradient (and about stopping: ``stop_requested()`` is
    read just before) from the same numbers. With on_nan=skip DeepSpeed's overflow check has already dropped such a
    step's update; with abort the run stops here, before anything could save the update.
    """
    reset_peak_memory()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    # This rank's own compute: the step's time less its waits inside the gradient reduction (see comm_wait_timer),
    # timed on sampled steps only on a GPU, where timing a wait costs a sync around each collective.
    timing = comm_wait_mode(getattr(run.cfg, "logging", None), step_batch.step, torch.cuda.is_available(),
                            world_size())
    start = time.perf_counter()
    with comm_wait_timer(timing == "exclude") as comm_wait:
        local = forward_backward(run, step_batch, waited=lambda: comm_wait[0])
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    compute_time = float("nan") if timing == "skip" else time.perf_counter() - start - comm_wait[0]
    peak_mem = peak_memory_gib()  # forward and backward's peak (the optimizer step's is the memory model's)
    lr = run.engine.get_lr()[0]  # the rate this step's update uses (the scheduler moves on inside step())
    run.engine.step()
    grad_norm = run.engine.get_global_grad_norm()  # a device tensor, or a number (inf: an overflow), or None
    values = [compute_time, local["loss_sum"], local["loss_tokens"], local["tokens"], local["flops"],
              local["nonfinite"], float(stop_requested()), peak_mem, *run.sp.stats.take_step_counts(),
              local["aux_sum"], float("nan") if grad_norm is None else grad_norm,
              *local["sp_mix"].values(run.sp.pstate.sp_degrees)]
    gathered = all_gather_floats(values, run.device)
    any_nonfinite = bool(gathered[:, STAT_COLUMNS.index("nonfinite")].max() > 0)
    norm = float(gathered[0, STAT_COLUMNS.index("grad_norm")])
    if run.cfg.train.on_nan == "abort" and (any_nonfinite or (grad_norm is not None and not math.isfinite(norm))):
        what = "loss" if any_nonfinite else "gradient norm"
        raise FloatingPointError(
            f"step {step_batch.step}: the {what} is NaN/inf (train.on_nan=abort); set train.on_nan=skip to skip such "
            "steps, or lower train.lr")
    # A NaN/inf loss gives NaN/inf gradients: ZeRO then skips the update and clears them (see build.deepspeed_config).
    skipped = any_nonfinite or not run.engine.was_step_applied()
    return gathered, skipped, lr


def forward_backward(run: Run, step_batch: StepBatch, waited=lambda: 0.0) -> dict:
    """Forward and backward of all this rank's micro-batches of one step; gradients end up reduced and ready for
    ``engine.step()``. Returns this rank's sums (token-loss sum, MoE aux sum and nonfinite flag as 0-dim tensors on
    the device; loss tokens, tokens and flops as numbers) and its tokens and compute seconds per SP degree
    ("sp_mix"; ``waited``: seconds spent in collectives so far). Reads nothing back from the device."""
    engine = run.engine
    active = None  # (group, sp) the model is set up for
    shape = parse_model_shape(run.model.config)
    num_micro = len(step_batch.micro_batches)
    loss_sum = torch.zeros((), dtype=torch.float64, device=run.device)
    aux_sum = torch.zeros((), dtype=torch.float64, device=run.device)  # MoE: Σ pack aux x its local loss tokens
    tokens = flops = loss_tokens = 0.0
    sp_mix = SPMixTimer(waited)
    for k, micro_batch in enumerate(step_batch.micro_batches):
        # A step that mixes packing groups (plan step_mix="mixed") switches group settings between micro-batches.
        group, sp = micro_batch.get("group", step_batch.group), micro_batch.get("sp", step_batch.sp)
        if (group, sp) != active:
            sp_mix.switch(sp)
            set_checkpointed_layers(run.model, step_ckpt_layers(
                run.cfg, group, micro_batch.get("ckpt_layers", step_batch.ckpt_layers),
                run.data.groups if run.data is not None else None))
            run.sp.set_active(sp)  # SP: the attention dispatcher switches to the group's degree
            if run.levers is not None and "pack_len" in micro_batch:  # the group's tiled MLP and offload
                run.levers.set(step_levers(micro_batch, run.data.groups if run.data is not None else None,
                                           shape.hidden, run.cfg.deepspeed.zero_stage))
            active = (group, sp)
        if micro_batch["num_samples"]:
            # Under SP each rank of the group does 1/sp of the pack's work (its token slice, its share of heads).
            tokens += micro_batch["input_ids"].shape[1] / sp
            sp_mix.add_tokens(sp, micro_batch["input_ids"].shape[1] / sp)
            flops += pack_flops(shape, micro_batch["seq_lens"]) / sp
        # One boundary per step, at its last micro-batch: ZeRO accumulates gradients until then.
        engine.set_gradient_accumulation_boundary(k == num_micro - 1)
        local = run.sp.split(micro_batch)  # SP: this rank's slice of the pack (on the host)
        # Counted on the host (the collate step's count at sp=1): the loss selects its rows without a sync.
        num_local_loss = (micro_batch["num_loss_tokens"] if sp == 1
                          else int((local["shift_labels"] != IGNORE_INDEX).sum()))
        loss_tokens += num_local_loss
        batch = to_device(local, run.device)
        # offload (a group's lever): the checkpointed layers' inputs leave for host memory in the forward and come
        # back in the backward, both inside the context
        with run.levers.micro_batch() if run.levers is not None else nullcontext():
            # SP: live CR — the attention dispatcher books this slice's real tokens as SP tokens or not.
            run.sp.begin_micro_batch(batch["num_local_tokens"] if micro_batch["num_samples"] else 0)
            weights_T = _loss_weights(run, batch, step_batch, sp)
            objective, loss_T = engine(batch["input_ids"], batch["position_ids"], batch["shift_labels"],
                                       batch["cu_seqlens"] if sp == 1 else None,
                                       batch["max_seqlen"] if sp == 1 else None,
                                       loss_weights=weights_T, num_loss_tokens=num_local_loss)
            loss_sum += loss_T.detach().double().sum()  # stays on the device: no sync per micro-batch
            if run.router_aux is not None:  # MoE: the pack's (or each sample's) router loss, given to its loss tokens
                aux = pack_aux_loss(engine.module.router_logits,
                                    batch["num_local_tokens"] if micro_batch["num_samples"] else 0, run.router_aux,
                                    run.sp.reduce_loss, engine.module.router_choices, batch["sample_ids"],
                                    micro_batch["num_samples"])
                # sum_t w_t (loss_t + coef aux_t): aux is the pack's, or each token's sample's (moe.py); w_t = 0 where
                # there is no label
                objective = objective + run.router_aux.coef * (aux * weights_T).sum()
                aux_sum += (aux.detach().double() * (batch["shift_labels"][0] != IGNORE_INDEX)).sum()
            engine.backward(run.sp.reduce_loss(objective))
    sp_mix.stop()
    # A NaN/inf token loss anywhere makes the sum NaN/inf.
    return {"loss_sum": loss_sum, "aux_sum": aux_sum, "loss_tokens": loss_tokens, "tokens": tokens,
            "flops": flops, "nonfinite": (~torch.isfinite(loss_sum)).double(), "sp_mix": sp_mix}


def _loss_weights(run: Run, batch: dict, step_batch: StepBatch, sp: int):
    """The micro-batch's per-token loss weights: sum_t w_t loss_t is its scalar for backward (loss.token_loss_weights).

    SP: each rank holds the token losses of its slice only. Its partial loss is scaled for the W/sp data-parallel
    replicas and summed over the SP group with a differentiable all-reduce (SequenceParallel.reduce_loss), so every
    rank back-propagates its group's loss; DeepSpeed's average over all W ranks then gives the exact step gradient
    (docs/sequence_parallel.md).
    """
    return token_loss_weights(
        batch["shift_labels"], batch["sample_ids"], run.cfg.loss.normalizer,
        # max(.., 1): a replica (or step) may hold only empty packs; its token sum is 0 anyway.
        global_loss_tokens=max(step_batch.global_loss_tokens, 1),
        # token_mean: this rank's loss tokens (a step mixing groups gives its SP packs one divisor per SP group)
        rank_loss_tokens=max(batch.get("rank_loss_tokens", step_batch.rank_loss_tokens), 1),
        global_num_samples=max(step_batch.global_num_samples, 1), rank_num_samples=step_batch.rank_num_samples,
        dp_world_size=run.grad_divisor // sp,  # SP: W/sp replicas of this micro-batch's group, see above
        num_micro_batches=1,  # gradient_accumulation_steps=1: no 1/m from DeepSpeed
        sample_loss_tokens_T=batch["sample_loss_tokens"],
    )


def _eval_due(step: int, total_steps: int, eval_every: int) -> bool:
    """Held-out loss after this step: every eval_every steps, and after the run's last step."""
    return step + 1 == total_steps or (eval_every > 0 and (step + 1) % eval_every == 0)
