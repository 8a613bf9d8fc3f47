"""data_tools.pack CLI: a full run (plan.json, table, plot), and one-line errors with exit code 2."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data_tools.pack import build_parser, main
from hbp_train.common.errors import UserError
from hbp_train.planning import Plan
from tests.cli_exit import exit_code

BASE = ["--world-size", "4", "--groups", "256:1,1024:2", "--global-tokens", "4096", "--quiet"]


@pytest.fixture()
def lengths_file(tmp_path):
    rng = np.random.default_rng(0)
    lengths = np.r_[rng.integers(1, 256, 300), rng.integers(257, 1024, 20), [2000]]
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(map(str, lengths)) + "\n")
    return path, lengths


def test_full_run_writes_plan_table_and_plot(tmp_path, lengths_file, capsys):
    path, lengths = lengths_file
    out, png = tmp_path / "plan.json", tmp_path / "figures" / "plan.png"  # the plot's folder is created
    assert main(["--lengths", str(path), *BASE, "--out", str(out), "--plot", str(png), "--curriculum-steps", "2"]) == 0
    printed = capsys.readouterr().out
    assert "hbp" in printed and "isf" in printed and "ABR" in printed and "sp_required_share" in printed
    assert "dropped 1 samples" in printed
    # The length mix of the steps beside the data's (#16): one row for the data, one for hbp's steps that mix the
    # groups, one per group for steps of one group (the curriculum's), with mix_TV mean / max.
    assert "mix_TV" in printed and "  data " in printed and "steps mixing the groups" in printed
    assert "hbp group 0 (" in printed  # at least the 2 curriculum steps
    d = json.loads(out.read_text())
    assert 0 < d["metrics"]["mix_TV"] <= 1 and all(0 <= s["mix_TV"] <= 1 for s in d["step_metrics"])
    for key in ("version", "world_size", "groups", "steps", "dropped", "metrics", "step_metrics", "num_samples"):
        assert key in d
    assert d["dropped"] == [{"index": len(lengths) - 1, "reason": "longer_than_max_pack_len"}]
    assert d["num_samples"] == len(lengths)
    assert len(d["step_metrics"]) == len(d["steps"])
    Plan.from_dict(d).validate()
    assert png.stat().st_size > 10_000


def test_npy_input_and_isf(tmp_path, lengths_file):
    _, lengths = lengths_file
    npy = tmp_path / "l.npy"
    np.save(npy, lengths)
    out = tmp_path / "p.json"
    assert main(["--lengths", str(npy), *BASE, "--strategy", "isf", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["strategy"] == "isf"


def test_groups_auto_reads_profile(tmp_path, lengths_file):
    path, _ = lengths_file
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"groups": [{"pack_len": 512, "sp": 1, "ckpt_layers": 3},
                                           {"pack_len": 2048, "sp": 4, "ckpt_layers": None}]}))
    out = tmp_path / "p.json"
    assert main(["--lengths", str(path), "--world-size", "4", "--groups", "auto", "--profile", str(prof),
                 "--out", str(out), "--quiet", "--no-baseline"]) == 0
    assert json.loads(out.read_text())["groups"][0] == {"pack_len": 512, "sp": 1, "ckpt_layers": 3}


def test_groups_auto_refuses_a_profile_made_for_another_world_size(tmp_path, lengths_file, capsys):
    """The profiler chose SP degrees and checkpoint counts for the memory ZeRO leaves on W ranks (it records W under
    "job"): planning for another W with them is refused in one line naming the file, both sizes and the fixes."""
    path, _ = lengths_file
    groups = [{"pack_len": 512, "sp": 1, "ckpt_layers": 3}, {"pack_len": 2048, "sp": 2, "ckpt_layers": 1}]
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"groups": groups, "job": {"world_size": 8, "zero_stage": 2}}))
    out = tmp_path / "p.json"
    argv = ["--lengths", str(path), "--groups", "auto", "--profile", str(prof), "--out", str(out), "--quiet"]
    _error(capsys, argv + ["--world-size", "4"],
           f"--profile {prof}: made for world size 8, but --world-size is 4; re-run the profiler with "
           "profile.world_size=4")
    _error(capsys, argv + ["--world-size", "4"], "or pass --world-size 8")
    assert not out.exists()
    assert main(argv + ["--world-size", "8"]) == 0  # the world size it was made for
    capsys.readouterr()  # (its output: a few-steps warning among it)
    # A profile that records W only in its config section (the profiler writes both) is checked the same way.
    prof.write_text(json.dumps({"groups": groups, "config": {"world_size": 2}}))
    _error(capsys, argv + ["--world-size", "4"], "made for world size 2, but --world-size is 4")
    # Longer data than the profile's groups: only the profiler can add a group in auto mode, so it says that.
    _error(capsys, argv + ["--world-size", "2", "--max-len", "4096"],
           f"--max-len 4096 exceeds the largest pack_len 2048 of --profile {prof}: re-run the profiler with "
           "profile.max_len=4096 (python -m hbp_train.profiler profile.max_len=4096 ...), or lower --max-len to 2048")


def test_help_explains_every_flag(capsys):
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    for flag in ("--lengths", "--dataset", "--shards", "--max-len", "--world-size", "--groups", "--profile",
                 "--strategy", "--global-tokens", "--curriculum-steps", "--seed", "--out", "--plot"):
        assert flag in text
    for action in build_parser()._actions:  # every option, including ones added later, is explained
        assert action.help and action.help.strip(), action.option_strings
        assert all(opt in text for opt in action.option_strings)


def _error(capsys, argv, expect):
    assert exit_code(main, argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert expect in err, err


def test_bad_inputs_are_one_line_exit_2(tmp_path, capsys):
    bad = tmp_path / "bad.txt"
    bad.write_text("12\nabc\n5\n")
    _error(capsys, ["--lengths", str(bad), *BASE, "--out", "x.json"], f"{bad}:2")
    zero = tmp_path / "zero.txt"
    zero.write_text("12\n7\n0\n")
    _error(capsys, ["--lengths", str(zero), *BASE, "--out", "x.json"], f"{zero}:3: length 0")
    good = tmp_path / "good.txt"
    good.write_text("12\n7\n")
    common = ["--lengths", str(good), "--world-size", "4", "--out", str(tmp_path / "x.json")]
    _error(capsys, common + ["--groups", "1024:1,256:2"], "strictly ascending")
    _error(capsys, common + ["--groups", "256:3"], "power of two")
    _error(capsys, common + ["--groups", "256:8"], "must divide --world-size")
    _error(capsys, common + ["--groups", "256"], "pack_len:sp")
    _error(capsys, common + ["--groups", "256:1", "--max-len", "512"], "exceeds the largest pack_len")
    _error(capsys, common + ["--groups", "auto"], "needs --profile")
    prof = tmp_path / "prof.json"
    prof.write_text(json.dumps({"layers": []}))
    _error(capsys, common + ["--groups", "auto", "--profile", str(prof)], "missing key 'groups'")
    prof.write_bytes(b"\xff\xfe{}")
    _error(capsys, common + ["--groups", "auto", "--profile", str(prof)], "not UTF-8")
    _error(capsys, common + ["--groups", "auto", "--profile", str(tmp_path)], f"--profile: {tmp_path}: is a folder")
    _error(capsys, ["--lengths", str(tmp_path / "missing.txt"), *BASE, "--out", "x.json"], "no such file")
    _error(capsys, ["--lengths", str(good), *BASE], "--out FILE is required")
    _error(capsys, ["--lengths", str(good), *BASE, "--shards", "o", "--out", "x"], "--shards needs --dataset")
    _error(capsys, ["--world-size", "4"], "required")
    notutf8 = tmp_path / "latin1.txt"
    notutf8.write_bytes(b"12\n7\n\xe9\n")
    _error(capsys, ["--lengths", str(notutf8), *BASE, "--out", "x.json"], f"{notutf8}:3: not UTF-8")
    huge = tmp_path / "huge.txt"
    huge.write_text("12\n7\n99999999999999999999999\n")
    _error(capsys, ["--lengths", str(huge), *BASE, "--out", "x.json"], f"{huge}:3: length 99999999999999999999999 is too large")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    _error(capsys, ["--lengths", str(empty), *BASE, "--out", "x.json"], "no samples")
    _error(capsys, ["--lengths", str(good), *BASE, "--out", "x.json", "--seed", "-1"], "--seed: -1 is out of range")
    _error(capsys, ["--lengths", str(good), *BASE, "--out", str(tmp_path)], f"--out: {tmp_path}: is a folder")
    broken = tmp_path / "broken_ds"
    broken.mkdir()
    (broken / "state.json").write_text("{")
    _error(capsys, ["--dataset", str(broken), *BASE, "--out", "x.json"], f"--dataset {broken}: cannot load")


def test_plot_edge_cases(tmp_path):
    """The figure also draws a plan whose samples were all dropped (no steps), without warnings; with two
    groups the per-replica panels show NUM_STEPS_SHOWN steps taken from both groups."""
    import warnings

    from hbp_train.planning import GroupSpec, PlanConfig, make_plan
    from hbp_train.planning.plot import NUM_STEPS_SHOWN, _steps_to_show, plot_plans

    cfg = dict(world_size=2, groups=[GroupSpec(64, 1)])
    empty = {s: make_plan([100, 200], PlanConfig(strategy=s, **cfg)) for s in ("isf", "hbp")}
    assert empty["hbp"].num_steps == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot_plans(empty["isf"], empty["hbp"], tmp_path / "empty.png")
    assert (tmp_path / "empty.png").stat().st_size > 10_000

    rng = np.random.default_rng(0)
    lengths = np.r_[rng.integers(1, 256, 400), rng.integers(257, 1024, 40)]
    plan = make_plan(lengths, PlanConfig(world_size=4, groups=[GroupSpec(256, 1), GroupSpec(1024, 2)],
                                         global_tokens=2048))
    shown = _steps_to_show(plan)
    assert len(shown) == NUM_STEPS_SHOWN and set(plan.step_group[shown].tolist()) == {0, 1}


def test_isf_with_one_replica_per_step_says_so_and_draws_its_packs_at_sp1(tmp_path):
    """The demo's shape: isf runs everything at sp=2 on 2 ranks, one replica per step. Its panel says there is
    nothing to balance between replicas (with its CR) and draws each step's first 2 packs as 2 ranks at sp=1 would
    run them, with that slot's ABR; hbp's panel is unchanged (per replica, with the steps' ABR)."""
    from hbp_train.planning import GroupSpec, PlanConfig, make_plan
    from hbp_train.planning.plot import _slot_abr, _steps_to_show, pack_attention, plot_plans

    lengths = np.random.default_rng(0).integers(16, 2048, 300)
    cfg = dict(world_size=2, groups=[GroupSpec(1024, 1), GroupSpec(2048, 2)], global_tokens=8192)
    isf, hbp = (make_plan(lengths, PlanConfig(strategy=s, **cfg)) for s in ("isf", "hbp"))
    assert all(isf.step_replicas(s) == 1 for s in range(isf.num_steps))
    fig = plot_plans(isf, hbp, tmp_path / "plan.png")
    isf_ax, hbp_ax = fig.axes[1], fig.axes[2]
    assert "isf: one replica per step (sp=2 on 2 ranks), nothing to balance" in isf_ax.get_title()
    assert any(f"(CR {isf.metrics['CR']:.2f})" in t.get_text() for t in isf_ax.texts)
    labels = [t.get_text() for t in isf_ax.get_legend().get_texts()]
    for s, label in zip(_steps_to_show(isf), labels):
        cost = pack_attention(isf, isf.step_matrix(s)[:2, 0])
        assert label == f"step {s}: its first 2 packs side by side, ABR {_slot_abr(cost):.3f} at sp=1"
    assert len(isf_ax.patches) == 2 * len(labels) and max(p.get_height() for p in isf_ax.patches) == 1.0
    assert hbp_ax.get_title().startswith("hbp: per-replica attention cost") and not hbp_ax.texts


def test_bad_values_found_before_planning_are_one_line_exit_2(tmp_path, capsys):
    good = tmp_path / "good.txt"
    good.write_text("12\n7\n300\n")
    out = tmp_path / "x.json"
    common = ["--lengths", str(good), "--world-size", "4", "--quiet", "--out", str(out)]
    _error(capsys, common + ["--groups", "99999999999999999999:1"], "pack_len 99999999999999999999 is larger than")
    _error(capsys, common + ["--groups", "256:1", "--world-size", "99999999999999999999"], "world_size=")
    _error(capsys, common + ["--groups", "256:1", "--isf-rounds", "99999999999"],
           "--isf-rounds: 99999999999 is out of range")
    prof = tmp_path / "prof.json"
    prof.write_text(json.dumps({"groups": [{"pack_len": True, "sp": 1}]}))
    _error(capsys, common + ["--groups", "auto", "--profile", str(prof)], "groups[0]: pack_len must be a positive")
    # Output paths are checked before the planning, which can take minutes on real data.
    _error(capsys, common + ["--groups", "256:1", "--plot", str(tmp_path / "plan.xyz")], "--plot")
    _error(capsys, common + ["--groups", "256:1", "--plot", str(tmp_path)], f"--plot: {tmp_path}: is a folder")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    _error(capsys, common + ["--groups", "256:1", "--plot", str(blocker / "p.png")], "not a writable folder")
    assert not out.exists()
    _error(capsys, ["--dataset", str(tmp_path / "missing"), "--world-size", "4", "--groups", "256:1", "--out",
                    str(out)], "--dataset: " + f"{tmp_path / 'missing'}: no such folder")


def test_max_len_below_the_data_warns_saying_what_happens_to_them(tmp_path, capsys):
    lengths = tmp_path / "l.txt"
    lengths.write_text("12\n7\n300\n")
    argv = ["--lengths", str(lengths), "--world-size", "2", "--groups", "256:1,512:2", "--max-len", "256",
            "--quiet", "--out", str(tmp_path / "p.json")]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "1 samples are longer than --max-len 256 (longest 300): 1 fit the largest pack_len and are planned" in err
    assert json.loads((tmp_path / "p.json").read_text())["dropped"] == []  # planned, not lost
    # Longer than the largest pack_len too: dropped, and the warning says so with the count (it said "planned").
    lengths.write_text("12\n7\n300\n600\n")
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert ("2 samples are longer than --max-len 256 (longest 600): 1 are longer than the largest pack_len 512 and "
            "are dropped (reason longer_than_max_pack_len, listed in the plan); 1 fit the largest pack_len and are "
            "planned; to keep them cut to 256 tokens re-run data_tools.preprocess --max-len 256 --overlong truncate"
            ) in err
    assert json.loads((tmp_path / "p.json").read_text())["dropped"] == [{"index": 3,
                                                                          "reason": "longer_than_max_pack_len"}]


def test_without_global_tokens_the_step_size_comes_from_the_data(tmp_path, lengths_file, capsys):
    """The README's command omitted --global-tokens, whose default (4,194,304) made ONE optimizer step of a
    509K-token set, silently. Now the data sizes the step; a plan of few steps is warned about, with the fix."""
    from hbp_train.planning.equal_steps import auto_global_tokens

    path, lengths = lengths_file
    out = tmp_path / "p.json"
    argv = ["--lengths", str(path), "--world-size", "4", "--groups", "256:1,1024:2", "--quiet", "--out", str(out)]
    assert main(argv) == 0
    captured = capsys.readouterr()
    kept = int(lengths[lengths <= 1024].sum())
    one_slot_each = 4 * 256 + 2 * 1024  # a pack of every group per replica, so that steps mix the groups' lengths
    assert json.loads(out.read_text())["global_tokens"] == auto_global_tokens(kept, one_slot_each) == one_slot_each
    assert f"--global-tokens not given: {one_slot_each:,} tokens per optimizer step" in captured.out
    assert json.loads(out.read_text())["metrics"]["num_steps"] >= 10 and "warning" not in captured.err
    assert main([*argv, "--global-tokens", str(4 * 1024 * 1024)]) == 0
    err = capsys.readouterr().err
    assert err.startswith(f"warning: only 1 optimizer steps of {kept:,} tokens, too few updates to train on; lower "
                          f"--global-tokens (now 4,194,304; without it, {one_slot_each:,}: about ")
    # The rule: T / 100 steps, at most the old default per step, at least the given slot.
    assert [auto_global_tokens(t, 3072) for t in (50_000, 10_000_000, 10**10)] == [3072, 100_000, 4 * 1024 * 1024]


def test_the_table_compares_like_with_like(tmp_path, capsys):
    """The demo's shape: isf runs every pack at sp=2 on 2 ranks, one replica per step, so its ABR and DBR read 0 --
    nothing to balance, which made hbp look worse in the table's first row. They read n/a, and a note says why."""
    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(map(str, np.random.default_rng(0).integers(16, 2048, 300))) + "\n")
    assert main(["--lengths", str(lengths), "--world-size", "2", "--groups", "1024:1,2048:2", "--quiet",
                 "--out", str(tmp_path / "p.json")]) == 0
    printed = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in printed.splitlines() if line.strip()}
    assert rows["metric"] == ["hbp", "isf"]
    for metric in ("ABR", "DBR"):
        assert rows[metric][1] == "n/a" and float(rows[metric][0]) >= 0
    assert float(rows["CR"][1]) == 1.0  # every isf token pays SP communication: that comparison stands
    assert ("\nnote: replicas per step: hbp sp=1: 2 replicas, sp=2: 1 replica; isf sp=2: 1 replica. ABR and DBR "
            "compare the replicas of a step") in printed


