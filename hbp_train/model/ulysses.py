"""DeepSpeed-Ulysses sequence parallelism (SP) with several SP degrees, switched from one step to the next.

HBP puts every step in one group, and groups use different SP degrees (short packs sp=1, long packs sp=2, 4, …),
so one training run switches the SP degree between steps inside one DeepSpeed engine. All of it is one object,
`SequenceParallel`, built once per run (`setup_sequence_parallel`, called by build.py) and held by the trainer's
Run; nothing lives in module globals:

* start-up: one DeepSpeed `UlyssesSPAttentionHF` per SP degree > 1, each on this rank's SP group from
  distributed/groups.py and each wrapping our packed core attention (`attention.hf_packed_attention`). The wrapper
  all-to-alls q/k/v from "my slice of the tokens, all heads" to "all tokens, my share of the heads", and
  all-gathers position_ids, so the core sees the whole pack and keeps its samples apart by the position_ids
  restarts. The object's bound `attention` method is registered with transformers' AttentionInterface as
  "hbp_ulysses" (`install`) and routes each call to the active degree; sp=1 calls the packed attention directly:
  no communication, and the fast varlen kernel on a GPU. A run whose plan has only sp=1 installs nothing.
* per step: `set_active(sp)`; the collate step gives each rank its slice of the pack (`split`, `split_for_sp`).
* loss: each rank only has the token losses of its slice; `reduce_loss` sums them over the SP group with the
  differentiable all-reduce, so every rank of the group back-propagates the group's loss (with a plain local
  loss the gradients come out 1/sp too small when the loss is scaled for the W/sp data-parallel replicas).
* live CR: `begin_micro_batch` and the dispatcher count the tokens that went through the all-to-all (`SPStats`).

Deliberately NOT used (docs/sequence_parallel.md): `UlyssesSPAttentionHF.register_with_transformers` and an
`mpu`. The former allows one SP group per process and drops non-BlockMask masks; an mpu makes ZeRO divide
gradients by a divisor fixed at `deepspeed.initialize`, which is wrong as soon as the degree changes.

Unequal head dims (MLA, e.g. DeepSeek-V3: q/k 192, v 128): DeepSpeed's wrapper moves q, k and v at one head
size (it asserts k and v shapes equal). The dispatcher pads v with zeros to the q/k head size before the
all-to-all, the core attention (`_core_attention`) strips the padding, attends, and pads its output again for the
way back; the dispatcher then drops the padded part of the output. Zero columns of v give zero output columns, so
this is exact (forward and backward); the cost is v and the output travelling at the q/k head size.

Head limits (checked at start-up by `check_sp_heads`, whose rule is `perf.shape.sp_heads_problem`): sp must divide
the number of query heads, and sp and the number of key/value heads must divide one another (kv heads are
replicated when sp exceeds them, e.g. 1 kv head at sp=4).

Shape legend: B batch (1: one pack per micro-batch), T tokens of the pack, T_l tokens of this rank's slice,
H query heads, K key/value heads, D head dim.
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from hbp_train.model.attention import ATTN_IMPLEMENTATION as PACKED_ATTN_IMPLEMENTATION
from hbp_train.model.attention import hf_packed_attention
from hbp_train.model.attention_calls import attention_heads
from hbp_train.model.attention_setup import use_attention
from hbp_train.common.errors import UserError
from hbp_train.common.labels import IGNORE_INDEX
from hbp_train.model.rope import PackSlice
from hbp_train.perf.shape import sp_heads_problem

ATTN_IMPLEMENTATION = "hbp_ulysses"

# Keys of a collated batch that hold one value per token ([1, T]) and what padding tokens get in them.
# input_ids 0: any valid id; the padding tokens form their own dummy sample and carry no loss.
TOKEN_PAD_VALUES = {"input_ids": 0, "shift_labels": IGNORE_INDEX, "labels": IGNORE_INDEX}
# Boundary arguments an sp=1 caller may hand to the model: under SP they would describe this rank's slice
# instead of the gathered pack, so the dispatcher drops them and the core uses the gathered position_ids.
_LOCAL_BOUNDARY_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")
# torch marks torch.distributed.nn.functional.all_reduce deprecated, but its backward (an all-reduce of the
# gradients) is exactly what the SP loss needs and is what tests/test_ulysses.py verifies: keep the warning out of
# every training log.
warnings.filterwarnings("ignore", message="torch.distributed.nn.functional.all_reduce is deprecated",
                        category=FutureWarning)


def check_sp_heads(num_heads: int, num_kv_heads: int, sp_degrees) -> None:
    """Raise a one-line UserError if Ulysses cannot split this model's heads at one of the SP degrees."""
    for sp in sorted(set(sp_degrees)):
        problem = sp_heads_problem(num_heads, num_kv_heads, sp)
        if problem:
            raise UserError(problem)


