"""Tests of the OpenCompass wrapper (eval/opencompass.py, eval/run.py opencompass) without OpenCompass installed:
the generated config runs against stand-in modules, the one-line errors for a missing install or missing data,
and a full run through a stand-in ``opencompass`` executable that writes a summary CSV as OpenCompass does."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import json
import os
import subprocess
import sys
import types
from contextlib import contextmanager
from pathlib import Path

import pytest

from eval import opencompass as oc
from eval.model_io import UsageError
from eval.run import main

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture()
def model_dir(tmp_path, tokenizer_dir) -> Path:
    """An exported-checkpoint directory as far as the wrapper looks at it: config.json and the tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig

    out = tmp_path / "my-model"
    LlamaConfig(vocab_size=4096, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                max_position_embeddings=131072).save_pretrained(str(out))
    AutoTokenizer.from_pretrained(str(tokenizer_dir)).save_pretrained(str(out))
    return out


@pytest.fixture()
def isolated_home(tmp_path, monkeypatch) -> Path:
    """No real ~/.cache/opencompass or tiktoken cache may satisfy the data check."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for name in ("COMPASS_DATA_CACHE", "TIKTOKEN_CACHE_DIR", "DATA_GYM_CACHE_DIR"):
        monkeypatch.delenv(name, raising=False)
    return home


@pytest.fixture()
def fake_venv(tmp_path) -> Path:
    """A venv whose ``opencompass`` writes an OpenCompass-format summary CSV and records its argv and env."""
    venv = tmp_path / "venv-oc"
    (venv / "bin").mkdir(parents=True)
    script = venv / "bin" / "opencompass"
    script.write_text(f"""#!{sys.executable}
import json, os, sys
config, work = sys.argv[1], sys.argv[sys.argv.index("-w") + 1]
summary = os.path.join(work, "20261123_120000", "summary")
os.makedirs(summary, exist_ok=True)
with open(os.path.join(summary, "summary_20261123_120000.csv"), "w") as f:
    f.write("dataset,version,metric,mode,my-model\\n")
    f.write("mmlu,-,naive_average,gen,61.25\\n")
    f.write("gsm8k,1d7fe4,accuracy,gen,48.50\\n")
    f.write("math,-,-,-,-\\n")
with open(os.path.join(work, "call.json"), "w") as f:
    json.dump({{"argv": sys.argv, "COMPASS_DATA_CACHE": os.environ.get("COMPASS_DATA_CACHE"),
               "TOKENIZER_MODEL": os.environ.get("TOKENIZER_MODEL")}}, f)
""")
    script.chmod(0o755)
    return venv


class _StubModule(types.ModuleType):
    """Stands in for any OpenCompass/mmengine module: names resolve to recognisable values."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "read_base":
            return contextmanager(lambda: (yield))
        if name.endswith("_datasets"):
            return [{"abbr": f"{self.__name__}:{name}"}]
        if name.endswith("_summary_groups"):
            return [{"name": f"{self.__name__}:{name}"}]
        if name.endswith("_summarizer"):
            return {"summary_groups": [{"name": f"{self.__name__}:{name}"}]}
        return type(name, (), {"stub_of": f"{self.__name__}.{name}"})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname.split(".")[0] in ("opencompass", "mmengine"):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module):
        pass


@pytest.fixture()
def stub_opencompass(monkeypatch):
    finder = _StubFinder()
    monkeypatch.setattr(sys, "meta_path", [finder, *sys.meta_path])
    yield
    for name in [n for n in sys.modules if n.split(".")[0] in ("opencompass", "mmengine")]:
        del sys.modules[name]


