"""Every flag of every command-line tool, walked: a value of the wrong type and one out of range, and for path flags
a missing path and a file where a folder is expected (and the reverse), each end as exit 2 with ONE line on stderr,
``<prog>: error: --flag: <what> (<fix>)``, and no traceback.

The flags are read off each tool's parser (``build_parser()``, walked through ``parser._actions`` and its
sub-commands); the bad values come from each flag's ``type=`` check (hbp_train/common/cli.py: ``low``/``high`` of a
number, ``path_kind`` of a path, ``bad_values`` of a tool's own check). A new flag whose type is a plain ``int``,
``float`` or ``str`` fails ``test_every_flag_is_walked`` until it gets a checked type or a FREE_FORM entry saying
why any value passes the parser. The tools run in-process (``main(argv)``): a bad flag ends in the parser, before
any work. The Hydra-override CLIs (hbp-train, hbp_train.config, hbp-profile) take config fields, walked by
tests/test_config_walk.py; hbp-profile's own ``profile.*`` fields are walked through its main here too.
"""

from __future__ import annotations

import argparse
import importlib
import re
import tomllib
from pathlib import Path

import pytest

from tests.cli_exit import exit_code

REPO = Path(__file__).resolve().parents[1]

# Every tool with flags, by module: each has main(argv) and build_parser() (test_the_tools_are_every_entry_point
# keeps the list complete).
TOOLS = ["data_tools.preprocess", "data_tools.pack", "data_tools.simulate", "data_tools.compare",
         "data_tools.make_demo_data", "data_tools.make_code_data", "data_tools.train_tokenizer",
         "hbp_train.perf.calibrate", "hbp_train.perf.step_costs", "hbp_train.export", "hbp_train.demo",
         "hbp_train.run_plot", "hbp_train.launch", "hbp_train.batches.shards",
         "eval.run"]
# Entry points whose arguments are Hydra overrides of the run config (tests/test_config_walk.py walks them).
HYDRA_CLIS = {"hbp_train.train", "hbp_train.config", "hbp_train.profiler", "hbp_train.profiler.cli"}
# Entry points that are not user tools: started by the project itself with arguments it wrote.
INTERNAL = {"hbp_train.profiler.worker": "one SP degree's measurements, started by profiler/launcher.py with its job file"}

# Flags where any value passes the parser: the tool parses them itself, and its one-line errors for them are
# tested in FREE_FORM_BAD below or beside the tool (the test named), or they are torchrun's own, passed on as
# torchrun takes them.
_TORCHRUN = "torchrun's own, passed on unchanged (rendezvous, logging and worker settings)"
FREE_FORM = {
    "data_tools.preprocess --input": "files or dataset folders checked one by one, a missing one being a bad-input "
                                     "reason that --on-error skip drops (test_preprocess)",
    "data_tools.make_code_data --modules": "module names, each one that matches no usable module a one-line error "
                                           "(test_make_code_data)",
    "data_tools.pack --groups": "pack_len:sp list or auto, parse_groups (test_planning_cli)",
    "data_tools.pack --model-shape": "preset, JSON or file, parse_model_shape (test_shape)",
    "data_tools.simulate --name": "a free label",
    "data_tools.simulate --model-shape": "preset, JSON or file, parse_model_shape (test_shape)",
    "data_tools.compare --groups": "as pack's (test_planning_cli)",
    "data_tools.compare --strategies": "a subset of the strategies, checked by compare.run (test_simulate)",
    "data_tools.compare --model-shape": "preset, JSON or file, parse_model_shape (test_shape)",
    "hbp_train.perf.calibrate --model-shape": "preset, JSON or file, parse_model_shape (test_shape)",
    "hbp_train.perf.calibrate --doc-lens": "its bound is --tokens, another flag: parse_doc_lens",
    "eval.run offline --device": "auto, cpu, cuda or cuda:N, pick_device (torch's device names)",
    "eval.run offline --dtype": "auto or a torch dtype name, pick_dtype",
    "eval.run opencompass --datasets": "suite words and benchmark names, parse_datasets (test_eval_opencompass)",
    "eval.run opencompass --long-lengths": "32k-style lengths per benchmark, parse_lengths (test_eval_opencompass)",
    "eval.run compare --labels": "free column names, one per RUN",
    **{f"hbp_train.launch {flag}": _TORCHRUN for flag in (
        "--rdzv-backend", "--rdzv-endpoint", "--rdzv-id", "--rdzv-conf", "--event-log-handler", "--role",
        "-r", "-t", "--local-ranks-filter", "--duplicate-stdout-filters",
        "--duplicate-stderr-filters", "--master-addr", "--local-addr", "--logs-specs", "--signals-to-handle",
        "training_script", "training_script_args")},
}


