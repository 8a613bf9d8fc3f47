"""Part of bench/trainer/bench_trainer.py: the workload — model shapes (presets, or HF config fields as JSON) and seeded
synthetic packs of exactly --pack-len tokens, as packed-shard rows for ``data.collate_pack`` and as documents for
the HF collator."""

from __future__ import annotations

import numpy as np

from hbp_train.common.errors import UserError
from hbp_train.common.labels import IGNORE_INDEX

# Model shapes as HF config fields ("model_type" picks the architecture). llama3.2-1b and the qwen2.5 shapes are the
# published configs (tied embeddings); tiny is for the CPU smoke run.
PRESETS = {
    "tiny": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096, "tie_word_embeddings": False},
    "llama3.2-1b": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
                    "rope_theta": 500000.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-5},
    "qwen2.5-0.5b": {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                     "rope_theta": 1000000.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-6},
    "qwen2.5-1.5b": {"model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
                     "rope_theta": 1000000.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-6},
}


def parse_shape(spec: str) -> tuple[str, str, dict]:
    """(name, architecture, HF config fields) from a preset, a JSON object or a JSON file."""
    from hbp_train.perf.shape import load_json_object

    if spec in PRESETS:
        fields, name = dict(PRESETS[spec]), spec
    else:
        fields = load_json_object(spec, f"--model-shape (not a preset: {', '.join(PRESETS)})")
        name = str(fields.pop("name", "custom"))
    missing = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"} - set(fields)
    if missing:
        raise UserError(f"--model-shape: missing HF config field(s) {', '.join(sorted(missing))}")
    architecture = str(fields.pop("model_type", "llama"))
    fields.pop("architectures", None)
    # Dropout would change the work per step and HF's cache would disable packed masks.
    fields.update(attention_dropout=0.0, use_cache=False)
    return name, architecture, fields


def doc_lengths(rng: np.random.Generator, num: int, max_len: int) -> np.ndarray:
    """A long-tailed SFT length mix (as bench_planner's): 95% chat-like (lognormal, median 600 tokens, sigma 1.2),
    5% long documents (log-uniform from max_len/8 to max_len); all clipped to [16, max_len]."""
    num_long = rng.random(num) < 0.05
    chat = np.round(rng.lognormal(np.log(600), 1.2, num))
    long = np.round(np.exp(rng.uniform(np.log(max(16, max_len // 8)), np.log(max_len), num)))
    return np.clip(np.where(num_long, long, chat), 16, max_len).astype(np.int64)


def make_doc(rng: np.random.Generator, length: int, vocab: int, prompt_frac: float) -> dict:
    """One sample: random token ids; the first prompt_frac of it (a prompt) carries label -100."""
    ids = rng.integers(3, vocab, size=length, dtype=np.int64)
    labels = ids.copy()
    labels[: int(length * prompt_frac)] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels}


def make_packs(pack_len: int, num_packs: int, vocab: int, seed: int, prompt_frac: float,
               docs: str = "mix") -> list[list[dict]]:
    """num_packs packs of exactly pack_len tokens (steady step times). mix: documents drawn (seeded) from
    `doc_lengths` until the pack is full, the last one cut to fit; single: one document of pack_len tokens."""
    rng = np.random.default_rng(seed)
    packs = []
    for _ in range(num_packs):
        if docs == "single":
            packs.append([make_doc(rng, pack_len, vocab, prompt_frac)])
            continue
        pack, room = [], pack_len
        while room > 0:
            length = int(doc_lengths(rng, 1, pack_len)[0])
            length = min(length, room)  # the last document is cut to fill the pack exactly
            pack.append(make_doc(rng, length, vocab, prompt_frac))
            room -= length
        packs.append(pack)
    return packs


def pack_row(pack: list[dict]) -> dict:
    """A packed-shard row (docs/architecture.md) of one pack, for data.collate_pack."""
    lengths = [len(d["input_ids"]) for d in pack]
    return {"input_ids": np.concatenate([d["input_ids"] for d in pack]),
            "labels": np.concatenate([d["labels"] for d in pack]),
            "position_ids": np.concatenate([np.arange(n) for n in lengths]),
            "cu_seqlens": np.concatenate([[0], np.cumsum(lengths)])}


def describe_packs(packs: list[list[dict]]) -> dict:
    lengths = np.array([len(d["input_ids"]) for p in packs for d in p])
    tokens = int(lengths.sum())
    return {"num_packs": len(packs), "docs_per_pack_mean": float(len(lengths) / len(packs)),
            "doc_len_p50": int(np.percentile(lengths, 50)), "doc_len_p90": int(np.percentile(lengths, 90)),
            "doc_len_max": int(lengths.max()),
            "attention_sum_len2_over_T2": float((lengths.astype(float) ** 2).sum()
                                                / sum(sum(len(d["input_ids"]) for d in p) ** 2 for p in packs)),
            "loss_token_share": float(sum(int((d["labels"][1:] != IGNORE_INDEX).sum()) for p in packs for d in p)
                                      / tokens)}
