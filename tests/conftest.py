"""Shared pytest set-up: offline HF, CPU threads, the tests pinned to the CPU (tests/cpu_pin.py), the `gpu` marker,
the two tiers (`full` marker, `--full` option), paths to shipped assets, and the Ctrl-C set-up of the tests that send
or check SIGINT.

Tiers: the default run (`./launch.sh test`, plain `pytest`) holds at least one real-component test of every feature
and stays within ten minutes on a 2-core machine; tests marked `full` are the heavy proofs that re-prove a feature
at length (the chaos matrix, real OpenCompass, the speed bench's quick run, the LoRA matrix, the demo end to end).
They run with `--full` (`./launch.sh test --full`, what CI runs), with `-m full`, or when named by their node id.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
TOKENIZER_DIR = REPO / "data_tools" / "assets" / "tokenizer"


def pytest_configure(config):
    from tests.cpu_pin import pin_to_cpu

    pin_to_cpu(config.option.markexpr)  # before the first torch import: see tests/cpu_pin.py
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU; skipped without one")
    config.addinivalue_line("markers", "slow: spawns processes or trains; still part of the default suite")
    config.addinivalue_line("markers", "full: a heavy proof, run only with --full (./launch.sh test --full; CI)")


def pytest_addoption(parser):
    parser.addoption("--full", action="store_true", default=False,
                     help="also run the tests marked `full` (the heavy proofs; what CI runs)")


def pytest_collection_modifyitems(config, items):
    _deselect_full_tier(config, items)
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _deselect_full_tier(config, items) -> None:
    """Without --full, leave out the `full` tests, unless the marker expression names `full` or the test was named
    by its node id on the command line (running one heavy test by hand needs no flag)."""
    if config.getoption("full") or "full" in (config.option.markexpr or ""):
        return
    named = {arg.split("[")[0] for arg in config.args if "::" in arg}
    keep, left_out = [], []
    for item in items:
        full = "full" in item.keywords and item.nodeid.split("[")[0] not in named
        (left_out if full else keep).append(item)
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = keep
        config._hbp_full_left_out = len(left_out)


def pytest_terminal_summary(terminalreporter, config):
    left_out = getattr(config, "_hbp_full_left_out", 0)
    if left_out:
        terminalreporter.write_line(f"{left_out} heavy tests of the full tier not run: ./launch.sh test --full "
                                    "(or pytest --full) runs them")


@pytest.fixture
def ctrl_c_stops_python():
    """SIGINT as in an interactive shell: Python's KeyboardInterrupt handler here, and the default action in the
    processes a test starts (exec resets a handled signal to its default; Python then installs its own handler).
    A suite started in the background or under nohup inherits SIGINT ignored, and an ignored signal stays ignored
    across fork and exec: a test of what Ctrl-C does would then see nothing happen."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.fixture(scope="session")
def tokenizer_dir() -> Path:
    """The small tokenizer shipped in the repo (no download)."""
    return TOKENIZER_DIR


def _hypothesis_profiles() -> None:
    """Property tests draw the same examples on every run (a red CI is never the luck of the draw);
    HYPOTHESIS_PROFILE=explore draws fresh random examples, to look for new failing cases."""
    from hypothesis import settings

    settings.register_profile("ci", derandomize=True)
    settings.register_profile("explore", derandomize=False)
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


_hypothesis_profiles()
