"""Compare every planning strategy on the same lengths: plan metrics, planning time, SIMULATED time, speed-up.

    python -m data_tools.compare --lengths lengths.txt --max-len 131072 --world-size 32 \\
        --groups 16384:1,131072:8 [--calibration FILE] [--plot cmp.png] [--out cmp.json]
    python -m data_tools.compare --lengths lengths.txt --world-size 8 --groups auto --profile profile.json

Plans the lengths with each strategy (isf, bfd, sorted, kk = veRL's Karmarkar-Karp on 24576·s + s², kk-cost = kk
on the cost model's predicted time, hbp, hbp-cost = hbp balancing predicted pack time from the cost model instead
of Σ len², wlb, bytescale), every one to the same optimizer steps of the same real tokens (--global-tokens),
simulates each plan with the cost model (data_tools.simulate's model; nothing runs on a GPU) and prints one row per
strategy with the speed-up over isf AND over the best baseline users run (the fastest of isf, bfd, sorted, kk and
kk-cost in this same run: beating the weak isf alone proves little), then one line naming that baseline and hbp's
speed-up over it. bytescale is simulated
with one synchronisation per step (ZeRO-0/1, the only stages it may run with); every other plan with one per
micro-batch (ZeRO-2/3). By default compute only (an upper bound of the speed-ups); --zero-stage S adds ZeRO's
collectives and the optimizer step (bytescale at stage 1 when S is 2 or 3), --comm-overlap F hides a share of the
per-micro-batch collectives (0: the pessimistic bound).
"""

from __future__ import annotations

import argparse
import json
import sys

from data_tools.packing.groups import parse_groups
from data_tools.packing.lengths import read_dataset_lengths, read_lengths, warn_if_longer_than_max_len
from data_tools.packing.model_record import check_sp_degrees, read_model
from data_tools.simulation.options import (add_comm_args, add_cost_model_args, add_link_args, cost_model_from_args,
                                           sim_config_from_args)
from data_tools.simulation.strategies import STRATEGIES, best_baseline_line, compare_strategies, table_columns
from data_tools.simulation.tables import format_table
from hbp_train.common.cli import (ArgumentParser, existing_dir, existing_file, existing_path, nonneg_int, output_file,
                                  positive_int)
from hbp_train.common.errors import EXIT_USER_ERROR, UserError
from hbp_train.common.outputs import check_output_file, interrupted, write_output

