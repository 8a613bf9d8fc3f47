"""The run config: composes each module's dataclass, registers the schema with Hydra, converts at the boundary.

Each part lives next to its code (model.ModelConfig, data.DataConfig, loss.LossConfig, trainer.TrainConfig,
build.DeepSpeedConfig, telemetry.LoggingConfig); this file only puts them together as ``HBPConfig``, stores it in
Hydra's ConfigStore as ``hbp_schema`` (the first entry of conf/config.yaml's defaults, so every YAML value is
type-checked against it), and turns the composed DictConfig into dataclasses with ``OmegaConf.to_object`` — after
that, no code sees a DictConfig. Every bad value becomes one ``ConfigError`` line naming the field.

``python -m hbp_train.config [OVERRIDES]`` checks a config without building anything (exit 2 on a bad value), its
input paths, the model against the data's plans (SP degrees against its heads, every feature the packed path refuses:
hbp_train/model/compat.py, on the meta device) and the run folder included (``check_paths``: ./launch.sh train runs
it before starting any worker), and prints the resolved YAML.
"""

from __future__ import annotations

import ast
import difflib
import inspect
import os
import sys
import textwrap
from dataclasses import dataclass, field, fields
from pathlib import Path

from hydra.core.config_store import ConfigStore
from hydra.errors import HydraException
from omegaconf import MISSING, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from hbp_train.build import DeepSpeedConfig
from hbp_train.batches.loader import DataConfig, shards_dir_problem
from hbp_train.common.errors import EXIT_USER_ERROR, UserError
from hbp_train.model.loss import LossConfig
from hbp_train.model.hf_model import ModelConfig, check_tokenizer_dir
from hbp_train.perf.profile_config import ProfileConfig
from hbp_train.runtime import preflight, resume_config
from hbp_train.observe.telemetry import LoggingConfig
from hbp_train.trainer import TrainConfig

CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


@dataclass
class HBPConfig:
    """A whole training run (conf/config.yaml composes it from the conf/ groups)."""

    model: ModelConfig = MISSING
    """The model to train (conf/model/)."""
    data: DataConfig = MISSING
    """The packed shards to train on (conf/data/)."""
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    """ZeRO stage and offloading (conf/deepspeed/: zero2, zero3, offload)."""
    train: TrainConfig = field(default_factory=TrainConfig)
    """Optimizer, schedule, checkpoints, resume (conf/train/)."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Loss normalizer and LM-head chunking (conf/loss/)."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics outputs and MFU peak (conf/logging/)."""
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    """Auto group selection profiler (python -m hbp_train.profiler; profile.* overrides; unused by training)."""


class ConfigError(UserError):
    """A user mistake in the config: one line naming the field."""


def register() -> None:
    """Store the schema in Hydra's ConfigStore (idempotent)."""
    ConfigStore.instance().store(name="hbp_schema", node=HBPConfig)


register()


def to_dataclass(cfg) -> HBPConfig:
    """Turn the composed DictConfig into an HBPConfig (runs every __post_init__); raises ConfigError."""
    try:
        return OmegaConf.to_object(cfg)
    except OmegaConfBaseException as e:
        raise ConfigError(_one_line(e)) from None
    except UserError as e:  # a section's __post_init__ check, naming the field
        raise ConfigError(str(e).splitlines()[0]) from None


def _one_line(e: OmegaConfBaseException) -> str:
    key = getattr(e, "full_key", None)
    first = str(e).splitlines()[0] if str(e) else type(e).__name__
    if type(e).__name__ == "MissingMandatoryValue" and key:
        return f"{key}: required but not set (add {key}=... to the command line or the experiment preset)"
    return f"{key}: {first}" if key and key not in first else first


