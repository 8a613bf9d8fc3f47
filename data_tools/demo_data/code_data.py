"""Real-text SFT data made on the user's machine: chats built from the Python standard library of this interpreter
(``make_code_data()``, run by ``python -m data_tools.make_code_data``).

Nothing is downloaded and nothing is shipped: the source files come from ``sysconfig``'s ``stdlib`` folder (or
``--source-dir``). Each module gives at most ``--long-per-module`` long and ``--short-per-module`` short tasks
(code_tasks.py): a long one is the whole module with one function's body removed and a request to write
it, answered by the removed body; the short ones are a docstring -> the function, a function -> a one-line summary
(its docstring's first line), a class -> its methods. Most samples are short; the long ones are as long as their
module, which gives the long tail.

Steps, each deterministic (same interpreter, same flags -> byte-identical files):

1. Walk the ``*.py`` files in path order. Skipped, and counted by reason in report.json: files under
   ``site-packages``/``dist-packages``, test packages (a folder named ``test``, ``tests`` or ``idle_test``, or a
   ``test_*.py`` file), modules ``--modules`` leaves out, files that do not decode or parse, and modules with
   no function or class fit for a task.
2. Split by module: ``round(--heldout-fraction * modules)`` modules, ranked by a hash of the seed and the module
   name, are held out; no module gives samples to both splits.
3. ``--max-samples``: when more samples were made, a seeded draw keeps each split's share of the total.
4. Train a byte-level BPE (bpe_tokenizer.py, ``--vocab-size``) on the text of the train split's
   samples; held-out text is never seen by it.
5. Measure every sample in tokens of that tokenizer, rendered with its chat template (the length
   data_tools.preprocess gives it). A long sample above ``--max-tokens`` is cut to a window of its module around
   the function (the top-level imports kept at the top; code_tasks.LongSource); one whose function alone does not
   fit is dropped (``function_too_long``), a short one above the cap is dropped (``overlong``). Every drop is a line
   of dropped.jsonl and a count in report.json.
6. Write, in a staging folder swapped in at the end, ``OUT/train.jsonl`` and ``OUT/heldout.jsonl`` (OpenAI
   ``messages`` records, shuffled with the seed, each with a ``meta`` {module, file, task, target[, lines]} that
   preprocess ignores), ``OUT/tokenizer/``, ``OUT/dropped.jsonl`` and ``OUT/report.json`` (counts, per-reason
   skips and drops, per split: samples per task, tokens, length percentiles and histogram). With ``--tokenize``,
   data_tools.preprocess then writes ``OUT/tokenized/train`` and ``OUT/tokenized/heldout``.

Library: ``make_code_data(out, seed=0, ...) -> report`` (the dict written to report.json), raising ``UserError``.
"""

from __future__ import annotations

import ast
import hashlib
import json
import random
import shutil
import sys
import sysconfig
import tokenize as pytokenize
from collections import Counter
from pathlib import Path

import numpy as np

from data_tools.demo_data import bpe_tokenizer
from data_tools.demo_data.code_tasks import TASKS, Task, make_tasks, module_name
from hbp_train.common.errors import UserError
from hbp_train.common.outputs import replace_dir, staging_dir

SKIP_REASONS = {
    "site_packages": "installed third-party code (a site-packages or dist-packages folder)",
    "test_package": "a test package (a folder named test, tests or idle_test) or a test_*.py file",
    "not_selected": "a module --modules leaves out",
    "parse_error": "the file does not decode or parse as Python of this interpreter",
    "no_tasks": "no function or class fit for any task",
}
DROP_REASONS = {
    "over_max_samples": "more samples than --max-samples: the seeded draw left it out",
    "function_too_long": "a fill_body sample whose function and imports alone are longer than --max-tokens",
    "overlong": "a short sample longer than --max-tokens",
}
TEST_FOLDERS = {"test", "tests", "idle_test"}
SPLITS = ("train", "heldout")
ROLE_TEXTS = ["system\n", "user\n", "assistant\n"]  # the chat template's role lines, as bpe_tokenizer adds them
FRACTION_ABOVE = (1024, 4096, 8192)
REPORT_KEY = "tool"  # report.json starts with {"tool": "make_code_data", ...}: how an earlier output is recognised
MAX_FIT_TRIES = 8


