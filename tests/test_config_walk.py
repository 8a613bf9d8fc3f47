"""Every config field, walked: a value of the wrong type and one out of range each end as exit 2 with one line
naming the field and no traceback (``python -m hbp_train.config``, what ./launch.sh train runs before starting
workers); every path field given a missing path, or a file where a folder is expected (and the reverse), is one
UserError line naming the field before the engine is built. A new field fails ``test_the_tables_cover_every_field``
until it is given its cases here."""

from __future__ import annotations

import dataclasses
import json
import typing

import pytest

from hbp_train import config
from tests.assets.packed_fixture import ONE_RANK_STEPS, TINY_LLAMA, synthetic_samples, write_packed


def _fields() -> dict:
    """{"section.field": type} of every field of HBPConfig."""
    out = {}
    sections = typing.get_type_hints(config.HBPConfig)
    for section in dataclasses.fields(config.HBPConfig):
        hints = typing.get_type_hints(sections[section.name])
        for f in dataclasses.fields(sections[section.name]):
            out[f"{section.name}.{f.name}"] = hints[f.name]
    return out


def _wrong_type(kind) -> typing.Optional[str]:
    """A value of another type than ``kind`` (None where any value is of the type, e.g. a free-form string)."""
    args = [a for a in typing.get_args(kind) if a is not type(None)]
    base = typing.get_origin(args[0] if args else kind) or (args[0] if args else kind)
    return {int: "abc", float: "abc", bool: "maybe", list: "abc", dict: "abc", str: "[1,2]"}.get(base)


# An out-of-range (or otherwise invalid) value per field; fields where every value of the type is valid are in
# NO_RANGE with the reason. (Path fields also get their own cases below.)
OUT_OF_RANGE = {
    "model.name_or_path": "/nonexistent/model", "model.config": "{num_attention_heads: 3}",
    "model.init_config": "{num_attention_heads: 3}",
    "model.architecture": "not_a_model", "model.dtype": "fp8", "model.attention_backend": "magic", "model.kernels": "triton",
    "model.tokenizer": "/nonexistent/tokenizer", "model.seed": "-1", "model.lora": "{r: -1}",
    "data.shards": "''", "data.epochs": "0", "data.eval_shards": "''",
    "deepspeed.zero_stage": "4", "deepspeed.reduce_bucket_size": "0", "deepspeed.extra": "{zero_optimization: 5}",
    "deepspeed.grad_accum_dtype": "fp16",
    "train.out_dir": "''", "train.max_steps": "0", "train.lr": "-1", "train.min_lr_ratio": "1.5",
    "train.warmup_steps": "-1", "train.weight_decay": "-0.1", "train.betas": "[0.9]", "train.eps": "0",
    "train.grad_clip": "-1", "train.seed": "-1", "train.ckpt_layers": "[2,-1]", "train.save_every": "-1",
    "train.keep_last": "-1", "train.resume": "''", "train.on_nan": "maybe", "train.max_skipped": "-1",
    "train.exit_after_steps": "0", "train.eval_every": "-1",
    "loss.normalizer": "mean", "loss.chunk_size": "0", "loss.impl": "liger",
    "logging.log_every": "0", "logging.peak_flops": "-1", "logging.wandb_project": "''", "logging.comm_wait_every": "0",
    "profile.max_len": "1", "profile.min_len": "0", "profile.lengths": "[0]", "profile.world_size": "0",
    "profile.sp_degrees": "[3]", "profile.gpus_per_node": "0", "profile.headroom": "1.5",
    "profile.memory_metric": "guess", "profile.ckpt_probe_layers": "-1", "profile.warmup_iters": "-1",
    "profile.iters": "0", "profile.time_budget_s": "0", "profile.docs": "/nonexistent/docs", "profile.seed": "-1",
    "profile.calibration": "/nonexistent/calibration.json", "profile.device_memory_gb": "0", "profile.output": "''",
    "profile.device": "tpu", "profile.measure_devices": "0", "profile.worker_timeout_s": "0",
    "profile.zero_stages": "[4]", "profile.global_tokens": "0", "profile.comm_overlap": "1.5",
    "profile.pcie_gbps": "0",
}
NO_RANGE = {  # every value of the type is valid: only the wrong type is checked
    "data.check_counts": "bool", "data.shuffle_epochs": "bool", "deepspeed.offload_optimizer": "bool",
    "deepspeed.offload_param": "bool (true needs ZeRO-3, tested in test_config)", "deepspeed.overlap_comm": "bool",
    "model.resize_vocab": "bool (its effect: tests/test_vocab.py)",
    "train.save_final": "bool", "logging.jsonl": "bool", "logging.tensorboard": "bool",
    "logging.progress_bar": "bool", "logging.exclude_comm_wait": "bool", "logging.wandb": "bool",
    "logging.wandb_run_name": "free-form name (None = W&B chooses)", "profile.prune": "bool", "profile.dry_run": "bool", "profile.progress": "bool",
    "profile.levers": "bool", "profile.zero_offload": "bool",
}