def compose(overrides: list | None = None) -> object:
    """Compose conf/config.yaml with Hydra overrides into a DictConfig (no run dir, no logging set-up)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return hydra_compose(config_name="config", overrides=list(overrides or []))


def load(overrides: list | None = None) -> HBPConfig:
    """Compose and convert; every failure is a ConfigError with one line naming the field or override."""
    for override in overrides or []:
        check_override_key(override)
    try:
        cfg = compose(overrides)
    except (HydraException, OmegaConfBaseException) as e:  # unknown group option, bad type, missing key
        line = _hydra_error_line(e)
        if "Could not override 'model.config." in line:  # model.config holds only the fields the user set
            line += ("; add a field with ++model.config.<field>=VALUE (a preset's shape is model.init_config, "
                     "used only without model.name_or_path)")
        raise ConfigError(line) from None
    return to_dataclass(cfg)


def check_paths(cfg: HBPConfig, world_size: int | None = None) -> None:
    """ConfigError naming the field for what a training run would refuse later with no worker needed: data.shards
    and data.eval_shards packed-shard folders, model.tokenizer (given, or model.name_or_path's) a tokenizer folder;
    the model against the shards' plans (``check_model``: SP degrees against its heads, the features the packed path
    refuses, the memory levers its groups ask for, the ZeRO stage it was planned for); train.out_dir a writable
    folder with room for one checkpoint that holds no other run's checkpoints (runtime/preflight.py); and a resume's
    checkpoint against this run: its plan, its model and the settings a resume cannot change, and the plan's SP
    degrees at this world size (runtime/resume_config.precheck). ``world_size``: the ranks the run will have
    (default: the WORLD_SIZE environment variable, which torchrun sets and ./launch.sh gives the config check;
    unset: not checked here, the workers do it); a fresh run's plan must be planned for it. model.name_or_path is
    checked with the model section itself. Not part of ``load``: the profiler reads no data and writes no run
    folder."""
    if world_size is None and os.environ.get("WORLD_SIZE", "").strip().isdigit():
        world_size = int(os.environ["WORLD_SIZE"])
    for field_name, path in (("data.shards", cfg.data.shards), ("data.eval_shards", cfg.data.eval_shards)):
        problem = shards_dir_problem(path) if path is not None else None
        if problem:
            raise ConfigError(f"{field_name}={path}: {problem}")
    try:
        check_tokenizer_dir(cfg.model.tokenizer)
    except UserError as e:
        implied = cfg.model.tokenizer == cfg.model.name_or_path  # the default: the model's own folder
        raise ConfigError(str(e) + ("; model.tokenizer defaults to model.name_or_path: save the tokenizer there "
                                    "or set model.tokenizer=DIR" if implied else "")) from None
    check_model(cfg)
    header = _plan_header(cfg.data.shards)
    check_levers(cfg)
    check_zero_stage(cfg)
    try:
        preflight.check_out_dir(cfg.train.out_dir, cfg.train.resume, _checkpoint_bytes(cfg, world_size))
        fresh = resume_config.checkpoint_to_resume(cfg) is None  # (a resume may re-plan for this world size)
        for field_name, path in (("data.shards", cfg.data.shards), ("data.eval_shards", cfg.data.eval_shards)):
            planned = (header if path == cfg.data.shards else _plan_header(path)).get("world_size")
            if fresh and world_size and planned not in (None, world_size):
                raise UserError(f"{field_name}={path}: planned for world size {planned}, but this run has "
                                f"{world_size} rank{'s' if world_size > 1 else ''}: launch {planned} processes "
                                f"(NPROC={planned} ./launch.sh train ...), or re-plan with data_tools.pack "
                                f"--world-size {world_size}")
        resume_config.precheck(cfg, world_size, header.get("groups"))
    except UserError as e:
        raise ConfigError(str(e)) from None


def _checkpoint_bytes(cfg: HBPConfig, world_size: int | None = None) -> int:
    """About how large one checkpoint of this run is (preflight.checkpoint_bytes: the model this run builds, its
    vocabulary the tokenizer's, its trained parameters, its ZeRO stage); 0 (no space check) when the model's shape
    cannot be read from its config, which the build then reports."""
    try:
        shape = resume_config.built_shape(cfg.model)
    except UserError:
        return 0
    lora = cfg.model.lora
    adapters = preflight.lora_params(shape, lora.r, lora.target_modules, lora.dora) if lora.r > 0 else 0
    return preflight.checkpoint_bytes(shape.num_params + adapters, cfg.deepspeed.zero_stage,
                                      cfg.model.torch_dtype().itemsize, world_size or 1,
                                      trained_params=adapters if lora.r > 0 else None,
                                      other_bytes=preflight.tokenizer_bytes(cfg.model.tokenizer))


def check_model(cfg: HBPConfig) -> None:
    """ConfigError (one line) when the model cannot be trained on the plans of data.shards and data.eval_shards:
    a group whose SP degree Ulysses cannot split the model's heads by, or a feature of the model the packed path
    refuses (hbp_train/model/compat.py: attention sinks, linear-attention layers, chunked attention on samples longer
    than a chunk, a backend that cannot apply its window or soft-cap, a logit head the loss would not reproduce...).
    Found here from the plans' headers and the model's config (the model on the meta device: no weights), before any
    worker starts, rather than by every rank once it has built its groups (build_run checks it again, with the
    samples' own lengths)."""
    from hbp_train.model.compat import check_model_support
    from hbp_train.model.compat import check_sp_degrees as check_heads
    from hbp_train.model.hf_model import hf_config_for

    hf_config = hf_config_for(cfg.model)
    model = cfg.model.name_or_path or f"model.architecture={cfg.model.architecture}"
    degrees, longest = set(), []
    for field_name, path in (("data.shards", cfg.data.shards), ("data.eval_shards", cfg.data.eval_shards)):
        sp = _planned_sp_degrees(path) if path is not None else None
        if not sp:
            continue
        degrees |= set(sp)
        max_len = _plan_header(path).get("max_len")
        longest += [int(max_len)] if isinstance(max_len, int) else []
        try:
            check_heads(hf_config, sp, f"{field_name}={path} (groups at sp {', '.join(map(str, sp))}) "
                                       f"for {getattr(hf_config, 'model_type', 'the model')} {model}")
        except UserError as e:
            raise ConfigError(str(e)) from None
    if not degrees:  # no readable plan: the loader names that problem when the run opens the shards
        return
    try:
        check_model_support(hf_config, max(longest) if longest else 0, sorted(degrees), cfg.model.attention_backend)
    except UserError as e:
        raise ConfigError(str(e)) from None


def check_levers(cfg: HBPConfig) -> None:
    """ConfigError (one line) when data.shards' groups ask for a memory lever this run cannot honour exactly: offload
    without checkpointed layers, or a tiled MLP this model cannot run (model/levers.py); from the plan's groups and
    the model's config (no weights), before any worker starts (build_run checks it again)."""
    from hbp_train.build import ckpt_layers_for
    from hbp_train.model.hf_model import hf_config_for
    from hbp_train.model.levers import check_plan_levers

    groups = _planned_groups(cfg.data.shards) if cfg.data.shards is not None else None
    if not groups:
        return
    ckpt = [ckpt_layers_for(cfg.train.ckpt_layers, g, group.get("ckpt_layers")) for g, group in enumerate(groups)]
    try:
        check_plan_levers(hf_config_for(cfg.model), groups, ckpt, cfg.model.kernels, f"data.shards={cfg.data.shards}")
    except UserError as e:
        raise ConfigError(str(e)) from None


def check_zero_stage(cfg: HBPConfig) -> None:
    """ConfigError (one line) when data.shards' plan was made for another ZeRO stage than deepspeed.zero_stage: the
    profiler chose its groups' SP degrees, checkpointing and levers for that stage's memory (``zero_stage`` in
    plan.json, written by hbp-pack from the profile or --zero-stage), so another stage may not fit or may be slower.
    A plan that names no stage is not checked."""
    stage = _plan_header(cfg.data.shards).get("zero_stage")
    if stage is not None and stage != cfg.deepspeed.zero_stage:
        raise ConfigError(f"data.shards={cfg.data.shards}: its plan was made for ZeRO-{stage} (plan.json zero_stage), "
                          f"not deepspeed.zero_stage={cfg.deepspeed.zero_stage}: set deepspeed.zero_stage={stage}, or "
                          f"plan for stage {cfg.deepspeed.zero_stage} (hbp-profile profile.zero_stages="
                          f"[{cfg.deepspeed.zero_stage}], then hbp-pack)")


def _planned_sp_degrees(shards: str) -> list | None:
    """The SP degrees of a packed-shards folder's groups (``_planned_groups``), or None."""
    groups = _planned_groups(shards)
    try:
        return sorted({int(g.get("sp", 1)) for g in groups}) if groups else None
    except (TypeError, ValueError):
        return None


def _planned_groups(shards: str) -> list | None:
    """The groups of a packed-shards folder's plan (its dicts, ``_plan_header``), or None without a readable plan:
    the loader names that problem when the run opens the shards."""
    groups = _plan_header(shards).get("groups")
    return groups if isinstance(groups, list) and all(isinstance(g, dict) for g in groups) else None


def _plan_header(shards: str | None) -> dict:
    """The "world_size", "groups", "max_len" (its longest sample) and "zero_stage" of a packed-shards folder's plan,
    without reading its steps: plan.npz's JSON header, or the head of plan.json (written before the steps; the whole
    file only when they are not in its first 64 KB) and its tail (zero_stage is among the last keys). {} when there
    is no readable plan: the loader names that problem when the run opens the shards."""
    import json

    if shards is None:
        return {}
    folder = Path(shards)
    try:
        if (folder / "plan.npz").is_file():
            from hbp_train.planning.plan_npz import open_npz

            header = open_npz(folder / "plan.npz", mmap=True)[0]
            out = {k: header.get(k) for k in ("world_size", "groups", "max_len")}
            out["zero_stage"] = (header.get("extra") or {}).get("zero_stage")
        else:
            with open(folder / "plan.json", "rb") as f:
                head = f.read(1 << 16).decode("utf-8", errors="ignore")
                f.seek(max(0, f.seek(0, 2) - (1 << 16)))
                tail = f.read().decode("utf-8", errors="ignore")
            out = {key: _json_value(head, key) for key in ("world_size", "groups", "max_len")}
            if None in out.values():
                whole = json.loads((folder / "plan.json").read_text())
                out = {k: whole.get(k) for k in out}
            out["zero_stage"] = _json_value(tail, "zero_stage", last=True)
        if out["zero_stage"] is not None:
            out["zero_stage"] = int(out["zero_stage"])
        return out
    except (OSError, ValueError, TypeError, AttributeError, UserError):
        return {}


def _json_value(text: str, key: str, last: bool = False):
    """The JSON value of ``"key":`` in ``text`` (its first occurrence, or its last), or None: absent, or cut off."""
    import json

    at = text.rfind(f'"{key}":') if last else text.find(f'"{key}":')
    if at < 0:
        return None
    try:
        return json.JSONDecoder().raw_decode(text[at + len(key) + 3:].lstrip())[0]
    except ValueError:
        return None


def _section_fields() -> dict:
    """{section: [field, ...]} of HBPConfig (the keys an override may set)."""
    out = {}
    for section in fields(HBPConfig):
        cls = section.type if isinstance(section.type, type) else globals()[section.type]
        out[section.name] = [f.name for f in fields(cls)]
    return out


def _field_named_like(name: str) -> str | None:
    """The dotted field whose own name is ``name`` or closest to it (max_steps, maxsteps -> train.max_steps)."""
    by_field = {f: f"{s}.{f}" for s, names in _section_fields().items() for f in names}
    close = difflib.get_close_matches(name, list(by_field), n=1)
    return by_field[close[0]] if close else None


def check_override_key(override: str) -> None:
    """ConfigError naming a misspelt key and the closest real one ("did you mean train.out_dir?").

    Checked before Hydra sees the override: Hydra's own message names no alternative, and ``+section.key=...``
    would otherwise add a key that no code reads, silently ignoring the setting."""
    key = override.split("=", 1)[0].lstrip("+~")
    if "=" not in override or not key or "@" in key or "/" in key:
        return  # not a key=value override (Hydra reports it), or a package/group path this check does not model
    sections = _section_fields()
    groups = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())
    head, _, rest = key.partition(".")
    if head not in sections:
        if not rest and head in groups:
            return  # a config group choice such as experiment=cpu_demo
        dotted = [f"{s}.{f}" for s, names in sections.items() for f in names]
        close = difflib.get_close_matches(key, dotted + sorted(set(sections) | set(groups)), n=1)
        close = close or [field for field in [_field_named_like(key)] if field]
        hint = f"did you mean {close[0]}?" if close else f"sections: {', '.join(sections)}; groups: {', '.join(groups)}"
        raise ConfigError(f"{key}: no such config section, group or field; {hint} "
                          f"(python -m hbp_train.train --help lists every field)")
    name = rest.split(".", 1)[0]
    if rest and name not in sections[head]:
        close = difflib.get_close_matches(name, sections[head], n=1)
        hint = f"did you mean {head}.{close[0]}?" if close else f"{head} has: {', '.join(sections[head])}"
        raise ConfigError(f"{head}.{name}: no such field in {head}; {hint}")


def _hydra_error_line(e: Exception) -> str:
    lines = [line.strip() for line in str(e).splitlines() if line.strip()]
    cause = e.__cause__ if isinstance(e.__cause__, OmegaConfBaseException) else None
    if cause is not None:
        return _one_line(cause) + (f" ({lines[0]})" if lines else "")
    key = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("full_key:")), None)
    text = " ".join(line for line in lines if not line.startswith(("full_key:", "object_type", "reference_type")))
    text = text.split(" Config search path:")[0]
    return f"{key}: {text}" if key else text