def _name(action) -> str:
    """The flag as argparse names it in an error: the first option string, or a positional's metavar/dest."""
    return action.option_strings[0] if action.option_strings else (action.metavar or action.dest)


def _walk(parser, prefix=()):
    """(argv prefix, parser, action) for every action that takes a value, sub-commands included."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, (*prefix, name))
        elif action.nargs != 0:  # switches (store_true, --help) take no value
            yield prefix, parser, action


def _bad_values(action) -> list:
    """(label, value) pairs the flag's parser must refuse; {missing}, {file} and {dir} are filled in per test."""
    check = action.type
    if hasattr(check, "bad_values"):  # a tool's own check (hbp_train.launch, hbp_train.demo)
        wrong, out_of_range = check.bad_values
        return [("wrong_type", wrong), ("out_of_range", out_of_range)]
    if hasattr(check, "path_kind"):
        return {"file": [("missing", "{missing}"), ("a_folder", "{dir}")],
                "dir": [("missing", "{missing}"), ("a_file", "{file}")],
                "file_or_dir": [("missing", "{missing}")],
                "out_file": [("a_folder", "{dir}")], "out_dir": [("a_file", "{file}")]}[check.path_kind]
    if hasattr(check, "low"):
        listed = getattr(check, "is_list", False)
        cases = [("wrong_type", "a,b" if listed else "x")]
        if check.kind is int:
            cases.append(("wrong_type_float", "1.5"))
        if check.low is not None:
            below = check.low if check.low_open else check.low - (1 if check.kind is int else 0.5)
            cases.append(("below_range", f"{check.low},{below:g}" if listed else f"{below:g}"))
        if check.high is not None:
            cases.append(("above_range", f"{check.high + (1 if check.kind is int else 0.5):g}"))
        return cases
    if action.choices is not None:
        return [("not_a_choice", "not-a-choice")] + ([("not_a_choice_number", "99")] if check is int else [])
    return []


def _parser(module: str):
    return importlib.import_module(module).build_parser()


def _cases():
    for module in TOOLS:
        for prefix, parser, action in _walk(_parser(module)):
            for label, value in _bad_values(action):
                flag = _name(action)
                yield pytest.param(module, prefix, parser.prog, action.option_strings[:1], flag, value,
                                   id=f"{module} {' '.join(prefix)} {flag}={label}".replace("  ", " "))


def test_every_flag_is_walked():
    """Each flag that takes a value has a checked type (or choices), or says in FREE_FORM why any value passes."""
    unwalked, stale = [], set(FREE_FORM)
    for module in TOOLS:
        for prefix, _, action in _walk(_parser(module)):
            key = " ".join([module, *prefix, _name(action)])
            stale.discard(key)
            if not _bad_values(action) and key not in FREE_FORM:
                unwalked.append(f"{key} (type={getattr(action.type, '__name__', action.type)})")
    assert not unwalked, "flags with no checked type (use hbp_train.common.cli's, or add a FREE_FORM reason): " + \
        ", ".join(unwalked)
    assert not stale, f"FREE_FORM names flags that no longer exist: {sorted(stale)}"
    assert set(FREE_FORM_BAD) <= set(FREE_FORM)


def test_the_tools_are_every_entry_point():
    """Every console script and every ``python -m`` module is walked here, is a Hydra-override CLI or is internal."""
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    modules = {target.split(":")[0] for target in scripts.values()}
    for package in ("hbp_train", "data_tools", "eval"):
        for path in (REPO / package).rglob("*.py"):
            text = path.read_text()
            if path.name == "__main__.py" or 'if __name__ == "__main__":' in text:
                module = ".".join(path.relative_to(REPO).with_suffix("").parts)
                modules.add(module.removesuffix(".__main__"))
    known = set(TOOLS) | HYDRA_CLIS | set(INTERNAL)
    assert modules <= known, sorted(modules - known)


