"""The profiler's text report: every measurement, the chosen groups, what was skipped and why.

Reads only the profile dict that `Profiler.run` returns (the content of profile.json), so a saved profile can be
printed again.
"""

from __future__ import annotations

GIB = 1024 ** 3


def throughput_unit(profile: dict) -> str:
    """What one rank of the profiled job is: a GPU, or on the CPU (profile.device=cpu) a process."""
    on_cpu = (profile.get("config") or {}).get("device") == "cpu" or \
        (profile.get("hardware") or {}).get("backend") == "cpu"
    return "proc" if on_cpu else "GPU"


def format_table(profile: dict) -> str:
    """Every measurement, then the chosen groups, as a fixed-width text table."""
    budget = profile["memory_budget_bytes"]
    unit = throughput_unit(profile)
    rows = [f"{'pack_len':>9} {'sp':>3} {'ckpt':>4} {'levers':<8} {'purpose':<10} {'time ms':>9} "
            f"{f'tok/s/{unit}':>10} {'peak GiB':>8} {'nvml GiB':>8} {'status':<11} source"]
    for m in profile["measurements"]:
        mem = m["nvml_used_bytes"] if (profile.get("memory_metric") == "nvml" and m["nvml_used_bytes"]) \
            else m["peak_mem_bytes"]
        status = "OOM" if m["oom"] else ("over budget" if mem is None or mem > budget else "ok")
        tps = m["pack_len"] / (m["time_s"] * m["sp"]) if m["time_s"] else None
        source = _source(m)
        rows.append(f"{m['pack_len']:>9} {m['sp']:>3} {m['ckpt_layers']:>4} {levers_label(m):<8} {m['purpose']:<10} "
                    f"{_fmt(m['time_s'], 1e3, '.1f'):>9} {_fmt(tps, 1, ',.0f'):>10} "
                    f"{_fmt(m['peak_mem_bytes'], 1 / GIB, '.1f'):>8} {_fmt(m['nvml_used_bytes'], 1 / GIB, '.1f'):>8} "
                    f"{status:<11} {source}")
    rows.append("")
    label = " (ANALYTIC ESTIMATE, nothing measured)" if profile["source"] == "analytic" else ""
    zero = f", {profile['zero']['name']}" if profile.get("zero") else ""
    rows.append(f"chosen groups{label}: l_best={profile['l_best']} l_max={profile['l_max']}{zero}")
    for g in profile["groups"]:
        flags = (" estimated" if g["estimated"] else (" measured" if g["source"] in ("gpu", "cpu") else "")) + \
            (f" [{g['source']}]" if g["source"] != "gpu" else "")
        levers = f" levers={levers_label(g)}" if levers_label(g) != "-" else ""
        rows.append(f"  pack_len={g['pack_len']:>7} sp={g['sp']} ckpt_layers={g['ckpt_layers']:<3}{levers} "
                    f"tok/s/{unit}={_fmt(g['tokens_per_s_per_gpu'], 1, ',.0f')}  ({g['role']}){flags}")
    for z in profile.get("zero_candidates", []):
        per_token = sum(z["seconds_per_token"].values())
        rows.append(f"  {z['name']:<36} longest {z['l_max'] or '-':>7}  "
                    f"{per_token * 1e6:,.1f} µs/token summed over {len(z['seconds_per_token'])} lengths"
                    + ("  <- chosen" if z["name"] == profile["zero"]["name"] else ""))
    for s in profile["skipped"]:
        rows.append(f"skipped: {s}")
    for w in profile["warnings"]:
        rows.append(f"warning: {w}")
    p = profile["profiler"]
    for run in p.get("sp_runs", []):
        rows.append(f"sp={run['sp']}: {run['status']} on {run['ranks']} ranks (one torchrun, {run['attempts']} "
                    f"start(s), {run['measured']} points, {run['wall_s']:.1f} s); log: {run['log']}")
    if "measured" in p:
        rows.append(f"points: {p['measured']} measured, {p['estimated']} estimated from a 1-{unit} slice")
    rows.append(f"profiler: {p['num_measurements']} measurements, {p['wall_s']:.1f} s "
                f"(budget {p['time_budget_s']:g} s{', exhausted' if p['budget_exhausted'] else ''})")
    if "predicted_gpu_measure_s" in p:
        rows.append(f"predicted GPU measuring time for this profile: {p['predicted_gpu_measure_s']:.0f} s "
                    "(timed iterations only)")
    return "\n".join(rows)


def levers_label(row: dict) -> str:
    """A configuration's memory levers as hbp-pack's --groups 4th field writes them ("tiled_mlp+offload"), or "-"."""
    names = [n for k, n in (("tiled_mlp", "tiled_mlp"), ("offload_activations", "offload")) if row.get(k)]
    return "+".join(names) or "-"


def _source(m: dict) -> str:
    """Where a row's numbers come from: measured (on how many ranks) or estimated; analytic/curve as they are."""
    if m["estimated"]:
        return f"{m['source']} estimated"
    if m["source"] in ("gpu", "cpu"):
        ranks = m.get("ranks", 1)
        return f"{m['source']} measured" + (f" on {ranks} ranks" if ranks > 1 else "")
    return m["source"]


def _fmt(value, scale, spec) -> str:
    return "-" if value is None else format(value * scale, spec)
