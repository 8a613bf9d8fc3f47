"""The binary plan (planning/plan_npz.py): it and the JSON form round-trip to the same Plan; arrays memory-mapped."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hbp_train.common.errors import UserError
from hbp_train.planning import ALL_STRATEGIES, GroupSpec, Plan, PlanConfig, make_plan
from hbp_train.planning.plan_npz import load_plan, read_npz, save_plan


def layout(plan: Plan) -> list:
    """What a plan means, independent of pack numbering: per step its group and the samples of every slot."""
    return [(int(plan.step_group[s]), [tuple(plan.pack(int(p)).tolist()) for p in plan.step_matrix(s).ravel()])
            for s in range(plan.num_steps)]


@settings(max_examples=20, deadline=None)
@given(strategy=st.sampled_from(ALL_STRATEGIES), seed=st.integers(0, 3),
       lengths=st.lists(st.integers(1, 300), min_size=1, max_size=150))
def test_json_and_binary_round_trip_to_the_same_plan(tmp_path_factory, strategy, seed, lengths):
    tmp = tmp_path_factory.mktemp("plan")
    cfg = PlanConfig(world_size=4, groups=[GroupSpec(64, 1), GroupSpec(256, 2)], strategy=strategy,
                     global_tokens=1024, seed=seed)
    plan = make_plan(lengths, cfg)
    save_plan(plan, tmp / "plan.json")
    save_plan(plan, tmp / "plan.npz")
    from_json, from_npz = load_plan(tmp / "plan.json"), load_plan(tmp / "plan.npz")
    from_npz.validate()
    assert layout(from_json) == layout(from_npz) == layout(plan)
    for back in (from_json, from_npz):
        assert np.array_equal(back.lengths, plan.lengths) and np.array_equal(back.dropped, plan.dropped)
        assert back.dropped_reason == plan.dropped_reason and back.deferred == plan.deferred
        assert back.config.to_dict() == plan.config.to_dict()
        assert back.metrics.keys() == plan.metrics.keys()
        assert all(np.allclose(back.step_metrics[k], plan.step_metrics[k]) for k in plan.step_metrics)
    # The binary form keeps the arrays exactly as planned (no renumbering) and maps them from the file.
    for name in ("pack_ptr", "pack_samples", "step_ptr", "step_packs", "step_group"):
        assert np.array_equal(getattr(from_npz, name), getattr(plan, name))
    assert from_npz.pack_samples.dtype == np.int64 and from_npz.step_group.dtype == np.int32
    assert from_npz.unequal_micro_batches == plan.unequal_micro_batches


def test_binary_plan_is_memory_mapped_in_narrow_types_and_pack_rows_survive(tmp_path):
    rng = np.random.default_rng(0)
    lengths = np.minimum(rng.lognormal(6, 1.2, 5000).astype(np.int64) + 1, 16384)
    plan = make_plan(lengths, PlanConfig(world_size=8, groups=[GroupSpec(2048, 1), GroupSpec(16384, 4)],
                                         global_tokens=65536))
    rows = np.arange(plan.num_packs)[::-1].copy()
    save_plan(plan, tmp_path / "p.npz", pack_row=rows)
    save_plan(plan, tmp_path / "p.json")
    from hbp_train.planning.plan_npz import open_npz

    header, arrays = open_npz(tmp_path / "p.npz")
    assert np.array_equal(arrays["pack_row"], rows) and header["num_samples"] == 5000
    assert isinstance(arrays["pack_samples"], np.memmap) and arrays["pack_samples"].dtype == np.int16
    assert np.array_equal(arrays["pack_samples"], plan.pack_samples)
    assert np.array_equal(read_npz(tmp_path / "p.npz", mmap=False).pack_samples, plan.pack_samples)


def test_bad_binary_plans_are_one_line_errors(tmp_path):
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip")
    with pytest.raises(UserError, match="junk.npz"):
        load_plan(junk)
    other = tmp_path / "other.npz"
    np.savez(other, a=np.arange(3))
    with pytest.raises(UserError, match="not a binary plan"):
        load_plan(other)


def test_large_plans_store_three_byte_indices_and_split_lengths(tmp_path):
    """From 2^16 values on, sample indices take 3 bytes and lengths 2 (plus the few long ones apart) instead of the 4
    of int32; every member reads back exactly, whole, sliced or one value at a time."""
    from hbp_train.planning.plan_npz import High16Array, Int24Array, open_npz

    rng = np.random.default_rng(0)
    lengths = rng.permutation(np.r_[rng.integers(1, 2000, 100000), rng.integers(65536, 131073, 300)])
    plan = make_plan(lengths, PlanConfig(world_size=4, groups=[GroupSpec(4096, 1), GroupSpec(131072, 4)],
                                         global_tokens=1 << 20))
    save_plan(plan, tmp_path / "p.npz")
    header, arrays = open_npz(tmp_path / "p.npz")
    assert header["encodings"]["lengths"] == "hi16" and header["encodings"]["pack_samples"] == "u24"
    assert isinstance(arrays["lengths"], High16Array) and isinstance(arrays["pack_samples"], Int24Array)
    for name in ("lengths", "pack_samples", "pack_ptr"):
        stored, planned = arrays[name], getattr(plan, name)
        assert np.array_equal(np.asarray(stored, np.int64), planned), name
        assert np.array_equal(stored[1234:90111], planned[1234:90111]) and stored[4321] == planned[4321], name
    back = read_npz(tmp_path / "p.npz")
    assert layout(back) == layout(plan) and np.array_equal(back.lengths, plan.lengths)
    import zipfile

    stored = {i.filename: i.file_size for i in zipfile.ZipFile(tmp_path / "p.npz").infolist()}
    n = len(lengths)
    assert stored["lengths.npy"] < 2 * n + 200 and stored["pack_samples.npy"] < 3 * n + 200  # + the .npy header
