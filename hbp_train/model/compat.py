"""The up-front compatibility check: an attention or loss feature of the model that the packed path cannot
honour is refused before any weight is loaded, in one line naming the feature, the family and what would work.

`check_model_support` reads the HF config (no weights), the model's modules built on the meta device (no
memory) and what its layers hand the attention function in one meta forward (hbp_train/model/attention_calls.py),
so the rule is about features, never about family names. Implemented exactly, per layer as the model calls its
attention: sliding windows (Mistral's one window, Gemma's and Qwen2's sliding layers) and attention logit
soft-capping (Gemma 2). Refused, each in one line (`check_attention`):

* attention sinks (gpt-oss's learned per-head logit, ``s_aux``), a layer's own mask, bidirectional attention, any
  keyword the packed attention does not read (`attention.unsupported_kwarg`);
* layers that mix tokens without the attention function: linear attention, state-space and convolution layers
  (Qwen3-Next, Mamba hybrids), told by the decoder layers that make no attention call, by transformers'
  ``layer_types`` names and by a Conv1d inside the decoder; a model whose attention does not go through transformers'
  attention-function interface at all;
* attention patterns transformers builds into the mask only, which the packed attention (given no mask) would drop:
  chunked attention (Llama 4's ``attention_chunk_size``) on samples longer than a chunk, and the other mask-only
  kinds of ``layer_types`` (sparse, indexed, windowed-ViT attention); Llama 4's attention temperature tuning (its
  NoPE layers scale queries by the position in the whole pack, not in the sample);
* a forward that does not read position_ids (positions counted over the whole pack: told by giving it one
  position too many on the meta device, which a model that reads them cannot add to its tokens);
* a backend named by the user that cannot apply the model's window or soft-cap;
* an LM head whose logits the loss does not reproduce: the loss (model/loss.py) applies the head's weight and bias
  itself, then what the model's own forward applies to the logits before its loss, as ``logit_head_of`` reads it
  from the config: Granite's ``logits_scaling`` (HF divides the logits by it; also Granite-MoE, MiniCPM3, which
  divides the hidden states), Cohere's ``logit_scale`` (multiplies; Cohere 2 too) and final logit soft-capping
  (``final_logit_softcapping``: Gemma 2/3, VaultGemma, NanoChat). Those are what transformers' causal LMs apply
  there (read in their forwards). ``check_logit_head`` then runs the model's own forward on a probe (the decoder's
  output given, a small real head in place of its LM head, on the CPU) and refuses the model when its logits are
  not ours (another transform, a sliced vocabulary, a head that is not a linear layer);
* attention dropout: the packed attention has none;
* an SP degree Ulysses cannot split the heads by (perf.shape.sp_heads_problem), the heads counted on the tensors the
  layers hand over (a config field the family does not read changes nothing).

`check_positions` refuses samples longer than the model's positions (positions restart at 0 in every sample of a
pack, so the longest sample counts, not the pack), unless RoPE scaling in the config extends them: then it says so,
and that RoPE is applied per sample (model/rope.py), as it does when samples pass a longrope's original positions.

hf_packed_attention refuses the same features at run time (a safety net for a model this check did not see).
"""

from __future__ import annotations

import math
from typing import Iterable, Optional

import torch

from hbp_train.common.errors import UserError
from hbp_train.model.attention_backends import feature_problem
from hbp_train.model.attention_calls import AttentionCalls, attention_calls
from hbp_train.model.loss import LogitHead
from hbp_train.perf.shape import sp_degrees_that_work, sp_heads_problem


def check_model_support(hf_config, longest_sample: int, sp_degrees: Iterable[int], backend: str) -> AttentionCalls:
    """Raise a one-line UserError if the packed path cannot train this model as configured; else return what its
    layers hand the attention function (their heads: model/ulysses.py sizes its all-to-all by them).

    ``longest_sample``: the longest sample the plan may put in a pack; ``sp_degrees``: the plan's SP degrees;
    ``backend``: the packed attention backend (model.attention_backend).
    """
    family = getattr(hf_config, "model_type", "this model")
    where = f"{family} (model.architecture / model.name_or_path)"
    if float(getattr(hf_config, "attention_dropout", 0.0) or 0.0) > 0:
        raise UserError(f"{where}: attention dropout ({hf_config.attention_dropout}) is not implemented by the packed "
                        "attention; set model.config.attention_dropout=0")
    head = logit_head_of(hf_config)  # its values checked before the model is built
    calls = attention_calls(hf_config)
    model = _meta_model(hf_config)
    check_attention(hf_config, calls, model, longest_sample, backend, where)
    check_sp_degrees(hf_config, sp_degrees, where)
    check_logit_head(model, head, where)
    return calls


