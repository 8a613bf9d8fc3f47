"""The default demo job of ``./launch.sh``: the whole pipeline on the CPU, on shipped/generated data.

generate synthetic chats → preprocess (tokenized shards) → plan + packed shards (hbp, with the isf baseline
printed beside it) → compare every strategy's simulated time → train a tiny Llama on 2 CPU processes
(groups at sp 1 and 2) → export an HF checkpoint → offline long-context checks → OpenCompass on the generated
offline suite (when its venv exists: ``./launch.sh eval --setup-opencompass``; skipped with that hint otherwise).
Each stage is the same CLI a user would run, so the demo doubles as a worked example; the commands are printed as
they run.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from hbp_train.common.cli import ArgumentParser, output_dir, positive_int

REPO = Path(__file__).resolve().parent.parent
TOKENIZER = REPO / "data_tools" / "assets" / "tokenizer"
OPENCOMPASS_STAGE = "OpenCompass offline suite"


def stages(out: Path, num_samples: int, nproc: int, epochs: int) -> list[tuple[str, list[str]]]:
    """The demo's commands, in order. Sizes are chosen so the whole demo takes a few minutes on 2 cores."""
    py = sys.executable
    raw, tok, held_raw, held_tok = out / "raw.jsonl", out / "tokenized", out / "heldout.jsonl", out / "heldout_tok"
    packed, held_packed, run, export = out / "packed", out / "heldout_packed", out / "train", out / "export"
    return [
        ("generate demo data", [py, "-m", "data_tools.make_demo_data", "--out", str(raw),
                                "--num-samples", str(num_samples), "--max-tokens", "2048", "--seed", "0"]),
        ("generate held-out data", [py, "-m", "data_tools.make_demo_data", "--out", str(held_raw),
                                    "--num-samples", "64", "--max-tokens", "1024", "--seed", "1"]),
        ("preprocess", [py, "-m", "data_tools.preprocess", "--input", str(raw), "--output", str(tok),
                        "--tokenizer", str(TOKENIZER), "--max-len", "2048", "--overlong", "truncate"]),
        ("preprocess held-out", [py, "-m", "data_tools.preprocess", "--input", str(held_raw), "--output",
                                 str(held_tok), "--tokenizer", str(TOKENIZER), "--max-len", "1024"]),
        ("plan + packed shards", [py, "-m", "data_tools.pack", "--dataset", str(tok), "--shards", str(packed),
                                  "--max-len", "2048", "--world-size", str(nproc), "--groups", "1024:1,2048:2",
                                  "--strategy", "hbp", "--global-tokens", "8192", "--curriculum-steps", "4",
                                  "--seed", "0", "--out", str(out / "plan.json"), "--plot", str(out / "plan.png")]),
        # The held-out chats packed the same way: the trainer logs their loss (loss/eval) as it goes.
        ("pack held-out", [py, "-m", "data_tools.pack", "--dataset", str(held_tok), "--shards", str(held_packed),
                           "--max-len", "2048", "--world-size", str(nproc), "--groups", "1024:1,2048:2",
                           "--global-tokens", "8192", "--seed", "0", "--no-baseline", "--quiet"]),
        # Every strategy on the same lengths, with the simulated time of the shipped H100 calibration's own shape
        # (Llama-3-8B), named: what the demo's packing would cost an 8B model, not the tiny model trained below.
        ("compare strategies (simulated)", [py, "-m", "data_tools.compare", "--dataset", str(tok), "--max-len", "2048",
                                            "--world-size", str(nproc), "--groups", "1024:1,2048:2",
                                            "--model-shape", "llama3-8b",
                                            "--global-tokens", "8192", "--plot", str(out / "compare.png"),
                                            "--out", str(out / "compare.json")]),
        ("train (2 CPU processes)", [py, "-m", "hbp_train.launch", "--standalone", "--nproc_per_node",
                                     str(nproc), "-m", "hbp_train.train", "experiment=cpu_demo",
                                     f"data.shards={packed}", f"data.epochs={epochs}", f"train.out_dir={run}",
                                     f"data.eval_shards={held_packed}", "train.eval_every=40"]),
        ("export", [py, "-m", "hbp_train.export", "--checkpoint", str(run / "checkpoints"), "--out", str(export)]),
        ("offline evaluation", [py, "-m", "eval.run", "offline", "--model", str(export), "--dataset",
                                str(held_tok), "--lengths", "128,256,512", "--out", str(out / "eval")]),
        # The same checkpoint through OpenCompass (its own venv), on the suite generated in its dataset format.
        (OPENCOMPASS_STAGE, [py, "-m", "eval.run", "opencompass", "--model", str(export), "--datasets", "offline",
                             "--out", str(out / "opencompass")]),
    ]


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m hbp_train.demo",
        description="Run the whole hbp-train pipeline on the CPU on generated demo data (a few minutes).",
    )
    parser.add_argument("--out", default=str(REPO / "runs" / "demo"), type=output_dir,
                        help="output directory, owned by the demo: a re-run replaces its outputs (default runs/demo)")
    parser.add_argument("--num-samples", type=positive_int, default=2000,
                        help="synthetic chats to generate (default 2000)")
    parser.add_argument("--nproc", type=positive_int, default=2, help="CPU training processes (default 2)")
    parser.add_argument("--epochs", type=positive_int, default=3, help="passes over the plan in training (default 3)")
    names = _stage_names()
    parser.add_argument("--only", default=None, type=stage_numbers,
                        help="comma-separated stage numbers to run (default: all): "
                             + ", ".join(f"{i} {name}" for i, name in enumerate(names, 1)))
    return parser


