"""scripts/wheelhouse.py (``./launch.sh wheelhouse``): which pins go into the wheelhouse and how torch is chosen.
The round trip itself (download, build, install with no index, import, the acceptance dry run) needs the network
and minutes: scripts/check_offline_install.sh runs it."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from hbp_train.common.errors import UserError

SPEC = importlib.util.spec_from_file_location("wheelhouse", Path(__file__).resolve().parent.parent / "scripts" / "wheelhouse.py")
wheelhouse = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(wheelhouse)

PINS = ["deepspeed==0.19.8", "nvidia-ml-py==13.615.71", "nvidia-cublas==13.1.0", "torch==2.13.0+cpu",
        "triton==3.6.0", "Hydra_Core==1.3.8", "numpy==2.4.6"]


def test_torch_and_its_cuda_libraries_are_apart_and_nvml_stays():
    chosen, torch = wheelhouse.select(PINS, only=None, exclude=set(), torch="installed")
    names = {wheelhouse.canonical(p.split("==")[0]) for p in chosen if "==" in p}
    assert names == {"deepspeed", "nvidia-ml-py", "hydra-core", "numpy"}
    assert torch == "torch==2.13.0+cpu"
    # the editable install on the node needs these, and the node cannot fetch them
    assert {"setuptools", "wheel"} <= set(chosen)


def test_torch_none_a_requirement_and_a_venv_without_torch():
    assert wheelhouse.select(PINS, None, set(), "none")[1] is None
    assert wheelhouse.select(PINS, None, set(), "torch==2.11.0")[1] == "torch==2.11.0"
    with pytest.raises(UserError, match="no torch"):
        wheelhouse.select([p for p in PINS if not p.startswith("torch")], None, set(), "installed")


def test_only_and_exclude_narrow_by_canonical_name():
    chosen, _ = wheelhouse.select(PINS, only={"hydra-core", "deepspeed"}, exclude=set(), torch="none")
    assert chosen == ["deepspeed==0.19.8", "Hydra_Core==1.3.8"]
    chosen, _ = wheelhouse.select(PINS, only=None, exclude={"numpy", "wheel"}, torch="none")
    assert "numpy==2.4.6" not in chosen and "wheel" not in chosen and "setuptools" in chosen


def test_another_python_asks_pip_for_its_tags():
    args = wheelhouse.build_parser().parse_args(["out", "--python-version", "3.12"])
    flags = wheelhouse.target_flags(args)
    assert flags[flags.index("--python-version") + 1] == "3.12"
    assert flags.count("--platform") == len(wheelhouse.DEFAULT_PLATFORMS)
    assert wheelhouse.target_flags(wheelhouse.build_parser().parse_args(["out"])) == []


def test_a_bad_folder_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    assert wheelhouse.main([str(tmp_path / "file"), "--torch", "none"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a folder" in err[0]


def test_setup_offline_without_a_wheel_folder_is_one_line_and_makes_no_venv(tmp_path):
    import subprocess

    repo = Path(__file__).resolve().parent.parent
    venv = tmp_path / "venv"
    proc = subprocess.run([str(repo / "launch.sh"), "setup", "--offline", str(tmp_path / "missing")],
                          capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "HBP_VENV": str(venv)})
    assert proc.returncode == 2 and not venv.exists()
    err = proc.stderr.strip().splitlines()
    assert len(err) == 1 and "not a folder of wheels" in err[0] and "./launch.sh wheelhouse" in err[0]


def test_liger_is_an_optional_extra_for_a_cuda_node(tmp_path):
    """requirements-liger.txt's lines go into the wheelhouse (a CPU venv has no Liger to freeze), narrowed by
    --only/--exclude like every other package."""
    files = wheelhouse.OPTIONAL_REQUIREMENTS
    assert [p.name for p in files] == ["requirements-liger.txt"]
    (line,) = wheelhouse.optional_requirements(files, None, set())
    assert line.startswith("liger-kernel>=")
    assert wheelhouse.optional_requirements(files, None, {"liger-kernel"}) == []
    assert wheelhouse.optional_requirements(files, {"deepspeed"}, set()) == []
    assert wheelhouse.optional_requirements(files, {"liger-kernel"}, set()) == [line]
    assert wheelhouse.build_parser().parse_args(["out"]).liger is True
    assert wheelhouse.build_parser().parse_args(["out", "--no-liger"]).liger is False


def _node_spec() -> str:
    import re

    text = (Path(__file__).resolve().parent.parent / "docs" / "gpu.md").read_text()
    return re.search(r'--node-has "([^"]+)"', text.replace("\\\n", " ")).group(1)


def test_a_node_images_wheelhouse_carries_the_transformers_the_requirements_need():
    """docs/gpu.md records a GPU node's image (torch 2.11, triton 3.6, transformers 5.17, ... and no deepspeed, Hydra,
    datasets or Liger) as the --node-has it gives the wheelhouse. For that image the wheelhouse carries transformers
    at this venv's version (the image's is under our floor) with the huggingface-hub it needs, DeepSpeed, Hydra,
    datasets and Liger; nothing of torch's and nothing the image has at a version that will do; and with them every
    runtime requirement of the project is met on the node."""
    import re
    import sys

    from packaging.requirements import Requirement

    text = (Path(__file__).resolve().parent.parent / "docs" / "gpu.md").read_text()
    assert "image has torch 2.11.0, triton 3.6.0, transformers 5.17.0" in " ".join(text.split())
    node = wheelhouse.parse_node(_node_spec())
    installed = wheelhouse.installed_metadata(sys.executable)
    liger = wheelhouse.optional_requirements(wheelhouse.OPTIONAL_REQUIREMENTS, None, set())
    pins, extras = wheelhouse.node_selection(wheelhouse.project_requirements(), installed, node, "3.12", liger)
    carried = {wheelhouse.canonical(p.split("==")[0]): p.split("==")[1] for p in pins}
    assert node["transformers"] == "5.17.0" and carried["transformers"] == installed["transformers"][0]
    transformers_hub = next(Requirement(r) for r in installed["transformers"][1] if r.startswith("huggingface-hub"))
    assert node["huggingface-hub"] not in transformers_hub.specifier and "huggingface-hub" in carried
    assert {"deepspeed", "pydantic", "hydra-core", "omegaconf", "antlr4-python3-runtime", "datasets"} <= set(carried)
    assert "liger-kernel" in carried or [Requirement(e).name for e in extras] == ["liger-kernel"]
    assert not set(carried) & {"torch", "triton", "numpy", "safetensors", "tokenizers", "accelerate", "pyarrow"}
    for line in wheelhouse.project_requirements():  # each met on the node: by the image or by what is carried
        req = Requirement(line)
        name = wheelhouse.canonical(req.name)
        version = carried.get(name) or node.get(name)
        assert name in carried or name in node, line
        assert version is None or req.specifier.contains(version), line
    assert not re.search(r"torch|triton|nvidia", " ".join(carried))


def test_a_bad_node_has_entry_is_one_line(tmp_path, capsys):
    assert wheelhouse.main([str(tmp_path / "w"), "--node-has", "torch==2.11 transformers=="]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--node-has: 'transformers==' is not name==version or name" in err[0]
