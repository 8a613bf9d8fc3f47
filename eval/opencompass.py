"""OpenCompass benchmarks for an exported checkpoint: its own venv, config generation, data checks, results.

OpenCompass 0.5 needs numpy < 2 and datasets < 4, which conflict with the training stack, so it lives in its own
virtual environment (``.venv-opencompass`` in the repo root, made by ``--setup-opencompass``) and runs as a
subprocess. This module never imports OpenCompass: it writes a config file (valid Python in OpenCompass's
``read_base`` style) that the ``opencompass`` CLI of that venv runs, then collects the summary CSV it writes into
one markdown table and one JSON file.

Benchmarks follow the HBP paper's evaluation: general (MMLU, MMLU-Pro, CMMLU, BBH, GSM8K, MATH) and long-context
(RULER, NeedleBench, LongBench), through OpenCompass's stock dataset configs. OpenCompass reads benchmark data
from ``$COMPASS_DATA_CACHE/data/<name>`` and downloads the archive when it is missing; without a network this
module says which archive to place where (exit 2) instead of letting OpenCompass fail deep inside a worker.
"""

from __future__ import annotations

import csv
import importlib.metadata
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

from eval.model_io import UsageError

REPO = Path(__file__).resolve().parent.parent
DEFAULT_VENV = REPO / ".venv-opencompass"
OPENCOMPASS_REQUIREMENT = "opencompass>=0.5.4,<0.6"
DATA_HOST = "opencompass.oss-cn-shanghai.aliyuncs.com"
DATA_URL = f"http://{DATA_HOST}/datasets/data/{{name}}.zip"  # OpenCompass's own archive URLs (datasets_info.py)
# NeedleBench counts tokens with tiktoken's gpt-4 encoding, which tiktoken downloads once into its cache, under the
# SHA-1 of the URL as the file name.
TIKTOKEN_URL = "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken"
TIKTOKEN_FILE = "9b5ad71b2ce5302211f9c61530b329a4922fc6a4"


@dataclass(frozen=True)
class Family:
    """One benchmark as OpenCompass configures it."""

    module: str
    """Dataset config module; ``{length}`` is replaced by each context length for long-context benchmarks."""
    variable: str
    """The list of dataset dicts that module defines."""
    data_dir: str
    """Directory under ``$COMPASS_DATA_CACHE/data/``; the archive OpenCompass downloads is ``<data_dir>.zip``."""
    summary_module: str | None = None
    """Module with summary groups (averages over subsets), or None."""
    summary_name: str | None = None
    """Name imported from ``summary_module``; ``{length}`` as above."""
    summary_expr: str | None = None
    """Python expression giving the list of groups from the imported name (default: the name itself)."""
    lengths: tuple[str, ...] = ()
    """Context lengths OpenCompass ships configs for (long-context benchmarks only)."""


