"""bench/speed/bench_speed.py's replay: W ranks this machine does not have, their real packs timed one after another on its
CPU. MEASURED COMPUTE, MODELLED WAITING: a replayed step is not a cluster run.

For each W (8 and 32) every strategy plans the same samples (the bench's pool, larger than a measured run's: at
W = 32 a one-pack step is 32 long packs) with the measured runs' groups, one long pack per rank per step and seed 0.
Optimizer steps are drawn (seeded, the same number for every strategy of a W) until timing them would take the
replay's time budget by the calibrated cost model (``draw_steps``). Every distinct non-empty pack of every rank in
those steps (a pack of the same samples in two plans, e.g. one long document alone, is timed once) runs through the
real model, the trainer's program without DeepSpeed (the decoder with packed attention, the
chunked LM-head loss, backward: calibrate's ``--validate`` step), in NPROC processes side by side with one torch
thread each, as the calibration measured and the training ranks run. Each process runs its share ``repeats``
times, every pass in a new shuffled order of all strategies' packs (a drift of the machine's speed spreads over
every strategy), and keeps each pack's fastest time (a burst of other work on a shared machine, which would raise
the maximum of a slot's many packs, rarely hits every pass). Then (``replay_step_seconds``), per drawn step:

    replayed = simulated - Σ_slots simulated slot + Σ_slots max over replicas (scale x measured + pack cost)

where simulated is the simulator's step time with this machine's fitted step costs (scale, per pack, per
micro-batch, per step, data) and ZeRO-2's collectives at W: the replay puts the measured pack times where the
simulator puts the cost model's, and keeps everything else (the collectives at W are modelled, never measured).
The simulator's figure for the same steps is ``simulated``. The drawn steps differ from strategy to strategy, so
their own tokens/s are not compared across strategies (a drawn step of short documents is fast whatever the
strategy): bench/speed/report.py's ``replay_figures`` scales each strategy's whole simulated plan by its measured
over simulated time on its drawn steps (a ratio estimate) and compares those.

``python -m bench.speed.replay --worker JOBS.json OUT.json`` is one timing process (the bench starts them).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
WARMUP_PACKS = 2  # packs run untimed first: allocations and first calls


def plan_all(lengths: np.ndarray, strategies: list, world: int, groups: list, model, slots_per_rank: int,
             seed: int) -> dict:
    """{strategy: Plan} of ``lengths`` at ``world`` ranks, as data_tools.pack makes them in the measured runs (hbp
    balancing the calibrated pack time; kk on veRL's workload)."""
    from hbp_train.perf.cost_model import pack_cost_fn
    from hbp_train.planning import GroupSpec, PlanConfig, make_plan

    specs = [GroupSpec.from_dict(g) for g in groups]
    budget = slots_per_rank * world * specs[-1].pack_len
    out = {}
    for strategy in strategies:
        cost = pack_cost_fn(model) if strategy == "hbp" else None
        out[strategy] = make_plan(lengths, PlanConfig(world_size=world, groups=specs, strategy=strategy,
                                                      global_tokens=budget, seed=seed, pack_cost=cost))
    return out


def draw_steps(plans: dict, pack_seconds: dict, budget_s: float, nproc: int, seed: int) -> dict:
    """Optimizer steps to replay, {W: {strategy: ascending step indices}} of ``plans`` ({W: {strategy: Plan}}):
    every W in turn draws each strategy's next step (a seeded random order of its steps) while the predicted time
    of timing them all (``pack_seconds``: {W: {strategy: predicted seconds of every pack}}, shared by ``nproc``
    processes; a pack already timed for another step or plan costs nothing more) stays within ``budget_s``; at
    least one step each, and the same number for every strategy of a W (so the strategies of a W are measured
    alike)."""
    rng = np.random.default_rng(seed)
    order = {(w, s): rng.permutation(p.num_optimizer_steps) for w, by in plans.items() for s, p in by.items()}
    timed = set()

    def untimed(w, n) -> list[dict]:
        """Per strategy of W, {pack_key: predicted seconds} of its n-th drawn step's packs not timed yet."""
        out = []
        for s, plan in plans[w].items():
            new = {}
            for p in step_packs(plan, int(order[w, s][n])).tolist():
                key = pack_key(plan.pack(p))
                if key is not None and key not in timed:
                    new[key] = float(pack_seconds[w][s][p])
            out.append(new)
        return out

    def take(per_strategy: list[dict]) -> float:
        """Mark the packs timed; their seconds (a pack two strategies share counted once) per process."""
        merged = {}
        for new in per_strategy:
            for key, seconds in new.items():
                merged.setdefault(key, seconds)
        timed.update(merged)
        return sum(merged.values()) / nproc

    count = {w: 1 for w in plans}
    spent = sum(take(untimed(w, 0)) for w in plans)
    growing = True
    while growing:
        growing = False
        for w, by in plans.items():
            n = count[w]
            if all(n < len(order[w, s]) for s in by):
                per_strategy = untimed(w, n)
                # An upper bound: a pack shared by two strategies counted twice.
                if spent + sum(sum(new.values()) for new in per_strategy) / nproc <= budget_s:
                    spent += take(per_strategy)
                    count[w], growing = n + 1, True
    return {w: {s: np.sort(order[w, s][:count[w]]) for s in by} for w, by in plans.items()}


def pack_key(samples) -> str | None:
    """What a pack's measured time is kept under: its samples, in order (their lengths and tokens are all that its
    time depends on); None for an empty pack, which is never run."""
    samples = [int(i) for i in samples]
    return ",".join(map(str, samples)) if samples else None


def step_packs(plan, step: int) -> np.ndarray:
    """The pack ids of optimizer step ``step`` (every plan step of it, slot-major)."""
    members = np.flatnonzero(plan.optimizer_steps() == step)
    return np.concatenate([plan.step_packs[plan.step_ptr[p]:plan.step_ptr[p + 1]] for p in members])


def replay_step_seconds(plan, sim, steps: np.ndarray, measured: np.ndarray, costs) -> np.ndarray:
    """Replayed seconds of optimizer ``steps`` (module docstring): ``sim`` is the simulator's result for ``plan``
    (with ``costs``), ``measured`` the measured seconds of every pack (NaN where not measured; an empty pack is 0)."""
    opt_of_slot = sim.slot_step  # the optimizer step of every slot
    out = []
    runs = np.ones(len(plan.step_packs), bool)
    if plan.unequal_micro_batches:  # a replica runs only its own packs (simulator.py)
        runs = np.diff(plan.pack_ptr)[plan.step_packs] > 0
    for step in steps.tolist():
        slots = np.flatnonzero(opt_of_slot == step)
        replayed = sim.step_seconds[step] - sim.slot_seconds[slots].sum()
        for i in slots.tolist():
            lo, hi = sim.slot_ptr[i], sim.slot_ptr[i + 1]
            packs = plan.step_packs[lo:hi]
            times = costs.compute_scale * np.nan_to_num(measured[packs], nan=0.0) + costs.pack_s * runs[lo:hi]
            if np.isnan(measured[packs][np.diff(plan.pack_ptr)[packs] > 0]).any():
                raise ValueError(f"step {step}: a pack was not measured")
            replayed += times.max()
        out.append(replayed)
    return np.array(out)


def jobs_for(plans: dict, drawn: dict) -> list:
    """One job per distinct non-empty pack of the drawn steps of ``plans`` ({strategy: Plan}, or several W's plans
    through ``drawn`` {strategy: steps} of each): {"key": pack_key, "samples"}."""
    jobs = {}
    for strategy, plan in plans.items():
        packs = np.unique(np.concatenate([step_packs(plan, s) for s in drawn[strategy].tolist()]))
        for p in packs.tolist():
            samples = plan.pack(p).tolist()
            key = pack_key(samples)
            if key is not None:
                jobs.setdefault(key, {"key": key, "samples": samples})
    return list(jobs.values())


def measured_pack_seconds(plan, times: dict) -> np.ndarray:
    """Every pack's measured seconds from ``times`` ({pack_key: seconds}): 0 for an empty pack, NaN where none."""
    out = np.full(plan.num_packs, np.nan)
    for p in range(plan.num_packs):
        key = pack_key(plan.pack(p))
        out[p] = 0.0 if key is None else times.get(key, np.nan)
    return out


def time_jobs(jobs: list, dataset: Path, shape_json: str, work: Path, nproc: int, env: dict, repeats: int,
              seed: int = 0) -> dict:
    """Run ``jobs`` (every W's, every strategy's) in ``nproc`` worker processes side by side, each ``repeats``
    times: {key: the fastest seconds}. The jobs are dealt longest first to the process with the fewest tokens, so
    both end together, and each process runs its share in a new shuffled order every pass."""
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(jobs))
    tokens = np.zeros(nproc)
    shares = [[] for _ in range(nproc)]
    lengths = _lengths(dataset)
    size = {j["key"]: int(lengths[j["samples"]].sum()) for j in jobs}
    for i in sorted(order.tolist(), key=lambda i: -size[jobs[i]["key"]]):
        k = int(np.argmin(tokens))
        shares[k].append(jobs[i])
        tokens[k] += size[jobs[i]["key"]]
    work.mkdir(parents=True, exist_ok=True)
    procs = []
    for k, share in enumerate(shares):
        spec = work / f"jobs{k}.json"
        spec.write_text(json.dumps({"dataset": str(dataset), "shape": shape_json, "seed": seed, "repeats": repeats,
                                    "jobs": share}))
        log = open(work / f"worker{k}.log", "w")
        procs.append((subprocess.Popen([sys.executable, "-m", "bench.speed.replay", "--worker", str(spec),
                                        str(work / f"times{k}.json")], cwd=REPO, env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    failed = []
    for k, (proc, log) in enumerate(procs):
        if proc.wait() != 0:
            failed.append(k)
        log.close()
    if failed:
        sys.exit(f"bench_speed: replay worker {failed[0]} failed:\n"
                 f"{(work / f'worker{failed[0]}.log').read_text()[-3000:]}")
    times = {}
    for k in range(nproc):
        times.update(json.loads((work / f"times{k}.json").read_text()))
    return times


def _lengths(dataset: Path) -> np.ndarray:
    import datasets

    from hbp_train.batches.columns import int_column

    return int_column(datasets.load_from_disk(str(dataset)), "length")


def _worker(spec_path: str, out_path: str) -> None:
    """One timing process: the model of the shape, every job's pack (the samples' real tokens, positions restarting
    per sample) run forward and backward after WARMUP_PACKS untimed ones, in ``repeats`` passes of a new shuffled
    order each (long and short packs mixed over the run); {key: its fastest seconds} to ``out_path``."""
    import datasets
    import torch
    from transformers import LlamaForCausalLM

    from hbp_train.model.attention_setup import register_packed_attention
    from hbp_train.batches.columns import list_column
    from hbp_train.common.labels import IGNORE_INDEX
    from hbp_train.model.loss import chunked_token_losses
    from hbp_train.model.hf_model import forward_hidden
    from hbp_train.perf.calibrate.timing import VALIDATE_LOSS_CHUNK, cu_seqlens_for, llama_config
    from hbp_train.perf.shape import parse_model_shape

    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    torch.manual_seed(spec["seed"])
    net = LlamaForCausalLM(llama_config(parse_model_shape(spec["shape"])))
    register_packed_attention(net, "auto", torch.device("cpu"))
    offsets, values = list_column(datasets.load_from_disk(spec["dataset"]), "input_ids")

    def run(samples):
        ids = np.concatenate([values[offsets[s]:offsets[s + 1]] for s in samples])
        lengths = [int(offsets[s + 1] - offsets[s]) for s in samples]
        input_ids = torch.as_tensor(ids, dtype=torch.long)[None]
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        cu = cu_seqlens_for(lengths, "cpu")
        shift = torch.cat([input_ids[0, 1:], input_ids[0, :1]])
        shift[cu[1:].long() - 1] = IGNORE_INDEX  # no sample predicts the next one
        hidden = forward_hidden(net, input_ids, pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths),
                                max_length_k=max(lengths))
        chunked_token_losses(hidden, net.get_output_embeddings().weight, shift, VALIDATE_LOSS_CHUNK).sum().backward()
        net.zero_grad(set_to_none=True)

    jobs = spec["jobs"]
    for job in jobs[:WARMUP_PACKS]:
        run(job["samples"])
    rng = np.random.default_rng(spec["seed"])
    times = {}
    for _ in range(spec["repeats"]):
        for i in rng.permutation(len(jobs)).tolist():
            t0 = time.perf_counter()
            run(jobs[i]["samples"])
            seconds = time.perf_counter() - t0
            times[jobs[i]["key"]] = min(seconds, times.get(jobs[i]["key"], seconds))
    Path(out_path).write_text(json.dumps(times))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3])
    else:
        sys.exit("usage: python -m bench.speed.replay --worker JOBS.json OUT.json (bench/speed/bench_speed.py starts it)")
