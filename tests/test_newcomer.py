"""A newcomer's path, end to end, with the real commands: their own small HF model of a family other than the
default preset's (saved with save_pretrained, the shipped tokenizer beside it) goes preprocess -> pack -> train ->
export -> generate() given only model.name_or_path, data.shards and train.out_dir, the way README.md says.

What it proves: the default model preset's shape does not touch a model given by path (it used to be laid over it:
a load report and a traceback per rank); pack sizes the steps from the data when --global-tokens is not given; the
run starts with one summary of what it trains and no DeepSpeed scheduler warning; metrics.jsonl counts steps from
1; the export loads and generates. The default tier runs a Qwen2 model through the library in one spawned rank;
the full tier runs every command as its own process for a Qwen2, a Mistral and a Gemma 3 model (tied embeddings,
sliding-window layers), about a minute each.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = REPO / "data_tools" / "assets" / "tokenizer"

# The user's own small model: another shape than the tiny_llama preset (hidden 64, 2 layers, 4096 positions).
SHAPE = dict(hidden_size=96, intermediate_size=160, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
             max_position_embeddings=1024, vocab_size=4096)
FAMILY_FIELDS = {
    "qwen2": {},
    "mistral": {"head_dim": 16, "sliding_window": None},
    # sliding-window and full layers, tied embeddings; a window no shorter than the longest sample (compat.py)
    "gemma3_text": {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 512,
                    "layer_types": ["sliding_attention", "sliding_attention", "full_attention"]},
}


def save_user_model(family: str, folder: Path) -> dict:
    """A model of ``family`` as a user saves one: config.json + safetensors + the tokenizer; returns its config."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.for_model(family, **SHAPE, **FAMILY_FIELDS[family])
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(TOKENIZER_DIR).save_pretrained(folder)
    return json.loads((folder / "config.json").read_text())


def assert_trained(exported, model_dir: Path) -> None:
    """The export holds the user's weights trained: same names and shapes, values moved."""
    from transformers import AutoModelForCausalLM

    start = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    end = exported.state_dict()
    assert {k: v.shape for k, v in start.items()} == {k: v.shape for k, v in end.items()}
    assert any(not start[k].equal(end[k]) for k in start)


def _run(args: list, cwd: Path) -> str:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    proc = subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"{' '.join(args[:3])} exited {proc.returncode}:\n{out[-4000:]}"
    assert "Traceback" not in out, out[-4000:]
    return out


def newcomer_path(family: str, tmp_path: Path) -> None:
    model_dir = tmp_path / f"my-{family}"
    config = save_user_model(family, model_dir)
    _run(["-m", "data_tools.make_demo_data", "--out", "chats.jsonl", "--num-samples", "100", "--max-tokens", "400",
          "--seed", "3"], tmp_path)
    _run(["-m", "data_tools.preprocess", "--input", "chats.jsonl", "--output", "tok", "--tokenizer", str(model_dir),
          "--max-len", "512"], tmp_path)
    # No --global-tokens: the step size comes from the data (one step of every token would train nothing).
    packed = _run(["-m", "data_tools.pack", "--dataset", "tok", "--shards", "packed", "--max-len", "512",
                   "--world-size", "1", "--groups", "512:1", "--quiet"], tmp_path)
    assert "--global-tokens not given" in packed
    plan = json.loads((tmp_path / "packed" / "plan.json").read_text())
    assert plan["metrics"]["num_steps"] >= 10 and plan["tokenizer"]["path"] == str(model_dir)

    # What ./launch.sh train starts (after its config check, tests/test_config.py), given three settings only.
    given = [f"model.name_or_path={model_dir}", "data.shards=packed", "train.out_dir=run"]
    log = _run(["-m", "hbp_train.launch", "--standalone", "--nproc_per_node", "1", "-m", "hbp_train.train", *given],
               tmp_path)
    assert "Attempting to get learning rate" not in log  # DeepSpeed's scheduler warning, fixed at its cause
    summary = [line for line in log.splitlines() if line.startswith("[train] model:")]
    assert len(summary) == 1 and f"{config['model_type']} {model_dir}" in summary[0], log[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, plan["metrics"]["num_steps"] + 1))
    assert {r["epoch"] for r in rows} == {1} and [r["plan/step"] for r in rows] == [r["step"] - 1 for r in rows]

    _run(["-m", "hbp_train.export", "--checkpoint", "run/checkpoints", "--out", "export"], tmp_path)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    exported = json.loads((tmp_path / "export" / "config.json").read_text())
    assert {k: exported[k] for k in SHAPE} == {k: config[k] for k in SHAPE}  # the user's model, its own shape
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert_trained(model, model_dir)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "export")
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model.generate(**prompt, max_new_tokens=8, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]


def _train_by_path(rank, world_size, model_dir: str, out: str):
    """One rank: the run config of three settings, trained, its summary, DeepSpeed's log, the export."""
    import logging

    from hbp_train import config, trainer
    from hbp_train.distributed.groups import init_distributed
    from hbp_train.export import export
    from hbp_train.observe.run_summary import start_summary

    init_distributed()
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logging.getLogger("DeepSpeed").addHandler(handler)
    summary = trainer.train(config.load([f"model.name_or_path={model_dir}", f"data.shards={out}/packed",
                                         f"train.out_dir={out}/run"]))
    export(f"{out}/run/checkpoints", f"{out}/export")
    return {"summary": start_summary(summary["run"]), "deepspeed_log": seen, "ended": summary["ended"],
            "hf_overrides": summary["run"].cfg.model.hf_overrides()}


@pytest.mark.slow
def test_a_qwen2_model_of_ones_own_trains_by_path_alone(tmp_path):
    """The same path in one spawned rank (the full tier runs every command as a process: the next test)."""
    import torch
    from transformers import AutoModelForCausalLM

    from data_tools import make_demo_data, pack, preprocess
    from tests.distributed import run_distributed

    model_dir = tmp_path / "my-qwen2"
    config = save_user_model("qwen2", model_dir)
    with open(tmp_path / "chats.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in make_demo_data.generate(60, max_tokens=300, seed=3))
    assert preprocess.main(["--input", str(tmp_path / "chats.jsonl"), "--output", str(tmp_path / "tok"),
                            "--tokenizer", str(model_dir), "--max-len", "512"]) == 0
    assert pack.main(["--dataset", str(tmp_path / "tok"), "--shards", str(tmp_path / "packed"), "--max-len", "512",
                      "--world-size", "1", "--groups", "512:1", "--quiet"]) == 0
    steps = json.loads((tmp_path / "packed" / "plan.json").read_text())["metrics"]["num_steps"]
    assert steps >= 10  # from the data: without --global-tokens the default 4M tokens made one step

    result = run_distributed(_train_by_path, 1, str(model_dir), str(tmp_path))[0]
    assert result["ended"] == "finished" and result["hf_overrides"] == {}  # the preset's shape is not applied
    assert not any("before it has started" in line for line in result["deepspeed_log"]), result["deepspeed_log"]
    assert result["summary"].startswith(f"[train] model: qwen2 {model_dir} | ")
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, steps + 1)) and {r["epoch"] for r in rows} == {1}
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "export").eval()
    assert {k: exported.config.to_dict()[k] for k in SHAPE} == {k: config[k] for k in SHAPE}
    assert_trained(exported, model_dir)
    with torch.no_grad():
        out = exported.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 7)


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen2", "mistral", "gemma3_text"])
def test_a_model_of_ones_own_goes_through_every_command_by_path_alone(family, tmp_path):
    newcomer_path(family, tmp_path)
