"""Tests for hbp_train/profiler/launcher.py and worker.py: the SP > 1 measurements on the node's devices, one
torchrun per SP degree. Fast: the command line built per degree, which degrees are launched, reading a worker's
results back, the relaunch after an OOM and the fallback after a failure, and the degree-by-degree search giving
the same profile as measuring everything in one process. Slow: the profiler end to end on the CPU with sp=2
measured by 2 gloo processes against the single-process measurements."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict

import pytest

from hbp_train.common.errors import UserError
from hbp_train.profiler import launcher as launcher_mod
from hbp_train.profiler.backends import CurveBackend, Measurement
from hbp_train.profiler.launcher import (EXIT_OOM, LaunchResult, SpLauncher, launch_command, launched_degrees,
                                         measuring_devices, read_results)
from hbp_train.profiler.search import Profiler
from tests.profiler_curves import GB, LAYERS, cfg, compute_time, linear_mem


def test_one_torchrun_per_degree_command_line(tmp_path):
    cmd = launch_command(4, str(tmp_path / "sp4.job.json"))
    assert cmd == [sys.executable, "-m", "hbp_train.launch", "--standalone", "--nproc_per_node=4",
                   "-m", "hbp_train.profiler.worker", str(tmp_path / "sp4.job.json")]
    # torchrun accepts it as it is: 4 local ranks, a standalone rendezvous, the worker as a module with its job
    from torch.distributed.run import parse_args

    args = parse_args(cmd[3:])
    assert args.nproc_per_node == "4" and args.standalone and args.module
    assert args.training_script == "hbp_train.profiler.worker" and args.training_script_args == [cmd[-1]]
    # the degrees launched: as many as the node has devices for, inside one node of the training job
    assert launched_degrees([1, 2, 4, 8], devices=4, gpus_per_node=8) == [2, 4]
    assert launched_degrees([1, 2, 4, 8], devices=8, gpus_per_node=4) == [2, 4]
    assert launched_degrees([1, 2, 4, 8], devices=1, gpus_per_node=8) == []


def test_the_parents_share_of_gpu_0_is_left_out_of_the_torchruns_readings(tmp_path, monkeypatch):
    """GPU 0 also holds the parent profiler's CUDA context while a torchrun measures on it: the job tells the
    workers what each device held beyond the idlest before it started (NVML), for them to leave out; nothing on
    the CPU or without NVML."""
    used = [3 * GB, GB, GB, GB // 2 + GB // 2]
    monkeypatch.setattr(launcher_mod, "nvml_used_bytes", lambda index: used[index])
    assert launcher_mod.device_excess_bytes(4, "cuda") == [2 * GB, 0, 0, 0]
    assert launcher_mod.device_excess_bytes(4, "cpu") is None
    job = SpLauncher([], cfg(device="cuda", output=str(tmp_path / "p.json")), [2], None, 8 * GB).job(2, [1024], 0.0, [])
    assert job["device_excess_bytes"] == [2 * GB, 0]
    monkeypatch.setattr(launcher_mod, "nvml_used_bytes", lambda index: None)
    assert launcher_mod.device_excess_bytes(2, "cuda") is None


def test_measuring_devices_follow_the_node_or_the_setting(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert measuring_devices(cfg()) == 8
    assert measuring_devices(cfg(measure_devices=2)) == 2
    assert measuring_devices(cfg(dry_run=True)) == 1
    assert measuring_devices(cfg(device="cpu")) == 1  # the CPU launches only when told to
    assert measuring_devices(cfg(device="cpu", measure_devices=2)) == 2
    with pytest.raises(UserError, match="profile.measure_devices=16"):
        measuring_devices(cfg(measure_devices=16))


def test_results_read_back_as_measurements(tmp_path):
    ms = [Measurement(1024, 2, 16, 0.25, 5 * GB, 6 * GB, source="gpu", ranks=2, purpose="ckpt-all", wall_s=1.0),
          Measurement(1024, 2, 8, None, None, None, oom=True, source="gpu", ranks=2, purpose="ckpt-probe")]
    path = tmp_path / "sp2.jsonl"
    lines = [json.dumps({"measurement": asdict(m)}) for m in ms]
    path.write_text("\n".join(lines) + "\n")
    assert read_results(path) == (ms, None)  # no closing line: the worker did not finish
    done = {"done": True, "skipped": [{"pack_len": 512, "sp": 2}], "warnings": [], "hardware": {}}
    path.write_text("\n".join(lines + [json.dumps(done)]) + "\n" + '{"measurement": {"pack_')  # a line cut by a kill
    assert read_results(path) == (ms, done)
    assert read_results(tmp_path / "missing.jsonl") == ([], None)


def _launcher(tmp_path, **kw) -> SpLauncher:
    return SpLauncher(["model=tiny_llama"], cfg(device="cpu", worker_timeout_s=5, **kw), [2], None, 80 * GB,
                      run_dir=tmp_path)


def test_an_oom_relaunches_for_the_rest_and_a_failure_keeps_what_was_measured(tmp_path, monkeypatch):
    """Attempt 1 measures one point, then a rank runs out of memory (marker, exit code EXIT_OOM); attempt 2 gets
    both as known and finishes. Another degree's worker dies: its point is kept, the warning names the log."""
    jobs, script = [], []

    def fake_start(self, sp, job_path, log, timeout):
        job = json.loads(job_path.read_text())
        jobs.append(job)
        assert timeout > 0 and job["sp"] == sp and job["lengths"] == [1024, 512]
        return script.pop(0)(job, log)

    def measures_then_oom(job, log):
        m = Measurement(1024, 2, 16, 0.5, GB, None, source="cpu", ranks=2)
        with open(job["results"], "a") as f:
            f.write(json.dumps({"measurement": asdict(m)}) + "\n")
        (tmp_path / "sp2.oom1.json").write_text(json.dumps({"pack_len": 1024, "sp": 2, "ckpt_layers": 8,
                                                            "rank": 1}))
        return EXIT_OOM

    def finishes(job, log):
        with open(job["results"], "a") as f:
            f.write(json.dumps({"measurement": asdict(Measurement(512, 2, 16, 0.2, GB, None, ranks=2))}) + "\n")
            f.write(json.dumps({"done": True, "skipped": [], "warnings": ["the search's, met again by the replay"]})
                    + "\n")
        return 0

    monkeypatch.setattr(SpLauncher, "_start", fake_start)
    script[:] = [measures_then_oom, finishes]
    result = _launcher(tmp_path).run(2, [1024, 512], 100.0, [])
    assert result.status == "measured" and result.attempts == 2
    assert [(m.pack_len, m.ckpt_layers, m.oom) for m in result.measurements] == \
        [(1024, 16, False), (1024, 8, True), (512, 16, False)]
    assert all(m.ranks == 2 and not m.estimated for m in result.measurements)
    assert "rank 1 of 2" in result.measurements[1].note
    # the relaunch resumes: it is given the first attempt's measurement and the OOM as known
    assert [(k["pack_len"], k["ckpt_layers"], k["oom"]) for k in jobs[1]["known"]] == [(1024, 16, False),
                                                                                        (1024, 8, True)]
    assert result.warnings == [] and not (tmp_path / "sp2.oom1.json").exists()

    def dies(job, log):
        with open(job["results"], "a") as f:
            f.write(json.dumps({"measurement": asdict(Measurement(1024, 2, 16, 0.5, GB, None, ranks=2))}) + "\n")
        with open(log, "a") as f:
            f.write("[launch] hbp_train.profiler.worker failed: rank 0 stopped first, with exit code 1\n")
        return 1

    script[:] = [dies]
    jobs.clear()
    result = _launcher(tmp_path).run(2, [1024, 512], 100.0, [])
    assert result.status == "failed" and len(result.measurements) == 1
    assert len(result.warnings) == 1 and result.warnings[0].startswith("sp=2: measuring on 2 ranks failed (exit code 1")
    assert str(tmp_path / "sp2.log") in result.warnings[0] and "the rest estimated" in result.warnings[0]