@pytest.mark.parametrize("module,prefix,prog,option,flag,value", list(_cases()))
def test_a_bad_flag_is_one_line_exit_2(module, prefix, prog, option, flag, value, tmp_path, capsys):
    afile = tmp_path / "a_file.json"
    afile.write_text("{}\n")
    value = value.format(missing=tmp_path / "missing", file=afile, dir=tmp_path)
    argv = [*prefix, *option, value]
    code = exit_code(importlib.import_module(module).main, argv)
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2, (argv, captured.err)
    assert len(lines) == 1 and "Traceback" not in captured.err, captured.err
    assert re.fullmatch(rf"{re.escape(prog)}: error: {re.escape(flag)}: .+ \(.+\)", lines[0]), lines[0]
    assert not captured.out


# Free-form flags given a bad value on top of a valid command line (BASE_ARGV, {lengths} and {out} filled in per
# test): their own checks end in one line too, naming the flag or the value, before any planning or measuring.
FREE_FORM_BAD = {
    "data_tools.pack --groups": "256", "data_tools.pack --model-shape": "no-such-shape",
    "data_tools.compare --groups": "256:3", "data_tools.compare --strategies": "no-such-strategy",
    "data_tools.compare --model-shape": "no-such-shape",
    "hbp_train.perf.calibrate --model-shape": "no-such-shape", "hbp_train.perf.calibrate --doc-lens": "16,abc",
    "data_tools.simulate --model-shape": "no-such-shape",
}
BASE_ARGV = {
    "data_tools.pack": ["--lengths", "{lengths}", "--world-size", "2", "--groups", "256:1", "--out", "{out}/plan.json",
                        "--quiet", "--no-baseline"],
    "data_tools.compare": ["--lengths", "{lengths}", "--world-size", "2", "--groups", "256:1", "--strategies", "isf",
                           "--quiet"],
    # Without --device cpu: a check that let the value through would end in "no CUDA GPU", which names no flag.
    "hbp_train.perf.calibrate": ["--tokens", "128", "--doc-lens", "16", "--out", "{out}/calibration.json"],
    "data_tools.simulate": ["--plan", "{out}/plan.json"],
}


@pytest.mark.parametrize("key", sorted(FREE_FORM_BAD))
def test_a_bad_free_form_value_is_one_line_exit_2(key, tmp_path, capsys):
    module, flag = key.split(" ")
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("12\n40\n100\n")
    if module == "data_tools.simulate":  # a plan to simulate
        pack = importlib.import_module("data_tools.pack")
        assert pack.main([a.format(lengths=lengths, out=tmp_path) for a in BASE_ARGV["data_tools.pack"]]) == 0
    capsys.readouterr()
    argv = [a.format(lengths=lengths, out=tmp_path) for a in BASE_ARGV[module]] + [flag, FREE_FORM_BAD[key]]
    code = exit_code(importlib.import_module(module).main, argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    assert flag in lines[0] or repr(FREE_FORM_BAD[key]) in lines[0], lines[0]


def _profile_cases():
    from tests.test_config_walk import OUT_OF_RANGE, _fields, _wrong_type

    for name, kind in _fields().items():
        if not name.startswith("profile."):
            continue
        wrong = _wrong_type(kind)
        if wrong is not None and name not in ("profile.docs", "profile.calibration"):
            yield pytest.param(name, wrong, id=f"{name}=wrong_type")
        if name in OUT_OF_RANGE:
            yield pytest.param(name, OUT_OF_RANGE[name], id=f"{name}=out_of_range")


@pytest.mark.parametrize("field,value", list(_profile_cases()))
def test_a_bad_profiler_flag_is_one_line_exit_2(field, value, capsys):
    """hbp-profile's flags are the ``profile.*`` fields: each bad one is a line naming it before any profiling."""
    from hbp_train.profiler.cli import main

    assert main([f"{field}={value}", "profile.dry_run=true"]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("profile: ") and field in lines[0], lines[0]
