"""Tests for data_tools.make_code_data (data_tools/demo_data/: code_data.py, code_tasks.py): chats from the standard
library, split by module, the removed body really removed and exactly the answer, determinism per seed, the token
cap, every skip and drop counted, and the output read by data_tools.preprocess. Runs use a few small modules and
small caps (seconds)."""

from __future__ import annotations

import ast
import inspect
import json
import random
from pathlib import Path

import pytest

from data_tools.demo_data.code_tasks import make_tasks, source_lines
from data_tools.demo_data.code_data import SKIP_REASONS, make_code_data, stdlib_dir
from data_tools.make_code_data import main
from hbp_train.common.errors import UserError
from tests.cli_exit import exit_code

# Small modules of every interpreter this runs on: bisect and colorsys fit 2048 tokens whole, json's decoder and
# encoder do not, so some long samples are cut.
MODULES = ["json", "textwrap", "heapq", "shlex", "colorsys", "fnmatch", "bisect", "glob"]
SMALL = dict(modules=MODULES, vocab_size=1000, max_tokens=2048, max_samples=None, heldout_fraction=0.3,
             long_per_module=2, short_per_module=6, progress=False)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    out = tmp_path_factory.mktemp("code") / "data"
    report = make_code_data(out, seed=0, tokenize=True, **SMALL)
    return out, report


def records(out: Path) -> dict[str, list[dict]]:
    return {split: read_jsonl(out / f"{split}.jsonl") for split in ("train", "heldout")}


def code_of(record: dict) -> str:
    """The source shown in the user turn (between the ```python fence and the closing fence)."""
    user = record["messages"][0]["content"]
    return user.split("```python\n", 1)[1].removesuffix("```")


def test_splits_are_disjoint_by_module(built):
    out, report = built
    data = records(out)
    modules = {split: {r["meta"]["module"] for r in rs} for split, rs in data.items()}
    assert modules["train"] and modules["heldout"] and not modules["train"] & modules["heldout"]
    files = {split: {r["meta"]["file"] for r in rs} for split, rs in data.items()}
    for split in files:  # a module assigned to a split may lose all its samples to the cap (counted as drops)
        assert len(files[split]) <= report["splits"][split]["modules"] <= len(files[split]) + \
            len({d["file"] for d in read_jsonl(out / "dropped.jsonl")})
    assert all(m == n or m.startswith(n + ".") for ms in modules.values() for m in ms for n in MODULES
               if m.split(".")[0] == n.split(".")[0])
    for split, rs in data.items():
        assert report["splits"][split]["samples"] == len(rs)
        kinds = {r["meta"]["task"] for r in rs}
        assert "fill_body" in kinds and kinds & {"doc_to_function", "summarize", "list_methods"}


def test_the_removed_body_is_absent_from_the_prompt_and_is_exactly_the_answer(built):
    out, _ = built
    num_whole = num_cut = 0
    for record in [r for rs in records(out).values() for r in rs if r["meta"]["task"] == "fill_body"]:
        meta, (user, answer) = record["meta"], (m["content"] for m in record["messages"])
        assert answer and answer not in user
        source = (stdlib_dir() / meta["file"]).read_text(encoding="utf-8")
        lines = source_lines(source)
        marker = f"# >>> the body of {meta['target']} goes here <<<\n"
        code = code_of(record)
        assert code.count(marker) == 1
        indent = answer[: len(answer) - len(answer.lstrip())]
        restored = code.replace(indent + marker, answer + "\n")
        lo, hi = meta["lines"]
        if (lo, hi) == (1, len(lines)):
            assert restored == "".join(lines)  # the body put back gives the module, byte for byte
            num_whole += 1
        else:
            assert "".join(lines[lo - 1: hi]) in restored and "left out ...]" in code
            num_cut += 1
            imports = [n for n in ast.parse(source).body if isinstance(n, (ast.Import, ast.ImportFrom))]
            above = "".join(ln for n in imports if n.end_lineno < lo for ln in lines[n.lineno - 1: n.end_lineno])
            shown = "".join(ln for ln in code.splitlines(keepends=True) if not ln.startswith("# [... line"))
            assert shown.startswith(above)  # the imports above the window are kept, at the top
    assert num_whole and num_cut


