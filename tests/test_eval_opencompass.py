"""Tests of the OpenCompass wrapper that need no OpenCompass run (eval/opencompass.py, eval/benchmarks.py,
eval/opencompass_venv.py, eval/run.py opencompass and compare): dataset selection, device/dtype/worker resolution,
the generated config (executed against stand-in modules: the stock benchmarks cannot run here without their data),
and the one-line errors. The real runs, on the real OpenCompass, are in tests/test_eval_opencompass_e2e.py."""

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

from eval import benchmarks
from eval import opencompass as oc
from eval import opencompass_venv
from eval.run import main
from hbp_train.common.errors import UserError
from tests.cli_exit import exit_code

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
def gpus(monkeypatch):
    """Set how many GPUs the wrapper sees."""
    def set_count(count: int):
        monkeypatch.setattr(oc, "visible_gpus", lambda: count)
    set_count(0)
    return set_count


class _StubModule(types.ModuleType):
    """Stands in for any OpenCompass/mmengine module: names resolve to recognisable values."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name == "read_base":
            return contextmanager(lambda: (yield))
        if name.endswith("_datasets"):
            return [{"abbr": f"{self.__name__}:{name}", "reader_cfg": {"input_columns": ["q"]}}]
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


def _exec(path: Path) -> dict:
    namespace: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    return namespace


def test_stock_benchmark_config_on_the_cpu(model_dir, tmp_path, stub_opencompass, gpus):
    out = tmp_path / "oc"
    code = main(["opencompass", "--model", str(model_dir), "--datasets", "general,ruler,needlebench,longbench",
                 "--long-lengths", "32k,128k", "--out", str(out), "--max-samples", "20", "--dry-run"])
    assert code == 0
    namespace = _exec(out / "opencompass_config.py")

    [model] = namespace["models"]
    assert model["type"].stub_of == "opencompass.models.HuggingFacewithChatTemplate"  # the tokenizer has a template
    assert model["path"] == str(model_dir.resolve()) and model["tokenizer_path"] == str(model_dir.resolve())
    # No GPU visible: the CPU, in fp32 (OpenCompass asserts with num_gpus=1 there), one task at a time.
    assert model["run_cfg"] == {"num_gpus": 0} and model["model_kwargs"] == {"torch_dtype": "float32"}
    assert model["max_seq_len"] == 131072
    # The chat template ends a turn with <|im_end|>: a stop word, with the tokenizer's eos.
    assert model["stop_words"] == ["<|endoftext|>", "<|im_end|>"]
    assert namespace["infer"]["partitioner"] == {"type": namespace["NumWorkerPartitioner"], "num_worker": 1}
    assert namespace["infer"]["runner"]["max_num_workers"] == 1
    assert namespace["eval"]["runner"]["task"]["type"].stub_of == "opencompass.tasks.OpenICLEvalTask"
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
    assert {d["reader_cfg"]["test_range"] for d in namespace["datasets"]} == {"[0:20]"}  # --max-samples
    assert namespace["datasets"][0]["reader_cfg"]["input_columns"] == ["q"]  # the rest of reader_cfg is kept
    groups = [g["name"] for g in namespace["summarizer"]["summary_groups"]]
    assert "opencompass.configs.summarizers.needlebench:needlebench_128k_summarizer" in groups
    assert "opencompass.configs.summarizers.groups.ruler:ruler_summary_groups" in groups
    assert len(groups) == len(set(groups))
    assert not (out / "suite").exists()  # no generated task asked for


def test_gpus_get_one_model_instance_each_in_bf16(model_dir, tmp_path, stub_opencompass, gpus):
    gpus(4)
    out = tmp_path / "oc"
    assert main(["opencompass", "--model", str(model_dir), "--datasets", "gsm8k", "--out", str(out), "--dry-run"]) == 0
    namespace = _exec(out / "opencompass_config.py")
    [model] = namespace["models"]
    assert model["run_cfg"] == {"num_gpus": 1} and model["model_kwargs"] == {"torch_dtype": "bfloat16"}
    assert namespace["infer"]["partitioner"]["num_worker"] == 4 and namespace["infer"]["runner"]["max_num_workers"] == 4
    # Two GPUs per instance: two instances side by side.
    assert main(["opencompass", "--model", str(model_dir), "--datasets", "gsm8k", "--out", str(out), "--dry-run",
                 "--num-gpus", "2"]) == 0
    namespace = _exec(out / "opencompass_config.py")
    assert namespace["models"][0]["run_cfg"] == {"num_gpus": 2} and namespace["infer"]["partitioner"]["num_worker"] == 2


@pytest.mark.parametrize("visible, argv, expected", [
    (0, ["--num-gpus", "1"], "error: --num-gpus 1: 0 GPU(s) visible; use --num-gpus 0 (the CPU)"),
    (0, ["--dtype", "bfloat16"], "error: --dtype bfloat16 with --num-gpus 0: the CPU runs the model in float32"),
    (2, ["--max-num-workers", "2", "--num-gpus", "2"], "error: --max-num-workers 2 x --num-gpus 2: 2 GPU(s) visible"),
    (0, ["--lengths", "200000"], "error: --lengths: 200000 tokens exceed 131072, the model's max_position_embeddings"),
    (0, ["--lengths", "600", "--max-seq-len", "512"], "error: --lengths: 600 tokens exceed 512, --max-seq-len"),
    (0, ["--lengths", "64"], "error: --lengths: 64 tokens cannot hold the needle and question"),
    (0, ["--depths", "0,2"], "error: --depths: '0,2' is not a list of numbers in [0, 1] (give e.g. 0,0.5,1)"),
    (0, ["--datasets", "mmlu-x"], "error: --datasets: unknown benchmark 'mmlu-x'; choose offline, general, long"),
    (0, ["--max-seq-len", "0"], "error: --max-seq-len: 0 is out of range (give a whole number >= 1)"),
])
def test_bad_options_are_one_line_and_write_nothing(model_dir, tmp_path, capsys, gpus, visible, argv, expected):
    gpus(visible)
    out = tmp_path / "oc"
    assert exit_code(main, ["opencompass", "--model", str(model_dir), "--out", str(out), "--dry-run", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(expected) or err.startswith("python -m eval.run opencompass: " + expected), err
    assert "\n" not in err and not out.exists()


def test_offline_suite_is_written_in_opencompass_dataset_format(model_dir, tmp_path, stub_opencompass, gpus):
    out = tmp_path / "oc"
    assert main(["opencompass", "--model", str(model_dir), "--out", str(out), "--lengths", "300,400",
                 "--depths", "0,1", "--trials", "3", "--qa-samples", "5", "--dry-run"]) == 0
    config = (out / "opencompass_config.py").read_text()
    for name in ("needle", "multikey", "variable_tracking", "demo_qa"):
        assert f"    from .suite.{name}_gen import {name}_datasets\n" in config  # read_base, relative to the config
        [dataset] = _exec(out / "suite" / f"{name}_gen.py")[f"{name}_datasets"]
        assert dataset["abbr"] == f"hbp_{name}" and dataset["type"].stub_of.endswith("CustomDataset")
        assert Path(dataset["path"]) == out / "suite" / f"{name}.jsonl"
        assert dataset["reader_cfg"] == {"input_columns": ["prompt"], "output_column": "answer"}
        rows = [json.loads(line) for line in Path(dataset["path"]).read_text().splitlines()]
        assert len(rows) == (5 if name == "demo_qa" else 2 * 2 * 3)
        assert all(isinstance(r["prompt"], str) and r["answer"] and isinstance(r["answer"], list) for r in rows)
    assert "RulerVtEvaluator" in (out / "suite" / "variable_tracking_gen.py").read_text()
    assert "EMEvaluator" in (out / "suite" / "demo_qa_gen.py").read_text()


def test_dataset_and_length_selection():
    assert oc.parse_datasets("offline") == ([], ["needle", "multikey", "variable_tracking", "demo_qa"])
    assert oc.parse_datasets("general") == (list(benchmarks.GENERAL), [])
    assert oc.parse_datasets("long,needle,mmlu,ruler,needle") == ([*benchmarks.LONG, "mmlu"], ["needle"])
    with pytest.raises(UserError, match="unknown benchmark 'mmlu-x'"):
        oc.parse_datasets("mmlu-x")
    with pytest.warns(UserWarning, match="needlebench has no config for 16k"):
        chosen = benchmarks.parse_lengths("16k,32k", ["mmlu", "ruler", "needlebench"])
    assert chosen == {"ruler": ["16k", "32k"], "needlebench": ["32k"]}
    with pytest.raises(UserError, match="needlebench has configs only for"):
        benchmarks.parse_lengths("16k", ["needlebench"])


def test_visible_gpus_follows_cuda_visible_devices(monkeypatch, tmp_path):
    """nvidia-smi's count, cut to CUDA_VISIBLE_DEVICES up to its first invalid entry; no nvidia-smi: none."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nfor i in 0 1 2 3; do echo \"GPU $i: NVIDIA H100 (UUID: GPU-$i)\"; done\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert oc.visible_gpus() == 4
    for visible, count in (("1,3", 2), ("", 0), ("2,-1,3", 1), ("0,1,2,3,4,5", 4)):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert oc.visible_gpus() == count, visible
    monkeypatch.setenv("PATH", str(tmp_path / "none"))
    assert oc.visible_gpus() == 0


