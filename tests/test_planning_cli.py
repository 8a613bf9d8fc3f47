"""data_tools.pack CLI: a full run (plan.json, table, plot), and one-line errors with exit code 2."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data_tools.pack import build_parser, main
from hbp_train.planning import Plan

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
    d = json.loads(out.read_text())
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
    assert main(argv) == 2
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
    _error(capsys, common + ["--groups", "auto", "--profile", str(tmp_path)], f"{tmp_path}: Is a directory")
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
    _error(capsys, ["--lengths", str(good), *BASE, "--out", "x.json", "--seed", "-1"], "--seed must be >= 0")
    _error(capsys, ["--lengths", str(good), *BASE, "--out", str(tmp_path)], f"{tmp_path}: is a directory")
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


def test_bad_values_found_before_planning_are_one_line_exit_2(tmp_path, capsys):
    good = tmp_path / "good.txt"
    good.write_text("12\n7\n300\n")
    out = tmp_path / "x.json"
    common = ["--lengths", str(good), "--world-size", "4", "--quiet", "--out", str(out)]
    _error(capsys, common + ["--groups", "99999999999999999999:1"], "pack_len 99999999999999999999 is larger than")
    _error(capsys, common + ["--groups", "256:1", "--world-size", "99999999999999999999"], "world_size=")
    _error(capsys, common + ["--groups", "256:1", "--isf-rounds", "99999999999"], "isf_rounds must be between")
    prof = tmp_path / "prof.json"
    prof.write_text(json.dumps({"groups": [{"pack_len": True, "sp": 1}]}))
    _error(capsys, common + ["--groups", "auto", "--profile", str(prof)], "groups[0]: pack_len must be a positive")
    # Output paths are checked before the planning, which can take minutes on real data.
    _error(capsys, common + ["--groups", "256:1", "--plot", str(tmp_path / "plan.xyz")], "--plot")
    _error(capsys, common + ["--groups", "256:1", "--plot", str(tmp_path)], f"--plot {tmp_path}: is a directory")
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    _error(capsys, common + ["--groups", "256:1", "--plot", str(blocker / "p.png")], "not a writable folder")
    assert not out.exists()
    _error(capsys, ["--dataset", str(tmp_path / "missing"), "--world-size", "4", "--groups", "256:1", "--out",
                    str(out)], "no such directory")


def test_max_len_below_the_data_warns(tmp_path, capsys):
    lengths = tmp_path / "l.txt"
    lengths.write_text("12\n7\n300\n")
    argv = ["--lengths", str(lengths), "--world-size", "2", "--groups", "256:1,512:2", "--max-len", "256",
            "--quiet", "--out", str(tmp_path / "p.json")]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert "1 samples are longer than --max-len 256 (longest 300)" in err
    assert json.loads((tmp_path / "p.json").read_text())["dropped"] == []  # planned, not lost


def test_plan_of_another_version_is_refused(tmp_path, lengths_file):
    path, _ = lengths_file
    out = tmp_path / "plan.json"
    assert main(["--lengths", str(path), *BASE, "--out", str(out), "--no-baseline"]) == 0
    d = json.loads(out.read_text())
    Plan.from_dict(d)  # its own version reads back
    with pytest.raises(ValueError, match="plan version 0 is not the version 1 this code reads; re-run"):
        Plan.from_dict({**d, "version": 0})
