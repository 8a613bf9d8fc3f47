"""SFT tasks made from one Python module's source: the pure, per-module part of ``data_tools.make_code_data``.

Every task is one chat (a user request, the assistant's answer) whose answer is taken verbatim from the module:

* ``fill_body`` (long): the whole module with one function's (or method's) body replaced by a marker line, and a
  request to write the missing body; the answer is the removed lines exactly as they were. Writing it needs the
  module's context (its imports, helpers and names), and the sample is as long as the module.
* ``doc_to_function`` (short): a function's signature and docstring -> the function's source.
* ``summarize`` (short): a function with its docstring taken out -> the docstring's first line.
* ``list_methods`` (short): a class's source -> its methods, ``name(parameters)`` one per line.

Only top-level functions, classes and the methods of top-level classes are used. A ``fill_body`` target has at
least ``MIN_BODY_STATEMENTS`` statements after its docstring (a one-line body teaches nothing), and its body
starts on a line of its own, so the removed lines are whole lines. A module longer than the token cap is cut by
``LongSource.render(lo, hi)`` to a window of lines around the function, with the module's top-level imports kept
at the top and a marker line for every run of lines left out (code_data.py sizes the window).
"""

from __future__ import annotations

import ast
import inspect
import random
from dataclasses import dataclass, replace
from itertools import islice

MIN_BODY_STATEMENTS = 3
# Short tasks stay short: functions and classes longer than this (in lines) are left to fill_body.
SHORT_MAX_FUNCTION_LINES = 120
SHORT_MAX_CLASS_LINES = 250
# A removed body longer than this is an answer no small model should be asked for in one go.
LONG_MAX_BODY_LINES = 200
MIN_SUMMARY_WORDS = 3
TASKS = ("fill_body", "doc_to_function", "summarize", "list_methods")


@dataclass(frozen=True)
class LongSource:
    """A module's lines with one function's body replaced by a marker; ``render`` shows all of it or a window."""

    relpath: str
    lines: tuple[str, ...]    # the module's lines, each with its newline
    imports: tuple[int, ...]  # line indices of the top-level import statements
    span: tuple[int, int]     # the function's lines [start, end), decorators included
    body: tuple[int, int]     # the removed body's lines [start, end)
    marker: str               # the line that stands where the body was (with its newline)

    def render(self, lo: int = 0, hi: int | None = None) -> str:
        """The module text from line ``lo`` to ``hi`` (exclusive; the whole module by default) with the body
        replaced by the marker; the imports above ``lo`` are kept, and each run of lines left out is one line
        ``# [... lines a-b of <file> left out ...]``."""
        hi = len(self.lines) if hi is None else hi
        assert lo <= self.span[0] and self.span[1] <= hi, (lo, hi, self.span)
        keep = [i for i in self.imports if i < lo] + list(range(lo, hi))
        out, previous = [], -1
        for i in keep:
            if self.body[0] < i < self.body[1]:
                continue
            if i > previous + 1:
                out.append(self._left_out(previous + 1, i))
            out.append(self.marker if i == self.body[0] else self.lines[i])
            previous = self.body[1] - 1 if i == self.body[0] else i
        if previous < len(self.lines) - 1:
            out.append(self._left_out(previous + 1, len(self.lines)))
        return "".join(out)

    def _left_out(self, lo: int, hi: int) -> str:
        """The line standing for lines [lo, hi) (0-based) left out of a window, numbered from 1 as editors do."""
        which = f"line {lo + 1}" if hi == lo + 1 else f"lines {lo + 1}-{hi}"
        return f"# [... {which} of {self.relpath} left out ...]\n"


