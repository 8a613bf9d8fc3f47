"""Per-sample RoPE: every sample of a pack gets the cos/sin its model gives it when run alone.

Two of transformers' RoPE types read the length of the sequence in the forward (``dynamic_rope_update`` in
transformers' modeling_rope_utils: ``max(position_ids) + 1``): ``longrope`` (Phi-3) takes its long factors when the
length passes ``original_max_position_embeddings``, and ``dynamic`` (NTK) recomputes its base from the length. In a
pack that length is the pack's longest sample (under Ulysses SP, the longest part of a rank's slice), so a short
sample packed beside a long one would train on the long sample's frequencies. Every other type (default, linear,
yarn, llama3, proportional) gives each position the same cos/sin whatever the length.

HF stays the source of truth: each rotary-embedding module of such a model (the module the decoder calls with
``(x, position_ids[, layer_type])``, one per model, per layer type for Gemma 3) gets a forward that groups the
tokens of the slice by the regime their sample's FULL length selects (``longrope``: longer than the original
positions or not; ``dynamic``: ``max(length, max_position_embeddings)``), calls HF's own forward once per regime on
those tokens' positions with one more position, length - 1, appended (so that HF sees the sample's length even when
the rank holds only the sample's start) and drops its output. ``dynamic`` keeps state between HF's calls (its
grown frequencies); the state is reset to the module's fresh one before each call, so the reference is a fresh
forward on the sample alone. The rotary embedding runs once per forward, before the decoder layers (a
checkpointed layer's recompute reuses its cos/sin): the grouping is host arithmetic on the pack's sample
boundaries (`PackSlice`, made by the SP split on the host), a few slices and one concatenation on the device: no
host sync of ours (HF's dynamic forward compares its length with its cache on the host, once per call, as it
does alone). Each regime costs one rotary call over its tokens; types whose cos/sin do not depend on the length
are left as they are (no wrapper).

Outside `per_sample` (a forward that gives no `PackSlice`) the modules run HF's forward unchanged. Liger's RoPE
kernel (model/kernels.py) replaces ``apply_rotary_pos_emb``, which consumes the cos/sin made here: the two compose.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Callable, Optional

import numpy as np
import torch

# The PackSlice of the forward running now (set by `per_sample`), read by the patched rotary embeddings.
_PACK_SLICE: ContextVar[Optional["PackSlice"]] = ContextVar("hbp_pack_slice", default=None)


@dataclass(frozen=True, eq=False)
class PackSlice:
    """Where a forward's tokens lie in their pack: the pack's sample boundaries and the slice [start, end) of the
    (padded) pack this rank holds. Host values only; the SP split makes it (ulysses.split_for_sp)."""

    bounds: np.ndarray
    """The pack's cu_seqlens: [0, l1, l1+l2, ..., T] (its real samples)."""
    num_pad: int
    """Padding tokens after the last sample (the SP split's; they form one more sample of that length)."""
    start: int
    end: int

    @classmethod
    def whole(cls, cu_seqlens) -> "PackSlice":
        """A whole pack (sp=1) from its cu_seqlens (a host tensor, array or list)."""
        bounds = np.asarray(cu_seqlens.cpu() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens, np.int64)
        return cls(bounds, 0, 0, int(bounds[-1]))

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor) -> "PackSlice":
        """A whole pack whose positions restart at 0 in every sample (copies them to the host: a sync on a GPU)."""
        positions = position_ids.reshape(-1).cpu().numpy()
        starts = np.flatnonzero(positions == 0)
        if len(starts) == 0 or starts[0] != 0:
            raise ValueError("per-sample RoPE: position_ids must restart at 0 in every sample of the pack")
        return cls(np.append(starts, len(positions)).astype(np.int64), 0, 0, len(positions))

    def spans(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(first token, end token, sample length) of each sample the slice holds, in slice coordinates."""
        bounds = self.bounds if not self.num_pad else np.append(self.bounds, self.bounds[-1] + self.num_pad)
        first = max(int(np.searchsorted(bounds, self.start, side="right")) - 1, 0)
        last = int(np.searchsorted(bounds, self.end, side="left"))  # samples first..last-1 overlap the slice
        lo, hi = bounds[first:last], bounds[first + 1:last + 1]
        return (np.clip(lo - self.start, 0, None), np.minimum(hi, self.end) - self.start, hi - lo)


@contextmanager
def per_sample(pack: Optional[PackSlice]):
    """Within it, the model's length-dependent rotary embeddings give each sample of ``pack`` its own cos/sin
    (None: HF's behaviour)."""
    token = _PACK_SLICE.set(pack)
    try:
        yield
    finally:
        _PACK_SLICE.reset(token)


# ---------------------------------------------------------------------------------------------- installing
def rotary_modules(model) -> list:
    """The model's rotary-embedding modules whose forward HF's ``dynamic_rope_update`` wraps (every family's)."""
    return [m for m in model.modules()
            if hasattr(m, "rope_type") and hasattr(getattr(type(m), "forward", None), "__wrapped__")]


def install_per_sample_rope(model) -> int:
    """Give each rotary embedding of ``model`` whose cos/sin depend on the sequence length the per-sample forward
    (an instance attribute: the module, its buffers and its state-dict keys stay HF's). Returns how many."""
    count = 0
    for module in rotary_modules(model):
        types = module.rope_type.items() if isinstance(module.rope_type, dict) else [(None, module.rope_type)]
        if any(_length_rule(module, t, layer) is not None for layer, t in types) and not is_per_sample(module):
            module.forward = functools.partial(_per_sample_forward, module)
            count += 1
    return count


def is_per_sample(module) -> bool:
    forward = module.__dict__.get("forward")
    return isinstance(forward, functools.partial) and forward.func is _per_sample_forward


def has_per_sample_rope(model) -> bool:
    """Whether ``model`` has a rotary embedding made per-sample (whose forwards then need a PackSlice)."""
    return any(is_per_sample(m) for m in model.modules())


# ------------------------------------------------------------------------------------------------ forward
def _length_rule(module, rope_type: str, layer_type: Optional[str] = None) -> Optional[Callable]:
    """The regime a sample length selects in HF's ``dynamic_rope_update`` (numpy, vectorised), or None when the
    type's cos/sin do not depend on the length. Mirrors its two branches and the fields they read."""
    if "dynamic" in rope_type:  # the base grows with the length past the positions it was made for
        original = int(module.original_max_seq_len)
        return lambda lengths: np.maximum(lengths, original)
    if rope_type == "longrope":  # long factors past the original positions
        params = module.config.rope_parameters
        original = int((params[layer_type] if layer_type is not None else params)["original_max_position_embeddings"])
        return lambda lengths: lengths > original
    return None


def _fresh_dynamic_state(module, layer_type: Optional[str]) -> None:
    """The state HF's dynamic RoPE starts from (its own reset: the original frequencies and cached length)."""
    prefix = f"{layer_type}_" if layer_type is not None else ""
    module.register_buffer(f"{prefix}inv_freq", getattr(module, f"{prefix}original_inv_freq"), persistent=False)
    setattr(module, f"{prefix}max_seq_len_cached", module.original_max_seq_len)


def _per_sample_forward(module, x, position_ids, *args, **kwargs):
    """The rotary embedding's forward, per sample inside `per_sample`, else HF's (module docstring)."""
    hf_forward = functools.partial(type(module).forward, module)
    pack = _PACK_SLICE.get()
    layer_type = args[0] if args else kwargs.get("layer_type")
    rope_type = module.rope_type[layer_type] if layer_type is not None else module.rope_type
    rule = _length_rule(module, rope_type, layer_type)
    if pack is None or rule is None:
        return hf_forward(x, position_ids, *args, **kwargs)
    num_tokens = position_ids.shape[-1]
    if position_ids.dim() != 2 or position_ids.shape[0] != 1 or num_tokens != pack.end - pack.start:
        raise ValueError(f"per-sample RoPE: position_ids of shape {tuple(position_ids.shape)} for a pack slice of "
                         f"{pack.end - pack.start} tokens")
    first, end, lengths = pack.spans()
    keys = rule(lengths)
    # runs of consecutive samples in the same regime: [first token, end token, regime, longest sample]
    breaks = np.flatnonzero(keys[1:] != keys[:-1]) + 1
    run_starts = np.concatenate([[0], breaks])
    runs = list(zip(first[run_starts].tolist(), end[np.append(breaks, len(keys)) - 1].tolist(),
                    keys[run_starts].tolist(), np.maximum.reduceat(lengths, run_starts).tolist()))

    def call(positions, length):
        if "dynamic" in rope_type:
            _fresh_dynamic_state(module, layer_type)
        positions = torch.cat([positions, positions.new_full((1, 1), length - 1)], dim=1)
        cos, sin = hf_forward(x, positions, *args, **kwargs)
        return cos[:, :-1], sin[:, :-1]

    regimes: dict = {}
    for run in runs:
        regimes.setdefault(run[2], []).append(run)
    if len(regimes) == 1:
        return call(position_ids, max(run[3] for run in runs))
    pieces = {}  # first token of a run -> its (cos, sin)
    for group in regimes.values():
        cos, sin = call(torch.cat([position_ids[:, a:b] for a, b, _, _ in group], dim=1), max(r[3] for r in group))
        offset = 0
        for a, b, _, _ in group:
            pieces[a] = (cos[:, offset:offset + b - a], sin[:, offset:offset + b - a])
            offset += b - a
    order = sorted(pieces)
    return torch.cat([pieces[a][0] for a in order], dim=1), torch.cat([pieces[a][1] for a in order], dim=1)