# transformers' layer_types (configuration_utils.ALLOWED_ATTN_LAYER_TYPES) whose layers mix tokens without attention,
# and those whose attention pattern lives in the mask transformers builds (which a custom attention is not given).
TOKEN_MIXING_LAYER_TYPES = ("linear_attention", "conv", "hybrid", "hybrid_sliding")
MASK_ONLY_LAYER_TYPES = ("window_attention", "indexed_attention", "compressed_sparse_attention",
                         "heavily_compressed_attention", "minimax_m3_sparse", "reference_sliding_attention")
PACKED_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "moe", "sparse", "dense")


def check_attention(hf_config, calls: AttentionCalls, model, longest_sample: int, backend: str, where: str) -> None:
    """UserError (one line, from ``where``) for the first thing the model's attention asks that the packed attention
    would not do exactly (the module's docstring lists them); ``calls``: its recorded attention calls, ``model``:
    the causal LM on the meta device."""
    modules = list(model.modules())
    if any(name.split(".")[-1] == "sinks" for m in modules for name, _ in m.named_parameters(recurse=False)):
        raise UserError(f"{where}: attention sinks (a learned per-head 'sinks' logit) are not implemented by the "
                        f"packed attention; use a model without them")
    softcap = getattr(hf_config, "attn_logit_softcapping", None)
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or softcap <= 0):
        raise UserError(f"{where} (model.config.attn_logit_softcapping): must be a positive number or null, got "
                        f"{softcap!r}")
    types = set(calls.layer_types)
    mixing = sorted(types & set(TOKEN_MIXING_LAYER_TYPES))
    decoder = getattr(model.base_model, "layers", model.base_model)
    convolutions = [type(m).__name__ for m in decoder.modules() if isinstance(m, torch.nn.Conv1d)]
    if mixing or convolutions or calls.silent_layers:
        what = (f"layer_types {', '.join(mixing)}" if mixing else f"a convolution over the tokens ({convolutions[0]})"
                if convolutions else f"{len(calls.silent_layers)} of its {calls.num_layers} decoder layers make no "
                f"attention call")
        raise UserError(f"{where}: layers that mix tokens without attention (linear attention, state-space or "
                        f"convolution layers: {what}) would run over a pack as one sequence, across its samples; "
                        "use a model of attention layers only (docs/models.md)")
    if not calls.failed and not calls.calls:
        raise UserError(f"{where}: its attention does not go through transformers' attention-function interface, "
                        "so the packed attention cannot keep a pack's samples apart; use a family of docs/models.md")
    if calls.reads_positions is False:
        raise UserError(f"{where}: its forward does not read position_ids (it counts positions over the whole pack, "
                        "not per sample), so every sample after a pack's first would see other positions; use a "
                        "family of docs/models.md")
    blind = next((c for c in calls.calls if not c.boundaries), None)
    if blind is not None:
        raise UserError(f"{where}: its attention ({blind.module}) is not handed position_ids nor the pack's "
                        "boundaries, so the packed attention cannot keep a pack's samples apart; use a family of "
                        "docs/models.md")
    problem = next((c for c in calls.calls if c.problems), None)
    if problem is not None:
        raise UserError(f"{where}: its attention ({problem.module}) asks for {problem.problems[0]}, which the packed "
                        f"attention does not implement; use a model without it")
    pattern = sorted(types - set(PACKED_LAYER_TYPES))
    if pattern:
        raise UserError(f"{where}: attention of kind {', '.join(pattern)} (model.config.layer_types) is built into "
                        "the mask transformers makes, which the packed attention does not apply; use a model with "
                        "full or sliding-window attention")
    chunk = getattr(hf_config, "attention_chunk_size", None)
    if "chunked_attention" in types and chunk and longest_sample > chunk:
        raise UserError(f"{where}: chunked attention (attention_chunk_size={chunk}) is not implemented by the packed "
                        f"attention and the plan's samples reach {longest_sample} tokens; re-plan with samples of at "
                        f"most {chunk} tokens (data_tools.preprocess/pack --max-len {chunk})")
    if getattr(hf_config, "attn_temperature_tuning", False) and not all(getattr(hf_config, "no_rope_layers", [1])):
        raise UserError(f"{where}: attention temperature tuning (attn_temperature_tuning) scales its NoPE layers' "
                        "queries by the position in the whole pack, not in the sample; set "
                        "model.config.attn_temperature_tuning=false (the model then differs from the pretrained one)")
    window = min(calls.windows) if calls.windows else None
    softcaps = calls.softcaps or ({float(softcap)} if softcap and calls.failed else set())
    if backend != "auto":
        why = feature_problem(backend, window is not None and longest_sample > window, bool(softcaps))
        if why:
            features = " and ".join(f for f in (f"sliding window {window}" if window else "",
                                                f"soft-cap {min(softcaps):g}" if softcaps else "") if f)
            raise UserError(f"model.attention_backend={backend} cannot apply {where.split(' ')[0]}'s {features} "
                            f"({why}); choose auto or a backend of docs/gpu.md that takes them")


