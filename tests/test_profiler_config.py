"""Tests for hbp_train/perf/profile_config.py: candidate lengths and SP degrees, and bad values named by field."""

from __future__ import annotations

import pytest

from hbp_train.common.errors import UserError
from tests.profiler_curves import cfg


def test_candidate_lengths_and_sp_degrees():
    c = cfg(max_len=100000, min_len=5000, world_size=12)
    assert c.candidate_lengths() == [8192, 16384, 32768, 65536, 100000]
    assert c.sp_candidates() == [1, 2, 4]
    assert cfg(lengths=[4096, 12288]).candidate_lengths() == [4096, 12288, 131072]


@pytest.mark.parametrize("field,value", [("headroom", 1.5), ("iters", 0), ("sp_degrees", [3]),
                                         ("memory_metric", "rss"), ("time_budget_s", 0), ("docs", "/nonexistent")])
def test_bad_config_names_the_field(field, value):
    with pytest.raises(UserError, match=f"profile.{field}"):
        cfg(**{field: value})
