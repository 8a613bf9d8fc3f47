"""Offline install, first half: write every wheel the training venv needs into one folder (``./launch.sh wheelhouse``).

    ./launch.sh wheelhouse wheels/                                   # for this machine's Python and platform
    ./launch.sh wheelhouse wheels/ --python-version 3.12             # for a node with another Python (Linux x86-64)
    ./launch.sh wheelhouse wheels/ --torch none                      # the node's own torch will be used
    ./launch.sh wheelhouse wheels/ --python-version 3.12 --node-has "torch==2.11.0 transformers==5.17.0 ..."
    ./launch.sh setup --offline wheels/                              # on the node: install from it, no network

Run it on a machine with network access and a set-up venv (``./launch.sh setup``): the exact versions are the ones
that venv runs (``pip freeze``), so the node gets the set this was tested with. Packages with a wheel for the target
are downloaded; packages published only as source (DeepSpeed, antlr4's runtime) are built here with
``pip wheel --no-deps``, which works for them because they are pure Python (a ``py3-none-any`` wheel installs on
any Python 3 and platform); a source-only package that builds a platform wheel is refused in one line, since its
wheel would only install on this machine. ``setuptools`` and ``wheel`` are added: the editable install of this repo
needs them and the node cannot fetch them.

torch: ``--torch installed`` (default) takes the version the venv runs (its CUDA build for another Linux target,
with the NVIDIA libraries it needs), ``--torch none`` leaves it out (the node's own torch is used: ``setup
--offline`` then makes a venv that sees the system's packages), any other value is a pip requirement
(``--torch 'torch==2.11.0'``). ``--only``/``--exclude`` narrow the set by name, for a node that already has most of
the stack.

A node whose image has most of the stack (``--node-has``: the image's packages, ``name==version`` or a bare
``name`` for any version): the wheelhouse then holds only what training and the GPU acceptance need beyond them, the
project's runtime requirements (pyproject.toml) and Liger, each with the requirements of its own, walked through the
venv's package metadata: a package the image lacks, or has at a version a requirement excludes (transformers 5.17
under our floor of 5.23, and then huggingface-hub under transformers' own), is added at the venv's version; one the
image has at a version that will do is left to it, with its own dependencies. torch's family is always the image's
(``--torch none``). The list is written beside the wheels (``node-has.txt``); ``setup --offline`` then installs the
runtime requirements only, over the image's packages.

Optional extras for a CUDA node: Liger's decoder kernels (requirements-liger.txt, one pure-Python wheel under 1 MiB;
its Triton comes with the node's CUDA torch) are added whether or not this venv has them (a CPU machine cannot run
them); ``--no-liger`` leaves them out. ``setup --offline`` installs them on a CUDA node only.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from hbp_train.common.cli import ArgumentParser  # noqa: E402
from hbp_train.common.errors import EXIT_USER_ERROR, UserError  # noqa: E402

# Linux x86-64 tags pip must be told one by one when it downloads for another interpreter (it matches them
# exactly): the manylinux levels that wheels on PyPI are built for, newest first.
DEFAULT_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64",
                     "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64", "linux_x86_64")
# The torch build carries these (CUDA libraries and Triton); with --torch none they stay out too. nvidia-ml-py
# (NVML's bindings, which the profiler uses) is ours, not torch's.
TORCH_FAMILY = re.compile(r"^(torch|triton|nvidia-(?!ml-py$).*|cuda-.*)$")
BUILD_TOOLS = ("setuptools", "wheel")
OPTIONAL_REQUIREMENTS = (REPO / "requirements-liger.txt",)  # CUDA-only extras: their wheels, without dependencies
MISSING = re.compile(r"No matching distribution found for ([A-Za-z0-9_.\-]+)")


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="./launch.sh wheelhouse", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", metavar="DIR", help="folder for the wheels (created; existing wheels are kept)")
    p.add_argument("--python-version", default=None,
                   help="target Python, e.g. 3.12 (default: this interpreter's; another one implies Linux x86-64 "
                        "unless --platform says otherwise)")
    p.add_argument("--platform", action="append", default=None,
                   help="target platform tag, repeatable (default: this machine's; with --python-version, the "
                        "manylinux x86-64 tags)")
    p.add_argument("--torch", default="installed",
                   help="installed (default: the venv's version), none (leave torch out), or a pip requirement")
    p.add_argument("--only", default=None, help="comma separated package names: only these (torch by --torch)")
    p.add_argument("--exclude", default=None, help="comma separated package names to leave out")
    p.add_argument("--liger", action=argparse.BooleanOptionalAction, default=True,
                   help="add Liger's kernels (requirements-liger.txt) for a CUDA node (default on; --no-liger: not)")
    p.add_argument("--python", default=sys.executable,
                   help="the venv's interpreter whose packages are pinned (default: the one running this)")
    p.add_argument("--node-has", default=None, metavar="PACKAGES",
                   help="the packages the node's image has (name==version, or name for any version; separated by "
                        "spaces or commas): only what the project needs beyond them is added (implies --torch none)")
    return p


def parse_node(spec: str) -> dict[str, str | None]:
    """--node-has: {canonical name: version, or None for any version}; UserError for a malformed entry."""
    node = {}
    for item in re.split(r"[,\s]+", spec.strip()):
        if not item:
            continue
        name, _, version = item.partition("==")
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-]*", name) or ("==" in item and not version):
            raise UserError(f"--node-has: {item!r} is not name==version or name")
        node[canonical(name)] = version or None
    return node


def project_requirements() -> list[str]:
    """What a node needs to train and run the GPU acceptance: pyproject.toml's runtime dependencies (not the test
    extras; Liger's is requirements-liger.txt's, an optional extra)."""
    import tomllib

    return list(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"])


_METADATA = """
import importlib.metadata as md, json
print(json.dumps({d.metadata["Name"]: [d.version, d.requires or []] for d in md.distributions()}))
"""


def installed_metadata(python: str) -> dict[str, tuple[str, list[str]]]:
    """{canonical name: (version, its requirement strings)} of every package the venv at ``python`` holds."""
    out = subprocess.run([python, "-c", _METADATA], check=True, capture_output=True, text=True).stdout
    return {canonical(name): (version, requires) for name, (version, requires) in json.loads(out).items()}


def node_selection(roots: list[str], installed: dict, node: dict, python_version: str | None = None,
                   optional: list[str] = ()) -> tuple[list[str], list[str]]:
    """(pins, requirements) a node with ``node``'s packages needs for ``roots`` and the ``optional`` extras: every
    requirement met by neither the node nor torch's family, at the venv's version (``name==version``), walked into
    the requirements of each package added; an optional extra this venv does not hold (Liger on a CPU machine) is
    returned as its requirement line, for pip to resolve."""
    from packaging.requirements import Requirement

    env = {"extra": ""}
    if python_version:
        env.update(python_version=python_version, python_full_version=f"{python_version}.0")
    chosen, unheld = {}, []
    queue = [(Requirement(r), False) for r in roots] + [(Requirement(r), True) for r in optional]
    while queue:
        req, extra = queue.pop(0)
        name = canonical(req.name)
        if (req.marker and not req.marker.evaluate(env)) or TORCH_FAMILY.match(name) or name in chosen:
            continue
        if name in node and (node[name] is None or req.specifier.contains(node[name], prereleases=True)):
            continue  # the image's own will do, with its own dependencies
        if name not in installed:
            if extra:
                unheld.append(str(req))
                continue
            raise UserError(f"{req}: needed on the node and not in this venv (./launch.sh setup first)")
        version, requires = installed[name]
        chosen[name] = f"{name}=={version}"
        queue += [(Requirement(r), False) for r in requires]
    return sorted(chosen.values()), unheld


def pinned_requirements(python: str) -> list[str]:
    """``name==version`` for every package the venv holds, but this repo itself (an editable install)."""
    out = subprocess.run([python, "-m", "pip", "freeze", "--exclude-editable"], check=True, capture_output=True,
                         text=True).stdout
    pins = [line.strip() for line in out.splitlines() if "==" in line and not line.startswith("#")]
    if not pins:
        raise UserError(f"--python {python}: pip freeze lists no package (run ./launch.sh setup first)")
    return pins


def select(pins: list[str], only: set[str] | None, exclude: set[str], torch: str) -> tuple[list[str], str | None]:
    """The pins to fetch (torch's family apart) and the torch requirement (None: leave it out)."""
    chosen = []
    torch_installed = None
    for pin in pins:
        name, version = pin.split("==", 1)
        key = canonical(name)
        if key == "torch":
            torch_installed = version
        if TORCH_FAMILY.match(key) or key in exclude or (only is not None and key not in only):
            continue
        chosen.append(pin)
    names = {canonical(p.split("==")[0]) for p in chosen}
    chosen += [t for t in BUILD_TOOLS if t not in names and t not in exclude and (only is None or t in only)]
    if torch == "none":
        return chosen, None
    if torch == "installed":
        if torch_installed is None:
            raise UserError("--torch installed: the venv has no torch (give --torch none or a requirement)")
        return chosen, f"torch=={torch_installed}"
    return chosen, torch


def optional_requirements(files, only: set[str] | None, exclude: set[str]) -> list[str]:
    """The requirement lines of the optional extras' files that --only/--exclude let through."""
    reqs = []
    for path in files:
        for line in path.read_text().splitlines():
            line = line.split("#", 1)[0].strip()
            name = canonical(re.split(r"[=<>!~ \[;]", line)[0]) if line else ""
            if line and name not in exclude and (only is None or name in only):
                reqs.append(line)
    return reqs


def target_flags(args) -> list[str]:
    """pip's flags naming the target interpreter and platform; none for this machine's own."""
    if args.python_version is None and args.platform is None:
        return []
    flags = ["--implementation", "cp"]
    if args.python_version:
        flags += ["--python-version", args.python_version]
    for tag in args.platform or DEFAULT_PLATFORMS:
        flags += ["--platform", tag]
    return flags


def pip(python: str, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-m", "pip", *argv], capture_output=True, text=True)


def download(python: str, reqs: list[str], out: Path, flags: list[str], deps: bool) -> list[str]:
    """Download wheels for reqs; returns the requirements no wheel exists for (to be built). pip stops at the first
    one it cannot find, so each miss is set aside and the rest asked for again."""
    remaining, unbuilt = list(reqs), []
    while remaining:
        # Wheels only, also for this machine: a source archive would have to be built on the node, offline.
        cmd = ["download", "-q", "--dest", str(out), "--only-binary=:all:", *([] if deps else ["--no-deps"]), *flags]
        result = pip(python, *cmd, *remaining)
        if result.returncode == 0:
            return unbuilt
        miss = MISSING.search(result.stderr)
        if miss is None:
            raise UserError(f"pip download failed: {result.stderr.strip().splitlines()[-1]}")
        name = canonical(re.split(r"[=<>!~ ]", miss.group(1))[0])
        hit = [r for r in remaining if canonical(re.split(r"[=<>!~ ]", r)[0]) == name]
        if not hit:
            raise UserError(f"pip download failed on {miss.group(1)}, which none of the pins names")
        unbuilt += hit
        remaining = [r for r in remaining if r not in hit]
    return unbuilt


def build(python: str, reqs: list[str], out: Path, cross: bool) -> list[str]:
    """Build wheels from source here (``pip wheel --no-deps``); for another target only pure-Python ones qualify."""
    if not reqs:
        return []
    with tempfile.TemporaryDirectory() as tmp:
        result = pip(python, "wheel", "-q", "--no-deps", "--wheel-dir", tmp, *reqs)
        if result.returncode != 0:
            raise UserError(f"pip wheel {' '.join(reqs)} failed: {result.stderr.strip().splitlines()[-1]}")
        built = sorted(Path(tmp).glob("*.whl"))
        for wheel in built:
            if cross and not wheel.name.endswith("-py3-none-any.whl"):
                raise UserError(f"{wheel.name}: no wheel on the index for the target and this build is for this "
                                "machine only; build it on the target (pip wheel --no-deps) and add it to the folder")
            wheel.replace(out / wheel.name)
        return [w.name for w in built]


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = Path(args.out)
        if out.exists() and not out.is_dir():
            raise UserError(f"{out}: not a folder (give a folder for the wheels)")
        out.mkdir(parents=True, exist_ok=True)
        split = lambda text: None if text is None else {canonical(n) for n in text.split(",") if n.strip()}  # noqa: E731
        only, exclude = split(args.only), split(args.exclude) or set()
        extras = optional_requirements(OPTIONAL_REQUIREMENTS if args.liger else (), only, exclude)
        if args.node_has is not None:  # only what the node's image lacks
            node = parse_node(args.node_has)
            wanted, extras = node_selection(project_requirements(), installed_metadata(args.python), node,
                                            args.python_version, extras)
            pins, torch_req = select(wanted, only, exclude, "none")
            (out / "node-has.txt").write_text(" ".join(f"{k}=={v}" if v else k for k, v in node.items()) + "\n")
        else:
            pins, torch_req = select(pinned_requirements(args.python), only, exclude, args.torch)
        flags = target_flags(args)
        if flags:  # another interpreter: a local build tag (+cpu) names no wheel on the index
            pins = [re.sub(r"\+[A-Za-z0-9.]+$", "", p) for p in pins]
            torch_req = torch_req and re.sub(r"\+[A-Za-z0-9.]+$", "", torch_req)
        print(f"[wheelhouse] {len(pins)} packages{' + ' + torch_req if torch_req else ''} -> {out}", flush=True)
        to_build = download(args.python, pins, out, flags, deps=False)
        if extras:  # pure-Python wheels; their dependencies (torch, Triton) are torch's family
            to_build += download(args.python, extras, out, flags, deps=False)
        if torch_req:  # with its dependencies: the CUDA build's NVIDIA libraries are not in a CPU venv's freeze
            to_build += download(args.python, [torch_req], out, flags, deps=True)
        built = build(args.python, to_build, out, cross=bool(flags))
    except UserError as exc:
        print(f"wheelhouse: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    wheels = sorted(out.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"[wheelhouse] {len(wheels)} wheels, {size:.0f} MiB in {out}" + (f"; built here: {', '.join(built)}" if built
                                                                          else ""))
    print(f"[wheelhouse] on the node: ./launch.sh setup --offline {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
