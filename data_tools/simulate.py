"""Simulator CLI: predicted (SIMULATED) training time of one or more plan.json files, and speed-ups.

    python -m data_tools.simulate --plan hbp.json [--calibration FILE] [--model-shape llama3-8b]
        [--intra-node-gbps 200] [--inter-node-gbps 40] [--gpus-per-node 8] [--zero-stage 2 --comm-overlap 0]
        [--out report.json] [--plot sim.png]
    python -m data_tools.simulate --plan isf.json --plan hbp.json ...     # speed-ups over the first plan

For every plan: every pack's predicted time (hbp_train.perf.cost_model), per micro-batch slot each replica's time and
the slot time (the slowest replica: ZeRO-2/3 synchronise every micro-batch), the idle fraction, the total time
and the speed-up. One plan is compared with isf planned here on the same lengths, world size, largest group, step
budget and seed (as data_tools.compare does); several plans with the first. By default compute only (an upper
bound of the speed-up); --zero-stage adds ZeRO's collectives and the optimizer step (--comm-overlap 0: all
exposed, the pessimistic bound); a calibration with fitted step costs (hbp_train.perf.step_costs) adds what a step
costs besides its packs, so the times are absolute. Times print with the unit that shows them (µs to h). Nothing
runs on a GPU: every figure is a model prediction (docs/simulator.md).

The shape costed: --model-shape, else the model the plan records (hbp-pack --model), else the calibration's own
(the shipped one: a Llama-3-8B layer); a shape that is not the plan's model is named in one warning line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hbp_train.common.cli import (ArgumentParser, existing_file, existing_path, float_range, fraction, nonneg_int,
                           output_file, positive_float, positive_int)
from hbp_train.common.errors import EXIT_USER_ERROR, UserError
from hbp_train.common.outputs import check_output_file, interrupted, write_output
from hbp_train.perf.cost_model import DEFAULT_INTER_NODE_GBPS, DEFAULT_INTRA_NODE_GBPS, DEFAULT_PCIE_GBPS, CostModel
from hbp_train.perf.shape import MODEL_SHAPES
from hbp_train.planning.simulator import DEFAULT_HBM_GBPS, SimConfig


def add_cost_model_args(parser: argparse.ArgumentParser) -> None:
    """The cost-model options shared by simulate, compare and pack."""
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


def comm_columns(config) -> list[tuple[str, str, str]]:
    """Table columns for the communication model: none when it is not modelled."""
    if config.zero_stage is None:
        return []
    return [("zero_stage", "ZeRO", "d"), ("comm_seconds_per_step", "comm/step", "time"),
            ("optimizer_seconds_per_step", "opt/step", "time")]


def cost_model_from_args(args, records: list, what: str, unknown: str) -> tuple[CostModel, str | None]:
    """(the CostModel the options ask for, a warning line or None); UserError with a one-line message on bad input.
    ``records``: the model records (or None) of the plans (model_record.plan_model) or of --model, ``what`` names
    them: the shape is --model-shape, else the recorded model's, else the calibration's own. The warning says when
    it is not the recorded model (model_record.cost_shape) or that no model is known (``unknown`` says why); the
    caller prints it with its results, so that a run stopped by bad input prints its one error line only."""
    from data_tools.model_record import cost_shape, unrecorded_line

    shape, warning = cost_shape(args.model_shape, records, what)
    if args.analytic:
        model = CostModel.analytic(shape or "llama3-8b", args.peak_tflops, args.efficiency)
    else:
        model = CostModel.from_calibration(args.calibration, shape)
    if getattr(args, "ckpt_layers", 0) > model.shape.num_layers:
        raise UserError(f"--ckpt-layers {args.ckpt_layers} exceeds the {model.shape.num_layers} layers of model "
                        f"shape {model.shape.name}")
    return model, warning or (unrecorded_line(model.shape.name, unknown) if shape is None else None)


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m data_tools.simulate", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plan", action="append", required=True, metavar="PLAN_JSON", type=existing_path,
                   help="a plan.json (from data_tools.pack), or a --shards folder holding one; repeat to compare, "
                        "the first is the baseline (required)")
    p.add_argument("--name", action="append", default=None,
                   help="label for each --plan, in order (default: the plan's strategy and file name)")
    add_cost_model_args(p)
    add_link_args(p)
    p.add_argument("--sync", choices=["micro", "step"], default=None,
                   help="synchronisation model: micro = ZeRO-2/3 (slowest replica per micro-batch), step = "
                        "ZeRO-0/1 (slowest replica per step); default: from --zero-stage when given, else step for "
                        "plans with unequal micro-batch counts (bytescale), micro otherwise")
    add_comm_args(p)
    p.add_argument("--out", default=None, metavar="REPORT_JSON", type=output_file,
                   help="write the report (summary per plan, and every slot's replica times) to this JSON file; an "
                        "existing file is replaced only if it is such a report (default: no report)")
    p.add_argument("--plot", default=None, metavar="PNG", type=output_file,
                   help="write a comparison plot (PNG; an existing image is replaced) (default: no plot)")
    p.add_argument("--show-slots", type=nonneg_int, default=3, metavar="N",
                   help="print each replica's time for the first N slots of every plan (default 3)")
    return p


def load_plan(path: str):
    """Plan.from_json with one-line errors (UserError naming the file)."""
    from hbp_train.planning.metrics import with_metrics
    from hbp_train.planning.plan import Plan

    p = Path(path)
    if p.is_dir():  # a --shards folder: use its plan
        if not (p / "plan.json").is_file():
            raise UserError(f"{path}: is a folder with no plan.json; pass a plan file from python -m data_tools.pack")
        p = p / "plan.json"
        path = str(p)
    if not p.is_file():
        raise UserError(f"{path}: no such plan file")
    try:
        with open(p) as f:
            data = json.load(f)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: invalid JSON at line {exc.lineno} ({exc.msg})") from None
    except UnicodeDecodeError:
        raise UserError(f"{path}: not UTF-8 text; pass a plan file from python -m data_tools.pack") from None
    except OSError as exc:
        raise UserError(f"{path}: cannot read ({exc.strerror})") from None
    if not isinstance(data, dict) or "steps" not in data or "groups" not in data:
        raise UserError(f"{path}: not a plan (no 'steps'/'groups'); make one with python -m data_tools.pack")
    if "lengths" not in data:
        raise UserError(f"{path}: the plan has no 'lengths' (written by data_tools.pack); re-run the planner")
    try:
        return with_metrics(Plan.from_dict(data))
    except UserError as exc:  # the plan's own checks (version, world size, groups): name the file
        raise UserError(f"{path}: {exc}") from None
    # Fields of the wrong shape in the file: int("x") (ValueError), a missing key, a number where a list goes.
    except (KeyError, TypeError, IndexError, ValueError) as exc:
        raise UserError(f"{path}: malformed plan ({type(exc).__name__}: {exc})") from None


def format_seconds(seconds: float) -> str:
    """A duration with 3 significant digits in the unit that shows it: µs, ms, s, min or h (a tiny model's step
    is microseconds, an 8B model's run hours: one fixed unit would print 0.000 for one of them)."""
    if seconds == 0:
        return "0 s"
    for unit, scale, below in (("µs", 1e-6, 1e-3), ("ms", 1e-3, 1.0), ("s", 1.0, 120.0), ("min", 60.0, 7200.0)):
        if abs(seconds) < below:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 3600:.3g} h"


