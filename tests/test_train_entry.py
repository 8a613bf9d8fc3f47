"""Tests for hbp_train/train.py's run(): training sets CUDA's expandable segments before the first CUDA
allocation (the process group), unless the user set PYTORCH_CUDA_ALLOC_CONF."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from hbp_train import train


class Reached(Exception):
    pass


@pytest.mark.parametrize("user_value, expected", [(None, "expandable_segments:True"),
                                                  ("max_split_size_mb:256", "max_split_size_mb:256")])
def test_training_sets_expandable_segments_before_the_process_group_unless_the_user_set_it(
        monkeypatch, user_value, expected):
    import hbp_train.distributed.groups as groups

    if user_value is None:
        monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    else:
        monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", user_value)
    seen = []

    def init_distributed(backend=None):
        seen.append(os.environ.get("PYTORCH_CUDA_ALLOC_CONF"))
        raise Reached

    monkeypatch.setattr(groups, "init_distributed", init_distributed)
    with pytest.raises(Reached):
        train.run(SimpleNamespace(train=SimpleNamespace(seed=0)), "")
    assert seen == [expected]