def test_the_tables_cover_every_field():
    fields = set(_fields())
    assert set(OUT_OF_RANGE) | set(NO_RANGE) == fields
    assert not set(OUT_OF_RANGE) & set(NO_RANGE)


def _cases():
    for name, kind in _fields().items():
        wrong = _wrong_type(kind)
        if wrong is not None and name not in ("model.name_or_path", "model.tokenizer", "train.resume",
                                              "data.eval_shards", "profile.docs", "profile.calibration"):
            yield pytest.param(name, wrong, id=f"{name}=wrong_type")
        if name in OUT_OF_RANGE:
            yield pytest.param(name, OUT_OF_RANGE[name], id=f"{name}=out_of_range")


@pytest.mark.parametrize("name, value", list(_cases()))
def test_a_bad_value_is_exit_2_and_one_line_naming_the_field(name, value, capsys):
    assert config.main(["experiment=cpu_demo", f"{name}={value}"]) == 2
    captured = capsys.readouterr()
    err = captured.err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in captured.err + captured.out, err
    assert err.startswith("config error: ") and name in err, err


VOCAB = 4096


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    out = tmp_path_factory.mktemp("walk_packed")
    return write_packed(str(out), synthetic_samples(12, VOCAB, seed=1), ONE_RANK_STEPS, world_size=1)


def _path_cases(tmp):
    """(field, value, what the line says) for each path field: a missing path, and the wrong kind of thing."""
    afile, adir = tmp / "a_file", tmp / "a_dir"
    return [
        ("data.shards", tmp / "missing", "data.shards"), ("data.shards", afile, "data.shards"),
        ("data.shards", adir, "data.shards"),  # a folder without plan.json
        ("data.eval_shards", tmp / "missing", "data.eval_shards"), ("data.eval_shards", afile, "data.eval_shards"),
        ("model.tokenizer", tmp / "missing", "model.tokenizer"), ("model.tokenizer", afile, "model.tokenizer"),
        ("model.tokenizer", adir, "model.tokenizer"),  # an empty folder
        ("model.name_or_path", tmp / "missing", "model.name_or_path"),
        ("model.name_or_path", afile, "model.name_or_path"),
        ("train.out_dir", afile, "train.out_dir"),
        ("train.resume", tmp / "missing", "train.resume"), ("train.resume", afile, "train.resume"),
        ("profile.docs", tmp / "missing", "profile.docs"),
        ("profile.calibration", tmp / "missing", "profile.calibration"),
        ("profile.calibration", adir, "profile.calibration"),
        # (profile.output naming a folder: the profiler CLI's own check, tests/test_profiler_cli.py)
    ]


def test_a_value_deepspeed_rejects_is_one_line_naming_deepspeed_extra(shards, tmp_path, monkeypatch):
    from hbp_train import build, trainer
    from hbp_train.model import hf_model as model
    from hbp_train.common.errors import UserError

    monkeypatch.setattr(model, "build_model", lambda *a, **k: pytest.fail("built the model first"))
    cfg = config.load(["experiment=cpu_demo", f"data.shards={shards}", f"train.out_dir={tmp_path / 'run'}",
                       "logging=quiet", "+deepspeed.extra.zero_optimization.reduce_bucket_size=-5"])
    with pytest.raises(UserError) as info:
        trainer.train(cfg)
    text = str(info.value)
    assert "\n" not in text and text.startswith("deepspeed.extra: DeepSpeed rejects the config (")
    assert "reduce_bucket_size" in text and "greater than 0" in text
    assert build.check_deepspeed_config(config.load(["experiment=cpu_demo", f"data.shards={shards}"]), 10, 1) is None


def test_every_path_field_with_a_missing_path_or_the_wrong_kind_is_one_line(shards, tmp_path, monkeypatch):
    from hbp_train import build, trainer
    from hbp_train.common.errors import UserError

    (tmp_path / "a_file").write_text("not a folder")
    (tmp_path / "a_dir").mkdir()
    # Nothing here may reach the engine: the error must come first.
    monkeypatch.setattr(build, "build_engine", lambda *a, **k: pytest.fail("reached the DeepSpeed engine"))
    model_cfg = json.dumps(TINY_LLAMA).replace('"', "").replace(" ", "")
    failures = []
    for name, value, names in _path_cases(tmp_path):
        overrides = ["experiment=cpu_demo", f"data.shards={shards}", f"train.out_dir={tmp_path / 'run'}",
                     "logging=quiet", f"model.config={model_cfg}", f"{name}={value}"]
        try:
            cfg = config.load(overrides)
            if not name.startswith("profile."):  # the profiler's fields are read by the profiler's CLI
                trainer.train(cfg)
            failures.append(f"{name}={value}: accepted")
        except UserError as e:
            text = str(e)
            if "\n" in text or names not in text:
                failures.append(f"{name}={value}: {text!r}")
    assert not failures, "\n".join(failures)
