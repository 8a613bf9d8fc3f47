"""Which differences bench/speed/bench_speed.py's figures may claim: the rules docs/benchmarks.md's measured table is
marked by (bench/speed/results_table.py renders it; pure arithmetic on the results file's runs).

Speed, paired by round. In round r every strategy ran beside isf with the same seed, so a strategy's tokens/s over
another's in the same round cancels the machine's drift. The row's leader is the strategy with the highest median
paired speed-up over isf. It is **best** (bold) only when its paired ratio over every other strategy lies wholly
above 1 in every round (min over rounds > 1); every strategy whose paired ratio with the leader reaches 1 or below
in some round is at **parity** with it. One round has no spread and is not judged. Three rounds wholly above 1 is a
sign test of 3 out of 3: no more than that is claimed.

Quality, paired by seed. Seed s gives every strategy the same initial weights (and its plan seed), so two strategies'
figures of one seed are compared seed by seed: the per-seed differences (held-out loss: a - b; time to quality: the
log of a's time over b's, seeds where both reached isf's loss) have mean m and sample SD sd over n seeds; the
difference lies **beyond seed noise** when the 95% Student-t interval m +- t(0.975, n - 1) * sd / sqrt(n) excludes 0
(n = 3: t = 4.303), otherwise **within seed noise (n)**. The leader (lowest mean loss, lowest median time) is bold
only when it lies beyond seed noise of every other strategy. With one seed nothing is judged.
"""

from __future__ import annotations

import math

import numpy as np

# Student's t, 0.975 quantile, by degrees of freedom (1..30); above 30 the normal's 1.96 is close enough.
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
         2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042)


def t975(dof: int) -> float:
    """The 0.975 quantile of Student's t with ``dof`` degrees of freedom (dof >= 1)."""
    return _T975[dof - 1] if dof <= len(_T975) else 1.96


def paired_interval(differences) -> dict:
    """The mean of paired ``differences`` and its 95% Student-t interval; "beyond" when the interval excludes 0
    (None with fewer than two pairs: no noise estimate)."""
    d = np.asarray([x for x in differences if x is not None], dtype=np.float64)
    if len(d) < 2:
        return {"n": len(d), "mean": float(d.mean()) if len(d) else None, "low": None, "high": None, "beyond": None}
    half = t975(len(d) - 1) * float(d.std(ddof=1)) / math.sqrt(len(d))
    mean = float(d.mean())
    return {"n": len(d), "mean": mean, "low": mean - half, "high": mean + half, "beyond": bool(abs(mean) > half)}


# ============================================================================================================ speed
def tokens_per_s_by_round(runs: list, timed) -> dict:
    """{round: raw tokens/s} of one strategy's runs (``timed``: report.timed)."""
    out = {}
    for r in runs:
        tokens, seconds, _ = timed(r)
        out[r["round"]] = tokens / seconds
    return out


def paired_between(runs_a: list, runs_b: list, timed) -> list:
    """a's raw tokens/s over b's, round by round (rounds both ran)."""
    a, b = tokens_per_s_by_round(runs_a, timed), tokens_per_s_by_round(runs_b, timed)
    return [a[k] / b[k] for k in sorted(a) if k in b]


def speed_verdict(runs: dict, timed, baseline: str = "isf") -> dict:
    """The speed rule (module docstring) on one budget's runs ({strategy: [run per round]}): {"leader", "best" (the
    leader, or None at parity), "parity" (the strategies at parity with the leader, leader first), "against":
    {other: {"ratios", "median", "min", "max"}} (the leader's paired ratio over each other strategy)}."""
    over_base = {name: float(np.median(paired_between(rs, runs[baseline], timed))) for name, rs in runs.items()}
    leader = max(over_base, key=over_base.get)
    against = {}
    for name, rs in runs.items():
        if name == leader:
            continue
        ratios = paired_between(runs[leader], rs, timed)
        against[name] = {"ratios": ratios, "median": float(np.median(ratios)), "min": min(ratios), "max": max(ratios)}
    tied = [name for name, a in against.items() if a["min"] <= 1.0]
    judged = min((len(a["ratios"]) for a in against.values()), default=0) >= 2  # one round has no spread
    return {"leader": leader, "best": leader if judged and not tied else None,
            "parity": [leader, *tied] if tied else [], "against": against, "judged": judged}


# ========================================================================================================== quality
def final_losses_by_seed(runs: list) -> dict:
    """{seed: final held-out loss} of one strategy's runs that evaluated."""
    return {r["seed"]: r["evals"][-1][2] for r in runs if r["evals"]}


def loss_verdict(runs: dict) -> dict | None:
    """The quality rule on final held-out losses: {"leader" (lowest mean), "best" (or None), "seeds", "against":
    {other: paired_interval of leader - other}}; None when no run evaluated."""
    losses = {name: final_losses_by_seed(rs) for name, rs in runs.items()}
    losses = {name: by_seed for name, by_seed in losses.items() if by_seed}
    if not losses:
        return None
    leader = min(losses, key=lambda n: np.mean(list(losses[n].values())))
    against = {name: paired_interval([losses[leader][s] - by_seed[s] for s in sorted(by_seed) if s in losses[leader]])
               for name, by_seed in losses.items() if name != leader}
    return _verdict(leader, against, max(len(v) for v in losses.values()))


def time_verdict(ttq: dict) -> dict | None:
    """The quality rule on time to isf's final loss (report.time_to_quality's per-seed ratios, seeds in order):
    the leader is the lowest median; against each other strategy, the per-seed log of the leader's time over
    theirs (seeds where both reached it)."""
    ranked = {name: t for name, t in ttq.items() if t and t["median"] is not None}
    if not ranked:
        return None
    # The most seeds reached first (a strategy that reached it once, quickly, does not lead one that always did).
    leader = min(ranked, key=lambda n: (-ranked[n]["reached"], ranked[n]["median"]))
    mine = ranked[leader]["ratios"]
    against = {}
    for name, t in ttq.items():
        if name == leader or not t:
            continue
        against[name] = paired_interval([math.log(a / b) for a, b in zip(mine, t["ratios"])
                                         if a is not None and b is not None])
    return _verdict(leader, against, ranked[leader]["seeds"])


def _verdict(leader: str, against: dict, seeds: int) -> dict:
    """``judged``: every comparison had two pairs or more; ``pairs``: the fewest pairs of any comparison."""
    judged = [a["beyond"] for a in against.values()]
    best = leader if judged and all(b is True for b in judged) else None
    return {"leader": leader, "best": best, "seeds": seeds, "against": against,
            "within_noise": [name for name, a in against.items() if a["beyond"] is not True],
            "judged": bool(judged) and all(b is not None for b in judged),
            "pairs": min((a["n"] for a in against.values()), default=0)}