def test_generated_config_is_valid_python_with_models_and_datasets(model_dir, tmp_path, stub_opencompass):
    out = tmp_path / "oc"
    code = main(["opencompass", "--model", str(model_dir), "--datasets", "general,ruler,needlebench,longbench",
                 "--long-lengths", "32k,128k", "--out", str(out), "--dry-run"])
    assert code == 0
    namespace: dict = {}
    exec(compile((out / "opencompass_config.py").read_text(), "opencompass_config.py", "exec"), namespace)

    [model] = namespace["models"]
    assert model["type"].stub_of == "opencompass.models.HuggingFacewithChatTemplate"  # the tokenizer has a template
    assert model["path"] == str(model_dir.resolve()) and model["tokenizer_path"] == str(model_dir.resolve())
    assert model["max_seq_len"] == 131072 and model["run_cfg"] == {"num_gpus": 1}
    abbrs = [d["abbr"] for d in namespace["datasets"]]
    assert abbrs == [
        "opencompass.configs.datasets.mmlu.mmlu_gen:mmlu_datasets",
        "opencompass.configs.datasets.mmlu_pro.mmlu_pro_gen:mmlu_pro_datasets",
        "opencompass.configs.datasets.cmmlu.cmmlu_gen:cmmlu_datasets",
        "opencompass.configs.datasets.bbh.bbh_gen:bbh_datasets",
        "opencompass.configs.datasets.gsm8k.gsm8k_gen:gsm8k_datasets",
        "opencompass.configs.datasets.math.math_gen:math_datasets",
        "opencompass.configs.datasets.ruler.ruler_32k_gen:ruler_datasets",
        "opencompass.configs.datasets.ruler.ruler_128k_gen:ruler_datasets",
        "opencompass.configs.datasets.needlebench.needlebench_32k.needlebench_32k:needlebench_datasets",
        "opencompass.configs.datasets.needlebench.needlebench_128k.needlebench_128k:needlebench_datasets",
        "opencompass.configs.datasets.longbench.longbench:longbench_datasets",
    ]
    groups = [g["name"] for g in namespace["summarizer"]["summary_groups"]]
    assert "opencompass.configs.summarizers.needlebench:needlebench_128k_summarizer" in groups
    assert "opencompass.configs.summarizers.groups.ruler:ruler_summary_groups" in groups
    assert len(groups) == len(set(groups))


def test_base_model_type_without_chat_template(model_dir, tmp_path):
    for name in ("chat_template.jinja", "chat_template.json"):
        (model_dir / name).unlink(missing_ok=True)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))
    text = oc.build_config(model_dir, ["gsm8k"], {}, max_seq_len=4096, max_out_len=256, batch_size=4, num_gpus=2)
    assert "type=HuggingFaceBaseModel," in text and "HuggingFacewithChatTemplate" not in text
    assert "run_cfg={'num_gpus': 2}" in text


def test_dataset_and_length_selection():
    assert oc.parse_datasets("general") == list(oc.GENERAL)
    assert oc.parse_datasets("long,mmlu,ruler") == [*oc.LONG, "mmlu"]
    with pytest.raises(UsageError, match="unknown benchmark 'mmlu-x'"):
        oc.parse_datasets("mmlu-x")
    with pytest.warns(UserWarning, match="needlebench has no config for 16k"):
        chosen = oc.parse_lengths("16k,32k", ["mmlu", "ruler", "needlebench"])
    assert chosen == {"ruler": ["16k", "32k"], "needlebench": ["32k"]}
    with pytest.raises(UsageError, match="needlebench has configs only for"):
        oc.parse_lengths("16k", ["needlebench"])