FAMILIES: dict[str, Family] = {
    "mmlu": Family("opencompass.configs.datasets.mmlu.mmlu_gen", "mmlu_datasets", "mmlu",
                   "opencompass.configs.summarizers.groups.mmlu", "mmlu_summary_groups"),
    "mmlu_pro": Family("opencompass.configs.datasets.mmlu_pro.mmlu_pro_gen", "mmlu_pro_datasets", "mmlu_pro",
                       "opencompass.configs.summarizers.groups.mmlu_pro", "mmlu_pro_summary_groups"),
    "cmmlu": Family("opencompass.configs.datasets.cmmlu.cmmlu_gen", "cmmlu_datasets", "cmmlu",
                    "opencompass.configs.summarizers.groups.cmmlu", "cmmlu_summary_groups"),
    "bbh": Family("opencompass.configs.datasets.bbh.bbh_gen", "bbh_datasets", "BBH",
                  "opencompass.configs.summarizers.groups.bbh", "bbh_summary_groups"),
    "gsm8k": Family("opencompass.configs.datasets.gsm8k.gsm8k_gen", "gsm8k_datasets", "gsm8k"),
    "math": Family("opencompass.configs.datasets.math.math_gen", "math_datasets", "math"),
    "ruler": Family("opencompass.configs.datasets.ruler.ruler_{length}_gen", "ruler_datasets", "ruler",
                    "opencompass.configs.summarizers.groups.ruler", "ruler_summary_groups",
                    lengths=("4k", "8k", "16k", "32k", "64k", "128k", "256k", "512k", "1m")),
    "needlebench": Family("opencompass.configs.datasets.needlebench.needlebench_{length}.needlebench_{length}",
                          "needlebench_datasets", "needlebench",
                          "opencompass.configs.summarizers.needlebench", "needlebench_{length}_summarizer",
                          "needlebench_{length}_summarizer['summary_groups']",
                          lengths=("4k", "8k", "32k", "128k", "200k", "256k", "1000k")),
    "longbench": Family("opencompass.configs.datasets.longbench.longbench", "longbench_datasets", "Longbench",
                        "opencompass.configs.summarizers.groups.longbench", "longbench_summary_groups"),
}
GENERAL = ("mmlu", "mmlu_pro", "cmmlu", "bbh", "gsm8k", "math")
LONG = ("ruler", "needlebench", "longbench")


def parse_datasets(spec: str) -> list[str]:
    """``general``, ``long`` or a comma list of those and benchmark names → ordered, de-duplicated names."""
    names: list[str] = []
    for token in (t.strip().lower() for t in spec.split(",")):
        if not token:
            continue
        expanded = GENERAL if token == "general" else LONG if token == "long" else (token,)
        for name in expanded:
            if name not in FAMILIES:
                raise UsageError(f"--datasets: unknown benchmark {token!r}; choose general, long or any of "
                                 f"{', '.join(FAMILIES)}")
            if name not in names:
                names.append(name)
    if not names:
        raise UsageError("--datasets: empty; choose general, long or a comma list of benchmarks")
    return names


def parse_lengths(spec: str, families: list[str]) -> dict[str, list[str]]:
    """Context lengths per long-context benchmark; a length a benchmark has no config for is skipped with a
    warning, and a benchmark left with none is an error."""
    wanted = [t.strip().lower() for t in spec.split(",") if t.strip()]
    if not wanted:
        raise UsageError("--long-lengths: empty; give e.g. 32k or 32k,128k")
    chosen: dict[str, list[str]] = {}
    for name in families:
        family = FAMILIES[name]
        if not family.lengths:
            continue
        have = [n for n in wanted if n in family.lengths]
        lacking = [n for n in wanted if n not in family.lengths]
        if not have:
            raise UsageError(f"--long-lengths {spec}: {name} has configs only for {', '.join(family.lengths)}")
        if lacking:
            warnings.warn(f"--long-lengths: {name} has no config for {', '.join(lacking)}; running "
                          f"{', '.join(have)} only", stacklevel=2)
        chosen[name] = have
    return chosen


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
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", model_dir.name) or "model"


