"""The layout rules of the house, checked on the source: the layering of pyproject.toml's import-linter contracts
(and a planted upward import breaks it), no import cycle between the project's modules, no module over 500 lines, no
machine paths in the repository, the ignore index in one place.

The import graph counts every ``import``/``from ... import`` of a project module, at the top of a file, inside
functions and under ``if TYPE_CHECKING:`` alike (a lazy import hides a cycle from Python, an annotation-only one
from the interpreter, neither from the architecture); ``from pkg import mod`` points at the submodule when ``mod``
is one.
"""

from __future__ import annotations

import ast
import io
import keyword
import os
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("hbp_train", "data_tools", "eval", "bench")
MAX_LINES = 500
# The one home of the ignore index; tests and docs may spell the value out.
IGNORE_INDEX_HOME = "hbp_train/common/labels.py"


def project_modules() -> dict[str, Path]:
    """{dotted module name: file} of every module of the project's packages (tests excluded)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            parts = path.relative_to(REPO).with_suffix("").parts
            if any(not p.isidentifier() for p in parts):  # e.g. a build/ copy or a folder that is no package
                continue
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def _imports(tree: ast.AST):
    """Every Import/ImportFrom node of the file, wherever it sits."""
    return (node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom)))


def _resolve(name: str, modules: dict) -> str | None:
    """The project module ``name`` loads: itself, or its longest prefix that is a project module."""
    while name:
        if name in modules:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph() -> dict[str, set[str]]:
    """{module: {project modules it imports}}."""
    modules = project_modules()
    graph = {}
    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        edges = set()
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                if node.level:  # relative: from the module's package, up level - 1 packages
                    base = name.split(".") if is_package else name.split(".")[:-1]
                    base = base[:len(base) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                           for alias in node.names]
            edges |= {t for t in (_resolve(x, modules) for x in targets) if t and t != name}
        graph[name] = edges
    return graph


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (a -> b -> ... -> a) per strongly connected component of more than one module (Tarjan)."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(set(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_shortest_cycle(graph, min(component), component) for component in components]


def _shortest_cycle(graph: dict[str, set[str]], start: str, component: set[str]) -> list[str]:
    """start -> ... -> start, the fewest steps inside ``component`` (breadth-first), for a readable message."""
    previous, frontier = {start: None}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & component):
                if w == start:
                    path = [v]
                    while previous[path[-1]] is not None:
                        path.append(previous[path[-1]])
                    return list(reversed(path)) + [start]
                if w not in previous:
                    previous[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{sorted(component)} is not a strongly connected component")


def test_the_cycle_finder_finds_cycles_and_only_cycles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"d"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []


def test_import_graph_resolves_submodules_and_function_level_imports():
    graph = import_graph()
    # `from hbp_train.planning.baselines.bytescale import check_zero_stage` inside a function of data_tools.pack
    assert "hbp_train.planning.baselines.bytescale" in graph["data_tools.pack"]
    # `from hbp_train.common.errors import UserError` at the top of data_tools.pack
    assert "hbp_train.common.errors" in graph["data_tools.pack"]
    assert "hbp_train.planning.plan" in graph["hbp_train.planning"]  # a package's __init__ counts as a module
    # an import for annotations only and one inside a function are dependencies as much as one at the top
    source = "import a\nif TYPE_CHECKING:\n    from b import B\ndef f():\n    import c\n"
    assert sorted(n.names[0].name if isinstance(n, ast.Import) else n.module for n in _imports(ast.parse(source))) \
        == ["a", "b", "c"]


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles (each line one cycle):\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_no_module_over_500_lines():
    too_long = [f"{path.relative_to(REPO)}: {len(path.read_text().splitlines())} lines"
                for name, path in sorted(project_modules().items()) if len(path.read_text().splitlines()) > MAX_LINES]
    assert not too_long, f"modules over {MAX_LINES} lines: split them by concept:\n" + "\n".join(too_long)


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    """import-linter's contracts (pyproject.toml) checked on the packages under ``root``."""
    lint = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(lint), "--no-cache", "--config", str(root / "pyproject.toml")], cwd=root,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(root)}, timeout=120)