def stdlib_dir() -> Path:
    """The standard library folder of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def find_sources(root: Path, modules: list[str] | None) -> tuple[list[tuple[str, str, ast.Module]], Counter, list]:
    """([(relpath, source, tree)] of the usable files in path order, skip counts by reason, files that failed to
    parse); ``modules``: dotted names whose modules (and submodules) are kept, all when None."""
    skipped, parse_errors, sources = Counter(), [], []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        relpath = path.relative_to(root).as_posix()
        parts = relpath.split("/")
        name = module_name(relpath)
        if {"site-packages", "dist-packages"} & set(parts):
            skipped["site_packages"] += 1
        elif TEST_FOLDERS & set(parts[:-1]) or parts[-1].startswith("test_"):
            skipped["test_package"] += 1
        elif modules is not None and not any(name == m or name.startswith(m + ".") for m in modules):
            skipped["not_selected"] += 1
        else:
            try:
                with pytokenize.open(path) as f:  # honours a coding cookie, as Python does
                    source = f.read()
                sources.append((relpath, source, ast.parse(source, relpath)))
            except (SyntaxError, UnicodeDecodeError, ValueError, OSError):
                skipped["parse_error"] += 1
                parse_errors.append(relpath)
    return sources, skipped, parse_errors


def heldout_modules(names: list[str], fraction: float, seed: int) -> set[str]:
    """The first ``round(fraction * len(names))`` names (at least one, at most all but one, when fraction > 0)
    ranked by a hash of the seed and the name: no dependence on the order of ``names``, none on the platform."""
    if fraction == 0 or len(names) < 2:
        return set()
    count = min(len(names) - 1, max(1, round(fraction * len(names))))
    rank = sorted(names, key=lambda n: hashlib.blake2b(f"{seed}/{n}".encode(), digest_size=8).digest())
    return set(rank[:count])


class _Lengths:
    """Token lengths of chats rendered with the tokenizer's chat template, as data_tools.preprocess tokenizes them
    (the Rust tokenizer called directly: transformers' wrapper around it costs more than the tokenizing)."""

    def __init__(self, tokenizer_dir: Path):
        from data_tools.preprocessing.chat_labels import ChatEncoder

        self.encoder = ChatEncoder(str(tokenizer_dir))
        self.backend = self.encoder.tokenizer.backend_tokenizer

    def of(self, tasks: list[Task]) -> list[int]:
        texts = [self.encoder.render(t.messages()) for t in tasks]
        return [len(e.ids) for e in self.backend.encode_batch_fast(texts, add_special_tokens=False)]

    def per_line(self, lines: tuple[str, ...]) -> np.ndarray:
        """Tokens of each line, from one encoding of the whole text (a token counts for the line it starts on)."""
        encoding = self.backend.encode("".join(lines), add_special_tokens=False)
        line_starts = np.cumsum([0] + [len(line) for line in lines[:-1]])
        token_starts = np.asarray([start for start, _ in encoding.offsets], dtype=np.int64)
        return np.bincount(np.searchsorted(line_starts, token_starts, side="right") - 1, minlength=len(lines))


def fit(task: Task, lengths: _Lengths, max_tokens: int) -> tuple[Task, int] | None:
    """A fill_body task cut to the widest window of its module around the function that fits ``max_tokens``, with
    its length; None if even the function alone (with the imports) does not fit."""
    f0, f1 = task.long.span
    smallest = task.cut(f0, f1)
    [smallest_len] = lengths.of([smallest])
    if smallest_len > max_tokens:
        return None
    line_tokens = lengths.per_line(task.long.lines).tolist()
    budget = max_tokens - smallest_len
    for _ in range(MAX_FIT_TRIES):
        lo, hi = _grow(line_tokens, f0, f1, budget)
        cut = task.cut(lo, hi)
        [length] = lengths.of([cut])
        if length <= max_tokens:
            return cut, length
        budget -= 2 * (length - max_tokens)  # the lines' own counts miss the left-out markers: aim lower
    return smallest, smallest_len


def _grow(line_tokens: list[int], lo: int, hi: int, budget: int) -> tuple[int, int]:
    """Widen [lo, hi) one line above, one below, in turn, while the added lines' tokens stay within ``budget``."""
    used, grew = 0, True
    while grew:
        grew = False
        if lo > 0 and used + line_tokens[lo - 1] <= budget:
            lo, used, grew = lo - 1, used + line_tokens[lo - 1], True
        if hi < len(line_tokens) and used + line_tokens[hi] <= budget:
            hi, used, grew = hi + 1, used + line_tokens[hi], True
    return lo, hi


def length_stats(lengths: list[int], max_tokens: int) -> dict:
    """Tokens, percentiles, the share above 1K/4K/8K and a power-of-two histogram of one split's lengths (bins
    (0, 128], (128, 256], ..., up to ``max_tokens``)."""
    a = np.asarray(lengths, dtype=np.int64)
    edges = [0] + [2 ** k for k in range(7, max(7, max_tokens.bit_length()))] + [max_tokens]
    edges = sorted(set(e for e in edges if e <= max_tokens))
    bins = np.searchsorted(edges, a, side="left") - 1  # bin i holds the lengths in (edges[i], edges[i + 1]]
    stats = {"tokens": int(a.sum()), "length_percentiles": {}, "fraction_above": {},
             "histogram": {"edges": edges, "counts": np.bincount(bins, minlength=len(edges) - 1).tolist()}}
    if len(a):
        stats["length_percentiles"] = {**{f"p{q}": int(np.percentile(a, q)) for q in (50, 90, 99)},
                                       "min": int(a.min()), "max": int(a.max()), "mean": round(float(a.mean()), 1)}
        stats["fraction_above"] = {str(t): round(float(np.mean(a > t)), 4) for t in FRACTION_ABOVE}
    return stats


def _check_out(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out}: is a file; pass a folder path")
    report = out / "report.json"
    ours = report.is_file() and report.read_text().startswith(f'{{\n  "{REPORT_KEY}": "make_code_data"')
    if out.is_dir() and any(out.iterdir()) and not ours:
        raise UserError(f"--out {out}: the folder is not empty and holds no earlier make_code_data output; choose a "
                        f"new or empty folder")


def make_code_data(out: str | Path, seed: int = 0, heldout_fraction: float = 0.1, max_tokens: int = 16384,
                   max_samples: int | None = 5000, long_per_module: int = 1, short_per_module: int = 6,
                   vocab_size: int = 4096, modules: list[str] | None = None, source_dir: str | Path | None = None,
                   tokenize: bool = False, progress: bool | None = None) -> dict:
    """Build the dataset in folder ``out`` (see the module docstring) and return its report (report.json).

    ``max_samples=None``: no cap on the count. ``modules``: dotted names to keep (with their submodules).
    ``tokenize``: also run data_tools.preprocess into ``out/tokenized/{train,heldout}`` (``--max-len max_tokens``).
    ``progress=None`` shows bars only on a terminal. Raises UserError (one line) for bad arguments or output."""
    out = Path(out)
    root = Path(source_dir) if source_dir is not None else stdlib_dir()
    if long_per_module + short_per_module == 0:
        raise UserError("--long-per-module and --short-per-module are both 0; ask for at least one task per module")
    if not 0 <= heldout_fraction < 1:
        raise UserError(f"--heldout-fraction {heldout_fraction} must be in [0, 1)")
    if not root.is_dir():
        raise UserError(f"--source-dir {root}: no such folder; pass a folder of Python files")
    _check_out(out)
    options = dict(seed=seed, heldout_fraction=heldout_fraction, max_tokens=max_tokens, max_samples=max_samples,
                   long_per_module=long_per_module, short_per_module=short_per_module, vocab_size=vocab_size,
                   modules=modules, tokenize=tokenize)
    disable = None if progress is None else not progress

    made, files = _made_per_module(root, modules, seed, long_per_module, short_per_module, disable)
    heldout = heldout_modules(sorted(made), heldout_fraction, seed)
    splits = {s: [t for r, tasks in made.items() if (r in heldout) == (s == "heldout") for t in tasks]
              for s in SPLITS}
    num_made = sum(len(tasks) for tasks in splits.values())
    dropped = _draw(splits, max_samples, seed) if max_samples is not None and num_made > max_samples else []

    work = staging_dir(out)
    try:
        train_text = ROLE_TEXTS + [m["content"] for t in splits["train"] for m in t.messages()]
        bpe_tokenizer.train(work / "tokenizer", vocab_size, train_text)
        lengths = _Lengths(work / "tokenizer")
        kept, num_cut = {}, {}
        for split, tasks in splits.items():
            kept[split], num_cut[split] = _cap(tasks, lengths, max_tokens, dropped, disable, split)
            random.Random(f"{seed}/order/{split}").shuffle(kept[split])
        report = _report(root, files, made, heldout, kept, num_cut, dropped, num_made, options)
        for split in SPLITS:
            with open(work / f"{split}.jsonl", "w", encoding="utf-8") as f:
                for task, _ in kept[split]:
                    f.write(json.dumps({"messages": task.messages(), "meta": task.meta()}, ensure_ascii=False) + "\n")
        with open(work / "dropped.jsonl", "w", encoding="utf-8") as f:
            for task, reason in dropped:
                f.write(json.dumps({**task.meta(), "reason": reason}) + "\n")
        (work / "report.json").write_text(json.dumps(report, indent=2) + "\n")
        replace_dir(work, out)
    except OSError as e:
        raise UserError(f"--out {out}: cannot write ({e.strerror or e}); pass a writable folder") from None
    finally:
        shutil.rmtree(work, ignore_errors=True)  # gone already when swapped in
    if tokenize:
        from data_tools.preprocessing.pipeline import preprocess

        for split in SPLITS:
            if kept[split]:  # an empty split (--heldout-fraction 0) has nothing to tokenize
                preprocess([str(out / f"{split}.jsonl")], str(out / "tokenized" / split), str(out / "tokenizer"),
                           max_len=max_tokens, progress=progress)
    return report


def _made_per_module(root: Path, modules, seed: int, num_long: int, num_short: int, disable):
    """({relpath: tasks} of the modules that gave tasks, the file counts for report.json)."""
    from tqdm import tqdm

    sources, skipped, parse_errors = find_sources(root, modules)
    made: dict[str, list[Task]] = {}
    for relpath, source, tree in tqdm(sources, desc="modules", unit="mod", disable=disable):
        # Seeded per module: a module's tasks do not change with the other modules selected.
        tasks = make_tasks(relpath, source, tree, random.Random(f"{seed}/{relpath}"), num_long, num_short)
        if tasks:
            made[relpath] = tasks
        else:
            skipped["no_tasks"] += 1
    if modules is not None:
        found = {module_name(r) for r in made}
        unknown = [m for m in modules if not any(n == m or n.startswith(m + ".") for n in found)]
        if unknown:
            raise UserError(f"--modules: {', '.join(unknown)} matched no usable module under {root} (test packages "
                            f"and modules without a function or class fit for a task are skipped); check the names")
    if len(made) < 2:
        raise UserError(f"only {len(made)} usable module(s) under {root}: a train and a held-out split need at least "
                        f"two; select more with --modules")
    files = {"found": sum(skipped.values()) - skipped["no_tasks"] + len(sources), "used": len(made),
             "skipped": {k: skipped.get(k, 0) for k in SKIP_REASONS}, "parse_errors": parse_errors}
    return made, files


def _draw(splits: dict[str, list[Task]], max_samples: int, seed: int) -> list[tuple[Task, str]]:
    """Keep ``max_samples`` samples, each split its share of them (a seeded draw, order kept); the rest dropped."""
    num_made = sum(len(tasks) for tasks in splits.values())
    num_train = round(max_samples * len(splits["train"]) / num_made)
    dropped = []
    for split, tasks in splits.items():
        keep = set(random.Random(f"{seed}/max-samples/{split}").sample(
            range(len(tasks)), num_train if split == "train" else max_samples - num_train))
        dropped += [(t, "over_max_samples") for i, t in enumerate(tasks) if i not in keep]
        splits[split] = [t for i, t in enumerate(tasks) if i in keep]
    return dropped


def _cap(tasks: list[Task], lengths: _Lengths, max_tokens: int, dropped: list, disable, split: str):
    """([(task, tokens)] within ``max_tokens``: long ones above it cut to a window, the rest dropped (appended to
    ``dropped`` with the reason), the number cut)."""
    from tqdm import tqdm

    kept, num_cut = [], 0
    for task, length in tqdm(list(zip(tasks, lengths.of(tasks))), desc=f"measure {split}", unit="sample",
                             disable=disable):
        if length > max_tokens and task.long is not None:
            fitted = fit(task, lengths, max_tokens)
            if fitted is None:
                dropped.append((task, "function_too_long"))
                continue
            task, length = fitted
            num_cut += 1
        elif length > max_tokens:
            dropped.append((task, "overlong"))
            continue
        kept.append((task, length))
    return kept, num_cut


def _report(root, files, made, heldout, kept, num_cut, dropped, num_made, options) -> dict:
    """report.json: what was read, skipped, made, dropped and cut, and each split's lengths in tokens."""
    drops = Counter(reason for _, reason in dropped)
    report = {
        REPORT_KEY: "make_code_data", "python": sys.version.split()[0], "source_dir": str(root), **options,
        "files": files,
        "samples_made": num_made,
        "dropped": {k: drops.get(k, 0) for k in DROP_REASONS},
        "splits": {},
    }
    for split in SPLITS:
        tasks = [t for t, _ in kept[split]]
        by_task = Counter(t.kind for t in tasks)
        report["splits"][split] = {
            "modules": sum((r in heldout) == (split == "heldout") for r in made),
            "samples": len(tasks), "by_task": {k: by_task.get(k, 0) for k in TASKS}, "cut": num_cut[split],
            **length_stats([n for _, n in kept[split]], options["max_tokens"]),
        }
    num_kept = sum(s["samples"] for s in report["splits"].values())
    assert num_made == num_kept + sum(drops.values()), (num_made, num_kept, drops)
    assert report["files"]["found"] == report["files"]["used"] + sum(report["files"]["skipped"].values())
    return report


def format_report(report: dict, out: Path) -> str:
    """A short human summary of a report."""
    files, lines = report["files"], []
    skips = ", ".join(f"{k} {v}" for k, v in files["skipped"].items() if v)
    drops = ", ".join(f"{k} {v}" for k, v in report["dropped"].items() if v)
    lines.append(f"{files['found']} files under {report['source_dir']}: {files['used']} modules used"
                 + (f"; skipped {skips}" if skips else ""))
    lines.append(f"{report['samples_made']} samples made" + (f"; dropped {drops}" if drops else ""))
    for split, s in report["splits"].items():
        pct, above = s["length_percentiles"], s["fraction_above"]
        tasks = ", ".join(f"{k} {v}" for k, v in s["by_task"].items())
        lines.append(f"{split}: {s['samples']} samples from {s['modules']} modules ({tasks}; {s['cut']} cut to a "
                     f"window), {s['tokens']:,} tokens; p50 {pct.get('p50')} p90 {pct.get('p90')} p99 {pct.get('p99')} "
                     f"max {pct.get('max')}; above " + ", ".join(f"{k}: {v:.1%}" for k, v in above.items()))
        edges, counts = s["histogram"]["edges"], s["histogram"]["counts"]
        lines.append(f"  {split} tokens per sample: " + ", ".join(
            f"{lo + 1}-{hi}: {n}" for lo, hi, n in zip(edges, edges[1:], counts)))
    tokenized = ""
    for split in SPLITS if report["tokenize"] else ():
        path = out / "tokenized" / split / "report.json"
        if path.is_file():
            pre = json.loads(path.read_text())
            lines.append(f"tokenized/{split}: {pre['kept']} samples, {pre['tokens']:,} tokens, trained on "
                         f"{pre['loss_tokens']:,}")
            tokenized += f", tokenized/{split}"
    lines.append(f"wrote {out}/ (train.jsonl, heldout.jsonl, tokenizer/, report.json, dropped.jsonl{tokenized})")
    return "\n".join(lines)
