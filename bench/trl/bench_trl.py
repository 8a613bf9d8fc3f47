"""Ours against what users run instead: TRL's SFTTrainer, side by side on this machine's CPU.

    python bench/trl/bench_trl.py            # the full run: 3 rounds, about 20-30 minutes on 2 idle cores (estimated)
    python bench/trl/bench_trl.py --quick    # a tiny model and set, 1 round (tests/test_bench_trl.py)

The full run writes bench/results/bench_trl.json (with the commit it ran on) and renders docs/benchmarks.md's TRL block
from it; ``--quick`` writes only under WORK. TRL lives in its own virtual environment, ``.venv-trl``, which the bench
builds on first use from the package index (bench/trl/venv.py): it is not a requirement of hbp-train.

Three runs a round, in rotated order, each one process with the same torch threads:
  trl        TRL 1.16 ``SFTTrainer``: ``packing=True, packing_strategy="bfd"`` (padding-free batches),
             ``assistant_only_loss=True``, its own tokenisation of the chats (bench/trl/trl_side.py);
  trl_block  the same with our per-document attention registered with transformers (hbp_train's ``sdpa_block``):
             what of the difference is attention;
  ours       data_tools.pack (hbp) and our trainer (bench/trl/ours_side.py).
Equalised and checked (the bench stops otherwise): the initial weights (one saved model both load); the documents,
token ids and trained targets (every document each side trains on, hashed: TRL's from its collator, ours from its
packed shards); the step count (ours planned to TRL's pack count); the optimiser (AdamW, lr, betas, eps, no weight
decay, clipping 1.0) and the learning rate of every step (TRL gets our schedule's formula; both logged and compared).
Measured: tokens/s of the timed steps (all but the first) on the wall clock from the end of the warm-up step to the
end of the last; held-out loss of the trained weights by eval/perplexity.py (the same function for both). What
could not be equalised is listed in the report (bench/trl/report.py). Figures are only worth committing from a run
that had the machine to itself.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench import results_file  # noqa: E402
from bench.speed import chain  # noqa: E402
from bench.speed.report import step_tokens  # noqa: E402
from bench.trl import ours_side, report, venv  # noqa: E402

NAME = "bench_trl"
WARMUP_STEPS = 1  # left out of the timed figures, as in bench_speed


@dataclass(frozen=True)
class Setup:
    shape: chain.Shape
    """The Llama both sides train."""
    max_len: int
    """TRL's max_length and our one packing group's pack length."""
    samples: int
    """Chats asked of data_tools.make_code_data (its training split is trained)."""
    heldout_samples: int
    """Held-out samples the loss is measured on (the first of the held-out split)."""
    rounds: int
    lr: float
    warmup_steps: int


SETUPS = {
    # About 200 chats of the code data's training split: some 45 steps of one 4096-token pack.
    "full": Setup(chain.Shape(hidden=128, layers=4, heads=4, kv_heads=2, ffn=344), max_len=4096, samples=240,
                  heldout_samples=40, rounds=3, lr=1e-3, warmup_steps=5),
    "quick": Setup(chain.Shape(hidden=32, layers=2, heads=4, kv_heads=2, ffn=64), max_len=1024, samples=120,
                   heldout_samples=8, rounds=1, lr=1e-3, warmup_steps=2),
}
OPTIMISER = {"betas": [0.9, 0.95], "eps": 1e-8, "grad_clip": 1.0, "cos_min_ratio": 0.1}


def schedule_spec(setup: Setup, steps: int) -> dict:
    """Our trainer's learning-rate schedule as hbp_train/build.py hands it to DeepSpeed's WarmupCosineLR (whose
    warm-up is at least 2 iterations), for TRL's LambdaLR."""
    from hbp_train.trainer import TrainConfig

    warmup_steps = TrainConfig(warmup_steps=setup.warmup_steps).warmup_for(steps)
    warmup = max(1, warmup_steps)
    return {"lr": setup.lr, "warmup_steps": setup.warmup_steps, "warmup": max(2, warmup),
            "warmup_min_ratio": 1.0 / warmup if warmup_steps > 0 else 1.0, "total": max(steps, warmup + 1),
            **OPTIMISER}


