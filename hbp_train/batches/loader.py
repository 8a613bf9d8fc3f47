"""Packed-shard loader and collate: this rank's micro-batches for optimizer step ``s``.

Reads ``OUT/plan.json`` (or the binary ``OUT/plan.npz``, memory-mapped: planning/plan_npz.py) and the memory-mapped ``OUT/group_<g>/`` datasets written by ``data_tools.pack --shards``
(formats: docs/architecture.md). For step ``s`` in group ``g`` (SP degree ``sp``), this rank serves replica
``r = rank // sp`` and gets that replica's packs, one micro-batch each. The step's global loss-token and sample
counts come from the plan and the shard metadata, so every rank knows them without a collective. An optimizer step
is one plan step, or several of different groups when the plan mixes groups (plan steps with the same
"optimizer_step", hbp step_mix="mixed"): its micro-batches are those of its plan steps one after the other, each
tagged with its group's "sp", "group", "ckpt_layers", "pack_len" and memory levers ("tiled_mlp",
"offload_activations"; the trainer switches the SP degree and the levers between them), and its global counts cover
all of them. A pack becomes a micro-batch in collate.py.

Legend: T = tokens in a pack, n = samples in a pack, m = micro-batches (packs) per replica in a step.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from typing import Optional

import numpy as np

from hbp_train.batches.collate import StepBatch, collate_pack, empty_micro_batch, token_mean_divisors
from hbp_train.batches.columns import int_column
from hbp_train.common.errors import UserError
from hbp_train.planning.plan import LEVER_KEYS


@dataclass
class DataConfig:
    """Where the packed shards are and how they are read."""

    shards: str = "???"
    """Packed-shard directory written by ``data_tools.pack --shards OUT`` (holds plan.json and group_<g>/)."""
    epochs: int = 1
    """How many times the plan's steps are run. The plan is one pass over the data; every epoch runs all its steps
    again (see shuffle_epochs)."""
    check_counts: bool = True
    """Check each pack's stored num_loss_tokens against its labels when it is loaded (cheap; catches stale shards)."""
    shuffle_epochs: bool = True
    """Epochs after the first run the plan's steps in a new order (seeded by train.seed and the epoch, so a resume
    is exact); each step keeps its packs, so its balance holds. False replays the plan's order every epoch. The
    first epoch always follows the plan, curriculum included."""
    eval_shards: Optional[str] = None
    """Packed held-out shards (data_tools.pack --shards on held-out data, same --world-size, SP degrees among the
    training plan's or not): their token-mean loss is logged as loss/eval every train.eval_every steps and at the
    end. None = no held-out loss during training."""

    def __post_init__(self):
        if not isinstance(self.shards, str) or not self.shards or self.shards == "???":
            raise UserError("data.shards: set it to a packed-shard directory (data_tools.pack --shards OUT)")
        if self.eval_shards is not None and (not isinstance(self.eval_shards, str) or not self.eval_shards):
            raise UserError("data.eval_shards: a packed-shard directory of held-out data, or null")
        if self.epochs < 1:
            raise UserError(f"data.epochs={self.epochs}: must be >= 1")


def shards_dir_problem(path: str) -> Optional[str]:
    """Why ``path`` is not a packed-shard folder (one holding plan.json or plan.npz), with the fix; None if it is.
    Checked by the loader and, before any worker starts, by python -m hbp_train.config (config.check_paths)."""
    if any(os.path.isfile(os.path.join(path, name)) for name in ("plan.json", "plan.npz")):
        return None
    what = ("no such folder" if not os.path.exists(path) else "a file, not a folder" if not os.path.isdir(path)
            else "no plan.json there")
    hint = (" (it is a tokenized dataset: plan and pack it first)"
            if os.path.isfile(os.path.join(path, "report.json")) else "")
    return (f"{what}{hint}; write packed shards with data_tools.pack --dataset TOKENIZED_DIR --shards OUT_DIR and "
            "pass that OUT_DIR")


