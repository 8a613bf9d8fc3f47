"""bench/speed/bench_speed.py's chain on this machine's CPU: data, calibration, profile, step costs, plans and shards,
training runs.

Every stage is the project's own command: the data tools, ``python -m hbp_train.perf.calibrate --device cpu``,
``python -m hbp_train.profiler profile.device=cpu``, ``data_tools.pack --groups auto --profile ... --calibration
...`` (its ``main``, in this process: planning is cheap, a new interpreter is not), the trainer through
``python -m hbp_train.launch`` (torchrun, gloo, the real DeepSpeed engine) and
``python -m hbp_train.perf.step_costs`` (the simulator's step costs, fitted on a run of samples the measured runs do
not train on). The processes compute with one torch thread each (OMP_NUM_THREADS=1: two ranks on two cores), the
calibration with as many processes at once as the training has ranks, so each measures what a rank meets: a
neighbour using the other core.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
NPROC = 2  # training processes (ranks): one per core of a 2-core machine
ZERO_STAGE = 2  # experiment=cpu_demo's DeepSpeed stage: the simulator models its collectives
THREADS = 1  # torch threads per rank: cores // NPROC
SHIPPED_TOKENIZER = REPO / "data_tools" / "assets" / "tokenizer"
# The code data's BPE vocabulary: small, so that the LM head (vocab x hidden per token) does not outweigh the
# decoder layers of the bench's small model.
CODE_VOCAB = 1024


def env() -> dict:
    """The environment of every stage: this checkout first on the path, offline, CPU only, one thread per process."""
    return dict(os.environ, PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false", OMP_NUM_THREADS=str(THREADS),
                CUDA_VISIBLE_DEVICES="", DS_ACCELERATOR="cpu")


def call(cmd: list, log: Path | None = None) -> str:
    """Run a command from the repository root; its output (also written to ``log``); on failure, stop with its tail."""
    res = subprocess.run([str(c) for c in cmd], cwd=REPO, env=env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(res.stdout)
    if res.returncode != 0:
        sys.exit(f"bench_speed: {' '.join(map(str, cmd[:5]))} ... failed ({res.returncode}):\n{res.stdout[-3000:]}")
    return res.stdout


@dataclass(frozen=True)
class Shape:
    """The trained model: a Llama built from this config (experiment=cpu_demo's tiny_llama, resized)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int

    def overrides(self) -> list:
        return [f"++model.config.hidden_size={self.hidden}", f"++model.config.num_hidden_layers={self.layers}",
                f"++model.config.num_attention_heads={self.heads}",
                f"++model.config.num_key_value_heads={self.kv_heads}",
                f"++model.config.intermediate_size={self.ffn}", "++model.config.max_position_embeddings=65536"]

    def json(self, vocab: int) -> str:
        """The shape for hbp_train.perf (parse_model_shape)."""
        return json.dumps({"name": f"bench-h{self.hidden}-l{self.layers}", "hidden": self.hidden,
                           "num_layers": self.layers, "num_heads": self.heads, "num_kv_heads": self.kv_heads,
                           "ffn": self.ffn, "vocab": vocab})


# ============================================================================================================ data
@dataclass
class Data:
    """The bench's samples, tokenized: a pool, the measured runs' training set and the step-cost calibration run's
    set drawn from it (disjoint), the held-out split, and the held-out eval set packed for the trainer."""

    kind: str
    """"code" (real text: data_tools.make_code_data) or "demo" (generated chats: data_tools.make_demo_data)."""
    pool: Path
    """Every training-split sample: the replay plans these (more than a measured run trains)."""
    train: Path
    """The measured runs' samples."""
    calib: Path
    """The step-cost calibration run's samples (none of them in ``train``)."""
    heldout: Path
    eval_shards: Path
    tokenizer: Path

    def train_set(self, samples: int) -> Path:
        """The measured runs' set of ``samples`` samples: the first ``samples`` of the seeded draw that made
        ``train`` (the largest set), so a smaller set is a subset of every larger one."""
        return self.train if samples == _sizes(self.train)[-1] else self.train.parent / f"{self.train.name}_{samples}"

    def lengths(self, which: str = "train") -> np.ndarray:
        import datasets

        from hbp_train.batches.columns import int_column

        return int_column(datasets.load_from_disk(str(getattr(self, which))), "length")

    def vocab(self) -> int:
        from transformers import AutoTokenizer

        return len(AutoTokenizer.from_pretrained(str(self.tokenizer)))


def _sizes(train: Path) -> list:
    return json.loads((train.parent / "subsets.json").read_text())["train"]


def make_data(root: Path, max_len: int, pool_samples: int, train_sizes: list, calib_samples: int,
              heldout_tokens: int) -> Data:
    """Real text from the Python standard library when the code data tool is there, else the generated demo
    chats with a long tail up to ``max_len``: a pool of ``pool_samples``, from which the measured runs' sets (of
    each of ``train_sizes`` samples, every smaller one a subset of the larger) and ``calib_samples`` others (the step-cost calibration run's) are drawn (seeded); made once under
    ``root``. The held-out eval set is the first held-out samples up to ``heldout_tokens`` tokens, packed for NPROC
    ranks."""
    code = (REPO / "data_tools" / "make_code_data.py").is_file()
    data = make_code_data(root / "code", max_len, pool_samples) if code else \
        make_demo_data(root / "demo", max_len, pool_samples)
    marker = data.train.parent / "subsets.json"
    wanted = {"train": sorted(set(train_sizes)), "calib": calib_samples}
    if not marker.is_file() or json.loads(marker.read_text()) != wanted:
        _draw_subsets(data, wanted["train"], calib_samples)
        marker.write_text(json.dumps(wanted))
    if not (data.eval_shards / "plan.json").is_file():
        _pack_heldout(data, max_len, heldout_tokens)
    return data


def _draw_subsets(data: Data, train_sizes: list, calib_samples: int) -> None:
    import datasets

    datasets.disable_progress_bars()
    pool = datasets.load_from_disk(str(data.pool))
    largest = train_sizes[-1]
    if largest + calib_samples > len(pool):
        sys.exit(f"bench_speed: the pool has {len(pool)} samples, fewer than the {largest} + {calib_samples} "
                 "the runs need")
    order = np.random.default_rng(0).permutation(len(pool))
    smaller = [(data.train.parent / f"{data.train.name}_{n}", order[:n]) for n in train_sizes[:-1]]
    for path, rows in [(data.train, order[:largest]), *smaller, (data.calib, order[largest:][:calib_samples])]:
        shutil.rmtree(path, ignore_errors=True)
        pool.select(np.sort(rows).tolist()).save_to_disk(str(path))


def make_code_data(root: Path, max_len: int, pool_samples: int) -> Data:
    tok = root / "tokenized"
    data = Data("code", tok / "train", root / "train_runs", root / "calib_run", tok / "heldout",
                root / "heldout_packed", root / "tokenizer")
    report = root / "report.json"
    made = json.loads(report.read_text()) if report.is_file() else {}
    if not (data.pool / "report.json").is_file() or (made.get("max_samples"), made.get("max_tokens")) != \
            (pool_samples, max_len):
        shutil.rmtree(root, ignore_errors=True)
        call([sys.executable, "-m", "data_tools.make_code_data", "--out", root, "--max-tokens", max_len,
              "--max-samples", pool_samples, "--vocab-size", CODE_VOCAB, "--seed", 0, "--tokenize"],
             root.parent / "make_code_data.log")
    return data


def make_demo_data(root: Path, max_len: int, pool_samples: int) -> Data:
    data = Data("demo", root / "pool", root / "train_runs", root / "calib_run", root / "heldout",
                root / "heldout_packed", SHIPPED_TOKENIZER)
    if (data.pool / "report.json").is_file():
        return data
    root.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    for name, n, seed in (("pool", pool_samples, 0), ("heldout", max(16, pool_samples // 8), 1)):
        raw = root / f"{name}.jsonl"
        call([py, "-m", "data_tools.make_demo_data", "--out", raw, "--num-samples", n, "--max-tokens", max_len,
              "--seed", seed, "--long-fraction", "0.15"])
        call([py, "-m", "data_tools.preprocess", "--input", raw, "--output", root / name, "--tokenizer",
              SHIPPED_TOKENIZER, "--max-len", max_len, "--overlong", "truncate"])
    return data


def _pack_heldout(data: Data, max_len: int, heldout_tokens: int) -> None:
    """The first held-out samples up to ``heldout_tokens`` tokens (the whole split if fewer), packed for NPROC ranks."""
    import datasets

    from data_tools import pack
    from hbp_train.batches.columns import int_column

    datasets.disable_progress_bars()
    ds = datasets.load_from_disk(str(data.heldout))
    keep = max(1, int(np.searchsorted(np.cumsum(int_column(ds, "length")), heldout_tokens, side="right")))
    subset = data.eval_shards.parent / "heldout_subset"
    shutil.rmtree(subset, ignore_errors=True)
    ds.select(range(min(keep, len(ds)))).save_to_disk(str(subset))
    shutil.rmtree(data.eval_shards, ignore_errors=True)
    _quiet(pack.main, ["--dataset", str(subset), "--shards", str(data.eval_shards), "--world-size", str(NPROC),
                       "--groups", f"{max_len}:1", "--strategy", "isf", "--quiet"])


def _quiet(main, argv: list) -> None:
    """A CLI's main in this process, its printing kept out of the bench's output; stop on failure."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        code = main(argv)
    if code != 0:
        sys.exit(f"bench_speed: {main.__module__} {' '.join(argv)} failed ({code}):\n{out.getvalue()[-3000:]}")


# ============================================================================= calibration, profile, plans
def calibrate(work: Path, shape_json: str, max_len: int, iters: int, rounds: int,
              reuse: bool) -> tuple[Path, dict]:
    """The CPU calibration of this shape (NPROC processes measuring together, THREADS threads each, ``rounds``
    rounds through every point) and its validation report; reused when ``reuse`` and the file was made for the same
    shape, threads and processes."""
    path, report = work / "calibration.json", work / "calibration_validate.json"
    if reuse and path.is_file() and report.is_file():
        old, shape = json.loads(path.read_text()), json.loads(shape_json)
        if ({k: old.get("model_shape", {}).get(k) for k in shape} == shape and old.get("threads") == THREADS
                and old.get("procs") == NPROC):
            return path, json.loads(report.read_text())
    doc_lens = sorted({64, 256, 1024, max_len // 4, max_len // 2, max_len} - {0})
    common = [sys.executable, "-m", "hbp_train.perf.calibrate", "--device", "cpu", "--threads", THREADS, "--procs",
              NPROC, "--model-shape", shape_json, "--tokens", max_len, "--iters", iters, "--warmup", 1,
              "--rounds", rounds]
    call(common + ["--doc-lens", ",".join(str(d) for d in doc_lens if d <= max_len), "--out", path],
         work / "calibrate.log")
    call(common + ["--validate", "--calibration", path, "--max-samples", min(64, max_len), "--num-packs", 5,
                   "--validate-out", report], work / "calibrate_validate.log")
    return path, json.loads(report.read_text())


def profile(work: Path, data: Data, shape: Shape, calibration: Path, max_len: int, min_len: int,
            dry_run: bool, reuse: bool) -> dict:
    """profile.json of the profiler's CPU back-end (the real model, sp=2 measured by NPROC ranks) or, with
    ``dry_run``, its analytic back-end on the CPU calibration; the groups it chose. Reused when made with the same
    command and calibration."""
    out, stamp = work / "profile.json", work / "profile.key.json"
    cmd = [sys.executable, "-m", "hbp_train.profiler", "experiment=cpu_demo", *shape.overrides(),
           f"model.tokenizer={data.tokenizer}", "profile.device=cpu", f"profile.world_size={NPROC}",
           f"profile.measure_devices={NPROC}", f"profile.gpus_per_node={NPROC}", f"profile.max_len={max_len}",
           f"profile.min_len={min_len}", f"profile.docs={data.train}", f"profile.calibration={calibration}",
           "profile.iters=1", "profile.warmup_iters=1", "profile.memory_metric=torch", "profile.device_memory_gb=8",
           f"profile.dry_run={str(dry_run).lower()}", "profile.progress=false", f"profile.output={out}",
           f"profile.zero_stages=[{ZERO_STAGE}]"]  # the stage train() runs (cpu_demo's), so the plan records it
    key = {"cmd": [str(c) for c in cmd[1:]], "calibration": calibration.read_text()}
    if not (reuse and out.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == key):
        call(cmd, work / "profile.log")
        stamp.write_text(json.dumps(key))
    return json.loads(out.read_text())


def plan(dataset: Path, out: Path, strategy: str, seed: int, groups: str, calibration: Path, profile_json: Path,
         step_tokens: int):
    """Packed shards of one strategy's plan of ``dataset`` through data_tools.pack (``groups`` "auto" reads the
    profile); hbp balances the calibrated pack time, kk veRL's workload 24576·s + s² (as veRL runs it: not our
    calibration). Returns the Plan."""
    from data_tools import pack
    from hbp_train.planning.plan_npz import load_plan

    shutil.rmtree(out, ignore_errors=True)
    cost = [] if strategy == "kk" else ["--calibration", str(calibration)]
    _quiet(pack.main, ["--dataset", str(dataset), "--shards", str(out), "--world-size", str(NPROC), "--groups",
                       groups, "--profile", str(profile_json), *cost, "--strategy", strategy, "--seed", str(seed),
                       "--global-tokens", str(step_tokens), "--no-baseline", "--quiet"])
    return load_plan(out / "plan.json")  # with its metrics, recomputed from the steps


def fit_step_costs(work: Path, data: Data, shape: Shape, calibration: Path, profile_json: Path, pack_len: int,
                   reuse: bool) -> Path:
    """The calibration with its step costs (hbp_train.perf.step_costs), fitted on a training run of the calibration
    set (samples no measured run trains on): hbp at one long pack per rank per step, whose steps range from one
    micro-batch (a slot of long packs with a few short ones) to many (short packs only) and whose packs from the
    shortest group's to the longest: what the fit needs to tell the per-pack, per-micro-batch and per-step costs
    apart. Reused when made from this calibration and profile."""
    out = work / "calibration_step_costs.json"
    key = {"calibration": calibration.read_text(), "profile": profile_json.read_text(), "data": str(data.calib)}
    stamp = work / "calibration_step_costs.key.json"
    if reuse and out.is_file() and stamp.is_file() and json.loads(stamp.read_text()) == key:
        return out
    run = work / "step_costs_run"
    plan(data.calib, run / "shards", "hbp", 99, "auto", calibration, profile_json, NPROC * pack_len)
    train(run / "shards", data, shape, run / "train", seed=99, eval_every=0)
    call([sys.executable, "-m", "hbp_train.perf.step_costs", "--run", run / "train", "--plan", run / "shards",
          "--calibration", calibration, "--out", out, "--zero-stage", ZERO_STAGE], work / "step_costs.log")
    stamp.write_text(json.dumps(key))
    return out


# =================================================================================================== training
def train(shards: Path, data: Data, shape: Shape, run_dir: Path, seed: int, eval_every: int) -> list:
    """Train the plan's every step once (one epoch) on NPROC CPU processes through hbp_train.launch; the run's
    metrics.jsonl rows. Held-out loss every ``eval_every`` steps (0: none); ``seed`` seeds the model's weights."""
    shutil.rmtree(run_dir, ignore_errors=True)
    evals = [f"data.eval_shards={data.eval_shards}", f"train.eval_every={eval_every}"] if eval_every else []
    call([sys.executable, "-m", "hbp_train.launch", "--standalone", "--nproc_per_node", NPROC, "-m",
          "hbp_train.train", "experiment=cpu_demo", *shape.overrides(), f"model.tokenizer={data.tokenizer}",
          f"model.seed={seed}", f"train.seed={seed}", f"data.shards={shards}", "data.epochs=1",
          f"train.out_dir={run_dir}", "train.save_final=false", "logging.progress_bar=false",
          "logging.tensorboard=false", "logging.log_every=1000000", *evals], run_dir.parent / f"{run_dir.name}.log")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def describe(shape: Shape, data: Data) -> dict:
    return {"shape": asdict(shape), "data": data.kind, "nproc": NPROC, "threads": THREADS}
