"""The live per-rank imbalance (issue 19, defect 12) on 2 CPU processes (gloo, DeepSpeed ZeRO-2): a plan step that
gives rank 0 twice rank 1's work must read a live BR near the planned 1 - mean/max = 0.25, a balanced one near 0.

Each rank's compute time leaves out its wait inside DeepSpeed's gradient reduction (step_timing.comm_wait_timer).
The same engine also runs the steps with ``logging.exclude_comm_wait=false``: there the fast rank's wait counts
as compute and the live figure reads near 0 whatever the plan (what it did before the fix).
"""

from __future__ import annotations

import json
import statistics

import numpy as np
import pytest

from tests.assets.packed_fixture import write_packed
from tests.distributed import run_distributed

VOCAB = 4096
DOC = 1024  # tokens per document: enough work per step that compute, not overhead, is what each rank times
MODEL = {"hidden_size": 256, "intermediate_size": 768, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "max_position_embeddings": 4096, "tie_word_embeddings": False}
REPEATS = 8  # steps per (plan, setting) pair; the median is compared (4 let one noisy CI run read 0.109 balanced)


def _steps() -> tuple[list, list]:
    """Plan steps: (rank 0 two documents, rank 1 one) then (one each), REPEATS times each, for both settings."""
    steps, kinds, doc = [], [], 0
    for _ in range(REPEATS):
        for kind in ("unequal", "balanced"):
            for exclude in (True, False):
                r0 = [doc, doc + 1] if kind == "unequal" else [doc]
                doc += len(r0)
                steps.append({"group": 0, "replicas": [[r0], [[doc]]]})
                doc += 1
                kinds.append((kind, exclude))
    return steps, kinds


def _worker(rank, world_size, shards, out, kinds):
    from hbp_train import build as builder
    from hbp_train import config, trainer
    from hbp_train.distributed.groups import init_distributed

    init_distributed()
    model_cfg = json.dumps(MODEL).replace('"', "").replace(" ", "")
    cfg = config.load(["experiment=cpu_demo", f"data.shards={shards}", f"train.out_dir={out}", "logging=quiet",
                       f"model.config={model_cfg}", "deepspeed.zero_stage=2", "train.warmup_steps=0"])
    run = builder.build(cfg)
    trainer.train_step(run, run.data.step_batch(0, rank, run.pad_token_id))  # warm-up (allocations, first calls)
    live = []
    for step, (_, exclude) in enumerate(kinds):
        run.cfg.logging.exclude_comm_wait = exclude
        gathered, _, _ = trainer.train_step(run, run.data.step_batch(step, rank, run.pad_token_id))
        compute = gathered[:, trainer.STAT_COLUMNS.index("compute_time")].tolist()
        live.append(1.0 - statistics.mean(compute) / max(compute))
    return live if rank == 0 else None


@pytest.mark.slow
@pytest.mark.full  # timed on two ranks: a proof of the live figure, not of a feature the default tier lacks
def test_live_imbalance_follows_the_plan_on_two_ranks(tmp_path):
    rng = np.random.default_rng(0)
    steps, kinds = _steps()
    num_docs = 1 + max(i for s in steps for rep in s["replicas"] for pack in rep for i in pack)
    samples = [(ids, ids) for ids in (rng.integers(3, VOCAB, size=DOC).tolist() for _ in range(num_docs))]
    shards = write_packed(str(tmp_path / "packed"), samples, steps, world_size=2)
    live = run_distributed(_worker, 2, shards, str(tmp_path / "run"), kinds, timeout=600)[0]
    by_kind = {k: statistics.median(v for v, kk in zip(live, kinds) if kk == k) for k in set(kinds)}
    planned = 1.0 - 1.5 / 2.0  # rank 0 twice rank 1's work: 1 - mean/max
    assert abs(by_kind["unequal", True] - planned) <= 0.1, by_kind
    # each live figure reads closer to its own plan's figure (0.25 or 0) than to the other's: on this machine the
    # balanced steps read 0.02-0.05, on a busier 2-core CI runner up to 0.11 with 4 repeats
    assert by_kind["balanced", True] < planned / 2, by_kind
    # before the fix (the wait counted as compute) the same steps read near 0: the check above is what tells them apart
    assert by_kind["unequal", False] < planned - 0.1, by_kind
