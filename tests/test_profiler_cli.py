"""Tests for hbp_train/profiler/cli.py: `python -m hbp_train.profiler` dry runs (no GPU) whose profile.json
data_tools.pack reads, one-line errors with exit code 2, and the SP degrees the model's heads allow."""

from __future__ import annotations

import json

import pytest

from hbp_train.common.errors import UserError
from hbp_train.perf.memory import JobSettings, analytic_memory_bytes
from hbp_train.perf.shape import parse_model_shape
from hbp_train.profiler import cli
from hbp_train.profiler.cli import tokenizer_vocab, usable_sp_degrees
from hbp_train.profiler.search import Profiler
from tests.profiler_curves import backend, cfg


def run_cli(argv, capsys):
    rc = cli.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_dry_run_writes_a_profile_pack_reads(tmp_path, capsys):
    from data_tools.packing.groups import parse_groups

    path = tmp_path / "profile.json"
    rc, out, _ = run_cli(["model=tiny_llama", "profile.dry_run=true", f"profile.output={path}",
                          "profile.max_len=65536", "profile.world_size=4", "profile.progress=false",
                          "profile.device_memory_gb=0.25", "deepspeed.reduce_bucket_size=4096"], capsys)
    assert rc == 0
    data = json.loads(path.read_text())
    assert data["source"] == "analytic" and all(m["source"] == "analytic" for m in data["measurements"])
    assert "ANALYTIC" in out and "chosen groups" in out
    assert data["model"]["num_layers"] == 2 and data["job"]["zero_stage"] == data["zero_stage"] in (1, 2, 3)
    # "0.25" is a quarter of a GiB, as "80" is an 80GB card's 80 GiB (not 80e9 bytes); DeepSpeed's default gradient
    # buckets (2 x 2e8 bf16 elements) alone would not fit it, hence the small reduce_bucket_size
    assert data["hardware"]["device_memory_bytes"] == 2**28
    for key in ("hardware", "config", "profiler", "strategies", "warnings"):
        assert key in data
    specs = parse_groups("auto", str(path), 4)
    assert [(g.pack_len, g.sp, g.ckpt_layers) for g in specs] == \
        [(g["pack_len"], g["sp"], g["ckpt_layers"]) for g in data["groups"]]
    # A quarter GiB device: 64K packs need SP, so the round trip carries an sp > 1 group.
    assert any(g.sp > 1 for g in specs)