def test_the_layers_hold():
    result = _lint_imports(REPO)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("importer,imported", [
    ("hbp_train/common/errors.py", "from hbp_train import trainer"),  # the bottom layer reaching the loop
    ("hbp_train/planning/plan.py", "import torch"),  # planning is pure numpy
    ("hbp_train/model/loss.py", "from hbp_train.batches import loader"),  # two independent siblings
    ("data_tools/preprocessing/pipeline.py", "from data_tools.packing import lengths"),  # two independent stages
    ("data_tools/packing/groups.py", "from data_tools import pack"),  # a stage reaching for its command
    ("data_tools/compare.py", "from data_tools.simulate import build_parser"),  # a command importing another
])
def test_a_planted_upward_import_breaks_the_layers(tmp_path, importer, imported):
    """A copy of the packages with one import that goes against the layering: lint-imports fails and names it."""
    for package in ("hbp_train", "data_tools", "eval"):
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / importer
    target.write_text(target.read_text() + f"\n\ndef _planted():\n    {imported}  # noqa\n")
    result = _lint_imports(tmp_path)
    assert result.returncode != 0 and "BROKEN" in result.stdout
    assert importer.removesuffix(".py").replace("/", ".") in result.stdout


def _tracked_files() -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    return [name for name in out.decode().split("\0") if name]


# Spelt in pieces so that this file does not match itself: a sibling "shared" folder, or the developers' /w-o-r-k tree.
MACHINE_PATH = re.compile(r"\.\./" + r"shared|(?<![\w.])/" + "work/")


def test_no_file_mentions_a_machine_path():
    found = []
    for name in _tracked_files():
        path = REPO / name
        if not path.is_file():  # deleted in the work tree, not yet committed
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):  # binary files (images, weights) hold no paths we write
            continue
        for number, line in enumerate(text.splitlines(), 1):
            if MACHINE_PATH.search(line) and name != "tests/test_layout.py":
                found.append(f"{name}:{number}: {line.strip()[:120]}")
    assert not found, "paths outside the repository (a sibling folder or a machine path) in it:\n" + "\n".join(found)


def literal_ignore_index(source: str) -> list[int]:
    """Line numbers where code (not a string or comment) spells the number -100 (a unary minus before 100)."""
    skip = (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT, tokenize.INDENT, tokenize.DEDENT)
    tokens = [None] + [t for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type not in skip]
    found = []
    for before, minus, number in zip(tokens, tokens[1:], tokens[2:]):
        if minus.string != "-" or number.type != tokenize.NUMBER or number.string != "100":
            continue
        binary = before is not None and (before.type in (tokenize.NUMBER, tokenize.STRING) or before.string in ")]}"
                                         or (before.type == tokenize.NAME and not keyword.iskeyword(before.string)))
        if not binary:
            found.append(minus.start[0])
    return found


def test_literal_ignore_index_finder():
    source = ("x = -100\ny = f(a, -100)\n# -100 in a comment\nz = '-100' + 'w'\nv = 5 - 100\nw = n - 100\n"
              "def f():\n    return -100\nu = [x, -100]\n")
    assert literal_ignore_index(source) == [1, 2, 8, 9]


def test_ignore_index_is_spelled_out_only_in_labels_py():
    found = []
    for name, path in sorted(project_modules().items()):
        if path.relative_to(REPO).as_posix() == IGNORE_INDEX_HOME:
            continue
        found += [f"{path.relative_to(REPO)}:{line}" for line in literal_ignore_index(path.read_text())]
    assert not found, ("the ignore index -100 spelled out in code: use `from hbp_train.common.labels import IGNORE_INDEX`:\n"
                       + "\n".join(found))
