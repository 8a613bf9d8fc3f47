"""Every planning strategy on the same lengths: each planned, then simulated with the cost model; the rows
data_tools.compare prints, with the speed-up over isf and over the best baseline users run (the fastest of isf,
bfd, sorted, kk and kk-cost in the same run). bench/bench_simulated_speedup.py calls the same functions."""

from __future__ import annotations

import time
from dataclasses import replace

import numpy as np

from data_tools.simulation.tables import comm_columns


STRATEGIES = ("isf", "bfd", "sorted", "kk", "kk-cost", "hbp", "hbp-cost", "wlb", "bytescale")

COLUMNS = [("name", "strategy", "s"), ("ABR", "ABR", ".4f"), ("DBR", "DBR", ".4f"), ("PR", "PR", ".4f"),
           ("CR", "CR", ".3f"), ("num_steps", "steps", "d"), ("num_slots", "slots", "d"), ("planning_seconds", "plan s", ".2f"),
           ("mean_deferred_wait_steps", "wait", ".2f"), ("sync", "sync", "s"),
           ("simulated_seconds", "sim time", "time"), ("idle_fraction", "idle", ".3f"),
           ("speedup", "speed-up", ".3f"), ("speedup_best", "vs best", ".3f")]

# The single-group baselines users actually run (naive packing, TRL/ms-swift best fit, LongAlign sorting, veRL's
# Karmarkar-Karp balancing, also on the cost model): every comparison reports hbp against the fastest of those
# present as well as against isf.
BASELINES = ("isf", "bfd", "sorted", "kk", "kk-cost")


def compare_strategies(lengths: np.ndarray, plan_kwargs: dict, model, sim_config, strategies=STRATEGIES,
                       progress: bool = True) -> tuple[list[dict], dict]:
    """Plan and simulate ``lengths`` with every strategy. Returns (rows, {name: (plan, SimResult)}).

    ``plan_kwargs``: PlanConfig fields except strategy and pack_cost. The speed-up is over isf when it is among
    the strategies, else over the first one; ``speedup_best`` is over the best baseline (``best_baseline``).
    """
    plans = plan_strategies(lengths, plan_kwargs, model, sim_config, strategies, progress)
    return simulate_strategies(plans, model, sim_config)


def plan_strategies(lengths: np.ndarray, plan_kwargs: dict, model, sim_config, strategies=STRATEGIES,
                    progress: bool = True) -> dict:
    """Plan ``lengths`` with every strategy: {name: (plan, planning seconds)}. The cost-balancing strategies use
    the cost model with ``sim_config``'s links and checkpoint default (not its communication model)."""
    from tqdm import tqdm

    from hbp_train.perf.cost_model import pack_cost_fn
    from hbp_train.planning import PlanConfig, make_plan

    cost = pack_cost_fn(model, sim_config.ckpt_layers, sim_config.intra_node_gbps, sim_config.inter_node_gbps,
                        sim_config.gpus_per_node)
    out = {}
    for name in tqdm(strategies, desc="strategies", disable=None if progress else True):  # None: none in a log file
        strategy = name.removesuffix("-cost")
        # wlb and bytescale balance a workload; give them (and the -cost variants) the cost model the simulator uses.
        use_cost = name.endswith("-cost") or name in ("wlb", "bytescale")
        cfg = PlanConfig(strategy=strategy, pack_cost=cost if use_cost else None, **plan_kwargs)
        t0 = time.perf_counter()
        plan = make_plan(lengths, cfg)
        out[name] = (plan, time.perf_counter() - t0)
    return out


def simulate_strategies(plans: dict, model, sim_config) -> tuple[list[dict], dict]:
    """Simulate plan_strategies' plans under ``sim_config``: (rows, {name: (plan, SimResult)}).

    Without a ZeRO stage the sync follows the plan (step for bytescale's unequal micro-batch counts, else micro).
    With stage 2 or 3, bytescale plans (which may only run with ZeRO 0/1) are simulated at stage 1 and their row
    says so (``zero_stage``).
    """
    from hbp_train.planning.simulator import simulate, speedup

    out, stages = {}, {}
    for name, (plan, planning) in plans.items():
        stage = sim_config.zero_stage
        if stage is not None and stage >= 2 and plan.unequal_micro_batches:
            stage = 1
        res = simulate(plan, model, replace(sim_config, sync=None, zero_stage=stage))
        res.extra["planning_seconds"] = planning
        out[name], stages[name] = (plan, res), stage
    base = out["isf"][1] if "isf" in out else next(iter(out.values()))[1]
    best = best_baseline(out)
    rows = []
    for name, (plan, res) in out.items():
        m = plan.metrics
        rows.append({"name": name, **{k: m.get(k) for k in ("ABR", "DBR", "PR", "CR", "num_dropped")},
                     "mean_deferred_wait_steps": m.get("mean_deferred_wait_steps") if plan.deferred else None,
                     "num_deferred": m.get("num_deferred", 0), **res.summary(), "zero_stage": stages[name],
                     "speedup": speedup(base, res),
                     "speedup_best": speedup(out[best][1], res) if best else None,
                     "best_baseline": best})
    return rows, out


def best_baseline(results: dict) -> str | None:
    """Name of the fastest (simulated tokens/s) of the BASELINES among ``results`` ({name: (plan, SimResult)});
    None if there is none."""
    present = [n for n in BASELINES if n in results]
    if not present:
        return None
    return max(present, key=lambda n: results[n][1].summary()["simulated_tokens_per_second"])


def best_baseline_line(rows: list[dict]) -> str:
    """One line: hbp's simulated speed-up over isf and over the best baseline of this run (named)."""
    by = {r["name"]: r for r in rows}
    if "hbp" not in by or not by["hbp"].get("best_baseline"):
        return "no hbp row or no baseline (isf, bfd, sorted) to compare with"
    hbp = by["hbp"]
    return (f"hbp over isf {hbp['speedup']:.3f}x; over the best baseline ({hbp['best_baseline']}) "
            f"{hbp['speedup_best']:.3f}x")


def table_columns(sim_config) -> list[tuple[str, str, str]]:
    """COLUMNS, with the communication columns before the simulated time when a ZeRO stage is modelled."""
    at = [k for k, _, _ in COLUMNS].index("simulated_seconds")
    return COLUMNS[:at] + comm_columns(sim_config) + COLUMNS[at:]