def _stage_names() -> list[str]:
    return [name for name, _ in stages(Path("OUT"), 0, 0, 0)]


def stage_numbers(text: str) -> set[int]:
    """--only's ``type=``: comma-separated stage numbers, each one of the stages."""
    count = len(_stage_names())
    items = [s.strip() for s in text.split(",")]
    if not all(s.isdigit() and 1 <= int(s) <= count for s in items):
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of stage numbers (give numbers 1-{count} such as "
                                         "1,2; see --help)")
    return {int(s) for s in items}


stage_numbers.bad_values = ("x", "0")  # for tests/test_cli_walk.py: a wrong type and one out of range


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    names = _stage_names()
    only = args.only or set(range(1, len(names) + 1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
               TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS="1")
    todo = stages(out, args.num_samples, args.nproc, args.epochs)
    t_start = time.time()
    for i, (name, cmd) in enumerate(todo, 1):
        if i not in only:
            continue
        # The demo owns OUT, so a re-run replaces its run and its export: training refuses a run directory that
        # holds another run's checkpoints, and hbp_train.export folders it did not write.
        if "hbp_train.train" in cmd:
            shutil.rmtree(out / "train", ignore_errors=True)
        if "hbp_train.export" in cmd:
            shutil.rmtree(out / "export", ignore_errors=True)
        if name == OPENCOMPASS_STAGE and not _opencompass_ready():
            print(f"\n=== [{i}/{len(todo)}] {name}: skipped, OpenCompass's venv is not set up. Create it once with "
                  f"./launch.sh eval --setup-opencompass (a few minutes, about 2 GB), then run this stage with "
                  f"python -m hbp_train.demo --out {out} --only {i}", flush=True)
            continue
        print(f"\n=== [{i}/{len(todo)}] {name}\n$ {shlex.join(cmd)}", flush=True)
        t0 = time.time()
        rc = subprocess.call(cmd, cwd=REPO, env=env)
        if rc != 0:
            print(f"demo: stage '{name}' failed with exit code {rc}", file=sys.stderr)
            return rc
        print(f"--- {name}: {time.time() - t0:.1f} s", flush=True)
    print(f"\nDemo finished in {time.time() - t_start:.0f} s. Outputs under {out}:")
    print(f"  preprocessing report  {out / 'tokenized' / 'report.json'}")
    print(f"  plan + metrics        {out / 'packed' / 'plan.json'}   plot {out / 'plan.png'}")
    print(f"  strategy comparison   {out / 'compare.json'}   plot {out / 'compare.png'} (simulated)")
    print(f"  training metrics      {out / 'train'} (metrics.jsonl with loss/eval on the held-out chats, plot "
          f"metrics.png; TensorBoard: tensorboard --logdir {out / 'train'})")
    print(f"  exported checkpoint   {out / 'export'}")
    print(f"  evaluation            {out / 'eval'} (results.json, results.md, needle_heatmap.png)")
    if (out / "opencompass" / "results.md").is_file():
        print(f"  OpenCompass           {out / 'opencompass'} (results.md, results.json, needle_heatmap.png)")
    return 0


def _opencompass_ready() -> bool:
    from eval.opencompass_venv import DEFAULT_VENV, is_ready

    return is_ready(DEFAULT_VENV)


if __name__ == "__main__":
    sys.exit(main())