def test_plan_of_another_version_is_refused(tmp_path, lengths_file):
    path, _ = lengths_file
    out = tmp_path / "plan.json"
    assert main(["--lengths", str(path), *BASE, "--out", str(out), "--no-baseline"]) == 0
    d = json.loads(out.read_text())
    Plan.from_dict(d)  # its own version reads back
    with pytest.raises(UserError, match="plan version 0 is not the version 1 this code reads; re-run"):
        Plan.from_dict({**d, "version": 0})


def _interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def test_interrupt_while_writing_keeps_the_earlier_plan(tmp_path, lengths_file, capsys, monkeypatch):
    """Ctrl-C while a plan is serialised: one line, exit code 130, and the earlier plan.json whole (it used to be
    opened for writing first and left at 0 bytes)."""
    path, _ = lengths_file
    out = tmp_path / "plan.json"
    assert main(["--lengths", str(path), *BASE, "--out", str(out), "--no-baseline"]) == 0
    before = out.read_bytes()
    capsys.readouterr()
    monkeypatch.setattr(Plan, "to_dict", _interrupt)
    assert main(["--lengths", str(path), *BASE, "--out", str(out), "--no-baseline", "--seed", "1"]) == 130
    err = capsys.readouterr().err
    assert err.splitlines() == [err.strip()] and err.startswith("pack: interrupted; ") and "left as they were" in err
    assert out.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lengths.txt", "plan.json"]  # no temporary file left


