"""OpenCompass's stock benchmarks: which config modules they live in, where their data goes, and what is missing.

Benchmarks follow the HBP paper's evaluation: general (MMLU, MMLU-Pro, CMMLU, BBH, GSM8K, MATH) and long-context
(RULER, NeedleBench, LongBench), through OpenCompass's own dataset configs (``opencompass.configs.datasets.*``).
OpenCompass reads benchmark data from ``$COMPASS_DATA_CACHE/data/<name>`` and downloads the archive when it is
missing; without a network, ``missing_data_message`` says which archive to place where (exit 2) instead of letting
OpenCompass fail deep inside a worker. The offline suite (``eval/suite.py``) needs none of this.
"""

from __future__ import annotations

import os
import socket
import warnings
from dataclasses import dataclass
from pathlib import Path

from hbp_train.common.errors import UserError

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


def parse_lengths(spec: str, families: list[str]) -> dict[str, list[str]]:
    """Context lengths per long-context benchmark; a length a benchmark has no config for is skipped with a
    warning, and a benchmark left with none is an error."""
    wanted = [t.strip().lower() for t in spec.split(",") if t.strip()]
    if not wanted:
        raise UserError("--long-lengths: empty; give e.g. 32k or 32k,128k")
    chosen: dict[str, list[str]] = {}
    for name in families:
        family = FAMILIES[name]
        if not family.lengths:
            continue
        have = [n for n in wanted if n in family.lengths]
        lacking = [n for n in wanted if n not in family.lengths]
        if not have:
            raise UserError(f"--long-lengths {spec}: {name} has configs only for {', '.join(family.lengths)}")
        if lacking:
            warnings.warn(f"--long-lengths: {name} has no config for {', '.join(lacking)}; running "
                          f"{', '.join(have)} only", stacklevel=2)
        chosen[name] = have
    return chosen


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


def length_tokens(name: str) -> int:
    """'32k' → 32768, '1m' → 1048576 (OpenCompass's naming of context lengths)."""
    scale = {"k": 1024, "m": 1024 * 1024}[name[-1]]
    return int(name[:-1]) * scale