def test_a_worker_past_its_time_is_stopped(tmp_path, monkeypatch):
    """A real subprocess that never finishes: stopped at the time budget left + worker_timeout_s, status timeout."""
    monkeypatch.setattr(launcher_mod, "launch_command",
                        lambda sp, job: [sys.executable, "-c", "import time; time.sleep(60)"])
    launcher = SpLauncher([], cfg(device="cpu", worker_timeout_s=0.5), [2], None, GB, run_dir=tmp_path)
    result = launcher.run(2, [1024], 0.0, [])
    assert result.status == "timeout" and result.wall_s < 30 and "still running after" in result.warnings[0]


class CurveLauncher:
    """Stands in for the torchruns in a test of the search's side: each degree is measured by a Profiler of its own
    (as worker.py does), on a curve backend that measures that degree."""

    def __init__(self, degrees, fail=()):
        self.degrees, self.fail, self.calls = list(degrees), set(fail), []

    def run(self, sp, lengths, budget_left_s, known):
        self.calls.append((sp, list(lengths)))
        if sp in self.fail:
            return LaunchResult(sp, "failed", warnings=[f"sp={sp}: measuring on {sp} ranks failed (exit code 1)"])
        inner = Profiler(_curves(num_gpus=sp), cfg(world_size=8), sp_degrees=[sp])
        inner.add_measurements(known)
        inner.measure_degree(sp, lengths)
        new = [m for m in inner.measurements if m not in known]
        for m in new:
            m.ranks = sp
        return LaunchResult(sp, "measured", measurements=new, attempts=1)


