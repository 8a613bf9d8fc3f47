"""hbp_train/observe/run_summary.py: the start-of-run lines, read from a built run (the real run's lines are checked in
tests/test_newcomer.py): the model and its parameters, those trained under LoRA, the data and the run's length."""

from __future__ import annotations

from types import SimpleNamespace

from hbp_train.model.lora import LoraSettings
from hbp_train.model.hf_model import ModelConfig, build_model
from hbp_train.observe.run_summary import count_parameters, start_summary
from hbp_train.trainer import TrainConfig

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)


def _run(model_cfg, model, total_steps=30, steps_per_epoch=10, epochs=3, warmup=10):
    cfg = SimpleNamespace(model=model_cfg, train=TrainConfig(out_dir="runs/x", warmup_steps=warmup),
                          deepspeed=SimpleNamespace(zero_stage=2),
                          data=SimpleNamespace(shards="packed/", eval_shards=None, epochs=epochs))
    data = SimpleNamespace(groups=[{"pack_len": 1024, "sp": 1}, {"pack_len": 4096, "sp": 2}], num_steps=steps_per_epoch,
                           plan={"metrics": {"num_samples": 500, "num_dropped": 2, "tokens": 40_000}})
    return SimpleNamespace(cfg=cfg, model=model, data=data, total_steps=total_steps,
                           sp=SimpleNamespace(pstate=SimpleNamespace(sp_degrees=[1, 2])))


def test_the_summary_says_what_is_trained_on_what_and_how_long():
    model_cfg = ModelConfig(config=TINY, seed=3)
    model = build_model(model_cfg, vocab_size=512)
    total = sum(p.numel() for p in model.parameters())
    assert count_parameters(model) == (total, total)
    lines = start_summary(_run(model_cfg, model)).splitlines()
    assert lines[0].startswith("[train] model: llama built from scratch (model.init_config, random weights, "
                               "model.seed=3) | ")
    assert "all trained | float32 | attention " in lines[0]
    assert lines[1] == "[train] ranks: 1 | ZeRO-2 | SP degrees 1, 2 | packing groups 1024:sp1, 4096:sp2"
    assert lines[2] == "[train] data: packed/ (500 samples, 2 dropped by the plan, 40,000 tokens)"
    assert lines[3] == ("[train] run: 10 optimizer steps per epoch x 3 epochs = 30 steps, ~4,000 tokens per step | "
                        "lr 2e-05, warm-up 10 steps | out runs/x")
    # The warm-up as the run applies it: capped for a run no longer than it.
    assert "warm-up 0 steps" in start_summary(_run(model_cfg, model, total_steps=3, steps_per_epoch=3, epochs=1))


def test_under_lora_the_summary_counts_the_trained_parameters():
    model_cfg = ModelConfig(config=TINY, lora=LoraSettings(r=4))
    model = build_model(model_cfg, vocab_size=512)
    total, trainable = count_parameters(model)
    assert 0 < trainable < total and trainable == sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert f"({100 * trainable / total:.2f}%, LoRA r=4)" in start_summary(_run(model_cfg, model)).splitlines()[0]


def test_after_a_resume_on_another_world_size_trained_samples_are_not_called_dropped():
    """A re-plan (planning/replan.py) lists the samples trained before the resume as dropped for that reason: the
    summary counts them apart; a re-plan that plans them again (a head of later epochs) drops none of them."""
    model_cfg = ModelConfig(config=TINY)
    model = build_model(model_cfg, vocab_size=512)
    run = _run(model_cfg, model)
    run.data.plan = {"metrics": {"num_samples": 500, "num_dropped": 202, "tokens": 40_000},
                     "replanned": {"trained": 200, "head_steps": 0}}
    assert start_summary(run).splitlines()[2] == ("[train] data: packed/ (500 samples, 2 dropped by the plan, "
                                                  "200 trained before the resume, 40,000 tokens)")
    run.data.plan = {"metrics": {"num_samples": 500, "num_dropped": 2, "tokens": 40_000},
                     "replanned": {"trained": 200, "head_steps": 3}}
    assert "(500 samples, 2 dropped by the plan, 40,000 tokens)" in start_summary(run)
