"""Evaluation CLI: ``python -m eval.run`` (``./launch.sh eval``).

    python -m eval.run offline --model DIR [--dataset TOKENIZED_DIR] --out DIR      no download, CPU or GPU
    python -m eval.run opencompass --model DIR --datasets general|long|LIST --out DIR
    python -m eval.run --setup-opencompass                                            builds .venv-opencompass

User mistakes print one ``error:`` line and exit with code 2; ``--help`` on each subcommand explains every option.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

from eval.model_io import UsageError

DEFAULT_LENGTHS = "256,512,1024"
DEFAULT_DEPTHS = "0,0.25,0.5,0.75,1"


def _one_line_warning(message, category, filename, lineno, file=None, line=None):
    print(f"warning: {message}", file=sys.stderr if file is None else file)


def _int_list(option: str, text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"{option} {text}: need comma-separated integers, e.g. {DEFAULT_LENGTHS}") from None


def _float_list(option: str, text: str) -> list[float]:
    try:
        return [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"{option} {text}: need comma-separated fractions, e.g. {DEFAULT_DEPTHS}") from None


def _make_out(path: Path) -> Path:
    path = Path(path).expanduser().resolve()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"--out {path}: cannot create the directory ({err.strerror})") from None
    return path


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m eval.run",
        description="Evaluate an exported hbp-train checkpoint (an HF safetensors directory with its tokenizer).",
        epilog="Subcommands: 'offline' (local long-context checks, no download) and 'opencompass' (benchmarks "
               "in OpenCompass's own venv). Run 'python -m eval.run SUBCOMMAND --help' for their options.",
    )
    parser.add_argument("--setup-opencompass", action="store_true",
                        help="create the OpenCompass virtual environment (--venv) with python3 -m venv and "
                             "pip-install OpenCompass there; it is kept apart because it needs numpy<2 and "
                             "datasets<4. With no subcommand, exit after the set-up")
    parser.add_argument("--venv", type=Path, default=None,
                        help="the OpenCompass virtual environment (default: .venv-opencompass in the repo root)")
    sub = parser.add_subparsers(dest="command", metavar="{offline,opencompass}")

    off = sub.add_parser(
        "offline", help="needle-in-a-haystack retrieval and held-out perplexity, generated locally",
        description="Offline long-context checks that need no download: needle-in-a-haystack retrieval "
                    "(RULER-style, built with the model's tokenizer and chat template) over context lengths and "
                    "needle depths, scored by log-likelihood ranking against distractor values and by greedy "
                    "decoding; and held-out loss/perplexity on a tokenized dataset (label tokens only, "
                    "token-weighted). Writes OUT/results.json, OUT/results.md and OUT/needle_heatmap.png.")
    off.add_argument("--model", type=Path, required=True, help="exported model directory (config.json, "
                     "safetensors weights, tokenizer), e.g. the output of hbp_train.export")
    off.add_argument("--out", type=Path, required=True, help="directory for the results (created if missing)")
    off.add_argument("--lengths", default=DEFAULT_LENGTHS,
                     help=f"needle context lengths in tokens, comma-separated (default {DEFAULT_LENGTHS})")
    off.add_argument("--depths", default=DEFAULT_DEPTHS,
                     help="needle depths as fractions of the haystack, 0 = start, 1 = end, comma-separated "
                          f"(default {DEFAULT_DEPTHS})")
    off.add_argument("--trials", type=int, default=4, help="samples per (length, depth) cell (default 4)")
    off.add_argument("--distractors", type=int, default=4,
                     help="wrong values the true one is ranked against in the log-likelihood score (default 4; "
                          "chance is 1/(distractors+1))")
    off.add_argument("--max-new-tokens", type=int, default=16, help="greedy-decoding budget per sample (default 16)")
    off.add_argument("--seed", type=int, default=0, help="seed of the needle sample generator (default 0)")
    off.add_argument("--no-needle", action="store_true", help="skip the needle test (perplexity only)")
    off.add_argument("--dataset", type=Path, default=None,
                     help="tokenized dataset directory (data_tools.preprocess output: input_ids, labels, ...) "
                          "for held-out loss and perplexity; omitted = no perplexity")
    off.add_argument("--max-samples", type=int, default=None,
                     help="use only the first N rows of --dataset (default: all rows)")
    off.add_argument("--device", default="auto", help="auto (CUDA if present, else CPU), cpu, cuda, cuda:N")
    off.add_argument("--dtype", default="auto", help="auto (bf16 on GPU, fp32 on CPU), float32, bfloat16, float16")
    off.add_argument("--threads", type=int, default=0,
                     help="CPU threads; 0 = auto: 1 for models under 100M parameters (faster: per-op overhead "
                          "dominates), torch's default otherwise (default 0)")
    off.add_argument("--no-progress", action="store_true", help="hide the progress bars")

    oc = sub.add_parser(
        "opencompass", help="run OpenCompass benchmarks (general / long-context) in its own venv",
        description="Generate an OpenCompass config for the checkpoint (HuggingFacewithChatTemplate when the "
                    "tokenizer has a chat template, else HuggingFaceBaseModel), run it with the opencompass CLI "
                    "of the OpenCompass venv, and collect the scores into OUT/summary.md and OUT/summary.json. "
                    "Benchmark data is read from --data-cache / $COMPASS_DATA_CACHE; when some is missing and "
                    "OpenCompass's data host is unreachable, the error says which archive to unzip where.")
    oc.add_argument("--model", type=Path, required=True, help="exported model directory (HF safetensors + tokenizer)")
    oc.add_argument("--datasets", default="general",
                    help="'general' (MMLU, MMLU-Pro, CMMLU, BBH, GSM8K, MATH), 'long' (RULER, NeedleBench, "
                         "LongBench), or a comma list of those words and names: mmlu, mmlu_pro, cmmlu, bbh, gsm8k, "
                         "math, ruler, needlebench, longbench (default general)")
    oc.add_argument("--long-lengths", default="32k",
                    help="context lengths for RULER / NeedleBench, comma-separated, e.g. 32k,128k (the paper "
                         "reports RULER-128K); a length a benchmark has no config for is skipped with a warning "
                         "(default 32k)")
    oc.add_argument("--out", type=Path, required=True,
                    help="directory for the config, OpenCompass's work dir (OUT/work) and the summary")
    oc.add_argument("--data-cache", type=Path, default=None,
                    help="benchmark data root (archives unzip into ROOT/data/); default $COMPASS_DATA_CACHE, "
                         "else ~/.cache/opencompass")
    oc.add_argument("--max-seq-len", type=int, default=None,
                    help="longest prompt the model is given (default: max_position_embeddings of config.json)")
    oc.add_argument("--max-out-len", type=int, default=1024, help="longest generated answer (default 1024)")
    oc.add_argument("--batch-size", type=int, default=8, help="inference batch size (default 8)")
    oc.add_argument("--num-gpus", type=int, default=1, help="GPUs per model instance (default 1)")
    oc.add_argument("--max-num-workers", type=int, default=1,
                    help="OpenCompass tasks run in parallel, e.g. one per GPU (default 1)")
    oc.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32", "auto"],
                    help="weights dtype OpenCompass loads the model in (default bfloat16, as trained)")
    oc.add_argument("--venv", type=Path, default=argparse.SUPPRESS,
                    help="the OpenCompass virtual environment (default: .venv-opencompass in the repo root)")
    oc.add_argument("--dry-run", action="store_true",
                    help="write the config and print the command, run nothing (needs no OpenCompass install)")
    return parser


def run_offline(args) -> int:
    from eval.model_io import (check_model_dir, load_model, load_tokenizer, pick_device, pick_dtype,
                               set_cpu_threads, stop_token_ids)
    from eval.needle import NeedleConfig, generate_samples, run_needle
    from eval.perplexity import load_tokenized, run_perplexity
    from eval.report import needle_table, plot_needle_heatmap

    start = time.time()
    lengths, depths = _int_list("--lengths", args.lengths), _float_list("--depths", args.depths)
    try:
        needle_config = NeedleConfig(lengths=lengths, depths=depths, trials=args.trials,
                                     num_distractors=args.distractors, max_new_tokens=args.max_new_tokens,
                                     seed=args.seed)
    except ValueError as err:
        field, _, rest = str(err).partition(":")
        option = {"num_distractors": "distractors"}.get(field, field).replace("_", "-")
        raise UsageError(f"--{option}:{rest}") from None
    if args.max_samples is not None and args.max_samples < 1:
        raise UsageError(f"--max-samples {args.max_samples}: need >= 1")
    if args.no_needle and args.dataset is None:
        raise UsageError("--no-needle without --dataset leaves nothing to evaluate; add --dataset DIR")
    # Everything that can be wrong with the input fails before the model loads.
    model_dir = check_model_dir(args.model)
    if not args.no_needle:
        _check_lengths_fit(model_dir, needle_config.lengths)
    samples = None if args.no_needle else generate_samples(load_tokenizer(model_dir), needle_config)
    if args.dataset is not None:
        load_tokenized(args.dataset)
    out = _make_out(args.out)
    if args.no_progress:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    device = pick_device(args.device)
    dtype = pick_dtype(args.dtype, device)
    model, tokenizer = load_model(args.model, device, dtype)
    threads = set_cpu_threads(model, args.threads)

    result = {"model": str(Path(args.model).resolve()), "device": str(device), "dtype": str(dtype).split(".")[-1],
              "threads": threads,
              "chat_template": bool(getattr(tokenizer, "chat_template", None)), "needle": None,
              "perplexity": None, "files": {}}
    report = [f"# Offline evaluation of {result['model']}\n"]
    if not args.no_needle:
        needle = run_needle(model, tokenizer, needle_config, stop_token_ids(model, tokenizer),
                            progress=not args.no_progress, samples=samples)
        result["needle"] = needle
        result["files"]["heatmap"] = str(plot_needle_heatmap(needle, out / "needle_heatmap.png"))
        report += ["## Needle in a haystack\n", needle_table(needle)]
    if args.dataset is not None:
        ppl = run_perplexity(model, args.dataset, args.max_samples, progress=not args.no_progress)
        result["perplexity"] = ppl
        report += ["## Held-out perplexity\n",
                   f"{ppl['num_samples']} samples, {ppl['num_loss_tokens']} label tokens: "
                   f"loss {ppl['loss']:.4f}, perplexity {ppl['perplexity']:.3f}\n"]
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


def _check_lengths_fit(model_dir: Path, lengths: list[int]) -> None:
    """A needle context longer than the model's positions measures nothing and can exhaust memory: refuse it."""
    try:
        limit = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return  # an unreadable config.json is reported by the tokenizer/model load with its own message
    if isinstance(limit, int) and limit > 0 and max(lengths) > limit:
        raise UsageError(f"--lengths: {max(lengths)} tokens exceed the model's max_position_embeddings ({limit}, "
                         f"{model_dir / 'config.json'}); use lengths <= {limit}")


