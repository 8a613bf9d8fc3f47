"""Granite and Cohere train their own objective: the trainer's held-out loss equals `hbp-eval offline` on the export.

Both families change the logits after the LM head (Granite divides them by ``logits_scaling``, Cohere multiplies them
by ``logit_scale``); the trainer's loss reads the LM head's weight itself (hbp_train/model/loss.py), so it must apply
the same change or it trains, and reports, another model's loss. Here a tiny model of each family, saved as a user
saves one, goes through the real commands: preprocess -> pack -> the trainer (held-out loss after its last step, on the
same samples) -> export -> ``eval.run offline --no-needle`` on the preprocessed samples, and the export's own HF
``forward(labels=...)`` per sample. The three losses agree to fp32 rounding.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hbp_train.model.families import tiny_config

REPO = Path(__file__).resolve().parent.parent
TOKENIZER_DIR = REPO / "data_tools" / "assets" / "tokenizer"
FAMILIES = ("granite", "cohere", "gemma3_text", "gemma2", "mistral")
STEPS = 2
# Sliding windows of 128-256 tokens (Gemma 3's sliding layers, Gemma 2's beside its attention soft-capping, Mistral's
# in every layer), which the ~1K-token samples of the data exceed.
CONFIG = {"gemma3_text": {"sliding_window": 256}, "gemma2": {"sliding_window": 128}, "mistral": {"sliding_window": 128}}
MAX_LEN = 1536  # with positions for it in every family



def save_model(family: str, folder: Path) -> None:
    """The tiny ``family`` model of the support matrix with the shipped tokenizer's vocabulary and special tokens,
    saved with save_pretrained beside the tokenizer."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    fields = tiny_config(family, vocab_size=len(tokenizer), max_position_embeddings=MAX_LEN, **CONFIG.get(family, {}))
    config = AutoConfig.for_model(family, **fields,
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _train_and_export(rank, world_size, root: str, families=FAMILIES):
    """One rank: each family's model trained (at most STEPS steps) with the held-out loss after the last step, then
    exported."""
    from hbp_train import config, trainer
    from hbp_train.distributed.groups import init_distributed
    from hbp_train.export import export

    init_distributed()
    for family in families:
        out = f"{root}/{family}"
        trainer.train(config.load([f"model.name_or_path={out}/model", f"data.shards={root}/packed",
                                   f"data.eval_shards={root}/packed", f"train.out_dir={out}/run", "logging=quiet",
                                   f"train.max_steps={STEPS}", "train.lr=1e-3", "train.warmup_steps=0"]))
        export(f"{out}/run/checkpoints", f"{out}/export")
    return True


def export_token_mean_loss(export_dir: Path, dataset_dir: Path, **config) -> tuple[float, int]:
    """The export's own loss: HF forward(labels=...) per sample, token-weighted over the samples' label tokens;
    ``config``: fields changed in the export's config (its weights kept)."""
    import torch
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(export_dir, **config).eval()
    total, tokens = 0.0, 0
    for row in load_from_disk(str(dataset_dir)):
        labels = torch.tensor(row["labels"])
        count = int((labels[1:] != -100).sum())
        with torch.no_grad():
            loss = model(input_ids=torch.tensor(row["input_ids"])[None], labels=labels[None]).loss
        total += float(loss) * count
        tokens += count
    return total / tokens, tokens


@pytest.mark.slow
def test_trainer_heldout_loss_is_the_exports_own_loss(tmp_path):
    from data_tools import pack, preprocess
    from data_tools.demo_data import synthetic_chats
    from eval.run import main as eval_main
    from tests.distributed import run_distributed

    records = synthetic_chats.generate(24, max_tokens=200, seed=5)
    records += synthetic_chats.generate(4, max_tokens=1400, seed=8, long_fraction=1.0)  # ~1K tokens: past the windows
    with open(tmp_path / "chats.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    for family in FAMILIES:
        save_model(family, tmp_path / family / "model")
    assert preprocess.main(["--input", str(tmp_path / "chats.jsonl"), "--output", str(tmp_path / "tok"),
                            "--tokenizer", str(TOKENIZER_DIR), "--max-len", str(MAX_LEN)]) == 0
    assert pack.main(["--dataset", str(tmp_path / "tok"), "--shards", str(tmp_path / "packed"), "--max-len",
                      str(MAX_LEN), "--world-size", "1", "--groups", f"256:1,{MAX_LEN}:1", "--global-tokens", "1536",
                      "--quiet"]) == 0
    assert run_distributed(_train_and_export, 1, str(tmp_path), timeout=600) == [True]

    differ = []  # both families named, with their numbers
    for family in FAMILIES:
        rows = [json.loads(line) for line in (tmp_path / family / "run" / "metrics.jsonl").read_text().splitlines()]
        trainer_loss, trainer_tokens = rows[-1]["loss/eval"], rows[-1]["eval/loss_tokens"]
        assert len(rows) == STEPS and all("loss/eval" not in r for r in rows[:-1])  # trained, then evaluated
        own_loss, own_tokens = export_token_mean_loss(tmp_path / family / "export", tmp_path / "tok")
        assert trainer_tokens == own_tokens  # the same samples' label tokens
        if family in CONFIG:  # the window binds: without it the export's own loss is another
            unwindowed, _ = export_token_mean_loss(tmp_path / family / "export", tmp_path / "tok", sliding_window=4096)
            assert abs(unwindowed - own_loss) > 1e-4 * own_loss, (family, unwindowed, own_loss)
        assert eval_main(["offline", "--model", str(tmp_path / family / "export"), "--dataset", str(tmp_path / "tok"),
                          "--no-needle", "--out", str(tmp_path / family / "eval"), "--no-progress"]) == 0
        evaluated = json.loads((tmp_path / family / "eval" / "results.json").read_text())["perplexity"]
        assert evaluated["num_loss_tokens"] == own_tokens
        line = (f"{family}: trainer held-out {trainer_loss:.6f}, hbp-eval offline {evaluated['loss']:.6f}, "
                f"export's HF loss {own_loss:.6f} over {own_tokens} tokens")
        print(line)
        if not (trainer_loss == pytest.approx(evaluated["loss"], rel=1e-5, abs=1e-5)
                and trainer_loss == pytest.approx(own_loss, rel=1e-5, abs=1e-5)):
            differ.append(line)
    assert not differ, "; ".join(differ)


# ------------------------------------------------------------------------------ RoPE that reads the sample length
# Phi-3's longrope takes its long factors past original_max_position_embeddings, chosen by HF from the length of the
# sequence in the forward: in a pack, from each sample's own length (hbp_train/model/rope.py).
LONGROPE = {"max_position_embeddings": 2048, "original_max_position_embeddings": 256,
            "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 8,
                                "long_factor": [1.0 + 2 * i for i in range(8)]}}  # 8 = the tiny model's head dim / 2


def save_longrope_model(folder: Path) -> None:
    """The tiny Phi-3 with longrope over 256 original positions (as save_model saves a model), its q and k
    projections sharpened (x8: at initialisation attention is nearly uniform, and RoPE would barely move the loss)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    config = AutoConfig.for_model("phi3", **tiny_config("phi3", vocab_size=len(tokenizer), **LONGROPE),
                                  bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)
    model = AutoModelForCausalLM.from_config(config)
    head_dim = config.hidden_size // config.num_attention_heads
    with torch.no_grad():
        for layer in model.model.layers:  # q and k: the first rows of Phi-3's fused projection
            layer.self_attn.qkv_proj.weight[: (config.num_attention_heads + config.num_key_value_heads) * head_dim] *= 8
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.mark.slow
@pytest.mark.full
def test_phi3_longrope_heldout_loss_is_the_exports_own_loss_with_long_and_short_samples(tmp_path):
    """Phi-3 longrope (256 original positions): samples up to ~1K tokens packed beside short ones, trained and
    evaluated on 2 ranks over a plan with an sp=1 group and an sp=2 group (the held-out loss runs every pack, so the
    sp=2 packs too: there a rank holds only part of a long sample). The trainer's held-out loss equals the export's
    own HF loss per sample and `hbp-eval offline`, to 2e-5: each sample got the factors its own length selects."""
    from data_tools import pack, preprocess
    from data_tools.demo_data import synthetic_chats
    from eval.run import main as eval_main
    from tests.distributed import run_distributed

    family = "phi3"
    with open(tmp_path / "chats.jsonl", "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in synthetic_chats.generate(16, max_tokens=1100, seed=5,
                                                                             long_fraction=0.3))
    save_longrope_model(tmp_path / family / "model")
    assert preprocess.main(["--input", str(tmp_path / "chats.jsonl"), "--output", str(tmp_path / "tok"),
                            "--tokenizer", str(TOKENIZER_DIR), "--max-len", "1100"]) == 0
    lengths = [int(n) for n in __import__("datasets").load_from_disk(str(tmp_path / "tok"))["length"]]
    assert max(lengths) > 600 and min(lengths) < LONGROPE["original_max_position_embeddings"], lengths
    assert pack.main(["--dataset", str(tmp_path / "tok"), "--shards", str(tmp_path / "packed"), "--max-len", "1100",
                      "--world-size", "2", "--groups", "512:1,2048:2", "--global-tokens", "4096", "--quiet"]) == 0
    plan = json.loads((tmp_path / "packed" / "plan.json").read_text())
    assert {g["sp"] for g in plan["groups"]} == {1, 2}
    assert run_distributed(_train_and_export, 2, str(tmp_path), (family,), timeout=900) == [True, True]

    rows = [json.loads(line) for line in (tmp_path / family / "run" / "metrics.jsonl").read_text().splitlines()]
    trainer_loss, trainer_tokens = rows[-1]["loss/eval"], rows[-1]["eval/loss_tokens"]
    own_loss, own_tokens = export_token_mean_loss(tmp_path / family / "export", tmp_path / "tok")
    assert trainer_tokens == own_tokens
    assert eval_main(["offline", "--model", str(tmp_path / family / "export"), "--dataset", str(tmp_path / "tok"),
                      "--no-needle", "--out", str(tmp_path / family / "eval"), "--no-progress"]) == 0
    evaluated = json.loads((tmp_path / family / "eval" / "results.json").read_text())["perplexity"]
    line = (f"{family} longrope: trainer held-out {trainer_loss:.6f}, hbp-eval offline {evaluated['loss']:.6f}, "
            f"export's HF loss {own_loss:.6f} over {own_tokens} tokens")
    print(line)
    assert trainer_loss == pytest.approx(evaluated["loss"], rel=2e-5), line
    assert trainer_loss == pytest.approx(own_loss, rel=2e-5), line
