"""A packed-shard row made a micro-batch, and the step a rank runs (StepBatch): the collate step of the loader.

Labels are shifted inside each sample (no sample predicts its neighbour's first token), sample ids and per-sample
loss-token counts derived; an empty pack is a one-token dummy with no loss token. Legend: T = tokens in a pack,
n = samples in a pack, m = micro-batches (packs) per replica in a step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from hbp_train.common.errors import UserError
from hbp_train.common.labels import IGNORE_INDEX

# A micro-batch is a plain dict (what the model, the SP split and the loss read), for one pack on one rank:
#   input_ids, position_ids, shift_labels [1, T] int64   (position_ids restart at 0 per sample; shift_labels are the
#                                                          labels shifted inside each sample, -100 on its last token)
#   sample_ids [1, T] int64            which sample of the pack each token belongs to (0..n-1)
#   sample_loss_tokens [1, T] int64    per token: the loss tokens of its whole sample (for sample_mean; stays right
#                                      after the SP split, where a rank only sees a slice of the sample)
#   cu_seqlens [n+1] int32, max_seqlen int, seq_lens list[int]   sample boundaries / lengths (attention FLOPs)
#   num_loss_tokens int, num_samples int   (num_samples 0 marks the empty dummy pack)
# Per-token tensors are [1, T] so that ulysses.split_for_sp slices all of them the same way.


@dataclass
class StepBatch:
    """Everything one rank needs for one optimizer step."""

    step: int
    """Global step index (epoch * optimizer steps of the plan + optimizer step)."""
    plan_step: int
    """The plan's optimizer step (an index into plan['steps'] when every plan step is its own optimizer step)."""
    group: int
    """The group of the step's (first) plan step; in a step that mixes groups each micro-batch has its "group"."""
    sp: int
    """The SP degree of that plan step; each micro-batch has its own "sp" too."""
    replica: int
    micro_batches: list
    """This rank's packs, in order; ``len`` = m, which varies by step. Each carries "sp", "group", "ckpt_layers",
    "pack_len", "tiled_mlp", "offload_activations"."""
    rank_loss_tokens: int
    """Loss tokens of this replica over all its micro-batches."""
    rank_num_samples: int
    global_loss_tokens: int
    """Loss tokens of the whole step, all replicas (from shard metadata: no collective)."""
    global_num_samples: int
    dp_size: int
    """Replicas in this step (= world_size // sp)."""
    ckpt_layers: Optional[int]
    """Checkpointed layers for this step's group, from the plan (None: the trainer's default)."""
    tiled_mlp: bool = False
    """This step's (first plan step's) group runs the tiled MLP (model/levers.py); each micro-batch has its own."""
    offload_activations: bool = False
    """This step's group offloads its checkpointed layers' hidden states; each micro-batch has its own."""
    plan_metrics: dict = field(default_factory=dict)
    """The plan's ABR/DBR/tokens for this step."""
    num_packs: int = 0
    """Packs of the step, all replicas, empty ones included."""
    capacity_tokens: int = 0
    """Sum of pack_len over the step's packs (all replicas): the tokens it could hold (live padding ratio)."""


def collate_pack(row: dict, check_counts: bool = True, where: str = "") -> dict:
    """Turn one packed-shard row into a micro-batch: shift labels inside each sample, derive sample ids."""
    input_ids = np.asarray(row["input_ids"], dtype=np.int64)
    labels = np.asarray(row["labels"], dtype=np.int64)
    position_ids = np.asarray(row["position_ids"], dtype=np.int64)
    cu = np.asarray(row["cu_seqlens"], dtype=np.int64)
    num_tokens = len(input_ids)
    if cu[0] != 0 or cu[-1] != num_tokens or len(labels) != num_tokens or len(position_ids) != num_tokens:
        raise UserError(f"{where}: cu_seqlens/labels/position_ids do not match input_ids ({num_tokens} tokens)")
    seq_lens = np.diff(cu)
    num_samples = len(seq_lens)
    shift_labels = np.full(num_tokens, IGNORE_INDEX, dtype=np.int64)
    shift_labels[:-1] = labels[1:]
    # The last token of each sample would otherwise predict the first token of the next one.
    shift_labels[cu[1:] - 1] = IGNORE_INDEX
    sample_ids = np.repeat(np.arange(num_samples, dtype=np.int64), seq_lens)
    per_sample = np.bincount(sample_ids[shift_labels != IGNORE_INDEX], minlength=num_samples)
    num_loss_tokens = int(per_sample.sum())
    if check_counts and "num_loss_tokens" in row and int(row["num_loss_tokens"]) != num_loss_tokens:
        raise UserError(
            f"{where}: num_loss_tokens={int(row['num_loss_tokens'])} but the labels give {num_loss_tokens}: "
            "the shards are stale or corrupt, re-run data_tools.pack --shards"
        )
    return {
        "input_ids": torch.from_numpy(input_ids)[None],
        "position_ids": torch.from_numpy(position_ids)[None],
        "shift_labels": torch.from_numpy(shift_labels)[None],
        "sample_ids": torch.from_numpy(sample_ids)[None],
        "sample_loss_tokens": torch.from_numpy(per_sample[sample_ids].astype(np.int64))[None],
        "cu_seqlens": torch.from_numpy(cu.astype(np.int32)),
        "max_seqlen": int(seq_lens.max()),
        "seq_lens": [int(x) for x in seq_lens],
        "num_loss_tokens": num_loss_tokens,
        "num_samples": num_samples,
    }


def empty_micro_batch(pad_token_id: int = 0) -> dict:
    """A one-token dummy pack with no loss token: keeps every rank's forward/backward count equal (ZeRO hooks and
    collectives must match) when a replica has fewer real packs than the others."""
    batch = collate_pack(
        {"input_ids": [pad_token_id], "labels": [IGNORE_INDEX], "position_ids": [0], "cu_seqlens": [0, 1]},
        check_counts=False,
    )
    batch["num_samples"] = 0
    return batch


def to_device(batch: dict, device: torch.device) -> dict:
    """The batch with its tensors on ``device`` (other fields as they are)."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}


def token_mean_divisors(parts: list, rank: int, world_size: int) -> None:
    """token_mean in a step that mixes groups: the mean over ranks of each rank's token mean, a rank's tokens being
    its own packs in the sp=1 plan steps and the packs of its SP group in the others. An SP pack's token losses are
    split over its group's ranks, each dividing its slice by its own count before the SP sum, so every rank of the
    group must divide by the same number: sp / sum over the group of 1 / count, which weights the pack as the
    mean over those ranks of 1 / count does. Sets micro_batch["rank_loss_tokens"] (the trainer's divisor)."""
    counts = np.zeros(world_size)
    for part in parts:
        sp = part["sp"]
        for j, tokens in enumerate(part["replica_loss_tokens"]):
            counts[j * sp:(j + 1) * sp] += tokens
    counts = np.maximum(counts, 1.0)
    for part in parts:
        sp = part["sp"]
        ranks = counts[(rank // sp) * sp:(rank // sp + 1) * sp]
        divisor = float(sp / np.sum(1.0 / ranks))
        for micro_batch in part["micro_batches"]:
            micro_batch["rank_loss_tokens"] = divisor
