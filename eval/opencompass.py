"""OpenCompass on an exported checkpoint: the run config, the run in OpenCompass's venv, its failures, its scores.

This module never imports OpenCompass. ``evaluate`` writes ``OUT/opencompass_config.py`` (ordinary OpenCompass
config: ``models``, ``datasets``, ``infer``/``eval`` runners, ``summarizer``), the generated offline suite under
``OUT/suite/`` when asked for, and runs ``<venv>/bin/opencompass`` with the current directory ``OUT`` (OpenCompass
writes ``tmp/`` and ``.cache/`` there) and its work dir ``OUT/work``; its whole output goes to
``OUT/opencompass.log``.

The model is one ``HuggingFacewithChatTemplate`` (prompts rendered with the model's own template, as an SFT model is
used; ``HuggingFaceBaseModel`` when the tokenizer has none) with the tokenizer's end-of-turn and eos tokens as stop
words. On the CPU (``num_gpus=0``) it runs in fp32, one task at a time unless asked otherwise; on GPUs each task holds
one model instance on ``num_gpus`` GPUs and ``max_num_workers`` tasks run side by side (OpenCompass's
``NumWorkerPartitioner`` splits every dataset into that many parts).

OpenCompass exits 0 even when its tasks fail. A run here fails (``RunResult.failures``) when OpenCompass reports a
task that exited non-zero ("task ... fail, see <log>"), when a result file holds an ``error``, when a generated
dataset has no result, or when no summary was written; each failure names the task and the log file to read.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from eval import benchmarks, suite
from eval.report import make_out
from eval.opencompass_venv import DEFAULT_VENV, check_install
from hbp_train.common.errors import UserError

LOG_NAME = "opencompass.log"
CONFIG_NAME = "opencompass_config.py"
SUITE_DIR = "suite"
GROUPS = {"general": benchmarks.GENERAL, "long": benchmarks.LONG, "offline": suite.SUITE}
# OpenCompass's lines worth showing while it runs (the rest stays in OUT/opencompass.log).
_SHOWN = re.compile(r"launch |fail|failed with code|ERROR|Current exp folder|write (csv|summary)")


def parse_datasets(spec: str) -> tuple[list[str], list[str]]:
    """``--datasets``: ``offline``, ``general``, ``long`` or a comma list of those and single names →
    ``(stock benchmarks, generated tasks)``, each in order and without repeats."""
    stock: list[str] = []
    generated: list[str] = []
    for token in (t.strip().lower() for t in spec.split(",")):
        if not token:
            continue
        for name in GROUPS.get(token, (token,)):
            if name in suite.SUITE:
                generated += [name] if name not in generated else []
            elif name in benchmarks.FAMILIES:
                stock += [name] if name not in stock else []
            else:
                raise UserError(f"--datasets: unknown benchmark {token!r}; choose offline, general, long or any of "
                                f"{', '.join([*suite.SUITE, *benchmarks.FAMILIES])}")
    if not stock and not generated:
        raise UserError("--datasets: empty; choose offline, general, long or a comma list of benchmarks")
    return stock, generated


def visible_gpus() -> int:
    """CUDA GPUs this process may use: ``nvidia-smi -L``'s count, limited by ``CUDA_VISIBLE_DEVICES``. Asks
    nvidia-smi rather than torch, so the command starts without importing torch."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    count = sum(line.startswith("GPU ") for line in listed.stdout.splitlines()) if listed.returncode == 0 else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = []
        for token in (t.strip() for t in visible.split(",")):
            if not token or token.startswith("-"):
                break  # CUDA ignores everything from the first invalid entry on
            ids.append(token)
        count = min(count, len(ids))
    return count


def has_chat_template(model_dir: Path) -> bool:
    """Whether the exported tokenizer carries a chat template (in tokenizer_config.json or chat_template.jinja)."""
    if (model_dir / "chat_template.jinja").is_file() or (model_dir / "chat_template.json").is_file():
        return True
    config = model_dir / "tokenizer_config.json"
    if config.is_file():
        try:
            return bool(json.loads(config.read_text()).get("chat_template"))
        except (json.JSONDecodeError, OSError):
            return False
    return False


