"""The packed attention as transformers calls it: sample boundaries, the layer's window and soft-cap, the backend.

`hf_packed_attention` adapts `attention_backends.packed_attention` to transformers' AttentionInterface (installed
under the name "hbp_packed"). What a layer hands it besides q, k and v is read as transformers defines it:
``scaling``, the layer's ``sliding_window`` (per layer: Mistral's one window, Gemma's and Qwen2's sliding layers
beside full ones) and ``softcap`` (Gemma 2's attention logit soft-capping). The mask argument is unused:
transformers builds none for a custom implementation, so the samples are kept apart by their boundaries, found in
``cu_seq_lens_q`` when given, else in ``position_ids`` (which DeepSpeed's Ulysses wrapper all-gathers: the core then
sees the whole pack, and the window applies to the gathered samples). Anything else a layer asks of its attention
(sinks, its own mask, dropout, a keyword not in `KNOWN_KWARGS`) is refused in one line: hbp_train/model/compat.py
refuses the same before the workers start; this is the net for a model that check did not see.

The backend is chosen by hbp_train/model/attention_setup.py (`set_backend`). Its probe's pack is small: the first
real pack of each new largest size is tried once more before it runs (`_backend_for_pack`), and a kernel that fails
there gives way to auto's next choice instead of ending the run. Every attention function is registered wrapped in
`torch.compiler.disable`: a decoder layer compiled by hbp_train/model/kernels.py (model.kernels=compile) then
breaks its graph around the attention call (host-side boundary code, collectives under Ulysses) and compiles
what is around it.

Shape legend: T tokens of the pack, H query heads, K key/value heads (H % K == 0, GQA), D head dim, B batch.
"""

from __future__ import annotations

import logging

import torch

from hbp_train.common.errors import UserError
from hbp_train.model import attention_kernels as kernels
from hbp_train.model.attention_backends import (  # noqa: F401 - the backends' names, imported from here by callers
    BACKENDS, GPU_ONLY_BACKENDS, VARLEN_KERNELS, feature_problem, packed_attention)

log = logging.getLogger(__name__)

ATTN_IMPLEMENTATION = "hbp_packed"
# What transformers' attention layers may hand an attention function besides q, k, v and the mask (read in every
# family's forward, transformers 5): the ones read here, and flags the model's forward passes down to every module
# (harmless when they hold these values); seq_idx (a sample index per token, from transformers'
# DataCollatorWithFlattening) restates the boundaries position_ids carry. s_aux (attention sinks) and anything else
# is refused.
READ_KWARGS = ("scaling", "dropout", "sliding_window", "softcap", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k",
               "max_length_q", "max_length_k")
PASSED_DOWN = {"use_cache": None, "output_attentions": (None, False), "output_router_logits": None,
               "output_hidden_states": None, "return_dict": None, "cache_position": None, "is_causal": (None, True),
               "past_key_values": (None,), "past_key_value": (None,), "seq_idx": None}
KNOWN_KWARGS = (*READ_KWARGS, *PASSED_DOWN)


def unsupported_kwarg(name: str, value) -> str | None:
    """What a keyword a layer hands its attention function asks that the packed attention does not do (a few
    words), or None when it is read here or harmless."""
    if name in READ_KWARGS:
        return None
    if name in PASSED_DOWN:
        allowed = PASSED_DOWN[name]
        if allowed is None or any(value is a or (a is not None and value == a) for a in allowed):
            return None
        return f"{name}={value!r}" + (" (bidirectional attention)" if name == "is_causal" else "")
    if name == "s_aux":
        return "attention sinks (s_aux, a learned per-head logit)" if value is not None else None
    return None if value is None else f"a {name!r} argument"


