"""Auto group selection: the HBP paper's Alg. 1, 3 and 4 over a measurement back-end.

The back-end (hbp_train.profiler.backends) answers one question: how long does one fwd+bwd of a pack of
`pack_len` tokens take on an SP group of `sp` GPUs with `ckpt_layers` checkpointed layers, and how much memory
does one rank use? On top of it:

  GreedyProfileCkpt(l, sp)  measure memory with all layers checkpointed and with fewer (the probe), fit the memory
                            each checkpointed layer saves, take the fewest checkpointed layers whose predicted
                            memory fits `headroom` x device memory, then verify that count by a measurement
                            (over budget / OOM: step up 1, 2, 4, ... layers; all layers is known to fit).
                            Run once per combination of memory levers (tiled MLP, activation offload: with
                            checkpointed layers only), each its own Alg. 4; a lever is tried only where the
                            configuration without it checkpoints (it costs time and saves only memory).
  FindBestSpCkpt(l)         for each SP degree, its fastest lever combination at its GreedyProfileCkpt count; keep
                            the best throughput in tokens/s per GPU (pack_len / ((time + ZeRO's share) x sp)).
  Alg. 1                    over candidate lengths (powers of two from min_len up to max_len, max_len first), the
                            best-throughput length l_best and the longest feasible one l_max with their strategies,
                            then the communication-free lengths l1 = l_best/sp_best and l2 = l_max/sp_max (run at
                            sp=1 with their own checkpoint count): groups [l1, l_best, l2, l_max] when
                            l2 > l_best, else [l1, l_best, l_max] (deduplicated, ascending).

The ZeRO stage (``zero_choice.py``): Alg. 3 and 1 run once per candidate ZeRO setup (profile.zero_stages): a
measurement's memory is moved to the setup by the difference of the model states, its time gets the setup's
collectives and optimizer step per pack. The run's setup is the one whose longest feasible length is longest, then
the one with the least time per token summed over the candidate lengths (as if every length held as many tokens);
its groups are the profile's, and profile.json names it ("zero_stage", "zero").

SP degrees measured on several GPUs (a `launcher`, profiler/launcher.py): before the per-length loop, the
degrees are profiled one after the other, smallest first: the in-process ones (sp=1) here, each launched one by ONE
torchrun that runs GreedyProfileCkpt for every length it is given (profiler/worker.py, this same class). A length
goes to a degree only if no smaller degree already needs no checkpointing (`prune`). Their measurements join the
cache, so the per-length loop then replays them (same answers, same decisions) instead of estimating.

The whole profiler: config.py (ProfileConfig), backends.py (measuring), launcher.py + worker.py (SP > 1 on the
node's GPUs), nvml.py, report.py (the table), cli.py (``python -m hbp_train.profiler``, which writes profile.json
for ``data_tools.pack --groups auto``).
"""

from __future__ import annotations

import logging
import math
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional

from hbp_train.common.errors import UserError
from hbp_train.profiler.backends import MeasureBackend, Measurement
from hbp_train.perf.profile_config import ProfileConfig
from hbp_train.profiler.zero_choice import ZeroChoice, ZeroSetup, choose_setup

log = logging.getLogger(__name__)

PROFILE_VERSION = 1
ROLES = ("l1", "l_best", "l2", "l_max")  # the group names of Alg. 1, in ascending length
PLAIN = (False, False)  # (tiled_mlp, offload_activations): no memory lever
LEVER_VARIANTS = (PLAIN, (True, False), (False, True), (True, True))  # in the order they are tried


@dataclass
class CkptChoice:
    """Result of GreedyProfileCkpt for one (pack_len, sp)."""

    pack_len: int
    sp: int
    status: str
    """"ok", "infeasible" (does not fit even with every layer checkpointed) or "skipped" (time budget)."""
    ckpt_layers: Optional[int] = None
    """Fewest checkpointed layers that fit (verified), when status is "ok"."""
    measurement: Optional[Measurement] = None
    """The verifying measurement at ckpt_layers (its time is ProfileTime of Alg. 3)."""
    bytes_per_layer: Optional[float] = None
    """Fitted memory saved per checkpointed layer (None when only one point could be measured)."""
    levers: tuple = PLAIN
    """(tiled_mlp, offload_activations) of this choice."""


