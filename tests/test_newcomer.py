"""A newcomer's path, end to end, with the real commands: their own small HF model of a family other than the
default preset's (saved with save_pretrained, the shipped tokenizer beside it) goes preprocess -> pack -> train ->
export -> generate() given only model.name_or_path, data.shards and train.out_dir, the way README.md says.

What it proves: the default model preset's shape does not touch a model given by path (it used to be laid over it:
a load report and a traceback per rank); pack sizes the steps from the data when --global-tokens is not given; the
run starts with one summary of what it trains and no DeepSpeed scheduler warning; metrics.jsonl counts steps from
1; the export loads and generates. The default tier runs a Qwen2 model through the library in one spawned rank;
the full tier runs every command as its own process for a Qwen2, a Mistral and a Gemma 3 model (tied embeddings,
sliding-window layers), about a minute each. The full tier also runs issue 37's newcomer: their own byte-level BPE
tokenizer and ChatML template, a Qwen3 of an odd shape and a small Qwen3-MoE, data in four formats with broken
lines, a held-out split and a weight, through every command on 2 ranks, and checks that no command prints another
library's warning, bar or traceback and that the trainer's held-out loss is hbp-eval's.
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

    from data_tools import pack, preprocess
    from data_tools.demo_data import synthetic_chats
    from tests.distributed import run_distributed

    model_dir = tmp_path / "my-qwen2"
    config = save_user_model("qwen2", model_dir)
    with open(tmp_path / "chats.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in synthetic_chats.generate(60, max_tokens=300, seed=3))
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


# --- The newcomer of issue 37: their own tokenizer, their own model, their data in four files ---------------------

# What a log must not show after our commands: another library's warnings and bars, tracebacks (ours start
# "warning:" or name the tool, and are checked where they are raised).
FOREIGN_NOISE = ("\r", "%|", "Traceback", "Warning", "WARNING", "deprecated", "death signal", "indexing errors",
                 "unable to detect")
# A ChatML template as a user writes one: no {% generation %} markers, tools in the system turn, calls as JSON.
CHATML_WITH_TOOLS = (
    "{%- if tools %}<|im_start|>system\n{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
    "Tools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'system' %}"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>{{ m.content }}</tool_response><|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}{%- if m.tool_calls %}{% for c in m.tool_calls %}"
    "<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}{% endif %}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
# Shapes no preset has: a head_dim that is not hidden / heads, an odd FFN; Qwen3's q/k norms; and a small MoE.
OWN_MODELS = {
    "qwen3": dict(hidden_size=88, intermediate_size=136, num_hidden_layers=3, num_attention_heads=6,
                  num_key_value_heads=2, head_dim=20),
    "qwen3_moe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=48, num_experts=4,
                      num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=24),
}


def save_own_tokenizer_and_model(family: str, folder: Path, texts: list) -> None:
    """A byte-level BPE of 1,500 tokens trained on the user's text (digits merged, unlike ours), Qwen's specials
    (no bos, eos <|im_end|>, pad <|endoftext|>), the ChatML template above; and a ``family`` model sized to it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=1500, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                        additional_special_tokens=["<|im_start|>"])
    tokenizer.chat_template = CHATML_WITH_TOOLS
    tokenizer.save_pretrained(folder)
    config = AutoConfig.for_model(family, **OWN_MODELS[family], max_position_embeddings=2048,
                                  vocab_size=len(tokenizer), tie_word_embeddings=False, bos_token_id=None,
                                  eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)