def resolved_yaml(cfg: HBPConfig) -> str:
    """The resolved config as YAML (saved into the run dir and every checkpoint)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


# Hydra's own command-line flags (hydra/_internal/utils.py get_args_parser), and those of them that take a value.
HYDRA_FLAGS = {"-h", "--help", "--hydra-help", "--version", "-c", "--cfg", "--resolve", "-p", "--package", "-r",
               "--run", "-m", "--multirun", "-sc", "--shell-completion", "-cp", "--config-path", "-cn",
               "--config-name", "-cd", "--config-dir", "--experimental-rerun", "-i", "--info"}
HYDRA_VALUE_FLAGS = {"-c", "--cfg", "-p", "--package", "-sc", "--shell-completion", "-cp", "--config-path", "-cn",
                     "--config-name", "-cd", "--config-dir", "--experimental-rerun"}


def check_command_line(argv: list) -> None:
    """ConfigError for what is neither a Hydra flag nor a KEY=VALUE override, e.g. ``--max-steps 3`` (Hydra would
    answer with a parser exception); names the override meant when a field matches."""
    expect_value = False
    for arg in argv:
        if expect_value:
            expect_value = False
            continue
        flag = arg.split("=", 1)[0]
        if arg.startswith("-") and flag in HYDRA_FLAGS:
            expect_value = flag in HYDRA_VALUE_FLAGS and "=" not in arg
            continue
        if arg.startswith("-") or ("=" not in arg and not arg.startswith("~")):
            field = _field_named_like(flag.lstrip("-").replace("-", "_"))
            example = f"{field}=VALUE" if field else "train.max_steps=3"
            raise ConfigError(f"{arg}: training takes Hydra overrides KEY=VALUE, not options (e.g. {example}); "
                              "python -m hbp_train.train --help lists every field")


def user_overrides(argv: list) -> list:
    """The Hydra overrides of a command line (no flags such as --cfg or -m; no hydra.* settings)."""
    return [a for a in argv if not a.startswith("-") and not a.lstrip("+~").startswith("hydra.")]


def field_docs(cls) -> dict:
    """{field: docstring} of a config dataclass, read from the string literal under each field in its source."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if isinstance(node, ast.AnnAssign) and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant):
            docs[node.target.id] = " ".join(str(nxt.value.value).split())
    return docs