def _curves(num_gpus):
    return CurveBackend(compute_time(), linear_mem(), LAYERS, 80 * GB, num_gpus=num_gpus)


def _key(m):
    return (m["pack_len"], m["sp"], m["ckpt_layers"])


@pytest.mark.parametrize("prune", [True, False])
def test_degree_by_degree_with_torchruns_gives_the_in_process_profile(prune):
    """The profile with sp=2, 4, 8 measured by one 'torchrun' each equals the one where a backend measures every
    degree in process: same groups, same measured points; no sp > 1 point is estimated or measured twice, and a
    degree is only given the lengths that a smaller degree did not already settle without checkpointing."""
    c = cfg(world_size=8, prune=prune)
    reference = Profiler(_curves(num_gpus=8), c).run()
    local = _curves(num_gpus=1)
    fake = CurveLauncher([2, 4, 8])
    got = Profiler(local, c, launcher=fake).run()
    assert got["groups"] == reference["groups"]
    assert sorted(map(_key, got["measurements"])) == sorted(map(_key, reference["measurements"]))
    assert not any(m["estimated"] for m in got["measurements"])
    assert {sp for _, sp, _ in local.calls} == {1}, "sp > 1 only in the torchruns"
    assert [sp for sp, _ in fake.calls] == [2, 4, 8]
    asked = dict(fake.calls)
    if prune:  # a length goes to a degree only while every smaller degree needs checkpointing there
        oracle = Profiler(_curves(num_gpus=8), c)
        for sp, lengths in fake.calls:
            for length in [l for l in c.candidate_lengths() if l % sp == 0]:
                settled = any(oracle.greedy_profile_ckpt(length, d).ckpt_layers == 0 for d in (1, 2, 4) if d < sp)
                assert (length in lengths) == (not settled), (sp, length)
        assert asked[2] != c.candidate_lengths()[::-1]  # short lengths fit at sp=1 without checkpointing
    else:
        assert asked[2] == c.candidate_lengths()[::-1]
    assert [r["status"] for r in got["profiler"]["sp_runs"]] == ["measured"] * 3
    assert got["profiler"]["estimated"] == 0 and got["profiler"]["sp_runs"][0]["ranks"] == 2