def write_four_formats(records: list, folder: Path) -> None:
    """The same kind of chats as four files: ShareGPT with tool calls (.jsonl.gz), TRL prompt/completion (.parquet),
    plain text (.csv), OpenAI messages with every 20th line cut in half (.jsonl)."""
    import gzip

    import pyarrow as pa
    import pyarrow.parquet as pq

    folder.mkdir()
    quarter = len(records) // 4
    tools = json.dumps([{"type": "function", "function": {"name": "lookup", "parameters": {
        "type": "object", "properties": {"q": {"type": "string"}}}}}])
    with gzip.open(folder / "a_tools.jsonl.gz", "wt") as f:
        for i, r in enumerate(records[:quarter]):
            turns = [{"from": "human" if m["role"] == "user" else "gpt", "value": m["content"]}
                     for m in r["messages"] if m["role"] != "system"]
            row = {"conversations": turns}
            if i % 3 == 0:
                call = {"name": "lookup", "arguments": {"q": turns[0]["value"][:20]}}
                row = {"conversations": [turns[0], {"from": "function_call", "value": json.dumps(call)},
                                         {"from": "observation", "value": "found"}, *turns[1:]], "tools": tools}
            f.write(json.dumps(row) + "\n")
    pairs = [[m for m in r["messages"] if m["role"] != "system"] for r in records[quarter:2 * quarter]]
    pq.write_table(pa.Table.from_pylist([{"prompt": t[:-1], "completion": t[-1:]} for t in pairs]),
                   folder / "b_trl.parquet")
    import csv

    with open(folder / "c_text.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["text"])
        writer.writerows([["\n".join(m["content"] for m in r["messages"])] for r in records[2 * quarter:3 * quarter]])
    with open(folder / "d_messages.jsonl", "w") as f:
        for i, r in enumerate(records[3 * quarter:]):
            line = json.dumps(r)
            f.write((line[:len(line) // 2] if i % 20 == 7 else line) + "\n")


def assert_no_foreign_noise(command: str, out: str) -> None:
    noisy = [line for line in out.splitlines(keepends=True) if any(mark in line for mark in FOREIGN_NOISE)]
    assert not noisy, f"{command}: lines not ours: {noisy[:5]}"


@pytest.mark.full
@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(OWN_MODELS))
def test_own_tokenizer_own_model_four_formats_run_quietly_and_report_one_loss(family, tmp_path):
    """Issue 37's newcomer flow in one run, every command a process as the README gives it, on 2 ranks with an SP
    switch: every sample is trained, held out or listed as dropped; the plan records the model and the simulator
    costs it; the trainer's held-out loss equals hbp-eval's on the export; the export carries the user's own
    tokenizer; no command prints another library's warning, bar or traceback."""
    from data_tools.demo_data import synthetic_chats

    records = synthetic_chats.generate(240, max_tokens=300, seed=5)
    model_dir = tmp_path / f"my-{family}"
    save_own_tokenizer_and_model(family, model_dir, [m["content"] for r in records for m in r["messages"]])
    write_four_formats(records, tmp_path / "data")
    outputs = {}

    def run(name, *args):
        outputs[name] = _run(list(args), tmp_path)
        assert_no_foreign_noise(name, outputs[name])
        return outputs[name]

    run("preprocess", "-m", "data_tools.preprocess", "--input", "data/a_tools.jsonl.gz", "data/b_trl.parquet:2",
        "data/c_text.csv", "data/d_messages.jsonl", "--output", "tok", "--tokenizer", str(model_dir),
        "--max-len", "512", "--on-error", "skip", "--heldout-count", "12")
    report = json.loads((tmp_path / "tok" / "report.json").read_text())
    assert report["formats"] == {"sharegpt": 60, "prompt_completion": 60, "text": 60, "messages": 57}
    dropped = [json.loads(line) for line in (tmp_path / "tok" / "dropped.jsonl").read_text().splitlines()]
    assert report["dropped"]["malformed_json"] == 3 and len(dropped) == sum(report["dropped"].values())
    assert report["kept"] == report["read"] - len(dropped) and report["heldout"]["samples"] == 12
    weighted = {p["weight"]: p for p in report["per_input"]}[2.0]
    assert weighted["after_weight"] == 2 * weighted["before_weight"]  # b_trl.parquet:2, whole repeats

    for name in ("tok", "tok_heldout"):
        run(f"pack {name}", "-m", "data_tools.pack", "--dataset", name, "--shards", f"packed_{name}", "--max-len",
            "512", "--world-size", "2", "--groups", "256:1,512:2", "--model", str(model_dir), "--quiet")
    plan = json.loads((tmp_path / "packed_tok" / "plan.json").read_text())
    recorded = plan["model"]
    assert recorded["model_type"] == family and recorded["shape"]["head_dim"] == OWN_MODELS[family]["head_dim"]
    assert plan["num_samples"] == report["rows"] and not plan["dropped"] and not plan["deferred"]  # all packed
    assert "recorded in the plan" in run("simulate", "-m", "data_tools.simulate", "--plan", "packed_tok/plan.json")

    given = [f"model.name_or_path={model_dir}", "data.shards=packed_tok", "train.out_dir=run",
             "data.eval_shards=packed_tok_heldout", "train.eval_every=5"]
    run("config check", "-m", "hbp_train.config", *given)
    log = run("train", "-m", "hbp_train.launch", "--standalone", "--nproc_per_node", "2", "-m", "hbp_train.train",
              *given)
    assert "[launch] finished: " in log and "sp=2" in log  # both groups trained, the SP=2 one on both ranks
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == plan["metrics"]["num_steps"]

    run("export", "-m", "hbp_train.export", "--checkpoint", "run/checkpoints", "--out", "export")
    assert (tmp_path / "export" / "tokenizer.json").read_bytes() == (model_dir / "tokenizer.json").read_bytes()
    assert (tmp_path / "export" / "chat_template.jinja").read_text() == CHATML_WITH_TOOLS
    run("eval", "-m", "eval.run", "offline", "--model", "export", "--out", "evalout", "--dataset", "tok_heldout",
        "--lengths", "256", "--trials", "2")
    scores = {(s["dataset"], s["metric"]): s["score"]
              for s in json.loads((tmp_path / "evalout" / "results.json").read_text())["scores"]}
    assert scores[("held-out", "loss")] == pytest.approx(rows[-1]["loss/eval"], abs=1e-4)
    assert ("needle (offline)", "loglik_acc, untrained baseline") in scores
