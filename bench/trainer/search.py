"""Part of bench/trainer/bench_trainer.py: the longest single pack our path trains, with the fewest checkpointed layers
that fit (an out-of-memory error rebuilds the engine and tries the next checkpoint level)."""

from __future__ import annotations

import sys
import time

from bench.trainer.paths import destroy_ours, ours_step, release
from bench.trainer.workload import make_packs, pack_row
from hbp_train.common.errors import UserError

TARGET_PACK = 131072  # issue #5: a 128K pack for a 1B shape


def ckpt_levels(spec, num_layers: int) -> list[int]:
    if spec:
        try:
            levels = sorted({int(x) for x in spec.split(",")})
        except ValueError:
            raise UserError(f"--ckpt-levels {spec!r}: comma-separated integers") from None
        if levels[0] < 0 or levels[-1] > num_layers:
            raise UserError(f"--ckpt-levels {spec!r}: each must be in [0, {num_layers}] (the model's layers)")
        return levels
    return sorted({0, num_layers // 4, num_layers // 2, 3 * num_layers // 4, num_layers})


def search_lengths(pack_len: int, max_len: int) -> list[int]:
    lengths, length = [], pack_len
    while length <= max_len:
        lengths.append(length)
        length *= 2
    if lengths and lengths[-1] < max_len:
        lengths.append(max_len)
    return lengths


def pack_search(args, run, rebuild, hf_config, device, peak_flops, first: dict | None,
                on_attempt=lambda partial: None) -> tuple:
    """The longest single pack our path trains, with the fewest checkpointed layers (of the levels) that fit.

    Returns (result dict, the run in use): an OOM destroys the engine (its ZeRO buffers may be half-way through a
    backward) and builds a fresh one. on_attempt(partial result) runs after every attempt. No attempt starts that the
    last one's seconds (its steps and any rebuild) would carry past --search-budget-s, and a search stopped from
    outside (a time limit) destroys the engine it holds before the stop goes on.
    """
    holding = [run]  # the engine the search holds now (None between a destroy and the next build): the only reference
    del run  # (one held in this frame would keep a destroyed engine's weights on the GPU for the rest of the search)
    try:
        return _search(args, holding, rebuild, hf_config, device, peak_flops, first, on_attempt)
    except BaseException:
        destroy_ours(holding[0])
        holding.clear()
        raise


def _search(args, holding: list, rebuild, hf_config, device, peak_flops, first, on_attempt) -> tuple:
    from tqdm import tqdm

    from hbp_train.batches.collate import collate_pack
    from hbp_train.perf.flops import pack_flops
    from hbp_train.perf.shape import parse_model_shape
    from hbp_train.observe.telemetry import is_oom, peak_memory_gib, reset_peak_memory

    run = holding[0]
    num_layers = run.model.config.num_hidden_layers
    levels = ckpt_levels(args.ckpt_levels, num_layers)
    level_index = 0
    attempts = [first] if first else []
    if first:  # the comparison's step at --pack-len: go on from its level (the next one up if it ran out of memory)
        above = first["ckpt_layers"] + (0 if first["ok"] else 1)
        level_index = next((i for i, c in enumerate(levels) if c >= above), len(levels))
    lengths = [n for n in search_lengths(args.pack_len, args.max_pack_search)
               if not (first and first["ok"] and n == first["pack_len"])]
    start, skipped, longest = time.perf_counter(), [], (first if first and first["ok"] else None)
    last_cost = 0.0  # seconds the last attempt took, its rebuild included: the next one takes at least as long
    bar = tqdm(total=len(lengths), desc="pack search", unit="len", file=sys.stderr, leave=False)
    for length in lengths:
        batch = collate_pack(pack_row(make_packs(length, 1, hf_config["vocab_size"], args.seed + length,
                                                 args.prompt_frac, args.search_docs)[0]), check_counts=False)
        fitted = False
        while level_index < len(levels):
            began = time.perf_counter()
            if began - start + last_cost > args.search_budget_s:
                skipped.append({"pack_len": length, "ckpt_layers": levels[level_index], "why": "search budget"})
                break
            ckpt = levels[level_index]
            attempt = {"pack_len": length, "ckpt_layers": ckpt, "docs": args.search_docs, "ok": False, "oom": False,
                       "device": device_info_name(device)}
            reset_peak_memory()
            try:
                for s in range(args.search_steps):
                    seconds, loss = ours_step(run, batch, 20_000 + s, ckpt)
                flops = pack_flops(parse_model_shape(run.model.config), batch["seq_lens"])
                attempt.update(ok=True, step_time_s=seconds, tokens_per_s=length / seconds, loss=loss,
                               mfu=flops / (seconds * peak_flops) if peak_flops else None,
                               peak_mem_gib=peak_memory_gib())
            except Exception as exc:  # noqa: BLE001 - an OOM is a result here; anything else ends the search
                if not is_oom(exc):
                    attempt["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    attempts.append(attempt)
                    on_attempt(finish_search(attempts, skipped, longest, args, levels))
                    bar.close()
                    return finish_search(attempts, skipped, longest, args, levels, stopped=attempt["error"]), run
                attempt.update(oom=True, peak_mem_gib=peak_memory_gib())
            attempts.append(attempt)
            if attempt["ok"]:
                fitted, longest = True, attempt
            on_attempt(finish_search(attempts, skipped, longest, args, levels))
            last_cost = time.perf_counter() - began
            if fitted:
                break
            destroy_ours(run)
            run = holding[0] = None
            release(device)
            level_index += 1
            if level_index < len(levels):
                run = holding[0] = rebuild()
            last_cost = time.perf_counter() - began
        bar.update(1)
        if not fitted:
            break
    bar.close()
    return finish_search(attempts, skipped, longest, args, levels), run


def finish_search(attempts, skipped, longest, args, levels, stopped=None) -> dict:
    return {"docs": args.search_docs, "ckpt_levels": levels, "max_pack_search": args.max_pack_search,
            "attempts": attempts, "skipped": skipped, "stopped_by_error": stopped,
            "longest_ok": longest["pack_len"] if longest else None,
            "ckpt_layers_needed": longest["ckpt_layers"] if longest else None,
            "goal": TARGET_PACK, "goal_met": bool(longest and longest["pack_len"] >= TARGET_PACK)}


def device_info_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