def model_abbr(model_dir: Path) -> str:
    """Short name OpenCompass shows in its tables (the directory name, made identifier-safe)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(model_dir).name) or "model"


@dataclass
class RunOptions:
    """One OpenCompass evaluation of one checkpoint."""

    model_dir: Path
    out: Path
    """Everything is written under it: config, generated suite, OpenCompass's work dir and log, results."""
    venv: Path = DEFAULT_VENV
    stock: list[str] = field(default_factory=list)
    """OpenCompass's own benchmarks (``eval/benchmarks.py``)."""
    long_lengths: dict[str, list[str]] = field(default_factory=dict)
    """Context-length configs per long-context stock benchmark."""
    suite: list[str] = field(default_factory=list)
    """Generated tasks (``eval/suite.py``)."""
    lengths: list[int] = field(default_factory=lambda: [256, 512, 1024])
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    trials: int = 2
    qa_samples: int = 40
    seed: int = 0
    max_seq_len: int | None = None
    """Longest prompt (OpenCompass truncates longer ones from the left); default: max_position_embeddings."""
    max_out_len: int = 1024
    batch_size: int = 8
    num_gpus: int = 0
    """GPUs per model instance; 0 = the CPU."""
    max_num_workers: int = 1
    dtype: str = "float32"
    data_root: Path | None = None
    max_samples: int | None = None
    """Only the first N rows of every dataset (``reader_cfg.test_range``)."""
    check_stamp: bool = True
    """Refuse a venv whose set-up did not finish (the set-up's own self-test runs before its stamp exists)."""


@dataclass
class Failure:
    """A task OpenCompass did not finish, and where its log is."""

    task: str
    log: Path | None
    reason: str = "failed"

    def describe(self) -> str:
        who = f"OpenCompass task {self.task}" if "[" in self.task else f"OpenCompass's {self.task}"
        return f"{who} {self.reason}" + (f"; see {self.log}" if self.log else "")


@dataclass
class RunResult:
    """What one run produced."""

    config: Path
    command: list[str]
    returncode: int | None = None
    run_dir: Path | None = None
    """``OUT/work/<timestamp>``: predictions, results, logs and summary of this run."""
    failures: list[Failure] = field(default_factory=list)
    scores: list[dict] = field(default_factory=list)
    """OpenCompass's summary: ``{"dataset", "version", "metric", "mode", "score"}`` (None = not computed)."""
    breakdowns: dict[str, dict] = field(default_factory=dict)
    """Per generated task, its predictions re-scored per group (``suite.breakdown``)."""
    seconds: float = 0.0


