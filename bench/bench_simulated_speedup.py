"""SIMULATED speed-up of every planning strategy over isf on a 1M-sample long-tailed mix (cost model, no GPU).

    python bench/bench_simulated_speedup.py [--num-samples 1000000] [--plot bench_simulated_speedup.png]

The mix is bench/bench_planner.py's ``long_tailed_lengths``: 95% chat-like samples (lognormal, median 600, clipped
to [16, 32768]) and 5% long documents (log-uniform 8K-128K), seeded. Planned at max_len 128K, W=32, groups 16384:1,131072:8 (hbp; the single-group strategies use 131072:8),
4M tokens per step, and simulated with the shipped H100 Llama-3-8B calibration (hbp_train/cost_model.py,
docs/simulator.md). Prints one row per strategy and the speed-up over isf measured in this same run.
The paper measured 1.40x for hbp over isf on Llama-3.1-8B (real training); these figures are predictions.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.bench_planner import long_tailed_lengths  # noqa: E402  (the planner bench's mix: same data)
from data_tools.compare import COLUMNS, STRATEGIES, compare_strategies  # noqa: E402
from data_tools.simulate import format_table  # noqa: E402
from hbp_train.cost_model import CostModel  # noqa: E402
from hbp_train.planning import GroupSpec  # noqa: E402
from hbp_train.planning.simulate import SimConfig, plot_comparison  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-samples", type=int, default=1_000_000, help="samples in the mix (default 1000000)")
    p.add_argument("--seed", type=int, default=0, help="seed of the mix and of planning (default 0)")
    p.add_argument("--ckpt-layers", type=int, default=0,
                   help="checkpointed layers in both groups (default 0; the plan's groups get this value)")
    p.add_argument("--plot", default="bench_simulated_speedup.png", help="output PNG")
    args = p.parse_args()
    t0 = time.perf_counter()
    lengths = long_tailed_lengths(args.num_samples, args.seed)
    tokens = int(lengths.sum())
    print(f"mix: {len(lengths)} samples, {tokens / 1e9:.2f}G tokens (bench_planner.long_tailed_lengths); "
          f"p50 {int(np.median(lengths))}, share of tokens in samples > 16K "
          f"{lengths[lengths > 16384].sum() / tokens:.2f} ({time.perf_counter() - t0:.1f}s)")
    model = CostModel.from_calibration()
    sim = SimConfig(ckpt_layers=args.ckpt_layers)
    groups = [GroupSpec(16384, 1, args.ckpt_layers), GroupSpec(131072, 8, args.ckpt_layers)]
    plan_kwargs = dict(world_size=32, groups=groups, global_tokens=4 * 1024 * 1024, max_len=131072, seed=args.seed)
    t0 = time.perf_counter()
    rows, out = compare_strategies(lengths, plan_kwargs, model, sim, STRATEGIES)
    print(f"SIMULATED ({model.source} cost model: {model.note}; links {sim.intra_node_gbps:g}/"
          f"{sim.inter_node_gbps:g} GB/s intra/inter; ckpt_layers {args.ckpt_layers}), all strategies in "
          f"{time.perf_counter() - t0:.0f}s:")
    print(format_table(rows, COLUMNS))
    by_name = {r["name"]: r for r in rows}
    print(f"simulated speed-up of hbp over isf: {by_name['hbp']['speedup']:.3f}x "
          f"(hbp-cost {by_name['hbp-cost']['speedup']:.3f}x; target >= 1.45x; paper, measured: 1.40x)")
    names = list(out)
    plot_comparison(names, [out[n][1] for n in names], args.plot,
                    f"{len(lengths)} samples, W=32, 16K:sp1 + 128K:sp8, Llama-3-8B H100 calibration")
    print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