def build_config(model_dir: Path, families: list[str], lengths: dict[str, list[str]], *, max_seq_len: int,
                 max_out_len: int, batch_size: int, num_gpus: int, dtype: str = "bfloat16") -> str:
    """The OpenCompass config file text: ``models``, ``datasets`` and a ``summarizer`` with the benchmarks'
    summary groups. A model with a chat template uses ``HuggingFacewithChatTemplate`` (prompts rendered with the
    model's own template, as an SFT model is used); without one, ``HuggingFaceBaseModel``."""
    model_dir = Path(model_dir).resolve()
    model_type = "HuggingFacewithChatTemplate" if has_chat_template(model_dir) else "HuggingFaceBaseModel"
    imports, dataset_vars, group_exprs = [], [], []
    summary_imports: list[str] = []
    for name in families:
        family = FAMILIES[name]
        for length in lengths.get(name, [None]):
            module = family.module.format(length=length)
            alias = f"{name}_{length}_datasets" if length else f"{name}_datasets"
            imports.append(f"    from {module} import {family.variable} as {alias}")
            dataset_vars.append(alias)
            if family.summary_module:
                summary_name = family.summary_name.format(length=length)
                line = f"    from {family.summary_module} import {summary_name}"
                if line not in summary_imports:
                    summary_imports.append(line)
                    group_exprs.append((family.summary_expr or summary_name).format(length=length))
    model = {
        "abbr": model_abbr(model_dir),
        "path": str(model_dir),
        "tokenizer_path": str(model_dir),
        "model_kwargs": {"torch_dtype": dtype},
        "max_seq_len": max_seq_len,
        "max_out_len": max_out_len,
        "batch_size": batch_size,
        "run_cfg": {"num_gpus": num_gpus},
    }
    model_lines = [f"        type={model_type},"] + [f"        {k}={v!r}," for k, v in model.items()]
    return "\n".join([
        '"""OpenCompass config generated by `python -m eval.run opencompass` (hbp-train). Re-run it with',
        f"`{DEFAULT_VENV.name}/bin/opencompass THIS_FILE -w WORK_DIR`; edit freely.\"\"\"",
        "",
        "from mmengine.config import read_base",
        "",
        f"from opencompass.models import {model_type}",
        "",
        "with read_base():",
        *imports,
        *summary_imports,
        "",
        f"datasets = [{', '.join('*' + v for v in dataset_vars)}]",
        "",
        "models = [",
        "    dict(",
        *model_lines,
        "    )",
        "]",
        "",
        f"summarizer = dict(summary_groups=[{', '.join('*' + e for e in group_exprs)}])",
        "",
    ])


def data_root(explicit: Path | None) -> Path:
    """Where OpenCompass finds benchmark data: ``--data-cache``, else ``$COMPASS_DATA_CACHE``, else its own
    default ``~/.cache/opencompass``. Archives unpack into ``<root>/data/``."""
    if explicit is not None:
        return Path(explicit).expanduser().resolve()
    env = os.environ.get("COMPASS_DATA_CACHE")
    return Path(env).expanduser().resolve() if env else Path("~/.cache/opencompass").expanduser()


def tiktoken_dir(root: Path) -> Path:
    """tiktoken's cache directory as the subprocess will see it (we pin it under the data root if unset)."""
    env = os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
    return Path(env).expanduser().resolve() if env else root / "tiktoken"


def missing_data(families: list[str], root: Path) -> tuple[list[str], bool]:
    """``(missing data directories, whether the tiktoken gpt-4 encoding is missing)`` for these benchmarks.
    OpenCompass also looks in ``~/.cache/opencompass/data`` before downloading, so that counts as present."""
    fallback = Path("~/.cache/opencompass").expanduser() / "data"
    missing = []
    for name in families:
        data_dir = FAMILIES[name].data_dir
        if not (root / "data" / data_dir).is_dir() and not (fallback / data_dir).is_dir() and data_dir not in missing:
            missing.append(data_dir)
    needs_tiktoken = "needlebench" in families and not (tiktoken_dir(root) / TIKTOKEN_FILE).is_file()
    return missing, needs_tiktoken


