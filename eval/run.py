"""Evaluation CLI: ``python -m eval.run`` (``./launch.sh eval``).

    python -m eval.run offline --model DIR [--dataset TOKENIZED_DIR] --out DIR      no download, CPU or GPU
    python -m eval.run opencompass --model DIR --datasets offline|general|long|LIST --out DIR
    python -m eval.run compare RUN_A RUN_B ... --out DIR                             checkpoints side by side
    python -m eval.run --setup-opencompass                                            builds .venv-opencompass

User mistakes (``UserError``) print one ``error:`` line and exit with code 2; an OpenCompass task that failed exits 1
naming the task and its log; ``--help`` on each subcommand explains every option.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path

from eval.report import make_out
from hbp_train.common.cli import (ArgumentParser, existing_dir, existing_path, fraction_list, int_list, nonneg_int,
                           output_dir, positive_int)
from hbp_train.common.errors import EXIT_USER_ERROR, UserError
from hbp_train.common.library_bars import library_bars_on_a_terminal_only

DEFAULT_LENGTHS = "256,512,1024"
DEFAULT_DEPTHS = "0,0.25,0.5,0.75,1"


def _one_line_warning(message, category, filename, lineno, file=None, line=None):
    print(f"warning: {message}", file=sys.stderr if file is None else file)


def baseline_arg(text: str):
    """``--baseline``: ``untrained``, ``none``, or an existing folder (a base model, checked by run_offline)."""
    if text in ("untrained", "none"):
        return text
    path = Path(text).expanduser()
    if text.strip() and path.is_dir():
        return path
    raise argparse.ArgumentTypeError(f"{text!r} is neither 'untrained', 'none' nor a model folder (give one of them)")


baseline_arg.bad_values = ("no-such-model", "/nonexistent/base")  # for tests/test_cli_walk.py: two refused values


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m eval.run",
        description="Evaluate an exported hbp-train checkpoint (an HF safetensors directory with its tokenizer).",
        epilog="Subcommands: 'offline' (local long-context checks, no download), 'opencompass' (benchmarks in "
               "OpenCompass's own venv) and 'compare' (evaluations side by side). Run 'python -m eval.run "
               "SUBCOMMAND --help' for their options.",
    )
    parser.add_argument("--setup-opencompass", action="store_true",
                        help="build the OpenCompass virtual environment (--venv): python3 -m venv, torch at this "
                             "venv's version, eval/requirements-opencompass.txt and the compatibility shim, then a "
                             "self-test on a tiny model; a second call with nothing changed returns at once. It is "
                             "kept apart because OpenCompass needs numpy<2 and datasets<4. With no subcommand, exit "
                             "after the set-up")
    parser.add_argument("--venv", type=output_dir.path, default=None,
                        help="the OpenCompass virtual environment (default: .venv-opencompass in the repo root)")
    sub = parser.add_subparsers(dest="command", metavar="{offline,opencompass,compare}")

    off = sub.add_parser(
        "offline", help="needle-in-a-haystack retrieval and held-out perplexity, generated locally",
        description="Offline long-context checks that need no download: needle-in-a-haystack retrieval "
                    "(RULER-style, built with the model's tokenizer and chat template) over context lengths and "
                    "needle depths, scored by log-likelihood ranking against distractor values and by greedy "
                    "decoding; and held-out loss/perplexity on a tokenized dataset (label tokens only, "
                    "token-weighted). Writes OUT/results.json, OUT/results.md and OUT/needle_heatmap.png.")
    off.add_argument("--model", type=existing_dir.path, required=True, help="exported model directory (config.json, "
                     "safetensors weights, tokenizer), e.g. the output of hbp_train.export")
    off.add_argument("--out", type=output_dir.path, required=True,
                     help="directory for the results (created if missing)")
    off.add_argument("--lengths", default=DEFAULT_LENGTHS, type=int_list(1),
                     help=f"needle context lengths in tokens, comma-separated (default {DEFAULT_LENGTHS})")
    off.add_argument("--depths", default=DEFAULT_DEPTHS, type=fraction_list,
                     help="needle depths as fractions of the haystack, 0 = start, 1 = end, comma-separated "
                          f"(default {DEFAULT_DEPTHS})")
    off.add_argument("--trials", type=positive_int, default=4, help="samples per (length, depth) cell (default 4)")
    off.add_argument("--distractors", type=positive_int, default=4,
                     help="wrong values the true one is ranked against in the log-likelihood score (default 4; "
                          "chance is 1/(distractors+1))")
    off.add_argument("--max-new-tokens", type=positive_int, default=16,
                     help="greedy-decoding budget per sample (default 16)")
    off.add_argument("--seed", type=nonneg_int, default=0, help="seed of the needle sample generator (default 0)")
    off.add_argument("--no-needle", action="store_true", help="skip the needle test (perplexity only)")
    off.add_argument("--baseline", default="untrained", metavar="untrained|none|DIR", type=baseline_arg,
                     help="the reference the needle scores are reported beside: 'untrained' (the model's config "
                          "with random weights, seeded by --seed: the measured chance level), a base model "
                          "directory with the same tokenizer (what training started from), or 'none' (default "
                          "untrained)")
    off.add_argument("--dataset", type=existing_dir.path, default=None,
                     help="tokenized dataset directory (data_tools.preprocess output: input_ids, labels, ...) "
                          "for held-out loss and perplexity; omitted = no perplexity")
    off.add_argument("--max-samples", type=positive_int, default=None,
                     help="use only the first N rows of --dataset (default: all rows)")
    off.add_argument("--device", default="auto", help="auto (CUDA if present, else CPU), cpu, cuda, cuda:N")
    off.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16")
    off.add_argument("--threads", type=nonneg_int, default=0,
                     help="CPU threads; 0 = auto: 1 for models under 100M parameters (faster: per-op overhead "
                          "dominates), torch's default otherwise (default 0)")
    off.add_argument("--no-progress", action="store_true", help="hide the progress bars")

    oc = sub.add_parser(
        "opencompass", help="run OpenCompass on the checkpoint: the generated offline suite or stock benchmarks",
        description="Run OpenCompass (in its own venv, see --setup-opencompass) on an exported checkpoint: the "
                    "offline suite we generate in OpenCompass's dataset format (needle grid, multi-key needle, "
                    "variable tracking, demo QA; no download), and/or OpenCompass's stock benchmarks when their "
                    "data is present. Writes everything under --out: the config, the suite, OpenCompass's work dir "
                    "and log, and the results table (results.md, results.json). Runs on the CPU in float32 when no "
                    "GPU is visible, else one model instance per GPU in bfloat16. Exits 1, naming the task and its "
                    "log, when any OpenCompass task failed.")
    oc.add_argument("--model", type=existing_dir.path, required=True,
                    help="exported model directory (HF safetensors + tokenizer)")
    oc.add_argument("--out", type=output_dir.path, required=True,
                    help="directory for everything the run writes (created if missing); OpenCompass runs in it")
    oc.add_argument("--datasets", default="offline",
                    help="'offline' (needle, multikey, variable_tracking, demo_qa: generated, no download), "
                         "'general' (MMLU, MMLU-Pro, CMMLU, BBH, GSM8K, MATH), 'long' (RULER, NeedleBench, "
                         "LongBench), or a comma list of those words and names: needle, multikey, "
                         "variable_tracking, demo_qa, mmlu, mmlu_pro, cmmlu, bbh, gsm8k, math, ruler, needlebench, "
                         "longbench (default offline)")
    oc.add_argument("--lengths", default=DEFAULT_LENGTHS, type=int_list(1),
                    help=f"prompt lengths in tokens of the generated long-context tasks, comma-separated (default "
                         f"{DEFAULT_LENGTHS}); at most --max-seq-len")
    oc.add_argument("--depths", default=DEFAULT_DEPTHS, type=fraction_list,
                    help=f"needle depths of the generated needle tasks, 0 = start, 1 = end (default {DEFAULT_DEPTHS})")
    oc.add_argument("--trials", type=positive_int, default=2,
                    help="generated samples per (length, depth) cell; variable tracking draws as many per length "
                         "(default 2)")
    oc.add_argument("--qa-samples", type=positive_int, default=40, help="questions in the demo QA set (default 40)")
    oc.add_argument("--seed", type=nonneg_int, default=0, help="seed of the generated tasks (default 0)")
    oc.add_argument("--long-lengths", default="32k",
                    help="context lengths for the stock RULER / NeedleBench, comma-separated, e.g. 32k,128k (the "
                         "paper reports RULER-128K); a length a benchmark has no config for is skipped with a "
                         "warning (default 32k)")
    oc.add_argument("--data-cache", type=output_dir.path, default=None,
                    help="stock benchmark data root (archives unzip into ROOT/data/); default $COMPASS_DATA_CACHE, "
                         "else ~/.cache/opencompass")
    oc.add_argument("--max-samples", type=positive_int, default=None,
                    help="evaluate only the first N rows of every dataset (OpenCompass's reader_cfg test_range), "
                         "e.g. for a quick look at stock benchmarks on a CPU (default: all rows)")
    oc.add_argument("--max-seq-len", type=positive_int, default=None,
                    help="longest prompt the model is given (default: max_position_embeddings of config.json)")
    oc.add_argument("--max-out-len", type=positive_int, default=1024,
                    help="longest generated answer for stock benchmarks without their own limit; the generated "
                         "tasks set theirs (default 1024)")
    oc.add_argument("--batch-size", type=positive_int, default=8, help="inference batch size (default 8)")
    oc.add_argument("--num-gpus", type=nonneg_int, default=None,
                    help="GPUs per model instance; 0 = run on the CPU (default: 1 when a GPU is visible, else 0)")
    oc.add_argument("--max-num-workers", type=positive_int, default=None,
                    help="OpenCompass tasks run side by side, each with its own model instance (default: visible "
                         "GPUs / --num-gpus, 1 on the CPU)")
    oc.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float16", "float32"],
                    help="weights dtype OpenCompass loads the model in (default auto: bfloat16 on GPUs, as trained; "
                         "float32 on the CPU, the only choice there)")
    oc.add_argument("--venv", type=output_dir.path, default=argparse.SUPPRESS,
                    help="the OpenCompass virtual environment (default: .venv-opencompass in the repo root)")
    oc.add_argument("--dry-run", action="store_true",
                    help="write the suite and the config and print the command, run nothing (needs no OpenCompass "
                         "install)")

    cmp = sub.add_parser(
        "compare", help="put evaluations of several checkpoints side by side (table + plot)",
        description="Read the results.json of each evaluation folder (offline or opencompass) and write one table "
                    "with a column per run (compare.md, compare.json) and a bar chart of the percentage scores "
                    "(compare.png).")
    cmp.add_argument("runs", type=existing_path.path, nargs="+", metavar="RUN",
                     help="--out folders of earlier 'offline' or 'opencompass' evaluations (or their results.json)")
    cmp.add_argument("--out", type=output_dir.path, required=True,
                     help="directory for compare.md, compare.json, compare.png")
    cmp.add_argument("--labels", default=None,
                     help="comma-separated column names, one per RUN (default: the folder names)")
    return parser


def run_offline(args) -> int:
    from eval.model_io import (check_model_dir, check_same_vocabulary, load_model, load_tokenizer, pick_device,
                               pick_dtype, set_cpu_threads, stop_token_ids)
    from eval.needle import run_needle
    from eval.perplexity import load_tokenized, run_perplexity
    from eval.report import needle_table, plot_needle_heatmap, score_table
    from eval.suite import write_jsonl
    from eval.tasks.needle import NeedleConfig, generate_samples, to_record

    start = time.time()
    lengths, depths = args.lengths, args.depths
    needle_config = NeedleConfig(lengths=lengths, depths=depths, trials=args.trials,
                                 num_distractors=args.distractors, seed=args.seed)
    if args.no_needle and args.dataset is None:
        raise UserError("--no-needle without --dataset leaves nothing to evaluate; add --dataset DIR")
    # Everything that can be wrong with the input fails before the model loads.
    model_dir = check_model_dir(args.model)
    baseline = None if args.no_needle or args.baseline == "none" else args.baseline
    if isinstance(baseline, Path):
        baseline = _baseline_dir(baseline)
    samples = None
    if not args.no_needle:
        _check_lengths_fit(model_dir, needle_config.lengths)
        tokenizer = load_tokenizer(model_dir)
        if isinstance(baseline, Path):
            check_same_vocabulary(model_dir, baseline, tokenizer)
        samples = generate_samples(tokenizer, needle_config)
    if args.dataset is not None:
        load_tokenized(args.dataset)
    out = make_out(args.out)
    if args.no_progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    model, tokenizer = load_model(args.model, device, dtype)
    threads = set_cpu_threads(model, args.threads)

    result = {"model": str(Path(args.model).resolve()), "kind": "offline", "device": str(device),
              "dtype": str(dtype).split(".")[-1], "threads": threads,
              "chat_template": bool(getattr(tokenizer, "chat_template", None)), "scores": [], "needle": None,
              "perplexity": None, "files": {}}
    report = [f"# Offline evaluation of {result['model']}\n"]
    if not args.no_needle:
        # The samples as an OpenCompass dataset: the same rows `eval.run opencompass --datasets needle` generates.
        result["files"]["needle_samples"] = str(write_jsonl(out / "needle.jsonl", [to_record(s) for s in samples]))
        stop_ids = stop_token_ids(model, tokenizer)
        needle = run_needle(model, tokenizer, needle_config, stop_ids, max_new_tokens=args.max_new_tokens,
                            progress=not args.no_progress, samples=samples)
        result["needle"] = needle
        result["scores"] += [{"dataset": "needle (offline)", "metric": metric, "mode": "offline",
                              "score": 100.0 * needle[metric]} for metric in ("loglik_acc", "greedy_acc")]
        result["scores"] += [{"dataset": "needle (offline)", "metric": f"{metric} length {length}",
                              "mode": "breakdown", "score": 100.0 * sum(c[metric] for c in cells) / len(cells)}
                             for metric in ("loglik_acc", "greedy_acc") for length in needle["lengths"]
                             for cells in [[c for c in needle["cells"] if c["length"] == length]]]
    if args.dataset is not None:
        ppl = run_perplexity(model, args.dataset, args.max_samples, progress=not args.no_progress)
        result["perplexity"] = ppl
        result["scores"] += [{"dataset": "held-out", "metric": metric, "mode": "offline", "score": ppl[metric]}
                             for metric in ("loss", "perplexity")]
    if baseline is not None:
        del model  # one model in memory at a time: the reference may be as large
        needle["baseline"] = _score_baseline(args, baseline, model_dir, tokenizer, stop_ids, device, dtype,
                                             needle_config, samples)
        result["scores"] += [{"dataset": "needle (offline)", "metric": f"{metric}, {needle['baseline']['model']}",
                              "mode": "baseline", "score": 100.0 * needle["baseline"][metric]}
                             for metric in ("loglik_acc", "greedy_acc")]
    if not args.no_needle:
        result["files"]["heatmap"] = str(plot_needle_heatmap(needle, out / "needle_heatmap.png"))
        report += ["## Needle in a haystack\n", needle_table(needle)]
    if args.dataset is not None:
        report += ["## Held-out perplexity\n",
                   f"{ppl['num_samples']} samples, {ppl['num_loss_tokens']} label tokens: "
                   f"loss {ppl['loss']:.4f}, perplexity {ppl['perplexity']:.3f}\n"]
    report[1:1] = ["## Scores (%; perplexity and loss as they are)\n",
                   score_table([s for s in result["scores"] if s["mode"] != "breakdown"])]
    result["seconds"] = round(time.time() - start, 2)
    result["files"]["json"] = str(out / "results.json")
    result["files"]["markdown"] = str(out / "results.md")
    (out / "results.md").write_text("\n".join(report))
    (out / "results.json").write_text(json.dumps(result, indent=2) + "\n")
    print("\n".join(report))
    print(f"[eval] wrote {out / 'results.json'}, {out / 'results.md'}"
          + (f", {result['files']['heatmap']}" if "heatmap" in result["files"] else "")
          + f" ({result['seconds']} s)")
    return 0


def _baseline_dir(path: Path) -> Path:
    """``--baseline DIR``: a model directory (config.json and a tokenizer); else the one-line error."""
    from eval.model_io import check_model_dir

    try:
        return check_model_dir(path)
    except UserError as err:
        raise UserError(str(err).replace("--model", "--baseline", 1)) from None


def _score_baseline(args, baseline, model_dir: Path, tokenizer, stop_ids: set[int], device, dtype, needle_config,
                    samples) -> dict:
    """The needle samples scored by the reference model (``--baseline``), loaded or built on ``device``, with the
    evaluated model's tokenizer and stop tokens."""
    from eval.model_io import load_model, set_cpu_threads, untrained_model
    from eval.needle import baseline_needle

    if baseline == "untrained":
        model = untrained_model(model_dir, device, dtype, args.seed)
        label = "untrained baseline"
    else:
        model, _ = load_model(baseline, device, dtype)
        label = f"baseline {baseline.name}"
    set_cpu_threads(model, args.threads)
    return baseline_needle(model, tokenizer, needle_config, stop_ids, samples, label,
                           max_new_tokens=args.max_new_tokens, progress=not args.no_progress)


