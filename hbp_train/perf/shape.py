"""The shape of a decoder-only transformer, and the one place that reads it.

``ModelShape`` holds what FLOPs, memory and all-to-all sizes depend on (hidden, layers, heads, kv heads, head dim,
MLP width, vocabulary). ``parse_model_shape`` is the only reader: a preset name (``MODEL_SHAPES``), a JSON object
given inline or as a file, a dict, or an HF config object — our own key names or HF ``config.json`` names.
``model_shape_of`` reads the shape a run's ``ModelConfig`` will build, from its HF config alone (no weights).
``sp_heads_problem`` is the one rule for which sequence-parallel degrees Ulysses can split the heads by;
``mlp_tiles`` the one rule for how many sequence tiles the tiled-MLP memory lever runs.

Pure Python (transformers is imported only by ``model_shape_of``): the planner and the simulator use this.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from hbp_train.common.errors import UserError


@dataclass(frozen=True)
class ModelShape:
    """Shape of a decoder-only transformer, enough to count FLOPs, memory and all-to-all bytes."""

    name: str
    """Label used in reports."""
    hidden: int
    """Hidden size."""
    num_layers: int
    """Number of decoder layers."""
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads (GQA)."""
    ffn: int
    """Intermediate size of the gated MLP (3 matrices)."""
    vocab: int
    """Vocabulary size (LM head)."""
    head_dim: int = 0
    """Per-head dimension of q and k; 0 means hidden // num_heads."""
    v_head_dim: int = 0
    """Per-head dimension of v and of the attention output; 0 means head_dim (MLA: smaller than q/k's)."""
    q_lora_rank: int = 0
    """MLA: rank of the low-rank q projection (hidden -> q_lora_rank -> heads·head_dim); 0 = a plain q projection."""
    kv_lora_rank: int = 0
    """MLA: width of the compressed kv latent (hidden -> kv_lora_rank (+ rope key) -> per-head k and v); 0 = no MLA."""
    qk_rope_head_dim: int = 0
    """MLA: the rotary part of head_dim, one key shared by all heads (projected from hidden directly)."""
    num_experts: int = 0
    """MoE: routed experts per MoE layer; 0 = a dense model."""
    experts_per_token: int = 0
    """MoE: routed experts each token goes through (top-k)."""
    moe_ffn: int = 0
    """MoE: intermediate size of one routed expert (gated, 3 matrices); 0 means ffn."""
    shared_ffn: int = 0
    """MoE: total intermediate size of the shared expert(s) every token goes through; 0 = none."""
    dense_layers: int = 0
    """MoE: layers whose MLP is dense (width ffn) instead of MoE (e.g. DeepSeek's first_k_dense_replace)."""
    tie_word_embeddings: bool = False
    """The LM head is the input embedding matrix (HF ``tie_word_embeddings``, e.g. Llama-3.2-1B/3B, Qwen2.5 up to
    3B): one vocab x hidden matrix of parameters, gradients and optimizer state instead of two. The LM head's
    FLOPs are the same either way."""

    def __post_init__(self):
        for field_name in ("hidden", "num_layers", "num_heads", "num_kv_heads", "ffn", "vocab"):
            if int(getattr(self, field_name)) <= 0:
                raise UserError(f"model shape: {field_name} must be > 0, got {getattr(self, field_name)}")
        if self.head_dim < 0:
            raise UserError(f"model shape: head_dim must be >= 0, got {self.head_dim}")
        if self.num_heads % self.num_kv_heads:
            raise UserError(f"model shape: num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                            f"({self.num_kv_heads})")
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden // self.num_heads)
        if self.v_head_dim == 0:
            object.__setattr__(self, "v_head_dim", self.head_dim)
        if self.num_experts and self.moe_ffn == 0:
            object.__setattr__(self, "moe_ffn", self.ffn)
        if self.num_experts and not 0 < self.experts_per_token <= self.num_experts:
            raise UserError(f"model shape: experts_per_token must be in [1, num_experts={self.num_experts}], "
                            f"got {self.experts_per_token}")
        if not 0 <= self.dense_layers <= self.num_layers:
            raise UserError(f"model shape: dense_layers must be in [0, num_layers], got {self.dense_layers}")

    @property
    def attn_width(self) -> int:
        """heads · head_dim: the width of q (and of k per kv head); the QK^T FLOPs scale with it."""
        return self.num_heads * self.head_dim

    @property
    def out_width(self) -> int:
        """heads · v_head_dim: the width of the attention output (o projection input); PV FLOPs scale with it."""
        return self.num_heads * self.v_head_dim

    @property
    def kv_width(self) -> int:
        """kv_heads · (head_dim + v_head_dim) / 2: the mean width of k and of v (k + v = 2 · kv_width)."""
        return self.num_kv_heads * (self.head_dim + self.v_head_dim) // 2

    @property
    def active_ffn(self) -> int:
        """Intermediate width one token goes through in an MoE layer (top-k experts + shared), or ffn if dense;
        the larger of the two when a model has both kinds of layers (activation memory's upper bound)."""
        if not self.num_experts:
            return self.ffn
        moe = self.experts_per_token * self.moe_ffn + self.shared_ffn
        return max(moe, self.ffn) if self.dense_layers else moe

    def attn_params(self) -> int:
        """Matmul weights of one layer's attention: q, k, v, o projections (MLA: its down/up projections)."""
        h, heads = self.hidden, self.num_heads
        out = self.out_width * h
        if self.kv_lora_rank:  # MLA
            q = (h * self.q_lora_rank + self.q_lora_rank * self.attn_width) if self.q_lora_rank else h * self.attn_width
            kv_down = h * (self.kv_lora_rank + self.qk_rope_head_dim)
            kv_up = self.kv_lora_rank * heads * (self.head_dim - self.qk_rope_head_dim + self.v_head_dim)
            return q + kv_down + kv_up + out
        return h * self.attn_width + h * self.num_kv_heads * (self.head_dim + self.v_head_dim) + out

    def mlp_params(self, moe: bool, active: bool) -> int:
        """Matmul weights of one layer's MLP: dense (3·hidden·ffn) or MoE (router, routed experts — only the top-k
        with ``active`` — and shared experts)."""
        if not moe:
            return 3 * self.hidden * self.ffn
        experts = self.experts_per_token if active else self.num_experts
        return self.hidden * self.num_experts + 3 * self.hidden * (experts * self.moe_ffn + self.shared_ffn)

    def linear_params(self, active: bool = True) -> int:
        """Matmul weights of all decoder layers (no embeddings, LM head or norms); ``active``: what one token uses
        (an MoE layer's top-k experts), else every weight. FLOPs per token are 2 per active weight."""
        moe_layers = self.num_layers - self.dense_layers if self.num_experts else 0
        return (self.num_layers * self.attn_params() + (self.num_layers - moe_layers) * self.mlp_params(False, active)
                + moe_layers * self.mlp_params(True, active))

    @property
    def num_params(self) -> int:
        """Parameters of the model: decoder layers (every expert), two norms per layer, the final norm, the
        embedding and, unless tied to it, the LM head. Used by the memory model and the simulator's ZeRO
        collectives and optimizer step."""
        embeddings = (1 if self.tie_word_embeddings else 2) * self.vocab * self.hidden
        return self.linear_params(active=False) + 2 * self.hidden * self.num_layers + embeddings + self.hidden

    @property
    def active_params(self) -> int:
        """Parameters one token uses (num_params with only the top-k routed experts of each MoE layer)."""
        return self.num_params - self.linear_params(active=False) + self.linear_params(active=True)

    def a2a_width(self, sp: int) -> int:
        """Elements per token moved by the four Ulysses all-to-alls of one layer forward (q, k, v, out).

        k and v have num_kv_heads heads; Ulysses replicates kv heads up to sp when there are fewer. v and the
        output travel at head_dim even when v_head_dim is smaller (model/ulysses.py pads them for MLA).
        """
        return 2 * self.attn_width + 2 * max(self.num_kv_heads, sp) * self.head_dim


MODEL_SHAPES = {
    "llama3-8b": ModelShape("llama3-8b", 4096, 32, 32, 8, 14336, 128256),
    "llama3.2-1b": ModelShape("llama3.2-1b", 2048, 16, 32, 8, 8192, 128256, 64, tie_word_embeddings=True),
    "llama3.2-3b": ModelShape("llama3.2-3b", 3072, 28, 24, 8, 8192, 128256, 128, tie_word_embeddings=True),
    "llama3.1-70b": ModelShape("llama3.1-70b", 8192, 80, 64, 8, 28672, 128256),
    "qwen2.5-7b": ModelShape("qwen2.5-7b", 3584, 28, 28, 4, 18944, 152064),
}

# HF config.json key names and ours, so a model's config file (or config object) works as a shape.
HF_KEYS = {"hidden_size": "hidden", "num_hidden_layers": "num_layers", "num_attention_heads": "num_heads",
           "num_key_value_heads": "num_kv_heads", "intermediate_size": "ffn", "vocab_size": "vocab"}
_FIELDS = ("name", "hidden", "num_layers", "num_heads", "num_kv_heads", "ffn", "vocab", "head_dim", "v_head_dim",
           "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim", "num_experts", "experts_per_token", "moe_ffn",
           "shared_ffn", "dense_layers", "tie_word_embeddings")
# HF config fields of MoE and MLA models that `_moe_and_mla_fields` translates.
HF_MOE_MLA_KEYS = ("v_head_dim", "qk_nope_head_dim", "qk_rope_head_dim", "q_lora_rank", "kv_lora_rank",
                   "num_local_experts", "num_experts", "n_routed_experts", "num_experts_per_tok",
                   "moe_intermediate_size", "n_shared_experts", "shared_expert_intermediate_size",
                   "first_k_dense_replace", "decoder_sparse_step", "mlp_only_layers")


def load_json_object(spec: str, what: str = "model shape") -> dict:
    """A JSON object given inline (text starting with '{') or as a file path; UserError naming ``what``."""
    text = spec
    if not spec.lstrip().startswith("{"):
        path = Path(spec)
        if not path.is_file():
            raise UserError(f"{what} {spec!r}: neither a JSON object nor a file")
        try:
            text = path.read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"{what} {spec}: cannot read ({exc})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{what}: invalid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise UserError(f"{what}: the JSON must be an object, got {type(data).__name__}")
    return data


def parse_model_shape(spec) -> ModelShape:
    """A ModelShape from a preset name, a JSON string or file, a dict, or an HF config object (its attributes).

    Keys may be ours or HF config.json's (``hidden_size``, ``num_attention_heads``, ...); unknown keys are
    ignored, a missing ``num_kv_heads`` means one kv head per query head (no GQA), a missing or null ``head_dim``
    means hidden // num_heads. Bad input raises UserError naming the problem.
    """
    if isinstance(spec, ModelShape):
        return spec
    if not isinstance(spec, (str, dict)) and hasattr(spec, "num_hidden_layers"):  # a transformers config object
        # Attributes, not to_dict(): the trainer reads the shape per micro-batch and to_dict deep-copies.
        spec = {k: getattr(spec, k) for k in (*HF_KEYS, "head_dim", "tie_word_embeddings", *HF_MOE_MLA_KEYS)
                if hasattr(spec, k)}
    if isinstance(spec, str):
        if spec in MODEL_SHAPES:
            return MODEL_SHAPES[spec]
        if not spec.lstrip().startswith("{") and not Path(spec).is_file():
            raise UserError(f"model shape {spec!r}: not a preset ({', '.join(MODEL_SHAPES)}), "
                            "not a JSON object and not a file")
        spec = load_json_object(spec)
    if not isinstance(spec, dict):
        raise UserError(f"model shape must be a preset name or a JSON object, got {type(spec).__name__}")
    fields = _moe_and_mla_fields({HF_KEYS.get(k, k): v for k, v in spec.items()})
    fields.setdefault("name", "custom")
    if fields.get("num_kv_heads") is None and "num_heads" in fields:
        fields["num_kv_heads"] = fields["num_heads"]
    for key in _FIELDS[7:]:  # optional sizes: null means 0 (derived or absent)
        if not fields.get(key):
            fields[key] = 0
    missing = {"hidden", "num_layers", "num_heads", "ffn", "vocab"} - {k for k, v in fields.items() if v is not None}
    if missing:
        raise UserError(f"model shape: missing field(s) {', '.join(sorted(missing))}")
    try:
        values = {k: (str(v) if k == "name" else bool(v) if k == "tie_word_embeddings" else int(v))
                  for k, v in fields.items() if k in _FIELDS}
    except (TypeError, ValueError) as exc:
        raise UserError(f"model shape: {exc}") from None
    return ModelShape(**values)


def _moe_and_mla_fields(fields: dict) -> dict:
    """HF config fields of MoE and MLA models in our names (each family names them differently).

    MLA (DeepSeek-V2/V3): q/k head dim = qk_nope_head_dim + qk_rope_head_dim, k and v are per query head.
    Routed experts: num_local_experts (Mixtral), num_experts (Qwen-MoE), n_routed_experts (DeepSeek); per-expert
    width moe_intermediate_size (Mixtral: intermediate_size); shared experts n_shared_experts · moe width
    (DeepSeek) or shared_expert_intermediate_size (Qwen2-MoE); dense layers first_k_dense_replace (DeepSeek) or
    those decoder_sparse_step / mlp_only_layers leave dense (Qwen-MoE).
    """
    out = {k: v for k, v in fields.items() if k not in HF_MOE_MLA_KEYS or k in _FIELDS}
    get = lambda key: fields.get(key) or 0  # noqa: E731 (null in a config means absent)
    if get("kv_lora_rank") and "qk_nope_head_dim" in fields:
        out.update(head_dim=get("qk_nope_head_dim") + get("qk_rope_head_dim"), num_kv_heads=fields.get("num_heads"))
    experts = get("num_local_experts") or get("n_routed_experts") or get("num_experts")
    if experts and "experts_per_token" not in fields:
        moe_ffn = get("moe_intermediate_size")
        shared = get("n_shared_experts") * (moe_ffn or get("ffn")) or get("shared_expert_intermediate_size")
        num_layers = int(get("num_layers"))
        dense = get("first_k_dense_replace")
        step, only_dense = get("decoder_sparse_step"), fields.get("mlp_only_layers") or []
        if step or only_dense:
            dense = sum(1 for i in range(num_layers) if i in only_dense or not (step and (i + 1) % step == 0))
        out.update(num_experts=experts, experts_per_token=get("num_experts_per_tok"), moe_ffn=moe_ffn,
                   shared_ffn=shared, dense_layers=min(dense, num_layers))
    return out


def model_shape_of(model_cfg, vocab_size: Optional[int] = None) -> ModelShape:
    """The ModelShape a ``hbp_train.model.hf_model.ModelConfig`` builds, from its HF config alone (no weights are built).

    ``vocab_size`` is the tokenizer's, applied as build_model does: a config-built model gets the larger of it and
    a vocab_size given in its config fields; a pretrained one grows to it, never shrinks.
    """
    from transformers import AutoConfig

    overrides = model_cfg.hf_overrides()  # a preset's shape only for a model built from scratch
    try:  # what transformers raises for an unreadable config.json or an unknown model_type in it
        if model_cfg.name_or_path is not None:
            hf = AutoConfig.from_pretrained(model_cfg.name_or_path, **overrides)
            name = Path(model_cfg.name_or_path).name
        else:
            hf = AutoConfig.for_model(model_cfg.architecture, **overrides)
            name = f"{model_cfg.architecture}-from-config"
    except (OSError, ValueError) as exc:
        where = model_cfg.name_or_path or f"model.architecture={model_cfg.architecture}"
        raise UserError(f"model config {where}: cannot read it ({str(exc).strip().splitlines()[0]})") from None
    fields = hf.to_dict()
    if vocab_size is not None and model_cfg.name_or_path is None:
        fields["vocab_size"] = max(vocab_size, int(overrides.get("vocab_size") or 0))
    elif vocab_size is not None and vocab_size > fields["vocab_size"]:
        fields["vocab_size"] = vocab_size
    fields["name"] = name
    return parse_model_shape(fields)


def sp_heads_problem(num_heads: int, num_kv_heads: int, sp: int) -> Optional[str]:
    """Why Ulysses cannot split these heads at SP degree ``sp``, or None when it can.

    Each SP rank gets num_heads/sp query heads, so sp must divide num_heads; kv heads are split (kv % sp == 0) or
    replicated (sp % kv == 0), so sp and num_kv_heads must divide one another. sp = 1 splits nothing.
    """
    if sp == 1:
        return None
    if num_heads % sp:
        return (f"sp={sp} does not divide the model's {num_heads} attention heads: Ulysses gives each SP rank "
                f"num_heads/sp query heads; use only SP degrees that divide {num_heads}")
    if num_kv_heads % sp and sp % num_kv_heads:
        return (f"sp={sp} and the model's {num_kv_heads} key/value heads do not divide one another: Ulysses "
                f"splits kv heads (kv % sp == 0) or replicates them (sp % kv == 0); use another SP degree")
    return None


def sp_degrees_that_work(num_heads: int, num_kv_heads: int) -> list:
    """The powers of two up to 64 Ulysses can split these heads by (``sp_heads_problem`` is None), for messages."""
    return [sp for sp in (1, 2, 4, 8, 16, 32, 64) if sp_heads_problem(num_heads, num_kv_heads, sp) is None]


def mlp_tiles(hidden: int, pack_len: int, sp: int) -> int:
    """Sequence tiles of the tiled-MLP memory lever for a packing group (hbp_train/model/levers.py): one per
    ``hidden`` tokens of a rank's slice of a ``pack_len`` pack at SP degree ``sp`` (DeepSpeed's ALST rule: a tile's
    MLP intermediate is then about the size of one MLP weight). Taken from the group, not from the pack a rank
    holds, so every rank of a step runs the same number of tiles without asking the others (ZeRO-3 gathers the
    MLP's weights once per tile: the ranks' calls must pair up). 1 = the slice fits in one tile: no tiling."""
    local = -(-int(pack_len) // int(sp))
    return max(1, -(-local // int(hidden)))