def test_a_failed_torchrun_leaves_its_degree_to_the_estimate_with_a_warning():
    from hbp_train.profiler.report import format_table

    local = _curves(num_gpus=1)
    got = Profiler(local, cfg(world_size=8), launcher=CurveLauncher([2, 4], fail=[4])).run()
    by_sp = {}
    for m in got["measurements"]:
        by_sp.setdefault(m["sp"], set()).add(m["estimated"])
    assert by_sp[2] == {False} and by_sp[4] == {True} and by_sp.get(8, {True}) == {True}
    assert any(w.startswith("sp=4: measuring on 4 ranks failed") for w in got["warnings"])
    assert got["profiler"]["estimated"] > 0 and got["profiler"]["sp_runs"][1]["status"] == "failed"
    table = format_table({**got, "source": "curve"})
    assert "sp=4: failed on 4 ranks" in table and "warning: sp=4: measuring on 4 ranks failed" in table


@pytest.mark.slow
def test_profiler_measures_sp2_on_two_gloo_processes(tmp_path, capsys):
    """`python -m hbp_train.profiler` on the CPU with SP degrees 1 and 2: sp=1 measured in process, sp=2 by ONE
    torchrun of 2 gloo ranks (the worker builds the tiny model with the Ulysses attention at degree 2). Its points
    come back measured, positive, and each rank holds the activations of half the pack: half the single-process
    measurement of the same pack, and the single-process measurement of a pack half as long (the reference)."""
    from hbp_train.perf.memory import JobSettings, model_state_bytes
    from hbp_train.profiler import cli

    out = tmp_path / "profile.json"
    rc = cli.main(["model=tiny_llama", "model.dtype=fp32", "profile.device=cpu", "profile.measure_devices=2",
                   "profile.world_size=2", "profile.lengths=[128,256]", "profile.min_len=128", "profile.max_len=256",
                   "profile.iters=1", "profile.warmup_iters=0", "profile.prune=false", "profile.progress=false",
                   f"profile.output={out}"])
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    data = json.loads(out.read_text())
    by_key = {(m["pack_len"], m["sp"], m["ckpt_layers"]): m for m in data["measurements"]}
    sp2 = [m for m in data["measurements"] if m["sp"] == 2]
    assert {m["pack_len"] for m in sp2} == {128, 256}
    for m in sp2:
        assert m["source"] == "cpu" and m["ranks"] == 2 and not m["estimated"] and not m["oom"]
        assert m["time_s"] > 0 and m["peak_mem_bytes"] > 0
    assert data["profiler"]["estimated"] == 0 and data["profiler"]["measured"] == len(data["measurements"])
    (run,) = data["profiler"]["sp_runs"]
    assert run["sp"] == 2 and run["status"] == "measured" and run["attempts"] == 1 and run["measured"] == len(sp2)
    assert (tmp_path / "profile.sp_runs" / "sp2.log").exists()
    assert all(not g["estimated"] for g in data["groups"])
    assert "cpu measured on 2 ranks" in printed.out and "sp=2: measured on 2 ranks" in printed.out
    job = data["job"]
    from dataclasses import fields

    states = model_state_bytes(data["model"]["num_params"], 2,
                               JobSettings(**{f.name: job[f.name] for f in fields(JobSettings) if f.name in job}))
    for m in sp2:
        act = m["peak_mem_bytes"] - states
        whole = by_key[m["pack_len"], 1, m["ckpt_layers"]]["peak_mem_bytes"] - states
        # a rank saves half of what one process saves for the whole pack (its tokens; its heads of attention)
        assert 0 < act < whole and act == pytest.approx(whole / 2, rel=0.05), (m, act, whole)
        if m["pack_len"] == 256:  # the reference: one process, the 128-token half
            half = by_key[128, 1, m["ckpt_layers"]]["peak_mem_bytes"] - states
            assert act == pytest.approx(half, rel=0.05), (act, half)
