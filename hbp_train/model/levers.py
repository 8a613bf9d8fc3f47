"""The memory levers of a packing group: tiled MLP and activation-checkpoint offload, switched per group.

A long pack's activations, not the model, fill a GPU. Three levers trade a little time for memory, each exact
(the same loss and gradients as without it; docs/memory_levers.md):

* **tiled MLP** (a group's ``tiled_mlp``): each decoder layer's MLP, or MoE block, runs over sequence tiles of
  ``hidden_size`` tokens (perf.shape.mlp_tiles), each tile a non-reentrant ``torch.utils.checkpoint``: its
  intermediate ([tile, intermediate] and the experts' buffers) is freed after the tile and recomputed in backward,
  so one tile's lives at a time instead of the whole slice's. MoE blocks tile as they are: the router runs per
  tile with gradients, and the router logits (and chosen experts) transformers records once per tile are joined
  back into one [T, E] per layer (hf_model.forward_hidden), so the router loss is the untiled one.
* **activation-checkpoint offload** (``offload_activations``): the hidden states each checkpointed layer keeps for
  its recompute go to pinned host memory on a side stream and come back for backward, each freed once its layer's
  backward is done (DeepSpeed's ``CheckpointHiddenStatesOffload``, a ``saved_tensors_hooks`` context around the
  micro-batch's forward and backward, with the inputs it marks known by their memory and each restored for one use:
  ``hidden_states_offload`` says why). On a CPU,
  DeepSpeed keeps them where they are (no device to free): the hooks run, nothing moves.
* **loss tiling** (always on): the LM head and its loss one chunk of tokens at a time (model/loss.py).

Why not DeepSpeed's ``TiledMLP`` for the first: it runs the shards' forward under ``no_grad`` and re-runs each in
backward, so the router logits an MoE block records carry no gradient (the router loss would not train the
router: tests/test_levers.py shows it), and ``torch.chunk`` makes fewer shards than asked for a short slice, so
ranks of one ZeRO-3 step could gather the MLP's weights a different number of times. Here every rank runs
exactly ``mlp_tiles`` tiles (``tensor_split``; a tile may be empty) and autograd sums each weight's gradient over
the tiles before ZeRO's gradient hook fires once.

``MemoryLevers`` is installed on a model once (build.build_run; ``install_levers`` for a measurement) and the
trainer switches it per (group, sp) with ``set(Levers(...))``, the levers of ``step_levers``; each micro-batch's
forward and backward run inside ``micro_batch()``. Under ZeRO-3 the tiling is the same in every step (the most
tiles any tiled group runs, on every group), as the checkpointed layers are (build.step_ckpt_layers): ZeRO-3
prefetches weights by the module order it traced, and tiles change that order.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from hbp_train.common.errors import UserError
from hbp_train.perf.shape import mlp_tiles

# The attribute holding a decoder layer's MLP (or MoE block) in transformers' families, first found wins.
MLP_ATTRIBUTES = ("mlp", "feed_forward", "block_sparse_moe")


@dataclass(frozen=True)
class Levers:
    """The levers a micro-batch runs with."""

    mlp_tiles: int = 1
    """Sequence tiles of each MLP (1 = untiled)."""
    offload: bool = False
    """Checkpointed layers' hidden states offloaded to host memory between forward and backward."""

    def describe(self) -> str:
        """How the start-of-run summary names them, e.g. 'tiled MLP (4 tiles), offload'."""
        parts = [f"tiled MLP ({self.mlp_tiles} tiles)"] if self.mlp_tiles > 1 else []
        parts += ["offload of the checkpointed layers' inputs"] if self.offload else []
        return ", ".join(parts) or "none"


def group_levers(group: dict, hidden: int) -> Levers:
    """The levers a packing group asks for: ``group`` as plan.json writes it (pack_len, sp, tiled_mlp,
    offload_activations), or a micro-batch's tags of it (batches/loader.py); a lever it does not name is off."""
    tiles = mlp_tiles(hidden, int(group["pack_len"]), int(group.get("sp", 1))) if group.get("tiled_mlp") else 1
    return Levers(mlp_tiles=tiles, offload=bool(group.get("offload_activations", False)))


