"""Export CLI: --help and one-line errors. (The round trip, ZeRO-2 and ZeRO-3 checkpoints to HF and logits equal to
the trained model's, runs where the checkpoints are made: tests/test_trainer.py and tests/test_trainer_dist.py.)"""

from __future__ import annotations

import pytest

from hbp_train.export import main


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "--checkpoint" in text and "--out" in text and "--dtype" in text


def test_not_a_checkpoint_is_one_line_exit_2(tmp_path, capsys):
    assert main(["--checkpoint", str(tmp_path), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("export error:") and "not a checkpoint" in err and "\n" not in err
    (tmp_path / "step_00000001").mkdir()
    assert main(["--checkpoint", str(tmp_path / "step_00000001"), "--out", str(tmp_path / "hf")]) == 2
    assert "no hf/config.json" in capsys.readouterr().err


def test_bad_out_is_one_line_exit_2(tmp_path, capsys):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    assert main(["--checkpoint", str(tmp_path), "--out", str(a_file)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"export error: --out {a_file}: exists and is not a directory"


def test_missing_or_untrained_checkpoint_says_why(tmp_path, capsys):
    assert main(["--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "hf")]) == 2
    assert f"--checkpoint {tmp_path / 'nope'}: no such directory" in capsys.readouterr().err
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)  # a run that has not saved yet
    assert main(["--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"export error: {tmp_path / 'run' / 'checkpoints'}: no checkpoint saved yet") and "\n" not in err


def test_out_holding_another_model_is_refused(tmp_path, capsys):
    base = tmp_path / "base_model"
    base.mkdir()
    (base / "model.safetensors").write_bytes(b"weights")
    assert main(["--checkpoint", str(tmp_path), "--out", str(base)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"export error: --out {base}: directory is not empty") and "hbp_export.json" in err
    assert (base / "model.safetensors").read_bytes() == b"weights"
    (base / "hbp_export.json").write_text("{}")  # an earlier export may be replaced: the checkpoint is checked next
    assert main(["--checkpoint", str(tmp_path), "--out", str(base)]) == 2
    assert "not a checkpoint" in capsys.readouterr().err
