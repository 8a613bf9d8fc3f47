"""Planner CLI: sample lengths (or a tokenized dataset) -> plan.json, optionally packed shards and a plot.

    python -m data_tools.pack --lengths lengths.txt --max-len 131072 --world-size 32 \\
        --groups 16384:1,131072:8 --strategy hbp --global-tokens 4194304 --out plan.json --plot plan.png

    python -m data_tools.pack --dataset tokenized/ --shards packed/ --world-size 8 --groups 4096:1,16384:4 \\
        --model my-model/

With --model (the folder of the model to be trained) the groups' SP degrees are checked against the model's heads
and the plan records the model (data_tools/packing/model_record.py), whose shape the simulator then costs.

Without --global-tokens the step size comes from the data (about 100 optimizer steps, at most 4,194,304 tokens
each, at least one pack of every group per replica); a plan of fewer than 10 optimizer steps is warned about.
Prints a metrics table; for hbp also the isf baseline on the same lengths (a metric that compares nothing for a
plan, e.g. the balance of one replica, reads n/a; data_tools/packing/report.py). Bad input: one line, exit code 2.
The planning itself lives in hbp_train/planning (pure numpy), the packed shards' writer in hbp_train/batches; this
file is the command line (its flags, the checks that name them, what it prints) over data_tools/packing/ (the
lengths read, the groups parsed, the model recorded, the report printed).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from data_tools.packing.groups import CliError, parse_groups, planned_zero_stage
from data_tools.packing.lengths import read_dataset_lengths, read_lengths, warn_if_longer_than_max_len
from data_tools.packing.report import metrics_table, replicas_note, step_line, warn_if_few_steps
from hbp_train.common.cli import (ArgumentParser, existing_dir, existing_file, int_range, nonneg_int, output_dir,
                           output_file, positive_int)
from hbp_train.common.errors import EXIT_USER_ERROR, UserError
from hbp_train.common.library_bars import datasets_bars_off
from hbp_train.common.outputs import check_output_file, interrupted, write_output
from hbp_train.planning.equal_steps import AUTO_MAX_TOKENS, AUTO_STEPS, auto_global_tokens, slot_tokens
from hbp_train.planning.plan_npz import check_binary_plan_target, is_binary_path, save_plan
from hbp_train.batches.vocab import recorded_tokenizer


def build_parser() -> argparse.ArgumentParser:
    from hbp_train.common.cli import existing_path
    from hbp_train.planning.plan import MAX_ISF_ROUNDS

    p = ArgumentParser(
        prog="python -m data_tools.pack",
        description="Plan hierarchical balance packing (hbp) or the naive isf baseline: which samples go into which "
        "pack, which packs each replica runs in each optimizer step. Writes plan.json (docs/architecture.md). "
        "Outputs are written only when complete: Ctrl-C (exit code 130) leaves earlier ones as they were.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--lengths", metavar="FILE", type=existing_file,
                     help="token length of every sample: a text file with one positive integer per line, or a .npy "
                     "array; sample i is line i (this or --dataset is required)")
    src.add_argument("--dataset", metavar="DIR", type=existing_dir,
                     help="tokenized dataset from data_tools.preprocess (HF save_to_disk); its 'length' column is used "
                     "(this or --lengths is required)")
    p.add_argument("--shards", metavar="OUT", type=output_dir,
                   help="with --dataset: also write packed shards to OUT (OUT/plan.json with per-step rows, "
                   "OUT/group_<g>/ one row per pack). OUT must be new, empty or an earlier --shards output, which "
                   "is replaced as a whole once the new set is complete (default: no shards)")
    p.add_argument("--max-len", type=positive_int, default=None,
                   help="longest sample length the data may have (the preprocess max_len); must not exceed the "
                   "largest group's pack_len (default: the largest pack_len)")
    p.add_argument("--world-size", type=positive_int, required=True, help="number of GPUs (ranks) W (required)")
    p.add_argument("--groups", required=True,
                   help="ascending pack_len:sp[:ckpt_layers[:levers]] groups, comma separated, e.g. "
                   "16384:1,131072:8:32:tiled_mlp+offload; sp is a power of two dividing W; levers: tiled_mlp, "
                   "offload (needs ckpt_layers > 0) joined by '+', '-' for none (docs/memory_levers.md); samples "
                   "longer than the last pack_len are dropped. 'auto' reads them from --profile (required)")
    p.add_argument("--profile", metavar="FILE", type=existing_file,
                   help="with --groups auto: the profiler's JSON, {\"groups\": [{\"pack_len\", \"sp\", \"ckpt_layers\"}]} "
                   "(default: none; --groups auto needs it)")
    p.add_argument("--strategy", choices=["hbp", "isf", "bfd", "sorted", "wlb", "bytescale", "kk"], default="hbp",
                   help="hbp = hierarchical balance packing; isf = naive packing into the largest pack_len; bfd = "
                   "best-fit decreasing into the largest pack_len (TRL / ms-swift packing); sorted = "
                   "LongAlign sorted batching; wlb = WLB-LLM workload-balanced packing with outlier delay; bytescale "
                   "= more micro-batches for lighter replicas (needs ZeRO stage 0/1, see --zero-stage); kk = veRL's "
                   "Karmarkar-Karp partition of every step's samples across the replicas (default hbp)")
    p.add_argument("--calibration", metavar="FILE", type=existing_file, default=None,
                   help="balance predicted pack time from this cost-model calibration (hbp_train.perf.calibrate JSON) "
                   "instead of sum of len^2 (default: sum of len^2; wlb/bytescale use the shipped calibration, kk "
                   "veRL's 24576*s + s^2)")
    p.add_argument("--model", metavar="DIR", default=None, type=existing_path,
                   help="the model the plan is for: its local HF folder (or config.json). Refuses SP degrees that "
                   "cannot split its heads, records it in the plan (hbp-simulate then costs its shape) and, with "
                   "--calibration, balances on its shape (default: none recorded)")
    p.add_argument("--model-shape", default=None, metavar="SHAPE",
                   help="with --calibration: model shape preset (llama3-8b, llama3.2-1b, ...) or JSON (default: "
                   "--model's shape, else the calibration's own)")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2, 3], default=None,
                   help="the ZeRO stage the plan will be trained with, recorded in the plan (zero_stage: training "
                   "refuses another deepspeed.zero_stage); bytescale is refused for stages 2/3 (they reduce gradients "
                   "every micro-batch, docs/simulator.md). With --groups auto the profile's chosen stage is recorded "
                   "and --zero-stage must agree with it (default: the profile's, else none recorded)")
    p.add_argument("--global-tokens", type=positive_int, default=None,
                   help="tokens per optimizer step G: real tokens with --step-tokens real (every strategy then makes "
                   "round(T / G) optimizer steps for T tokens), pack capacity with --step-tokens capacity "
                   f"(default: from the data, T / {AUTO_STEPS} for about {AUTO_STEPS} optimizer steps, at most "
                   f"{AUTO_MAX_TOKENS}, at least one pack of every group per replica)")
    p.add_argument("--step-tokens", choices=["real", "capacity"], default="real",
                   help="what --global-tokens counts: real = real (non-padding) tokens, the same number of optimizer "
                   "steps of the same tokens for every strategy, so a better plan saves time, never updates; "
                   "capacity = pack capacity, m = max(1, round(G / (pack_len * W/sp))) micro-batches per replica, "
                   "so denser packs make fewer, larger steps (default real)")
    p.add_argument("--curriculum-steps", type=nonneg_int, default=0,
                   help="the first K steps use only the shortest group (isf: only packs of short samples) (default 0)")
    p.add_argument("--seed", type=nonneg_int, default=0, help="seed (>= 0) for all shuffles; same inputs + seed = same "
                   "plan (default 0)")
    p.add_argument("--balance", choices=["refine", "sort"], default="refine",
                   help="hbp slot balancing: sort = paper (sort packs by attention cost, chunk); refine = sort, then "
                   "move samples between the packs of a slot to even their cost (default refine)")
    p.add_argument("--step-mix", choices=["mixed", "stratified", "sorted"], default="mixed",
                   help="hbp: how balanced slots become optimizer steps: sorted = consecutive cost-sorted slots of one "
                   "group (the paper; steps homogeneous in length, which costs quality); stratified = one slot of "
                   "each cost stratum of one group; mixed = stratified, and every optimizer step holds slots of "
                   "every group (the trainer switches SP between them) (default mixed)")
    p.add_argument("--isf-rounds", type=int_range(0, MAX_ISF_ROUNDS), default=4,
                   help="isf: shuffle-and-fill rounds before packing leftovers (default 4)")
    p.add_argument("--isf-threshold", type=nonneg_int, default=None,
                   help="isf: keep a pack in a round if it holds >= pack_len - threshold tokens (default: pack_len // 64)")
    p.add_argument("--plan-format", choices=["json", "npz"], default="json",
                   help="with --shards: the plan inside OUT, OUT/plan.json or the compact binary OUT/plan.npz that "
                   "the trainer memory-maps (for millions of samples) (default json)")
    p.add_argument("--out", metavar="FILE", type=output_file,
                   help="where to write the plan (required unless --shards is given): JSON, or the compact binary "
                   "form (memory-mapped CSR arrays, for millions of samples) when it ends in .npz; an existing file "
                   "is replaced only if it is a plan of that form, never other data")
    p.add_argument("--plot", metavar="PNG", type=output_file,
                   help="draw length histogram, per-replica attention cost (isf vs hbp) and ABR (default: no plot)")
    p.add_argument("--no-baseline", action="store_true", help="hbp: skip planning the isf baseline for comparison")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def check_shards_dir(path: str) -> None:
    """--shards must be new, empty or an earlier --shards output (OUT/plan.json): never a folder of other files.

    A re-pack replaces the whole folder, so an earlier output holding anything besides plan.json, checksums.json
    and group_* (say notes someone added) is refused rather than deleted."""
    p = Path(path)
    if p.exists() and not p.is_dir():
        raise CliError(f"--shards {path}: exists and is not a directory; pass a new or empty directory")
    if not p.is_dir() or not any(p.iterdir()):
        return
    plans = ("plan.json", "plan.npz")
    if not any((p / name).is_file() for name in plans):
        raise CliError(f"--shards {path}: directory is not empty and holds no earlier packed shards (plan.json or "
                       "plan.npz); choose a new or empty --shards directory")
    ours = (*plans, "checksums.json")
    other = sorted(x.name for x in p.iterdir() if x.name not in ours and not x.name.startswith("group_"))
    if other:
        raise CliError(f"--shards {path}: holds {other[0]}, which is not part of the packed shards a re-pack "
                       "replaces; move it out or choose another --shards directory")


def run(argv=None) -> int:
    args = build_parser().parse_args(argv)
    from hbp_train.planning import PlanConfig, make_plan

    if args.shards and not args.dataset:
        raise CliError("--shards needs --dataset (the tokens come from the tokenized dataset)")
    if not args.out and not args.shards:
        raise CliError("--out FILE is required (or --shards OUT, which writes OUT/plan.json)")
    if args.out and is_binary_path(args.out):
        check_binary_plan_target(args.out)
        check_output_file("--out", args.out)
    else:
        check_output_file("--out", args.out, json_key="version", kind="plan")
    check_output_file("--plot", args.plot, image=True)
    if args.shards:
        check_shards_dir(args.shards)
    groups = parse_groups(args.groups, args.profile, args.world_size)
    model_record = None
    if args.model:  # before any planning: SP degrees the model's heads cannot be split by fail training later
        from data_tools.packing.model_record import check_sp_degrees, read_model

        model_record = read_model(args.model)
        check_sp_degrees(model_record, groups, "--groups" if args.groups != "auto" else f"--profile {args.profile}:")
    if args.max_len is not None and args.max_len > groups[-1].pack_len:
        if args.groups == "auto":  # the groups are the profiler's: only it can add a longer one
            raise CliError(f"--max-len {args.max_len} exceeds the largest pack_len {groups[-1].pack_len} of --profile "
                           f"{args.profile}: re-run the profiler with profile.max_len={args.max_len} (python -m "
                           f"hbp_train.profiler profile.max_len={args.max_len} ...), or lower --max-len to "
                           f"{groups[-1].pack_len}")
        raise CliError(f"--max-len {args.max_len} exceeds the largest pack_len {groups[-1].pack_len}: add a group "
                       f"with pack_len >= {args.max_len} or lower --max-len")
    zero_stage = planned_zero_stage(args)
    if args.strategy == "bytescale" and args.zero_stage is not None:
        from hbp_train.planning.baselines.bytescale import check_zero_stage

        try:
            check_zero_stage({"requires_zero_stage": [0, 1]}, args.zero_stage)
        except UserError as e:
            raise CliError(f"--zero-stage {args.zero_stage}: {e}") from None
    pack_cost = None
    if args.calibration or args.model_shape:
        from hbp_train.perf.cost_model import CostModel, pack_cost_fn

        shape = args.model_shape or (model_record["shape"] if model_record else None)
        pack_cost = pack_cost_fn(CostModel.from_calibration(args.calibration, shape))
    read_start = time.process_time()
    lengths = read_lengths(args.lengths) if args.lengths else read_dataset_lengths(args.dataset)
    cpu = {"read": time.process_time() - read_start}
    if len(lengths) == 0:
        raise CliError(f"{args.lengths or args.dataset}: no samples")
    warn_if_longer_than_max_len(lengths, args.max_len, groups[-1].pack_len)
    global_tokens = args.global_tokens
    if global_tokens is None:
        kept_tokens = int(lengths[lengths <= groups[-1].pack_len].sum())
        one_slot_each = slot_tokens(args.world_size, groups)
        global_tokens = auto_global_tokens(kept_tokens, one_slot_each)
        print(f"--global-tokens not given: {global_tokens:,} tokens per optimizer step, from the data ({kept_tokens:,} "
              f"tokens / {AUTO_STEPS}, at most {AUTO_MAX_TOKENS:,}, at least one pack of every group per replica: "
              f"{one_slot_each:,}); give --global-tokens to choose")

    def plan_with(strategy):
        cfg = PlanConfig(world_size=args.world_size, groups=groups, strategy=strategy,
                         global_tokens=global_tokens, max_len=args.max_len,
                         curriculum_steps=args.curriculum_steps, seed=args.seed, isf_rounds=args.isf_rounds,
                         isf_threshold=args.isf_threshold, balance=args.balance, step_mix=args.step_mix,
                         step_tokens=args.step_tokens, progress=not args.quiet,
                         pack_cost=pack_cost)
        if not args.quiet and not sys.stderr.isatty():  # a log file gets no bar: one line says the work began
            print(f"planning {len(lengths):,} samples ({strategy}, world size {args.world_size}) ...",
                  file=sys.stderr, flush=True)
        t0, c0 = time.perf_counter(), time.process_time()
        plan = make_plan(lengths, cfg)
        plan.extra["wall_seconds"] = time.perf_counter() - t0
        plan.extra["cpu_seconds"] = time.process_time() - c0  # planning and its metrics
        return plan

    plans = {args.strategy: plan_with(args.strategy)}
    if args.strategy == "hbp" and not args.no_baseline:
        plans["isf"] = plan_with("isf")
    plan = plans[args.strategy]
    cpu["plan"] = plan.extra["cpu_seconds"]
    if args.dataset:  # the tokenizer that made the data, which the trainer checks the model against (vocab.py)
        record = recorded_tokenizer(args.dataset)
        if record is not None:
            plan.extra["tokenizer"] = record
    if model_record is not None:  # the model the plan is for (hbp-simulate costs its shape)
        plan.extra["model"] = model_record
    if zero_stage is not None:  # the stage its groups were chosen for (hbp_train.config refuses another)
        plan.extra["zero_stage"] = zero_stage
    if args.out:
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            save_plan(plan, args.out)
        except OSError as e:  # checked before the planning; a full disk or a folder that changed since
            raise CliError(f"--out {args.out}: cannot write ({e.strerror})") from None
        cpu["write"] = time.process_time() - c0
        print(f"wrote {args.out} ({plan.num_optimizer_steps} optimizer steps, {plan.num_packs} packs, "
              f"{Path(args.out).stat().st_size / 1e6:.1f} MB) in {time.perf_counter() - t0:.2f}s")
    if args.shards:
        from hbp_train.batches.shards import write_shards

        c0 = time.process_time()
        # datasets' own "Saving the dataset" bars: not with --quiet, nor into a log file
        try:
            with datasets_bars_off(when=args.quiet or not sys.stderr.isatty()):
                rows = write_shards(plan, args.dataset, args.shards, progress=not args.quiet,
                                    plan_format=args.plan_format)
        except OSError as e:  # the --dataset files or the --shards folder: a full disk, no permission
            raise CliError(f"--shards {args.shards}: {e.filename or args.dataset}: {e.strerror}; check the --dataset "
                           "and --shards paths and their permissions") from None
        cpu["shards"] = time.process_time() - c0
        print(f"wrote packed shards to {args.shards}: " + ", ".join(f"group_{g}: {n} rows" for g, n in rows.items()))
    print(metrics_table(plans))
    note = replicas_note(plans)
    if note:
        print(note)
    print(step_line(plan, global_tokens, args.step_tokens))
    warn_if_few_steps(plan, global_tokens)
    print(f"CPU seconds ({args.strategy}): " + ", ".join(f"{k} {v:.2f}" for k, v in cpu.items())
          + f", together {sum(cpu.values()):.2f}")
    from hbp_train.planning.metrics import mix_report

    # The steps' length mix beside the data's: far above isf's mix_TV means length-skewed steps (docs/planning.md).
    report = mix_report(plan, args.strategy)
    if report:
        print(report)
    if plan.metrics["num_dropped"]:
        print(f"dropped {plan.metrics['num_dropped']} samples longer than the largest pack_len "
              f"({groups[-1].pack_len}): reason longer_than_max_pack_len")
    if plan.metrics["empty_packs"]:
        print(f"note: {plan.metrics['empty_packs']} empty packs in tail steps (too few samples to give every replica "
              "one); the trainer runs a zero-loss dummy micro-batch for them")
    if args.strategy == "bytescale":
        print("note: bytescale gives replicas unequal micro-batch counts; train it with ZeRO stage 0 or 1 only "
              "(plan records requires_zero_stage)")
    if args.plot and args.strategy not in ("hbp", "isf"):
        print(f"note: --plot draws isf/hbp plans; for {args.strategy} use python -m data_tools.compare --plot "
              "(simulated comparison of every strategy)")
    elif args.plot:
        from hbp_train.planning.plot import plot_plans

        write_output("--plot", args.plot, lambda path: plot_plans(plans.get("isf"), plans.get("hbp"), path))
        print(f"wrote {args.plot}")
    return 0


def main(argv=None) -> int:
    try:
        return run(argv)
    except UserError as e:  # bad flags, input files or settings (PlanConfig/GroupSpec name the field)
        print(f"pack: error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:  # every output is written to a temporary name and moved into place when complete
        return interrupted("pack", "outputs not yet complete (--out, --shards, --plot) were left as they were")


if __name__ == "__main__":
    sys.exit(main())