def format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """A fixed-width text table; columns are (key, header, format), format "time" for seconds (format_seconds)."""
    def cell(value, f):
        if value is None:
            return "-"
        return format_seconds(value) if f == "time" else format(value, f)

    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append([cell(r.get(k), f) for k, _, f in columns])
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c[i].rjust(widths[i]) if i else c[i].ljust(widths[i]) for i in range(len(columns)))
             for c in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


SIM_COLUMNS = [("name", "plan", "s"), ("strategy", "strategy", "s"), ("num_steps", "steps", "d"),
               ("num_slots", "slots", "d"), ("sync", "sync", "s"), ("simulated_seconds", "sim time", "time"),
               ("idle_fraction", "idle", ".3f"), ("simulated_tokens_per_second", "sim tok/s", ".4g"),
               ("speedup", "speed-up", ".3f")]


def describe_groups(plan) -> str:
    """A plan's groups with their levers, as hbp-pack's --groups writes them (pack_len:sp:ckpt_layers[:levers]),
    and the ZeRO stage it was made for."""
    from hbp_train.perf.cost_model import group_levers

    parts = []
    for g in plan.config.groups:
        levers = "+".join(n for n, on in zip(("tiled_mlp", "offload"), group_levers(g)) if on)
        ckpt = "-" if g.ckpt_layers is None else g.ckpt_layers
        parts.append(f"{g.pack_len}:{g.sp}:{ckpt}" + (f":{levers}" if levers else ""))
    stage = plan.extra.get("zero_stage")
    return ", ".join(parts) + (f" (made for ZeRO-{stage})" if stage is not None else "")


def isf_baseline(plan):
    """isf planned on ``plan``'s lengths with its world size, largest group, step budget, curriculum and seed: what
    the plan is compared with when it is simulated alone (data_tools.compare's baseline)."""
    from dataclasses import replace

    from hbp_train.planning import make_plan

    return make_plan(plan.lengths, replace(plan.config, strategy="isf", pack_cost=None, progress=False))


def main(argv=None) -> int:
    try:
        return run(argv)
    except UserError as exc:  # bad flags, plan files or output paths
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:  # outputs are written to a temporary name and moved into place when complete
        return interrupted("simulate", "outputs not yet complete (--out, --plot) were left as they were")


