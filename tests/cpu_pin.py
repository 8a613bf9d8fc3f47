"""What the test suite assumes, made true on any machine: the tests run on the CPU.

Their expected values are fp32 results of the exact ``sdpa_block`` backend with gloo, which is what ``model.dtype:
auto`` and ``attention_backend: auto`` resolve to on a CPU. On a CUDA machine they would resolve to bf16 and a GPU
kernel and the fp32 tolerances would fail for the wrong reason, so unless the GPU tests are selected (``-m gpu``,
docs/gpu.md) the session hides the GPUs from itself and from every process it spawns, before torch is imported.
"""

from __future__ import annotations

import os


def gpu_tests_selected(markexpr: str) -> bool:
    """True for a marker expression that selects the GPU tests (``gpu``, ``gpu and slow``), not ``not gpu``."""
    words = (markexpr or "").replace("(", " ").replace(")", " ").split()
    return any(w == "gpu" and (i == 0 or words[i - 1] != "not") for i, w in enumerate(words))


def pin_to_cpu(markexpr: str, environ=os.environ) -> bool:
    """Hide CUDA (torch and DeepSpeed) unless the GPU tests are selected; returns whether it pinned."""
    if gpu_tests_selected(markexpr):
        return False
    environ["CUDA_VISIBLE_DEVICES"] = ""
    environ["DS_ACCELERATOR"] = "cpu"
    return True
