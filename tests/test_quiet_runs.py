"""Lines and files that alarm a user for nothing, each checked at its cause: DeepSpeed's "unable to detect" an
accelerator from hbp-export without a GPU; transformers' `past_key_values` deprecation from hbp-eval's needle check;
its "indexing errors" warning for a sample hbp-preprocess then drops as overlong; the preprocessing summary's chat
template line for plain text; the loader's own keys added to an exported tokenizer_config.json. (A CPU profile's
per-process column: tests/test_profiler_defaults.py.)"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def transformers_log():
    """Every record transformers logs during the test (its loggers do not propagate to pytest's), with its
    warn-once memory cleared so a warning given earlier in the session shows again."""
    from transformers.utils import logging as hf_logging

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    handler = Keep()
    root = logging.getLogger("transformers")
    root.addHandler(handler)
    hf_logging.warning_once.cache_clear()
    yield records
    root.removeHandler(handler)


def test_export_without_a_gpu_names_deepspeeds_accelerator(tmp_path):
    """hbp-export run directly (no launch.sh to set DS_ACCELERATOR) on a machine without a GPU."""
    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    env.update(CUDA_VISIBLE_DEVICES="", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "hbp_train.export", "--checkpoint", str(tmp_path), "--out",
                           str(tmp_path / "hf")], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "not a checkpoint" in proc.stderr  # got past importing DeepSpeed
    assert "accelerator" not in proc.stderr + proc.stdout, proc.stderr


def test_needle_scoring_uses_the_models_own_cache_keyword(tokenizer_dir, transformers_log):
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from eval.needle import score_sample
    from eval.tasks.needle import NeedleConfig, generate_samples

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)).eval()
    sample = generate_samples(tokenizer, NeedleConfig(lengths=[150], depths=[0.5], trials=1))[0]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = score_sample(model, tokenizer, sample, max_new_tokens=3, stop_ids=set())
    assert len(result["logliks"]) == 5
    said = [str(w.message) for w in caught] + transformers_log
    assert not [line for line in said if "past_key_values" in line or "deprecated" in line], said


def test_a_sample_dropped_as_overlong_raises_no_indexing_warning(tmp_path, transformers_log):
    """A tokenizer with a short model_max_length and a template without generation markers (so conversations are
    tokenized one by one): the long sample is dropped by --max-len, with nothing said about indexing errors."""
    from tests.test_preprocess import LLAMA_LIKE_TEMPLATE, run, tokenizer_with_template, write_jsonl

    tokenizer = tokenizer_with_template(tmp_path, LLAMA_LIKE_TEMPLATE)
    config_path = Path(tokenizer) / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "model_max_length": 100}))
    long = {"messages": [{"role": "user", "content": "word " * 60}, {"role": "assistant", "content": "ok"}]}
    short = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
    report, _ = run(tmp_path, [write_jsonl(tmp_path / "d.jsonl", [long, short])], tokenizer=tokenizer, max_len=100)
    assert report["dropped"] == {"overlong": 1} and report["label_mode"] == "incremental"
    assert not [line for line in transformers_log if "sequence length" in line], transformers_log


def test_a_plain_text_csv_is_reported_as_plain_text(tmp_path, capsys):
    from data_tools.preprocess import main
    from tests.test_preprocess import TOKENIZER

    path = tmp_path / "c_text.csv"
    path.write_text("origin,text\nweb,Some plain text.\nbook,More text.\n")
    assert main(["--input", str(path), "--output", str(tmp_path / "o"), "--tokenizer", TOKENIZER]) == 0
    label_line = [line for line in capsys.readouterr().out.splitlines() if line.startswith("labels:")]
    assert label_line and label_line[0].startswith("labels: plain text, no chat template, the text (or completion) "
                                                   "and the eos trained;")
    assert json.loads((tmp_path / "o" / "report.json").read_text())["plain_text"] == 2


def _saved_checkpoint(tmp_path, user_tokenizer: Path):
    """A checkpoint whose hf/ holds the tokenizer as the trainer saves it (transformers' save_pretrained of the
    tokenizer it loaded from model.tokenizer), and whose config.yaml names that folder."""
    from transformers import AutoTokenizer, LlamaConfig

    from tests.assets.packed_fixture import TINY_LLAMA
    from tests.test_export import _complete

    tag = tmp_path / "run" / "checkpoints" / "step_00000003"
    config = LlamaConfig(**TINY_LLAMA, vocab_size=4096, use_cache=False)
    config.save_pretrained(tag / "hf")
    AutoTokenizer.from_pretrained(str(user_tokenizer)).save_pretrained(str(tag / "hf"))
    (tag / "config.yaml").write_text(f"model:\n  tokenizer: {user_tokenizer}\n")
    _complete(tag)
    return tag, config


def _export(tmp_path, monkeypatch, tag, config) -> Path:
    import torch
    from transformers import AutoModelForCausalLM

    from hbp_train.export import export
    from tests.test_export import _consolidated

    torch.manual_seed(0)
    _consolidated(monkeypatch, AutoModelForCausalLM.from_config(config))
    out = tmp_path / "export"
    export(str(tag), str(out))
    return out


def test_export_writes_the_users_tokenizer_files_as_they_were(tmp_path, tokenizer_dir, monkeypatch):
    user = tmp_path / "my_tokenizer"
    shutil.copytree(tokenizer_dir, user)
    tag, config = _saved_checkpoint(tmp_path, user)
    saved = json.loads((tag / "hf" / "tokenizer_config.json").read_text())
    assert saved["is_local"] is True  # what a re-save adds, and the checkpoint holds
    out = _export(tmp_path, monkeypatch, tag, config)
    for name in ("tokenizer_config.json", "tokenizer.json"):
        assert (out / name).read_bytes() == (user / name).read_bytes()
    assert not (out / "chat_template.jinja").exists()  # the template stays where the user had it


def test_export_without_the_users_folder_writes_the_checkpoints_copy_without_loader_keys(tmp_path, tokenizer_dir,
                                                                                         monkeypatch):
    from transformers import AutoTokenizer

    user = tmp_path / "my_tokenizer"
    shutil.copytree(tokenizer_dir, user)
    tag, config = _saved_checkpoint(tmp_path, user)
    shutil.rmtree(user)  # moved since training
    out = _export(tmp_path, monkeypatch, tag, config)
    exported = json.loads((out / "tokenizer_config.json").read_text())
    assert "is_local" not in exported and "local_files_only" not in exported
    checkpoint_copy = json.loads((tag / "hf" / "tokenizer_config.json").read_text())
    assert exported == {k: v for k, v in checkpoint_copy.items() if k not in ("is_local", "local_files_only")}
    loaded, original = AutoTokenizer.from_pretrained(str(out)), AutoTokenizer.from_pretrained(str(tokenizer_dir))
    assert loaded.get_vocab() == original.get_vocab() and loaded.chat_template == original.chat_template