def max_positions(model_dir: Path) -> int | None:
    """``max_position_embeddings`` of the export's config.json (None if it has none)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"--model {model_dir}: config.json is not valid JSON ({err}); re-export the checkpoint or "
                        "pass --max-seq-len") from None
    value = config.get("max_position_embeddings")
    return int(value) if isinstance(value, int) and value > 0 else None


def check(options: RunOptions) -> int:
    """Refuse what cannot run (one-line UserError) before anything is written; returns the max_seq_len to use."""
    model_dir = Path(options.model_dir)
    if not any((model_dir / n).is_file() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        # OpenCompass loads the tokenizer from the model directory only after its own (long) start-up.
        raise UserError(f"--model {model_dir}: no tokenizer (tokenizer.json, tokenizer.model or vocab.json); "
                        "export the checkpoint with its tokenizer (hbp_train.export copies it)")
    for option, value in (("--max-out-len", options.max_out_len), ("--batch-size", options.batch_size),
                          ("--max-num-workers", options.max_num_workers), ("--max-seq-len", options.max_seq_len),
                          ("--max-samples", options.max_samples), ("--trials", options.trials)):
        if value is not None and value < 1:
            raise UserError(f"{option} {value}: need >= 1")
    if options.num_gpus < 0:
        raise UserError(f"--num-gpus {options.num_gpus}: need >= 0 (0 = run on the CPU)")
    if options.num_gpus == 0 and options.dtype != "float32":
        raise UserError(f"--dtype {options.dtype} with --num-gpus 0: the CPU runs the model in float32; use "
                        "--dtype auto or float32")
    positions = max_positions(model_dir)
    max_seq_len = options.max_seq_len or positions or 32768
    if options.suite and options.suite != ["demo_qa"]:
        if not options.lengths or min(options.lengths) < 1:
            raise UserError(f"--lengths: need positive token counts, got {options.lengths}")
        if max(options.lengths) > max_seq_len:
            where = "--max-seq-len" if options.max_seq_len else \
                f"the model's max_position_embeddings ({model_dir / 'config.json'})"
            raise UserError(f"--lengths: {max(options.lengths)} tokens exceed {max_seq_len}, {where}; use lengths "
                            f"<= {max_seq_len}")
    longest = max((benchmarks.length_tokens(n) for names in options.long_lengths.values() for n in names), default=0)
    if longest > max_seq_len:
        warnings.warn(f"--long-lengths: {longest} tokens exceed --max-seq-len {max_seq_len}; OpenCompass will "
                      f"truncate those prompts", stacklevel=2)
    return max_seq_len


def stop_words(model_dir: Path, tokenizer) -> list[str]:
    """The tokens that end an answer (end-of-turn of the chat template, eos of tokenizer and generation config),
    as the strings OpenCompass cuts its outputs at."""
    from eval.model_io import stop_token_ids_of_dir

    words = {tokenizer.convert_ids_to_tokens(i) for i in stop_token_ids_of_dir(model_dir, tokenizer)}
    return sorted(w for w in words if w)


def build_config(options: RunOptions, *, max_seq_len: int, stop: list[str],
                 generated: list[suite.SuiteDataset]) -> str:
    """The OpenCompass config file text (see the module doc)."""
    model_dir = Path(options.model_dir).resolve()
    model_type = "HuggingFacewithChatTemplate" if has_chat_template(model_dir) else "HuggingFaceBaseModel"
    imports, dataset_vars, group_exprs, summary_imports = [], [], [], []
    for name in options.stock:
        family = benchmarks.FAMILIES[name]
        for length in options.long_lengths.get(name, [None]):
            alias = f"{name}_{length}_datasets" if length else f"{name}_datasets"
            imports.append(f"    from {family.module.format(length=length)} import {family.variable} as {alias}")
            dataset_vars.append(alias)
            if family.summary_module:
                summary_name = family.summary_name.format(length=length)
                line = f"    from {family.summary_module} import {summary_name}"
                if line not in summary_imports:
                    summary_imports.append(line)
                    group_exprs.append((family.summary_expr or summary_name).format(length=length))
    for dataset in generated:
        # Relative to this config file: OpenCompass's read_base resolves it to suite/<task>_gen.py.
        imports.append(f"    from .{SUITE_DIR}.{dataset.config.stem} import {dataset.variable}")
        dataset_vars.append(dataset.variable)
    workers = options.max_num_workers
    num_datasets = len(dataset_vars)
    model = {
        "abbr": model_abbr(model_dir),
        "path": str(model_dir),
        "tokenizer_path": str(model_dir),
        "model_kwargs": {"torch_dtype": options.dtype},
        "max_seq_len": max_seq_len,
        "max_out_len": options.max_out_len,
        "batch_size": options.batch_size,
        "stop_words": stop,
        "run_cfg": {"num_gpus": options.num_gpus},
    }
    lines = [
        '"""OpenCompass config generated by `python -m eval.run opencompass` (hbp-train). Re-run it from this',
        f"folder with `{Path(options.venv).resolve() / 'bin' / 'opencompass'} {CONFIG_NAME} -w work`;",
        'edit freely."""',
        "",
        "from mmengine.config import read_base",
        "",
        f"from opencompass.models import {model_type}",
        "from opencompass.partitioners import NaivePartitioner, NumWorkerPartitioner",
        "from opencompass.runners import LocalRunner",
        "from opencompass.tasks import OpenICLEvalTask, OpenICLInferTask",
        "",
        "with read_base():",
        *imports,
        *summary_imports,
        "",
        f"datasets = [{', '.join('*' + v for v in dataset_vars)}]",
    ]
    if options.max_samples:
        lines.append(f"datasets = [dict(d, reader_cfg=dict(d['reader_cfg'], test_range='[0:{options.max_samples}]'))"
                     " for d in datasets]")
    lines += [
        "",
        "models = [",
        "    dict(",
        f"        type={model_type},",
        *[f"        {k}={v!r}," for k, v in model.items()],
        "    )",
        "]",
        "",
        f"# {workers} task(s) side by side: inference split into {workers} part(s) (one model instance each), "
        "scoring in as many processes.",
        f"infer = dict(partitioner=dict(type=NumWorkerPartitioner, num_worker={workers}),",
        f"             runner=dict(type=LocalRunner, max_num_workers={workers}, task=dict(type=OpenICLInferTask)))",
        f"eval = dict(partitioner=dict(type=NaivePartitioner, n={max(1, -(-num_datasets // workers))}),",
        f"            runner=dict(type=LocalRunner, max_num_workers={workers}, task=dict(type=OpenICLEvalTask)))",
        "",
        f"summarizer = dict(summary_groups=[{', '.join('*' + e for e in group_exprs)}])",
        "",
    ]
    return "\n".join(lines)