@dataclass(frozen=True)
class Task:
    """One chat: ``messages()`` is ``[user, assistant]``; ``code`` is the source shown in the request."""

    kind: str                  # one of TASKS
    module: str                # dotted module name
    relpath: str               # the module's file, relative to the source folder
    target: str                # the function's or class's qualified name (Class.method)
    request: str               # the instruction above the code
    code: str
    answer: str
    long: LongSource | None = None     # fill_body: what a window is cut from
    window: tuple[int, int] | None = None  # fill_body cut to lines [lo, hi) of the module (1-based in meta)

    def messages(self) -> list[dict]:
        user = f"{self.request}\n\n```python\n{self.code}```"
        return [{"role": "user", "content": user}, {"role": "assistant", "content": self.answer}]

    def cut(self, lo: int, hi: int) -> "Task":
        """This fill_body task with the module cut to lines [lo, hi) (imports above kept)."""
        request = (f"{self.request} Parts of the module far from `{self.target}` are left out: its top-level "
                   f"imports are kept at the top, and each `# [... lines a-b of ... left out ...]` line stands "
                   f"for lines that are not shown.")
        return replace(self, request=request, code=self.long.render(lo, hi), window=(lo, hi))

    def meta(self) -> dict:
        meta = {"module": self.module, "file": self.relpath, "task": self.kind, "target": self.target}
        if self.long is not None:
            meta["lines"] = [1, len(self.long.lines)] if self.window is None else [self.window[0] + 1, self.window[1]]
        return meta


def module_name(relpath: str) -> str:
    """``email/mime/text.py`` -> ``email.mime.text``; ``json/__init__.py`` -> ``json``."""
    parts = relpath[:-3].split("/")
    return ".".join(parts[:-1] if parts[-1] == "__init__" and len(parts) > 1 else parts)


def source_lines(source: str) -> tuple[str, ...]:
    """The lines as ``ast`` numbers them, each ending in a newline: split at "\\n" only (``str.splitlines`` also
    splits at form feeds and Unicode line separators, which Python source may hold inside a line)."""
    text = source if source.endswith("\n") or not source else source + "\n"
    return tuple(line + "\n" for line in text.split("\n")[:-1])


def make_tasks(relpath: str, source: str, tree: ast.Module, rng: random.Random, num_long: int,
               num_short: int) -> list[Task]:
    """Up to ``num_long`` fill_body and ``num_short`` short tasks from one parsed module, drawn with ``rng``."""
    module = module_name(relpath)
    lines = source_lines(source)
    functions, classes = _definitions(tree)
    long_pool = [f for f in functions if _fill_body_span(f[1], lines) is not None]
    short_pool = [("doc_to_function", f) for f in functions if _summary_parts(f[1], lines)]
    short_pool += [("summarize", f) for f in functions if _summary_parts(f[1], lines)]
    short_pool += [("list_methods", (c.name, c)) for c in classes if _lists_methods(c)]
    imports = tuple(i for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))
                    for i in range(node.lineno - 1, node.end_lineno))
    tasks = [_fill_body(module, relpath, lines, imports, qualname, node)
             for qualname, node in rng.sample(long_pool, min(num_long, len(long_pool)))]
    for kind, (qualname, node) in rng.sample(short_pool, min(num_short, len(short_pool))):
        make = {"doc_to_function": _doc_to_function, "summarize": _summarize, "list_methods": _list_methods}[kind]
        tasks.append(make(module, relpath, lines, qualname, node))
    return tasks


def _definitions(tree: ast.Module):
    """([(qualname, function node)], [top-level class nodes]), in source order."""
    kinds = (ast.FunctionDef, ast.AsyncFunctionDef)
    functions, classes = [], []
    for node in tree.body:
        if isinstance(node, kinds):
            functions.append((node.name, node))
        elif isinstance(node, ast.ClassDef):
            classes.append(node)
            functions += [(f"{node.name}.{m.name}", m) for m in node.body if isinstance(m, kinds)]
    return functions, classes


def _docstring(node) -> ast.Expr | None:
    first = node.body[0]
    if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
        return first
    return None


def _starts_line(node: ast.AST, lines: tuple[str, ...]) -> bool:
    """Whether only indentation precedes ``node`` on its first line (col_offset counts UTF-8 bytes)."""
    return not lines[node.lineno - 1].encode()[:node.col_offset].strip()


def _start(node) -> int:
    """First line index of a definition, its decorators included."""
    return min([node.lineno] + [d.lineno for d in node.decorator_list]) - 1


