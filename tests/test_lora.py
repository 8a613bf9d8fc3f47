"""hbp_train/lora.py: LoRA through the trainer on 2 ranks over a plan with sp=1 and sp=2 groups (ZeRO-2 and 3):
only adapter parameters change, a resumed run continues exactly, and export merges the adapters into full HF
weights whose logits equal the trained model's. SP=2 == SP=1 with adapters: tests/test_families.py."""

from __future__ import annotations

import json

import pytest
import torch

from hbp_train.errors import UserError
from hbp_train.lora import LoraSettings
from tests.test_families import SP_PLAN_STEPS, model_overrides

FAMILY = "qwen3"


def _worker(rank, world_size, shards, out):
    from hbp_train import config, trainer
    from hbp_train.distributed.groups import init_distributed

    init_distributed()
    results = {}
    for zero_stage in (2, 3):
        base = ["experiment=cpu_demo", f"data.shards={shards}", "logging=quiet", "train.lr=5e-2",
                "train.warmup_steps=0", f"deepspeed.zero_stage={zero_stage}", "model.lora.r=4",
                "model.lora.alpha=8", *model_overrides(FAMILY)]
        full = config.load([*base, f"train.out_dir={out}/z{zero_stage}/full"])
        summary = trainer.train(full)
        # the same run in two invocations: 2 steps, then resumed for the rest
        first = config.load([*base, f"train.out_dir={out}/z{zero_stage}/split", "train.exit_after_steps=2"])
        trainer.train(first)
        second = config.load([*base, f"train.out_dir={out}/z{zero_stage}/split", "train.resume=auto"])
        resumed = trainer.train(second)
        results[zero_stage] = (summary["losses"], resumed["losses"], resumed["start_step"])
        if zero_stage == 2:  # the trained model's logits, for the export check
            with torch.no_grad():
                ids = torch.arange(3, 30)[None]
                results["logits"] = summary["run"].model(input_ids=ids, position_ids=torch.arange(27)[None]).logits
    return results if rank == 0 else None


@pytest.mark.slow
def test_lora_trains_only_adapters_resumes_exactly_and_exports_merged(tmp_path, tokenizer_dir):
    from transformers import AutoModelForCausalLM

    from hbp_train.export import export
    from hbp_train.families import tiny_config
    from hbp_train.model import ModelConfig, build_model
    from tests.assets.packed_fixture import synthetic_samples, write_packed
    from tests.distributed import run_distributed

    shards = write_packed(str(tmp_path / "packed"), synthetic_samples(14, 4096, seed=7), SP_PLAN_STEPS, world_size=2)
    with open(f"{shards}/plan.json") as f:
        plan = json.load(f)
    plan["groups"][1]["sp"] = 2
    with open(f"{shards}/plan.json", "w") as f:
        json.dump(plan, f)
    results = run_distributed(_worker, 2, shards, str(tmp_path / "runs"), timeout=900)[0]
    for zero_stage in (2, 3):
        losses, resumed_losses, start = results[zero_stage]
        assert len(losses) == 4 and losses[-1] < losses[0], losses
        assert start == 2 and resumed_losses == pytest.approx(losses[2:], rel=1e-6, abs=1e-7), zero_stage
    # export merges: frozen weights are the initial ones, adapted weights moved, logits equal the trained model's
    merged = AutoModelForCausalLM.from_pretrained(export(str(tmp_path / "runs" / "z2" / "full"), str(tmp_path / "hf")))
    initial = build_model(ModelConfig(config=tiny_config(FAMILY), architecture=FAMILY, seed=0), vocab_size=4096)
    initial_state = initial.state_dict()
    changed = {k for k, v in merged.state_dict().items() if not torch.equal(v, initial_state[k])}
    assert changed and all(k.endswith("proj.weight") and "layers." in k for k in changed), sorted(changed)[:5]
    assert not any("lora" in k for k in merged.state_dict()) and not hasattr(merged.config, "hbp_lora")
    with torch.no_grad():
        logits = merged.eval()(input_ids=torch.arange(3, 30)[None]).logits
    torch.testing.assert_close(logits, results["logits"], rtol=1e-4, atol=1e-5)


def test_lora_settings_are_checked():
    for kwargs, field in [({"r": -1}, "model.lora.r"), ({"r": 4, "alpha": 0}, "model.lora.alpha"),
                          ({"dropout": 1.0}, "model.lora.dropout"), ({"target_modules": []}, "target_modules")]:
        with pytest.raises(UserError, match=field):
            LoraSettings(**kwargs)