def run_trl(python: Path, spec: dict, out: Path, threads: int) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps({**spec, "out": str(out)}))
    res = subprocess.run([str(python), str(REPO / "bench" / "trl" / "trl_side.py"), str(out / "spec.json")],
                         cwd=REPO, env=ours_side.env(threads), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    (out / "trl.log").write_text(res.stdout)
    if res.returncode != 0:
        sys.exit(f"bench_trl: TRL's run failed ({res.returncode}), log {out / 'trl.log'}:\n{res.stdout[-3000:]}")
    return json.loads((out / "trl.json").read_text())


def check_documents(name: str, docs: list, reference: Counter) -> None:
    got = Counter(d[0] for d in docs)
    if got != reference:
        missing, extra = reference - got, got - reference
        sys.exit(f"bench_trl: {name} trains other documents than ours ({sum(missing.values())} of ours missing, "
                 f"{sum(extra.values())} not ours): the token ids or trained targets differ; see the runs' logs")


def check_lr(name: str, lrs: list, ours: list) -> float:
    if len(lrs) != len(ours):
        sys.exit(f"bench_trl: {name} ran {len(lrs)} steps, ours {len(ours)}")
    worst = max(abs(a - b) / b for a, b in zip(lrs, ours))
    if worst > 1e-6:
        sys.exit(f"bench_trl: {name}'s learning rate differs from ours by up to {worst:.2e} (relative)")
    return worst


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tiny model and set, 1 round")
    p.add_argument("--work", default=str(REPO / "bench" / "out" / "trl"), help="default bench/out/trl (ignored)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads of each side (default: cores)")
    p.add_argument("--venv", default=str(venv.DEFAULT_VENV), help="TRL's virtual environment (built if missing)")
    p.add_argument("--no-page", action="store_true", help="the full run: leave docs/benchmarks.md's block as it is")
    args = p.parse_args(argv)
    name = "quick" if args.quick else "full"
    setup = SETUPS[name]
    work = Path(args.work).resolve() / name
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    origin = results_file.provenance()

    def stage(text):
        print(f"[{time.time() - t0:6.0f}s] {text}", flush=True)

    stage("TRL's virtual environment")
    try:
        python = venv.ensure(Path(args.venv), echo=stage)
    except venv.VenvError as err:
        sys.exit(f"bench_trl: {err}")
    stage("data and the initial model")
    data = chain.make_code_data(work / "data", setup.max_len, setup.samples)
    chats = data.pool.parents[1] / "train.jsonl"
    model_dir = ours_side.make_model(work / "model", setup.shape, data.tokenizer, setup.max_len)
    lengths = data.lengths("pool")
    base = {"model": str(model_dir), "train": str(chats), "tokenizer": str(data.tokenizer), "max_len": setup.max_len,
            "threads": args.threads}
    stage("TRL tokenises and packs (its pack count is both sides' step count)")
    packs = run_trl(python, {**base, "seed": 0, "attention": "sdpa", "prepare_only": True, **schedule_spec(setup, 1)},
                    work / "prepare", args.threads)["packs"]
    spec = schedule_spec(setup, packs)
    rounds = []
    checks = {"steps": packs, "lr_max_rel_diff": 0.0}
    for r in range(setup.rounds):
        shards = work / "shards" / f"r{r}"
        plan = ours_side.plan(data.pool, shards, setup.max_len, r, ours_side.step_budget(int(lengths.sum()), packs))
        if plan.num_optimizer_steps != packs:
            sys.exit(f"bench_trl: our plan has {plan.num_optimizer_steps} steps, TRL {packs} packs")
        ours_docs = ours_side.documents(shards)
        reference = Counter(d[0] for d in ours_docs)
        checks.update(documents=len(ours_docs), tokens=int(sum(d[1] for d in ours_docs)))
        runs = {}
        order = ["trl", "trl_block", "ours"]
        order = order[r % 3:] + order[:r % 3]
        for variant in order:
            stage(f"round {r + 1}/{setup.rounds}: {variant}")
            out = work / "runs" / f"r{r}-{variant}"
            if variant == "ours":
                rows = [row for row in ours_side.train(shards, model_dir, out / "train", {**spec, "seed": r},
                                                       args.threads) if "perf/step_time_s" in row]
                model_out = ours_side.export(out / "train", out / "model", args.threads)
                tokens, seconds = ours_side.timed([row["time"] for row in rows], step_tokens(plan).tolist(),
                                                  WARMUP_STEPS)
                lrs, losses = [row["optim/lr"] for row in rows], [row["loss/train"] for row in rows]
            else:
                rec = run_trl(python, {**base, **spec, "seed": r, "prepare_only": False,
                                       "attention": "sdpa" if variant == "trl" else "hbp_block"}, out, args.threads)
                check_documents(variant, rec["docs"], reference)
                model_out = out / "model"
                tokens, seconds = ours_side.timed(rec["step_end"], rec["batch_tokens"], WARMUP_STEPS)
                lrs, losses = rec["lr"], rec["loss"]
            runs[variant] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds, "lr": lrs,
                             "loss": losses, "steps": len(lrs),
                             "heldout_loss": ours_side.heldout_loss(model_out, data.heldout, setup.heldout_samples,
                                                                    args.threads)}
        for variant in ("trl", "trl_block"):
            checks["lr_max_rel_diff"] = max(checks["lr_max_rel_diff"],
                                            check_lr(variant, runs[variant]["lr"], runs["ours"]["lr"]))
        runs["trl_block"]["loss_max_abs_diff_vs_trl"] = max(
            abs(a - b) for a, b in zip(runs["trl_block"]["loss"], runs["trl"]["loss"]))
        rounds.append(runs)
    trl_version = subprocess.run([str(python), "-c", "import trl; print(trl.__version__)"], capture_output=True,
                                 text=True).stdout.strip()
    results = {"setup": {**asdict(setup), "threads": args.threads, "name": name}, "provenance": origin,
               "trl_version": trl_version, "checks": checks, "schedule": spec, "rounds": rounds,
               "figures": report.figures(rounds), "wall_s": time.time() - t0}
    (work / "results.json").write_text(json.dumps(results, indent=1))
    print("\n" + report.render(json.loads(json.dumps(results))))
    print(f"\nwrote {work / 'results.json'}; wall time {results['wall_s']:.0f}s")
    if name == "full":
        kept = results_file.write_results(NAME, results, {work: "WORK"})
        print(f"wrote {kept.relative_to(REPO)}")
        if not args.no_page:
            results_file.write_block(NAME, report.render(results_file.read_results(NAME)))
            print(f"docs/benchmarks.md: block {NAME} rendered from {kept.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