def test_missing_install_is_one_line_exit_2(model_dir, tmp_path):
    """Through the real CLI entry point: exit 2, one line on stderr, no traceback."""
    proc = subprocess.run([sys.executable, "-m", "eval.run", "opencompass", "--model", str(model_dir),
                           "--out", str(tmp_path / "oc"), "--venv", str(tmp_path / "no-venv")],
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "OpenCompass is not installed" in proc.stderr and "./launch.sh eval --setup-opencompass" in proc.stderr


def test_missing_data_offline_names_archives_and_places(model_dir, tmp_path, fake_venv, isolated_home, monkeypatch,
                                                        capsys):
    monkeypatch.setattr(oc, "have_network", lambda *a, **k: False)
    root = tmp_path / "compass-data"
    (root / "data" / "gsm8k").mkdir(parents=True)  # present: must not be asked for
    code = main(["opencompass", "--model", str(model_dir), "--datasets", "mmlu,bbh,gsm8k,needlebench",
                 "--out", str(tmp_path / "oc"), "--venv", str(fake_venv), "--data-cache", str(root)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and err.startswith("error: ")
    for archive in ("mmlu", "BBH", "needlebench"):
        assert oc.DATA_URL.format(name=archive) in err
    assert "gsm8k.zip" not in err
    assert f"unzip each into {root / 'data'}/" in err
    assert str(root / "tiktoken" / oc.TIKTOKEN_FILE) in err and oc.TIKTOKEN_URL in err
    assert not (tmp_path / "oc" / "work").exists()  # nothing ran


def test_run_collects_summary(model_dir, tmp_path, fake_venv, isolated_home):
    root = tmp_path / "compass-data"
    for name in ("mmlu", "gsm8k", "math"):
        (root / "data" / name).mkdir(parents=True)
    out = tmp_path / "oc"
    code = main(["opencompass", "--model", str(model_dir), "--datasets", "mmlu,gsm8k,math", "--out", str(out),
                 "--venv", str(fake_venv), "--data-cache", str(root)])
    assert code == 0
    call = json.loads((out / "work" / "call.json").read_text())
    assert call["argv"][1] == str(out / "opencompass_config.py")
    assert call["COMPASS_DATA_CACHE"] == str(root.resolve())
    assert call["TOKENIZER_MODEL"] == str(model_dir.resolve())

    summary = json.loads((out / "summary.json").read_text())
    assert summary["benchmarks"] == ["mmlu", "gsm8k", "math"]
    scores = {(r["dataset"], r["metric"]): r["scores"]["my-model"] for r in summary["rows"]}
    assert scores == {("mmlu", "naive_average"): 61.25, ("gsm8k", "accuracy"): 48.5, ("math", "-"): None}
    table = (out / "summary.md").read_text()
    assert "| mmlu | naive_average | gen | 61.25 |" in table and "| math | - | - | - |" in table


def test_setup_creates_venv_then_installs(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(oc.subprocess, "run",
                        lambda cmd, **kw: calls.append(cmd) or types.SimpleNamespace(returncode=0))
    assert main(["--setup-opencompass", "--venv", str(tmp_path / "v")]) == 0
    assert calls[0][1:] == ["-m", "venv", str(tmp_path / "v")]
    installs = [c[-1] for c in calls[1:]]
    assert installs[-1] == oc.OPENCOMPASS_REQUIREMENT
    assert any(i.startswith("torch==") for i in installs)  # torch pinned before OpenCompass can pull a CUDA build


def test_bad_config_json_and_max_seq_len_are_one_line(model_dir, tmp_path, capsys):
    assert main(["opencompass", "--model", str(model_dir), "--out", str(tmp_path / "oc"), "--max-seq-len", "0",
                 "--dry-run"]) == 2
    assert capsys.readouterr().err.strip() == "error: --max-seq-len 0: need >= 1"
    (model_dir / "config.json").write_text("{not json")
    assert main(["opencompass", "--model", str(model_dir), "--out", str(tmp_path / "oc"), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert "config.json is not valid JSON" in err and "\n" not in err
    assert not (tmp_path / "oc").exists()  # nothing written before the input is known to be good


def test_model_without_tokenizer_is_one_line(model_dir, tmp_path, capsys):
    for name in ("tokenizer.json", "tokenizer.model", "vocab.json"):
        (model_dir / name).unlink(missing_ok=True)
    assert main(["opencompass", "--model", str(model_dir), "--out", str(tmp_path / "oc"), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --model {model_dir.resolve()}: no tokenizer") and "\n" not in err
    assert not (tmp_path / "oc").exists()


def test_help_documents_every_option(capsys):
    """--help of the CLI and of both subcommands explains every option."""
    import argparse

    from eval.run import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for argv, sub in (([], parser), (["offline"], subparsers.choices["offline"]),
                      (["opencompass"], subparsers.choices["opencompass"])):
        with pytest.raises(SystemExit) as info:
            main([*argv, "--help"])
        assert info.value.code == 0
        text = capsys.readouterr().out
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help and action.help.strip(), action.option_strings
            assert all(opt in text for opt in action.option_strings), action.option_strings