def check_sp_degrees(hf_config, sp_degrees: Iterable[int], where: str) -> None:
    """UserError (one line, from ``where``) for the first SP degree Ulysses cannot split the model's heads by: the
    heads its layers hand the attention function (attention_calls.py), whose shapes must be the same in every layer
    for one all-to-all."""
    from hbp_train.model.attention_calls import attention_heads

    degrees = sorted(set(sp_degrees))
    if degrees == [1] or not degrees:  # nothing to split
        return
    calls = attention_calls(hf_config)
    if any(sp > 1 for sp in degrees) and calls.calls and calls.heads is None:
        shapes = sorted({(c.num_heads, c.num_kv_heads) for c in calls.calls})
        raise UserError(f"{where}: its layers have different heads ({shapes}), which Ulysses' one all-to-all per "
                        "degree cannot split; train it at sp=1 (data_tools.pack --groups LEN:1)")
    blind = next((c for c in calls.calls if "position_ids" not in c.boundaries), None)
    if any(sp > 1 for sp in degrees) and blind is not None:
        raise UserError(f"{where}: its attention ({blind.module}) is not handed position_ids, which Ulysses needs to "
                        "keep the gathered samples apart; train it at sp=1 (data_tools.pack --groups LEN:1)")
    num_heads, num_kv_heads = attention_heads(hf_config)[:2]
    for sp in degrees:
        problem = sp_heads_problem(num_heads, num_kv_heads, sp)
        if problem:
            good = sp_degrees_that_work(num_heads, num_kv_heads)
            raise UserError(f"{where}: {problem} (SP degrees that work: {', '.join(map(str, good))}; "
                            "data_tools.pack --groups)")


# The config fields transformers' causal LMs read between the LM head and the loss (their forwards, transformers 5):
# (field, what the loss's LogitHead takes from it).
LOGIT_SCALES = {
    "logits_scaling": lambda v: 1.0 / v,  # Granite, Granite-MoE (logits / v), MiniCPM3 (hidden / v: the same)
    "logit_scale": lambda v: v,           # Cohere, Cohere 2 (logits * v)
}


def logit_head_of(hf_config) -> LogitHead:
    """What the model's forward applies to its LM head's output before the loss, read from its config (the fields
    of LOGIT_SCALES and ``final_logit_softcapping``); a value that is not a positive number is refused in one line."""
    family = getattr(hf_config, "model_type", "this model")
    scale, softcap = 1.0, None
    for name, value in [(n, getattr(hf_config, n, None)) for n in (*LOGIT_SCALES, "final_logit_softcapping")]:
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
            raise UserError(f"{family} (model.config.{name}): must be a positive number, got {value!r}")
        if name == "final_logit_softcapping":
            softcap = float(value)
        else:
            scale *= LOGIT_SCALES[name](float(value))
    return LogitHead(scale=scale, softcap=softcap)


