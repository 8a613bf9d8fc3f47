"""The packing groups a plan is made with, and the ZeRO stage it records (data_tools/pack.py's --groups, --profile
and --zero-stage): groups written by hand (pack_len:sp[:ckpt_layers[:levers]]) or chosen by the profiler
(hbp_train.profiler's profile.json, its levers and its ZeRO stage), each checked with a one-line error."""

from __future__ import annotations

import json
from pathlib import Path

from hbp_train.common.errors import UserError

# Packed shards hold token positions and cu_seqlens as int32.
MAX_PACK_LEN = 2**31 - 1


class CliError(UserError):
    """A user mistake in the command line or its input files: printed as one line, exit code 2."""


# The names of the memory levers in --groups' 4th field, and the GroupSpec field each one sets.
LEVER_NAMES = {"tiled_mlp": "tiled_mlp", "offload": "offload_activations"}


def parse_levers(text: str, part: str) -> dict:
    """The GroupSpec lever fields of --groups' 4th field: names joined by '+' (tiled_mlp, offload), '-' for none."""
    on = set()
    for name in ([] if text.strip() in ("-", "") else text.split("+")):
        if name.strip() not in LEVER_NAMES:
            raise CliError(f"--groups {part!r}: unknown memory lever {name.strip()!r} (levers: "
                           f"{', '.join(LEVER_NAMES)}, joined by '+', or '-' for none)")
        on.add(LEVER_NAMES[name.strip()])
    return {field: field in on for field in LEVER_NAMES.values()}


def parse_groups(text: str, profile: str | None, world_size: int):
    """GroupSpecs from 'len:sp[:ckpt[:levers]],...' or the profiler file; CliError with the fix on bad input."""
    from hbp_train.planning import GroupSpec
    from hbp_train.planning.plan import LEVER_KEYS

    if text == "auto":
        if not profile:
            raise CliError("--groups auto needs --profile FILE (the profiler's JSON)")
        try:
            data = json.loads(Path(profile).read_text())
        except FileNotFoundError:
            raise CliError(f"--profile {profile}: no such file") from None
        except json.JSONDecodeError as e:
            raise CliError(f"--profile {profile}:{e.lineno}: not valid JSON ({e.msg})") from None
        except UnicodeDecodeError:
            raise CliError(f"--profile {profile}: not UTF-8 text; pass the profiler's profile.json") from None
        except OSError as e:  # a directory, no permission
            raise CliError(f"--profile {profile}: {e.strerror}; pass the profiler's profile.json") from None
        if not isinstance(data, dict) or not isinstance(data.get("groups"), list) or not data["groups"]:
            raise CliError(f"--profile {profile}: missing key 'groups' (a list of {{pack_len, sp, ckpt_layers}})")
        check_profile_world_size(data, profile, world_size)
        items = []
        for i, g in enumerate(data["groups"]):
            if not isinstance(g, dict) or "pack_len" not in g or "sp" not in g:
                raise CliError(f"--profile {profile}: groups[{i}] needs 'pack_len' and 'sp'")
            levers = {k: g.get(k, False) for k in LEVER_KEYS}
            items.append((g["pack_len"], g["sp"], g.get("ckpt_layers"), levers, f"--profile {profile}: groups[{i}]"))
    else:
        items = []
        for part in text.split(","):
            fields = part.strip().split(":")
            numbers = fields[:3]
            if (len(fields) not in (2, 3, 4) or not all(x.strip().lstrip("-").isdigit() for x in numbers)):
                raise CliError(f"--groups: {part.strip()!r} is not pack_len:sp, pack_len:sp:ckpt_layers or "
                               "pack_len:sp:ckpt_layers:levers (e.g. 16384:1,131072:8:32:tiled_mlp+offload)")
            vals = [int(x) for x in numbers]
            levers = parse_levers(fields[3] if len(fields) == 4 else "-", part.strip())
            items.append((vals[0], vals[1], vals[2] if len(vals) >= 3 else None, levers, f"--groups {part.strip()!r}"))
    groups = []
    for pack_len, sp, ckpt, levers, where in items:
        if not isinstance(pack_len, int) or isinstance(pack_len, bool) or pack_len < 1:
            raise CliError(f"{where}: pack_len must be a positive integer")
        if pack_len > MAX_PACK_LEN:  # packed shards hold token positions and cu_seqlens as int32
            raise CliError(f"{where}: pack_len {pack_len} is larger than {MAX_PACK_LEN} (int32 token offsets)")
        if not isinstance(sp, int) or isinstance(sp, bool) or sp < 1 or sp & (sp - 1):
            raise CliError(f"{where}: sp={sp} must be a power of two (1, 2, 4, ...)")
        if world_size % sp:
            raise CliError(f"{where}: sp={sp} must divide --world-size {world_size}")
        if ckpt is not None and (not isinstance(ckpt, int) or isinstance(ckpt, bool) or ckpt < 0):
            raise CliError(f"{where}: ckpt_layers must be a non-negative integer")
        if any(not isinstance(v, bool) for v in levers.values()):
            raise CliError(f"{where}: {', '.join(LEVER_KEYS)} must be true or false")
        if levers["offload_activations"] and ckpt == 0:
            raise CliError(f"{where}: offload needs checkpointed layers (it moves the hidden states they keep to "
                           "host memory): give ckpt_layers > 0, or drop offload")
        groups.append(GroupSpec(pack_len, sp, ckpt, **levers))
    lens = [g.pack_len for g in groups]
    if any(b <= a for a, b in zip(lens, lens[1:])):
        raise CliError(f"--groups: pack lengths must be strictly ascending, got {lens}")
    return groups


def planned_zero_stage(args) -> int | None:
    """The ZeRO stage the plan records: the profile's chosen one with --groups auto (``zero_stage``; a profile made
    before the profiler chose stages names none), else --zero-stage; CliError when both are given and differ."""
    stage = None
    if args.groups == "auto" and args.profile:
        data = json.loads(Path(args.profile).read_text())  # parse_groups read it already: valid JSON
        stage = data.get("zero_stage")
    if stage is not None and args.zero_stage is not None and int(stage) != args.zero_stage:
        raise CliError(f"--zero-stage {args.zero_stage}: --profile {args.profile} chose its groups for ZeRO-{stage}; "
                       f"drop --zero-stage, or profile again with profile.zero_stages=[{args.zero_stage}]")
    return int(stage) if stage is not None else args.zero_stage


def check_profile_world_size(profile_data: dict, profile: str, world_size: int) -> None:
    """CliError when the profile was made for another world size: its SP degrees and checkpoint counts were chosen
    for the memory ZeRO leaves on that many ranks, so they do not carry over. Profiles that do not record a world
    size (hand-written ones) are not checked."""
    job = profile_data.get("job") if isinstance(profile_data.get("job"), dict) else {}
    config = profile_data.get("config") if isinstance(profile_data.get("config"), dict) else {}
    made_for = job.get("world_size", config.get("world_size"))
    if made_for is None or made_for == world_size:
        return
    raise CliError(f"--profile {profile}: made for world size {made_for}, but --world-size is {world_size}; re-run "
                   f"the profiler with profile.world_size={world_size} (python -m hbp_train.profiler "
                   f"profile.world_size={world_size} ...) or pass --world-size {made_for}")
