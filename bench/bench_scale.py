"""End to end at scale: raw chats -> tokenized -> plan + packed shards -> the first optimizer step of a 2-process CPU
run, at 1M and 10M samples: per stage its time and peak memory, per rank its time to the first step and its resident
memory with the plan memory-mapped.

    .venv/bin/python bench/bench_scale.py [--sizes 1000000,10000000] [--measured-max 1000000] [--work DIR]

Every stage is the project's own command (those of hbp_train/demo.py) run as a child process, measured with
os.wait4: wall time, CPU time of the process and the workers it waited for, and the peak RSS of the largest of them;
beside it the peak anonymous RSS of the command's own process (sampled), since RSS also counts the pages of the
memory-mapped files it reads, which the kernel drops when memory is short.

  raw          data_tools.make_demo_data --num-samples N: the input, not a stage of the pipeline (shown for scale)
  tokenize     data_tools.preprocess --num-proc 2 --max-len 2048 --overlong truncate
  plan+shards  data_tools.pack --dataset TOK --shards OUT --plan-format npz (W=2, groups 1024:1,2048:2, 8192 tokens a
               step: the CPU demo's), with the CPU seconds the CLI reports for reading the lengths, planning and
               writing the packed shards
  first step   hbp_train.launch --standalone --nproc_per_node 2 (torchrun) with experiment=cpu_demo and
               train.max_steps=1: every rank reports the seconds from the launch to the end of its first optimizer
               step and to its packed data being open, and its resident memory then (VmRSS, of it file-backed pages
               such as the memory-mapped plan and shards, and its peak VmHWM)

Above --measured-max samples the raw and tokenize stages are not run: their times are those of the largest measured
size scaled by the ratio of sizes (both stream the records in fixed-size blocks through the same per-record work, so their time is
linear in the records and their memory flat; compare the 1M figures with bench/bench_preprocess.py's 50K), and the
tokenized data of N samples is synthetic (random token ids, lengths log-normal around 12 tokens, each sample with
loss tokens; written here with numpy and pyarrow): plan, packed shards and the first step then run on N samples.
Run it under the CPU lock; it needs a few GB of disk in --work (default: a temporary folder).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, REPO)
TOKENIZER = os.path.join(REPO, "data_tools", "assets", "tokenizer")
GROUPS, WORLD, GLOBAL_TOKENS, MAX_LEN = "1024:1,2048:2", 2, 8192, 2048


def _rss_anon_mb(pid: int) -> float:
    """The anonymous resident memory of process ``pid`` now, MB (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) / 1e3 for line in f if line.startswith("RssAnon:")), 0.0)
    except OSError:
        return 0.0


def run_child(cmd: list[str], env: dict | None = None) -> dict:
    """Run ``cmd`` from the repository root; its wall time, CPU time (user + sys, with the workers it waited for),
    the peak RSS of its largest process (os.wait4) and the peak anonymous RSS of the command's own process, sampled
    every 50 ms (RSS also counts the pages of memory-mapped files it has read, which the kernel can drop at will;
    anonymous memory is what it allocated). Exits with the child's output if it fails."""
    t0 = time.perf_counter()
    child = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, **(env or {})})
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.append(child.stdout.read()), daemon=True)
    reader.start()
    anon = 0.0
    while True:
        pid, status, usage = os.wait4(child.pid, os.WNOHANG)
        if pid:
            break
        anon = max(anon, _rss_anon_mb(child.pid))
        time.sleep(0.05)
    reader.join()
    wall = time.perf_counter() - t0
    out = "".join(output)
    if status:
        raise SystemExit(f"bench_scale: {' '.join(cmd[:4])} ... failed:\n{out[-3000:]}")
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "rss_mb": usage.ru_maxrss / 1e3,
            "anon_mb": anon, "output": out}