def check_logit_head(model, head: LogitHead, where: str) -> None:
    """Refuse (one line) a model whose forward turns its LM head's output into logits otherwise than ``head``.

    ``model``: the causal LM built on the meta device (``_meta_model``; it is changed here: use it no more). Its
    decoder is replaced by a module returning given hidden states and its LM head by a small real linear layer, so
    that the model's own forward runs on the CPU in microseconds; its logits must equal ``head`` applied to that
    layer's output. The logits span 0.1 to 300 in size, so that soft-capping at any cap below about a thousand, or
    any scale, shows."""
    lm_head = model.get_output_embeddings()
    if not isinstance(lm_head, torch.nn.Linear):
        raise UserError(f"{where}: its LM head ({type(lm_head).__name__}) is not a linear layer, which the packed "
                        "LM-head loss applies itself; use a model whose output embeddings are a linear layer")
    gen = torch.Generator().manual_seed(0)  # on the host, and every tensor here too, whatever the default device
    tokens, width, columns = 5, lm_head.in_features, 24
    hidden = torch.randn(1, tokens, width, generator=gen, device="cpu")
    # skip_init: no draw from the global random stream (the model's weights are drawn from it later)
    probe = torch.nn.utils.skip_init(torch.nn.Linear, width, columns, bias=lm_head.bias is not None, device="cpu",
                                     dtype=torch.float32)
    with torch.no_grad():
        sizes = torch.logspace(-1, math.log10(300.0), columns, device="cpu")[:, None]  # each column's logits' size
        probe.weight.copy_(torch.randn(columns, width, generator=gen, device="cpu") * sizes / math.sqrt(width))
        if probe.bias is not None:
            probe.bias.copy_(torch.randn(columns, generator=gen, device="cpu"))
        ours = head.apply_(probe(hidden).double()).float()

    decoder = model.base_model  # what forward_hidden runs (the model itself when base_model_prefix names nothing)
    if decoder is model:
        raise UserError(f"{where}: its decoder is not at model.{model.base_model_prefix}, where the packed path runs "
                        "it without the LM head; use a family of docs/models.md")
    _set_submodule(model, lm_head, probe)
    setattr(model, model.base_model_prefix, _GivenHidden(decoder, hidden))
    try:
        with torch.no_grad():
            theirs = model(input_ids=torch.zeros(1, tokens, dtype=torch.long, device="cpu")).logits
        same = theirs.shape == ours.shape and torch.allclose(theirs.float(), ours, rtol=1e-4, atol=1e-4)
        found = "" if same else (f"logits of shape {tuple(theirs.shape)} for {tuple(ours.shape)}"
                                 if theirs.shape != ours.shape else
                                 f"up to {float((theirs.float() - ours).abs().max()):.3g} apart")
    except Exception as exc:  # noqa: BLE001 -- a forward that cannot run on a given decoder output: not checkable
        found = f"its forward does not run on a given decoder output ({type(exc).__name__})"
    if found:
        raise UserError(f"{where}: its forward changes the LM head's logits in a way the packed LM-head loss does not "
                        f"reproduce (on a probe: {found}; the loss applies scale {head.scale:g}"
                        f"{f', soft-cap {head.softcap:g}' if head.softcap else ''}); use a family of docs/models.md")


class _DecoderOutput:
    """A decoder's output for check_logit_head: the given hidden states, and None for anything else a forward reads
    from it (router logits, caches, a multimodal model's image features)."""

    def __init__(self, hidden):
        self.last_hidden_state = hidden

    def __getattr__(self, name):
        return None

    def __getitem__(self, index):
        return (self.last_hidden_state,)[index]


class _GivenHidden(torch.nn.Module):
    """In a decoder's place for check_logit_head: returns the given hidden states, also when the forward calls one
    of the decoder's parts (OPT's ``model.decoder``); the decoder's other attributes (a multiplier) are its own."""

    def __init__(self, decoder, hidden):
        super().__init__()
        object.__setattr__(self, "decoder_", decoder)  # not a submodule
        self.hidden = hidden

    def forward(self, *args, **kwargs):
        return _DecoderOutput(self.hidden)

    def __getattr__(self, name):
        value = getattr(object.__getattribute__(self, "decoder_"), name)
        return self if isinstance(value, torch.nn.Module) else value


def _set_submodule(model, old, new) -> None:
    """Put ``new`` where ``old`` is in ``model`` (under every name it has)."""
    for name, module in list(model.named_modules(remove_duplicate=False)):
        for child_name, child in list(module.named_children()):
            if child is old:
                setattr(module, child_name, new)


# RoPE scalings that stretch the trained positions by their factor (transformers' rope_type names).
STRETCHING_ROPE = ("linear", "dynamic", "yarn", "longrope", "llama3")
# How the packed path applies any of them (model/rope.py): what the start-of-run line says.
PER_SAMPLE_ROPE = "RoPE is applied per sample (each sample gets the cos/sin the model gives it alone"