def verify_shards(path: str) -> None:
    """Check the folder's files against its checksums.json before anything reads them (batches/shards.py): a
    damaged file is a UserError naming it. Under torch.distributed the ranks share the hashing (collective: every
    rank opens the same shards in the same order). Shards without checksums.json load with a one-line warning."""
    import torch.distributed as dist

    from hbp_train.batches.shards import CHECKSUMS, verify_checksums

    rank, world = (dist.get_rank(), dist.get_world_size()) if dist.is_available() and dist.is_initialized() else (0, 1)

    def gather(value) -> list:
        values = [None] * world
        dist.all_gather_object(values, value)
        return values

    if verify_checksums(path, rank, world, gather if world > 1 else (lambda x: [x])) is None and rank == 0:
        print(f"[data] warning: {path} has no {CHECKSUMS} (packed by an older hbp-pack): a damaged file would go "
              f"unnoticed; re-run data_tools.pack --shards {path} to add it", file=sys.stderr, flush=True)


def _is_empty_row(row) -> bool:
    return row is None or (isinstance(row, (int, np.integer)) and row < 0)


class _LazyStepMetrics:
    """plan.json's per-step metric dicts, read from a binary plan's per-step arrays one step at a time."""

    def __init__(self, arrays: dict, num_steps: int):
        self.arrays, self.num_steps = arrays, num_steps

    def __len__(self) -> int:
        return self.num_steps

    def __getitem__(self, s: int) -> dict:
        return {k: v[s].item() for k, v in self.arrays.items()}


