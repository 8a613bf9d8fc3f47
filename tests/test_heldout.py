"""Tests for hbp_train/observe/heldout.py: the held-out loss on 2 gloo processes (no DeepSpeed: a stand-in engine whose
per-token loss is known) equals the token mean over every labelled token of every pack, computed here directly."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hbp_train.common.labels import IGNORE_INDEX
from tests.distributed import run_distributed

PAD = 0


def _pack(lengths, first_id):
    """A collated pack of samples with the given lengths: ids first_id.., labels shifted per sample (IGNORE_INDEX at
    each sample's last token and on every third token, as a prompt mask would)."""
    ids = torch.arange(first_id, first_id + sum(lengths))[None]
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    labels[0, ::3] = IGNORE_INDEX
    ends = torch.cumsum(torch.tensor(lengths), 0) - 1
    labels[0, ends] = IGNORE_INDEX
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()], dtype=torch.int32)
    return {"input_ids": ids, "position_ids": pos, "shift_labels": labels, "cu_seqlens": cu,
            "max_seqlen": max(lengths)}


# step 0 at sp=1: each rank runs its own replica's packs (different token counts, so a mean of rank means is wrong);
# step 1 at sp=2: both ranks share one pack of odd length (a padding token).
STEPS = [
    {"sp": 1, "per_rank": [[_pack([5, 9], 1)], [_pack([3], 100), _pack([20, 2, 4], 200)]]},
    {"sp": 2, "per_rank": [[_pack([7, 6, 4], 300)]] * 2},
]


def _token_loss(input_ids, shift_labels):
    return torch.where(shift_labels != IGNORE_INDEX, 0.01 * input_ids.double() + 1.0, 0.0)


class _Engine:
    """Per-token loss 0.01 * id + 1 on labelled tokens; checks that sp > 1 slices get no whole-pack cu_seqlens, and
    that every forward gets its slice's place in the pack (per-sample RoPE, model/rope.py)."""

    def eval(self):
        pass

    def train(self):
        pass

    def __call__(self, input_ids, position_ids, shift_labels, cu_seqlens, max_seqlen, pack_slice):
        assert pack_slice.end - pack_slice.start == input_ids.shape[1]
        if cu_seqlens is not None:
            assert int(cu_seqlens[-1]) == input_ids.shape[1]
        return _token_loss(input_ids, shift_labels)[0].float()


def _eval_worker(rank, world_size):
    import torch.distributed as dist

    from hbp_train.observe import heldout
    from hbp_train.distributed.groups import build_parallel_state
    from hbp_train.model.ulysses import SequenceParallel

    class NoAttentionSP(SequenceParallel):
        """The real SP split, with no attention to switch (the stand-in engine has none)."""

        def set_active(self, sp):
            self.active_sp = sp

    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    data = SimpleNamespace(num_steps=len(STEPS), step_batch=lambda step, r, pad: SimpleNamespace(
        sp=STEPS[step]["sp"], micro_batches=STEPS[step]["per_rank"][r]))
    run = SimpleNamespace(engine=_Engine(), device=torch.device("cpu"), pad_token_id=PAD,
                          cfg=SimpleNamespace(logging=SimpleNamespace(progress_bar=False)),
                          sp=NoAttentionSP(build_parallel_state([1, 2])))
    return heldout.evaluate(run, data)


@pytest.mark.slow
def test_eval_loss_is_the_token_mean_over_ranks_and_sp_degrees():
    results = run_distributed(_eval_worker, 2)
    # Every pack once (the sp=2 pack is shared by both ranks, so count it once).
    packs = STEPS[0]["per_rank"][0] + STEPS[0]["per_rank"][1] + STEPS[1]["per_rank"][0]
    total = sum(float(_token_loss(p["input_ids"], p["shift_labels"]).sum()) for p in packs)
    tokens = sum(int((p["shift_labels"] != IGNORE_INDEX).sum()) for p in packs)
    for r in results:
        assert r["eval/loss_tokens"] == tokens
        assert r["loss/eval"] == pytest.approx(total / tokens, rel=1e-6)
        assert r["ppl/eval"] == pytest.approx(torch.tensor(total / tokens).exp().item(), rel=1e-6)