def test_cli_without_gpu_is_one_line_and_exit_2(monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc, _, err = run_cli(["model=tiny_llama", "profile.progress=false"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "profile.dry_run=true" in err


def test_cli_bad_value_is_one_line_and_exit_2(capsys):
    rc, _, err = run_cli(["profile.headroom=2", "profile.dry_run=true"], capsys)
    assert rc == 2 and "profile.headroom" in err and len(err.strip().splitlines()) == 1
    rc, out, _ = run_cli(["--help"], capsys)
    assert rc == 0 and "dry_run" in out and "time_budget_s" in out


def test_sp_degrees_limited_to_what_ulysses_can_split():
    shape = parse_model_shape({"hidden": 64, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "ffn": 176,
                                    "vocab": 512})
    assert usable_sp_degrees([1, 2, 4, 8], shape) == [1, 2, 4]
    p = Profiler(backend(), cfg(), sp_degrees=[1, 2, 4])
    p.find_best_sp_ckpt(131072)
    assert {m.sp for m in p.measurements} <= {1, 2, 4}


LLAMA8B_CONFIG = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 4096,
                  "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
                  "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 131072,
                  "rope_theta": 500000.0, "tie_word_embeddings": False}


def test_cli_dry_run_8b_from_a_config_json_alone(tmp_path, capsys):
    """The 128K experiment preset on a machine without the weights: a folder with only config.json (no tokenizer:
    the config's vocabulary is used), no data.shards (the profiler reads no data). The l_max group's checkpoint
    count is the fewest layers that fit the analytic memory model."""
    from data_tools.packing.groups import parse_groups

    model_dir = tmp_path / "llama8b"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(LLAMA8B_CONFIG))
    path = tmp_path / "p8.json"
    rc, out, err = run_cli(["experiment=llama3_8b_128k", f"model.name_or_path={model_dir}", "profile.dry_run=true",
                            "profile.progress=false", f"profile.output={path}", "profile.zero_stages=[]",
                            "profile.levers=false"], capsys)
    assert rc == 0, err
    data = json.loads(path.read_text())
    assert data["model"]["vocab"] == 128256 and data["model"]["num_layers"] == 32
    assert data["job"]["zero_stage"] == 3 and data["job"]["loss_chunk_tokens"] == 8192
    top = data["groups"][-1]
    assert top["pack_len"] == 131072 and top["role"].endswith("l_max")
    shape = parse_model_shape(data["model"])
    job = JobSettings(3, False, 8192)
    fits = [c for c in range(33)
            if analytic_memory_bytes(shape, 131072, top["sp"], c, 8, job) <= data["memory_budget_bytes"]]
    assert top["ckpt_layers"] == min(fits) and 0 < top["ckpt_layers"] < 32
    # One document per pack makes the shortest candidate the best: said in the output.
    assert data["l_best"] == 8192 and any("profile.docs" in w for w in data["warnings"])
    # An 8-GPU node (gpus_per_node=8) measures every degree up to 8 on that many GPUs, at the configuration's time.
    want = sum(4 * m["time_s"] for m in data["measurements"] if m["time_s"])
    assert data["profiler"]["predicted_gpu_measure_s"] == pytest.approx(want, abs=0.1)
    # A node lending one GPU runs every sp > 1 as its 1/sp slice on it.
    rc, _, err = run_cli(["experiment=llama3_8b_128k", f"model.name_or_path={model_dir}", "profile.dry_run=true",
                          "profile.progress=false", f"profile.output={path}", "profile.measure_devices=1",
                          "profile.zero_stages=[]", "profile.levers=false"], capsys)
    assert rc == 0, err
    data = json.loads(path.read_text())
    want = sum(4 * m["time_s"] / m["sp"] for m in data["measurements"] if m["time_s"])
    assert data["profiler"]["predicted_gpu_measure_s"] == pytest.approx(want, abs=0.1)
    assert [(g.pack_len, g.sp, g.ckpt_layers) for g in parse_groups("auto", str(path), 8)] == \
        [(g["pack_len"], g["sp"], g["ckpt_layers"]) for g in data["groups"]]


def test_cli_missing_model_dir_and_unwritable_output_are_one_line(tmp_path, capsys):
    rc, _, err = run_cli(["model=llama3_8b", "model.name_or_path=/nonexistent/model", "profile.dry_run=true"],
                         capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "config.json" in err
    blocker = tmp_path / "file"
    blocker.write_text("")
    rc, _, err = run_cli(["profile.dry_run=true", f"profile.output={blocker}/p.json"], capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1 and "profile.output" in err
    rc, _, err = run_cli(["profile.dry_run=true", "profile.progress=false", f"profile.output={tmp_path}"], capsys)
    # check_output_file's message (write_output's would say "cannot write"): found before the profiling, not after
    assert rc == 2 and err.strip() == f"profile: profile.output {tmp_path}: is a directory; pass a file path"


def test_cli_nothing_fits_is_one_line_and_exit_2(tmp_path, capsys):
    """ProfileError is the user's (settings that ask for more than the hardware gives): one line, exit 2, no file."""
    out = tmp_path / "p.json"
    rc, _, err = run_cli(["model=tiny_llama", "profile.dry_run=true", "profile.progress=false",
                          "profile.device_memory_gb=0.001", "profile.max_len=16384", f"profile.output={out}"], capsys)
    assert rc == 2 and err.strip().splitlines()[-1].startswith("profile: no candidate pack length fits")
    assert not out.exists()


def test_gpu_run_needs_a_tokenizer(tmp_path):
    with pytest.raises(UserError, match="model.tokenizer"):
        tokenizer_vocab(str(tmp_path), dry_run=False)
    assert tokenizer_vocab(str(tmp_path), dry_run=True) is None


def _user_model(folder, tokenizer_dir):
    """A Qwen2-shaped model saved by its user, tokenizer beside it: another shape than the default preset's."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.for_model("qwen2", hidden_size=96, intermediate_size=192, num_hidden_layers=3,
                                  num_attention_heads=6, num_key_value_heads=2, vocab_size=4096)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)


def test_dry_run_profiles_the_model_the_config_names(tmp_path, tokenizer_dir, capsys):
    """model.name_or_path alone: the dry run profiles that model (it profiled the default preset's tiny Llama)."""
    _user_model(tmp_path / "mine", tokenizer_dir)
    path = tmp_path / "p.json"
    rc, _, err = run_cli([f"model.name_or_path={tmp_path / 'mine'}", "profile.dry_run=true", "profile.progress=false",
                          "profile.max_len=2048", "profile.min_len=512", "profile.world_size=2",
                          f"profile.output={path}"], capsys)
    assert rc == 0, err
    model = json.loads(path.read_text())["model"]
    assert (model["name"], model["hidden"], model["num_layers"], model["num_heads"], model["ffn"]) == \
        ("mine", 96, 3, 6, 192)


@pytest.mark.slow
def test_cpu_profile_measures_the_model_the_config_names(tmp_path, tokenizer_dir, capsys):
    """profile.device=cpu builds and measures the named model on this CPU (it stopped with a traceback: the default
    preset's shape laid over the checkpoint)."""
    _user_model(tmp_path / "mine", tokenizer_dir)
    path = tmp_path / "p.json"
    rc, _, err = run_cli([f"model.name_or_path={tmp_path / 'mine'}", "profile.device=cpu", "profile.progress=false",
                          "profile.max_len=512", "profile.min_len=256", "profile.world_size=1", "profile.iters=1",
                          "profile.warmup_iters=0", f"profile.output={path}"], capsys)
    assert rc == 0, err
    from transformers import AutoModelForCausalLM

    data = json.loads(path.read_text())
    saved = AutoModelForCausalLM.from_pretrained(tmp_path / "mine")
    assert data["model"]["hidden"] == 96 and data["model"]["num_params"] == sum(p.numel() for p in saved.parameters())
    assert {m["source"] for m in data["measurements"]} == {"cpu"} and data["groups"]  # measured on this CPU