def _check_lengths_fit(model_dir: Path, lengths: list[int]) -> None:
    """A needle context longer than the model's positions measures nothing and can exhaust memory: refuse it."""
    try:
        limit = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return  # an unreadable config.json is reported by the tokenizer/model load with its own message
    if isinstance(limit, int) and limit > 0 and max(lengths) > limit:
        raise UserError(f"--lengths: {max(lengths)} tokens exceed the model's max_position_embeddings ({limit}, "
                        f"{model_dir / 'config.json'}); use lengths <= {limit}")


def opencompass_options(args):
    """The RunOptions of the opencompass subcommand: devices, dtype and workers resolved, input checked."""
    from eval import benchmarks
    from eval import opencompass as oc
    from eval.model_io import check_model_dir
    from eval.opencompass_venv import DEFAULT_VENV

    model_dir = check_model_dir(args.model)
    stock, generated = oc.parse_datasets(args.datasets)
    gpus = oc.visible_gpus()
    num_gpus = args.num_gpus if args.num_gpus is not None else (1 if gpus else 0)
    if num_gpus > gpus:
        raise UserError(f"--num-gpus {num_gpus}: {gpus} GPU(s) visible; use --num-gpus {gpus} "
                        f"({'the CPU' if gpus == 0 else 'or fewer'})")
    workers = args.max_num_workers if args.max_num_workers is not None else max(1, gpus // max(num_gpus, 1)) \
        if num_gpus else 1
    if num_gpus and workers * num_gpus > gpus:
        raise UserError(f"--max-num-workers {workers} x --num-gpus {num_gpus}: {gpus} GPU(s) visible")
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if num_gpus else "float32")
    lengths, depths = args.lengths, args.depths
    return oc.RunOptions(
        model_dir=model_dir, out=args.out, venv=Path(getattr(args, "venv", None) or DEFAULT_VENV), stock=stock,
        long_lengths=benchmarks.parse_lengths(args.long_lengths, stock), suite=generated, lengths=lengths,
        depths=depths, trials=args.trials, qa_samples=args.qa_samples, seed=args.seed, max_seq_len=args.max_seq_len,
        max_out_len=args.max_out_len, batch_size=args.batch_size, num_gpus=num_gpus, max_num_workers=workers,
        dtype=dtype, data_root=args.data_cache, max_samples=args.max_samples)