def test_short_tasks_are_taken_from_the_source(built):
    out, _ = built
    seen = set()
    for record in [r for rs in records(out).values() for r in rs if r["meta"]["task"] != "fill_body"]:
        meta, answer = record["meta"], record["messages"][1]["content"]
        lines = source_lines((stdlib_dir() / meta["file"]).read_text(encoding="utf-8"))
        tree = ast.parse("".join(lines))
        node = tree
        for part in meta["target"].split("."):
            node = next(n for n in node.body if getattr(n, "name", None) == part)
        seen.add(meta["task"])
        if meta["task"] == "summarize":
            assert answer == inspect.cleandoc(ast.get_docstring(node, clean=False)).split("\n")[0].strip()
            assert ast.get_docstring(ast.parse(code_of(record)).body[0]) is None  # the docstring is taken out
        elif meta["task"] == "doc_to_function":
            # The function's lines, decorators included, less the indentation of its def (a method's).
            start = min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1
            original = lines[start: node.end_lineno]
            indent = original[0][: len(original[0]) - len(original[0].lstrip())]
            assert len(answer.splitlines()) == len(original)
            assert all(o in (indent + a + "\n", a + "\n") or not o.strip() and not a.strip()
                       for o, a in zip(original, answer.splitlines()))
            assert ast.parse(answer).body[0].name == node.name
            assert inspect.cleandoc(ast.get_docstring(node)) in record["messages"][0]["content"]
        else:
            assert [line.split("(")[0] for line in answer.splitlines()] == \
                [m.name for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
    assert seen == {"summarize", "doc_to_function", "list_methods"}


def test_the_cap_holds_in_tokens_and_the_output_passes_preprocess(built):
    """Every sample fits --max-tokens as preprocess tokenizes it; preprocess keeps them all with the lengths the
    report gives; long modules were cut (counted), not dropped."""
    out, report = built
    for split in ("train", "heldout"):
        pre = json.loads((out / "tokenized" / split / "report.json").read_text())
        ours = report["splits"][split]
        assert pre["kept"] == pre["read"] == ours["samples"] and not pre["dropped"]
        assert pre["tokens"] == ours["tokens"] and pre["length_percentiles"]["max"] <= 2048
        assert pre["length_percentiles"]["max"] == ours["length_percentiles"]["max"]
        assert sum(ours["histogram"]["counts"]) == ours["samples"]
        num_cut = sum(r["meta"].get("lines", [1, 0])[0] > 1 or "left out ...]" in code_of(r)
                      for r in read_jsonl(out / f"{split}.jsonl") if r["meta"]["task"] == "fill_body")
        assert ours["cut"] == num_cut
    assert report["splits"]["train"]["cut"] > 0
    assert report["splits"]["train"]["length_percentiles"]["max"] > 2048 * 0.8  # the long tail reaches the cap


def test_same_seed_same_files_another_seed_other_files(tmp_path):
    small = {**SMALL, "modules": ["json", "textwrap", "shlex"]}
    a, b, c = (tmp_path / n for n in "abc")
    make_code_data(a, seed=3, **small)
    make_code_data(b, seed=3, **small)
    make_code_data(c, seed=4, **small)
    files = sorted(p.relative_to(a) for p in a.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(b) for p in b.rglob("*") if p.is_file())
    assert {"train.jsonl", "heldout.jsonl", "report.json", "dropped.jsonl", "tokenizer/tokenizer.json"} <= \
        {p.as_posix() for p in files}
    for f in files:
        assert (a / f).read_bytes() == (b / f).read_bytes(), f
    assert (a / "train.jsonl").read_bytes() != (c / "train.jsonl").read_bytes()


def test_lines_are_numbered_as_ast_numbers_them():
    """A form feed or a Unicode line separator inside a line splits it for str.splitlines, not for ast: the removed
    body is still exactly the function's body lines."""
    source = ('import os\n\x0c\n\ndef f(a):\n    """Sum and sep\u2028arate things."""\n    b = a + 1\n'
              '    c = "x\u2028y"\n    return b, c\n')
    [task] = make_tasks("m.py", source, ast.parse(source), random.Random(0), 1, 0)
    assert task.answer == '    b = a + 1\n    c = "x\u2028y"\n    return b, c'
    assert task.code == source.replace(task.answer, "    # >>> the body of f goes here <<<")
    assert source_lines("a\x0cb\nc") == ("a\x0cb\n", "c\n") and source_lines("") == ()


def _tree(root: Path) -> None:
    """A small source folder with one file for every skip reason."""
    body = "\n".join(f"    x{i} = {i} * 2  # {'padding ' * 12}" for i in range(60))
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text(
        'import os\n\n\ndef alpha(a, b):\n    """Add two numbers and double the sum."""\n    c = a + b\n'
        '    d = c * 2\n    return d\n\n\ndef huge():\n    """Build a very long list of numbers."""\n' + body +
        "\n    return x0\n")
    (root / "pkg" / "helpers.py").write_text(
        'def beta(s):\n    """Strip a string and upper-case it."""\n    t = s.strip()\n    u = t.upper()\n'
        '    return u\n\n\nclass Gamma:\n    def one(self):\n        return 1\n\n    def two(self, x):\n'
        '        return x\n')
    (root / "pkg" / "tests").mkdir()
    (root / "pkg" / "tests" / "helper.py").write_text("def f():\n    pass\n")
    (root / "test_things.py").write_text("def test_x():\n    pass\n")
    (root / "site-packages").mkdir()
    (root / "site-packages" / "foreign.py").write_text("def g():\n    pass\n")
    (root / "broken.py").write_text("def oops(:\n")
    (root / "latin.py").write_bytes(b"x = '\xe9'\n")  # not UTF-8 and no coding cookie
    (root / "constants.py").write_text("A = 1\nB = 2\n")


def test_every_skip_and_every_drop_is_counted(tmp_path):
    src = tmp_path / "src"
    _tree(src)
    report = make_code_data(tmp_path / "out", source_dir=src, vocab_size=300, max_tokens=256, max_samples=None,
                            heldout_fraction=0.5, long_per_module=2, short_per_module=6, progress=False)
    files = report["files"]
    assert files["skipped"] == {"site_packages": 1, "test_package": 2, "not_selected": 0, "parse_error": 2,
                                "no_tasks": 1}
    assert set(files["skipped"]) == set(SKIP_REASONS)
    assert files["found"] == 8 and files["used"] == 2 and files["parse_errors"] == ["broken.py", "latin.py"]
    dropped = read_jsonl(tmp_path / "out" / "dropped.jsonl")
    # huge(): its body alone passes 256 tokens (function_too_long), and so does its docstring -> function task.
    assert report["dropped"]["function_too_long"] >= 1 and report["dropped"]["overlong"] >= 1
    assert sorted(d["reason"] for d in dropped) == sorted(k for k, v in report["dropped"].items() for _ in range(v))
    kept = sum(s["samples"] for s in report["splits"].values())
    assert report["samples_made"] == kept + len(dropped)

    capped = make_code_data(tmp_path / "out", source_dir=src, vocab_size=300, max_tokens=4096, max_samples=3,
                            heldout_fraction=0.5, long_per_module=2, short_per_module=6, progress=False)
    over_cap = capped["dropped"]["function_too_long"] + capped["dropped"]["overlong"]
    assert sum(s["samples"] for s in capped["splits"].values()) + over_cap == 3
    assert capped["dropped"]["over_max_samples"] == capped["samples_made"] - 3


def test_cli_writes_and_its_errors_are_one_line(tmp_path, capsys, monkeypatch):
    out = tmp_path / "data"
    argv = ["--out", str(out), "--modules", "textwrap,shlex", "--vocab-size", "300", "--max-tokens", "512"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "train:" in printed and "heldout:" in printed and (out / "report.json").is_file()
    assert main(argv + ["--seed", "1"]) == 0  # an earlier output is replaced
    capsys.readouterr()
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    for bad, expected in ((["--out", str(out), "--modules", "no_such_module"], "--modules: no_such_module matched"),
                          (["--out", str(out), "--modules", ","], "--modules ','"),
                          (["--out", str(foreign), "--modules", "json"], "holds no earlier make_code_data output"),
                          (["--out", str(out), "--modules", "json", "--long-per-module", "0",
                            "--short-per-module", "0"], "both 0")):
        assert exit_code(main, bad) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and expected in err and "Traceback" not in err, err
    assert (foreign / "notes.txt").read_text() == "mine"
    with pytest.raises(UserError, match="two"):
        make_code_data(tmp_path / "one", modules=["textwrap"], progress=False)

    # Ctrl-C half-way: one line, exit 130, the earlier output as it was and no staging folder left.
    from data_tools.demo_data import bpe_tokenizer

    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def interrupt(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(bpe_tokenizer, "train", interrupt)
    assert main(argv) == 130
    assert capsys.readouterr().err == f"make_code_data: interrupted; --out {out} was left as it was\n"
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "foreign"]
