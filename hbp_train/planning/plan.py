"""Plan types: the planner's config, its groups, and the plan itself (numpy inside, JSON outside).

A plan says, for every optimizer step, which group (pack length + SP degree) it runs in and which packs each
replica runs, in order. Internally everything is flat numpy so a 1M-sample plan stays cheap:

* packs are CSR: ``pack_samples[pack_ptr[p]:pack_ptr[p+1]]`` are the sample indices of pack ``p``; an empty pack
  (only ever in a group's tail step, see docs/planning.md) has ``pack_ptr[p] == pack_ptr[p+1]``;
* steps are CSR over packs, **slot-major**: ``step_packs[step_ptr[s] + k * R + r]`` is the pack that replica ``r``
  runs as micro-batch ``k`` of step ``s``, where ``R = world_size // sp`` of the step's group. Slot-major keeps the
  packs that run at the same time next to each other, which is what balancing and the metrics look at.

Python lists are only built when serialising (``to_dict`` / ``to_json``); ``from_json`` rebuilds the arrays.
The JSON layout is the contract in docs/architecture.md ("Plan"). The metrics are computed by
hbp_train/planning/metrics.py, which sits above this module (``with_metrics``); ``to_dict`` needs them filled.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np

from hbp_train.common.errors import UserError
from hbp_train.common.outputs import atomic_write
from hbp_train.planning.csr import pack_tokens

PLAN_VERSION = 1
MAX_WORLD_SIZE = 1 << 20
MAX_ISF_ROUNDS = 1000
STRATEGIES = ("hbp", "isf")
BALANCE_METHODS = ("refine", "sort")
STEP_MIX_METHODS = ("mixed", "stratified", "sorted")
STEP_TOKENS = ("real", "capacity")
DROP_TOO_LONG = "longer_than_max_pack_len"
LEVER_KEYS = ("tiled_mlp", "offload_activations")  # a group's memory levers (model/levers.py), in plan.json when on

# A per-pack cost: (lengths of the samples of all packs, flat in pack order; CSR pointer [num_packs + 1];
# the group the packs run in) -> float64 cost per pack. Default: attention cost, sum of len^2 per pack.
PackCostFn = Callable[[np.ndarray, np.ndarray, "GroupSpec"], np.ndarray]


def _is_power_of_two(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


@dataclass(frozen=True)
class GroupSpec:
    """One hierarchical packing group: packs of up to ``pack_len`` tokens trained with SP degree ``sp``."""

    pack_len: int
    """Capacity of every pack of this group, in tokens (sum of its samples' lengths never exceeds it)."""
    sp: int = 1
    """Sequence-parallel degree: each pack is split across ``sp`` ranks (a power of two dividing world_size)."""
    ckpt_layers: int | None = None
    """Number of layers to activation-checkpoint for this group (from the profiler); None = trainer default."""
    tiled_mlp: bool = False
    """Memory lever: each layer's MLP (or MoE block) runs over sequence tiles recomputed in backward, one tile's
    intermediate alive at a time (model/levers.py; tiles: perf.shape.mlp_tiles). Exact, as every lever."""
    offload_activations: bool = False
    """Memory lever: the inputs checkpointed layers keep wait in pinned host memory until backward (needs them)."""

    def __post_init__(self):
        if not isinstance(self.pack_len, (int, np.integer)) or self.pack_len < 1:
            raise UserError(f"groups.pack_len must be a positive integer, got {self.pack_len!r}")
        if not isinstance(self.sp, (int, np.integer)) or not _is_power_of_two(int(self.sp)):
            raise UserError(f"groups.sp must be a power of two (1, 2, 4, ...), got {self.sp!r}")
        if self.ckpt_layers is not None and (not isinstance(self.ckpt_layers, (int, np.integer)) or self.ckpt_layers < 0):
            raise UserError(f"groups.ckpt_layers must be a non-negative integer or null, got {self.ckpt_layers!r}")
        for name in LEVER_KEYS:
            if not isinstance(getattr(self, name), (bool, np.bool_)):
                raise UserError(f"groups.{name} must be true or false, got {getattr(self, name)!r}")
        if self.offload_activations and self.ckpt_layers == 0:  # it moves what checkpointed layers keep
            raise UserError(f"groups: pack_len {self.pack_len} has offload_activations with ckpt_layers 0: give it "
                            "checkpointed layers (pack_len:sp:ckpt_layers:offload) or drop offload")

    def to_dict(self) -> dict:
        """The group as plan.json writes it; a lever only when on (plans without levers keep their bytes)."""
        return {"pack_len": int(self.pack_len), "sp": int(self.sp), "ckpt_layers": self.ckpt_layers,
                **{name: True for name in LEVER_KEYS if getattr(self, name)}}

    @classmethod
    def from_dict(cls, d: dict) -> "GroupSpec":
        """A group as a plan file records it (``to_dict``); a plan written before the levers has none."""
        return cls(int(d["pack_len"]), int(d["sp"]), d.get("ckpt_layers"),
                   **{name: bool(d.get(name, False)) for name in LEVER_KEYS})


@dataclass
class PlanConfig:
    """Everything the planner needs besides the lengths."""

    world_size: int
    """Number of ranks (GPUs). A step of a group with SP degree s has world_size // s replicas."""
    groups: Sequence[GroupSpec]
    """Hierarchical packing groups, ascending by pack_len. ``isf`` uses only the last (largest) one."""
    strategy: str = "hbp"
    """Planning strategy: "hbp" (hierarchical balance packing) or "isf" (naive packing baseline)."""
    global_tokens: int = 4 * 1024 * 1024
    """Tokens per optimizer step, G. With step_tokens="real" (default): real (non-padding) tokens, the same for every
    strategy: a plan of T real tokens has max(1, round(T / G)) optimizer steps of T / that count tokens each, up to
    one slot (planning/equal_steps.py). With "capacity": pack capacity, m = max(1, round(G / (pack_len * R)))
    micro-batches per replica, so denser packs make fewer steps."""
    step_tokens: str = "real"
    """What global_tokens counts: "real" (default) — real tokens, every strategy makes the same number of
    optimizer steps of (nearly) the same real tokens, so a better plan saves time, never updates; "capacity" —
    pack capacity (the steps before #24: a strategy's step count then depends on its padding)."""
    max_len: int | None = None
    """Longest sample length the data may have (recorded in the plan); None = the largest group's pack_len.
    Must not exceed the largest pack_len (samples longer than that are dropped as longer_than_max_pack_len)."""
    curriculum_steps: int = 0
    """The first K steps use only the shortest group (hbp) / only packs of short samples (isf)."""
    seed: int = 0
    """Seed (>= 0) for every random choice (shuffles, step order, interleave); same seed + lengths -> same plan."""
    isf_rounds: int = 4
    """ISF: shuffle-and-fill rounds before the leftovers are packed as they come."""
    isf_threshold: int | None = None
    """ISF: a pack is kept in a round if it holds at least pack_len - threshold tokens; None = pack_len // 64."""
    balance: str = "refine"
    """hbp step building: "sort" (paper: sort packs by cost, chunk) or "refine" (sort, then a swap pass)."""
    step_mix: str = "mixed"
    """hbp: how balanced slots become optimizer steps. "sorted": m consecutive cost-sorted slots of one group (the
    paper's chunking: steps homogeneous in length, which costs quality; #16); "stratified": one slot of each of m
    cost strata of one group (steps span the group's lengths); "mixed" (default): stratified, then every optimizer
    step takes slots of every group in proportion to the group's slots, as one plan step per group
    (``Plan.optimizer_step``; the trainer switches the SP degree between them)."""
    pack_cost: PackCostFn | None = None
    """Per-pack cost the balancer equalises across replicas (e.g. from hbp_train.perf.cost_model); None = sum len^2."""
    progress: bool = False
    """Show tqdm progress bars for the long phases."""

    def __post_init__(self):
        self.groups = tuple(g if isinstance(g, GroupSpec) else GroupSpec(**g) for g in self.groups)
        if not isinstance(self.world_size, (int, np.integer)) or self.world_size < 1:
            raise UserError(f"world_size must be a positive integer, got {self.world_size!r}")
        if self.world_size > MAX_WORLD_SIZE:  # every step lists world_size/sp replicas: memory grows with it
            raise UserError(f"world_size={self.world_size} is larger than the {MAX_WORLD_SIZE} ranks supported")
        if not self.groups:
            raise UserError("groups must hold at least one group")
        lens = [g.pack_len for g in self.groups]
        if any(b <= a for a, b in zip(lens, lens[1:])):
            raise UserError(f"groups must be strictly ascending by pack_len, got {lens}")
        for g in self.groups:
            if g.sp > self.world_size or self.world_size % g.sp:
                raise UserError(f"groups.sp={g.sp} (pack_len {g.pack_len}) must divide world_size={self.world_size}")
        if self.strategy not in STRATEGIES and not isinstance(self.strategy, str):
            raise UserError(f"strategy must be a string, got {self.strategy!r}")
        if not isinstance(self.global_tokens, (int, np.integer)) or self.global_tokens < 1:
            raise UserError(f"global_tokens must be a positive integer, got {self.global_tokens!r}")
        if self.max_len is None:
            self.max_len = int(self.groups[-1].pack_len)
        if self.max_len < 1 or self.max_len > self.groups[-1].pack_len:
            raise UserError(
                f"max_len={self.max_len} must be between 1 and the largest pack_len ({self.groups[-1].pack_len}): "
                "add a group whose pack_len is at least max_len"
            )
        if self.curriculum_steps < 0:
            raise UserError(f"curriculum_steps must be >= 0, got {self.curriculum_steps}")
        if not isinstance(self.seed, (int, np.integer)) or self.seed < 0:  # numpy's RNG takes no negative seed
            raise UserError(f"seed must be a non-negative integer, got {self.seed!r}")
        if not 0 <= self.isf_rounds <= MAX_ISF_ROUNDS:  # each round is a pass over the data
            raise UserError(f"isf_rounds must be between 0 and {MAX_ISF_ROUNDS}, got {self.isf_rounds}")
        if self.isf_threshold is not None and self.isf_threshold < 0:
            raise UserError(f"isf_threshold must be >= 0 or None, got {self.isf_threshold}")
        if self.balance not in BALANCE_METHODS:
            raise UserError(f"balance must be one of {BALANCE_METHODS}, got {self.balance!r}")
        if self.step_mix not in STEP_MIX_METHODS:
            raise UserError(f"step_mix must be one of {STEP_MIX_METHODS}, got {self.step_mix!r}")
        if self.step_tokens not in STEP_TOKENS:
            raise UserError(f"step_tokens must be one of {STEP_TOKENS}, got {self.step_tokens!r}")

    def replicas(self, group: int) -> int:
        """Number of replicas (SP groups) of a step in ``group``."""
        return self.world_size // self.groups[group].sp

    def micro_batches(self, group: int) -> int:
        """Micro-batches per replica of a full step in ``group``: max(1, round(G / (pack_len * R))). The step shape
        strategies build with; with step_tokens="real" their steps are then re-cut to the real-token budget."""
        g = self.groups[group]
        return max(1, int(round(self.global_tokens / (g.pack_len * self.replicas(group)))))

    def to_dict(self) -> dict:
        return {
            "world_size": int(self.world_size),
            "strategy": self.strategy,
            "seed": int(self.seed),
            "max_len": int(self.max_len),
            "global_tokens": int(self.global_tokens),
            "step_tokens": self.step_tokens,
            "curriculum_steps": int(self.curriculum_steps),
            "groups": [g.to_dict() for g in self.groups],
            # How the strategy was run, so a re-plan (planning/replan.py: a resume on another number of ranks) runs
            # it the same way. pack_cost is a function and is not recorded (a re-plan uses the default cost).
            "balance": self.balance,
            "step_mix": self.step_mix,
            "isf_rounds": int(self.isf_rounds),
            "isf_threshold": None if self.isf_threshold is None else int(self.isf_threshold),
        }

    @classmethod
    def from_record(cls, d: dict) -> "PlanConfig":
        """The config a plan file records (``to_dict``'s keys at the top of plan.json, or a binary plan's header);
        keys an older plan lacks take their defaults (step_tokens: "capacity", how plans before #24 were cut)."""
        groups = [GroupSpec.from_dict(g) for g in d["groups"]]
        return cls(world_size=int(d["world_size"]), groups=groups, strategy=d.get("strategy", "hbp"),
                   global_tokens=int(d.get("global_tokens", 1)), max_len=d.get("max_len"),
                   curriculum_steps=int(d.get("curriculum_steps", 0)), seed=int(d.get("seed", 0)),
                   step_tokens=d.get("step_tokens", "capacity"), balance=d.get("balance", "refine"),
                   step_mix=d.get("step_mix", "mixed"), isf_rounds=int(d.get("isf_rounds", 4)),
                   isf_threshold=d.get("isf_threshold"))


@dataclass
class Plan:
    """A complete plan. Build one with ``make_plan`` (hbp_train.planning) or read one with ``plan_npz.load_plan``."""

    config: PlanConfig
    """The config the plan was made with (pack_cost is not serialised)."""
    lengths: np.ndarray
    """int64 [num_samples]: token length of every input sample (index = row of the tokenized dataset)."""
    pack_ptr: np.ndarray
    """int64 [num_packs + 1]: CSR pointer into pack_samples."""
    pack_samples: np.ndarray
    """int64: sample indices of all packs, pack after pack, in the order the samples are concatenated."""
    pack_group: np.ndarray
    """int32 [num_packs]: group index of every pack."""
    step_ptr: np.ndarray
    """int64 [num_steps + 1]: CSR pointer into step_packs."""
    step_packs: np.ndarray
    """int64: pack ids of all steps, slot-major within a step (index k * R + r = replica r, micro-batch k)."""
    step_group: np.ndarray
    """int32 [num_steps]: group index of every step."""
    optimizer_step: np.ndarray | None = None
    """int64 [num_steps] or None: the optimizer step every plan step belongs to (0, 1, 2, ..., each value on
    consecutive plan steps of distinct groups). The plan steps of one optimizer step accumulate their gradients
    into one update, each at its own group's SP degree (hbp with step_mix="mixed": every optimizer step holds slots
    of every group; any real-token step that spans groups, equal_steps.py). None: every plan step is an optimizer
    step of its own."""
    dropped: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    """int64: indices of dropped samples (sorted)."""
    dropped_reason: list[str] = field(default_factory=list)
    """Reason of each dropped sample (same order as ``dropped``)."""
    deferred: list[dict] = field(default_factory=list)
    """Samples a strategy delayed ({"index", "waited_steps"}); empty for hbp/isf."""
    metrics: dict[str, Any] = field(default_factory=dict)
    """Plan-wide metrics (DBR, PR, ABR, CR, AveT, sp_required_share, ...), filled by metrics.with_metrics()."""
    step_metrics: dict[str, np.ndarray] = field(default_factory=dict)
    """Per-step metric arrays (ABR, DBR, tokens, group), filled by metrics.with_metrics()."""
    extra: dict[str, Any] = field(default_factory=dict)
    """Other top-level JSON keys to keep (e.g. planning wall time); written as-is by to_dict()."""

    # -- sizes and views ---------------------------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        return int(len(self.lengths))

    @property
    def num_packs(self) -> int:
        return int(len(self.pack_ptr) - 1)

    @property
    def num_steps(self) -> int:
        return int(len(self.step_ptr) - 1)

    @property
    def num_optimizer_steps(self) -> int:
        return self.num_steps if self.optimizer_step is None or not self.num_steps else int(self.optimizer_step[-1]) + 1

    def optimizer_steps(self) -> np.ndarray:
        """int64 [num_steps]: the optimizer step of every plan step (``optimizer_step``, or one per plan step)."""
        if self.optimizer_step is None:
            return np.arange(self.num_steps, dtype=np.int64)
        return np.asarray(self.optimizer_step, np.int64)

    @property
    def pack_tokens(self) -> np.ndarray:
        """int64 [num_packs]: tokens in every pack."""
        return pack_tokens(self.lengths, self.pack_ptr, self.pack_samples)

    @property
    def num_empty_packs(self) -> int:
        return int(np.count_nonzero(np.diff(self.pack_ptr) == 0))

    def step_replicas(self, step: int) -> int:
        return self.config.replicas(int(self.step_group[step]))

    def step_micro_batches(self) -> np.ndarray:
        """int64 [num_steps]: micro-batches per replica of every step."""
        reps = np.array([self.config.replicas(g) for g in range(len(self.config.groups))], np.int64)
        return np.diff(self.step_ptr) // reps[self.step_group]

    @property
    def unequal_micro_batches(self) -> bool:
        """True for a plan whose replicas run different numbers of micro-batches (only strategy "bytescale",
        marked by extra["unequal_micro_batches"]): in memory the shorter replicas end with empty packs, which
        to_dict omits and from_dict restores."""
        return bool(self.extra.get("unequal_micro_batches")) and self.config.strategy == "bytescale"

    def step_matrix(self, step: int) -> np.ndarray:
        """int64 [m, R]: pack id that replica r runs as micro-batch k of ``step`` (row = slot)."""
        r = self.step_replicas(step)
        return self.step_packs[self.step_ptr[step]:self.step_ptr[step + 1]].reshape(-1, r)

    def pack(self, p: int) -> np.ndarray:
        return self.pack_samples[self.pack_ptr[p]:self.pack_ptr[p + 1]]

    # -- checks ------------------------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError if the plan breaks the contract (docs/architecture.md): every index once in a pack or
        dropped, no pack over its pack_len, W/sp replicas with equal micro-batch counts, empty packs only in
        one step per group. A broken plan is a planner bug, not bad input, hence ValueError (never UserError)."""
        cfg, n = self.config, self.num_samples
        ng = len(cfg.groups)
        if self.pack_ptr[0] != 0 or self.pack_ptr[-1] != len(self.pack_samples) or np.any(np.diff(self.pack_ptr) < 0):
            raise ValueError("plan: pack_ptr is not a valid CSR pointer")
        if self.step_ptr[0] != 0 or self.step_ptr[-1] != len(self.step_packs) or np.any(np.diff(self.step_ptr) < 0):
            raise ValueError("plan: step_ptr is not a valid CSR pointer")
        if len(self.pack_group) != self.num_packs or len(self.step_group) != self.num_steps:
            raise ValueError("plan: pack_group/step_group sizes do not match the packs/steps")
        if np.any(self.step_group < 0) or np.any(self.step_group >= ng) or np.any(self.pack_group < 0) or np.any(self.pack_group >= ng):
            raise ValueError("plan: group index out of range")
        seen = np.zeros(n, np.int64)
        if len(self.pack_samples) and (self.pack_samples.min() < 0 or self.pack_samples.max() >= n):
            raise ValueError("plan: pack holds a sample index outside [0, num_samples)")
        if len(self.dropped) and (self.dropped.min() < 0 or self.dropped.max() >= n):
            raise ValueError("plan: dropped index outside [0, num_samples)")
        np.add.at(seen, self.pack_samples, 1)
        np.add.at(seen, self.dropped, 1)
        if np.any(seen != 1):
            bad = int(np.flatnonzero(seen != 1)[0])
            raise ValueError(f"plan: sample {bad} appears {int(seen[bad])} times (must be exactly once in a pack or dropped)")
        if len(self.dropped_reason) != len(self.dropped):
            raise ValueError("plan: dropped and dropped_reason differ in length")
        cap = np.array([g.pack_len for g in cfg.groups], np.int64)
        over = self.pack_tokens > cap[self.pack_group]
        if np.any(over):
            p = int(np.flatnonzero(over)[0])
            raise ValueError(f"plan: pack {p} holds {int(self.pack_tokens[p])} tokens > pack_len {int(cap[self.pack_group[p]])}")
        used = np.zeros(self.num_packs, np.int64)
        np.add.at(used, self.step_packs, 1)
        if np.any(used != 1):
            raise ValueError("plan: every pack must be in exactly one step slot")
        reps = np.array([cfg.replicas(g) for g in range(ng)], np.int64)
        sizes = np.diff(self.step_ptr)
        if np.any(sizes % reps[self.step_group]) or np.any(sizes == 0):
            raise ValueError("plan: a step's pack count is not a positive multiple of its replica count")
        if np.any(self.pack_group[self.step_packs] != np.repeat(self.step_group, sizes)):
            raise ValueError("plan: a step holds a pack of another group")
        if self.optimizer_step is not None:
            opt = np.asarray(self.optimizer_step)
            steps_ok = len(opt) == 0 or (opt[0] == 0 and np.all((np.diff(opt) == 0) | (np.diff(opt) == 1)))
            if len(opt) != self.num_steps or not steps_ok:
                raise ValueError("plan: optimizer_step must number the plan steps 0, 1, 2, ... in order")
            same = np.diff(opt) == 0
            if self.unequal_micro_batches and np.any(same):
                raise ValueError("plan: unequal micro-batch counts (bytescale) cannot share an optimizer step")
            # Plan steps of one optimizer step run one after the other: one per group, so a group never appears twice.
            pairs = np.unique(np.stack([opt, self.step_group.astype(np.int64)]), axis=1)
            if pairs.shape[1] != self.num_steps:
                raise ValueError("plan: an optimizer step holds two plan steps of the same group")
        empty = np.flatnonzero(np.diff(self.pack_ptr) == 0)
        if self.extra.get("unequal_micro_batches") and not self.unequal_micro_batches:
            raise ValueError("plan: unequal_micro_batches is only valid for strategy 'bytescale'")
        if self.unequal_micro_batches:
            # bytescale pads shorter replicas with empty packs: a replica's empty packs must all come last.
            is_empty = np.diff(self.pack_ptr) == 0
            for s in range(self.num_steps):
                rows = is_empty[self.step_matrix(s)]
                if np.any(rows[1:] < rows[:-1]):
                    raise ValueError(f"plan: step {s} has an empty pack before a non-empty one on a replica")
        elif len(empty):
            # Empty packs are a last resort for a group's tail step (docs/planning.md): at most one step per group.
            step_of_pack = np.repeat(np.arange(self.num_steps), sizes)[np.argsort(self.step_packs)]
            for g in np.unique(self.pack_group[empty]):
                if len(np.unique(step_of_pack[empty[self.pack_group[empty] == g]])) > 1:
                    raise ValueError(f"plan: empty packs in more than one step of group {int(g)}")
            for s in np.unique(step_of_pack[empty]):
                if np.all(np.diff(self.pack_ptr)[self.step_packs[self.step_ptr[s]:self.step_ptr[s + 1]]] == 0):
                    raise ValueError(f"plan: step {int(s)} holds only empty packs")

    # -- serialisation -----------------------------------------------------------------------------------------
    def to_dict(self, step_rows: list | None = None) -> dict:
        """The plan as JSON-ready Python objects (docs/architecture.md). ``step_rows``: optional per-step
        "rows" (the packed-shard writer adds them)."""
        if not self.metrics:  # metrics.py sits above this module: its caller fills them
            raise ValueError("plan.to_dict: the plan has no metrics; fill them first (planning.metrics.with_metrics)")
        flat = self.pack_samples.tolist()
        ptr = self.pack_ptr.tolist()
        packs = [flat[ptr[p]:ptr[p + 1]] for p in range(self.num_packs)]
        step_packs = self.step_packs.tolist()
        sptr = self.step_ptr.tolist()
        steps = []
        for s in range(self.num_steps):
            g = int(self.step_group[s])
            r = self.config.replicas(g)
            ids = step_packs[sptr[s]:sptr[s + 1]]
            replicas = [[packs[p] for p in ids[i::r]] for i in range(r)]
            if self.unequal_micro_batches:  # drop the in-memory padding: replicas list their own packs only
                replicas = [[pk for pk in rep if pk] for rep in replicas]
            entry = {"group": g, "replicas": replicas}
            if self.optimizer_step is not None:
                entry["optimizer_step"] = int(self.optimizer_step[s])
            if step_rows is not None:
                entry["rows"] = step_rows[s]
            steps.append(entry)
        sm = self.step_metrics
        keys = list(sm)
        cols = [sm[k].tolist() for k in keys]
        step_metrics = [dict(zip(keys, vals)) for vals in zip(*cols)] if keys else []
        out = self.config.to_dict()
        out = {"version": PLAN_VERSION, **out}
        out.update(
            {
                "steps": steps,
                "dropped": [{"index": int(i), "reason": r} for i, r in zip(self.dropped.tolist(), self.dropped_reason)],
                "deferred": list(self.deferred),
                "num_samples": self.num_samples,
                "empty_packs": self.num_empty_packs,
                "lengths": self.lengths.tolist(),
                "metrics": self.metrics,
                "step_metrics": step_metrics,
            }
        )
        out.update(self.extra)
        return out

    def to_json(self, path: str | Path, step_rows: list | None = None) -> None:
        """Write the plan as compact JSON to ``path`` (creating its folder).

        Written to a temporary file beside ``path`` and moved over it: an interrupt while serialising a large plan
        leaves the earlier plan.json whole, never empty."""
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        # dumps + write: json.dump streams through the pure-Python iterencode, several times slower.
        text = json.dumps(self.to_dict(step_rows), separators=(",", ":"))
        atomic_write(path, lambda tmp: tmp.write_text(text))

    @classmethod
    def from_dict(cls, d: dict) -> "Plan":
        """Rebuild a plan (numpy arrays) from its JSON dict. Needs "lengths" (written by to_dict). Its metrics are
        left empty: ``planning.metrics.with_metrics`` recomputes them from the steps (plan_npz.load_plan does)."""
        if d.get("version", PLAN_VERSION) != PLAN_VERSION:
            raise UserError(f"plan version {d.get('version')!r} is not the version {PLAN_VERSION} this code reads; "
                            "re-run python -m data_tools.pack to rebuild the plan")
        cfg = PlanConfig.from_record(d)
        lengths = np.asarray(d["lengths"], np.int64)
        pack_sizes, flat, step_sizes, step_packs, step_group, pack_group = [], [], [], [], [], []
        p = 0
        for step in d["steps"]:
            g = int(step["group"])
            reps = step["replicas"]
            m = max((len(x) for x in reps), default=0)  # unequal only for bytescale (padded with [])
            for k in range(m):
                for r in range(len(reps)):
                    pk = reps[r][k] if k < len(reps[r]) else []
                    pack_sizes.append(len(pk))
                    flat.extend(pk)
                    step_packs.append(p)
                    pack_group.append(g)
                    p += 1
            step_sizes.append(m * len(reps))
            step_group.append(g)
        dropped = d.get("dropped", [])
        known = {"version", "world_size", "strategy", "seed", "max_len", "global_tokens", "step_tokens",
                 "curriculum_steps", "groups", "balance", "step_mix", "isf_rounds", "isf_threshold",
                 "steps", "dropped", "deferred", "num_samples", "empty_packs", "lengths", "metrics", "step_metrics"}
        plan = cls(
            config=cfg, lengths=lengths,
            pack_ptr=np.concatenate([[0], np.cumsum(pack_sizes, dtype=np.int64)]).astype(np.int64),
            pack_samples=np.asarray(flat, np.int64), pack_group=np.asarray(pack_group, np.int32),
            step_ptr=np.concatenate([[0], np.cumsum(step_sizes, dtype=np.int64)]).astype(np.int64),
            step_packs=np.asarray(step_packs, np.int64), step_group=np.asarray(step_group, np.int32),
            optimizer_step=(np.asarray([int(s["optimizer_step"]) for s in d["steps"]], np.int64)
                            if d["steps"] and "optimizer_step" in d["steps"][0] else None),
            dropped=np.asarray([x["index"] for x in dropped], np.int64),
            dropped_reason=[x["reason"] for x in dropped], deferred=list(d.get("deferred", [])),
            extra={k: v for k, v in d.items() if k not in known},
        )
        return plan

    @classmethod
    def from_json(cls, path: str | Path) -> "Plan":
        with open(path) as f:
            return cls.from_dict(json.load(f))


def check_lengths(lengths) -> np.ndarray:
    """Lengths as int64; UserError (one line) for non-integers, zero or negative lengths."""
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise UserError(f"lengths must be a 1-D sequence, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.issubdtype(arr.dtype, np.floating) or np.any(arr != np.round(arr)):
            raise UserError("lengths must be integers")
    arr = arr.astype(np.int64, copy=False)  # no copy of an int64 input: a 10M-sample plan keeps one lengths array
    bad = np.flatnonzero(arr <= 0)
    if len(bad):
        raise UserError(f"lengths: sample {int(bad[0])} has length {int(arr[bad[0]])}; every sample needs >= 1 token")
    return arr