def run_opencompass(args) -> int:
    from eval import opencompass as oc

    options = opencompass_options(args)
    device = f"{options.max_num_workers} x {options.num_gpus} GPU" if options.num_gpus else "cpu"
    if args.dry_run:
        prepared = oc.prepare(options)
        print(f"[eval] wrote {prepared.config}")
        print(f"[eval] dry run; would run in {options.out}: " + " ".join(prepared.command))
        return 0
    print(f"[eval] OpenCompass on {device} ({options.dtype}): {', '.join(options.suite + options.stock)}; "
          f"output in {Path(options.out).resolve()}", flush=True)
    result = oc.evaluate(options)
    write_opencompass_results(options, result, device)
    if result.failures:
        oc.echo_failures(result)
        return 1
    return 0


def write_opencompass_results(options, result, device: str) -> None:
    """The results table of the checkpoint: OUT/results.md, OUT/results.json (and the needle heatmap)."""
    from eval import report, suite

    out = Path(options.out)
    scores = list(result.scores)
    for name, breakdown in result.breakdowns.items():
        scores += report.breakdown_scores(suite.ABBR_PREFIX + name, breakdown)
    files = {"json": str(out / "results.json"), "markdown": str(out / "results.md"), "config": str(result.config),
             "log": str(out / "opencompass.log"), "work_dir": str(result.run_dir) if result.run_dir else None}
    heatmap = report.plot_score_grids(result.breakdowns, out / "needle_heatmap.png")
    if heatmap:
        files["heatmap"] = str(heatmap)
    content = {
        "model": str(options.model_dir), "kind": "opencompass", "device": device, "dtype": options.dtype,
        "num_gpus": options.num_gpus, "max_num_workers": options.max_num_workers,
        "datasets": options.suite + options.stock, "long_lengths": options.long_lengths,
        "scores": scores, "breakdowns": result.breakdowns,
        "failures": [{"task": f.task, "log": str(f.log) if f.log else None, "reason": f.reason}
                     for f in result.failures],
        "seconds": round(result.seconds, 1), "files": files,
    }
    lines = [f"# OpenCompass results for {options.model_dir}\n",
             f"{device}, {options.dtype}, {result.seconds:.0f} s; OpenCompass's work dir: {result.run_dir}\n",
             report.score_table(result.scores) if result.scores else "No scores: OpenCompass wrote no summary.\n"]
    for name, breakdown in result.breakdowns.items():
        lines += [f"## {suite.ABBR_PREFIX + name} by {' and '.join(breakdown['group_by'])}\n",
                  report.breakdown_table(name, breakdown)]
    if result.failures:
        lines += ["## Failed tasks\n", *[f"- {f.describe()}" for f in result.failures], ""]
    (out / "results.md").write_text("\n".join(lines))
    (out / "results.json").write_text(json.dumps(content, indent=2) + "\n")
    print("\n".join(lines[:3]))
    print(f"[eval] wrote {out / 'results.md'} and {out / 'results.json'}"
          + (f", {heatmap}" if heatmap else "") + f"; OpenCompass's output: {out / 'opencompass.log'}")


