"""Tests for tests/cpu_pin.py: the suite runs as on a CPU (fp32, sdpa_block, gloo) even on a CUDA machine."""

from __future__ import annotations

import os

import pytest
import torch

from tests.cpu_pin import gpu_tests_selected, pin_to_cpu


def test_this_session_is_pinned_to_the_cpu():
    """The fp32 / sdpa_block expectations of the suite hold only on the CPU: the session hid every GPU."""
    from hbp_train.model.attention_setup import select_backend
    from hbp_train.model.hf_model import ModelConfig

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and os.environ["DS_ACCELERATOR"] == "cpu"
    assert not torch.cuda.is_available()
    assert ModelConfig(config={"hidden_size": 32, "num_attention_heads": 4, "num_key_value_heads": 2}).torch_dtype() == torch.float32
    assert select_backend("auto", torch.device("cpu"), torch.float32) == "sdpa_block"


@pytest.mark.parametrize("markexpr, selected", [("", False), ("not gpu", False), ("slow and not gpu", False),
                                                 ("gpu", True), ("gpu and not slow", True), ("(gpu)", True)])
def test_only_a_gpu_selection_keeps_the_gpus(markexpr, selected):
    env = {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert gpu_tests_selected(markexpr) is selected
    assert pin_to_cpu(markexpr, env) is (not selected)
    assert env["CUDA_VISIBLE_DEVICES"] == ("0,1" if selected else "")