def test_sigint_subprocess_one_line_no_traceback(tmp_path, ctrl_c_stops_python):
    """A real Ctrl-C (SIGINT) while a 1M-sample plan is being made: no traceback, exit code 130, --out untouched.
    (ctrl_c_stops_python: the child reacts to SIGINT even when the suite runs in the background.)"""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    lengths = tmp_path / "l.txt"
    lengths.write_text("\n".join(map(str, np.random.default_rng(0).integers(16, 32768, 1_000_000))) + "\n")
    out = tmp_path / "plan.json"
    out.write_text('{"version": 1, "earlier": true}')  # an earlier plan: it may be replaced, never cut short
    proc = subprocess.Popen([sys.executable, "-m", "data_tools.pack", "--lengths", str(lengths), "--world-size", "8",
                             "--groups", "4096:1,32768:8", "--out", str(out)], cwd=Path(__file__).parent.parent,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err, deadline = b"", time.monotonic() + 60
    while b"planning" not in err and time.monotonic() < deadline:  # planning is under way (a line: stderr is a pipe)
        chunk = os.read(proc.stderr.fileno(), 4096)
        if not chunk:
            break
        err += chunk
    time.sleep(0.2)  # a moment into the planning; about a second of work is left
    proc.send_signal(signal.SIGINT)
    err += proc.stderr.read()
    proc.wait(timeout=60)
    text = err.decode()
    assert proc.returncode == 130, text
    assert "Traceback" not in text, text
    assert text.replace("\r", "\n").strip().splitlines()[-1].startswith("pack: interrupted; ")
    assert out.read_text() == '{"version": 1, "earlier": true}'


def test_out_never_replaces_a_file_that_is_not_a_plan(tmp_path, lengths_file, capsys):
    path, _ = lengths_file
    raw = tmp_path / "train.jsonl"
    raw.write_text('{"messages": []}\n')
    _error(capsys, ["--lengths", str(path), *BASE, "--out", str(raw)],
           f"--out {raw}: exists and is not a plan written by hbp-train")
    assert raw.read_text() == '{"messages": []}\n'
    out = tmp_path / "plan.json"
    for seed in ("0", "1"):  # an earlier plan is replaced
        assert main(["--lengths", str(path), *BASE, "--out", str(out), "--no-baseline", "--seed", seed]) == 0
        assert json.loads(out.read_text())["seed"] == int(seed)
    _error(capsys, ["--lengths", str(tmp_path), *BASE, "--out", str(out)], f"--lengths: {tmp_path}: is a folder")


@pytest.mark.parametrize("module", ["data_tools.pack", "data_tools.compare", "data_tools.simulate",
                                    "data_tools.preprocess", "data_tools.make_demo_data", "data_tools.make_code_data",
                                    "hbp_train.perf.calibrate",
                                    "bench.bench_planner", "bench.bench_simulated_speedup"])
def test_every_option_of_every_planning_cli_says_its_default(module):
    """--help of each CLI: every option explained; every option that takes a value says its default or that it is
    required, once (no argparse '(default: None)' next to a hand-written default)."""
    import argparse
    import importlib

    parser = importlib.import_module(module).build_parser()
    assert "(default: None)" not in parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        text = (action.help or "").lower()
        assert text.strip(), action.option_strings
        if action.nargs != 0:  # flags (store_true) are off unless given
            assert "default" in text or "required" in text, (action.option_strings, text)
        assert text.count("default") <= 1, (action.option_strings, text)


def test_out_npz_writes_the_binary_plan_and_refuses_other_npz(tmp_path, lengths_file, capsys):
    """--out *.npz writes the binary form of the same plan --out *.json writes (here for bfd), and never replaces
    an .npz that is not a binary plan."""
    from hbp_train.planning.plan_npz import load_plan

    path, lengths = lengths_file
    outs = [tmp_path / "plan.json", tmp_path / "plan.npz"]
    for out in outs:
        assert main(["--lengths", str(path), *BASE, "--strategy", "bfd", "--out", str(out)]) == 0
    a, b = (load_plan(o) for o in outs)
    b.validate()
    assert b.config.strategy == "bfd" and b.num_samples == len(lengths)
    assert [sorted(map(tuple, (a.pack(p).tolist() for p in a.step_matrix(s).ravel()))) for s in range(a.num_steps)] \
        == [sorted(map(tuple, (b.pack(p).tolist() for p in b.step_matrix(s).ravel()))) for s in range(b.num_steps)]
    data = tmp_path / "weights.npz"
    np.savez(data, w=np.arange(4))
    before = data.read_bytes()
    _error(capsys, ["--lengths", str(path), *BASE, "--out", str(data)], f"--out {data}: exists and is not a binary plan")
    assert data.read_bytes() == before


def save_model_config(folder, **fields):
    """A model folder as the user has it (its config.json; no weights are read), a Llama of ``fields``."""
    from transformers import AutoConfig

    shape = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=1000)
    AutoConfig.for_model("llama", **{**shape, **fields}).save_pretrained(folder)
    return folder


