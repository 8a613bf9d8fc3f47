"""Held-out loss during training: the token-mean loss of packed held-out shards, every ``train.eval_every`` steps.

The held-out data is packed like the training data (``data_tools.pack --shards``, same world size), so it runs
through the same machinery: each rank forwards its replica's packs of every plan step, at that step's SP degree
(its slice of each pack; SP groups exist for every degree of both plans, see build.build). Every rank sums its
token losses and loss tokens; one all-reduce over all ranks gives the exact token mean over the whole held-out
set, since replicas split the packs and SP ranks split a pack's tokens, so every token is counted once.
No gradients, no optimizer state, and the live CR counters are untouched (no tokens are booked).
"""

from __future__ import annotations

import math
import sys
import time

import torch
import torch.distributed as dist

from hbp_train.batches.collate import to_device
from hbp_train.batches.loader import PackedData
from hbp_train.distributed.groups import rank as this_rank
from hbp_train.common.labels import IGNORE_INDEX


@torch.no_grad()
def evaluate(run, data: PackedData) -> dict:
    """Held-out metrics {"loss/eval", "ppl/eval", "eval/loss_tokens", "eval/seconds"}; every rank must call it."""
    start = time.perf_counter()
    rank = this_rank()
    engine = run.engine
    engine.eval()
    sums = torch.zeros(2, dtype=torch.float64, device=run.device)  # [token-loss sum, loss tokens]
    from tqdm import tqdm

    # A held-out set can take minutes: its own bar under the training bar (rank 0, bars on, and a terminal: in a
    # log file a bar that erases itself leaves only cursor codes).
    bar = tqdm(range(data.num_steps), desc="eval", unit="step", leave=False, file=sys.stderr,
               disable=rank != 0 or not run.cfg.logging.progress_bar or not sys.stderr.isatty())
    try:
        for step in bar:
            step_batch = data.step_batch(step, rank, run.pad_token_id)
            # Every rank of the step runs every micro-batch (empty packs are dummies): the SP all-to-alls and the
            # ZeRO-3 parameter gathers are collectives and need all their ranks.
            for micro_batch in step_batch.micro_batches:
                sp = micro_batch.get("sp", step_batch.sp)  # a step that mixes groups switches degree
                run.sp.set_active(sp)
                batch = to_device(run.sp.split(micro_batch), run.device)
                loss_T = engine(batch["input_ids"], batch["position_ids"], batch["shift_labels"],
                                batch["cu_seqlens"] if sp == 1 else None, batch["max_seqlen"] if sp == 1 else None,
                                pack_slice=batch.get("pack_slice"))  # each sample's own RoPE, as in training
                sums[0] += loss_T.double().sum()
                sums[1] += float((batch["shift_labels"] != IGNORE_INDEX).sum())
    finally:
        engine.train()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(sums)
    loss_sum, loss_tokens = float(sums[0]), float(sums[1])
    loss = loss_sum / loss_tokens if loss_tokens else float("nan")
    return {"loss/eval": loss, "ppl/eval": math.exp(min(loss, 50.0)), "eval/loss_tokens": loss_tokens,
            "eval/seconds": time.perf_counter() - start}
