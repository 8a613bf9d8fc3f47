"""Does balance cost quality? Train the same tiny model on the same data with each strategy's plan; held-out loss.

    python bench/bench_quality.py [--datasets demo,long] [--strategies isf,sorted,bfd,kk,hbp,hbp-unmixed]
        [--seeds 0,1,2,3,4,5] [--epochs 3] [--work bench/out/quality] [--plot bench/out/quality.png] [--resume]

For every dataset: generate it (data_tools.make_demo_data), tokenize it (data_tools.preprocess) and pack its
held-out counterpart; then, for every strategy and plan seed, plan the training data in this process
(hbp_train.planning.make_plan, the plan ``data_tools.pack --max-len 2048 --world-size 2 --groups 1024:1,2048:2
--global-tokens 8192 --curriculum-steps 4 --seed S`` makes), write its packed shards and train the real trainer
(``hbp_train.launch`` torchrun, 2 CPU processes, experiment=cpu_demo, the same model seed for every run) for
``--epochs`` epochs, and read the final held-out loss (``loss/eval``, token mean over the held-out set) from the
run's metrics.jsonl. One training at a time (the machine has 2 cores). About a minute per run on 2 free cores: the
defaults (2 datasets x 6 strategies x 6 seeds) take about an hour.

Every strategy trains at equal optimisation (the planner's default step_tokens="real", #24): the same number of
optimizer steps of the same real tokens (8192 a step, to within one slot), so a strategy's packing changes its
speed, never its number of updates. isf-capacity and hbp-capacity size steps by pack capacity instead, as before
#24: hbp's denser packs then make fewer, larger steps (the cause of its loss there).

Strategies (VARIANTS below): isf, sorted, bfd, kk (veRL's Karmarkar-Karp balancing), hbp (step_mix="mixed", the
default: optimizer steps that mix the groups), hbp-stratified (steps of one group, one slot per cost stratum),
hbp-unmixed (step_mix="sorted": the earlier hbp), isf-capacity and hbp-capacity (above), and the ablations and
diagnostics that found the cause of #16 (isf-split, hbp-1group, isf-120, isf-nocurr, hbp-noshuffle, isf-sum,
hbp-sum; see their comments).

Datasets:
* ``demo`` — the demo's data: 2000 chats, 4% long (512-1946 tokens); held-out: 64 chats up to 1024 tokens.
* ``long`` — another shape: 900 chats, 30% long; held-out: 128 chats of the same mix, long ones up to 2048
  tokens too (so the held-out loss also measures the long samples).

Prints, per dataset, the held-out loss of every strategy (mean, standard deviation and range over the seeds,
the per-seed values, the difference to isf's mean), next to its SIMULATED speed-up over isf (the same plans on
hbp_train/planning/simulator.py with the shipped calibration, compute only, mean over seeds) and the plan's
balance and length-mix figures: ABR, mix_TV (mean over optimizer steps of the total-variation distance between a
step's token share per length bucket and the whole data's, planning/metrics.py), the coefficient of variation of
the loss tokens per step, the effective weight a loss token of the longest bucket gets under the ave_token
normaliser (1/loss tokens of its step, relative to a uniform weight; 1 = unbiased) and the optimizer steps. Writes a plot (PNG) and
WORK/results.json. ``--resume`` reuses runs whose result.json matches the plan (same samples in the same steps).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hbp_train.batches.columns import int_column  # noqa: E402
from hbp_train.planning import GroupSpec, PlanConfig, make_plan  # noqa: E402
from hbp_train.planning.metrics import with_metrics  # noqa: E402

DEFAULT_WORK = REPO / "bench" / "out" / "quality"
DEFAULT_PLOT = REPO / "bench" / "out" / "quality.png"
TOKENIZER = REPO / "data_tools" / "assets" / "tokenizer"
MAX_LEN = 2048
WORLD_SIZE = 2
GROUPS = [GroupSpec(1024, 1), GroupSpec(2048, 2)]
GLOBAL_TOKENS = 8192
CURRICULUM_STEPS = 4

# name: (training samples, long fraction, held-out samples, held-out max tokens)
DATASETS = {
    "demo": dict(num_samples=2000, long_fraction=0.04, heldout_samples=64, heldout_max_tokens=1024),
    "long": dict(num_samples=900, long_fraction=0.30, heldout_samples=128, heldout_max_tokens=2048),
}


def plan_config(strategy: str, seed: int, **extra) -> PlanConfig:
    kwargs = dict(world_size=WORLD_SIZE, groups=GROUPS, strategy=strategy, global_tokens=GLOBAL_TOKENS,
                  max_len=MAX_LEN, curriculum_steps=CURRICULUM_STEPS, seed=seed)
    return PlanConfig(**{**kwargs, **extra})


def _plan(strategy: str, **extra):
    return lambda lengths, seed: make_plan(lengths, plan_config(strategy, seed, **extra))


def _isf_split(lengths, seed):
    """Ablation: isf's shuffled packs, but a step holds only packs with a sample longer than the smallest group's
    pack_len or only packs without one (hbp's split of steps into groups, without its packing)."""
    from hbp_train.planning.balance import reorder_steps

    plan = make_plan(lengths, plan_config("isf", seed))
    cfg, limit = plan.config, GROUPS[0].pack_len
    per_step = cfg.replicas(len(GROUPS) - 1) * cfg.micro_batches(len(GROUPS) - 1)
    has_long = np.maximum.reduceat(lengths[plan.pack_samples], plan.pack_ptr[:-1]) > limit
    packs = np.r_[np.flatnonzero(has_long), np.flatnonzero(~has_long)]
    step_ptr = np.r_[np.arange(0, len(packs), per_step), len(packs)]
    plan.step_ptr, plan.step_packs = step_ptr.astype(np.int64), packs.astype(np.int64)
    plan.step_group = np.full(len(step_ptr) - 1, len(GROUPS) - 1, np.int32)
    order = np.random.default_rng(seed).permutation(plan.num_steps)
    plan.step_ptr, plan.step_packs, plan.step_group = reorder_steps(plan.step_ptr, plan.step_packs, plan.step_group, order)
    plan.validate()
    return with_metrics(plan)


# Strategies, the fix's ablations and diagnostics: name -> (plan function(lengths, seed) -> Plan, extra trainer
# overrides). Every run of a dataset uses the same model seed and trainer settings unless the variant says so.
VARIANTS = {
    "isf": (_plan("isf"), []),
    "sorted": (_plan("sorted"), []),
    "bfd": (_plan("bfd"), []),  # best-fit decreasing into the largest pack (TRL / ms-swift packing)
    "kk": (_plan("kk"), []),  # veRL: each step's samples split across the replicas by Karmarkar-Karp on workload
    "hbp": (_plan("hbp"), []),  # step_mix="mixed": optimizer steps that mix the groups, spread over the costs
    # hbp with only the first half of the fix (steps of one group, one slot per cost stratum), and the earlier hbp
    # (m consecutive cost-sorted slots per step: steps homogeneous in length)
    "hbp-stratified": (_plan("hbp", step_mix="stratified"), []),
    "hbp-unmixed": (_plan("hbp", step_mix="sorted"), []),
    # ablations: hbp with one group only (no hierarchy); isf's packs split into steps like hbp's groups
    "hbp-1group": (_plan("hbp", groups=GROUPS[-1:], step_mix="stratified"), []),
    "isf-split": (_isf_split, []),
    # step order: isf without its short-first curriculum; hbp replaying the plan's interleaved order every epoch
    # (the trainer shuffles the steps of later epochs uniformly by default, data.shuffle_epochs)
    "isf-nocurr": (_plan("isf", curriculum_steps=0), []),
    "hbp-nocurr": (_plan("hbp", curriculum_steps=0), []),
    # steps sized by pack capacity (before #24): hbp's denser packs make fewer, larger optimizer steps than isf's
    "isf-capacity": (_plan("isf", step_tokens="capacity"), []),
    "hbp-capacity": (_plan("hbp", step_tokens="capacity"), []),
    # isf stopped after 120 steps (#16: hbp's step count on the demo when steps were sized by capacity)
    "isf-120": (_plan("isf", step_tokens="capacity"), ["train.max_steps=120"]),
    "hbp-noshuffle": (_plan("hbp", step_mix="stratified"), ["data.shuffle_epochs=false"]),
    # diagnostics: the loss as a plain sum of token losses (every loss token weighs the same whatever its step),
    # no gradient clipping (clipping would re-weight steps by their gradient norm)
    "isf-sum": (_plan("isf"), ["loss.normalizer=sum", "train.grad_clip=0"]),
    "hbp-sum": (_plan("hbp", step_mix="stratified"), ["loss.normalizer=sum", "train.grad_clip=0"]),
}
DEFAULT_VARIANTS = "isf,sorted,bfd,kk,hbp,hbp-unmixed"


def env() -> dict:
    return dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")


def call(cmd: list[str], log: Path | None = None) -> None:
    """Run a command from the repository root; on failure print its output's tail and stop."""
    res = subprocess.run(cmd, cwd=REPO, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if log is not None:
        log.write_text(res.stdout)
    if res.returncode != 0:
        sys.exit(f"bench_quality: {' '.join(cmd[:4])} ... failed ({res.returncode}):\n{res.stdout[-3000:]}")


def prepare_dataset(name: str, work: Path) -> tuple[Path, Path]:
    """(tokenized training set, packed held-out shards) of a dataset, made once under WORK/<name>/."""
    spec, py = DATASETS[name], sys.executable
    root = work / name
    tok, held_tok, held_packed = root / "tokenized", root / "heldout_tok", root / "heldout_packed"
    if (tok / "report.json").is_file() and (held_packed / "plan.json").is_file():
        return tok, held_packed
    root.mkdir(parents=True, exist_ok=True)
    for out, n, max_tokens, seed in ((root / "raw.jsonl", spec["num_samples"], MAX_LEN, 0),
                                     (root / "heldout.jsonl", spec["heldout_samples"], spec["heldout_max_tokens"], 1)):
        call([py, "-m", "data_tools.make_demo_data", "--out", str(out), "--num-samples", str(n), "--max-tokens",
              str(max_tokens), "--seed", str(seed), "--long-fraction", str(spec["long_fraction"])])
    call([py, "-m", "data_tools.preprocess", "--input", str(root / "raw.jsonl"), "--output", str(tok), "--tokenizer",
          str(TOKENIZER), "--max-len", str(MAX_LEN), "--overlong", "truncate"])
    call([py, "-m", "data_tools.preprocess", "--input", str(root / "heldout.jsonl"), "--output", str(held_tok),
          "--tokenizer", str(TOKENIZER), "--max-len", str(MAX_LEN), "--overlong", "truncate"])
    shutil.rmtree(held_packed, ignore_errors=True)
    call([py, "-m", "data_tools.pack", "--dataset", str(held_tok), "--shards", str(held_packed), "--max-len",
          str(MAX_LEN), "--world-size", str(WORLD_SIZE), "--groups", ",".join(f"{g.pack_len}:{g.sp}" for g in GROUPS),
          "--global-tokens", str(GLOBAL_TOKENS), "--seed", "0", "--no-baseline", "--quiet"])
    return tok, held_packed


def plan_fingerprint(plan) -> str:
    """Hash of which samples run in which pack of which step (what training depends on)."""
    h = hashlib.sha256()
    arrays = [plan.pack_ptr, plan.pack_samples, plan.step_ptr, plan.step_packs, plan.step_group]
    if plan.optimizer_step is not None:  # which plan steps make one optimizer step
        arrays.append(plan.optimizer_step)
    for arr in arrays:
        h.update(np.ascontiguousarray(arr, np.int64).tobytes())
    return h.hexdigest()[:16]


def plan_stats(plan, loss_tokens: np.ndarray) -> dict:
    """Length-mix and loss-weight figures of a plan (needs the samples' loss-token counts)."""
    from hbp_train.planning.metrics import mix_edges

    lengths = plan.lengths
    edges = mix_edges([g.pack_len for g in plan.config.groups])
    bucket = np.searchsorted(edges, lengths, side="left")
    step_of = np.zeros(len(lengths), np.int64)
    sizes = np.diff(plan.pack_ptr)
    step_of_pack = np.zeros(plan.num_packs, np.int64)
    step_of_pack[plan.step_packs] = np.repeat(plan.optimizer_steps(), np.diff(plan.step_ptr))  # optimizer steps
    step_of[plan.pack_samples] = np.repeat(step_of_pack, sizes)
    packed = plan.pack_samples
    num_steps = plan.num_optimizer_steps
    step_lt = np.bincount(step_of[packed], weights=loss_tokens[packed], minlength=num_steps)
    # ave_token: a loss token weighs 1 / (loss tokens of its step); uniform would be num_steps / all loss tokens.
    weight = 1.0 / step_lt[step_of[packed]] / (num_steps / loss_tokens[packed].sum())
    lt = loss_tokens[packed]
    top = bucket[packed] == bucket[packed].max()
    return {"ABR": plan.metrics["ABR"], "mix_TV": plan.metrics.get("mix_TV", float("nan")),
            "num_steps": num_steps, "loss_tokens_cv": float(step_lt.std() / step_lt.mean()),
            "long_loss_weight": float((weight[top] * lt[top]).sum() / lt[top].sum())}


def simulated_speedups(plans: dict) -> dict:
    """SIMULATED speed-up over isf of every plan (shipped calibration, compute only); {} without isf."""
    from hbp_train.perf.cost_model import CostModel
    from hbp_train.planning.simulator import SimConfig, simulate, speedup

    if "isf" not in plans:
        return {}
    model, sim = CostModel.from_calibration(), SimConfig()
    base = simulate(plans["isf"], model, sim)
    out = {name: speedup(base, simulate(plan, model, sim)) for name, plan in plans.items()}
    if "hbp" in plans:  # SP per sample: its simulated upper bound over hbp, times hbp's speed-up over isf
        from hbp_train.planning.dynsp import dynsp_bound

        out["dynsp bound"] = out["hbp"] * dynsp_bound(plans["hbp"], model, sim)["speedup_bound"]
    return out


def train(plan, tok: Path, held_packed: Path, run_dir: Path, epochs: int, overrides: list[str]) -> float:
    """Packed shards of ``plan`` + a 2-process CPU training; returns the final held-out loss."""
    from hbp_train.batches.shards import write_shards

    import datasets

    datasets.disable_progress_bars()
    shards, out = run_dir / "shards", run_dir / "train"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    write_shards(plan, tok, shards, progress=False)
    call([sys.executable, "-m", "hbp_train.launch", "--standalone", "--nproc_per_node", str(WORLD_SIZE), "-m",
          "hbp_train.train", "experiment=cpu_demo", f"data.shards={shards}", f"data.epochs={epochs}",
          f"train.out_dir={out}", f"data.eval_shards={held_packed}", "logging.progress_bar=false",
          "logging.tensorboard=false", "logging.log_every=100000", "train.save_final=false", *overrides],
         run_dir / "train.log")
    evals = [json.loads(line)["loss/eval"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if "loss/eval" in line]
    shutil.rmtree(shards, ignore_errors=True)  # the plan is in result.json's fingerprint; shards are re-made
    return float(evals[-1])


def run_dataset(name: str, strategies: list[str], seeds: list[int], epochs: int, work: Path, resume: bool) -> dict:
    import datasets

    tok, held_packed = prepare_dataset(name, work)
    ds = datasets.load_from_disk(str(tok))
    lengths, loss_tokens = int_column(ds, "length"), int_column(ds, "num_loss_tokens")
    out = {s: {"loss": [], "speedup": [], "stats": []} for s in strategies}
    for seed in seeds:
        plans = {s: VARIANTS[s][0](lengths, seed) for s in strategies}
        speed = simulated_speedups(plans)
        for s, plan in plans.items():
            run_dir = work / name / f"{s}-seed{seed}"
            key = {"fingerprint": plan_fingerprint(plan), "epochs": epochs, "overrides": VARIANTS[s][1]}
            cached = run_dir / "result.json"
            if resume and cached.is_file() and all(
                    json.loads(cached.read_text()).get(k, []) == v for k, v in key.items()):
                loss = json.loads(cached.read_text())["loss"]
                how = "cached"
            else:
                t0 = time.time()
                loss = train(plan, tok, held_packed, run_dir, epochs, VARIANTS[s][1])
                cached.write_text(json.dumps({**key, "loss": loss}))
                how = f"{time.time() - t0:.0f}s"
            out[s]["loss"].append(loss)
            out[s]["speedup"].append(speed.get(s, float("nan")))
            out[s]["stats"].append(plan_stats(plan, loss_tokens))
            print(f"[{name}] {s:<18} seed {seed}: held-out loss {loss:.4f} ({how})", flush=True)
        if "dynsp bound" in speed:
            out.setdefault("dynsp bound", []).append(speed["dynsp bound"])
    return out


def summary_table(name: str, res: dict, seeds: list[int]) -> str:
    base = np.mean(res["isf"]["loss"]) if "isf" in res else None
    lines = [f"\n{name}: held-out loss over plan seeds {','.join(map(str, seeds))} (mean ± std [min..max]); "
             "SIMULATED speed-up over isf (compute only, mean over seeds); plan figures (mean over seeds)",
             f"{'strategy':<18}{'held-out loss':>32}{'vs isf':>9}  {'per seed':<24}{'speed-up':>9}{'ABR':>8}"
             f"{'mix_TV':>8}{'lt cv':>7}{'long w':>8}{'steps':>7}"]
    bound = res.pop("dynsp bound", None)
    for s, r in res.items():
        loss = np.asarray(r["loss"])
        st = {k: np.mean([x[k] for x in r["stats"]]) for k in r["stats"][0]}
        diff = f"{loss.mean() - base:+.3f}" if base is not None else "n/a"
        lines.append(f"{s:<18}{f'{loss.mean():.4f} ± {loss.std():.4f} [{loss.min():.3f}..{loss.max():.3f}]':>32}"
                     f"{diff:>9}  {' '.join(f'{x:.3f}' for x in loss):<24}{np.mean(r['speedup']):>8.3f}x"
                     f"{st['ABR']:>8.4f}{st['mix_TV']:>8.3f}{st['loss_tokens_cv']:>7.2f}{st['long_loss_weight']:>8.2f}"
                     f"{st['num_steps']:>7.0f}")
    if bound is not None:
        res["dynsp bound"] = bound
        lines.append(f"{'dynsp (bound)':<18}{'(hbp plan: same loss)':>32}{'':>9}  {'':<24}{np.mean(bound):>8.3f}x"
                     "   SP per sample, simulated UPPER bound; not trained: the SP degree does not change the "
                     "loss (SP=1 equals SP=2 in the tests), and it only earns its trainer code at >= 5%")
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4.2), squeeze=False)
    for ax, (name, res) in zip(axes[0], results.items()):
        names = [s for s in res if s != "dynsp bound"]
        for i, s in enumerate(names):
            loss = np.asarray(res[s]["loss"])
            ax.scatter(np.full(len(loss), i), loss, s=14, color="0.6", zorder=2)
            ax.errorbar(i, loss.mean(), yerr=loss.std(), fmt="o", color=f"C{i}", capsize=5, zorder=3)
        if "isf" in res:
            ax.axhline(np.mean(res["isf"]["loss"]), color="C0", lw=0.8, ls="--", label="isf mean")
            ax.legend(fontsize=8)
        ax.set_xticks(range(len(names)), [f"{s}\n{np.mean(res[s]['speedup']):.2f}x sim." for s in names], fontsize=8)
        ax.set_ylabel("held-out loss (nats/token)")
        ax.set_title(f"{name}: held-out loss (mean ± std over seeds)\nand SIMULATED speed-up over isf", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", default="demo,long", help=f"comma-separated, of {', '.join(DATASETS)} (default both)")
    p.add_argument("--strategies", default=DEFAULT_VARIANTS,
                   help=f"comma-separated, of {', '.join(VARIANTS)} (default {DEFAULT_VARIANTS})")
    p.add_argument("--seeds", default="0,1,2,3,4,5", help="plan seeds (default 0-5: the seed spread of the tiny runs is about as large as the differences)")
    p.add_argument("--epochs", type=int, default=3, help="training epochs per run (default 3, as the demo)")
    p.add_argument("--work", default=str(DEFAULT_WORK), help="data and runs (default bench/out/quality, ignored by git)")
    p.add_argument("--plot", default=str(DEFAULT_PLOT), help="output PNG (default bench/out/quality.png)")
    p.add_argument("--resume", action="store_true", help="reuse finished runs whose plan and epochs match")
    args = p.parse_args(argv)
    names = [d for d in args.datasets.split(",") if d]
    strategies = [s for s in args.strategies.split(",") if s]
    for bad in [d for d in names if d not in DATASETS] + [s for s in strategies if s not in VARIANTS]:
        p.error(f"unknown dataset or strategy {bad!r}")
    seeds = [int(s) for s in args.seeds.split(",")]
    work = Path(args.work)
    t0 = time.time()
    results = {name: run_dataset(name, strategies, seeds, args.epochs, work, args.resume) for name in names}
    for name, res in results.items():
        print(summary_table(name, res, seeds))
    plot(results, Path(args.plot))
    (work / "results.json").write_text(json.dumps(results, indent=1))
    print(f"\nwrote {args.plot} and {work / 'results.json'} ({time.time() - t0:.0f}s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
