"""Tests for scripts/slurm_train.sbatch: valid bash, and the command line it hands srun (fake srun and scontrol on
PATH print what they got), plus its one-line errors outside an allocation or without overrides."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "slurm_train.sbatch"


def _fake_slurm(tmp_path: Path) -> dict:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text("#!/bin/bash\n[ \"$1 $2\" = 'show hostnames' ] && printf 'gpu-017\\ngpu-018\\n'\n")
    (bin_dir / "srun").write_text("#!/bin/bash\nfor a in \"$@\"; do printf '%s\\n' \"$a\"; done\n")
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "GPUS_PER_NODE", "RDZV_", "PY"))}
    env["PATH"] = f"{bin_dir}:{env['PATH']}"
    return env


def test_script_is_valid_bash():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_builds_one_torchrun_per_node_meeting_on_the_first_node(tmp_path):
    env = _fake_slurm(tmp_path)
    env.update(SLURM_JOB_NODELIST="gpu-[017-018]", SLURM_JOB_ID="4242", SLURM_NNODES="2", SLURM_GPUS_ON_NODE="4",
               SLURM_CPUS_PER_TASK="32", PY="python3")
    out = subprocess.run(["bash", str(SCRIPT), "data.shards=packed/", "train.out_dir=runs/x y"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "[slurm] job 4242: 2 node(s) x 4 GPU(s), rendezvous gpu-017:29500"
    assert out[1:] == ["--kill-on-bad-exit=1", "--ntasks-per-node=1", "python3", "-m", "hbp_train.launch",
                       "--nnodes", "2", "--nproc_per_node", "4", "--rdzv_id", "4242", "--rdzv_backend", "c10d",
                       "--rdzv_endpoint", "gpu-017:29500", "-m", "hbp_train.train", "data.shards=packed/",
                       "train.out_dir=runs/x y"]


def test_the_torchrun_arguments_it_builds_parse(tmp_path):
    """The arguments after `-m hbp_train.launch` are torchrun's own (hbp_train.launch parses them with torchrun)."""
    from torch.distributed.run import parse_args

    args = parse_args(["--nnodes", "2", "--nproc_per_node", "4", "--rdzv_id", "4242", "--rdzv_backend", "c10d",
                       "--rdzv_endpoint", "gpu-017:29500", "-m", "hbp_train.train", "data.shards=packed/"])
    assert args.nnodes == "2" and args.rdzv_endpoint == "gpu-017:29500" and args.module
    assert args.training_script == "hbp_train.train" and args.training_script_args == ["data.shards=packed/"]


def test_outside_an_allocation_or_without_overrides_is_one_line_exit_2(tmp_path):
    env = _fake_slurm(tmp_path)
    no_job = subprocess.run(["bash", str(SCRIPT), "data.shards=p/"], env=env, capture_output=True, text=True)
    assert no_job.returncode == 2 and no_job.stderr.strip().count("\n") == 0 and "SLURM allocation" in no_job.stderr
    env.update(SLURM_JOB_NODELIST="gpu-017", SLURM_JOB_ID="1")
    no_args = subprocess.run(["bash", str(SCRIPT)], env=env, capture_output=True, text=True)
    assert no_args.returncode == 2 and no_args.stderr.startswith("usage:")