def check_positions(hf_config, longest_sample: int) -> Optional[str]:
    """UserError (one line) when the plan's samples are longer than the model's positions; a line to print when
    RoPE scaling in the config provides the positions beyond max_position_embeddings, or when the samples pass a
    longrope's original positions (each sample's own length then picks its factors); None otherwise."""
    max_positions = getattr(hf_config, "max_position_embeddings", None)
    family = getattr(hf_config, "model_type", "this model")
    if not max_positions or longest_sample <= max_positions:
        original = _longrope_original_positions(hf_config)
        if original is None or longest_sample <= original:
            return None
        return (f"[train] the plan's samples reach {longest_sample} tokens, past the {original} original positions "
                f"of {family}'s longrope RoPE: {PER_SAMPLE_ROPE}: a sample's own length picks the long or the short "
                "factors, in a pack and under SP alike)")
    scaled = _rope_scaled_positions(hf_config)
    if scaled is not None and longest_sample <= scaled[0]:
        positions, rope_type, factor, original = scaled
        own = {"dynamic": ": a sample's own length sets the base", "longrope": ": a sample's own length picks the "
               "long or the short factors"}.get(rope_type, "")
        return (f"[train] the plan's samples reach {longest_sample} tokens, beyond max_position_embeddings "
                f"{max_positions} of {family}: RoPE scaling provides {positions} positions ({rope_type}, factor "
                f"{factor:g} x {original}; model.config.rope_scaling); {PER_SAMPLE_ROPE}{own})")
    have = f"{max_positions} positions (max_position_embeddings" + (
        f"; RoPE scaling {scaled[1]} gives {scaled[0]})" if scaled else ")")
    factor = math.ceil(longest_sample / max_positions)
    params = getattr(hf_config, "rope_parameters", None) or {}
    if any(isinstance(v, dict) for v in params.values()):  # RoPE per layer type (Gemma 3)
        how = "++model.config.rope_parameters={...} with a scaling (e.g. yarn) for its full-attention layers"
    else:
        how = (f"++model.config.rope_scaling={{rope_type:yarn,factor:{factor},original_max_position_embeddings:"
               f"{max_positions}}} ++model.config.max_position_embeddings={factor * max_positions}")
    raise UserError(f"{family} (model.name_or_path / model.config): the plan's samples reach {longest_sample} tokens "
                    f"but the model has {have}; re-plan with samples of at most {max_positions} tokens "
                    f"(data_tools.preprocess and pack --max-len {max_positions}), or extend the positions with RoPE "
                    f"scaling: {how}")


def _rope_scaled_positions(hf_config) -> Optional[tuple]:
    """(positions, rope_type, factor, original positions) of a RoPE scaling that stretches the positions, or None.
    transformers 5 keeps it in rope_parameters, per layer type for some families (Gemma 3): the smallest of the
    full-attention layers counts (a sliding-window layer sees no further back than its window)."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    sets = [p for kind, p in params.items() if isinstance(p, dict) and "sliding" not in kind] or [params]
    found = []
    for p in sets:
        rope_type = p.get("rope_type", p.get("type"))
        if rope_type in STRETCHING_ROPE and p.get("factor"):
            original = int(p.get("original_max_position_embeddings") or hf_config.max_position_embeddings)
            positions = max(int(hf_config.max_position_embeddings), int(original * float(p["factor"])))
            found.append((positions, rope_type, float(p["factor"]), original))
    return min(found) if found and len(found) == len(sets) else None


def _longrope_original_positions(hf_config) -> Optional[int]:
    """The original positions of a longrope RoPE in the config (the smallest, per layer type), or None."""
    params = getattr(hf_config, "rope_parameters", None) or getattr(hf_config, "rope_scaling", None) or {}
    sets = [p for p in params.values() if isinstance(p, dict)] or [params]
    found = [int(p.get("original_max_position_embeddings") or getattr(hf_config, "original_max_position_embeddings", 0)
                 or 0) for p in sets if p.get("rope_type", p.get("type")) == "longrope"]
    return min(found) if found and min(found) > 0 else None


def _meta_model(hf_config):
    """The causal LM, built on the meta device: its structure, no memory, no initialisation."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):  # eager: every model supports it (some not sdpa); the attention is not used here
        return AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager")
