"""Tests for scripts/slurm_train.sbatch under a fake SLURM: ``srun`` and ``scontrol`` are shell scripts on PATH, and
the fake srun starts the command once per node (SLURM_NODEID 0, 1, ...) as srun does, so every node's launcher
command line is checked. The script runs as sbatch runs it: a copy in a spool folder, from another folder than the
checkout. Plus its one-line errors (outside an allocation, without overrides, without GPUs, without a checkout), and
in the full tier a real two-node training under the fake srun that a second submission (a requeue) resumes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "slurm_train.sbatch"

FAKE_SRUN = r"""#!/bin/bash
# srun: its own options are logged, then the command runs once per node with that node's SLURM_NODEID.
while [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do printf '%s\n' "$1" >> "$FAKE_LOG/srun_options"; shift; done
pids=()
for ((i = 0; i < ${SLURM_NNODES:-1}; i++)); do
  SLURM_NODEID=$i SLURM_PROCID=$i SLURM_LOCALID=0 "$@" > "$FAKE_LOG/node_$i.out" 2> "$FAKE_LOG/node_$i.err" &
  pids+=($!)
done
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=$?; done
exit $rc
"""
# A Python that records what it was asked to run, per node.
FAKE_PY = r"""#!/bin/bash
{ printf '%s\n' "$@"; for v in PET_NODE_RANK OMP_NUM_THREADS HBP_SHUTDOWN_TIMEOUT PYTHONPATH DS_ACCELERATOR WORLD_SIZE
  do echo "$v=${!v}"; done
} > "$FAKE_LOG/python_${SLURM_NODEID:-batch}"
"""


def _fake_slurm(tmp_path: Path, command: str = str(SCRIPT), gpus: int = 0) -> dict:
    """A fake SLURM on PATH; ``gpus``: how many GPUs a fake nvidia-smi lists (0: it fails, as on a CPU node)."""
    bin_dir = tmp_path / "bin"
    log = tmp_path / "log"
    bin_dir.mkdir(parents=True)
    log.mkdir(exist_ok=True)
    (bin_dir / "scontrol").write_text(
        "#!/bin/bash\n"
        "case \"$1 $2\" in\n"
        "  'show hostnames') printf 'localhost\\nlocalhost\\n' ;;\n"
        f"  'show job') printf 'JobId=%s JobName=hbp-train\\n   Command={command}\\n   WorkDir=/x\\n' \"$3\" ;;\n"
        "esac\n")
    (bin_dir / "srun").write_text(FAKE_SRUN)
    listed = "".join(f"GPU {i}: NVIDIA H100 (UUID: GPU-{i})\\n" for i in range(gpus))
    (bin_dir / "nvidia-smi").write_text(f"#!/bin/bash\nprintf '{listed}'\n" if gpus else "#!/bin/bash\nexit 9\n")
    (bin_dir / "python-fake").write_text(FAKE_PY)
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "GPUS_PER_NODE", "RDZV_", "PY", "HBP_", "OMP_NUM_THREADS", "DS_ACCELERATOR",
                                 "WORLD_SIZE"))}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", FAKE_LOG=str(log))
    return env


def _spooled(tmp_path: Path) -> Path:
    """The script where sbatch runs it from: a copy in the spool folder, nowhere near the checkout."""
    spool = tmp_path / "spool" / "job4242"
    spool.mkdir(parents=True, exist_ok=True)
    return Path(shutil.copy(SCRIPT, spool / "slurm_script"))


def _allocation(env: dict, **extra) -> dict:
    env = dict(env, SLURM_JOB_NODELIST="node-[017-018]", SLURM_JOB_ID="4242", SLURM_NNODES="2",
               SLURM_SUBMIT_DIR="/nonexistent")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def _submit(tmp_path: Path, env: dict, *overrides: str, script: Path | None = None) -> subprocess.CompletedProcess:
    work = tmp_path / "work"  # the folder the job was submitted from
    work.mkdir(exist_ok=True)
    return subprocess.run(["bash", str(script or _spooled(tmp_path)), *overrides], env=env, cwd=work,
                          capture_output=True, text=True, timeout=600)


def test_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_each_node_gets_its_rank_and_the_allocation_s_gpus_cpus_and_port_from_any_folder(tmp_path):
    env = _allocation(_fake_slurm(tmp_path, gpus=4), SLURM_GPUS_ON_NODE=4, SLURM_CPUS_PER_TASK=32,
                      PY=tmp_path / "bin" / "python-fake")
    proc = _submit(tmp_path, env, "data.shards=packed/", "train.out_dir=runs/x y")
    assert proc.returncode == 0, proc.stderr
    port = 15000 + 4242 % 15000
    assert proc.stdout.splitlines() == [
        f"[slurm] job 4242: 2 node(s) x 4 GPU(s), 32 CPUs each, rendezvous localhost:{port}, up to 300 s to save "
        "after SIGTERM, train.resume=auto"]
    log = tmp_path / "log"
    assert (log / "srun_options").read_text().splitlines() == ["--kill-on-bad-exit=1", "--ntasks-per-node=1",
                                                                "--cpus-per-task=32"]
    for node in (0, 1):
        lines = (log / f"python_{node}").read_text().splitlines()
        assert lines == ["-m", "hbp_train.launch", "--nnodes", "2", "--nproc_per_node", "4", "--master_addr",
                         "localhost", "--master_port", str(port), "-m", "hbp_train.train", "train.resume=auto",
                         "data.shards=packed/", "train.out_dir=runs/x y", f"PET_NODE_RANK={node}",
                         "OMP_NUM_THREADS=8", "HBP_SHUTDOWN_TIMEOUT=300", f"PYTHONPATH={REPO}", "DS_ACCELERATOR=",
                         "WORLD_SIZE="]
    # Before srun, once: the config check, told the job's world size (a resume it would refuse is one line here).
    assert (log / "python_batch").read_text().splitlines() == [
        "-m", "hbp_train.config", "train.resume=auto", "data.shards=packed/", "train.out_dir=runs/x y",
        "PET_NODE_RANK=", "OMP_NUM_THREADS=8", "HBP_SHUTDOWN_TIMEOUT=300", f"PYTHONPATH={REPO}", "DS_ACCELERATOR=",
        "WORLD_SIZE=8"]


def test_the_shutdown_timeout_is_the_signal_lead_time_of_the_script(tmp_path):
    """SLURM's SIGTERM comes N s before the end (--signal=TERM@N); the launcher waits as long for the save."""
    text = SCRIPT.read_text()
    assert "#SBATCH --signal=TERM@300\n" in text
    script = _spooled(tmp_path)
    script.write_text(text.replace("--signal=TERM@300", "--signal=B:TERM@600"))
    env = _allocation(_fake_slurm(tmp_path), SLURM_GPUS_PER_NODE="h100:2", SLURM_CPUS_ON_NODE=16,
                      PY=tmp_path / "bin" / "python-fake", RDZV_PORT=29999)
    proc = _submit(tmp_path, env, "data.shards=p/", "train.resume=null", script=script)
    assert proc.returncode == 0, proc.stderr
    assert "2 GPU(s), 16 CPUs each, rendezvous localhost:29999, up to 600 s to save after SIGTERM\n" in proc.stdout
    lines = (tmp_path / "log" / "python_1").read_text().splitlines()
    assert "HBP_SHUTDOWN_TIMEOUT=600" in lines and "OMP_NUM_THREADS=8" in lines
    # No GPU on this "node" (its nvidia-smi fails): DeepSpeed is told the CPU, as launch.sh tells it, instead of
    # every worker warning that it fell back to it.
    assert "DS_ACCELERATOR=cpu" in lines
    assert lines[lines.index("hbp_train.train") + 1:lines.index("PET_NODE_RANK=1")] == ["data.shards=p/",
                                                                                         "train.resume=null"]


def test_the_launcher_reads_the_node_rank_srun_gives_it():
    """The per-node arguments parse as torchrun's, PET_NODE_RANK giving --node_rank."""
    from hbp_train.launch import build_parser

    os.environ["PET_NODE_RANK"] = "1"
    try:
        args = build_parser().parse_args(["--nnodes", "2", "--nproc_per_node", "4", "--master_addr", "node-017",
                                          "--master_port", "19242", "-m", "hbp_train.train", "data.shards=p/"])
    finally:
        del os.environ["PET_NODE_RANK"]
    assert (args.nnodes, args.node_rank, args.master_addr, args.master_port) == ("2", 1, "node-017", 19242)
    assert args.rdzv_backend == "static" and args.training_script_args == ["data.shards=p/"]


def test_outside_an_allocation_or_without_overrides_gpus_or_checkout_is_one_line_exit_2(tmp_path):
    env = _fake_slurm(tmp_path)
    no_job = _submit(tmp_path, env, "data.shards=p/")
    assert no_job.returncode == 2 and no_job.stderr.strip().count("\n") == 0 and "SLURM allocation" in no_job.stderr
    env = _allocation(env)
    no_args = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True)
    assert no_args.returncode == 2 and no_args.stderr.startswith("usage:")
    env["PATH"] = f"{tmp_path / 'bin'}:/usr/bin:/bin"  # no nvidia-smi, no GPUs asked for
    (tmp_path / "bin" / "nvidia-smi").unlink()
    no_gpus = subprocess.run(["bash", str(SCRIPT), "data.shards=p/"], env=env, capture_output=True, text=True)
    assert no_gpus.returncode == 2 and no_gpus.stderr.count("\n") == 1
    assert "no GPUs in this allocation; ask for them (sbatch --gpus-per-node=8) or set GPUS_PER_NODE" in no_gpus.stderr
    lost = _allocation(_fake_slurm(tmp_path / "elsewhere", command="/nowhere/slurm_train.sbatch"),
                       GPUS_PER_NODE=1)
    no_root = _submit(tmp_path, lost, "data.shards=p/")
    assert no_root.returncode == 2 and no_root.stderr.count("\n") == 1
    assert no_root.stderr.startswith("slurm_train.sbatch: cannot find the hbp-train checkout; submit with HBP_ROOT=")
    found = _submit(tmp_path, dict(lost, HBP_ROOT=str(REPO), PY=str(tmp_path / "elsewhere" / "bin" / "python-fake")),
                    "data.shards=p/")
    assert found.returncode == 0, found.stderr


