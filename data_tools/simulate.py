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

from data_tools.packing.model_record import describe, plan_model
from data_tools.simulation.options import (add_comm_args, add_cost_model_args, add_link_args, cost_model_from_args,
                                           sim_config_from_args)
from data_tools.simulation.plans import describe_groups, isf_baseline, load_plan
from data_tools.simulation.tables import comm_columns, format_seconds, format_table
from hbp_train.common.cli import ArgumentParser, existing_path, nonneg_int, output_file
from hbp_train.common.errors import EXIT_USER_ERROR, UserError
from hbp_train.common.outputs import check_output_file, interrupted, write_output

# The command line: its flags, their checks, what it prints and writes; the plans read, the options shared with
# compare and the tables are in data_tools/simulation/, the simulator itself in hbp_train/planning/simulator.py.


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


SIM_COLUMNS = [("name", "plan", "s"), ("strategy", "strategy", "s"), ("num_steps", "steps", "d"),
               ("num_slots", "slots", "d"), ("sync", "sync", "s"), ("simulated_seconds", "sim time", "time"),
               ("idle_fraction", "idle", ".3f"), ("simulated_tokens_per_second", "sim tok/s", ".4g"),
               ("speedup", "speed-up", ".3f")]


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
