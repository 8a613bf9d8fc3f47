"""Predicted time of one pack on one SP replica: attention by document length, linear layers by tokens, Ulysses comm.

Pure numpy (no torch), used by the planner (hbp balances predicted pack time), the simulator and the compare CLI.
The model, per pack of samples with lengths l_i (T = Σ l_i tokens) run by an SP group of ``sp`` ranks, is

    compute/layer   = Σ_i A_fb(l_i) + C_fb · T                 (attention fwd+bwd per document + linear part)
    recompute/layer = Σ_i A_f(l_i)  + C_fb/3 · T               (one extra forward for a checkpointed layer)
    a2a             = (T/sp) · (sp-1)/sp · bytes_per_token / bw (one Ulysses all-to-all, per rank; SP groups
                      spanning nodes: the off-node share over the inter-node link, see a2a_seconds)
    pack time       = [layers·compute + ckpt·recompute + H_fb·T] / sp + (8·layers + 4·ckpt) · a2a_q/k/v/o

plus, for a packing group's memory levers (``pack_times(..., tiled_mlp=, offload_activations=)``):

    tiled MLP       + layers · [C_fb/3 · T · mlp_share / sp + 2 · tiles · TILED_MLP_TILE_S]
                    (its backward recomputes the MLP forward of every layer, checkpointed or not: the MLP's share of
                    the linear FLOPs, ``mlp_share``, of one forward; and a fixed cost per tile and pass)
    offload         + ckpt · [max(0, copy − layer forward) + copy · (1 − OFFLOAD_RESTORE_OVERLAP)]
                    copy = (T/sp) · hidden · 2 B / pcie_gbps: each checkpointed layer's input goes to the host during
                    the next layer's forward (hidden behind it when shorter) and comes back before its recompute
                    (DeepSpeed 0.19.8 waits for it there: exposed)

where A(l) comes from the calibration table (ms for 32768 tokens made of documents of length l, interpolated in
log-log: one document of length l costs t(l)·l/32768), C_fb is the linear fwd+bwd time per token, H_fb the LM
head and its chunked loss per token: measured by the calibration (``head_fwdbwd_ms_per_32768_tokens``: the
trainer's chunked loss, fwd+bwd; scaled by hidden·vocab to another shape), else its four vocab x hidden matmuls
(forward, and in backward the recomputed logits and both gradients) at the linear part's FLOP rate, which leaves
out the loss's fp32 passes over the logits; and the four all-to-alls per layer
forward move q, k, v (before attention) and the attention output (after), four more in backward, four more for
each recomputed layer. docs/simulator.md states the model and its limits (no compute/comm overlap; the optimizer
step and ZeRO's collectives are per step / per micro-batch, not per pack: hbp_train.planning.simulator adds them).

``StepCosts``: what a training step costs besides its packs' compute (a fixed cost per pack, per micro-batch and per
step, the data loading, and the trainer's compute over this model's), a calibration's optional ``"step_costs"``
entry, fitted from a training run by hbp_train.perf.step_costs; the simulator adds them. Without the entry (the
shipped H100 file) every term is 0: unknown, not measured.

``source`` says where the numbers come from: "measured" (the calibration's own shape), "scaled" (a calibration
measured on another shape, scaled by FLOPs), "analytic" (FLOPs at a stated efficiency of peak, no measurement).
Shapes come from hbp_train.perf.shape and FLOPs from hbp_train.perf.flops (the formula MFU uses too). A bad
calibration file or shape is the user's: UserError naming the file or field.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np

from hbp_train.common.errors import UserError
from hbp_train.perf.flops import (TRAIN_OVER_FORWARD, attention_fwd_flops, head_fwd_flops_per_token,
                                  linear_fwd_flops_per_token)
from hbp_train.perf.shape import ModelShape, parse_model_shape

DEFAULT_CALIBRATION = Path(__file__).resolve().parent / "calibration" / "h100_llama3_8b_layer.json"
# The calibration table's unit: a pack of this many tokens.
TABLE_TOKENS = 32768
# Defaults for the all-to-all bandwidth per GPU, in GB/s (gigabytes per second, one direction, effective):
# H100 NVLink-4 is 450 GB/s per direction, NCCL all-to-all reaches well under that; 8x400 Gb/s InfiniBand
# gives 50 GB/s per GPU, effective ~40.
DEFAULT_INTRA_NODE_GBPS = 200.0
DEFAULT_INTER_NODE_GBPS = 40.0
# FlashAttention-style backward does 5 matmuls to the forward's 2: fwd+bwd = 3.5 x fwd.
ATTN_FWDBWD_OVER_FWD = 3.5
# The chunked LM-head loss (hbp_train/model/loss.py) runs the logits matmul in forward and again in backward, then the
# hidden and the weight gradients: 4 x the forward's vocab x hidden FLOPs (a plain layer's fwd+bwd is 3x).
HEAD_MATMULS = 4
# Host <-> GPU bandwidth of activation offload, GB/s per GPU and direction (pinned memory): PCIe Gen5 x16 moves
# ~55 GB/s one way, but a node's 8 GPUs share their CPUs' lanes and memory when they all copy at once; 25 is the
# planning figure (an assumption, not measured here: --pcie-gbps / profile.pcie_gbps changes it).
DEFAULT_PCIE_GBPS = 25.0
# Seconds a tiled-MLP tile costs per pass (forward, and the recompute + backward) beyond its FLOPs: the Python loop,
# the slicing and the kernel launches of one small MLP (an assumption: ~10 launches of a few microseconds).
TILED_MLP_TILE_S = 30e-6
# Share of an offloaded input's copy back to the GPU hidden behind compute: DeepSpeed 0.19.8's
# CheckpointHiddenStatesOffload starts the copy when backward asks for the input and waits for it (no prefetch).
OFFLOAD_RESTORE_OVERLAP = 0.0


@dataclass(frozen=True)
class StepCosts:
    """What a training step costs besides its packs' compute, in seconds, on the machine a calibration measured
    (fitted from a training run by ``python -m hbp_train.perf.step_costs``). All terms 0 and the scale 1 (the
    default, and the shipped H100 calibration's): unknown, so the simulator predicts compute only, plus the
    collectives and optimizer step ``--zero-stage`` models."""

    compute_scale: float = 1.0
    """The trainer's compute of a pack over the cost model's prediction (its whole program around the layers the
    calibration timed: embedding, loss, DeepSpeed's gradient hooks)."""
    pack_s: float = 0.0
    """Seconds every pack costs its rank beyond its compute, the one-token dummy the trainer runs for an empty pack
    included (launches, Python, the collate)."""
    micro_batch_s: float = 0.0
    """Seconds every micro-batch (slot) costs beyond its slowest pack: the engine's micro-step and whatever of ZeRO's
    per-micro-batch gradient reduction ``--zero-stage`` does not model."""
    step_s: float = 0.0
    """Seconds every optimizer step costs beyond its micro-batches: the optimizer step, ZeRO's per-step all-gather
    and the step's bookkeeping, beyond what ``--zero-stage`` models."""
    data_step_s: float = 0.0
    """Seconds of loading a step's packs, once per optimizer step."""
    data_micro_batch_s: float = 0.0
    """Seconds of loading each micro-batch a rank runs."""
    source: str = "none"
    """Where the terms come from (the run they were fitted on), or "none"."""

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name != "source" and not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise UserError(f"step_costs.{f.name} must be a number >= 0, got {value!r}")
        if not self.compute_scale > 0:
            raise UserError(f"step_costs.compute_scale must be > 0, got {self.compute_scale!r}")

    @classmethod
    def from_dict(cls, data: dict, where: str = "step_costs") -> "StepCosts":
        """The terms of a calibration's "step_costs" entry (its other keys are the fit's record); UserError names
        ``where``."""
        if not isinstance(data, dict):
            raise UserError(f"{where}: must be an object of seconds, got {type(data).__name__}")
        names = [f.name for f in fields(cls)]
        try:
            return cls(**{k: data[k] for k in names if k in data})
        except UserError as exc:
            raise UserError(f"{where}: {exc}") from None

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def known(self) -> bool:
        """True when any term was measured."""
        return self != StepCosts(source=self.source)

    def note(self) -> str:
        """One line for tables: the terms in milliseconds, or that there are none."""
        if not self.known:
            return "no step costs (compute only)"
        ms = lambda s: f"{1e3 * s:.3g} ms"  # noqa: E731
        return (f"step costs: compute x{self.compute_scale:.3g}, {ms(self.pack_s)}/pack, "
                f"{ms(self.micro_batch_s)}/micro-batch, {ms(self.step_s)}/step, data {ms(self.data_step_s)}/step + "
                f"{ms(self.data_micro_batch_s)}/micro-batch ({self.source})")


class CostModel:
    """Pack-time predictor. Build it with ``from_calibration`` or ``analytic``; times are in seconds."""

    def __init__(self, shape: ModelShape, table_lens, attn_fb_ms, attn_f_ms, linear_fb_ms_per_table: float,
                 source: str, note: str = "", dtype_bytes: int = 2, head_fb_ms_per_table: float | None = None,
                 step_costs: StepCosts | None = None):
        lens = np.asarray(table_lens, dtype=np.float64)
        self.step_costs = step_costs or StepCosts()
        order = np.argsort(lens)
        self.shape = shape
        self.source = source
        self.note = note
        self.dtype_bytes = dtype_bytes
        self._log_len = np.log(lens[order])
        self._log_attn_fb = np.log(np.asarray(attn_fb_ms, dtype=np.float64)[order])
        self._log_attn_f = np.log(np.asarray(attn_f_ms, dtype=np.float64)[order])
        # Per token, per layer, in seconds.
        self.linear_fb_per_token = linear_fb_ms_per_table / 1e3 / TABLE_TOKENS
        if head_fb_ms_per_table is not None:  # the calibration timed the trainer's chunked loss
            self.head_fb_per_token = head_fb_ms_per_table / 1e3 / TABLE_TOKENS
        else:  # its HEAD_MATMULS matmuls at the linear part's FLOP rate (which does TRAIN_OVER_FORWARD per forward)
            self.head_fb_per_token = (self.linear_fb_per_token * HEAD_MATMULS / TRAIN_OVER_FORWARD
                                      * head_fwd_flops_per_token(shape) / linear_fwd_flops_per_token(shape))

    # ---- construction -------------------------------------------------------------------------------------
    @classmethod
    def from_calibration(cls, path=None, model_shape=None) -> "CostModel":
        """Load a calibration JSON (the shipped H100 Llama-3-8B layer by default), optionally scaled to a shape.

        The file's own shape is its "model_shape" entry (written by ``hbp_train.perf.calibrate``); the shipped file
        has none and was measured on a Llama-3-8B layer. Another ``model_shape`` scales the linear part by the
        ratio of linear FLOPs and attention by heads·head_dim, and the result is labelled "scaled".
        """
        path = Path(path) if path is not None else DEFAULT_CALIBRATION
        try:
            data = json.loads(path.read_text())
        except OSError as exc:
            raise UserError(f"calibration {path}: cannot read ({exc.strerror})") from None
        except json.JSONDecodeError as exc:
            raise UserError(f"calibration {path}: invalid JSON at line {exc.lineno} ({exc.msg})") from None
        for key in ("linear_fwdbwd_ms_per_32768_tokens", "attention_fwdbwd_ms_32768_tokens_by_doc_len"):
            if key not in data:
                raise UserError(f"calibration {path}: missing field {key!r}")
        measured_shape = parse_model_shape(data.get("model_shape", "llama3-8b"))
        table = data["attention_fwdbwd_ms_32768_tokens_by_doc_len"]
        try:
            lens = np.array([int(k) for k in table], dtype=np.float64)
            fb = np.array([float(v) for v in table.values()])
        except (TypeError, ValueError, AttributeError):  # AttributeError: a list or number instead of an object
            raise UserError(f"calibration {path}: attention table keys must be lengths and values ms") from None
        if len(lens) < 2 or (fb <= 0).any() or (lens <= 0).any():
            raise UserError(f"calibration {path}: attention table needs >= 2 positive points")
        fwd_table = data.get("attention_fwd_ms_32768_tokens_by_doc_len")
        if fwd_table and set(fwd_table) == set(table):
            f = np.array([float(fwd_table[k]) for k in table])
        else:
            f = fb / ATTN_FWDBWD_OVER_FWD
        try:
            linear = float(data["linear_fwdbwd_ms_per_32768_tokens"])
        except (TypeError, ValueError):
            linear = float("nan")
        if not linear > 0:  # also NaN and non-numbers
            raise UserError(f"calibration {path}: linear_fwdbwd_ms_per_32768_tokens must be > 0")
        head = data.get("head_fwdbwd_ms_per_32768_tokens")
        if head is not None and not (isinstance(head, (int, float)) and head > 0):
            raise UserError(f"calibration {path}: head_fwdbwd_ms_per_32768_tokens must be > 0 (or absent)")
        # A CPU calibration (hbp_train.perf.calibrate --device cpu) names its CPU and threads, and is fp32.
        source, note = "measured", f"{path.name} ({data.get('gpu') or data.get('cpu') or 'unknown GPU'})"
        dtype_bytes = 4 if data.get("dtype") == "float32" else 2
        if head is None:
            note += ", LM head from FLOPs"
        shape = measured_shape
        if model_shape is not None:
            shape = parse_model_shape(model_shape)
            if head is not None:  # matmuls over vocab x hidden and fp32 passes over the vocab: both ~ hidden·vocab
                head = head * head_fwd_flops_per_token(shape) / head_fwd_flops_per_token(measured_shape)
            # Same layer, other depth or vocab: the per-layer numbers are still measured.
            if not _same_layer(shape, measured_shape):
                attn_scale = shape.attn_width / measured_shape.attn_width
                fb, f = fb * attn_scale, f * attn_scale
                linear = linear * linear_fwd_flops_per_token(shape) / linear_fwd_flops_per_token(measured_shape)
                source = "scaled"
                note += f", scaled from {measured_shape.name} to {shape.name} by FLOPs"
        step_costs = StepCosts.from_dict(data["step_costs"], f"calibration {path}: step_costs") \
            if "step_costs" in data else None
        return cls(shape, lens, fb, f, linear, source, note, dtype_bytes, head_fb_ms_per_table=head,
                   step_costs=step_costs)

    @classmethod
    def analytic(cls, model_shape, peak_tflops: float = 989.0, efficiency: float = 0.5) -> "CostModel":
        """FLOPs at ``efficiency`` of ``peak_tflops`` (H100 SXM dense bf16: 989), no measurement ("analytic").

        Causal attention of a document of length l: forward 2·l²·heads·head_dim FLOPs, backward 2.5x that.
        Linear part: 3x the forward FLOPs (backward computes input and weight gradients); LM head 4x (its loss
        recomputes the logits in backward)."""
        if peak_tflops <= 0:
            raise UserError(f"peak_tflops must be > 0, got {peak_tflops}")
        if not 0 < efficiency <= 1:
            raise UserError(f"efficiency must be in (0, 1], got {efficiency}")
        shape = parse_model_shape(model_shape)
        rate = peak_tflops * 1e12 * efficiency  # FLOP/s
        lens = 2.0 ** np.arange(4, 21)
        # ms for TABLE_TOKENS tokens made of documents of length l: (TABLE_TOKENS / l) docs of 2·l²·H·d FLOPs.
        f_ms = TABLE_TOKENS / lens * attention_fwd_flops(shape, lens) / rate * 1e3
        fb_ms = f_ms * ATTN_FWDBWD_OVER_FWD
        linear_ms = TRAIN_OVER_FORWARD * linear_fwd_flops_per_token(shape) * TABLE_TOKENS / rate * 1e3
        return cls(shape, lens, fb_ms, f_ms, linear_ms, "analytic",
                   f"{efficiency:.0%} of {peak_tflops:g} TFLOP/s peak")

    # ---- per-document and per-pack times ------------------------------------------------------------------
    def _attn(self, lengths, log_table) -> np.ndarray:
        """Per-document, per-layer attention seconds: t(l)·l/TABLE_TOKENS with t interpolated in log-log.

        Outside the table: below the shortest length the per-token cost stays flat (kernel overheads dominate);
        above the longest it follows the last segment's slope (≈ 1: quadratic per document).
        """
        lengths = np.asarray(lengths, dtype=np.float64)
        log_l = np.log(np.maximum(lengths, 1.0))
        lo, hi = self._log_len, log_table
        log_t = np.interp(log_l, lo, hi)
        slope = (hi[-1] - hi[-2]) / (lo[-1] - lo[-2])
        above = log_l > lo[-1]
        log_t = np.where(above, hi[-1] + slope * (log_l - lo[-1]), log_t)
        return np.exp(log_t) * lengths / TABLE_TOKENS / 1e3

    def attention_fwdbwd(self, lengths) -> np.ndarray:
        """Attention fwd+bwd seconds of one layer for each document length."""
        return self._attn(lengths, self._log_attn_fb)

    def attention_fwd(self, lengths) -> np.ndarray:
        """Attention forward seconds of one layer for each document length (the recompute of a checkpoint)."""
        return self._attn(lengths, self._log_attn_f)

    def a2a_seconds(self, tokens, sp, intra_node_gbps=DEFAULT_INTRA_NODE_GBPS,
                    inter_node_gbps=DEFAULT_INTER_NODE_GBPS, gpus_per_node: int = 8) -> np.ndarray:
        """Seconds of the four all-to-alls of ONE layer forward for packs of ``tokens`` at degree ``sp``.

        Each rank holds T/sp tokens and sends 1/sp of them to each of its sp-1 peers (the heads those peers own).
        An SP group is sp consecutive ranks: min(sp, gpus_per_node)-1 peers share the rank's node (NVLink), the
        other sp-min(sp, gpus_per_node) are on other nodes (the GPU's own NIC). Both parts run at the same time,
        so the slower one sets the time; within a node this is (T/sp)·(sp-1)/sp·width·bytes / intra bandwidth.
        """
        tokens = np.asarray(tokens, dtype=np.float64)
        sp = np.broadcast_to(np.asarray(sp, dtype=np.int64), tokens.shape)
        shape = self.shape
        width = 2 * shape.attn_width + 2 * np.maximum(shape.num_kv_heads, sp) * shape.head_dim  # = a2a_width
        per_peer = tokens / sp / sp * width * self.dtype_bytes
        local_peers = np.minimum(sp, gpus_per_node) - 1
        remote_peers = sp - 1 - local_peers
        return np.maximum(per_peer * local_peers / (intra_node_gbps * 1e9),
                          per_peer * remote_peers / (inter_node_gbps * 1e9))

    def pack_times(self, lengths, offsets, sp, ckpt_layers=0, intra_node_gbps=DEFAULT_INTRA_NODE_GBPS,
                   inter_node_gbps=DEFAULT_INTER_NODE_GBPS, gpus_per_node: int = 8, tiled_mlp=False,
                   offload_activations=False, pcie_gbps: float = DEFAULT_PCIE_GBPS) -> np.ndarray:
        """Seconds of every pack, vectorised over a CSR layout.

        lengths: all samples' lengths, pack by pack; offsets: [0, end_0, end_1, ...] (len = #packs + 1);
        sp, ckpt_layers, tiled_mlp, offload_activations: scalars or one value per pack (the levers' costs: module
        docstring). Empty packs cost 0.
        """
        lengths = np.asarray(lengths, dtype=np.float64)
        offsets = np.asarray(offsets, dtype=np.int64)
        num_packs = len(offsets) - 1
        sp = np.broadcast_to(np.asarray(sp, dtype=np.int64), (num_packs,))
        ckpt = np.broadcast_to(np.asarray(ckpt_layers, dtype=np.float64), (num_packs,))
        if (sp < 1).any():
            raise ValueError("sp must be >= 1")
        if ((ckpt < 0) | (ckpt > self.shape.num_layers)).any():
            raise ValueError(f"ckpt_layers must be in [0, {self.shape.num_layers}]")
        pack_of = np.repeat(np.arange(num_packs), np.diff(offsets))
        attn_fb = np.bincount(pack_of, self.attention_fwdbwd(lengths), minlength=num_packs)
        attn_f = np.bincount(pack_of, self.attention_fwd(lengths), minlength=num_packs)
        tokens = np.bincount(pack_of, lengths, minlength=num_packs)
        layers = self.shape.num_layers
        compute = attn_fb + self.linear_fb_per_token * tokens
        recompute = attn_f + self.linear_fb_per_token / 3.0 * tokens
        a2a = self.a2a_seconds(tokens, sp, intra_node_gbps, inter_node_gbps, gpus_per_node)
        times = ((layers * compute + ckpt * recompute + self.head_fb_per_token * tokens) / sp
                 + (2 * layers + ckpt) * a2a)
        tiled = np.broadcast_to(np.asarray(tiled_mlp, dtype=bool), (num_packs,))
        offload = np.broadcast_to(np.asarray(offload_activations, dtype=bool), (num_packs,))
        if tiled.any() or offload.any():
            times = times + self.lever_seconds(tokens, sp, ckpt, recompute, tiled, offload, pcie_gbps)
        return np.where(tokens > 0, times, 0.0)

    def lever_seconds(self, tokens, sp, ckpt, layer_forward, tiled, offload, pcie_gbps=DEFAULT_PCIE_GBPS):
        """What a group's memory levers add to packs of ``tokens`` (module docstring): the tiled MLP's recompute of
        every layer's MLP forward and its per-tile cost; activation offload's copies of each checkpointed layer's
        input (``layer_forward``: one layer's forward seconds of the whole pack, hiding the copy to the host when
        longer; the copy back is exposed)."""
        shape = self.shape
        local = np.ceil(np.asarray(tokens, dtype=np.float64) / sp)
        mlp_share = 1.0 - shape.num_layers * shape.attn_params() / shape.linear_params(active=True)
        tiles = np.maximum(1.0, np.ceil(local / shape.hidden))
        tiled_s = shape.num_layers * (self.linear_fb_per_token / 3.0 * mlp_share * local
                                      + 2 * tiles * TILED_MLP_TILE_S)
        copy = local * shape.hidden * self.dtype_bytes / (pcie_gbps * 1e9)
        offload_s = ckpt * (np.maximum(0.0, copy - layer_forward / sp) + copy * (1.0 - OFFLOAD_RESTORE_OVERLAP))
        return np.where(tiled, tiled_s, 0.0) + np.where(offload, offload_s, 0.0)

    def pack_time(self, sample_lengths, sp: int = 1, ckpt_layers: int = 0,
                  intra_node_gbps=DEFAULT_INTRA_NODE_GBPS, inter_node_gbps=DEFAULT_INTER_NODE_GBPS,
                  gpus_per_node: int = 8, tiled_mlp: bool = False, offload_activations: bool = False,
                  pcie_gbps: float = DEFAULT_PCIE_GBPS) -> float:
        """Seconds of one pack (fwd+bwd of all layers, recompute, LM head, all-to-alls, the levers' costs) on an SP
        group of sp."""
        lengths = np.asarray(sample_lengths, dtype=np.float64)
        return float(self.pack_times(lengths, [0, len(lengths)], sp, ckpt_layers, intra_node_gbps,
                                     inter_node_gbps, gpus_per_node, tiled_mlp, offload_activations, pcie_gbps)[0])

    def describe(self) -> dict:
        """What this model is, for reports."""
        return {"source": self.source, "note": self.note, "model_shape": asdict(self.shape),
                "step_costs": self.step_costs.to_dict()}


def _same_layer(a: ModelShape, b: ModelShape) -> bool:
    """True when two shapes have the same per-layer FLOPs (the layer count and vocab may differ)."""
    return (a.hidden, a.num_heads, a.num_kv_heads, a.head_dim, a.ffn) == \
        (b.hidden, b.num_heads, b.num_kv_heads, b.head_dim, b.ffn)


def pack_cost_fn(model: CostModel, ckpt_layers_default: int = 0, intra_node_gbps=DEFAULT_INTRA_NODE_GBPS,
                 inter_node_gbps=DEFAULT_INTER_NODE_GBPS, gpus_per_node: int = 8):
    """A planner ``PackCostFn`` (hbp_train.planning.plan): predicted seconds of packs run in a group.

    The group's sp, ckpt_layers and memory levers are used (``ckpt_layers_default`` where the group says null),
    so the planner balances predicted pack time instead of Σ len².
    """

    def cost(pack_lengths: np.ndarray, pack_ptr: np.ndarray, group=None) -> np.ndarray:
        sp = 1 if group is None else int(group.sp)
        ckpt = ckpt_layers_default if group is None or group.ckpt_layers is None else int(group.ckpt_layers)
        tiled, offload = (False, False) if group is None else group_levers(group)
        return model.pack_times(pack_lengths, pack_ptr, sp, min(ckpt, model.shape.num_layers), intra_node_gbps,
                                inter_node_gbps, gpus_per_node, tiled, offload)

    return cost


def group_levers(group) -> tuple[bool, bool]:
    """(tiled_mlp, offload_activations) of a packing group (a planning GroupSpec, or a plan's group dict); a group
    written before the levers existed has neither."""
    if isinstance(group, dict):
        return bool(group.get("tiled_mlp", False)), bool(group.get("offload_activations", False))
    return bool(getattr(group, "tiled_mlp", False)), bool(getattr(group, "offload_activations", False))