def test_missing_install_is_one_line_exit_2(model_dir, tmp_path):
    """Through the real CLI entry point: exit 2, one line on stderr, no traceback."""
    proc = subprocess.run([sys.executable, "-m", "eval.run", "opencompass", "--model", str(model_dir),
                           "--out", str(tmp_path / "oc"), "--venv", str(tmp_path / "no-venv")],
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "Traceback" not in proc.stderr
    assert "OpenCompass is not installed" in proc.stderr and "./launch.sh eval --setup-opencompass" in proc.stderr
    assert not (tmp_path / "oc").exists()


def _venv(tmp_path: Path, stamped: bool) -> Path:
    """A venv folder as far as check_install looks (its entry point and stamp); nothing in it ever runs here."""
    venv = tmp_path / "venv-oc"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "opencompass").write_text("")
    if stamped:
        (venv / opencompass_venv.STAMP).write_text(opencompass_venv.fingerprint() + "\n")
    return venv


def test_unfinished_venv_is_refused(model_dir, tmp_path, capsys):
    venv = _venv(tmp_path, stamped=False)
    assert exit_code(main, ["opencompass", "--model", str(model_dir), "--out", str(tmp_path / "oc"), "--venv",
                            str(venv)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"the OpenCompass venv {venv} is unfinished or was built from other requirements" in err
    assert err.endswith("run ./launch.sh eval --setup-opencompass") and "\n" not in err
    (venv / opencompass_venv.STAMP).write_text("an older fingerprint\n")
    assert not opencompass_venv.is_ready(venv)


def test_missing_data_offline_names_archives_and_places(model_dir, tmp_path, isolated_home, monkeypatch, capsys):
    monkeypatch.setattr(benchmarks, "have_network", lambda *a, **k: False)
    root = tmp_path / "compass-data"
    (root / "data" / "gsm8k").mkdir(parents=True)  # present: must not be asked for
    code = main(["opencompass", "--model", str(model_dir), "--datasets", "mmlu,bbh,gsm8k,needlebench",
                 "--out", str(tmp_path / "oc"), "--venv", str(_venv(tmp_path, stamped=True)),
                 "--data-cache", str(root)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and "\n" not in err and err.startswith("error: ")
    for archive in ("mmlu", "BBH", "needlebench"):
        assert benchmarks.DATA_URL.format(name=archive) in err
    assert "gsm8k.zip" not in err
    assert f"unzip each into {root / 'data'}/" in err
    assert str(root / "tiktoken" / benchmarks.TIKTOKEN_FILE) in err and benchmarks.TIKTOKEN_URL in err
    assert not (tmp_path / "oc").exists()  # nothing written, nothing ran


def test_bad_config_json_and_missing_tokenizer_are_one_line(model_dir, tmp_path, capsys, gpus):
    (model_dir / "config.json").write_text("{not json")
    assert exit_code(main, ["opencompass", "--model", str(model_dir), "--out", str(tmp_path / "oc"), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert "config.json is not valid JSON" in err and "\n" not in err
    for name in ("tokenizer.json", "tokenizer.model", "vocab.json"):
        (model_dir / name).unlink(missing_ok=True)
    assert exit_code(main, ["opencompass", "--model", str(model_dir), "--out", str(tmp_path / "oc"), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: --model {model_dir.resolve()}: no tokenizer") and "\n" not in err
    assert not (tmp_path / "oc").exists()


def test_summary_csv_is_parsed_with_missing_scores_as_none(tmp_path):
    """OpenCompass's summary CSV (header dataset,version,metric,mode,<model>; '-' where nothing was scored)."""
    csv_path = tmp_path / "summary_20261125_120000.csv"
    csv_path.write_text("dataset,version,metric,mode,export\nhbp_needle,5ddc62,score,gen,12.50\n"
                        "hbp_demo_qa,-,-,-,-\n\n")
    assert oc.collect(csv_path) == [
        {"dataset": "hbp_needle", "version": "5ddc62", "metric": "score", "mode": "gen", "score": 12.5},
        {"dataset": "hbp_demo_qa", "version": "-", "metric": "-", "mode": "-", "score": None},
    ]
    csv_path.write_text("name,value\n")
    with pytest.raises(UserError, match="not an OpenCompass summary"):
        oc.collect(csv_path)


def _results(folder: Path, scores: list[tuple]) -> Path:
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps({"scores": [
        {"dataset": d, "metric": m, "mode": mode, "score": s} for d, m, mode, s in scores]}))
    return folder


def test_compare_puts_checkpoints_side_by_side(tmp_path, capsys):
    a = _results(tmp_path / "step_100" / "oc", [("hbp_needle", "score", "gen", 10.0), ("held-out", "loss", "offline",
                                                                                        2.5)])
    b = _results(tmp_path / "step_200" / "oc", [("hbp_needle", "score", "gen", 30.0),
                                                ("hbp_needle", "length 256", "breakdown", 50.0)])
    out = tmp_path / "cmp"
    assert main(["compare", str(a), str(b / "results.json"), "--out", str(out)]) == 0
    comparison = json.loads((out / "compare.json").read_text())
    assert [r["label"] for r in comparison["runs"]] == ["step_100/oc", "step_200/oc"]  # same folder name: longer
    assert [(r["dataset"], r["metric"], r["mode"], list(r["scores"].items())) for r in comparison["rows"]] == [
        ("hbp_needle", "score", "gen", [("step_100/oc", 10.0), ("step_200/oc", 30.0)]),
        ("held-out", "loss", "offline", [("step_100/oc", 2.5), ("step_200/oc", None)]),
        ("hbp_needle", "length 256", "breakdown", [("step_100/oc", None), ("step_200/oc", 50.0)]),
    ]
    assert "| hbp_needle | score | 10 | 30 |" in (out / "compare.md").read_text()
    assert "| held-out | loss | 2.5 | - |" in capsys.readouterr().out
    assert (out / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["compare", str(a), str(b), "--out", str(out), "--labels", "early,late"]) == 0
    assert [r["label"] for r in json.loads((out / "compare.json").read_text())["runs"]] == ["early", "late"]


@pytest.mark.parametrize("argv, expected", [
    (["RUN_A"], "compare: give at least two evaluation folders"),
    (["RUN_A", "NOPE"], "no results.json; pass the --out folder of `eval.run offline` or `eval.run opencompass`"),
    (["RUN_A", "RUN_A", "--labels", "x"], "--labels: 1 labels for 2 runs"),
])
def test_compare_bad_input_is_one_line(tmp_path, capsys, argv, expected):
    run = _results(tmp_path / "a", [("x", "score", "gen", 1.0)])
    (tmp_path / "empty").mkdir()  # (a path that does not exist is refused by the parser: tests/test_cli_walk.py)
    argv = [str(run) if a == "RUN_A" else str(tmp_path / "empty") if a == "NOPE" else a for a in argv]
    assert exit_code(main, ["compare", *argv, "--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and expected in err and "\n" not in err


def test_help_documents_every_option(capsys):
    """--help of the CLI and of every subcommand explains every option."""
    import argparse

    from eval.run import build_parser

    parser = build_parser()
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for argv, sub in (([], parser), *(([name], p) for name, p in subparsers.choices.items())):
        with pytest.raises(SystemExit) as info:
            main([*argv, "--help"])
        assert info.value.code == 0
        text = capsys.readouterr().out
        for action in sub._actions:
            if isinstance(action, argparse._SubParsersAction):
                continue
            assert action.help and action.help.strip(), action.option_strings
            assert all(opt in text for opt in action.option_strings), action.option_strings
    assert set(subparsers.choices) == {"offline", "opencompass", "compare"}


def test_failures_are_found_in_output_results_and_missing_files(tmp_path):
    """Besides a task exiting non-zero (the e2e test's case): an evaluator that returned an error, a generated
    dataset with no result, OpenCompass itself failing, and no summary; each names a log to read."""
    out = tmp_path / "oc"
    run = out / "work" / "20261125_120000"
    (run / "results" / "export").mkdir(parents=True)
    (run / "results" / "export" / "hbp_needle.json").write_text(json.dumps({"score": 50.0}))
    (run / "results" / "export" / "hbp_demo_qa.json").write_text(json.dumps({"error": "predictions and references "
                                                                                      "have different length"}))
    (run / "logs" / "eval" / "export").mkdir(parents=True)
    (run / "logs" / "eval" / "export" / "hbp_needle.out").write_text("")
    lines = ["11/25 12:00:00 - OpenCompass - INFO - Current exp folder: work/20261125_120000",
             "11/25 12:00:09 - OpenCompass - ERROR - .../local.py - _launch - 241 - task "
             "OpenICLInfer[export/hbp_multikey] fail, see", "work/20261125_120000/logs/infer/export/hbp_multikey.out"]
    options = oc.RunOptions(model_dir=tmp_path / "export", out=out, suite=["needle", "multikey", "demo_qa",
                                                                           "variable_tracking"])
    result = oc.RunResult(config=out / "opencompass_config.py", command=[], returncode=0,
                          run_dir=oc.run_dir(out, lines))
    assert result.run_dir == run
    found = [f.describe() for f in oc.failures(out, result, lines, options)]
    assert found == [
        f"OpenCompass task OpenICLInfer[export/hbp_multikey] exited with an error; see "
        f"{run / 'logs' / 'infer' / 'export' / 'hbp_multikey.out'}",
        f"OpenCompass task OpenICLEval[export/hbp_demo_qa] reported an error (predictions and references have "
        f"different length); see {run / 'logs' / 'eval' / 'export' / 'hbp_needle.out'}",
        f"OpenCompass task OpenICLEval[export/hbp_variable_tracking] wrote no result; see "
        f"{run / 'logs' / 'eval' / 'export' / 'hbp_needle.out'}",
        f"OpenCompass's summarizer wrote no summary under {run / 'summary'}; see {out / 'opencompass.log'}",
    ]
    result.returncode = 1
    assert oc.failures(out, result, [], options)[0].describe() == \
        f"OpenCompass's run exited with code 1; see {out / 'opencompass.log'}"
