"""Tests for hbp_train/common/outputs.py: output checks, atomic file writes and the staged folder swap, direct calls."""

from __future__ import annotations

import json
import os

import pytest

from hbp_train.common import outputs
from hbp_train.common.errors import UserError
from hbp_train.common.outputs import atomic_write, check_output_file, replace_dir, staging_dir


def test_json_key_accepts_an_earlier_output_or_an_empty_file_and_refuses_other_data(tmp_path):
    earlier = tmp_path / "plan.json"
    earlier.write_text(json.dumps({"version": 1, "steps": []}, indent=1))
    check_output_file("--out", str(earlier), json_key="version", kind="plan")  # our own earlier output
    empty = tmp_path / "empty.json"
    empty.write_text("")
    check_output_file("--out", str(empty), json_key="version", kind="plan")  # nothing in it to lose
    # A JSON-lines file whose SECOND record starts with the key is still someone's data: only the file's start counts.
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"messages": []}) + "\n" + json.dumps({"version": 2}) + "\n")
    with pytest.raises(UserError, match=r"^--out .*train.jsonl: exists and is not a plan written by hbp-train"):
        check_output_file("--out", str(data), json_key="version", kind="plan")
    nested = tmp_path / "nested.json"  # the key inside another object is not the first key
    nested.write_text(json.dumps({"meta": {"version": 1}}))
    with pytest.raises(UserError, match="not a plan"):
        check_output_file("--out", str(nested), json_key="version", kind="plan")


def test_image_suffix_is_case_insensitive_and_unwritable_parents_are_refused(tmp_path):
    check_output_file("--plot", str(tmp_path / "new" / "deeper" / "P.PNG"), image=True)  # folders created later
    with pytest.raises(UserError, match="unknown image type .xyz"):
        check_output_file("--plot", str(tmp_path / "p.xyz"), image=True)
    if os.geteuid() == 0:
        pytest.skip("root may write into a read-only folder")
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        with pytest.raises(UserError, match=r"^--out .*: cannot create it \(.*locked is not a writable folder\)$"):
            check_output_file("--out", str(locked / "r.json"))
    finally:
        locked.chmod(0o700)


def test_atomic_write_keeps_the_suffix_and_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "plot.svg"
    seen = []
    atomic_write(target, lambda tmp: (seen.append(tmp), tmp.write_text("new")))
    assert seen[0].parent == tmp_path and seen[0].suffix == ".svg" and seen[0] != target  # matplotlib reads the suffix
    assert target.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["plot.svg"]

    def half_then_fail(tmp):
        tmp.write_text("half")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        atomic_write(target, half_then_fail)
    assert target.read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == ["plot.svg"]


def test_replace_dir_swaps_in_the_new_folder_and_leaves_nothing_beside_it(tmp_path):
    target = tmp_path / "out"
    for content in ("first", "second"):
        staged = staging_dir(target)
        assert staged.parent == tmp_path and not list(staged.iterdir())
        (staged / "f.txt").write_text(content)
        replace_dir(staged, target)
        assert (target / "f.txt").read_text() == content
        assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging or old folder left


def test_staging_dir_of_the_current_folder_is_beside_it(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    staged = staging_dir(".")
    assert staged.parent == tmp_path and staged.name.startswith(".work.staging-")


def test_replace_dir_failure_puts_the_earlier_folder_back(tmp_path, monkeypatch):
    target = tmp_path / "out"
    target.mkdir()
    (target / "f.txt").write_text("earlier")
    staged = staging_dir(target)
    (staged / "f.txt").write_text("new")
    real_replace = os.replace

    def fail_on_the_staged_folder(src, dst):
        if os.fspath(src) == os.fspath(staged):
            raise KeyboardInterrupt  # between moving the earlier folder aside and moving the new one in
        return real_replace(src, dst)

    monkeypatch.setattr(outputs.os, "replace", fail_on_the_staged_folder)
    with pytest.raises(KeyboardInterrupt):
        replace_dir(staged, target)
    assert (target / "f.txt").read_text() == "earlier"