# The command line: its flags, their checks, what it prints and writes; simulation/strategies.py plans and simulates.


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m data_tools.compare", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", metavar="FILE", type=existing_file,
                     help="one token length per line (or a .npy array) (this or --dataset "
                     "is required)")
    src.add_argument("--dataset", metavar="DIR", type=existing_dir,
                     help="tokenized dataset (data_tools.preprocess); its 'length' column "
                     "(this or --lengths is required)")
    p.add_argument("--max-len", type=positive_int, default=None,
                   help="longest sample length the data may have, as in data_tools.pack (default: the largest "
                        "pack_len); samples beyond it are warned about, and only those longer than the largest "
                        "pack_len are dropped")
    p.add_argument("--world-size", type=positive_int, required=True, help="number of GPUs W (required)")
    p.add_argument("--groups", required=True,
                   help="ascending pack_len:sp[:ckpt_layers[:levers]] list, e.g. 16384:1,131072:8 (as "
                        "data_tools.pack --groups); single-group strategies use the last group; 'auto' reads them "
                        "from --profile (required)")
    p.add_argument("--profile", default=None, metavar="FILE", type=existing_file,
                   help="with --groups auto: the profiler's JSON (python -m hbp_train.profiler) (default: none; "
                        "--groups auto needs it)")
    p.add_argument("--global-tokens", type=positive_int, default=4 * 1024 * 1024,
                   help="real tokens per optimizer step: every strategy makes round(T / G) steps (default 4194304)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="planning seed (default 0)")
    p.add_argument("--model", metavar="DIR", default=None, type=existing_path,
                   help="the model to be trained: its local HF folder (or config.json); refuses SP degrees that cannot "
                        "split its heads and costs its shape (default: --model-shape, else the calibration's own, "
                        "said in a warning)")
    p.add_argument("--strategies", default=",".join(STRATEGIES),
                   help=f"comma-separated subset of {', '.join(STRATEGIES)} (default: all)")
    add_cost_model_args(p)
    add_link_args(p)
    add_comm_args(p)
    p.add_argument("--plot", default=None, metavar="PNG", type=output_file,
                   help="write the comparison plot (PNG; an existing image is replaced) (default: no plot)")
    p.add_argument("--out", default=None, metavar="JSON", type=output_file,
                   help="write the table (and settings) as JSON; an existing file is replaced only if it is such a "
                        "report (default: none)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def main(argv=None) -> int:
    try:
        return run(argv)
    except UserError as exc:  # bad flags, input files, settings or output paths
        print(f"compare: error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:  # outputs are written to a temporary name and moved into place when complete
        return interrupted("compare", "outputs not yet complete (--out, --plot) were left as they were")


def run(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from hbp_train.planning import PlanConfig
    from hbp_train.planning.simulator import plot_comparison

    strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    bad = [s for s in strategies if s not in STRATEGIES]
    if bad or not strategies:
        raise UserError(f"--strategies: unknown {', '.join(bad) or '(empty)'}; choose from {', '.join(STRATEGIES)}")
    groups = parse_groups(args.groups, args.profile, args.world_size)
    record = None
    if args.model:
        record = read_model(args.model)
        check_sp_degrees(record, groups, "--groups" if args.groups != "auto" else f"--profile {args.profile}:")
    model, warning = cost_model_from_args(args, [record], "--model", "no --model given")
    sim_cfg = sim_config_from_args(args)
    lengths = read_lengths(args.lengths) if args.lengths else read_dataset_lengths(args.dataset)
    if len(lengths) == 0:
        raise UserError(f"{args.lengths or args.dataset}: no samples")
    warn_if_longer_than_max_len(lengths, args.max_len, groups[-1].pack_len)
    plan_kwargs = dict(world_size=args.world_size, groups=groups, global_tokens=args.global_tokens,
                       max_len=args.max_len, seed=args.seed)
    PlanConfig(**plan_kwargs)  # validate the settings before the long part
    check_output_file("--out", args.out, json_key="simulated", kind="comparison report")
    check_output_file("--plot", args.plot, image=True)
    rows, out = compare_strategies(lengths, plan_kwargs, model, sim_cfg, strategies, progress=not args.quiet)
    if warning:  # with the results: a run stopped by bad input prints its one error line only
        print(warning, file=sys.stderr)
    print(f"{len(lengths)} samples, W={args.world_size}, groups {args.groups}; SIMULATED with cost model "
          f"{model.source} ({model.note}), shape {model.shape.name}; {sim_cfg.comm_model()}")
    if any(r["zero_stage"] != sim_cfg.zero_stage for r in rows):
        print("note: bytescale (unequal micro-batch counts) can only run with ZeRO 0/1: simulated at ZeRO-1",
              file=sys.stderr)
    print(format_table(rows, table_columns(sim_cfg)))
    print(best_baseline_line(rows))
    if args.out:
        write_output("--out", args.out, lambda path: path.write_text(json.dumps(
            {"simulated": True, "cost_model": model.describe(), "settings": {**vars(args)}, "rows": rows},
            indent=1)))
        print(f"wrote {args.out}")
    if args.plot:
        names = sorted(out, key=lambda n: n != "isf")  # the plot's speed-ups are over its first plan
        title = f"{len(lengths)} samples, W={args.world_size}, groups {args.groups}, {model.source} cost model"
        write_output("--plot", args.plot, lambda path: plot_comparison(names, [out[n][1] for n in names], path, title))
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