def step_levers(group: dict, groups: Optional[list], hidden: int, zero_stage: int) -> Levers:
    """The levers a micro-batch of packing group ``group`` (see group_levers) runs with: its group's, except the
    tiling under ZeRO-3 with the plan's ``groups`` known, where every step runs the most tiles any group does (none
    when no group tiles): one module order for ZeRO-3's prefetch trace (module docstring). Offload changes no
    module order: per group at every stage."""
    own = group_levers(group, hidden)
    if zero_stage < 3 or not groups:
        return own
    return Levers(mlp_tiles=max(group_levers(g, hidden).mlp_tiles for g in groups), offload=own.offload)


def setup_levers(model, groups: list, ckpt_layers: list, kernels: str, where: str) -> "MemoryLevers":
    """The run's MemoryLevers on ``model``, after the checks of the levers its packing ``groups`` ask for
    (``ckpt_layers``: each group's checkpointed layers; ``kernels``: model.kernels; ``where``: the groups'
    source, for messages)."""
    check_group_levers(groups, ckpt_layers, where)
    if any(g.get("tiled_mlp") for g in groups):
        check_tiled_mlp(model, kernels)
    return install_levers(model)


def check_plan_levers(hf_config, groups: list, ckpt_layers: list, kernels: str, where: str) -> None:
    """setup_levers' checks from the HF config alone (the model built on the meta device: no memory, no weights),
    for config.check_paths before any worker starts."""
    check_group_levers(groups, ckpt_layers, where)
    if any(g.get("tiled_mlp") for g in groups):
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            check_tiled_mlp(AutoModelForCausalLM.from_config(hf_config, attn_implementation="eager"), kernels)


def describe_groups(groups: list, hidden: int, zero_stage: int) -> str:
    """Each group's levers in words, e.g. '16384:sp1 none; 131072:sp8 tiled MLP (4 tiles), offload' (as
    step_levers applies them)."""
    return "; ".join(f"{g['pack_len']}:sp{g.get('sp', 1)} {step_levers(g, groups, hidden, zero_stage).describe()}"
                     for g in groups)


def check_group_levers(groups: list, ckpt_layers: list, where: str) -> None:
    """One-line UserError for a group asking for offload without checkpointed layers (``ckpt_layers``: each
    group's own count, build.ckpt_layers_for, before ZeRO-3's rule; ``where``: the groups' source, for the
    message)."""
    for g, (group, layers) in enumerate(zip(groups, ckpt_layers)):
        if group.get("offload_activations") and layers == 0:
            raise UserError(f"{where}: group {g} (pack_len {group['pack_len']}) asks for offload_activations with 0 "
                            "checkpointed layers: offload moves the hidden states checkpointed layers keep; give "
                            "the group checkpointed layers (train.ckpt_layers or pack --groups "
                            "pack_len:sp:ckpt_layers:offload) or drop offload")


def _decoder_layers(model):
    """The decoder blocks (hf_model.decoder_layers, which imports this module)."""
    return model.base_model.layers


def mlp_of(layer) -> Optional[torch.nn.Module]:
    """A decoder layer's MLP or MoE block (MLP_ATTRIBUTES), or None."""
    for name in MLP_ATTRIBUTES:
        module = getattr(layer, name, None)
        if isinstance(module, torch.nn.Module):
            return module
    return None


