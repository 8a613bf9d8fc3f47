"""What a model's layers ask of the attention function, read from the model itself before any weight exists.

`attention_calls` builds the causal LM of an HF config on the meta device (no memory, no initialisation) and runs
its decoder once on 16 meta tokens with a recording function installed as its attention implementation (through
transformers' AttentionInterface, as the packed attention is). Each call records what the layer really hands over:
its query and key/value heads and head sizes (the tensors' shapes, whatever the config's fields say: a GPT-NeoX
config carrying a stray ``num_key_value_heads`` still has as many kv heads as query heads), its ``sliding_window``
and ``softcap`` (a field the family does not read is never passed), and anything the packed attention does not do
(sinks, its own mask, bidirectional attention, an unknown keyword: `attention.unsupported_kwarg`). Decoder layers
that made no call mix their tokens some other way (linear attention, state-space or convolution layers), or the
model does not call attention through the interface at all.

The meta forward needs no weights and takes well under a second for a 70B config; some families cannot run it (a
step that reads values, e.g. ``.item()``): then ``failed`` says why and the callers fall back to the config's fields.
hbp_train/model/compat.py refuses from these records, attention_setup.py probes the kernel with the model's window
and soft-cap, and model/ulysses.py sizes DeepSpeed's all-to-all by their heads.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch

from hbp_train.model.attention import unsupported_kwarg

RECORDER = "hbp_record"
PROBE_TOKENS = 16


@dataclass(frozen=True)
class LayerCall:
    """One attention call of a forward: which layer made it and what it handed over."""

    layer: int | None
    """The decoder layer (index into the model's layers) the calling module belongs to; None when outside them."""
    module: str
    """The attention module's class name."""
    num_heads: int
    num_kv_heads: int
    head_dim: int
    """q/k head size."""
    v_head_dim: int
    window: int | None
    """HF's sliding_window for this layer (a query sees itself and window - 1 keys before it); None: no window."""
    softcap: float | None
    """Attention logit soft-capping; None: none."""
    problems: tuple = ()
    """What the call asks that the packed attention does not do, a few words each."""
    boundaries: tuple = ()
    """Which of the pack's boundary arguments reached the call: position_ids (what Ulysses gathers),
    cu_seq_lens_q (what the trainer hands the model at sp=1)."""


@dataclass(frozen=True)
class AttentionCalls:
    """Every attention call of one forward of the model, and its decoder layers."""

    calls: tuple = ()
    num_layers: int | None = None
    """Decoder layers (the model's ``base_model.layers``); None when it has no such list."""
    failed: str | None = None
    """Why the meta forward did not run (then ``calls`` is empty and nothing is known from it)."""
    layer_types: tuple = field(default=())
    """The config's ``layer_types`` (transformers' name for each decoder layer's kind), if it has them."""
    reads_positions: bool | None = None
    """Whether the model's forward reads the position_ids it is given (positions restart in every sample of a pack);
    None when unknown."""

    @property
    def windows(self) -> set:
        return {c.window for c in self.calls if c.window is not None}

    @property
    def softcaps(self) -> set:
        return {c.softcap for c in self.calls if c.softcap is not None}

    @property
    def heads(self) -> tuple | None:
        """(query heads, kv heads, q/k head size, v head size) when every call has the same, else None."""
        shapes = {(c.num_heads, c.num_kv_heads, c.head_dim, c.v_head_dim) for c in self.calls}
        return shapes.pop() if len(shapes) == 1 else None

    @property
    def silent_layers(self) -> list:
        """Indices of decoder layers that made no attention call."""
        if self.num_layers is None or self.failed:
            return []
        called = {c.layer for c in self.calls}
        return [i for i in range(self.num_layers) if i not in called]


def _record_call(into: list, layer_of: dict):
    def record(module, query, key, value, attention_mask=None, scaling=None, dropout=0.0, sliding_window=None,
               softcap=None, **kwargs):
        problems = [p for p in (unsupported_kwarg(name, v) for name, v in kwargs.items()) if p]
        if attention_mask is not None:
            problems.append("its own attention mask")
        if getattr(module, "is_causal", True) is False:
            problems.append("bidirectional attention (is_causal=False)")
        into.append(LayerCall(
            layer=layer_of.get(id(module)), module=type(module).__name__, num_heads=int(query.shape[1]),
            num_kv_heads=int(key.shape[1]), head_dim=int(query.shape[-1]), v_head_dim=int(value.shape[-1]),
            window=int(sliding_window) if sliding_window is not None else None,
            softcap=float(softcap) if softcap is not None else None, problems=tuple(problems),
            boundaries=tuple(k for k in ("position_ids", "cu_seq_lens_q") if kwargs.get(k) is not None)))
        batch, heads, tokens = query.shape[:3]
        return query.new_empty(batch, tokens, heads, value.shape[-1]), None

    return record


def _layer_index(model) -> tuple[int | None, dict]:
    """(number of decoder layers, {id(module): its layer}) of the model's ``base_model.layers``."""
    layers = getattr(model.base_model, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        return None, {}
    return len(layers), {id(m): i for i, layer in enumerate(layers) for m in layer.modules()}


def _record(config) -> AttentionCalls:
    from transformers import AttentionInterface, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    layer_types = tuple(getattr(config, "layer_types", None) or ())
    calls: list = []
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "does not support setting its attention implementation": we say so ourselves
    try:
        with torch.device("meta"):
            # bf16: the MoE families' grouped expert kernels refuse fp32 even on the meta device
            model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.bfloat16)
        num_layers, layer_of = _layer_index(model)
        AttentionInterface.register(RECORDER, _record_call(calls, layer_of))
        model.set_attn_implementation(RECORDER)
        ids = torch.zeros(1, PROBE_TOKENS, dtype=torch.long, device="meta")
        # the arguments hf_model.forward_hidden gives at sp=1: the pack's boundaries as well as its positions
        boundaries = torch.tensor([0, PROBE_TOKENS], dtype=torch.int32, device="meta")
        with torch.no_grad():
            model.base_model(input_ids=ids, position_ids=torch.arange(PROBE_TOKENS, device="meta")[None],
                             use_cache=False, cu_seq_lens_q=boundaries, max_length_q=PROBE_TOKENS)
        recorded = list(calls)
        reads_positions = _reads_positions(model, ids)
        calls[:] = recorded
    except Exception as exc:  # noqa: BLE001 - a forward that cannot run without values: nothing known from it
        first = str(exc).splitlines()[0] if str(exc) else ""
        return AttentionCalls(failed=f"{type(exc).__name__}: {first}"[:200], layer_types=layer_types)
    finally:
        hf_logging.set_verbosity(verbosity)
    return AttentionCalls(calls=tuple(calls), num_layers=num_layers, layer_types=layer_types,
                          reads_positions=reads_positions)


def _reads_positions(model, ids) -> bool:
    """Whether the decoder reads position_ids: given one position too many, a model that reads them (RoPE's cos and
    sin, learned position embeddings) cannot add them to its tokens and fails; one that counts positions itself
    over the whole sequence (a pack's, not a sample's) runs."""
    try:
        with torch.no_grad():
            model.base_model(input_ids=ids, position_ids=torch.arange(PROBE_TOKENS + 1, device="meta")[None],
                             use_cache=False)
    except Exception:  # noqa: BLE001 - the shapes did not fit: the positions given were used
        return True
    return False


# The records of the last configs seen (the config check, the build and the probe read the same config).
_cache: dict = {}


def attention_calls(hf_config) -> AttentionCalls:
    """The attention calls of one forward of ``hf_config``'s causal LM (see the module's docstring); cached per
    config (its JSON)."""
    try:
        key = hf_config.to_json_string(use_diff=False)
    except (TypeError, ValueError):  # a field that does not serialise: recorded every time
        key = None
    if key is None or key not in _cache:
        record = _record(copy.deepcopy(hf_config))
        if key is None:
            return record
        if len(_cache) >= 8:
            _cache.pop(next(iter(_cache)))
        _cache[key] = record
    return _cache[key]


def attention_heads(hf_config) -> tuple:
    """(query heads, key/value heads, q/k head size, v head size) as the model's layers hand them to the attention
    function; from the config's fields only when its forward cannot be recorded or its layers differ (then the
    first layer's, or the config's)."""
    calls = attention_calls(hf_config)
    if calls.heads is not None:
        return calls.heads
    if calls.calls:
        first = calls.calls[0]
        return first.num_heads, first.num_kv_heads, first.head_dim, first.v_head_dim
    from hbp_train.perf.shape import parse_model_shape

    shape = parse_model_shape(hf_config)
    return shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.v_head_dim