def run(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from hbp_train.planning.baselines.bytescale import check_zero_stage
    from hbp_train.planning.simulator import plot_comparison, simulate, speedup

    if args.name and len(args.name) != len(args.plan):
        raise UserError(f"--name given {len(args.name)} times for {len(args.plan)} --plan files")
    from data_tools.model_record import describe, plan_model

    plans = [load_plan(p) for p in args.plan]
    planned = sorted({p.extra["zero_stage"] for p in plans if p.extra.get("zero_stage") is not None})
    if args.zero_stage is None and len(planned) == 1 and args.sync is None:
        args.zero_stage = int(planned[0])  # the stage the plan was made for (hbp-pack records it)
        print(f"ZeRO stage: {args.zero_stage}, the plan's (its zero_stage; --zero-stage to simulate another)")
    sim_cfg = sim_config_from_args(args, args.sync)
    if sim_cfg.zero_stage is not None:
        for path, plan in zip(args.plan, plans):
            try:
                check_zero_stage(plan, sim_cfg.zero_stage)
            except UserError as exc:
                raise UserError(f"{path}: {exc}") from None
    check_output_file("--out", args.out, json_key="simulated", kind="simulation report")
    check_output_file("--plot", args.plot, image=True)
    records = [plan_model(p) for p in plans]
    model, warning = cost_model_from_args(args, records, ", ".join(args.plan),
                                          f"{'the plans record' if len(plans) > 1 else 'the plan records'} no model")
    if args.model_shape is None and any(records):  # the shape costed is the plan's own model's
        print(f"model: {describe(next(r for r in records if r))}, recorded in the plan (hbp-pack --model)")
    for path, plan in zip(args.plan, plans):
        over = sorted({g.ckpt_layers for g in plan.config.groups
                       if g.ckpt_layers is not None and g.ckpt_layers > model.shape.num_layers})
        if over:
            print(f"note: {path}: groups with ckpt_layers {over} are simulated with all {model.shape.num_layers} "
                  f"layers of {model.shape.name} checkpointed (the plan was made for a deeper model?)",
                  file=sys.stderr)
    names = list(args.name or [f"{pl.config.strategy}:{Path(p).name}" for pl, p in zip(plans, args.plan)])
    files = list(args.plan)
    if len(plans) == 1:  # alone, a plan is its own baseline (speed-up 1): compare it with isf on its lengths
        plans.insert(0, isf_baseline(plans[0]))
        names.insert(0, "isf (planned here)")
        files.insert(0, None)
    results, rows = [], []
    for name, plan in zip(names, plans):
        t0 = time.perf_counter()
        res = simulate(plan, model, sim_cfg)
        res.extra["simulate_seconds"] = time.perf_counter() - t0
        results.append(res)
    for name, plan, res in zip(names, plans, results):
        rows.append({"name": name, "strategy": plan.config.strategy, **res.summary(),
                     "speedup": speedup(results[0], res)})
    if len({r["tokens"] for r in rows}) > 1:
        print("note: the plans train different token counts (dropped samples differ); speed-up compares simulated "
              "tokens/s", file=sys.stderr)
    if warning:
        print(warning, file=sys.stderr)
    print(f"SIMULATED with cost model: {model.source} ({model.note}); shape {model.shape.name}; links "
          f"{args.intra_node_gbps:g}/{args.inter_node_gbps:g} GB/s intra/inter, {args.gpus_per_node} GPUs/node; "
          f"{sim_cfg.comm_model()}; {model.step_costs.note()}")
    if files[0] is None:
        base = plans[0].config
        print(f"baseline: isf planned here on the plan's {plans[0].num_samples} lengths (W={base.world_size}, pack "
              f"length {base.groups[-1].pack_len}, the plan's step budget and seed)")
    for row in rows:
        row["zero_stage"] = sim_cfg.zero_stage
    print(format_table(rows, SIM_COLUMNS[:-3] + comm_columns(sim_cfg) + SIM_COLUMNS[-3:]))
    for name, plan in zip(names, plans):
        print(f"  {name} groups: {describe_groups(plan)}")
    for name, res in zip(names, results):
        for s in res.slots(args.show_slots):
            print(f"  {name} step {s['step']} slot {s['slot']}: replicas "
                  f"{', '.join(format_seconds(x) for x in s['replica_seconds'])} -> slot "
                  f"{format_seconds(s['slot_seconds'])}")
    if args.out:
        report = {"simulated": True, "cost_model": model.describe(),
                  "links": {"intra_node_gbps": args.intra_node_gbps, "inter_node_gbps": args.inter_node_gbps,
                            "gpus_per_node": args.gpus_per_node, "ckpt_layers_default": args.ckpt_layers},
                  "comm": {"model": sim_cfg.comm_model(), "zero_stage": sim_cfg.zero_stage,
                           "comm_overlap": sim_cfg.comm_overlap, "hbm_gbps": sim_cfg.hbm_gbps},
                  "baseline": names[0],
                  "plans": [{**row, "file": p, "slots": res.slots()} for row, p, res in zip(rows, files, results)]}
    if args.out:
        write_output("--out", args.out, lambda path: path.write_text(json.dumps(report)))
        print(f"wrote {args.out}")
    if args.plot:
        write_output("--plot", args.plot, lambda path: plot_comparison(names, results, path,
                                                              f"{model.source} cost model, {model.shape.name}"))
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