def check_tiled_mlp(model, kernels: str = "none") -> None:
    """One-line UserError when the tiled MLP cannot be exact on this model (read from its modules: a model built on
    the meta device will do): a decoder layer without an MLP module we know, a router outside the MLP (its records
    could not be joined per layer), router noise (drawn per tile: another draw than untiled), or compiled decoder
    layers (model.kernels=compile)."""
    family = getattr(model.config, "model_type", "this model")
    where = f"tiled_mlp ({family})"
    if kernels == "compile":
        raise UserError(f"{where}: not with model.kernels=compile (each tile is a checkpoint inside the compiled "
                        "layer); use model.kernels=liger or none, or drop tiled_mlp from the plan's groups")
    mlps = []
    for index, layer in enumerate(_decoder_layers(model)):
        mlp = mlp_of(layer)
        if mlp is None:
            raise UserError(f"{where}: decoder layer {index} ({type(layer).__name__}) has none of the MLP modules "
                            f"{', '.join(MLP_ATTRIBUTES)}; drop tiled_mlp from the plan's groups")
        mlps.append(mlp)
    inside = {id(m) for mlp in mlps for m in mlp.modules()}
    spec = (getattr(model.base_model, "_can_record_outputs", None) or {}).get("router_logits")
    router_class = getattr(spec, "target_class", spec)
    if isinstance(router_class, type):
        outside = [m for m in model.modules() if isinstance(m, router_class) and id(m) not in inside]
        if outside:
            raise UserError(f"{where}: the router {type(outside[0]).__name__} sits outside the layers' MLP modules, "
                            "so its records could not be joined per layer; drop tiled_mlp from the plan's groups")
    noise = float(getattr(model.config, "router_jitter_noise", 0.0) or 0.0)
    if noise > 0:
        raise UserError(f"{where}: router_jitter_noise={noise} draws its noise per tile, not as the untiled MLP "
                        "does; set model.config.router_jitter_noise=0 or drop tiled_mlp from the plan's groups")


class MemoryLevers:
    """The levers installed on one model: each decoder layer's MLP made tileable, and the offload context.

    ``set(Levers(...))`` switches them (cheap; the trainer calls it when the packing group changes);
    ``micro_batch()`` is the context one micro-batch's forward AND backward run in (the offload hooks' restores
    happen in backward). Untiled and without offload, the model runs exactly as HF's.
    """

    def __init__(self, model):
        self.model = model
        self.levers = Levers()
        self._offload = None  # DeepSpeed's context, made at first use; kept, so its pinned buffers are reused
        self.offload_stats = None
        """The last offloading micro-batch's DeepSpeed counters (marked, offloaded, restored tensors, bytes)."""
        for layer in _decoder_layers(model):
            mlp = mlp_of(layer)
            if mlp is not None and not getattr(mlp, "_hbp_tileable", False):
                _make_tileable(mlp, self)
        model._hbp_levers = self

    def set(self, levers: Levers) -> None:
        self.levers = levers
        # read by hf_model.forward_hidden: the routers' records come once per tile
        self.model._hbp_mlp_tiles = levers.mlp_tiles

    def micro_batch(self):
        """The context of one micro-batch's forward and backward: DeepSpeed's offload hooks when offload is on."""
        if not self.levers.offload:
            return nullcontext()
        if self._offload is None:
            self._offload = hidden_states_offload()()
        return _Counted(self._offload, self)


_OFFLOAD_CLASS = []


def hidden_states_offload() -> type:
    """DeepSpeed's ``CheckpointHiddenStatesOffload`` with two changes.

    * Its marked inputs are known by their memory (address, shape, strides, dtype) instead of their Python object.
      DeepSpeed marks a checkpointed layer's input as the layer is called, and offloads the tensor the layer's
      checkpoint saves if it is that object; under ZeRO-3 the module hooks in between hand the layer a detached alias
      of it (``PostBackwardFunctionModule``: the same memory, another object), so DeepSpeed's own class offloads
      nothing there (tests/test_levers.py saw 0 of 2 under ZeRO-3).
    * Each input is restored for one use. DeepSpeed's unpack caches what it restores until the context exits (for a
      second backward over the same graph, ``retain_graph``), so by the end of the backward every offloaded input is
      back on the device at once and offload lowers only the end of the forward. torch's non-reentrant checkpoint
      unpacks a layer's saved input once per backward, to recompute the layer, so here the restored input lives only
      as long as that layer's recompute and backward hold it. A second unpack of the same input (a second backward
      over a retained graph, or a backward after the context) stops with one line; the trainer runs neither."""
    if not _OFFLOAD_CLASS:
        from deepspeed.runtime.activation_checkpointing.offload_activations import (
            CheckpointHiddenStatesOffload, _OffloadedTensorRef)

        def key(tensor):
            return tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype

        class HiddenStatesOffload(CheckpointHiddenStatesOffload):
            def mark(self, tensor):
                self._allowed[key(tensor)] = self._allowed.get(key(tensor), 0) + 1
                self.stats.marked_tensors += 1

            def _consume_mark(self, tensor):
                count = self._allowed.get(key(tensor), 0)
                if count <= 0:
                    return False
                if count == 1:
                    del self._allowed[key(tensor)]
                else:
                    self._allowed[key(tensor)] = count - 1
                return True

            def _unpack_tensor(self, packed):
                if not isinstance(packed, _OffloadedTensorRef):
                    return packed
                index = packed.tensor_id
                if index not in self._keep_last and index not in self._fwd_stash and index not in self._tracker:
                    raise RuntimeError(f"offload_activations: checkpointed layer input {index} is no longer held: "
                                       "each offloaded input is restored once, for the one backward inside "
                                       "MemoryLevers.micro_batch(); a second backward over the same graph "
                                       "(retain_graph=True) or a backward after the context needs offload off")
                return self.restore_input(index)  # DeepSpeed's single-consumption restore (no cache)

        _OFFLOAD_CLASS.append(HiddenStatesOffload)
    return _OFFLOAD_CLASS[0]