def subprocess_env(model_dir: Path, root: Path) -> dict[str, str]:
    """Environment for the OpenCompass run: the data root, tiktoken's cache, and RULER's tokenizer set to the
    model's own (RULER's default is tiktoken's gpt-4, which would need a download)."""
    env = dict(os.environ)
    env["COMPASS_DATA_CACHE"] = str(root)
    env.setdefault("TIKTOKEN_CACHE_DIR", str(benchmarks.tiktoken_dir(root)))
    env["TOKENIZER_MODEL"] = str(model_dir)
    # Our venv's PYTHONPATH (set by launch.sh) must not leak into OpenCompass's interpreter.
    env.pop("PYTHONPATH", None)
    return env


def prepare(options: RunOptions) -> RunResult:
    """Check the options, write the suite and the config; the command is not run."""
    from eval.model_io import check_model_dir, load_tokenizer

    options.model_dir = check_model_dir(options.model_dir)
    max_seq_len = check(options)
    tokenizer = load_tokenizer(options.model_dir)
    suite_config = suite.SuiteConfig(lengths=options.lengths, depths=options.depths, trials=options.trials,
                                     qa_samples=options.qa_samples, seed=options.seed)
    rows = {name: suite.generate(tokenizer, name, suite_config) for name in options.suite}  # may refuse a length
    out = make_out(options.out)
    options.out = out
    generated = suite.write(out / SUITE_DIR, rows)
    config_path = out / CONFIG_NAME
    config_path.write_text(build_config(options, max_seq_len=max_seq_len, stop=stop_words(options.model_dir,
                                                                                          tokenizer),
                                        generated=generated))
    command = [str(Path(options.venv).resolve() / "bin" / "opencompass"), CONFIG_NAME, "-w", "work"]
    return RunResult(config=config_path, command=command)


def check_ready(options: RunOptions) -> Path:
    """The install, then the stock benchmarks' data; the first thing missing is a one-line UserError."""
    root = benchmarks.data_root(options.data_root)
    if options.check_stamp:
        check_install(options.venv)
    elif not (Path(options.venv) / "bin" / "opencompass").is_file():
        raise UserError(f"OpenCompass is not installed in {options.venv}")
    missing, needs_tiktoken = benchmarks.missing_data(options.stock, root)
    if missing or needs_tiktoken:
        if not benchmarks.have_network():
            raise UserError(benchmarks.missing_data_message(missing, needs_tiktoken, root))
        print(f"[eval] OpenCompass will download {', '.join(missing + ['tiktoken'] * needs_tiktoken)} into {root}")
    return root