def help_text(prog: str = "python -m hbp_train.train") -> str:
    """Usage, the conf/ groups and their options, and every field with its default and docstring."""
    defaults = OmegaConf.to_container(compose(), resolve=False)
    lines = [f"usage: {prog} [experiment=NAME] [GROUP=OPTION ...] [SECTION.FIELD=VALUE ...]", "",
             "Fine-tune a causal LM on packed shards (data_tools.pack --shards) with DeepSpeed. Launch with torchrun",
             "or ./launch.sh train (NPROC processes); a bad value exits 2 with one line naming the field.",
             "Hydra flags work too: --cfg job (print the composed config), --hydra-help.", "", "config groups:"]
    for group in sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir()):
        options = sorted(f.stem for f in (CONF_DIR / group).glob("*.yaml"))
        lines.append(f"  {group:<11} {', '.join(options)}")
    for section in fields(HBPConfig):
        cls = section.type if isinstance(section.type, type) else globals()[section.type]
        lines += ["", f"{section.name}: {' '.join((cls.__doc__ or '').split())}"]
        for name, doc in field_docs(cls).items():
            default = defaults.get(section.name, {}).get(name)
            lines.append(f"  {section.name}.{name} = {default!r}\n      {doc}")
    return "\n".join(lines)


def main(argv: list | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print("usage: python -m hbp_train.config [OVERRIDES...]\n\nCompose conf/config.yaml with Hydra overrides "
              "(e.g. experiment=cpu_demo train.lr=1e-4), check every value and input path, print the resolved YAML.\n"
              "Exit 2 with one line naming the field on a bad value.")
        return 0
    try:
        cfg = load(user_overrides(argv))
        check_paths(cfg)
    except UserError as e:
        print(f"config error: {e}", file=sys.stderr)
        return EXIT_USER_ERROR
    print(resolved_yaml(cfg), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