def synthetic_tokenized(path: str, n: int, seed: int = 0) -> None:
    """A tokenized data set in data_tools.preprocess's layout with ``n`` short synthetic samples (module docstring)."""
    import datasets
    import pyarrow as pa

    from data_tools.preprocessing.pipeline import _features
    from hbp_train.common.labels import IGNORE_INDEX

    rng = np.random.default_rng(seed)
    chunk = 1 << 21
    tables = []
    for start in range(0, n, chunk):
        m = min(chunk, n - start)
        lengths = np.clip(np.round(rng.lognormal(np.log(12), 0.8, m)), 2, MAX_LEN).astype(np.int32)
        offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        ids = rng.integers(10, 4000, int(offsets[-1])).astype(np.int32)
        labels = ids.copy()
        labels[offsets[:-1]] = IGNORE_INDEX  # a prompt token first, then the answer: lengths - 1 loss tokens each
        tables.append(pa.table({
            "input_ids": pa.ListArray.from_arrays(pa.array(offsets), pa.array(ids)),
            "labels": pa.ListArray.from_arrays(pa.array(offsets), pa.array(labels)),
            "length": pa.array(lengths), "num_loss_tokens": pa.array(lengths - 1),
            "source": pa.array([f"synthetic:{start + i}" for i in range(m)], pa.string()),
        }, schema=_features().arrow_schema))
    datasets.Dataset(pa.concat_tables(tables)).save_to_disk(path, num_shards=max(1, n // 2_000_000))


def read_rss() -> dict:
    """This process's resident memory now, MB: VmRSS, its anonymous and file-backed parts, and the peak VmHWM."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                fields[key] = int(value.split()[0]) / 1e3
    return fields


def rank_worker(report_dir: str, overrides: list[str]) -> None:
    """One rank of the first-step run: the trainer as ``python -m hbp_train.train`` runs it, timed at the end of
    its first optimizer step (trainer.train_step) and when its packed data is open (data.PackedData)."""
    import hbp_train.batches.loader as data
    import hbp_train.trainer as trainer

    launched = float(os.environ["BENCH_SCALE_LAUNCHED"])
    marks: dict = {}
    open_data, train_step = data.PackedData.__init__, trainer.train_step

    def timed_open(self, *args, **kwargs):
        t0 = time.time()
        open_data(self, *args, **kwargs)
        if "data_open_s" not in marks:
            marks.update(data_open_s=time.time() - t0, data_open_at_s=time.time() - launched,
                         rss_after_data_open=read_rss())

    def timed_step(*args, **kwargs):
        out = train_step(*args, **kwargs)
        if "first_step_at_s" not in marks:
            marks.update(first_step_at_s=time.time() - launched, rss_at_first_step=read_rss())
            with open(os.path.join(report_dir, f"rank{os.environ.get('RANK', '0')}.json"), "w") as f:
                json.dump(marks, f)
        return out

    data.PackedData.__init__, trainer.train_step = timed_open, timed_step
    sys.argv = ["hbp_train.train", *overrides]
    from hbp_train.train import main

    main()


def first_step(shards: str, work: str) -> dict:
    """The 2-process CPU run of one optimizer step on ``shards``; the launcher's figures and every rank's."""
    report_dir = os.path.join(work, "ranks")
    os.makedirs(report_dir, exist_ok=True)
    overrides = ["experiment=cpu_demo", f"data.shards={shards}", "train.max_steps=1", "train.save_final=false",
                 "logging=quiet", f"train.out_dir={os.path.join(work, 'train')}"]
    cmd = [sys.executable, "-m", "hbp_train.launch", "--standalone", "--nproc_per_node", str(WORLD),
           os.path.abspath(__file__), "--rank-worker", report_dir, *overrides]
    res = run_child(cmd, {"BENCH_SCALE_LAUNCHED": repr(time.time()), "OMP_NUM_THREADS": "1"})
    res["ranks"] = [json.load(open(os.path.join(report_dir, f"rank{r}.json"))) for r in range(WORLD)]
    return res


def cpu_line(output: str) -> dict:
    line = next(x for x in output.splitlines() if x.startswith("CPU seconds"))
    return dict((k, float(v)) for k, v in (part.split()[-2:] for part in line.split(": ", 1)[1].split(", ")))


def measure(n: int, measured_max: int, work: str, scaled_from: dict | None) -> dict:
    """Every stage at ``n`` samples (module docstring)."""
    py = sys.executable
    raw, tok, packed = (os.path.join(work, name) for name in ("raw.jsonl", "tokenized", "packed"))
    stages = {}
    if n <= measured_max:
        stages["raw"] = run_child([py, "-m", "data_tools.make_demo_data", "--out", raw, "--num-samples", str(n),
                                   "--max-tokens", str(MAX_LEN), "--seed", "0"])
        stages["tokenize"] = run_child([py, "-m", "data_tools.preprocess", "--input", raw, "--output", tok,
                                        "--tokenizer", TOKENIZER, "--max-len", str(MAX_LEN), "--overlong",
                                        "truncate", "--num-proc", "2"])
        os.remove(raw)
    else:
        factor = n / scaled_from["n"]
        for name in ("raw", "tokenize"):
            stages[name] = {k: scaled_from[name][k] * factor for k in ("wall", "cpu")}
            stages[name].update(rss_mb=scaled_from[name]["rss_mb"], anon_mb=scaled_from[name]["anon_mb"], scaled=factor)
        # in a child: a process's peak RSS (ru_maxrss) survives fork and exec, so a parent that built 10M rows
        # itself would pass its own peak on to every stage it starts after
        stages["synthetic tokenized"] = run_child([py, os.path.abspath(__file__), "--synthetic", tok, str(n)])
        stages["synthetic tokenized"]["input"] = True
    stages["plan+shards"] = run_child([py, "-m", "data_tools.pack", "--dataset", tok, "--shards", packed,
                                       "--plan-format", "npz", "--max-len", str(MAX_LEN), "--world-size", str(WORLD),
                                       "--groups", GROUPS, "--global-tokens", str(GLOBAL_TOKENS), "--seed", "0",
                                       "--no-baseline", "--quiet"])
    stages["plan+shards"]["cpu_phases"] = cpu_line(stages["plan+shards"]["output"])
    stages["plan+shards"]["plan_npz_mb"] = os.path.getsize(os.path.join(packed, "plan.npz")) / 1e6
    stages["first step"] = first_step(packed, work)
    return stages


def report(n: int, stages: dict) -> None:
    print(f"\n{n:,} samples")
    for name, s in stages.items():
        if s.get("input"):
            print(f"  {name:<20} {s['wall']:8.1f} s wall (input for the next stages)")
            continue
        note = f"  [scaled x{s['scaled']:.0f} from the measured size, not run]" if "scaled" in s else ""
        anon = f" (anonymous {s['anon_mb']:.0f} MB)" if "anon_mb" in s else ""
        print(f"  {name:<20} {s['wall']:8.1f} s wall {s['cpu']:8.1f} s CPU  peak RSS {s['rss_mb']:7.0f} MB{anon}{note}")
        if "cpu_phases" in s:
            phases = s["cpu_phases"]
            print(f"  {'':<20} CPU s: " + ", ".join(f"{k} {v:.2f}" for k, v in phases.items())
                  + f"; plan.npz {s['plan_npz_mb']:.1f} MB")
        for r, rank in enumerate(s.get("ranks", [])):
            mem = rank["rss_at_first_step"]
            print(f"  {'':<20} rank {r}: data open {rank['data_open_s']:.2f} s (at {rank['data_open_at_s']:.1f} s), "
                  f"first step done {rank['first_step_at_s']:.1f} s after the launch; RSS then {mem['VmRSS']:.0f} MB "
                  f"({mem['RssFile']:.0f} MB file-backed), peak {mem['VmHWM']:.0f} MB")


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--rank-worker":
        rank_worker(sys.argv[2], sys.argv[3:])
        return 0
    if len(sys.argv) == 4 and sys.argv[1] == "--synthetic":
        synthetic_tokenized(sys.argv[2], int(sys.argv[3]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="1000000,10000000", help="sample counts, comma separated (default 1M,10M)")
    ap.add_argument("--measured-max", type=int, default=1_000_000,
                    help="largest size whose raw and tokenize stages are run; above it they are scaled (default 1M)")
    ap.add_argument("--work", default=None, help="folder for the data (default: a temporary folder)")
    args = ap.parse_args()
    sizes = sorted(int(x) for x in args.sizes.split(","))
    if not sizes or sizes[0] < 1 or args.measured_max < 1 or min(sizes) > args.measured_max:
        ap.error("--sizes must hold positive counts, the smallest <= --measured-max")
    with tempfile.TemporaryDirectory(dir=args.work) as tmp:
        measured = None
        for n in sizes:
            work = os.path.join(tmp, str(n))
            os.makedirs(work)
            stages = measure(n, args.measured_max, work, measured)
            if n <= args.measured_max:
                measured = {"n": n, **{k: stages[k] for k in ("raw", "tokenize")}}
            report(n, stages)
            subprocess.run(["rm", "-rf", work])
    return 0


if __name__ == "__main__":
    sys.exit(main())