def have_network(host: str = DATA_HOST, port: int = 80, timeout: float = 3.0) -> bool:
    """Whether OpenCompass's data host answers (it downloads missing archives from there)."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def missing_data_message(missing: list[str], needs_tiktoken: bool, root: Path) -> str:
    """One line saying exactly which archive (and tiktoken file) to place where."""
    parts = []
    if missing:
        urls = " ".join(DATA_URL.format(name=d) for d in missing)
        parts.append(f"download {urls} and unzip each into {root / 'data'}/ (so that "
                     f"{', '.join(str(root / 'data' / d) + '/' for d in missing)} exist)")
    if needs_tiktoken:
        parts.append(f"save {TIKTOKEN_URL} as {tiktoken_dir(root) / TIKTOKEN_FILE} (NeedleBench's gpt-4 tokenizer)")
    return (f"OpenCompass benchmark data is missing and {DATA_HOST} is unreachable: " + "; and ".join(parts)
            + f"; the data root is --data-cache, else $COMPASS_DATA_CACHE (now {root})")


def check_install(venv: Path) -> Path:
    """The ``opencompass`` entry point of the venv, or a one-line UsageError telling how to install it."""
    exe = Path(venv) / "bin" / "opencompass"
    if not exe.is_file():
        raise UsageError(f"OpenCompass is not installed in {venv}: run ./launch.sh eval --setup-opencompass")
    return exe


def setup_venv(venv: Path = DEFAULT_VENV) -> int:
    """Create the OpenCompass venv with ``python3 -m venv`` and pip-install OpenCompass into it. torch is
    installed first at the main venv's version, so a CPU machine gets the CPU build instead of a multi-GB CUDA one
    (see shared/TECH-NOTES.md)."""
    venv = Path(venv)
    python = shutil.which("python3") or sys.executable
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install"]
    steps = []
    if not (venv / "bin" / "python").is_file():
        steps.append(("create the virtual environment", [python, "-m", "venv", str(venv)]))
    steps.append(("upgrade pip", pip + ["-q", "--upgrade", "pip"]))
    try:
        torch_version = importlib.metadata.version("torch").split("+")[0]
        steps.append((f"install torch=={torch_version}", pip + ["-q", f"torch=={torch_version}"]))
    except importlib.metadata.PackageNotFoundError:
        pass  # OpenCompass then pulls its own torch
    steps.append((f"install {OPENCOMPASS_REQUIREMENT}", pip + ["-q", OPENCOMPASS_REQUIREMENT]))
    for title, command in steps:
        print(f"[eval] {title}: {' '.join(command)}", flush=True)
        if subprocess.run(command).returncode != 0:
            print(f"error: OpenCompass set-up failed at '{title}' (output above); fix it and re-run "
                  f"./launch.sh eval --setup-opencompass", file=sys.stderr)
            return 2
    print(f"[eval] OpenCompass installed in {venv}; run: ./launch.sh eval opencompass --model DIR --datasets general")
    return 0


def find_summary(work_dir: Path) -> Path | None:
    """The newest ``summary_<time>.csv`` OpenCompass wrote under ``work_dir/<time>/summary/``."""
    found = sorted(Path(work_dir).glob("*/summary/summary_*.csv"), key=lambda p: (p.parent.parent.name, p.name))
    return found[-1] if found else None


def collect(summary_csv: Path) -> list[dict]:
    """Rows ``{"dataset", "metric", "mode", "version", "scores": {model: float or None}}`` from OpenCompass's CSV
    (header ``dataset,version,metric,mode,<model>...``; ``-`` marks a score it could not compute)."""
    with open(summary_csv, newline="", encoding="utf-8") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if not header or header[:4] != ["dataset", "version", "metric", "mode"]:
            raise UsageError(f"{summary_csv}: not an OpenCompass summary (header {header})")
        models = header[4:]
        rows = []
        for line in reader:
            if not line or not line[0].strip():
                continue
            scores = {}
            for model, value in zip(models, line[4:]):
                try:
                    scores[model] = float(value)
                except ValueError:
                    scores[model] = None
            rows.append({"dataset": line[0], "version": line[1], "metric": line[2], "mode": line[3],
                         "scores": scores})
    return rows


def subprocess_env(model_dir: Path, root: Path) -> dict[str, str]:
    """Environment for the OpenCompass run: the data root, tiktoken's cache, and RULER's tokenizer set to the
    model's own (RULER's default is tiktoken's gpt-4, which would need a download)."""
    env = dict(os.environ)
    env["COMPASS_DATA_CACHE"] = str(root)
    env.setdefault("TIKTOKEN_CACHE_DIR", str(tiktoken_dir(root)))
    env["TOKENIZER_MODEL"] = str(model_dir)
    # Our venv's PYTHONPATH (set by launch.sh) must not leak into OpenCompass's interpreter.
    env.pop("PYTHONPATH", None)
    return env
