"""Every conf/ config composes and converts to dataclasses; bad values fail with one line naming the field (and
exit code 2 from the entry point, before anything is built)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hbp_train import config
from hbp_train.config import CONF_DIR, ConfigError, HBPConfig

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def fake_hf_model(tmp_path_factory) -> str:
    """A local dir with a config.json (and a tokenizer file), so presets that name a real model (8B) convert here."""
    d = tmp_path_factory.mktemp("hf_model")
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (d / "tokenizer_config.json").write_text("{}")  # a model folder holds its tokenizer too (model.tokenizer)
    return str(d)


def _options(group: str) -> list:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def test_every_preset_and_group_option_composes(tmp_path, fake_hf_model):
    base = [f"data.shards={tmp_path}", f"model.name_or_path={fake_hf_model}"]
    for experiment in _options("experiment"):
        cfg = config.load([f"experiment={experiment}", *base])
        assert isinstance(cfg, HBPConfig) and cfg.data.shards == str(tmp_path)
    groups = [g.name for g in CONF_DIR.iterdir() if g.is_dir() and g.name != "experiment"]
    assert {"model", "data", "deepspeed", "train", "loss", "logging"} <= set(groups)
    for group in groups:
        for option in _options(group):
            cfg = config.load([f"{group}={option}", *base])
            assert type(getattr(cfg, group)).__name__.endswith("Config"), (group, option)
    # The presets mean what they say.
    demo = config.load(["experiment=cpu_demo"])
    assert demo.model.name_or_path is None and demo.model.dtype == "fp32" and demo.deepspeed.zero_stage == 2
    assert config.load([]).loss.normalizer == "ave_token"  # the default normalizer
    big = config.load(["experiment=llama3_8b_128k", *base])
    assert big.deepspeed.zero_stage == 3 and big.model.dtype == "bf16" and big.train.resume == "auto"
    # 128K packs: chunked LM-head loss, the best GPU attention, checkpointing depth per group from the plan.
    assert big.loss.chunk_size <= 16384 and big.model.attention_backend == "auto" and big.train.ckpt_layers is None
    assert config.load(["deepspeed=offload"]).deepspeed.offload_optimizer
    for normalizer in _options("loss"):
        assert config.load([f"loss={normalizer}"]).loss.normalizer == normalizer


@pytest.mark.parametrize("override, field", [
    ("train.lr=-1", "train.lr"),
    ("train.lr=abc", "train.lr"),
    ("train.on_nan=maybe", "train.on_nan"),
    ("train.betas=[0.9]", "train.betas"),
    ("train.bogus=1", "train.bogus"),
    ("loss.normalizer=mean", "loss.normalizer"),
    ("deepspeed.zero_stage=4", "deepspeed.zero_stage"),
    ("deepspeed.offload_param=true", "deepspeed.offload_param"),
    ("data=custom", "data.shards"),
    ("logging.log_every=0", "logging.log_every"),
    ("model.dtype=fp8", "model.dtype"),
    ("train.max_steps=0", "train.max_steps"),
    ("train.min_lr_ratio=1.5", "train.min_lr_ratio"),
    ("train.weight_decay=-0.1", "train.weight_decay"),
    ("train.eps=0", "train.eps"),
    ("train.grad_clip=-1", "train.grad_clip"),
    ("train.ckpt_layers=[2,-1]", "train.ckpt_layers"),
    ("train.save_every=-1", "train.save_every"),
    ("train.exit_after_steps=0", "train.exit_after_steps"),
    ("train.eval_every=-1", "train.eval_every"),
    ("deepspeed.reduce_bucket_size=0", "deepspeed.reduce_bucket_size"),
])
def test_bad_value_names_the_field(override, field):
    with pytest.raises(ConfigError) as info:
        config.load([override])
    message = str(info.value)
    assert field in message and "\n" not in message


@pytest.mark.parametrize("override, message", [
    ("train.output_dir=x", "train.output_dir: no such field in train; did you mean train.out_dir?"),
    ("+train.output_dir=x", "train.output_dir: no such field in train; did you mean train.out_dir?"),
    ("deepspeed.stage=3", "deepspeed.stage: no such field in deepspeed; did you mean deepspeed.zero_stage?"),
    ("trian.lr=1", "trian.lr: no such config section, group or field; did you mean train.lr?"),
    ("lr=1", "lr: no such config section, group or field; did you mean train.lr?"),
])
def test_misspelt_key_suggests_the_closest_field(override, message, capsys):
    assert config.main([override]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"config error: {message}") and err.count("\n") == 1


# The parameter counts the models' cards publish (total, active; in billions; Qwen3-30B-A3B's card rounds 3.35 to
# 3.3): the presets' shapes reproduce them from their config fields alone (no weights, no download).
FAMILY_PRESETS = {"llama3_8b": (8.03, None), "qwen3_8b": (8.19, None), "qwen2_5_32b": (32.5, None),
                  "mistral_nemo_12b": (12.2, None), "qwen3_30b_a3b": (30.5, 3.35), "mixtral_8x7b": (46.7, 12.9)}


@pytest.mark.parametrize("preset", sorted(FAMILY_PRESETS))
def test_family_presets_have_their_models_shapes_and_leave_a_checkpoint_its_own(preset, fake_hf_model):
    from hbp_train.perf.shape import model_shape_of

    total, active = FAMILY_PRESETS[preset]
    scratch = config.load([f"model={preset}", "model.name_or_path=null", "data.shards=x"]).model
    shape = model_shape_of(scratch, 4096)  # the shipped tokenizer's 4096 tokens: the preset's vocabulary stays
    assert shape.num_params / 1e9 == pytest.approx(total, rel=0.01)
    assert shape.active_params / 1e9 == pytest.approx(active or total, rel=0.01)
    assert scratch.dtype == "bf16"
    # Given a checkpoint, its config.json is the shape: the preset adds nothing over it.
    assert config.load([f"model={preset}", f"model.name_or_path={fake_hf_model}", "data.shards=x"]).model \
        .hf_overrides() == {}


def test_a_model_config_field_the_preset_does_not_hold_says_how_to_add_it(capsys):
    assert config.main(["model.config.hidden_size=128"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "++model.config.<field>=VALUE" in err and "model.init_config" in err


def test_input_paths_are_checked_before_any_worker_starts(tmp_path, fake_hf_model, capsys):
    """python -m hbp_train.config (what ./launch.sh train runs first) finds a wrong data.shards, data.eval_shards
    or tokenizer folder in one line naming the field: a data.shards typo was reported by "rank 1" once the
    workers had started."""
    (tmp_path / "packed").mkdir()
    (tmp_path / "packed" / "plan.json").write_text("{}")
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "report.json").write_text("{}")
    no_tokenizer = tmp_path / "weights_only"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_text(json.dumps({"model_type": "llama"}))
    # A small model: the run folder's check wants room for one checkpoint (fake_hf_model is a 7B Llama).
    small = tmp_path / "small_model"
    small.mkdir()
    (small / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2,
                                                   "intermediate_size": 64, "num_attention_heads": 4}))
    (small / "tokenizer_config.json").write_text("{}")
    good = [f"data.shards={tmp_path / 'packed'}", f"model.name_or_path={small}", f"train.out_dir={tmp_path / 'run'}"]
    for override, message in [
        (f"data.shards={tmp_path / 'packd'}", "data.shards="),
        (f"data.shards={tmp_path / 'tok'}", "no plan.json there (it is a tokenized dataset: plan and pack it first)"),
        (f"data.eval_shards={tmp_path / 'packed' / 'plan.json'}", "data.eval_shards="),
        (f"model.name_or_path={no_tokenizer}", "model.tokenizer defaults to model.name_or_path"),
    ]:
        assert config.main([*good, override]) == 2, override
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, err
    assert config.main(good) == 0


def test_sp_degrees_the_models_heads_cannot_split_are_refused_before_any_worker_starts(tmp_path, capsys):
    """Shards with a group at sp=2 and a model of 5 heads: python -m hbp_train.config (what ./launch.sh train runs
    before starting workers) says so in one line, exit 2, naming the shards, the model and the degrees that work
    (it used to surface 21 s into training, from every rank). data.eval_shards too; 4 heads pass."""
    from tests.assets.packed_fixture import synthetic_samples, write_packed

    steps = [{"group": 0, "replicas": [[[0]], [[1]]]}, {"group": 1, "replicas": [[[2, 3]]]}]
    shards = write_packed(str(tmp_path / "packed"), synthetic_samples(4, 100), steps, world_size=2,
                          groups={1: {"sp": 2}})
    one = write_packed(str(tmp_path / "sp1"), synthetic_samples(4, 100), [{"group": 0, "replicas": [[[0, 1]]]}], 1)
    five_heads = ["++model.config.hidden_size=40", "++model.config.num_attention_heads=5",
                  "++model.config.num_key_value_heads=5"]
    capsys.readouterr()
    for data in ([f"data.shards={shards}"], [f"data.shards={one}", f"data.eval_shards={shards}"]):
        assert config.main([*data, *five_heads]) == 2
        err = capsys.readouterr().err
        field = data[-1].split("=")[0]
        assert err.count("\n") == 1 and err.startswith(f"config error: {field}={shards} (groups at sp 1, 2) for "
                                                         "llama model.architecture=llama: sp=2 does not divide the "
                                                         "model's 5 attention heads"), err
        assert "(SP degrees that work: 1; data_tools.pack --groups)" in err, err  # powers of two only
    assert config.main([f"data.shards={one}", *five_heads]) == 0  # sp=1 splits nothing
    assert config.main([f"data.shards={shards}"]) == 0  # the tiny Llama's 4 heads: sp=2 splits them
    capsys.readouterr()


def test_a_model_feature_the_packed_path_refuses_is_refused_before_any_worker_starts(tmp_path, capsys):
    """Issue 43: a refusal of the model (here Gemma 3 made bidirectional; windows and soft-caps train) used to come
    from rank 0 after torchrun and DeepSpeed started; python -m hbp_train.config, which ./launch.sh train runs first,
    now says it in one line, exit 2. A windowed, soft-capped Gemma 2 passes."""
    from tests.assets.packed_fixture import synthetic_samples, write_packed

    shards = write_packed(str(tmp_path / "packed"), synthetic_samples(4, 100), [{"group": 0, "replicas": [[[0, 1]]]}],
                          1)
    gemma = ["model.architecture=gemma3_text", "++model.config.head_dim=16", "++model.config.sliding_window=4"]
    capsys.readouterr()
    assert config.main([f"data.shards={shards}", f"train.out_dir={tmp_path}/run", *gemma,
                        "++model.config.use_bidirectional_attention=true"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("config error: gemma3_text (model.architecture / "
                                                   "model.name_or_path): its attention (Gemma3Attention) asks for "
                                                   "bidirectional attention"), err
    assert config.main([f"data.shards={shards}", f"train.out_dir={tmp_path}/run", "model.architecture=gemma2",
                        "++model.config.head_dim=16", "++model.config.sliding_window=4"]) == 0


def test_the_planned_sp_degrees_are_read_from_the_plans_head_or_its_binary_header(tmp_path):
    """The check reads only the groups: the top of plan.json (the steps of a large plan are never parsed) or the
    JSON header of plan.npz."""
    from data_tools import pack

    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in [30, 60, 200, 250] * 50))
    for name in ("plan.json", "plan.npz"):
        (tmp_path / name.replace(".", "_")).mkdir()
        out = tmp_path / name.replace(".", "_") / name
        assert pack.main(["--lengths", str(lengths), "--world-size", "4", "--groups", "64:1,256:4", "--out",
                          str(out), "--quiet", "--no-baseline"]) == 0
        assert config._planned_sp_degrees(str(out.parent)) == [1, 4], name
    assert config._planned_sp_degrees(str(tmp_path / "nowhere")) is None


def test_added_keys_inside_free_form_fields_still_work():
    cfg = config.load(["+deepspeed.extra.foo=1"])
    assert cfg.deepspeed.extra["foo"] == 1


def test_resolved_yaml_round_trips():
    from omegaconf import OmegaConf

    cfg = config.load(["experiment=cpu_demo", "train.lr=0.5"])
    again = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(HBPConfig),
                                                OmegaConf.create(config.resolved_yaml(cfg))))
    assert again == cfg


def test_help_documents_every_field():
    text = config.help_text()
    for section in ("model", "data", "deepspeed", "train", "loss", "logging"):
        section_cls = type(getattr(config.load([]), section))
        for name in config.field_docs(section_cls):
            assert f"{section}.{name} = " in text
    assert "experiment" in text and "cpu_demo" in text


def test_entry_point_rejects_bad_value_with_exit_2():
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, "-m", "hbp_train.train", "experiment=cpu_demo", "train.warmup_steps=-3"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert lines == ["config error: train.warmup_steps=-3: must be >= 0"]


@pytest.mark.parametrize("argv, message", [
    (["--max-steps", "3"], "--max-steps: training takes Hydra overrides KEY=VALUE, not options (e.g. train.max_steps=VALUE)"),
    (["train.lr=1e-3", "max_steps"], "max_steps: training takes Hydra overrides KEY=VALUE"),
    (["--bogus"], "--bogus: training takes Hydra overrides KEY=VALUE, not options (e.g. train.max_steps=3)"),
])
def test_options_that_are_not_overrides_are_refused_naming_the_override(argv, message):
    with pytest.raises(config.ConfigError, match=re.escape(message)):
        config.check_command_line(argv)
    config.check_command_line(["--cfg", "job", "train.lr=1e-3", "~train.betas", "-m", "--config-name=config"])


def test_deepspeed_launcher_local_rank_is_stripped(monkeypatch):
    from hbp_train.train import _strip_local_rank

    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert _strip_local_rank(["--local_rank=3", "experiment=cpu_demo"]) == ["experiment=cpu_demo"]
    assert os.environ["LOCAL_RANK"] == "3"
    assert _strip_local_rank(["a=1", "--local_rank", "1", "b=2"]) == ["a=1", "b=2"]
