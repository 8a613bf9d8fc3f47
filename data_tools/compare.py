"""Compare every planning strategy on the same lengths: plan metrics, planning time, SIMULATED time, speed-up.

    python -m data_tools.compare --lengths lengths.txt --max-len 131072 --world-size 32 \\
        --groups 16384:1,131072:8 [--calibration FILE] [--plot cmp.png] [--out cmp.json]
    python -m data_tools.compare --lengths lengths.txt --world-size 8 --groups auto --profile profile.json

Plans the lengths with each strategy (isf, sorted, hbp, hbp-cost = hbp balancing predicted pack time from the
cost model instead of Σ len², wlb, bytescale), simulates each plan with the cost model (data_tools.simulate's
model; nothing runs on a GPU) and prints one row per strategy with the speed-up over isf. bytescale is simulated
with one synchronisation per step (ZeRO-0/1, the only stages it may run with); every other plan with one per
micro-batch (ZeRO-2/3).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import numpy as np

from data_tools.simulate import (add_cost_model_args, add_link_args, check_writable, cost_model_from_args,
                                 format_table, write_outputs)

STRATEGIES = ("isf", "sorted", "hbp", "hbp-cost", "wlb", "bytescale")

COLUMNS = [("name", "strategy", "s"), ("ABR", "ABR", ".4f"), ("DBR", "DBR", ".4f"), ("PR", "PR", ".4f"),
           ("CR", "CR", ".3f"), ("num_steps", "steps", "d"), ("num_slots", "slots", "d"), ("planning_seconds", "plan s", ".2f"),
           ("mean_deferred_wait_steps", "wait", ".2f"), ("sync", "sync", "s"),
           ("simulated_hours", "sim hours", ".3f"), ("idle_fraction", "idle", ".3f"),
           ("speedup", "speed-up", ".3f")]


def compare_strategies(lengths: np.ndarray, plan_kwargs: dict, model, sim_config, strategies=STRATEGIES,
                       progress: bool = True) -> tuple[list[dict], dict]:
    """Plan and simulate ``lengths`` with every strategy. Returns (rows, {name: (plan, SimResult)}).

    ``plan_kwargs``: PlanConfig fields except strategy and pack_cost. The speed-up is over isf when it is among
    the strategies, else over the first one.
    """
    from tqdm import tqdm

    from hbp_train.cost_model import pack_cost_fn
    from hbp_train.planning import PlanConfig, make_plan
    from hbp_train.planning.simulate import SimConfig, simulate, speedup

    cost = pack_cost_fn(model, sim_config.ckpt_layers, sim_config.intra_node_gbps, sim_config.inter_node_gbps,
                        sim_config.gpus_per_node)
    out = {}
    for name in tqdm(strategies, desc="strategies", disable=not progress):
        strategy = "hbp" if name == "hbp-cost" else name
        # wlb and bytescale balance a workload; give them the same cost model the simulator uses.
        use_cost = name in ("hbp-cost", "wlb", "bytescale")
        cfg = PlanConfig(strategy=strategy, pack_cost=cost if use_cost else None, **plan_kwargs)
        t0 = time.perf_counter()
        plan = make_plan(lengths, cfg)
        planning = time.perf_counter() - t0
        sync = "step" if plan.unequal_micro_batches else "micro"
        res = simulate(plan, model, SimConfig(sim_config.intra_node_gbps, sim_config.inter_node_gbps,
                                              sim_config.gpus_per_node, sim_config.ckpt_layers, sync))
        res.extra["planning_seconds"] = planning
        out[name] = (plan, res)
    base = out["isf"][1] if "isf" in out else next(iter(out.values()))[1]
    rows = []
    for name, (plan, res) in out.items():
        m = plan.metrics
        rows.append({"name": name, **{k: m.get(k) for k in ("ABR", "DBR", "PR", "CR", "num_dropped")},
                     "mean_deferred_wait_steps": m.get("mean_deferred_wait_steps") if plan.deferred else None,
                     "num_deferred": m.get("num_deferred", 0), **res.summary(), "speedup": speedup(base, res)})
    return rows, out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m data_tools.compare", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", metavar="FILE", help="one token length per line (or a .npy array)")
    src.add_argument("--dataset", metavar="DIR", help="tokenized dataset (data_tools.preprocess); its 'length' column")
    p.add_argument("--max-len", type=int, default=None,
                   help="longest sample length (default: the largest pack_len); longer samples are dropped")
    p.add_argument("--world-size", type=int, required=True, help="number of GPUs W")
    p.add_argument("--groups", required=True,
                   help="ascending pack_len:sp[:ckpt_layers] list, e.g. 16384:1,131072:8; single-group strategies "
                        "use the last group")
    p.add_argument("--profile", default=None, metavar="FILE",
                   help="with --groups auto: the profiler's JSON (python -m hbp_train.profile)")
    p.add_argument("--global-tokens", type=int, default=4 * 1024 * 1024, help="target tokens per optimizer step "
                   "(default 4194304)")
    p.add_argument("--seed", type=int, default=0, help="planning seed (default 0)")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"comma-separated subset of {', '.join(STRATEGIES)} (default: all)")
    add_cost_model_args(p)
    add_link_args(p)
    p.add_argument("--plot", default=None, metavar="PNG", help="write the comparison plot (PNG)")
    p.add_argument("--out", default=None, metavar="JSON", help="write the table (and settings) as JSON")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from data_tools.pack import CliError, parse_groups, read_dataset_lengths, read_lengths
    from hbp_train.planning.simulate import SimConfig, plot_comparison

    try:
        strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
        bad = [s for s in strategies if s not in STRATEGIES]
        if bad or not strategies:
            raise ValueError(f"--strategies: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(STRATEGIES)}")
        groups = parse_groups(args.groups, args.profile, args.world_size)
        model = cost_model_from_args(args)
        sim_cfg = SimConfig(args.intra_node_gbps, args.inter_node_gbps, args.gpus_per_node, args.ckpt_layers)
        lengths = read_lengths(args.lengths) if args.lengths else read_dataset_lengths(args.dataset)
        if len(lengths) == 0:
            raise ValueError(f"{args.lengths or args.dataset}: no samples")
        plan_kwargs = dict(world_size=args.world_size, groups=groups, global_tokens=args.global_tokens,
                           max_len=args.max_len, seed=args.seed)
        from hbp_train.planning import PlanConfig

        PlanConfig(**plan_kwargs)  # validate the settings before the long part
        check_writable(args.out)
        check_writable(args.plot)
    except (ValueError, CliError) as exc:
        print(f"compare: error: {exc}", file=sys.stderr)
        return 2
    rows, out = compare_strategies(lengths, plan_kwargs, model, sim_cfg, strategies, progress=not args.quiet)
    print(f"{len(lengths)} samples, W={args.world_size}, groups {args.groups}; SIMULATED with cost model "
          f"{model.source} ({model.note}), shape {model.shape.name}")
    print(format_table(rows, COLUMNS))
    try:
        if args.out:
            write_outputs(args.out, lambda path: path.write_text(json.dumps(
                {"simulated": True, "cost_model": model.describe(), "settings": {**vars(args)}, "rows": rows},
                indent=1)))
            print(f"wrote {args.out}")
        if args.plot:
            names = sorted(out, key=lambda n: n != "isf")  # the plot's speed-ups are over its first plan
            title = f"{len(lengths)} samples, W={args.world_size}, groups {args.groups}, {model.source} cost model"
            write_outputs(args.plot, lambda path: plot_comparison(names, [out[n][1] for n in names], path, title))
            print(f"wrote {args.plot}")
    except ValueError as exc:
        print(f"compare: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
