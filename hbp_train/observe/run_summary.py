"""The start-of-run summary: what is about to be trained, on what, and how, in a few lines printed once by rank 0.

Everything here is read from the built run (trainer.train prints it before the first step): the model (its folder
or the architecture built from scratch, its parameters and those trained, e.g. under LoRA), the precision and the
packed attention backend, the ranks, the SP degrees and ZeRO stage, the data (samples, tokens, what the plan
dropped), the run's length (optimizer steps per epoch, epochs, tokens per step, learning rate and warm-up) and the
memory levers each packing group runs with.
"""

from __future__ import annotations

from hbp_train.common.errors import UserError
from hbp_train.model.attention import get_backend
from hbp_train.model.levers import describe_groups
from hbp_train.perf.shape import parse_model_shape
from hbp_train.distributed.groups import world_size


def count_parameters(model) -> tuple[int, int]:
    """(all parameters, trainable ones) of ``model``; a ZeRO-3 partitioned parameter counts in full (ds_numel)."""
    total = trainable = 0
    for p in model.parameters():
        n = int(getattr(p, "ds_numel", p.numel()))
        total += n
        trainable += n if p.requires_grad else 0
    return total, trainable


def _count(n: float) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.2f}{unit}"
    return str(int(n))


def start_summary(run) -> str:
    """The summary lines of a run built by build.build (its cfg, model, data and total_steps)."""
    cfg, model = run.cfg, run.model
    total, trainable = count_parameters(model)
    source = (cfg.model.name_or_path if cfg.model.name_or_path is not None
              else f"built from scratch (model.init_config, random weights, model.seed={cfg.model.seed})")
    trained = "all trained"
    if trainable != total:
        lora = f", LoRA r={cfg.model.lora.r}" if cfg.model.lora.r else ""
        trained = f"{_count(trainable)} trained ({100 * trainable / total:.2f}%{lora})"
    lines = [f"[train] model: {getattr(model.config, 'model_type', '?')} {source} | {_count(total)} parameters, "
             f"{trained} | {str(cfg.model.torch_dtype()).replace('torch.', '')} | attention {get_backend()}"]
    groups = ", ".join(f"{g['pack_len']}:sp{g.get('sp', 1)}" for g in run.data.groups)
    lines.append(f"[train] ranks: {world_size()} | ZeRO-{cfg.deepspeed.zero_stage} | SP degrees "
                 f"{', '.join(map(str, run.sp.pstate.sp_degrees))} | packing groups {groups}")
    metrics = run.data.plan.get("metrics") or {}
    steps_per_epoch = run.data.num_steps
    tokens = metrics.get("tokens")
    data = f"[train] data: {cfg.data.shards}"
    if metrics.get("num_samples") is not None:
        # after a resume on another number of ranks, the samples trained before it are left out of the re-plan
        # (listed as dropped for that reason): counted apart, not as the plan's drops
        trained = 0 if (run.data.plan.get("replanned") or {}).get("head_steps") else \
            int((run.data.plan.get("replanned") or {}).get("trained", 0))
        dropped = metrics.get("num_dropped", 0) - trained
        data += f" ({metrics['num_samples']:,} samples, {dropped:,} dropped by the plan"
        data += f", {trained:,} trained before the resume" if trained else ""
        data += f", {tokens:,} tokens)" if tokens is not None else ")"
    if cfg.data.eval_shards:
        data += f" | held-out {cfg.data.eval_shards}"
    lines.append(data)
    per_step = f", ~{tokens / steps_per_epoch:,.0f} tokens per step" if tokens else ""
    warmup = cfg.train.warmup_for(run.total_steps)
    limit = f" (train.max_steps={cfg.train.max_steps})" if cfg.train.max_steps is not None else ""
    lines.append(f"[train] run: {steps_per_epoch} optimizer steps per epoch x {cfg.data.epochs} epochs = "
                 f"{run.total_steps} steps{limit}{per_step} | lr {cfg.train.lr:g}, warm-up {warmup} steps | "
                 f"out {cfg.train.out_dir}")
    lines.append(levers_line(run.data.groups, model.config, cfg))
    return "\n".join(lines)


def levers_line(groups: list, hf_config, cfg) -> str:
    """Which packing group runs with which memory levers (model/levers.py; under ZeRO-3 the tiling every step runs),
    and the loss's chunk (the third lever, always on)."""
    try:
        hidden = parse_model_shape(hf_config).hidden
    except UserError:  # not a config the shape reader knows: the tile count is the model's own hidden_size
        hidden = int(hf_config.hidden_size)
    line = f"[train] memory levers: {describe_groups(groups, hidden, cfg.deepspeed.zero_stage)}"
    loss = getattr(cfg, "loss", None)
    return line + (f" | loss: LM head + loss in chunks of {loss.chunk_size} tokens" if loss is not None else "")
