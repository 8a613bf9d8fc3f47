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
