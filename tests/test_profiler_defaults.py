"""hbp-profile's defaults on a short or a CPU profile (hbp_train/profiler/cli.py, report.py): the default
profile.min_len (8192) is lowered to a shorter profile.max_len with a one-line note, while a min_len the user set
above max_len stays an error; a CPU profile's throughput column is per process, not per GPU."""

from __future__ import annotations

import json
import logging

from hbp_train.profiler import cli
from hbp_train.profiler.report import format_table

DRY = ["model=tiny_llama", "profile.dry_run=true", "profile.progress=false", "profile.world_size=2"]


def test_the_default_min_len_is_lowered_to_a_shorter_max_len(tmp_path, capsys, caplog):
    path = tmp_path / "p.json"
    with caplog.at_level(logging.INFO):
        rc = cli.main([*DRY, "profile.max_len=2048", f"profile.output={path}"])
    err = capsys.readouterr().err
    assert rc == 0, err
    notes = [r.getMessage() for r in caplog.records if "profile.min_len" in r.getMessage()]
    assert notes == ["profile.min_len: the default 8192 is longer than profile.max_len=2048; using min_len=2048"]
    data = json.loads(path.read_text())
    assert data["config"]["min_len"] == 2048
    assert {m["pack_len"] for m in data["measurements"]} == {2048} and data["groups"]


def test_a_min_len_set_above_max_len_is_still_an_error(tmp_path, capsys):
    rc = cli.main([*DRY, "profile.max_len=2048", "profile.min_len=8192", f"profile.output={tmp_path / 'p.json'}"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "profile.min_len must be in [1, max_len=2048], got 8192" in err and "\n" not in err


def test_a_max_len_above_the_default_keeps_it(tmp_path, capsys):
    path = tmp_path / "p.json"
    assert cli.main([*DRY, "profile.max_len=16384", f"profile.output={path}"]) == 0
    data = json.loads(path.read_text())
    assert data["config"]["min_len"] == 8192 and {m["pack_len"] for m in data["measurements"]} == {8192, 16384}


def test_a_cpu_profile_counts_tokens_per_process(tmp_path, capsys):
    """The table of a profile measured with profile.device=cpu: its ranks are processes, not GPUs."""
    path = tmp_path / "p.json"
    assert cli.main([*DRY, "profile.max_len=16384", f"profile.output={path}"]) == 0
    gpu = json.loads(path.read_text())
    table = format_table(gpu)
    assert "tok/s/GPU" in table and "tok/s/proc" not in table
    cpu = {**gpu, "config": {**gpu["config"], "device": "cpu"}}
    table = format_table(cpu)
    assert "tok/s/proc" in table and "tok/s/GPU" not in table and "1-proc slice" in table