class _Counted:
    """The offload context, keeping its counters once it is left (DeepSpeed resets them at the next entry)."""

    def __init__(self, ctx, levers: MemoryLevers):
        self.ctx, self.levers = ctx, levers

    def __enter__(self):
        return self.ctx.__enter__()

    def __exit__(self, *exc):
        from dataclasses import replace

        self.levers.offload_stats = replace(self.ctx.stats)
        return self.ctx.__exit__(*exc)


def install_levers(model) -> MemoryLevers:
    """The model's MemoryLevers (installed once; the same object on a second call)."""
    return getattr(model, "_hbp_levers", None) or MemoryLevers(model)


def _make_tileable(mlp: torch.nn.Module, levers: MemoryLevers) -> None:
    """Route ``mlp``'s forward through the tiling: its own forward (HF's, or the one model.kernels put on the
    instance) runs once per tile when ``levers`` says so."""
    inner = mlp.forward

    def forward(hidden_states, *args, **kwargs):
        tiles = levers.levers.mlp_tiles
        if tiles <= 1:
            return inner(hidden_states, *args, **kwargs)
        if any(isinstance(a, torch.Tensor) for a in (*args, *kwargs.values())):
            raise UserError(f"tiled_mlp: {type(mlp).__name__}.forward takes tensors besides the hidden states, "
                            "which the tiling does not split; drop tiled_mlp from the plan's groups")
        pieces = torch.tensor_split(hidden_states, tiles, dim=-2)  # exactly `tiles` pieces on every rank
        if torch.is_grad_enabled():
            # non-reentrant: nests inside a checkpointed layer, and autograd sums each weight's gradient over the
            # tiles before its accumulation hook (ZeRO's reduction) fires, once
            outs = [checkpoint(inner, piece, *args, use_reentrant=False, **kwargs) for piece in pieces]
        else:
            outs = [inner(piece, *args, **kwargs) for piece in pieces]
        return _join(outs)

    mlp.forward = forward
    mlp._hbp_tileable = True


def _join(outs: list):
    """The tiles' outputs joined along the token dimension (a tensor, or a tuple of them)."""
    if isinstance(outs[0], torch.Tensor):
        return torch.cat(outs, dim=-2)
    return type(outs[0])(torch.cat(parts, dim=-2) if isinstance(parts[0], torch.Tensor) else parts[0]
                         for parts in zip(*outs))


def join_tiles(records: list, tiles: int) -> list:
    """Per-call records of a tiled forward (router logits or chosen experts: ``tiles`` consecutive ones per MoE
    layer) joined into one per layer along the token dimension, as the untiled forward records them."""
    if tiles <= 1:
        return list(records)
    if len(records) % tiles:
        raise AssertionError(f"{len(records)} router records is not a multiple of the {tiles} MLP tiles")
    return [torch.cat(records[i:i + tiles], dim=-2) for i in range(0, len(records), tiles)]