def run_compare(args) -> int:
    from eval import compare

    labels = [t.strip() for t in args.labels.split(",")] if args.labels else None
    comparison = compare.compare(args.runs, labels)
    out = make_out(args.out)
    text = compare.table(comparison)
    (out / "compare.md").write_text("# Checkpoints side by side\n\n" + text)
    (out / "compare.json").write_text(json.dumps(comparison, indent=2) + "\n")
    plot = compare.plot(comparison, out / "compare.png")
    print(text)
    print(f"[eval] wrote {out / 'compare.md'}, {out / 'compare.json'}, {plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    library_bars_on_a_terminal_only()
    with warnings.catch_warnings():
        warnings.showwarning = _one_line_warning
        return _dispatch(parser, args)


def _dispatch(parser: argparse.ArgumentParser, args) -> int:
    try:
        if args.setup_opencompass:
            from eval.opencompass_setup import setup
            from eval.opencompass_venv import DEFAULT_VENV

            code = setup(args.venv or DEFAULT_VENV)
            if code != 0 or args.command is None:
                return code
        if args.command == "offline":
            return run_offline(args)
        if args.command == "opencompass":
            return run_opencompass(args)
        if args.command == "compare":
            return run_compare(args)
        parser.error("choose a subcommand (offline, opencompass or compare) or --setup-opencompass (see --help)")
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_USER_ERROR


if __name__ == "__main__":
    sys.exit(main())