# ------------------------------------------------------------------------------------------------ boundaries
def cu_seqlens_from_position_ids(position_ids: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Sample boundaries of a pack from its position_ids ([T] or [1, T]).

    A new sample starts at token 0 and wherever the position does not continue the previous one (in particular
    at every reset to 0). Returns (cu_seqlens int32 [n+1] on the same device, max_seqlen).
    """
    if position_ids.dim() == 2:
        if position_ids.shape[0] != 1:
            raise ValueError(f"packed position_ids must have batch size 1, got shape {tuple(position_ids.shape)}")
        position_ids = position_ids[0]
    if position_ids.dim() != 1 or position_ids.numel() == 0:
        raise ValueError(f"position_ids must be a non-empty [T] or [1, T] tensor, got {tuple(position_ids.shape)}")
    num_tokens = position_ids.numel()
    is_start = torch.ones(num_tokens, dtype=torch.bool, device=position_ids.device)
    is_start[1:] = position_ids[1:] != position_ids[:-1] + 1
    starts = torch.nonzero(is_start, as_tuple=False).flatten()
    end = torch.tensor([num_tokens], device=position_ids.device, dtype=starts.dtype)
    cu_seqlens = torch.cat([starts, end]).to(torch.int32)
    max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())
    return cu_seqlens, max_seqlen


def _document_ids(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """Sample index of every token ([T] int64)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    return torch.repeat_interleave(torch.arange(lengths.numel(), device=cu_seqlens.device), lengths, output_size=num_tokens)


# ------------------------------------------------------------------------------------------ transformers glue
_state = {"backend": "sdpa_block"}


def set_backend(name: str) -> None:
    """Choose the backend `hf_packed_attention` uses (a concrete name; resolve "auto" with `select_backend`).

    fa4 activates FlashAttention-4 in torch's dispatcher, for the whole process (torch's flash kernels behind
    varlen_attn and SDPA become FA4's); choosing any other backend restores torch's own kernels, so that a
    torch_varlen chosen later really runs the bundled FA2."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend {name!r} is unknown; choose one of {', '.join(BACKENDS)}")
    kernels.use_torch_flash_impl("FA4" if name == "fa4" else None)
    _state["backend"] = name


def get_backend() -> str:
    """The backend `hf_packed_attention` uses now."""
    return _state["backend"]


# ------------------------------------------------------------------------------- the first real pack of a size
# The probe (attention_setup.probe_backend) runs 128 tokens: a GPU kernel can still fail on a real pack (FA4 compiles
# per shape; a backward may not exist for this head shape at this length). The first pack of each new largest size
# is tried once on copies, forward and backward (forward only where no gradient is asked for), before the real call;
# if that fails, auto's next choice that passes its probe and the same trial runs from then on (one warning line),
# and a backend the user named is a UserError.
_trial: dict = {"tokens": {}, "fallbacks": (), "check": None, "named": False}


def set_fallbacks(fallbacks, check=None, named: bool = False) -> None:
    """What the first pack of a new size does when the chosen backend fails on it (attention_setup sets this with
    the choice): try ``fallbacks`` in order, each taken when ``check(name)`` (its probe) returns None and it runs the
    pack; ``named``: the user asked for the chosen backend, so its failure is theirs to see."""
    _trial.update(tokens={}, fallbacks=tuple(fallbacks), check=check, named=named)


def _runs_pack(name, q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale, features: dict,
               backward: bool = True) -> str | None:
    """None if backend ``name`` runs forward (and backward) on copies of this pack with this layer's ``features``
    (window, softcap), else why in one line. Identity saved-tensor hooks: inside a checkpointed layer the trial
    keeps its own tensors for its own backward."""
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            inputs = [x.detach().clone().requires_grad_(backward) for x in (q_THD, k_TKD, v_TKD)]
            out = packed_attention(*inputs, cu_seqlens, max_seqlen, name, scale=scale, **features)
            if backward:
                torch.autograd.grad(out, inputs, torch.ones_like(out))
    except Exception as exc:  # noqa: BLE001 - any failure of the kernel on this pack: not this backend
        if "out of memory" in str(exc):  # not the kernel's doing: the real call would run out as well
            raise
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    return None


def _backend_for_pack(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale, features: dict) -> str:
    """The backend to run this pack with: the chosen one, tried first on a pack larger than any before with this
    kind of layer (a windowed or soft-capped layer runs other kernels than a plain one; see above)."""
    backend, tokens = get_backend(), q_THD.shape[0]
    backward = torch.is_grad_enabled() and any(x.requires_grad for x in (q_THD, k_TKD, v_TKD))
    kind = tuple(sorted(features))
    tried = _trial["tokens"].get((kind, True), 0)
    if not backward:
        tried = max(tried, _trial["tokens"].get((kind, False), 0))
    if backend not in GPU_ONLY_BACKENDS or tokens <= tried or q_THD.device.type == "meta":
        return backend
    args = (q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scale, features, backward)
    why = _runs_pack(backend, *args)
    remaining = [b for b in _trial["fallbacks"] if b != backend]
    while why is not None:
        if _trial["named"] or not remaining:
            raise UserError(f"model.attention_backend={backend} fails on a pack of {tokens} tokens ({why}); choose "
                            f"another backend (auto falls back to the next one by itself)")
        failed, backend = backend, remaining.pop(0)
        log.warning("attention backend %s failed on the first pack of %d tokens (%s); falling back to %s",
                    failed, tokens, why, backend)
        check = _trial["check"]
        why = (check(backend) if check and backend != "sdpa_block" else None) or (
            _runs_pack(backend, *args) if backend in GPU_ONLY_BACKENDS else None)
    if backend != get_backend():  # the pack before this one may have been tried with other features
        _trial["tokens"] = {}
    set_backend(backend)
    _trial["tokens"][kind, backward] = tokens
    return backend


# Boundaries are the same for every layer of a forward (and its checkpoint recompute): remember the last
# position_ids tensor seen, with its version counter so an in-place refill of a reused buffer is noticed.
# The trainer hands cu_seqlens to every layer (at sp=1 through the model's kwargs, under Ulysses from
# SequenceParallel.split), so this is for callers that give position_ids only.
_boundary_cache: dict = {"key": None, "result": None}


def _boundaries_from_kwargs(kwargs: dict) -> tuple[torch.Tensor, int]:
    cu_seqlens = kwargs.get("cu_seq_lens_q")
    if cu_seqlens is not None:
        max_seqlen = kwargs.get("max_length_q")
        if max_seqlen is None:
            max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max().item())
        return cu_seqlens, int(max_seqlen)
    position_ids = kwargs.get("position_ids")
    if position_ids is None:
        raise ValueError("hbp_packed attention needs position_ids (restarting per sample) or cu_seq_lens_q")
    key = _boundary_cache["key"]
    if key is None or key[0] is not position_ids or key[1] != position_ids._version:
        _boundary_cache["result"] = cu_seqlens_from_position_ids(position_ids)
        _boundary_cache["key"] = (position_ids, position_ids._version)
    return _boundary_cache["result"]


def hf_packed_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None,
                        softcap=None, **kwargs):
    """transformers AttentionInterface function: query [1, H, T, D], key/value [1, K, T, D] -> ([1, T, H, D], None).

    Sample boundaries come from kwargs["cu_seq_lens_q"] when given, else from kwargs["position_ids"]. Under Ulysses
    the core sees the whole pack (all-to-all over heads), so a cu_seq_lens_q passed through must describe the whole
    padded pack, not this rank's slice; position_ids are all-gathered by DeepSpeed's wrapper and are always right.
    ``sliding_window`` and ``softcap`` are the layer's (None: none), applied within each sample.
    """
    if query.shape[0] != 1:
        raise ValueError(f"packed attention expects batch size 1 (one pack per micro-batch), got {query.shape[0]}")
    if dropout:  # the model's config (attention_dropout), so the user's to fix
        raise UserError(
            f"packed attention does not implement attention dropout; set attention_dropout=0 (got {dropout})")
    if attention_mask is not None:  # transformers builds none for our implementation: the layer made its own
        raise UserError(f"{type(module).__name__} hands its attention its own mask, which the packed attention does "
                        "not apply; use a family of docs/models.md")
    for name, given in kwargs.items():  # hbp_train/model/compat.py refuses these before the model is built
        problem = unsupported_kwarg(name, given)
        if problem:
            raise UserError(f"{type(module).__name__} asks its attention for {problem}, which the packed attention "
                            "does not implement; use a family of docs/models.md")
    cu_seqlens, max_seqlen = _boundaries_from_kwargs(kwargs)
    features = {name: value for name, value in (("window", sliding_window), ("softcap", softcap))
                if value is not None}
    if features.get("window") is not None and features["window"] >= max_seqlen:
        del features["window"]  # no sample is longer: plain causal attention (e.g. Mistral's 4096 on short packs)
    q_THD, k_TKD, v_TKD = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)
    backend = _backend_for_pack(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, scaling, features)
    out_THD = packed_attention(q_THD, k_TKD, v_TKD, cu_seqlens, max_seqlen, backend, scale=scaling, **features)
    # Contiguous as HF's own attention functions return it: some models .view() the output (JetMoE).
    return out_THD[None].contiguous(), None