@dataclass
class Strategy:
    """Best (sp, ckpt) for one pack length (Alg. 3's result)."""

    pack_len: int
    sp: int
    ckpt_layers: int
    time_s: float
    tokens_per_s_per_gpu: float
    estimated: bool
    source: str
    tiled_mlp: bool = False
    offload_activations: bool = False
    zero_s: float = 0.0
    """ZeRO's seconds per pack under the setup it was chosen for (in tokens_per_s_per_gpu, not in time_s)."""

    def as_dict(self) -> dict:
        return asdict(self)


class ProfileError(UserError):
    """Nothing usable was measured (every length infeasible or skipped): the settings ask for more than the
    hardware or the time budget gives, so the message says which setting to change."""


class Profiler:
    """Runs Alg. 4 → 3 → 1 against a backend, within a time budget, remembering every measurement.

    The clock is injectable so the time budget can be tested with simulated time.
    """

    def __init__(self, backend: MeasureBackend, cfg: ProfileConfig, clock: Callable[[], float] = time.monotonic,
                 sp_degrees: Optional[list[int]] = None, launcher=None,
                 on_measurement: Optional[Callable[[Measurement], None]] = None, zero: Optional[ZeroChoice] = None):
        self.backend = backend
        self.zero = zero
        """The ZeRO setups to choose among (None: the job's own, its collectives not costed)."""
        self.setups: list[Optional[ZeroSetup]] = list(zero.setups) if zero is not None else [None]
        self.variants = LEVER_VARIANTS if (cfg.levers and getattr(backend, "supports_levers", False)) else (PLAIN,)
        self.cfg = cfg
        self.clock = clock
        self.sp_degrees = sorted(sp_degrees) if sp_degrees else cfg.sp_candidates()
        self.budget_bytes = int(cfg.headroom * backend.device_memory_bytes)
        self.measurements: list[Measurement] = []
        self.skipped: list[dict] = []
        self.warnings: list[str] = []
        self._cache: dict[tuple, Measurement] = {}
        self._start: Optional[float] = None
        self._bar = None
        self.launcher = launcher
        """SP degrees measured by torchruns: `.degrees` and `.run(sp, lengths, budget_left_s, known)` (launcher.py)."""
        self.on_measurement = on_measurement
        """Called with every new measurement (the worker streams them to its parent)."""
        self.runs: list[dict] = []  # one entry per launched SP degree: status, ranks, log, wall time

    # ---- bookkeeping ----------------------------------------------------------------------------------------
    def elapsed(self) -> float:
        return 0.0 if self._start is None else self.clock() - self._start

    def budget_exhausted(self) -> bool:
        return self.elapsed() >= self.cfg.time_budget_s

    def _warn(self, message: str) -> None:
        if message not in self.warnings:
            self.warnings.append(message)
            log.warning(message)

    def add_measurements(self, measurements) -> None:
        """Known measurements (a torchrun's, or an earlier attempt's): answered from the cache from now on."""
        for m in measurements:
            key = (m.pack_len, m.sp, m.ckpt_layers, m.tiled_mlp, m.offload_activations)
            if key not in self._cache:
                self._cache[key] = m
                self.measurements.append(m)

    def measure_degree(self, sp: int, lengths: list[int]) -> dict[int, CkptChoice]:
        """GreedyProfileCkpt at degree `sp` for each length, in the given order, within the time budget (a length
        left when it runs out is recorded as skipped), for every ZeRO setup and lever combination the per-length
        loop will ask for. Returns each length's choice that checkpoints the most (no lever) over the setups."""
        if self._start is None:
            self._start = self.clock()
        choices = {}
        for length in lengths:
            if self.budget_exhausted() and not self._has_measured(length, sp):
                self.skipped.append({"pack_len": length, "sp": sp, "purpose": "length",
                                     "reason": f"time budget of {self.cfg.time_budget_s:g} s exhausted"})
                continue
            found = [self.best_levers(length, sp, setup) for setup in self.setups]
            choices[length] = max(found, key=lambda c: (c.levers != PLAIN, c.ckpt_layers or 0, c.status != "ok"))
        return choices

    def _has_measured(self, pack_len: int, sp: Optional[int] = None) -> bool:
        return any(k[0] == pack_len and (sp is None or k[1] == sp) for k in self._cache)

    def _measure(self, pack_len: int, sp: int, ckpt: int, purpose: str, levers=PLAIN) -> Optional[Measurement]:
        """A cached measurement, or None when the time budget forbids starting a new one (recorded as skipped)."""
        key = (pack_len, sp, ckpt, *levers)
        if key in self._cache:
            return self._cache[key]
        if self.budget_exhausted():
            self.skipped.append({"pack_len": pack_len, "sp": sp, "ckpt_layers": ckpt, "purpose": purpose,
                                 "tiled_mlp": levers[0], "offload_activations": levers[1],
                                 "reason": f"time budget of {self.cfg.time_budget_s:g} s exhausted"})
            return None
        started = self.clock()
        if levers == PLAIN:
            m = self.backend.measure(pack_len, sp, ckpt, self.cfg.iters)
        else:
            m = self.backend.measure(pack_len, sp, ckpt, self.cfg.iters, tiled_mlp=levers[0],
                                     offload_activations=levers[1])
        m.purpose = m.purpose or purpose
        m.wall_s = self.clock() - started
        self._cache[key] = m
        self.measurements.append(m)
        if self.on_measurement is not None:
            self.on_measurement(m)
        if self._bar is not None:
            self._bar.set_postfix_str(f"l={pack_len} sp={sp} ckpt={ckpt} {_status(m, self)}", refresh=True)
        return m

    def memory_of(self, m: Measurement, setup: Optional[ZeroSetup] = None) -> Optional[int]:
        """The measurement's memory (profile.memory_metric) under a ZeRO setup: the model's own for an analytic
        one (the backend's ``memory_for``), else the reading moved by the setup's difference of model states."""
        mem = m.memory_bytes(self.cfg.memory_metric)
        if setup is None or mem is None:
            return mem
        if self._modelled(m):
            return self.backend.memory_for(m, setup.job(self.zero.base))
        return mem + self.zero.memory_delta(setup)

    def _modelled(self, m: Measurement) -> bool:
        return m.source == "analytic" and hasattr(self.backend, "memory_for")

    def fits(self, m: Measurement, setup: Optional[ZeroSetup] = None) -> bool:
        """Ran without OOM and within headroom x device memory (under ``setup``'s model states). An analytic
        configuration's OOM flag is its job's; under another setup its memory alone decides."""
        mem = self.memory_of(m, setup)
        oom = m.oom and not (setup is not None and self._modelled(m))
        return not oom and m.time_s is not None and mem is not None and mem <= self.budget_bytes

    # ---- Alg. 4 ---------------------------------------------------------------------------------------------
    def greedy_profile_ckpt(self, pack_len: int, sp: int, levers=PLAIN,
                            setup: Optional[ZeroSetup] = None) -> CkptChoice:
        """Fewest checkpointed layers for (pack_len, sp) with ``levers`` that fit the memory budget under ``setup``,
        verified by a measurement (activation offload needs at least one checkpointed layer)."""
        metric = self.cfg.memory_metric
        c_max = self.backend.num_layers
        c_floor = 1 if levers[1] else 0
        top = self._measure(pack_len, sp, c_max, "ckpt-all", levers)
        if top is None:
            return CkptChoice(pack_len, sp, "skipped", levers=levers)
        if not self.fits(top, setup):
            return CkptChoice(pack_len, sp, "infeasible", measurement=top, levers=levers)
        probe_at = self.cfg.ckpt_probe_layers
        c_min = max(c_floor, c_max // 2 if probe_at is None else min(probe_at, c_max))
        # The probe may itself run out of memory: move it halfway towards c_max until it runs.
        low = None
        while c_min < c_max:
            low = self._measure(pack_len, sp, c_min, "ckpt-probe", levers)
            if low is None:
                break  # budget: decide from the all-checkpointed point alone
            if not low.oom and low.memory_bytes(metric) is not None:
                break
            c_min = (c_min + c_max + 1) // 2
            low = None
        bytes_per_layer = None
        if low is None or c_min >= c_max:
            guess = c_max
        else:
            bytes_per_layer = (low.memory_bytes(metric) - top.memory_bytes(metric)) / (c_max - c_min)
            if bytes_per_layer <= 0:
                guess = 0  # checkpointing saves nothing measurable here: none is needed
            else:
                spare = self.budget_bytes - self.memory_of(top, setup)
                guess = c_max - math.floor(spare / bytes_per_layer)
        guess = int(min(max(guess, c_floor), c_max))
        # Verify; over budget or OOM → step up 1, 2, 4, ... layers (all layers is known to fit).
        step = 1
        while True:
            m = self._measure(pack_len, sp, guess, "verify", levers)
            if m is None:
                # No time to verify: fall back to the most conservative measured count that fits.
                fitting = [x for x in self.measurements
                           if (x.pack_len, x.sp, x.tiled_mlp, x.offload_activations) == (pack_len, sp, *levers)
                           and self.fits(x, setup) and x.ckpt_layers >= guess]
                best = min(fitting, key=lambda x: x.ckpt_layers)
                self._warn(f"l={pack_len} sp={sp}{_lever_note(levers)}: no time to verify ckpt={guess}; using "
                           f"measured ckpt={best.ckpt_layers}")
                return CkptChoice(pack_len, sp, "ok", best.ckpt_layers, best, bytes_per_layer, levers)
            if self.fits(m, setup):
                return CkptChoice(pack_len, sp, "ok", guess, m, bytes_per_layer, levers)
            guess = min(guess + step, c_max)
            step *= 2

    def best_levers(self, pack_len: int, sp: int, setup: Optional[ZeroSetup] = None) -> CkptChoice:
        """The fastest lever combination for (pack_len, sp) under ``setup``, each at its GreedyProfileCkpt count.
        A lever is tried only where the combination without it checkpoints or does not fit (it costs time and
        only saves memory); offload only on top of a combination that checkpoints."""
        choices: dict[tuple, CkptChoice] = {}
        for levers in self.variants:
            tiled, offload = levers
            without = choices.get((False, offload)) if tiled else choices.get((tiled, False)) if offload else None
            if levers != PLAIN and (without is None or (without.status == "ok" and without.ckpt_layers == 0)):
                continue
            choices[levers] = self.greedy_profile_ckpt(pack_len, sp, levers, setup)
        done = [c for c in choices.values() if c.status == "ok"]
        if not done:
            return choices[PLAIN]
        return min(done, key=lambda c: c.measurement.time_s)

    # ---- Alg. 3 ---------------------------------------------------------------------------------------------
    def find_best_sp_ckpt(self, pack_len: int, setup: Optional[ZeroSetup] = None) -> Optional[Strategy]:
        """Best-throughput (sp, ckpt, levers) for one pack length under ``setup``, or None when nothing fits /
        nothing was measured."""
        best: Optional[Strategy] = None
        degrees = [sp for sp in self.sp_degrees if pack_len % sp == 0]  # Ulysses cuts a pack into sp equal slices
        for done, sp in enumerate(degrees, start=1):
            choice = self.best_levers(pack_len, sp, setup)
            plain = choice.status == "ok" and choice.ckpt_layers == 0 and choice.levers == PLAIN
            if self._bar is not None and setup == self.setups[0]:
                self._bar.update(len(degrees) - done + 1 if self.cfg.prune and plain else 1)
            if choice.status != "ok":
                continue
            cand = self._strategy(choice, setup)
            if best is None or cand.tokens_per_s_per_gpu > best.tokens_per_s_per_gpu:
                best = cand
            if self.cfg.prune and plain:
                break  # nothing left to save by more SP, only communication to add
        return best

    def _strategy(self, choice: CkptChoice, setup: Optional[ZeroSetup]) -> Strategy:
        """A measured choice as a strategy: its pack time, and its throughput with the setup's ZeRO time."""
        m = choice.measurement
        zero_s = 0.0 if setup is None else self.zero.pack_seconds(setup, m.pack_len, m.sp)
        return Strategy(m.pack_len, m.sp, choice.ckpt_layers, m.time_s, m.pack_len / ((m.time_s + zero_s) * m.sp),
                        m.estimated, m.source, *choice.levers, zero_s)

    # ---- Alg. 1 ---------------------------------------------------------------------------------------------
    def run(self) -> dict:
        """Profile every candidate length (longest first: l_max is the one group training cannot do without) under
        every ZeRO setup, keep the setup that trains the longest packs, then the fastest, and derive its groups.
        Returns the profile dict written to profile.json."""
        self._start = self.clock()
        lengths = self.cfg.candidate_lengths()
        total = sum(1 for l in lengths for sp in self.sp_degrees if l % sp == 0)
        self._bar = _progress(total, self.cfg.progress)
        try:
            if self.launcher is not None and self.launcher.degrees:
                self._launched_degrees(lengths)
            by_setup = {setup: self._strategies(lengths, setup) for setup in self.setups}
            setup = choose_setup(by_setup)
            strategies = by_setup[setup]
            if not strategies:
                raise ProfileError(
                    "no candidate pack length fits in memory at any SP degree (or the time budget ran out before "
                    "one was measured); raise profile.world_size / time_budget_s or lower profile.max_len")
            for length in lengths:
                if length not in strategies and not any(s.get("pack_len") == length for s in self.skipped):
                    self._warn(f"pack length {length}: does not fit in {self.cfg.headroom:g} x device memory at "
                               f"any SP degree in {self.sp_degrees}")
            groups = self.select_groups(strategies, setup)
        finally:
            if self._bar is not None:
                self._bar.close()
                self._bar = None
        return self._report(strategies, groups, setup, by_setup)

    def _strategies(self, lengths: list[int], setup: Optional[ZeroSetup]) -> dict[int, Strategy]:
        """Alg. 3 for every candidate length, longest first, under one ZeRO setup."""
        strategies: dict[int, Strategy] = {}
        for length in reversed(lengths):
            if self.budget_exhausted() and not self._has_measured(length):
                if not any(s.get("pack_len") == length and s.get("purpose") == "length" for s in self.skipped):
                    self.skipped.append({"pack_len": length, "purpose": "length",
                                         "reason": f"time budget of {self.cfg.time_budget_s:g} s exhausted"})
                continue
            strat = self.find_best_sp_ckpt(length, setup)
            if strat is not None:
                strategies[length] = strat
        return strategies

    def _launched_degrees(self, lengths: list[int]) -> None:
        """Profile the degrees up to the largest launched one, smallest first, before the per-length loop: in this
        process (sp=1) or by one torchrun per degree. A length is given to a degree unless a smaller degree already
        needs no checkpointing there (prune); a failed torchrun leaves its points to the estimate, with a warning."""
        choices: dict[tuple[int, int], CkptChoice] = {}
        top = max(self.launcher.degrees)
        for sp in [d for d in self.sp_degrees if d <= top]:
            todo = [l for l in reversed(lengths) if l % sp == 0 and not (self.cfg.prune and any(
                c.ckpt_layers == 0 for (l2, d), c in choices.items() if l2 == l and d < sp))]
            if not todo:
                continue
            if sp in self.launcher.degrees:
                if self.budget_exhausted():
                    break
                self.release_backend()
                result = self.launcher.run(sp, todo, self.cfg.time_budget_s - self.elapsed(),
                                           [m for m in self.measurements if m.sp == sp])
                self.add_measurements(result.measurements)
                self.runs.append(result.summary())
                for w in result.warnings:
                    self._warn(w)
            # In-process degrees are measured here; a launched degree's points are cache hits (a replay).
            for length, choice in self.measure_degree(sp, todo).items():
                choices[length, sp] = choice

    def release_backend(self) -> None:
        """Let the backend free the GPU it holds before a torchrun needs it."""
        release = getattr(self.backend, "release", None)
        if release is not None:
            release()

    def select_groups(self, strategies: dict[int, Strategy], setup: Optional[ZeroSetup] = None) -> list[dict]:
        """Alg. 1 stage 2: [l1, l_best, (l2,) l_max], each with its own sp, ckpt_layers and levers."""
        l_max = max(strategies)
        if l_max < self.cfg.max_len:
            self._warn(f"max_len {self.cfg.max_len} could not be profiled as trainable; the longest group is "
                       f"{l_max}: samples longer than that would be dropped")
        # Best throughput; ties go to the longer length (fewer, larger packs).
        l_best = max(strategies, key=lambda l: (strategies[l].tokens_per_s_per_gpu, l))
        s_best, s_max = strategies[l_best], strategies[l_max]
        if self.cfg.docs == "single" and l_best == min(strategies) < l_max:
            # One document per pack: attention per token grows with the length, so the shortest candidate wins
            # unless fixed per-pack costs outweigh that. Real packs hold many shorter documents.
            self._warn(f"l_best={l_best} is the shortest candidate: with profile.docs=single (one document per "
                       "pack) attention per token grows with the pack length; set profile.docs to the tokenized "
                       "dataset to profile packs like the training data")
        l1, l2 = l_best // s_best.sp, l_max // s_max.sp
        roles = {l_best: ["l_best"], l_max: ["l_max"]} if l_best != l_max else {l_max: ["l_best", "l_max"]}
        groups: dict[int, dict] = {}
        for length, names in roles.items():
            groups[length] = _group(strategies[length], ",".join(names))
        extra = [(l1, "l1", s_best)] + ([(l2, "l2", s_max)] if l2 > l_best else [])
        for length, role, parent in extra:
            if length in groups:
                groups[length]["role"] = ",".join(sorted(groups[length]["role"].split(",") + [role], key=ROLES.index))
                continue
            # l1 / l2: communication-free, sp = 1, with their own checkpoint count and levers.
            choice = self.best_levers(length, 1, setup)
            if choice.status == "ok":
                groups[length] = _group(self._strategy(choice, setup), role)
            elif choice.status == "skipped":
                # Same tokens per rank as the parent: its checkpoint count and levers are a safe, unmeasured
                # stand-in.
                self._warn(f"{role}={length}: not measured (time budget); using ckpt_layers="
                           f"{parent.ckpt_layers} of its parent length {parent.pack_len}")
                groups[length] = _group(Strategy(length, 1, parent.ckpt_layers, None, None, True, "inherited",
                                                 parent.tiled_mlp, parent.offload_activations), role)
            else:
                self._warn(f"{role}={length} does not fit at sp=1; group dropped")
        return [groups[k] for k in sorted(groups)]

    def _report(self, strategies: dict[int, Strategy], groups: list[dict], setup: Optional[ZeroSetup],
                by_setup: dict) -> dict:
        l_best = max(strategies, key=lambda l: (strategies[l].tokens_per_s_per_gpu, l))
        zero = {}
        if setup is not None:
            zero = {"zero_stage": setup.stage, "zero": {**setup.as_dict(), "name": setup.describe()},
                    "zero_candidates": [{**z.as_dict(), "name": z.describe(), "l_max": max(st, default=None),
                                         "seconds_per_token": {l: 1.0 / st[l].tokens_per_s_per_gpu for l in sorted(st)}}
                                        for z, st in by_setup.items()]}
        return {
            "version": PROFILE_VERSION,
            "source": self.backend.name,
            **zero,
            "groups": groups,
            "l_best": l_best,
            "l_max": max(strategies),
            "strategies": [strategies[k].as_dict() for k in sorted(strategies)],
            "measurements": [asdict(m) for m in self.measurements],
            "skipped": self.skipped,
            "warnings": self.warnings,
            "memory_budget_bytes": self.budget_bytes,
            "memory_metric": self.cfg.memory_metric,
            "profiler": {"wall_s": round(self.elapsed(), 3),
                         "measured": sum(1 for m in self.measurements
                                         if not m.estimated and m.source in ("gpu", "cpu")),
                         "estimated": sum(1 for m in self.measurements if m.estimated),
                         "sp_runs": self.runs,
                         "measure_s": round(sum(m.wall_s for m in self.measurements), 3),
                         "num_measurements": len(self.measurements),
                         "time_budget_s": self.cfg.time_budget_s,
                         "budget_exhausted": bool(self.skipped)},
        }


def _group(strat: Strategy, role: str) -> dict:
    """A group as profile.json lists it; a lever's key only when it is on (as plan.json's groups)."""
    out = {"pack_len": int(strat.pack_len), "sp": int(strat.sp), "ckpt_layers": int(strat.ckpt_layers), "role": role,
           "time_s": strat.time_s, "tokens_per_s_per_gpu": strat.tokens_per_s_per_gpu,
           "estimated": bool(strat.estimated), "source": strat.source}
    out.update({k: True for k in ("tiled_mlp", "offload_activations") if getattr(strat, k)})
    return out


def _lever_note(levers) -> str:
    """" tiled_mlp+offload" for messages; empty without levers."""
    names = [n for n, on in zip(("tiled_mlp", "offload"), levers) if on]
    return f" {'+'.join(names)}" if names else ""


def _status(m: Measurement, prof: Optional[Profiler] = None) -> str:
    if m.oom:
        return "OOM"
    if prof is not None and not prof.fits(m):
        return "over budget"
    return "ok"


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="profile (length, sp)", unit="cfg", file=sys.stderr, dynamic_ncols=True,
                disable=None)  # None: no bar when stderr is a log file, not a terminal
