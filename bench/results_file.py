"""Results files kept in the repository (bench/results/*.json) and the blocks of docs/benchmarks.md rendered from them.

A bench whose figures docs/benchmarks.md holds writes its results file with what it ran on: the commit, whether the tree
differed from it (``dirty``, with the changed files), the machine and the library versions. Paths of the machine
are replaced by names (``WORK``, ``REPO``) so the file can be committed. docs/benchmarks.md holds each table between two
marker lines; ``write_block`` replaces what lies between them, ``read_block`` reads it back, and the benches' tests
check that the page's block equals what the committed results file renders, so the two cannot drift.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"
PAGE = REPO / "docs" / "benchmarks.md"  # where the benches' tables live (README.md quotes their headlines)


def provenance() -> dict:
    """The commit this checkout is at, whether its tracked or new files differ from it (the benches' own outputs,
    bench/results/ and docs/benchmarks.md, left out), the machine and versions. Taken when a bench starts."""
    def git(*args):
        res = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        return res.stdout.rstrip("\n") if res.returncode == 0 else None  # status lines start with a space

    status = git("status", "--porcelain")
    # What the benches write themselves (results files, the page's blocks) is output, not the code measured: a
    # second bench run after a first one has not changed what it measures.
    changed = [line[3:] for line in (status or "").splitlines()
               if not (line[3:].startswith("bench/results/") or line[3:] == "docs/benchmarks.md")]
    versions = {}
    for name in ("torch", "transformers", "deepspeed", "datasets"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - a library a bench does not need may be absent or fail to import
            versions[name] = None
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(changed), "dirty_files": changed[:50],
            "date": time.strftime("%Y-%m-%d", time.gmtime()), "machine": machine(), "python": platform.python_version(),
            "versions": versions}


def machine() -> dict:
    """The CPU's model name, its logical cores and the load when asked (a busy machine's timings are not figures)."""
    model = platform.processor() or None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"cpu": model, "cores": os.cpu_count(), "load_1min": load, "system": platform.system()}


def portable(obj, places: dict):
    """``obj`` (JSON-able) with every string's machine paths replaced: ``places`` {path: name}, the longest first."""
    text = json.dumps(obj, default=float)
    for path, name in sorted(places.items(), key=lambda kv: -len(str(kv[0]))):
        text = text.replace(json.dumps(str(Path(path).resolve()))[1:-1], name)
    return json.loads(text)


def write_results(name: str, results: dict, places: dict) -> Path:
    """bench/results/<name>.json (portable paths), indented so that a rerun's diff reads."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(portable(results, {**places, REPO: "REPO"}), indent=1) + "\n")
    return path


def read_results(name: str) -> dict | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def _markers(name: str) -> tuple[str, str]:
    return (f"<!-- {name}: rendered from bench/results/{name}.json by its bench; do not edit by hand -->",
            f"<!-- end of {name} -->")


def read_block(name: str, page: Path = PAGE) -> str:
    """The page's text between ``name``'s marker lines (ValueError when they are missing)."""
    begin, end = _markers(name)
    text = page.read_text()
    if begin not in text or end not in text:
        raise ValueError(f"{page.name} has no block {name!r} (marker lines {begin!r} ... {end!r})")
    return text.split(begin, 1)[1].split(end, 1)[0].strip("\n")


def write_block(name: str, body: str, page: Path = PAGE) -> None:
    """Replace the page's block ``name`` with ``body``."""
    begin, end = _markers(name)
    text = page.read_text()
    head, rest = text.split(begin, 1) if begin in text else (None, None)
    if head is None or end not in rest:
        raise ValueError(f"{page.name} has no block {name!r} (marker lines {begin!r} ... {end!r})")
    page.write_text(head + begin + "\n" + body.strip("\n") + "\n" + end + rest.split(end, 1)[1])