class SPStats:
    """Live communication ratio: tokens that went through the SP all-to-all over all tokens (the planner's CR,
    measured). Counted per rank by the dispatcher, summed over ranks by the trainer's per-step all-gather."""

    def __init__(self):
        self.step = [0, 0]  # this rank, this step: [tokens, tokens through the all-to-all]
        self.total = [0.0, 0.0]  # all ranks, all steps so far

    def book(self, num_tokens: int, through_all_to_all: bool) -> None:
        self.step[0] += num_tokens
        self.step[1] += num_tokens if through_all_to_all else 0

    def take_step_counts(self) -> tuple[int, int]:
        """(tokens, SP tokens) this rank booked since the last call; resets them."""
        counts, self.step = tuple(self.step), [0, 0]
        return counts

    def totals(self) -> list:
        """[tokens, SP tokens] of all ranks since the run started (saved in checkpoints)."""
        return list(self.total)

    def start_run(self, totals=None) -> None:
        """Start counting for a run: from zero, or from a resumed run's ``totals`` (from its checkpoint)."""
        self.step = [0, 0]
        self.total = [float(totals[0]), float(totals[1])] if totals else [0.0, 0.0]

    def step_metrics(self, compute_times, tokens, sp_tokens) -> dict:
        """Metrics of one step from every rank's gathered values ([W] each): compute time, tokens, SP tokens.

        sp/cr_step and sp/cr: SP tokens over all tokens, this step and since the run started (resumes continue it);
        time/compute_s/rank<r>: each rank's forward+backward seconds (the spread behind balance/imbalance); None on
        a step whose times were not taken (NaN: step_timing.comm_wait_mode "skip").
        """
        step_tokens, step_sp_tokens = float(sum(tokens)), float(sum(sp_tokens))
        self.total[0] += step_tokens
        self.total[1] += step_sp_tokens
        metrics = {
            "sp/cr_step": step_sp_tokens / step_tokens if step_tokens else 0.0,
            "sp/cr": self.total[1] / self.total[0] if self.total[0] else 0.0,
        }
        for rank, seconds in enumerate(compute_times):
            metrics[f"time/compute_s/rank{rank}"] = float(seconds) if seconds == seconds else None
        return metrics


