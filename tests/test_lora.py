"""hbp_train/model/lora.py: LoRA and DoRA through the trainer on 2 ranks over a plan with sp=1 and sp=2 groups (ZeRO-2 and
3), on a dense family and (LoRA) on an MoE family whose fused experts are adapted: only adapter parameters change,
a resumed run continues exactly, export merges the adapters into full HF weights whose logits equal the trained
model's, and ``--adapter`` writes a peft adapter that ``PeftModel.from_pretrained`` loads over the base model to the
same logits. SP=2 == SP=1 with adapters: tests/test_families.py."""

from __future__ import annotations

import json
import os
import warnings

import pytest
import torch

from hbp_train.common.errors import UserError
from hbp_train.model.lora import LoraSettings, is_adapter_parameter
from tests.test_families import SP_PLAN_STEPS, losses_and_grads, make_samples, model_overrides, pack_of, tiny_model

# (family, extra overrides): LoRA and DoRA on a dense family; LoRA on an MoE family (attention, router, fused experts)
VARIANTS = {"qwen3+lora": ("qwen3", []), "qwen3+dora": ("qwen3", ["model.lora.dora=true"]),
            "qwen3_moe+lora": ("qwen3_moe", [])}


def _worker(rank, world_size, shards, out, variants):
    """Every variant on the same 2 ranks, one after the other: one spawn (each costs ~15 s of imports)."""
    from hbp_train.distributed.groups import init_distributed

    init_distributed()
    results = {variant: _train_variant(shards, f"{out}/{variant}", variant) for variant in variants}
    return results if rank == 0 else None


def _train_variant(shards, out, variant):
    from hbp_train import config, trainer

    family, extra = VARIANTS[variant]
    results = {}
    for zero_stage in (2, 3):
        base = ["experiment=cpu_demo", f"data.shards={shards}", "logging=quiet", "train.lr=5e-2",
                "train.warmup_steps=0", f"deepspeed.zero_stage={zero_stage}", "model.lora.r=4",
                "model.lora.alpha=8", *extra, *model_overrides(family)]
        if zero_stage == 3:  # partition even these tiny weights (DeepSpeed keeps small ones whole by default)
            base.append("++deepspeed.extra.zero_optimization.stage3_param_persistence_threshold=0")
        full = config.load([*base, f"train.out_dir={out}/z{zero_stage}/full"])
        summary = trainer.train(full)
        # the same run in two invocations: 2 steps, then resumed for the rest
        first = config.load([*base, f"train.out_dir={out}/z{zero_stage}/split", "train.exit_after_steps=2"])
        trainer.train(first)
        second = config.load([*base, f"train.out_dir={out}/z{zero_stage}/split", "train.resume=auto"])
        resumed = trainer.train(second)
        results[zero_stage] = (summary["losses"], resumed["losses"], resumed["start_step"])
        if zero_stage == 2:  # the trained model's weights and logits, for the checks against the exports
            model = summary["run"].model
            results["params"] = {n: p.detach().clone() for n, p in model.named_parameters()}
            with torch.no_grad():
                ids = torch.arange(3, 30)[None]
                results["logits"] = model(input_ids=ids, position_ids=torch.arange(27)[None]).logits
    return results


def _initial(family, lora=None):
    """The model the trainer starts from (cpu_demo's seed), with adapters when ``lora`` is given."""
    from hbp_train.model.families import tiny_config
    from hbp_train.model.hf_model import ModelConfig, build_model

    return build_model(ModelConfig(config=tiny_config(family), architecture=family, seed=0,
                                   lora=lora or LoraSettings()), vocab_size=4096)