def evaluate(options: RunOptions, echo: bool = True) -> RunResult:
    """Write everything, run OpenCompass, and collect failures, scores and breakdowns (see the module doc).
    ``echo`` prints OpenCompass's progress lines (its whole output is in ``OUT/opencompass.log`` either way)."""
    root = check_ready(options)
    result = prepare(options)
    out = Path(options.out)
    for stale in (".cache", "tmp"):  # OpenCompass caches dataset sizes by name; ours change between runs
        shutil.rmtree(out / stale, ignore_errors=True)
    start = time.time()
    lines: list[str] = []
    with open(out / LOG_NAME, "w", encoding="utf-8") as log:
        process = subprocess.Popen(result.command, cwd=out, env=subprocess_env(options.model_dir, root),
                                   stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        for line in process.stdout:
            log.write(line)
            lines.append(line.rstrip("\n"))
            if echo and _SHOWN.search(line):
                print("  " + line.rstrip()[-300:], flush=True)
        result.returncode = process.wait()
    result.seconds = time.time() - start
    result.run_dir = run_dir(out, lines)
    result.failures = failures(out, result, lines, options)
    summary = find_summary(result.run_dir) if result.run_dir else None
    if summary is not None:
        result.scores = collect(summary)
    failed_tasks = " ".join(f.task for f in result.failures)
    for dataset in options.suite:
        abbr = suite.ABBR_PREFIX + dataset
        predictions = load_predictions(result.run_dir, model_abbr(options.model_dir), abbr) if result.run_dir \
            else None
        rows = suite.read_jsonl(out / SUITE_DIR / f"{dataset}.jsonl")
        if options.max_samples:
            rows = rows[:options.max_samples]
        if predictions is not None and len(predictions) == len(rows) and abbr not in failed_tasks:
            result.breakdowns[dataset] = suite.breakdown(dataset, rows, predictions)
    return result


def run_dir(out: Path, lines: list[str]) -> Path | None:
    """This run's ``OUT/work/<timestamp>``, from OpenCompass's "Current exp folder" line."""
    for line in lines:
        match = re.search(r"Current exp folder: (\S+)", line)
        if match:
            return (out / match.group(1)).resolve()
    return None


def failures(out: Path, result: RunResult, lines: list[str], options: RunOptions) -> list[Failure]:
    """Every task OpenCompass did not finish (see the module doc), with its log file."""
    found: list[Failure] = []
    for i, line in enumerate(lines):
        match = re.search(r"task (\S+) fail, see", line)
        if match:
            log = lines[i + 1].strip() if i + 1 < len(lines) else ""
            found.append(Failure(match.group(1), (out / log).resolve() if log else None,
                                 "exited with an error"))
    if result.returncode:
        found.append(Failure("run", out / LOG_NAME, f"exited with code {result.returncode}"))
    if result.run_dir is None or not result.run_dir.is_dir():
        if not found:
            found.append(Failure("run", out / LOG_NAME, "started nothing (no 'Current exp folder' line)"))
        return found
    model = model_abbr(options.model_dir)
    results = result.run_dir / "results" / model
    for path in sorted(results.glob("*.json")):
        try:
            content = json.loads(path.read_text())
        except (OSError, ValueError):
            content = {"error": "unreadable result file"}
        if isinstance(content, dict) and "error" in content:
            found.append(Failure(f"OpenICLEval[{model}/{path.stem}]", _log(result.run_dir, "eval", model, path.stem),
                                 f"reported an error ({str(content['error'])[:200]})"))
    named = " ".join(f.task for f in found)
    for dataset in options.suite:
        abbr = suite.ABBR_PREFIX + dataset
        if not (results / f"{abbr}.json").is_file() and abbr not in named:
            found.append(Failure(f"OpenICLEval[{model}/{abbr}]", _log(result.run_dir, "eval", model, abbr)
                                 or _log(result.run_dir, "infer", model, abbr), "wrote no result"))
    if find_summary(result.run_dir) is None:
        found.append(Failure("summarizer", out / LOG_NAME, f"wrote no summary under {result.run_dir / 'summary'}"))
    return found


def _log(run: Path, stage: str, model: str, abbr: str) -> Path | None:
    """The log of the task that handled ``abbr`` (a task's log is named after its first dataset, or part 0)."""
    for name in (f"{abbr}.out", f"{abbr}_0.out"):
        if (run / "logs" / stage / model / name).is_file():
            return run / "logs" / stage / model / name
    logs = sorted((run / "logs" / stage / model).glob("*.out"))
    return logs[0] if logs else None


def find_summary(run: Path) -> Path | None:
    """The ``summary_<time>.csv`` OpenCompass wrote under ``run/summary/`` (the newest if several)."""
    found = sorted(Path(run).glob("summary/summary_*.csv"))
    return found[-1] if found else None


def collect(summary_csv: Path) -> list[dict]:
    """Rows ``{"dataset", "version", "metric", "mode", "score"}`` from OpenCompass's CSV (header ``dataset,version,
    metric,mode,<model>``; ``-`` marks a score it could not compute, kept as None)."""
    with open(summary_csv, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if not header or header[:4] != ["dataset", "version", "metric", "mode"] or len(header) < 5:
            raise UserError(f"{summary_csv}: not an OpenCompass summary (header {header})")
        rows = []
        for line in reader:
            if not line or not line[0].strip():
                continue
            try:
                score = float(line[4])
            except (ValueError, IndexError):
                score = None
            rows.append({"dataset": line[0], "version": line[1], "metric": line[2], "mode": line[3], "score": score})
    return rows


def load_predictions(run: Path, model: str, abbr: str) -> list[str] | None:
    """The predictions of dataset ``abbr`` in row order: ``predictions/<model>/<abbr>.json``, or its parts
    ``<abbr>_0.json``, ``<abbr>_1.json``, ... when the dataset was split across tasks (as OpenCompass reads them)."""
    folder = Path(run) / "predictions" / model
    if (folder / f"{abbr}.json").is_file():
        parts = [folder / f"{abbr}.json"]
    else:
        parts = []
        while (folder / f"{abbr}_{len(parts)}.json").is_file():
            parts.append(folder / f"{abbr}_{len(parts)}.json")
    if not parts:
        return None
    predictions: list[str] = []
    for part in parts:
        content = json.loads(part.read_text())
        predictions += [content[str(k)]["prediction"] for k in range(len(content))]
    return predictions


def echo_failures(result: RunResult) -> None:
    for failure in result.failures:
        print(f"error: {failure.describe()}", file=sys.stderr)