class SequenceParallel:
    """This rank's sequence parallelism: the SP groups of every degree (``pstate``), the active degree, the Ulysses
    attention of every degree > 1 (``wrappers``) and the live CR counters (``stats``).

    ``model`` None builds no attention (a stand-in for code that only splits packs; ``set_active`` then accepts
    sp=1 only). ``heads``: (query heads, kv heads, q/k head size, v head size) as the model's layers hand them to the
    attention function (compat.check_model_support's record); read from the model when not given, never from a
    config field the family may not use. Every rank must build it, for the same degrees (the wrappers look up their
    groups).
    """

    def __init__(self, pstate, model=None, heads=None):
        self.pstate = pstate
        self.active_sp = 1
        self.stats = SPStats()
        self.wrappers = {}
        # Under kv replication the wrapper overwrites module.num_key_value_groups and never restores it.
        self._kv_groups = []
        self._pending_tokens = 0
        self._installed = False
        self._v_head_dim = None  # this call's v head dim when it is padded to the q/k head dim (MLA), else None
        # The whole (padded) pack's boundaries of the micro-batch `split` last cut: (cu_seqlens on the host,
        # max_seqlen, the same cu_seqlens on the attention's device once the first layer needed it).
        self._pack_bounds = None
        if model is None or max(pstate.sp_degrees) == 1:
            return
        from deepspeed.runtime.sequence_parallel.ulysses_sp import UlyssesSPAttentionHF

        num_heads, num_kv_heads, head_dim = (heads or attention_heads(model.config))[:3]  # MLA: q/k's head dim
        num_layers = int(getattr(model.config, "num_hidden_layers", 1) or 1)
        check_sp_heads(num_heads, num_kv_heads, pstate.sp_degrees)
        self.wrappers = {
            sp: UlyssesSPAttentionHF(
                attn=self._core_attention, batch_size=1, attn_head_count=num_heads, attn_head_size=head_dim,
                kv_head_count=num_kv_heads, num_hidden_layers=num_layers,
                process_group=pstate.sp_group(sp),
                seq_length_is_variable=True,  # pack lengths change every step
            )
            for sp in pstate.sp_degrees
            if sp > 1
        }
        self._kv_groups = [(m, m.num_key_value_groups) for m in model.modules() if hasattr(m, "num_key_value_groups")]

    # ------------------------------------------------------------------------------------------ installing
    def install(self, model) -> None:
        """Route the model's attention through this object's dispatcher ("hbp_ulysses").

        transformers looks attention functions up by name, so the bound method is registered under that name at
        every install: the last SequenceParallel installed in a process owns it (one training run per process).
        Call after `attention_setup.register_packed_attention` (which chose the core backend) and before
        `deepspeed.initialize`.
        """
        use_attention(model, ATTN_IMPLEMENTATION, self.attention)
        self._installed = True

    def uninstall(self, model) -> None:
        """Back to the plain packed attention ("hbp_packed")."""
        use_attention(model, PACKED_ATTN_IMPLEMENTATION)
        self._installed = False

    # ------------------------------------------------------------------------------------------- per step
    def set_active(self, sp: int) -> None:
        """Route attention to degree ``sp`` from now on (every rank must switch at the same step)."""
        if sp != 1 and sp not in self.wrappers:
            raise ValueError(
                f"sp={sp} has no Ulysses attention (built: {', '.join(map(str, self.pstate.sp_degrees))}); "
                f"pass every SP degree of the plan to build_parallel_state"
            )
        for module, groups in self._kv_groups:
            module.num_key_value_groups = groups
        self.active_sp = sp
        self._pack_bounds = None  # the next `split` cuts at this degree

    def split(self, batch: dict) -> dict:
        """This rank's slice of a collated pack at the active degree (see `split_for_sp`).

        Also remembers the whole padded pack's sample boundaries for the core attention: every layer of the
        micro-batch's forward, and each layer recomputed in its backward, then uses them as they are, instead of
        finding them in the position_ids DeepSpeed gathers anew per layer (a nonzero() and an .item() per layer:
        two host syncs each). Call it once per micro-batch, before its forward."""
        local = split_for_sp(batch, self.active_sp, self.pstate.sp_rank(self.active_sp))
        self._pack_bounds = None
        if self.active_sp > 1 and "cu_seqlens" in batch:
            # max_seqlen bounds every sample the kernel sees, the padding's too: a flash kernel skips the rows of a
            # sample longer than it (left uninitialised: NaN x 0 in the weight gradient), and tiny samples at sp >= 4
            # can be shorter than the padding
            self._pack_bounds = [padded_cu_seqlens(batch["cu_seqlens"], local["num_pad_tokens"]),
                                 max(int(batch["max_seqlen"]), local["num_pad_tokens"]), None]
        return local

    def begin_micro_batch(self, num_tokens: int) -> None:
        """Announce this rank's real (non-padding) tokens of the next forward. With the dispatcher installed, it
        books them on its first call, as SP tokens if they went through the all-to-all; otherwise here."""
        if self._installed:
            self._pending_tokens = int(num_tokens)
        else:
            self.stats.book(int(num_tokens), through_all_to_all=False)

    # ---------------------------------------------------------------------------------------- attention
    def attention(self, module, query, key, value, attention_mask, **kwargs):
        """transformers AttentionInterface function: [1, H, T_l, D] q, [1, K, T_l, D] k/v -> ([1, T_l, H, D], None)."""
        if self._pending_tokens:  # the first attention call of a micro-batch: book where its tokens went
            self.stats.book(self._pending_tokens, through_all_to_all=self.active_sp > 1)
            self._pending_tokens = 0
        if self.active_sp == 1:
            return hf_packed_attention(module, query, key, value, attention_mask, **kwargs)
        for name in _LOCAL_BOUNDARY_KWARGS:
            kwargs.pop(name, None)
        head_dim, v_head_dim = query.shape[-1], value.shape[-1]
        if v_head_dim == head_dim:
            return self.wrappers[self.active_sp](module, query, key, value, attention_mask, **kwargs)
        # MLA: DeepSpeed's wrapper moves one head size; pad v for the trip (module docstring).
        self._v_head_dim = v_head_dim
        try:
            value = torch.nn.functional.pad(value, (0, head_dim - v_head_dim))
            out, weights = self.wrappers[self.active_sp](module, query, key, value, attention_mask, **kwargs)
        finally:
            self._v_head_dim = None
        return out.unflatten(-1, (-1, head_dim))[..., :v_head_dim], weights

    def _core_attention(self, module, query, key, value, attention_mask, **kwargs):
        """The packed attention DeepSpeed's wrapper calls on the whole pack; strips v's padding (MLA) first and
        pads the output back to the head size the wrapper's all-to-all expects. The pack's boundaries come from
        `split` when it cut this micro-batch (copied to the device once), else from the gathered position_ids."""
        if self._pack_bounds is not None:
            bounds = self._pack_bounds
            if bounds[2] is None or bounds[2].device != query.device:
                bounds[2] = bounds[0].to(query.device, non_blocking=True)
            kwargs.update(cu_seq_lens_q=bounds[2], max_length_q=bounds[1])
        if self._v_head_dim is None:
            return hf_packed_attention(module, query, key, value, attention_mask, **kwargs)
        head_dim = value.shape[-1]
        out, weights = hf_packed_attention(module, query, key, value[..., :self._v_head_dim], attention_mask, **kwargs)
        return torch.nn.functional.pad(out, (0, head_dim - self._v_head_dim)), weights

    # -------------------------------------------------------------------------------------------- loss
    def reduce_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Sum a rank's partial loss over its active SP group, differentiably (identity at sp=1).

        Scale the partial loss for the W/sp data-parallel replicas (normalize_loss's dp_world_size = W // sp):
        with the all-reduce every rank of a group back-propagates the group's loss, and DeepSpeed averages over
        all W ranks.
        """
        if self.active_sp == 1:
            return loss
        from torch.distributed.nn.functional import all_reduce

        # all_reduce, not all_gather: the latter's backward fails on gloo subgroups without global rank 0.
        return all_reduce(loss, op=dist.ReduceOp.SUM, group=self.pstate.sp_group(self.active_sp))


def setup_sequence_parallel(model, pstate, heads=None) -> SequenceParallel:
    """The run's `SequenceParallel`: the Ulysses attention of every SP degree in ``pstate``, installed on ``model``
    when a degree > 1 is used (an sp=1-only run keeps the plain packed attention).

    Call after `attention_setup.register_packed_attention(model, backend)` and before `deepspeed.initialize`; every rank
    must call it. Raises UserError at start-up if a degree cannot split the model's heads (`check_sp_heads`);
    ``heads``: see `SequenceParallel`.
    """
    sp = SequenceParallel(pstate, model, heads)
    if sp.wrappers:
        sp.install(model)
    return sp


# ------------------------------------------------------------------------------------------------ collate
def padded_cu_seqlens(cu_seqlens: torch.Tensor, num_pad: int) -> torch.Tensor:
    """The boundaries of a pack after `split_for_sp` padded it: its samples, then the padding tokens as one
    sample of their own (int32, on the host)."""
    cu_seqlens = cu_seqlens.to("cpu", torch.int32)
    if not num_pad:
        return cu_seqlens
    return torch.cat([cu_seqlens, cu_seqlens[-1:] + num_pad])


def split_for_sp(batch: dict, sp: int, sp_rank: int) -> dict:
    """This SP rank's slice of one collated pack.

    The pack is padded at the end to a multiple of ``sp`` (at most sp-1 tokens) and cut into sp equal slices;
    rank ``sp_rank`` gets slice ``sp_rank`` of every per-token tensor ([1, T]: input_ids, position_ids,
    shift_labels, and any other [1, T] tensor such as per-token sample ids or loss-token counts). Padding tokens
    get shift_label IGNORE_INDEX (no loss) and position_ids 0, 1, …, so they form their own dummy sample and never
    join a real one. Labels must already be shifted per sample (shift_labels), because the shift crosses slice
    borders. Everything else (cu_seqlens of the real samples, max_seqlen, counts) is kept as is: it describes the
    whole pack. Adds ``num_pad_tokens`` (padding in the whole pack), ``num_local_tokens`` (real tokens in this
    slice) and, when the batch has its cu_seqlens, ``pack_slice`` (rope.PackSlice: the pack's samples, its padding
    and this slice's place, for per-sample RoPE). sp == 1 returns the batch unchanged apart from those keys.
    """
    if sp < 1 or not 0 <= sp_rank < sp:
        raise ValueError(f"split_for_sp: need sp >= 1 and 0 <= sp_rank < sp, got sp={sp}, sp_rank={sp_rank}")
    num_tokens = batch["input_ids"].shape[-1]
    for key, what in (("shift_labels", "labels shifted per sample"), ("position_ids", "restarting per sample")):
        if key not in batch:
            raise ValueError(f"split_for_sp needs {key} ({what}) in the batch")
    if sp == 1:
        return {**batch, "num_pad_tokens": 0, "num_local_tokens": num_tokens, **_pack_slice(batch, 0, 0, num_tokens)}
    num_pad = -num_tokens % sp
    local = (num_tokens + num_pad) // sp
    start, end = sp_rank * local, (sp_rank + 1) * local
    out = {}
    for key, value in batch.items():
        if isinstance(value, torch.Tensor) and value.dim() == 2 and value.shape == (1, num_tokens):
            if num_pad:
                if key == "position_ids":
                    pad = torch.arange(num_pad, dtype=value.dtype, device=value.device)[None]
                elif key == "sample_ids":  # per-token sample id: the padding is one more sample
                    pad = torch.full((1, num_pad), int(value.max()) + 1, dtype=value.dtype, device=value.device)
                else:
                    pad = torch.full((1, num_pad), TOKEN_PAD_VALUES.get(key, 0), dtype=value.dtype, device=value.device)
                value = torch.cat([value, pad], dim=1)
            value = value[:, start:end]
        out[key] = value
    out["num_pad_tokens"] = num_pad
    out["num_local_tokens"] = max(0, min(end, num_tokens) - start)
    out.update(_pack_slice(batch, num_pad, start, end))
    return out


def _pack_slice(batch: dict, num_pad: int, start: int, end: int) -> dict:
    """{"pack_slice": where the slice lies in its pack (rope.PackSlice: per-sample RoPE reads each token's whole
    sample length from it)} when the batch has its cu_seqlens (on the host), else {}."""
    if "cu_seqlens" not in batch:
        return {}
    return {"pack_slice": PackSlice(PackSlice.whole(batch["cu_seqlens"]).bounds, num_pad, start, end)}