@pytest.mark.full
def test_two_nodes_train_under_the_fake_srun_and_a_requeue_resumes(tmp_path):
    """The real launcher and trainer on two "nodes" (both on this host), through the script, twice: the first
    submission stops after 2 steps (as a preempted job saves and ends), the second, with the same command line (a
    requeue), resumes from its checkpoint because the script adds train.resume=auto."""
    from tests.assets.packed_fixture import TINY_LLAMA, TWO_RANK_STEPS, synthetic_samples, write_packed

    shards = write_packed(str(tmp_path / "packed"), synthetic_samples(14, 4096, seed=2), TWO_RANK_STEPS, world_size=2)
    env = _allocation(_fake_slurm(tmp_path), GPUS_PER_NODE=1, SLURM_CPUS_ON_NODE=1, PY=sys.executable,
                      RDZV_PORT=_free_port(), DS_ACCELERATOR="cpu", HF_HUB_OFFLINE=1, TRANSFORMERS_OFFLINE=1)
    model_cfg = json.dumps(TINY_LLAMA).replace('"', "").replace(" ", "")
    overrides = ["experiment=cpu_demo", f"data.shards={shards}", f"train.out_dir={tmp_path / 'run'}", "logging=quiet",
                 f"model.config={model_cfg}", "train.warmup_steps=2", "data.epochs=2", "train.exit_after_steps=2"]
    first = _submit(tmp_path, env, *overrides)
    log = tmp_path / "log"
    outputs = "".join((log / f"node_{i}.{s}").read_text() for i in (0, 1) for s in ("out", "err"))
    assert first.returncode == 0, first.stderr + outputs
    assert "train.resume=auto: no checkpoint in" in outputs and "stopped after train.exit_after_steps=2" in outputs
    second = _submit(tmp_path, env, *overrides)
    outputs = "".join((log / f"node_{i}.{s}").read_text() for i in (0, 1) for s in ("out", "err"))
    assert second.returncode == 0, second.stderr + outputs
    assert f"resumed from {tmp_path / 'run' / 'checkpoints' / 'step_00000002'} at step 2" in outputs
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["plan/step"] for r in rows] == [0, 1, 2, 3]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
