"""The options the simulator's commands share (data_tools.simulate and data_tools.compare): the cost model
(calibration, model shape, analytic), the links (all-to-all bandwidths, GPUs per node, checkpointed layers) and
ZeRO's communication, and the ``SimConfig`` and ``CostModel`` they ask for, each with one-line errors."""

from __future__ import annotations

import argparse
import sys

from data_tools.packing.model_record import cost_shape, unrecorded_line
from hbp_train.common.cli import existing_file, float_range, fraction, nonneg_int, positive_float, positive_int
from hbp_train.common.errors import UserError
from hbp_train.perf.cost_model import DEFAULT_INTER_NODE_GBPS, DEFAULT_INTRA_NODE_GBPS, DEFAULT_PCIE_GBPS, CostModel
from hbp_train.perf.shape import MODEL_SHAPES
from hbp_train.planning.simulator import DEFAULT_HBM_GBPS, SimConfig


def add_cost_model_args(parser: argparse.ArgumentParser) -> None:
    """The cost-model options of simulate and compare."""
    parser.add_argument("--calibration", default=None, metavar="FILE", type=existing_file,
                        help="calibration JSON (hbp_train.perf.calibrate format); default: the shipped H100 Llama-3-8B "
                             "layer, hbp_train/perf/calibration/h100_llama3_8b_layer.json")
    parser.add_argument("--model-shape", default=None, metavar="SHAPE",
                        help=f"model shape: a preset ({', '.join(MODEL_SHAPES)}), a JSON object, or a JSON file "
                             "(HF config.json keys work); default: the model the plan records (hbp-pack --model), "
                             "else the calibration's own shape (said in a warning). Another shape than the "
                             "calibration's scales the measurement by FLOPs (labelled 'scaled')")
    parser.add_argument("--analytic", action="store_true",
                        help="ignore calibrations: time = FLOPs / (peak * efficiency) (labelled 'analytic'); "
                             "needs --model-shape (default llama3-8b)")
    parser.add_argument("--peak-tflops", type=positive_float, default=989.0, help="peak bf16 TFLOP/s for --analytic "
                        "(default 989, H100 SXM dense)")
    parser.add_argument("--efficiency", type=float_range(0.0, 1.0, low_open=True), default=0.5,
                        help="fraction of peak reached for --analytic "
                        "(default 0.5)")


def add_link_args(parser: argparse.ArgumentParser) -> None:
    """Interconnect options for the Ulysses all-to-all time."""
    parser.add_argument("--intra-node-gbps", type=positive_float, default=DEFAULT_INTRA_NODE_GBPS,
                        help=f"all-to-all bandwidth per GPU inside a node, in GB/s (gigaBYTES per second; default "
                             f"{DEFAULT_INTRA_NODE_GBPS:g}); also ZeRO's collectives (--zero-stage) when the plan's "
                             "W <= --gpus-per-node")
    parser.add_argument("--inter-node-gbps", type=positive_float, default=DEFAULT_INTER_NODE_GBPS,
                        help=f"all-to-all bandwidth per GPU across nodes, GB/s (default {DEFAULT_INTER_NODE_GBPS:g}); "
                             "also ZeRO's collectives (--zero-stage) when the plan spans nodes")
    parser.add_argument("--gpus-per-node", type=positive_int, default=8,
                        help="GPUs per node; SP groups larger than this use the inter-node bandwidth (default 8)")
    parser.add_argument("--ckpt-layers", type=nonneg_int, default=0,
                        help="checkpointed layers for groups whose ckpt_layers is null in the plan (default 0)")


def add_comm_args(parser: argparse.ArgumentParser) -> None:
    """The optional ZeRO communication model (hbp_train.planning.simulator's docstring has the formulas)."""
    parser.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None,
                        help="add DeepSpeed ZeRO's own collectives for this stage (ring over all W ranks at the "
                             "intra-node bandwidth if W <= --gpus-per-node, else inter-node; 0: gradient all-reduce "
                             "per step, 1: reduce-scatter + all-gather per step, 2: reduce-scatter per micro-batch + "
                             "all-gather per step, 3: two all-gathers + a reduce-scatter per micro-batch) and the "
                             "AdamW step; also sets the sync (step for 0/1, micro for 2/3). Default: not modelled "
                             "(compute only, the upper bound of a speed-up)")
    parser.add_argument("--comm-overlap", type=fraction, default=0.0, metavar="F",
                        help="with --zero-stage: share 0..1 of the per-micro-batch collectives hidden behind "
                             "compute (DeepSpeed overlap_comm); default 0, all exposed (the pessimistic bound)")
    parser.add_argument("--pcie-gbps", type=positive_float, default=DEFAULT_PCIE_GBPS,
                        help="host <-> GPU GB/s per GPU: the activation offload of groups that use it, and ZeRO "
                             f"offload (default {DEFAULT_PCIE_GBPS:g})")
    parser.add_argument("--hbm-gbps", type=positive_float, default=DEFAULT_HBM_GBPS,
                        help="with --zero-stage: GPU memory bandwidth in GB/s for the memory-bound optimizer step "
                             f"(~32 bytes per parameter updated; default {DEFAULT_HBM_GBPS:g}, H100 SXM)")


def sim_config_from_args(args, sync=None) -> SimConfig:
    """The SimConfig the link, checkpoint and communication options ask for (UserError names the field)."""
    if args.zero_stage is None and args.comm_overlap != 0.0:
        print("note: --comm-overlap has no effect without --zero-stage", file=sys.stderr)
    return SimConfig(args.intra_node_gbps, args.inter_node_gbps, args.gpus_per_node, args.ckpt_layers, sync,
                     zero_stage=args.zero_stage, comm_overlap=args.comm_overlap, hbm_gbps=args.hbm_gbps,
                     pcie_gbps=getattr(args, "pcie_gbps", DEFAULT_PCIE_GBPS))


def cost_model_from_args(args, records: list, what: str, unknown: str) -> tuple[CostModel, str | None]:
    """(the CostModel the options ask for, a warning line or None); UserError with a one-line message on bad input.
    ``records``: the model records (or None) of the plans (model_record.plan_model) or of --model, ``what`` names
    them: the shape is --model-shape, else the recorded model's, else the calibration's own. The warning says when
    it is not the recorded model (model_record.cost_shape) or that no model is known (``unknown`` says why); the
    caller prints it with its results, so that a run stopped by bad input prints its one error line only."""
    shape, warning = cost_shape(args.model_shape, records, what)
    if args.analytic:
        model = CostModel.analytic(shape or "llama3-8b", args.peak_tflops, args.efficiency)
    else:
        model = CostModel.from_calibration(args.calibration, shape)
    if getattr(args, "ckpt_layers", 0) > model.shape.num_layers:
        raise UserError(f"--ckpt-layers {args.ckpt_layers} exceeds the {model.shape.num_layers} layers of model "
                        f"shape {model.shape.name}")
    return model, warning or (unrecorded_line(model.shape.name, unknown) if shape is None else None)