def run_opencompass(args) -> int:
    from eval import opencompass as oc
    from eval.model_io import check_model_dir
    from eval.report import markdown_table

    model_dir = check_model_dir(args.model)
    if not any((model_dir / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        # OpenCompass loads the tokenizer from the model directory only after its own (long) start-up.
        raise UsageError(f"--model {model_dir}: no tokenizer (tokenizer.json, tokenizer.model or vocab.json); "
                         "export the checkpoint with its tokenizer (hbp_train.export copies it)")
    families = oc.parse_datasets(args.datasets)
    for option, value in (("--max-out-len", args.max_out_len), ("--batch-size", args.batch_size),
                          ("--num-gpus", args.num_gpus), ("--max-num-workers", args.max_num_workers),
                          ("--max-seq-len", args.max_seq_len)):
        if value is not None and value < 1:
            raise UsageError(f"{option} {value}: need >= 1")
    venv = Path(args.venv or oc.DEFAULT_VENV)
    root = oc.data_root(args.data_cache)
    if not args.dry_run:
        # Install and data first: when either is missing, its one-line error is all the user sees.
        oc.check_install(venv)
        missing, needs_tiktoken = oc.missing_data(families, root)
        if missing or needs_tiktoken:
            if not oc.have_network():
                raise UsageError(oc.missing_data_message(missing, needs_tiktoken, root))
            print(f"[eval] OpenCompass will download {', '.join(missing + ['tiktoken'] * needs_tiktoken)} "
                  f"into {root}")

    lengths = oc.parse_lengths(args.long_lengths, families)
    max_seq_len = args.max_seq_len
    if max_seq_len is None:
        try:
            config = json.loads((model_dir / "config.json").read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise UsageError(f"--model {model_dir}: config.json is not valid JSON ({err}); re-export the "
                             "checkpoint or pass --max-seq-len") from None
        max_seq_len = int(config.get("max_position_embeddings") or 32768)
    longest = max((_length_tokens(n) for names in lengths.values() for n in names), default=0)
    if longest > max_seq_len:
        warnings.warn(f"--long-lengths: {longest} tokens exceed --max-seq-len {max_seq_len}; OpenCompass will "
                      f"truncate those prompts", stacklevel=1)

    out = _make_out(args.out)
    config_path = out / "opencompass_config.py"
    config_path.write_text(oc.build_config(model_dir, families, lengths, max_seq_len=max_seq_len,
                                           max_out_len=args.max_out_len, batch_size=args.batch_size,
                                           num_gpus=args.num_gpus, dtype=args.dtype))
    work_dir = out / "work"
    command = [str(venv / "bin" / "opencompass"), str(config_path), "-w", str(work_dir),
               "--max-num-workers", str(args.max_num_workers)]
    print(f"[eval] wrote {config_path}")
    if args.dry_run:
        print("[eval] dry run; would run: " + " ".join(command))
        return 0
    print("[eval] running: " + " ".join(command), flush=True)
    returncode = subprocess.run(command, env=oc.subprocess_env(model_dir, root)).returncode
    if returncode != 0:
        print(f"error: OpenCompass exited with code {returncode}; its logs are under {work_dir}", file=sys.stderr)
        return 1
    summary_csv = oc.find_summary(work_dir)
    if summary_csv is None:
        print(f"error: OpenCompass wrote no summary under {work_dir}/*/summary/; see its logs there", file=sys.stderr)
        return 1
    rows = oc.collect(summary_csv)
    models = list(rows[0]["scores"]) if rows else []
    table = markdown_table(["dataset", "metric", "mode", *models],
                           [[r["dataset"], r["metric"], r["mode"], *r["scores"].values()] for r in rows])
    (out / "summary.md").write_text(f"# OpenCompass results for {model_dir}\n\n{table}")
    (out / "summary.json").write_text(json.dumps(
        {"model": str(model_dir), "benchmarks": families, "long_lengths": lengths, "source": str(summary_csv),
         "rows": rows}, indent=2) + "\n")
    print(table)
    print(f"[eval] wrote {out / 'summary.md'} and {out / 'summary.json'}")
    return 0


def _length_tokens(name: str) -> int:
    """'32k' → 32768, '1m' → 1048576 (OpenCompass's naming of context lengths)."""
    scale = {"k": 1024, "m": 1024 * 1024}[name[-1]]
    return int(name[:-1]) * scale


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    with warnings.catch_warnings():
        warnings.showwarning = _one_line_warning
        return _dispatch(parser, args)


def _dispatch(parser: argparse.ArgumentParser, args) -> int:
    try:
        if args.setup_opencompass:
            from eval.opencompass import DEFAULT_VENV, setup_venv

            code = setup_venv(args.venv or DEFAULT_VENV)
            if code != 0 or args.command is None:
                return code
        if args.command == "offline":
            return run_offline(args)
        if args.command == "opencompass":
            return run_opencompass(args)
        parser.error("choose a subcommand (offline or opencompass) or --setup-opencompass; see --help")
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