def test_model_records_the_model_in_json_and_npz_plans_and_refuses_sp_its_heads_cannot_split(tmp_path, lengths_file,
                                                                                            capsys):
    """--model DIR: the groups' SP degrees against the model's heads before any planning (a 5-head model with a
    group at sp=2 used to pass pack and simulate and stop training 21 s in), and the model recorded in the plan,
    JSON and binary, which loads back with it (plans without it load as before)."""
    from hbp_train.planning.plan_npz import load_plan

    path, _ = lengths_file
    five = save_model_config(tmp_path / "five-heads", hidden_size=40, num_attention_heads=5, num_key_value_heads=5)
    assert exit_code(main, ["--lengths", str(path), *BASE, "--out", str(tmp_path / "p.json"), "--model",
                            str(five)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("pack: error: --groups 1024:2: sp=2 does not divide the model's "
                                                   "5 attention heads"), err
    assert "model five-heads (llama, 5 heads, 5 kv heads;" in err and "SP degrees that work: 1" in err, err
    assert not (tmp_path / "p.json").exists()
    no_model = tmp_path / "empty"
    no_model.mkdir()
    assert exit_code(main, ["--lengths", str(path), *BASE, "--out", str(tmp_path / "p.json"), "--model",
                            str(no_model)]) == 2
    assert "--model " in capsys.readouterr().err

    mine = save_model_config(tmp_path / "my-llama")
    for name in ("plan.json", "plan.npz"):
        out = tmp_path / name
        assert main(["--lengths", str(path), *BASE, "--out", str(out), "--model", str(mine)]) == 0
        record = load_plan(out).extra["model"]
        assert record["name"] == "my-llama" and record["model_type"] == "llama" and record["path"] == str(mine)
        assert {k: record["shape"][k] for k in ("hidden", "num_layers", "num_heads", "num_kv_heads", "ffn", "vocab")} \
            == {"hidden": 64, "num_layers": 3, "num_heads": 4, "num_kv_heads": 2, "ffn": 96, "vocab": 1000}, name
    assert main(["--lengths", str(path), *BASE, "--out", str(tmp_path / "old.json")]) == 0
    assert "model" not in load_plan(tmp_path / "old.json").extra
