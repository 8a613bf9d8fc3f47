"""Our side of bench/trl/bench_trl.py, and what both sides share: the data, the initial model, the held-out loss.

Ours as users run it on one process: ``data_tools.pack`` (hbp, one packing group of the bench's pack length, world
size 1, the step budget that gives TRL's step count), then the trainer through ``python -m hbp_train.launch``
(DeepSpeed ZeRO-2 at world size 1, fp32, torch AdamW, our CPU attention ``sdpa_block``, the chunked LM-head loss,
the token-mean loss of the step), then ``python -m hbp_train.export`` for the held-out loss. The documents it trains
on are read back from its packed shards (what the trainer's loader reads) in the form TRL's side records them
(bench/trl/trl_side.py ``documents``).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.speed import chain  # noqa: E402
from bench.trl.trl_side import doc_hash  # noqa: E402
from hbp_train.common.labels import IGNORE_INDEX  # noqa: E402


def env(threads: int) -> dict:
    """chain.env with this bench's threads: one process a side, every core of the machine."""
    return {**chain.env(), "OMP_NUM_THREADS": str(threads)}


def call(cmd: list, log: Path, threads: int) -> str:
    res = subprocess.run([str(c) for c in cmd], cwd=REPO, env=env(threads), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text(res.stdout)
    if res.returncode != 0:
        sys.exit(f"bench_trl: {' '.join(map(str, cmd[:6]))} ... failed ({res.returncode}), log {log}:\n"
                 f"{res.stdout[-3000:]}")
    return res.stdout


def make_model(out: Path, shape: chain.Shape, tokenizer_dir: Path, max_len: int) -> Path:
    """The initial weights both sides load: a Llama of ``shape`` with the data's tokenizer, seed 0, saved once."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=shape.hidden, intermediate_size=shape.ffn,
                         num_hidden_layers=shape.layers, num_attention_heads=shape.heads,
                         num_key_value_heads=shape.kv_heads, max_position_embeddings=max(max_len, 2048),
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    staging = out.with_name(out.name + ".staging")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(str(staging))
    tokenizer.save_pretrained(str(staging))
    staging.rename(out)
    return out


def step_budget(total_tokens: int, steps: int) -> int:
    """``--global-tokens`` that makes the planner cut ``steps`` optimizer steps (N = round(T / G))."""
    return max(1, round(total_tokens / steps))


def plan(dataset: Path, shards: Path, max_len: int, seed: int, global_tokens: int):
    from data_tools import pack
    from hbp_train.planning.plan_npz import load_plan

    shutil.rmtree(shards, ignore_errors=True)
    chain._quiet(pack.main, ["--dataset", str(dataset), "--shards", str(shards), "--world-size", "1", "--groups",
                             f"{max_len}:1", "--strategy", "hbp", "--seed", str(seed), "--global-tokens",
                             str(global_tokens), "--no-baseline", "--quiet"])
    return load_plan(shards / "plan.json")


def documents(shards: Path) -> list:
    """(hash, tokens, targets) of every document in our packed shards (bench/trl/trl_side.py ``documents``)."""
    import datasets

    out = []
    for group in sorted(shards.glob("group_*")):
        for row in datasets.load_from_disk(str(group)):
            ids, labels, cu = row["input_ids"], row["labels"], row["cu_seqlens"]
            for a, b in zip(cu, cu[1:]):
                doc_labels = labels[a:b]
                mask = [int(lab != IGNORE_INDEX) for lab in doc_labels[1:]]
                assert all(lab in (IGNORE_INDEX, tok) for lab, tok in zip(doc_labels, ids[a:b]))
                out.append((doc_hash(list(ids[a:b]), mask), b - a, sum(mask)))
    return out


def train(shards: Path, model_dir: Path, run_dir: Path, spec: dict, threads: int) -> list:
    """Our trainer on one process over the plan's every step; its metrics.jsonl rows."""
    shutil.rmtree(run_dir, ignore_errors=True)
    call([sys.executable, "-m", "hbp_train.launch", "--standalone", "--nproc_per_node", 1, "-m", "hbp_train.train",
          "experiment=cpu_demo", f"model.name_or_path={model_dir}", "model.dtype=fp32",
          "model.attention_backend=sdpa_block", "loss=token_mean", f"train.lr={spec['lr']}",
          f"train.warmup_steps={spec['warmup_steps']}", f"train.min_lr_ratio={spec['cos_min_ratio']}",
          f"train.betas=[{spec['betas'][0]},{spec['betas'][1]}]", f"train.eps={spec['eps']}", "train.weight_decay=0",
          f"train.grad_clip={spec['grad_clip']}", f"train.seed={spec['seed']}", f"data.shards={shards}",
          "data.epochs=1", f"train.out_dir={run_dir}", "train.save_final=true", "logging.progress_bar=false",
          "logging.tensorboard=false", "logging.log_every=1000000"], run_dir.parent / f"{run_dir.name}.log", threads)
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def export(run_dir: Path, out: Path, threads: int) -> Path:
    shutil.rmtree(out, ignore_errors=True)
    call([sys.executable, "-m", "hbp_train.export", "--checkpoint", run_dir, "--out", out],
         run_dir.parent / f"{run_dir.name}.export.log", threads)
    return out


def heldout_loss(model_dir: Path, heldout: Path, max_samples: int, threads: int) -> float:
    """eval/perplexity.py's token-mean loss of the first ``max_samples`` held-out samples, each alone: the same
    function on both sides' trained weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from eval.perplexity import run_perplexity

    torch.set_num_threads(threads)
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    return float(run_perplexity(model, heldout, max_samples=max_samples, progress=False)["loss"])


def timed(step_end: list, step_tokens: list, warmup: int) -> tuple[float, float]:
    """(real tokens, seconds) of the timed steps: from the end of the last warm-up step to the end of the last."""
    return float(np.sum(step_tokens[warmup:])), float(step_end[-1] - step_end[warmup - 1])