class PackedData:
    """The packed shards of one plan: plan.json (or the binary plan.npz, memory-mapped) plus one memory-mapped HF
    dataset per group."""

    def __init__(self, path: str, check_counts: bool = True, shuffle_epochs: bool = False, seed: int = 0):
        self.path = path
        self.check_counts = check_counts
        self.shuffle_epochs = shuffle_epochs
        self.seed = seed
        self._orders: dict[int, np.ndarray] = {}
        self._datasets = {}
        self._loss_tokens = {}
        self._npz: dict | None = None  # the memory-mapped arrays of a binary plan (plan.npz), else None
        if os.path.isfile(os.path.join(path, "plan.npz")):
            verify_shards(path)
            self._open_npz(os.path.join(path, "plan.npz"))
            self._check_rows()
            return
        plan_path = os.path.join(path, "plan.json")
        problem = shards_dir_problem(path)
        if problem:
            raise UserError(f"data.shards={path}: {problem}")
        verify_shards(path)
        try:
            with open(plan_path) as f:
                self.plan = json.load(f)
        except json.JSONDecodeError as exc:
            raise UserError(f"{plan_path}: invalid JSON at line {exc.lineno} ({exc.msg}); rewrite it with "
                            f"data_tools.pack --shards {path}") from None
        except UnicodeDecodeError:
            raise UserError(f"{plan_path}: not UTF-8 text; rewrite it with data_tools.pack --shards {path}") from None
        except OSError as exc:
            raise UserError(f"{plan_path}: cannot read ({exc.strerror}); check data.shards and its permissions") \
                from None
        from hbp_train.planning.plan import PLAN_VERSION

        if (not isinstance(self.plan, dict) or self.plan.get("version", PLAN_VERSION) != PLAN_VERSION
                or not isinstance(self.plan.get("steps"), list) or not isinstance(self.plan.get("groups"), list)):
            raise UserError(f"{plan_path}: not a version-{PLAN_VERSION} plan; rewrite the shards with "
                            f"data_tools.pack --shards {path}")
        self.groups = self.plan["groups"]
        self.steps = self.plan["steps"]
        if not self.steps:
            raise UserError(f"{plan_path}: the plan has no steps")
        for s, step in enumerate(self.steps):
            if "rows" not in step:
                raise UserError(f"{plan_path}: steps[{s}] has no 'rows': this is a plan, not packed shards "
                                f"(run data_tools.pack --shards {path})")
        self.step_metrics = self.plan.get("step_metrics") or [{} for _ in self.steps]
        self._set_optimizer_steps([s.get("optimizer_step", i) for i, s in enumerate(self.steps)], plan_path)
        self._check_rows()

    def _open_npz(self, plan_path: str) -> None:
        """Read a binary plan (planning/plan_npz.py): a small JSON header, the CSR arrays memory-mapped. Steps are
        built on demand (``_step_entry``), so a 10M-sample plan opens in milliseconds on every rank."""
        from hbp_train.planning.plan_npz import open_npz

        header, arrays = open_npz(plan_path)
        if "pack_row" not in arrays:
            raise UserError(f"{plan_path}: a plan without shard rows, not packed shards (run data_tools.pack "
                            f"--shards {self.path} --plan-format npz)")
        if len(arrays["step_group"]) == 0:
            raise UserError(f"{plan_path}: the plan has no steps")
        self.plan = {**header, **header.get("extra", {})}  # extra keys top-level, as plan.json has them
        self.groups = self.plan["groups"]
        self._npz = arrays
        self._replicas = np.array([self.world_size // int(g.get("sp", 1)) for g in self.groups], np.int64)
        names = header.get("step_metrics", [])
        self._step_metric_arrays = {k: arrays[f"step_metric_{k}"] for k in names}
        self.step_metrics = _LazyStepMetrics(self._step_metric_arrays, len(arrays["step_group"]))
        num_plan_steps = len(arrays["step_group"])
        self._set_optimizer_steps(arrays["optimizer_step"] if "optimizer_step" in arrays else np.arange(num_plan_steps),
                                  plan_path)

    def _set_optimizer_steps(self, optimizer_step, where: str) -> None:
        """CSR of the optimizer steps over the plan steps: optimizer step k runs plan steps _opt_ptr[k]..[k+1]."""
        opt = np.asarray(optimizer_step, np.int64)
        if len(opt) and (opt[0] != 0 or np.any((np.diff(opt) != 0) & (np.diff(opt) != 1))):
            raise UserError(f"{where}: the steps' optimizer_step must count 0, 1, 2, ... in order; rewrite the "
                            f"shards with data_tools.pack --shards {self.path}")
        self._opt_ptr = np.r_[0, np.flatnonzero(np.diff(opt)) + 1, len(opt)].astype(np.int64)

    def _step_entry(self, s: int) -> dict:
        """Step ``s`` as plan.json lists it: {"group", "replicas": [[samples of each pack]], "rows": [[row]]}."""
        if self._npz is None:
            return self.steps[s]
        a = self._npz
        g = int(a["step_group"][s])
        r = int(self._replicas[g])
        ids = np.asarray(a["step_packs"][int(a["step_ptr"][s]):int(a["step_ptr"][s + 1])], np.int64).reshape(-1, r).T
        ptr, flat = a["pack_ptr"], a["pack_samples"]
        packs = [[np.asarray(flat[int(ptr[p]):int(ptr[p + 1])]).tolist() for p in rep] for rep in ids.tolist()]
        if self.plan.get("unequal_micro_batches"):  # as in plan.json: a replica lists its own packs only
            packs = [[pk for pk in rep if pk] for rep in packs]
        entry = {"group": g, "replicas": packs, "rows": np.asarray(a["pack_row"])[ids].tolist()}
        if "optimizer_step" in a:
            entry["optimizer_step"] = int(a["optimizer_step"][s])
        return entry

    def _check_rows(self) -> None:
        """Open every group now and check that the plan's rows exist: damaged or stale shards fail here, in one
        line naming the directory, before any model is built, instead of at the first step that reads them."""
        wanted: dict[int, int] = {}
        if self._npz is not None:  # vectorised over the memory-mapped arrays: the highest row of every group
            rows, group = np.asarray(self._npz["pack_row"]), np.asarray(self._npz["pack_group"])
            for g in np.unique(group).tolist():
                wanted[int(g)] = int(rows[group == g].max())
        for step in (self.steps if self._npz is None else []):
            rows = [int(r) for replica in step["rows"] for r in replica if not _is_empty_row(r)]
            if rows:
                g = int(step["group"])
                wanted[g] = max(wanted.get(g, -1), max(rows))
        for g, top in sorted(wanted.items()):
            num_rows = len(self.dataset(g))
            if top >= num_rows:
                raise UserError(f"{self.path}/group_{g}: plan.json reads row {top} but the shard has {num_rows} rows "
                                f"(stale shards: rewrite them with data_tools.pack --shards {self.path})")

    @property
    def world_size(self) -> int:
        return int(self.plan["world_size"])

    @property
    def num_steps(self) -> int:
        """Optimizer steps of the plan (= plan steps unless the plan mixes groups in a step)."""
        return len(self._opt_ptr) - 1

    @property
    def num_plan_steps(self) -> int:
        return int(self._opt_ptr[-1])

    def plan_steps_of(self, opt_step: int) -> range:
        """The plan steps optimizer step ``opt_step`` runs, in order."""
        return range(int(self._opt_ptr[opt_step]), int(self._opt_ptr[opt_step + 1]))

    def sample_lengths(self) -> Optional[np.ndarray]:
        """Every sample's token length as the plan lists it ("lengths"), or None for a plan without them. From a
        binary plan this is its memory-mapped array (or a view decoding its compact layout; planning/plan_npz.py):
        index it with the samples you need rather than reading it whole (10M samples would be 80 MB a rank)."""
        if self._npz is not None:
            return self._npz["lengths"]
        lengths = self.plan.get("lengths")
        return None if lengths is None else np.asarray(lengths, np.int64)

    def step_samples(self, opt_step: int) -> np.ndarray:
        """The sample indices of every pack of optimizer step ``opt_step`` (all its plan steps, all replicas)."""
        entries = [self._step_entry(s) for s in self.plan_steps_of(opt_step)]
        return np.asarray([i for e in entries for replica in e["replicas"] for pack in replica for i in pack], np.int64)

    def max_micro_batches(self) -> int:
        """The most micro-batches (packs) a replica runs in one optimizer step of the plan (empty packs included):
        1 means no step sums gradients over micro-batches (build.py then lets bf16 gradients accumulate in bf16)."""
        if self._npz is not None:  # slot-major step_packs: a plan step's packs over its group's replicas
            a = self._npz
            per_plan_step = np.diff(np.asarray(a["step_ptr"], np.int64)) // self._replicas[np.asarray(a["step_group"])]
        else:
            per_plan_step = np.array([max(len(r) for r in step["rows"]) for step in self.steps], np.int64)
        return int(np.add.reduceat(per_plan_step, self._opt_ptr[:-1]).max())

    def sp_degrees(self) -> list:
        return sorted({int(g.get("sp", 1)) for g in self.groups})

    def dataset(self, group: int):
        """The group's packed dataset, opened (memory-mapped) on first use."""
        if group not in self._datasets:
            from datasets import load_from_disk

            gdir = os.path.join(self.path, f"group_{group}")
            if not os.path.isdir(gdir):
                raise UserError(f"{self.path}: missing {gdir} for group {group} of plan.json")
            try:
                ds = load_from_disk(gdir).with_format("numpy")
                loss_tokens = int_column(ds, "num_loss_tokens")
            except Exception as exc:  # a truncated or foreign file: name it, whatever the reader raised
                raise UserError(f"{gdir}: cannot read the packed shard ({type(exc).__name__}: {exc}); rewrite it "
                                f"with data_tools.pack --shards {self.path}") from None
            self._datasets[group] = ds
            self._loss_tokens[group] = loss_tokens
        return self._datasets[group]

    def pack_loss_tokens(self, group: int, row) -> int:
        if _is_empty_row(row):
            return 0
        self.dataset(group)
        return int(self._loss_tokens[group][row])

    def plan_step(self, step: int) -> int:
        """The plan's optimizer step that global step ``step`` runs: epoch 0 in plan order, later epochs in their own
        seeded order when shuffle_epochs (the same on every rank and after a resume: it depends only on seed and
        epoch)."""
        return self.epoch_step(*divmod(step, self.num_steps))

    def epoch_step(self, epoch: int, index: int) -> int:
        """The plan's optimizer step that runs ``index``-th in epoch ``epoch`` (see plan_step)."""
        if epoch == 0 or not self.shuffle_epochs:
            return index
        if epoch not in self._orders:
            self._orders[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_steps)
        return int(self._orders[epoch][index])

    def epoch_of(self, step: int) -> int:
        """The epoch (0-based) global step ``step`` is in."""
        return step // self.num_steps

    def run_steps(self, epochs: int) -> int:
        """Optimizer steps of a run of ``epochs`` epochs (before train.max_steps)."""
        return self.num_steps * epochs

    def step_batch(self, step: int, rank: int, pad_token_id: int = 0, equal_counts: bool = True) -> StepBatch:
        """This rank's micro-batches for global step ``step`` and the step's global counts.

        ``equal_counts``: give every replica the step's largest micro-batch count, padding with empty micro-batches
        (ZeRO-2/3 meet in a collective after every micro-batch). False: only this replica's own packs, for plans
        with unequal counts (bytescale) under ZeRO-1, where ranks meet once per step."""
        opt_step = self.plan_step(step)
        parts = [self._plan_step_batch(s, rank, pad_token_id, equal_counts) for s in self.plan_steps_of(opt_step)]
        first = parts[0]
        if len(parts) > 1:
            token_mean_divisors(parts, rank, self.world_size)
        micro_batches = [mb for part in parts for mb in part["micro_batches"]]
        metrics = [self.step_metrics[s] if s < len(self.step_metrics) else {} for s in self.plan_steps_of(opt_step)]
        return StepBatch(
            step=step, plan_step=opt_step, group=first["group"], sp=first["sp"], replica=first["replica"],
            micro_batches=micro_batches, rank_loss_tokens=sum(mb["num_loss_tokens"] for mb in micro_batches),
            rank_num_samples=sum(mb["num_samples"] for mb in micro_batches),
            global_loss_tokens=sum(p["global_loss_tokens"] for p in parts),
            global_num_samples=sum(p["global_num_samples"] for p in parts), dp_size=first["dp_size"],
            ckpt_layers=first["ckpt_layers"], tiled_mlp=first["tiled_mlp"],
            offload_activations=first["offload_activations"], plan_metrics=_combined_step_metrics(metrics),
            num_packs=sum(p["num_packs"] for p in parts), capacity_tokens=sum(p["capacity_tokens"] for p in parts),
        )

    def _plan_step_batch(self, plan_step: int, rank: int, pad_token_id: int, equal_counts: bool) -> dict:
        """This rank's micro-batches of one plan step (tagged with the step's sp, group and ckpt_layers) and the plan
        step's global counts."""
        entry = self._step_entry(plan_step)
        group = int(entry["group"])
        sp = int(self.groups[group].get("sp", 1))
        replica = rank // sp
        rows = entry["rows"]
        packs = entry["replicas"]
        dp_size = len(rows)
        if dp_size != self.world_size // sp:
            raise UserError(f"{self.path}/plan.json: step {plan_step} has {dp_size} replicas, expected "
                            f"world_size/sp = {self.world_size}//{sp}")
        # m is the same for all replicas except in bytescale plans, whose JSON omits a replica's trailing empty packs
        num_micro = max(len(r) for r in rows) if equal_counts else max(1, len(rows[replica]))
        ds = self.dataset(group)
        ckpt_layers = self.groups[group].get("ckpt_layers")
        # the group's memory levers (model/levers.py) and pack length (the tiled MLP's tile count comes from it)
        levers = {key: bool(self.groups[group].get(key, False)) for key in LEVER_KEYS}
        micro_batches = []
        for k in range(num_micro):
            row = rows[replica][k] if k < len(rows[replica]) else None
            # Empty packs ([] in the plan, a zero-token row in the shards) become a dummy micro-batch.
            if _is_empty_row(row) or (k < len(packs[replica]) and len(packs[replica][k]) == 0):
                micro_batch = empty_micro_batch(pad_token_id)
            else:
                record = ds[int(row)]
                if len(record["input_ids"]) == 0:
                    micro_batch = empty_micro_batch(pad_token_id)
                else:
                    micro_batch = collate_pack(record, self.check_counts, f"{self.path}/group_{group} row {row}")
            micro_batch.update(sp=sp, group=group, ckpt_layers=ckpt_layers,
                               pack_len=int(self.groups[group]["pack_len"]), **levers)
            micro_batches.append(micro_batch)
        num_packs = max(len(r) for r in rows) * dp_size
        replica_loss_tokens = [sum(self.pack_loss_tokens(group, row) for row in r) for r in rows]
        return {"micro_batches": micro_batches, "group": group, "sp": sp, "replica": replica, "dp_size": dp_size,
                "ckpt_layers": ckpt_layers, **levers, "num_packs": num_packs,
                "capacity_tokens": num_packs * int(self.groups[group]["pack_len"]),
                "replica_loss_tokens": replica_loss_tokens, "global_loss_tokens": sum(replica_loss_tokens),
                "global_num_samples": sum(len(p) for r in packs for p in r)}


def _combined_step_metrics(metrics: list) -> dict:
    """The plan's step metrics of an optimizer step from those of its plan steps: ABR/DBR averaged over their slots
    (weighted by micro-batches), tokens and micro-batches summed, anything else from the first plan step."""
    if len(metrics) == 1:
        return dict(metrics[0])
    out = dict(metrics[0])
    weight = [float(m.get("micro_batches", 1)) for m in metrics]
    for key in ("ABR", "DBR"):
        if all(key in m for m in metrics):
            out[key] = sum(w * m[key] for w, m in zip(weight, metrics)) / sum(weight)
    for key in ("tokens", "micro_batches"):
        if all(key in m for m in metrics):
            out[key] = sum(m[key] for m in metrics)
    return out
