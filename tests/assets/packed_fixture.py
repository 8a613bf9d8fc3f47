"""Tiny packed shards for the trainer tests, written in the documented format (docs/architecture.md) from a few
synthetic samples, independently of the planner's code.

``write_packed(out, samples, steps, world_size)``: ``samples`` is a list of (input_ids, labels) (labels unshifted,
-100 = not trained), ``steps`` a list of {"group": g, "replicas": [[pack, ...] per replica]} where a pack is a list
of sample indices ([] = an empty pack). Group g's SP degree is 1 and its pack_len the longest pack.
"""

from __future__ import annotations

import json
import os

import numpy as np

TINY_LLAMA = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 256, "tie_word_embeddings": False}


def synthetic_samples(num: int, vocab: int, seed: int = 0, min_len: int = 5, max_len: int = 40) -> list:
    """(input_ids, labels) pairs: a random prompt (labels -100) then a random answer (labels = ids)."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num):
        length = int(rng.integers(min_len, max_len + 1))
        ids = rng.integers(3, vocab, size=length).tolist()
        prompt = int(rng.integers(1, length - 2))
        labels = [-100] * prompt + ids[prompt:]
        out.append((ids, labels))
    return out


def loss_tokens(labels: list) -> int:
    """Trainable targets after the shift (labels[1:] != -100)."""
    return int(sum(1 for x in labels[1:] if x != -100))


def write_packed(out: str, samples: list, steps: list, world_size: int, plan_extra: dict | None = None,
                 groups: dict | None = None) -> str:
    """Write the shards and plan.json; ``plan_extra`` overrides or adds plan keys (e.g. a bytescale plan's);
    ``groups`` overrides a group's fields ({1: {"sp": 2}}: group 1 at sp=2). A step's own "optimizer_step" (the
    plan steps that make one optimizer step) is kept."""
    from datasets import Dataset

    num_groups = 1 + max(s["group"] for s in steps)
    rows_by_group = {g: [] for g in range(num_groups)}
    plan_steps = []
    for step in steps:
        g = step["group"]
        rows = []
        for replica in step["replicas"]:
            replica_rows = []
            for pack in replica:
                ids, labels, pos, cu = [], [], [], [0]
                for i in pack:
                    s_ids, s_labels = samples[i]
                    ids += s_ids
                    labels += s_labels
                    pos += list(range(len(s_ids)))
                    cu.append(cu[-1] + len(s_ids))
                rows_by_group[g].append({
                    "input_ids": ids, "labels": labels, "position_ids": pos, "cu_seqlens": cu,
                    "sample_indices": list(pack), "num_loss_tokens": sum(loss_tokens(samples[i][1]) for i in pack)})
                replica_rows.append(len(rows_by_group[g]) - 1)
            rows.append(replica_rows)
        plan_steps.append({"group": g, "replicas": step["replicas"], "rows": rows,
                           **{k: step[k] for k in ("optimizer_step",) if k in step}})
    for g, rows in rows_by_group.items():
        Dataset.from_list(rows).save_to_disk(os.path.join(out, f"group_{g}"))
    pack_len = {g: max([len(r["input_ids"]) for r in rows] or [1]) for g, rows in rows_by_group.items()}
    plan = {
        "version": 1, "world_size": world_size, "strategy": "test", "seed": 0,
        "max_len": max(pack_len.values()), "global_tokens": 0,
        "groups": [{"pack_len": pack_len[g], "sp": 1, "ckpt_layers": None, **(groups or {}).get(g, {})}
                   for g in range(num_groups)],
        "steps": plan_steps, "dropped": [], "deferred": [], "num_samples": len(samples), "metrics": {},
        "step_metrics": [{"ABR": 1.0, "DBR": 1.0, "tokens": 0, "group": s["group"]} for s in steps],
        **(plan_extra or {}),
    }
    with open(os.path.join(out, "plan.json"), "w") as f:
        json.dump(plan, f)
    return out


# Two replicas; m = 2, 1, 2 micro-batches; unequal samples and tokens per replica; one empty pack.
TWO_RANK_STEPS = [
    {"group": 0, "replicas": [[[0, 1], [2]], [[3], [4, 5, 6]]]},
    {"group": 1, "replicas": [[[7, 8]], [[9]]]},
    {"group": 0, "replicas": [[[10], [11]], [[12, 13], []]]},
]

# bytescale-shaped (ZeRO-1 only): replicas run different numbers of micro-batches, 1 vs 3 and 2 vs 1.
BYTESCALE_STEPS = [
    {"group": 0, "replicas": [[[0, 1, 2, 3]], [[4], [5, 6], [7]]]},
    {"group": 0, "replicas": [[[8], [9, 10]], [[11, 12, 13]]]},
]
BYTESCALE_PLAN = {"strategy": "bytescale", "unequal_micro_batches": True, "requires_zero_stage": [0, 1]}

# One replica: 6 steps with m = 2, 1, 2, 1, 2, 1.
ONE_RANK_STEPS = [{"group": s % 2, "replicas": [[[2 * s], [2 * s + 1]] if s % 2 == 0 else [[2 * s, 2 * s + 1]]]}
                  for s in range(6)]


def reference_normalized_loss(model, samples, step, normalizer):
    """The normalizer's formula over every sample of a plan step, each sample run alone through the plain model:
    the single-process reference that the distributed gradient tests compare against."""
    import torch

    sums, counts, replica_of = [], [], []
    for r, replica in enumerate(step["replicas"]):
        for pack in replica:
            for i in pack:
                ids, labels = samples[i]
                logits = model(input_ids=torch.tensor([ids])).logits[0]
                target = torch.tensor(labels[1:])
                sums.append(torch.nn.functional.cross_entropy(logits[:-1], target, ignore_index=-100, reduction="sum"))
                counts.append(float((target != -100).sum()))
                replica_of.append(r)
    sums_t, counts_t, replica_t = torch.stack(sums), torch.tensor(counts), torch.tensor(replica_of)
    if normalizer == "ave_token":
        return sums_t.sum() / counts_t.sum()
    if normalizer == "sum":
        return sums_t.sum()
    if normalizer == "sample_mean":
        return (sums_t / counts_t).mean()
    assert normalizer == "token_mean", normalizer
    return torch.stack([sums_t[replica_t == r].sum() / counts_t[replica_t == r].sum()
                        for r in range(len(step["replicas"]))]).mean()