def _wraps_fused(model) -> set:
    """Prefixes of the adapter modules that wrap a fused (3-D) parameter, e.g. an MoE experts tensor."""
    from peft.tuners.lora.layer import ParamWrapper

    return {name + "." for name, module in model.named_modules() if isinstance(module, ParamWrapper)}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(the runs' folder, every variant's results), trained in one spawn of 2 ranks."""
    from tests.assets.packed_fixture import synthetic_samples, write_packed
    from tests.distributed import run_distributed

    tmp = tmp_path_factory.mktemp("lora")
    shards = write_packed(str(tmp / "packed"), synthetic_samples(14, 4096, seed=7), SP_PLAN_STEPS, world_size=2,
                          groups={1: {"sp": 2}})
    return tmp / "runs", run_distributed(_worker, 2, shards, str(tmp / "runs"), sorted(VARIANTS), timeout=900)[0]


@pytest.mark.slow
@pytest.mark.full  # the LoRA matrix; the single-process peft tests below stay in the default tier
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_adapters_train_alone_resume_exactly_and_export_merged_or_as_adapter(variant, trained, tmp_path,
                                                                              tokenizer_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from hbp_train.export import export

    family, extra = VARIANTS[variant]
    runs, every = trained
    results, runs = every[variant], runs / variant
    for zero_stage in (2, 3):
        losses, resumed_losses, start = results[zero_stage]
        assert len(losses) == 4 and losses[-1] < losses[0], losses
        assert start == 2 and resumed_losses == pytest.approx(losses[2:], rel=1e-6, abs=1e-7), zero_stage
    # only adapter parameters moved from where the trainer started (DoRA: its magnitudes are adapter parameters too)
    lora = LoraSettings(r=4, alpha=8, dora="model.lora.dora=true" in extra)
    initial = _initial(family, lora)
    start_params = dict(initial.named_parameters())
    assert results["params"].keys() == start_params.keys()
    changed = {n for n, p in results["params"].items() if not torch.equal(p, start_params[n])}
    assert changed and all(is_adapter_parameter(n) for n in changed), sorted(changed)[:5]
    if lora.dora:
        assert any("lora_magnitude_vector" in n for n in changed)
    fused = _wraps_fused(initial)
    assert bool(fused) == (family == "qwen3_moe")  # the MoE family's experts are adapted ...
    assert all(any(n.startswith(p) for n in changed) for p in fused)  # ... and trained
    # export merges: the base model's weights (no adapter left), logits equal the trained model's
    ids = torch.arange(3, 30)[None]
    merged = AutoModelForCausalLM.from_pretrained(export(str(runs / "z2" / "full"), str(tmp_path / "hf")))
    assert merged.state_dict().keys() == _initial(family).state_dict().keys()
    assert not hasattr(merged.config, "hbp_lora")
    with torch.no_grad():
        torch.testing.assert_close(merged.eval()(input_ids=ids).logits, results["logits"], rtol=1e-4, atol=1e-5)
    # --adapter: a peft adapter folder that loads over the base model to the same logits (written over the merged
    # export: its full-model files go)
    out = export(str(runs / "z2" / "full"), str(tmp_path / "hf"), adapter=True)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(os.listdir(out))
    with open(os.path.join(out, "hbp_export.json")) as f:
        assert json.load(f)["adapter"] is True
    assert not any(f.startswith("model") or f == "config.json" for f in os.listdir(out)), os.listdir(out)
    loaded = PeftModel.from_pretrained(_initial(family), out)
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(input_ids=ids).logits, results["logits"], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "deepseek_v3"])
def test_moe_experts_are_adapted_without_a_false_peft_warning(family):
    """The default targets adapt an MoE family's fused expert parameters (peft's target_parameters): their adapters
    get gradients through the packed forward, frozen weights none, and peft's warning about its own rank pattern for
    the fused experts (which it did apply) is not shown."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = tiny_model(f"{family}+lora")
    assert not [str(w.message) for w in caught if "pattern" in str(w.message)]
    fused = _wraps_fused(model)
    assert fused
    with torch.no_grad():  # lora_B starts at zero (no gradient for lora_A): move it so both get one
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    _, grads = losses_and_grads(model, [pack_of(make_samples())])
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert grads.keys() == trainable and all(is_adapter_parameter(n) for n in trainable)
    for prefix in fused:
        expert_grads = [g for n, g in grads.items() if n.startswith(prefix)]
        assert expert_grads and all(g.abs().sum() > 0 for g in expert_grads), prefix


def test_target_parameters_adapt_only_what_is_named():
    """model.lora.target_modules=[q_proj] + target_parameters=[down_proj]: the experts' down projection and q_proj
    get adapters; the router, the experts' gate_up_proj and the other projections stay as they are."""
    from hbp_train.model.families import tiny_config
    from hbp_train.model.hf_model import ModelConfig, build_model

    lora = LoraSettings(r=4, target_modules=["q_proj"], target_parameters=["down_proj"])
    model = build_model(ModelConfig(config=tiny_config("qwen3_moe"), architecture="qwen3_moe", seed=3, lora=lora),
                        vocab_size=128)
    adapted = {n.split(".lora_")[0] for n, p in model.named_parameters() if p.requires_grad}
    assert adapted == {f"model.layers.{i}.{m}" for i in range(2) for m in ("self_attn.q_proj", "mlp.experts")}
    wrapper = model.model.layers[0].mlp.experts
    assert wrapper.parameter_name == "down_proj" and not hasattr(wrapper.base_layer, "base_layer")


def test_dora_on_fused_experts_is_refused_in_one_line():
    with pytest.raises(UserError, match="model.lora.dora=true: qwen3_moe's MoE experts are fused"):
        tiny_model("qwen3_moe+dora")


def test_lora_settings_are_checked():
    for kwargs, field in [({"r": -1}, "model.lora.r"), ({"r": 4, "alpha": 0}, "model.lora.alpha"),
                          ({"dropout": 1.0}, "model.lora.dropout"), ({"target_modules": []}, "target_modules"),
                          ({"target_parameters": []}, "target_parameters"),
                          ({"r": 4, "dora": True, "target_parameters": ["down_proj"]}, "dora")]:
        with pytest.raises(UserError, match=field):
            LoraSettings(**kwargs)


def test_an_adapter_on_the_lm_head_is_refused_in_one_line():
    """The loss reads the LM head's weight itself (hidden @ W.T chunk by chunk, model/packed_lm.PackedCausalLM), past any
    adapter wrapped around the head: an lm_head adapter would stay at its initial values, silently. Refused where
    the settings are read, and, for a head by another name, when the adapters are injected."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from hbp_train.model.lora import apply_lora

    with pytest.raises(UserError) as err:
        LoraSettings(r=4, target_modules=["q_proj", "lm_head"])
    assert str(err.value).startswith("model.lora.target_modules=['q_proj', 'lm_head']: lm_head") and \
        "\n" not in str(err.value)
    config = AutoConfig.for_model("biogpt", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, vocab_size=64)
    model = AutoModelForCausalLM.from_config(config)  # its LM head is called output_projection
    with pytest.raises(UserError, match=r"target_modules=\['output_projection'\]: output_projection is the LM head"):
        apply_lora(model, LoraSettings(r=4, target_modules=["output_projection"]))
