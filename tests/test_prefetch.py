"""The trainer's batch prefetch (hbp_train/batches/prefetch.py): the same batches in the same order as made on demand,
from any first step (a resume), errors raised where the step is asked for, pinning only on a GPU."""

from __future__ import annotations

import threading

import pytest
import torch

from hbp_train.batches.loader import PackedData
from hbp_train.batches.prefetch import StepPrefetcher
from tests.assets.packed_fixture import TWO_RANK_STEPS, synthetic_samples, write_packed


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    shards = write_packed(str(tmp_path_factory.mktemp("packed")), synthetic_samples(14, 100, seed=5), TWO_RANK_STEPS,
                          world_size=2)
    return PackedData(shards, shuffle_epochs=True, seed=1)


def _same(a, b) -> bool:
    return len(a.micro_batches) == len(b.micro_batches) and all(
        x.keys() == y.keys() and all(torch.equal(x[k], y[k]) if isinstance(x[k], torch.Tensor) else x[k] == y[k]
                                     for k in x)
        for x, y in zip(a.micro_batches, b.micro_batches)) and a.global_loss_tokens == b.global_loss_tokens


@pytest.mark.parametrize("start", [0, 4])
def test_prefetched_batches_equal_the_batches_made_on_demand(data, start):
    """Steps start..8 (epochs 2 and 3 in their shuffled order) through the background thread, each next step made
    in the thread while the caller holds the current one, equal data.step_batch's, in order."""
    threads = set()

    def make(step):
        threads.add(threading.current_thread().name)
        return data.step_batch(step, 1)

    batches = StepPrefetcher(make, "cpu", background=True)
    try:
        for step in range(start, 9):
            got = batches.get(step, step + 1 if step + 1 < 9 else None)
            assert got.step == step and _same(got, data.step_batch(step, 1)), step
    finally:
        batches.close()
    assert any(name.startswith("hbp-prefetch") for name in threads)
    assert not batches.pin  # pinned memory only where the copies go to a GPU


def test_prefetch_errors_surface_at_their_step_and_out_of_order_asks_are_made_anew(data):
    def make(step):
        if step == 2:
            raise ValueError("bad shard")
        return data.step_batch(step, 0)

    batches = StepPrefetcher(make, "cpu", background=True)
    try:
        batches.get(0, 1)
        assert _same(batches.get(5, 2), data.step_batch(5, 0))  # not the step made ahead (1): made now
        with pytest.raises(ValueError, match="bad shard"):
            batches.get(2)
    finally:
        batches.close()
    on_demand = StepPrefetcher(lambda s: data.step_batch(s, 0), "cpu")  # the CPU default: no thread
    assert on_demand._pool is None and _same(on_demand.get(1, 2), data.step_batch(1, 0))