def _fill_body_span(node, lines) -> tuple[int, int] | None:
    """[start, end) line indices of the body a fill_body task removes, or None if the function is no target."""
    rest = node.body[1:] if _docstring(node) else node.body
    if not rest or not _starts_line(rest[0], lines):
        return None
    start, end = rest[0].lineno - 1, node.end_lineno
    if end - start > LONG_MAX_BODY_LINES:
        return None
    statements = (n for s in rest for n in ast.walk(s) if isinstance(n, ast.stmt))
    if next(islice(statements, MIN_BODY_STATEMENTS - 1, None), None) is None:  # fewer than the minimum
        return None
    return start, end


def _summary_parts(node, lines) -> tuple[str, int, int] | None:
    """(first docstring line, docstring start, end) of a function fit for the short tasks, else None."""
    doc = _docstring(node)
    if doc is None or len(node.body) < 2 or not _starts_line(doc, lines) or not _starts_line(node.body[1], lines):
        return None
    if node.end_lineno - _start(node) > SHORT_MAX_FUNCTION_LINES:
        return None
    summary = inspect.cleandoc(doc.value.value).split("\n", 1)[0].strip()
    if len(summary.split()) < MIN_SUMMARY_WORDS:
        return None
    return summary, doc.lineno - 1, doc.end_lineno


def _methods(node: ast.ClassDef) -> list:
    return [m for m in node.body if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]


def _lists_methods(node: ast.ClassDef) -> bool:
    return len(_methods(node)) >= 2 and node.end_lineno - _start(node) <= SHORT_MAX_CLASS_LINES


def _dedent(lines, indent: str) -> str:
    """The lines with ``indent`` taken off each that starts with it (a flush-left string line stays as it is)."""
    return "".join(line[len(indent):] if line.startswith(indent) else line for line in lines)


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def _where(module: str, qualname: str) -> str:
    cls, _, _ = qualname.rpartition(".")
    return f"`{qualname}` (a method of class `{cls}` in module `{module}`)" if cls else \
        f"`{qualname}` (module `{module}`)"


def _fill_body(module, relpath, lines, imports, qualname, node) -> Task:
    start, end = _fill_body_span(node, lines)
    marker = f"{_indent(lines[start])}# >>> the body of {qualname} goes here <<<\n"
    long = LongSource(relpath, lines, imports, (_start(node), node.end_lineno), (start, end), marker)
    request = (f"Here is the Python module `{module}` ({relpath}). The body of `{qualname}` was removed: the line "
               f"`{marker.strip()}` marks where it was. Write the missing body, only the lines that replace that "
               f"marker, indented as in the module.")
    answer = "".join(lines[start:end]).removesuffix("\n")
    return Task("fill_body", module, relpath, qualname, request, long.render(), answer, long=long)


def _doc_to_function(module, relpath, lines, qualname, node) -> Task:
    _, doc_start, _ = _summary_parts(node, lines)
    indent = _indent(lines[node.lineno - 1])
    signature = _dedent(lines[node.lineno - 1: doc_start], indent)
    docstring = inspect.cleandoc(_docstring(node).value.value)
    request = f"Write the Python function {_where(module, qualname)}. Its docstring:\n\n{docstring}\n\nIts signature:"
    answer = _dedent(lines[_start(node): node.end_lineno], indent).removesuffix("\n")
    return Task("doc_to_function", module, relpath, qualname, request, signature, answer)


def _summarize(module, relpath, lines, qualname, node) -> Task:
    summary, doc_start, doc_end = _summary_parts(node, lines)
    indent = _indent(lines[node.lineno - 1])
    code = _dedent(lines[_start(node): doc_start] + lines[doc_end: node.end_lineno], indent)
    request = f"Say in one line what the Python function {_where(module, qualname)} below does."
    return Task("summarize", module, relpath, qualname, request, code, summary)


def _list_methods(module, relpath, lines, qualname, node) -> Task:
    indent = _indent(lines[node.lineno - 1])
    code = _dedent(lines[_start(node): node.end_lineno], indent)
    request = (f"List the methods that class `{qualname}` of module `{module}` defines, in order, one per line, as "
               f"name(parameters).")
    answer = "\n".join(f"{m.name}({ast.unparse(m.args)})" for m in _methods(node))
    return Task("list_methods", module, relpath, qualname, request, code, answer)
