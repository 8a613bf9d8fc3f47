"""One error type for the user's mistakes (hbp_train/common/errors.py): every CLI turns a ``UserError`` into one line and
exit code 2, and lets any other exception — a ValueError from deep inside numpy, torch or our own code is a bug —
go by with its traceback, never dressed up as bad input."""

from __future__ import annotations

import numpy as np
import pytest

from hbp_train.common.errors import EXIT_USER_ERROR, UserError

BUG = "an internal ValueError that is not about the input"
USER = "lengths.txt:3: a user mistake; the fix is named here"
PACK_ARGS = ["--world-size", "2", "--groups", "64:1,256:2", "--global-tokens", "512", "--quiet", "--no-baseline"]


@pytest.fixture()
def lengths_file(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("\n".join(map(str, np.random.default_rng(0).integers(1, 256, 60))) + "\n")
    return path


@pytest.fixture()
def plan_file(tmp_path, lengths_file):
    from data_tools import pack

    out = tmp_path / "plan.json"
    assert pack.main(["--lengths", str(lengths_file), *PACK_ARGS, "--out", str(out)]) == 0
    return out


def _raiser(exc):
    def fail(*args, **kwargs):
        raise exc

    return fail


def _one_line_exit_2(capsys, rc) -> str:
    assert rc == EXIT_USER_ERROR
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


def _pack(monkeypatch, exc, lengths_file, tmp_path):
    import hbp_train.planning
    from data_tools import pack

    monkeypatch.setattr(hbp_train.planning, "make_plan", _raiser(exc))
    return pack.main(["--lengths", str(lengths_file), *PACK_ARGS, "--out", str(tmp_path / "out.json")])


def _compare(monkeypatch, exc, lengths_file, tmp_path):
    import hbp_train.planning
    from data_tools import compare

    monkeypatch.setattr(hbp_train.planning, "make_plan", _raiser(exc))
    return compare.main(["--lengths", str(lengths_file), "--world-size", "2", "--groups", "64:1,256:2",
                         "--global-tokens", "512", "--strategies", "hbp", "--quiet"])


def _simulate(monkeypatch, exc, plan_file, tmp_path):
    import hbp_train.planning.simulator
    from data_tools import simulate

    monkeypatch.setattr(hbp_train.planning.simulator, "simulate", _raiser(exc))
    return simulate.main(["--plan", str(plan_file)])


CLIS = {"pack": (_pack, "lengths_file"), "compare": (_compare, "lengths_file"), "simulate": (_simulate, "plan_file")}


@pytest.mark.parametrize("cli", sorted(CLIS))
def test_a_valueerror_from_inside_keeps_its_traceback(cli, monkeypatch, request, tmp_path, capsys):
    run, fixture = CLIS[cli]
    with pytest.raises(ValueError, match=BUG):
        run(monkeypatch, ValueError(BUG), request.getfixturevalue(fixture), tmp_path)
    assert "error" not in capsys.readouterr().err  # not reported as the user's mistake


@pytest.mark.parametrize("cli", sorted(CLIS))
def test_a_usererror_is_one_line_and_exit_2(cli, monkeypatch, request, tmp_path, capsys):
    run, fixture = CLIS[cli]
    err = _one_line_exit_2(capsys, run(monkeypatch, UserError(USER), request.getfixturevalue(fixture), tmp_path))
    assert err.endswith(USER)


def test_the_checks_of_the_planning_config_are_user_errors():
    from hbp_train.planning import GroupSpec, PlanConfig

    with pytest.raises(UserError, match="groups.sp must be a power of two"):
        GroupSpec(64, 3)
    with pytest.raises(UserError, match="must divide world_size=2"):
        PlanConfig(world_size=2, groups=[GroupSpec(64, 4)])


# --- the training entry point (hbp_train.train), in-process: the trainer is replaced, the entry is real ----------

@pytest.fixture()
def train_entry(monkeypatch, tmp_path):
    """(_task, config) for a real composed config; distributed set-up is a 1-process gloo group, the trainer a stub
    the test sets. Skipped where a process group already exists: run() destroys the group it set up."""
    import torch.distributed as dist

    from hbp_train import config, train
    from hbp_train.distributed import groups

    if dist.is_initialized():
        pytest.skip("a process group from another test exists; run() would tear it down")

    def init_gloo():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    monkeypatch.setattr(groups, "init_distributed", init_gloo)
    for name in ("RANK", "TORCHELASTIC_ERROR_FILE", "HBP_LAUNCHER", "HBP_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    cfg = config.compose(["experiment=cpu_demo", f"data.shards={tmp_path / 'shards'}",
                          f"train.out_dir={tmp_path / 'run'}"])
    return train._task, cfg


def test_train_entry_lets_an_internal_valueerror_through(train_entry, monkeypatch, capsys):
    import torch.distributed as dist

    from hbp_train import trainer

    task, cfg = train_entry
    monkeypatch.setattr(trainer, "train", _raiser(ValueError(BUG)))
    with pytest.raises(ValueError, match=BUG):
        task(cfg)
    assert "error" not in capsys.readouterr().err
    assert not dist.is_initialized()  # torn down on the way out


def test_train_entry_reports_a_usererror_in_one_line_exit_2(train_entry, monkeypatch, capsys, tmp_path):
    from hbp_train import trainer

    task, cfg = train_entry
    monkeypatch.setattr(trainer, "train", _raiser(UserError(USER)))
    with pytest.raises(SystemExit) as exit_info:
        task(cfg)
    err = _one_line_exit_2(capsys, exit_info.value.code)
    assert err.startswith(f"error: {USER}")
    assert (tmp_path / "run" / "config.yaml").is_file()  # the run got as far as the trainer


def test_train_entry_reports_a_bad_config_value_in_one_line_exit_2(train_entry, capsys):
    from hbp_train import config

    task, _ = train_entry
    bad = config.compose(["experiment=cpu_demo", "data.shards=x", "logging.log_every=0"])
    with pytest.raises(SystemExit) as exit_info:
        task(bad)
    assert _one_line_exit_2(capsys, exit_info.value.code) == "config error: logging.log_every=0: must be >= 1"
