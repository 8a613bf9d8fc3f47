"""Tests for hbp_train/perf/cost_model.py and perf/calibrate.py: the shipped calibration's table points,
monotonicity, recompute, SP split and comm, scaling, bad calibration files, and the calibrate CLI on the CPU."""

from __future__ import annotations

import json

import numpy as np
import pytest

from hbp_train.common.errors import UserError
from hbp_train.perf.cost_model import DEFAULT_CALIBRATION, TABLE_TOKENS, CostModel
from hbp_train.perf.shape import parse_model_shape
from tests.cli_exit import exit_code

TABLE = json.loads(DEFAULT_CALIBRATION.read_text())
FB = {int(k): v for k, v in TABLE["attention_fwdbwd_ms_32768_tokens_by_doc_len"].items()}
FWD = {int(k): v for k, v in TABLE["attention_fwd_ms_32768_tokens_by_doc_len"].items()}
LINEAR_MS = TABLE["linear_fwdbwd_ms_per_32768_tokens"]
# Llama-3-8B layer linear FLOPs per token, written out: q, o (4096x4096), k, v (4096x1024), MLP 3 x 4096x14336.
LLAMA8B_LINEAR_FLOPS = 2 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
LLAMA8B_HEAD_FLOPS = 2 * 4096 * 128256


@pytest.fixture(scope="module")
def model() -> CostModel:
    return CostModel.from_calibration()


def test_shipped_calibration_copy_is_verbatim():
    shared = DEFAULT_CALIBRATION.parents[3] / "shared" / "calibration" / DEFAULT_CALIBRATION.name
    if shared.is_file():
        assert json.loads(shared.read_text()) == TABLE


def test_reproduces_table_points(model):
    assert model.source == "measured"
    assert model.shape.name == "llama3-8b" and model.shape.num_layers == 32
    for length, ms in FB.items():
        # One document costs t(l) * l / 32768: a 32K pack of such documents costs t(l).
        per_pack = model.attention_fwdbwd([length])[0] * (TABLE_TOKENS / length) * 1e3
        assert per_pack == pytest.approx(ms, rel=1e-9)
        assert model.attention_fwd([length])[0] * (TABLE_TOKENS / length) * 1e3 == pytest.approx(FWD[length], rel=1e-9)
    assert model.linear_fb_per_token * TABLE_TOKENS * 1e3 == pytest.approx(LINEAR_MS)


def test_pack_time_of_table_pack(model):
    # A 32K pack of 1K documents, sp=1: layers x (attention + linear) + LM head. The table has no head timing, so
    # the head is the layer's linear rate scaled by FLOPs, at 4 matmuls (the chunked loss) to a layer's 3.
    pack = [1024] * 32
    head_ms = LINEAR_MS * 4 / 3 * LLAMA8B_HEAD_FLOPS / LLAMA8B_LINEAR_FLOPS
    expected = (32 * (FB[1024] + LINEAR_MS) + head_ms) / 1e3
    assert model.pack_time(pack) == pytest.approx(expected, rel=1e-9)


def test_interpolation_is_log_log_and_monotonic(model):
    # Midway in log space between two table points, t is their geometric mean.
    mid = np.sqrt(1024 * 2048)
    per_pack = model.attention_fwdbwd([mid])[0] * TABLE_TOKENS / mid * 1e3
    assert per_pack == pytest.approx(np.sqrt(FB[1024] * FB[2048]), rel=1e-9)
    lens = np.unique(np.geomspace(1, 300_000, 400).astype(int))
    per_doc = model.attention_fwdbwd(lens)
    assert np.all(np.diff(per_doc) > 0)
    single = [model.pack_time([int(l)]) for l in lens[::20]]
    assert np.all(np.diff(single) > 0)
    # Same tokens in longer documents never cost less.
    packs = [model.pack_time([l] * (65536 // l)) for l in (128, 512, 2048, 8192, 65536)]
    assert np.all(np.diff(packs) > 0)
    # Beyond the table the per-document cost keeps the last segment's slope: 2x length ~ 4x cost.
    assert model.attention_fwdbwd([65536])[0] / model.attention_fwdbwd([32768])[0] == pytest.approx(
        2 * FB[32768] / FB[16384], rel=1e-9)


def test_checkpointing_adds_one_forward(model):
    pack = [300, 5000, 20000]
    base = model.pack_time(pack)
    for k in (1, 8, 32):
        recompute = k * (model.attention_fwd(pack).sum() + model.linear_fb_per_token / 3 * sum(pack))
        assert model.pack_time(pack, ckpt_layers=k) - base == pytest.approx(recompute, rel=1e-9)
    with pytest.raises(ValueError):
        model.pack_time(pack, ckpt_layers=33)


def test_sp_divides_compute_and_adds_comm(model):
    pack = [1000, 30000, 60000]
    tokens = sum(pack)
    t1 = model.pack_time(pack, sp=1)
    # Infinite bandwidth: compute only, split over sp ranks.
    for sp in (2, 4, 8):
        assert model.pack_time(pack, sp=sp, intra_node_gbps=1e30) == pytest.approx(t1 / sp, rel=1e-9)
    # Finite bandwidth: 8 all-to-alls per layer (q, k, v, out; fwd and bwd), each rank moving (sp-1)/sp of T/sp
    # tokens; q/out are 32*128 wide, k/v 8*128 (kv heads >= sp here), bf16.
    sp, gbps = 4, 100.0
    per_layer_fwd = tokens / sp * (sp - 1) / sp * (2 * 4096 + 2 * 1024) * 2 / (gbps * 1e9)
    got = model.pack_time(pack, sp=sp, intra_node_gbps=gbps) - t1 / sp
    assert got == pytest.approx(2 * 32 * per_layer_fwd, rel=1e-9)
    # Checkpointed layers add their forward's 4 all-to-alls again.
    got_ckpt = model.pack_time(pack, sp=sp, ckpt_layers=10, intra_node_gbps=gbps) - model.pack_time(
        pack, sp=sp, ckpt_layers=10, intra_node_gbps=1e30)
    assert got_ckpt == pytest.approx((2 * 32 + 10) * per_layer_fwd, rel=1e-9)
    # An SP group of 16 over nodes of 8 GPUs: each rank sends 1/16 of its T/16 tokens to each of 15 peers, 7 on
    # its node and 8 on the other node; both links work at once, the slower sets the time. kv heads are
    # replicated up to sp (16 x 128 wide).
    sp = 16
    width = 2 * 4096 + 2 * 16 * 128
    per_peer = tokens / sp / sp * width * 2
    cross = model.pack_time(pack, sp=sp, intra_node_gbps=1e30, inter_node_gbps=gbps) - t1 / sp
    assert cross == pytest.approx(2 * 32 * 8 * per_peer / (gbps * 1e9), rel=1e-9)
    slow_nvlink = model.pack_time(pack, sp=sp, intra_node_gbps=gbps / 4, inter_node_gbps=gbps) - t1 / sp
    assert slow_nvlink == pytest.approx(2 * 32 * 7 * per_peer / (gbps / 4 * 1e9), rel=1e-9)
    # Within a node the inter-node link is never used.
    assert model.pack_time(pack, sp=8, inter_node_gbps=1e-3) < 2 * model.pack_time(pack, sp=8)
    assert model.pack_time(pack, sp=1, intra_node_gbps=1e-3) == t1  # sp=1 never communicates


def test_vectorised_matches_scalar(model):
    rng = np.random.default_rng(0)
    packs = [rng.integers(1, 40000, size=rng.integers(0, 6)) for _ in range(50)]
    offsets = np.concatenate([[0], np.cumsum([len(p) for p in packs])])
    sp = rng.choice([1, 2, 4, 8, 16], size=len(packs))
    ckpt = rng.integers(0, 33, size=len(packs))
    flat = np.concatenate(packs)
    got = model.pack_times(flat, offsets, sp, ckpt)
    want = [model.pack_time(p, int(s), int(k)) if len(p) else 0.0 for p, s, k in zip(packs, sp, ckpt)]
    np.testing.assert_allclose(got, want, rtol=1e-12)


def test_scaled_shapes_are_labelled_and_scale_by_flops(model):
    small = CostModel.from_calibration(model_shape="llama3.2-1b")
    assert small.source == "scaled"
    s = small.shape
    lin = 2 * (2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192)
    assert small.linear_fb_per_token / model.linear_fb_per_token == pytest.approx(lin / LLAMA8B_LINEAR_FLOPS)
    # Attention scales with heads * head_dim: 32*64 vs 32*128.
    assert small.attention_fwdbwd([4096])[0] / model.attention_fwdbwd([4096])[0] == pytest.approx(0.5)
    assert s.num_layers == 16
    # Same layer, other depth: still measured numbers, time scales with the layer count (+ head).
    deep = CostModel.from_calibration(model_shape={**vars(model.shape), "num_layers": 64, "name": "deep"})
    assert deep.source == "measured"
    assert deep.pack_time([8192]) > 1.9 * model.pack_time([8192])


def test_analytic_is_flops_over_rate():
    m = CostModel.analytic("llama3-8b", peak_tflops=1000, efficiency=0.5)
    assert m.source == "analytic"
    rate = 1000e12 * 0.5
    l = 10000
    attn = 7 * l * l * 4096 / rate  # fwd 2 l^2 H d, bwd 2.5x
    linear = 3 * LLAMA8B_LINEAR_FLOPS * l / rate
    head = 4 * LLAMA8B_HEAD_FLOPS * l / rate  # the chunked loss: logits again in backward, then both gradients
    assert m.pack_time([l]) == pytest.approx(32 * (attn + linear) + head, rel=1e-9)
    with pytest.raises(UserError):
        CostModel.analytic("llama3-8b", efficiency=0)


def test_bad_calibration_file_is_a_user_error(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="invalid JSON"):
        CostModel.from_calibration(bad)
    bad.write_text(json.dumps({"linear_fwdbwd_ms_per_32768_tokens": 1.0}))
    with pytest.raises(UserError, match="attention_fwdbwd_ms_32768_tokens_by_doc_len"):
        CostModel.from_calibration(bad)
    with pytest.raises(UserError, match="cannot read"):
        CostModel.from_calibration(tmp_path / "missing.json")


TINY = '{"name": "tiny", "hidden": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "ffn": 64, "vocab": 128}'


def test_calibrate_without_gpu_exits_2(capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from hbp_train.perf import calibrate

    assert exit_code(calibrate.main, ["--out", "unused.json"]) == 2
    assert "no CUDA GPU here" in capsys.readouterr().err


def test_cpu_calibration_says_where_it_was_measured_and_validates(tmp_path):
    """--device cpu: fp32, the threads asked for (and this process's own count left as it was), the CPU named in
    the file and in the cost model's note; the model reads it as measured fp32 (4-byte all-to-alls) and --validate
    compares whole packs with it."""
    import torch

    from hbp_train.perf import calibrate

    out = tmp_path / "tiny.json"
    common = ["--device", "cpu", "--threads", "1", "--model-shape", TINY, "--tokens", "128", "--iters", "1",
              "--warmup", "0"]
    threads = torch.get_num_threads()
    assert calibrate.main(common + ["--doc-lens", "16,64,128", "--out", str(out)]) == 0
    assert torch.get_num_threads() == threads
    data = json.loads(out.read_text())
    assert set(data["attention_fwdbwd_ms_32768_tokens_by_doc_len"]) == {"16", "64", "128"}
    assert data["linear_fwdbwd_ms_per_32768_tokens"] > 0 and data["model_shape"]["hidden"] == 32
    assert (data["device"], data["dtype"], data["threads"], data["procs"], data["gpu"]) == \
        ("cpu", "float32", 1, 1, None)
    assert data["cpu"].startswith("CPU ") and data["cpu"].endswith(", 1 thread(s)") and "float32" in data["what"]
    # what CPU training runs: sdpa_block, HF's modules, the chunked loss (a GPU: test_the_calibration_times_what_...)
    assert (data["backend"], data["loss_impl"]) == ("sdpa_block", "chunked") and data["decoder_kernels"].startswith("none")
    model = CostModel.from_calibration(out)
    assert model.source == "measured" and model.shape.name == "tiny" and data["cpu"] in model.note
    assert model.dtype_bytes == 4 and CostModel.from_calibration().dtype_bytes == 2  # fp32 here, bf16 on the H100
    assert model.a2a_seconds(1024, 2)[()] == pytest.approx(2 * CostModel(
        model.shape, [16, 128], [1, 2], [1, 2], 1.0, "measured").a2a_seconds(1024, 2)[()])
    report_path = tmp_path / "val.json"
    assert calibrate.main(common + ["--validate", "--calibration", str(out), "--max-samples", "8", "--num-packs", "3",
                                    "--validate-out", str(report_path)]) == 0
    report = json.loads(report_path.read_text())
    assert [p["num_samples"] for p in report["packs"]] == [1, 3, 8] and report["device"].startswith("CPU ")
    for p in report["packs"]:
        assert sum(p["lengths"]) == 128 and len(p["lengths"]) == p["num_samples"]
        assert p["predicted_s"] == pytest.approx(model.pack_time(p["lengths"]))
        assert p["error"] == pytest.approx(p["predicted_s"] / p["measured_s"] - 1)
    assert exit_code(calibrate.main, common + ["--doc-lens", "256", "--out", str(out)]) == 2  # longer than --tokens


def test_cpu_calibration_with_procs_measures_in_step_with_its_companions(tmp_path, monkeypatch):
    """--procs 2: a spawned process runs the same measurements, both waiting at a barrier before every point (a
    training rank computes beside another); the file says so. The barrier is gone afterwards."""
    from hbp_train.perf import calibrate
    from hbp_train.perf.calibrate import timing

    waits = []
    real_timer = timing.timer

    def counting_timer(device):  # this process's waits: two per timed point (before the warm-ups, before timing)
        run = real_timer(device)

        def timed(fn, iters, warmup):
            waits.append(timing.barrier is not None)
            return run(fn, iters, warmup)
        return timed

    monkeypatch.setattr(timing, "timer", counting_timer)
    out = tmp_path / "two.json"
    assert calibrate.main(["--device", "cpu", "--threads", "1", "--procs", "2", "--model-shape", TINY, "--tokens",
                           "64", "--iters", "1", "--warmup", "0", "--doc-lens", "16,64", "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["procs"] == 2 and data["threads"] == 1
    assert waits == [True] * 6 and timing.barrier is None  # fwd, fwd+bwd per doc length, the layer, the head


def test_cpu_calibration_flags_are_refused_for_a_gpu(capsys):
    from hbp_train.perf import calibrate

    for flags in (["--threads", "2"], ["--procs", "2"]):
        assert exit_code(calibrate.main, flags + ["--out", "unused.json"]) == 2
        err = capsys.readouterr().err
        assert "--threads and --procs are for --device cpu" in err and len(err.strip().splitlines()) == 1


def test_pack_cost_fn_uses_the_group_and_balances_predicted_time(model):
    """The planner hook: a group's sp and ckpt_layers (null -> the default), and hbp balancing with it evens the
    predicted slot times at least as well as the default sum of len^2 does."""
    from hbp_train.perf.cost_model import pack_cost_fn
    from hbp_train.planning import GroupSpec, PlanConfig, make_plan
    from hbp_train.planning.metrics import cost_balance_ratio

    lengths = np.array([300, 5000, 20000, 64000, 1000])
    ptr = np.array([0, 2, 4, 5])
    cost = pack_cost_fn(model, ckpt_layers_default=6)
    np.testing.assert_allclose(cost(lengths, ptr, GroupSpec(65536, 4, 10)), model.pack_times(lengths, ptr, 4, 10))
    np.testing.assert_allclose(cost(lengths, ptr, GroupSpec(65536, 2, None)), model.pack_times(lengths, ptr, 2, 6))
    rng = np.random.default_rng(0)
    mix = np.minimum(rng.lognormal(6.5, 1.3, 3000).astype(np.int64) + 1, 32768)
    base = dict(world_size=8, groups=[GroupSpec(4096, 1), GroupSpec(32768, 4)], global_tokens=1 << 18)
    by_time = make_plan(mix, PlanConfig(pack_cost=cost, **base))
    by_len2 = make_plan(mix, PlanConfig(**base))
    isf = make_plan(mix, PlanConfig(strategy="isf", **base))
    by_time.validate()
    assert cost_balance_ratio(by_time, cost) < cost_balance_ratio(by_len2, cost)
    assert cost_balance_ratio(by_time, cost) < cost_balance_ratio(isf, cost) / 5


def test_calibrate_bad_flags_fail_before_measuring(tmp_path, capsys):
    from hbp_train.perf import calibrate

    common = ["--device", "cpu", "--model-shape", TINY, "--tokens", "128"]
    assert exit_code(calibrate.main, common + ["--doc-lens", "16,abc", "--out", str(tmp_path / "c.json")]) == 2
    assert "--doc-lens" in capsys.readouterr().err
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert exit_code(calibrate.main, common + ["--doc-lens", "16", "--out", str(blocker / "c.json")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and len(err.strip().splitlines()) == 1
    assert exit_code(calibrate.main, common + ["--doc-lens", "16", "--out", str(tmp_path)]) == 2


@pytest.mark.parametrize("field, value", [
    ("attention_fwdbwd_ms_32768_tokens_by_doc_len", [1.0, 2.0]),
    ("linear_fwdbwd_ms_per_32768_tokens", "fast"),
])
def test_calibration_field_of_the_wrong_type_names_file_and_field(tmp_path, field, value):
    path = tmp_path / "cal.json"
    path.write_text(json.dumps({**TABLE, field: value}))
    with pytest.raises(UserError) as info:
        CostModel.from_calibration(path)
    assert str(info.value).startswith(f"calibration {path}:") and field.split("_")[0] in str(info.value)


def test_calibrate_checks_flags_before_asking_for_a_gpu(tmp_path, capsys):
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    from hbp_train.perf import calibrate

    assert exit_code(calibrate.main, ["--doc-lens", "16,abc", "--out", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert "--doc-lens" in err and "no CUDA GPU" not in err


def _fake_timer(ms_of):
    """A timing.timer stand-in: the 'median' of fn is ms_of(fn) (fn is not run: no timing noise)."""
    return lambda device: (lambda fn, iters, warmup: ms_of(fn))


def test_calibrate_scales_every_timing_to_32768_tokens(tmp_path, monkeypatch):
    """Each table entry is its own pack's time scaled by 32768 / (tokens in that pack): a doc length that does not
    divide --tokens times fewer tokens. fwd and fwd+bwd land under their own keys; the linear part is per token."""
    from hbp_train.perf import calibrate
    from hbp_train.perf.calibrate import timing
    from hbp_train.perf.cost_model import TABLE_TOKENS

    ms = {"forward": 1.0, "forward_backward": 3.0, "layer_step": 5.0, "head_step": 7.0}
    monkeypatch.setattr(timing, "timer", _fake_timer(lambda fn: ms[fn.__name__]))
    out = tmp_path / "c.json"
    tokens, doc_lens = 100, [16, 64, 100]
    assert calibrate.main(["--allow-cpu", "--model-shape", TINY, "--tokens", str(tokens), "--iters", "1",
                           "--warmup", "0", "--doc-lens", ",".join(map(str, doc_lens)), "--out", str(out)]) == 0
    data = json.loads(out.read_text())
    for length in doc_lens:
        packed = (tokens // length) * length  # whole documents only
        assert data["attention_fwd_ms_32768_tokens_by_doc_len"][str(length)] == \
            pytest.approx(ms["forward"] * TABLE_TOKENS / packed, abs=1e-3)
        assert data["attention_fwdbwd_ms_32768_tokens_by_doc_len"][str(length)] == \
            pytest.approx(ms["forward_backward"] * TABLE_TOKENS / packed, abs=1e-3)
    assert data["linear_fwdbwd_ms_per_32768_tokens"] == pytest.approx(ms["layer_step"] * TABLE_TOKENS / tokens,
                                                                       abs=1e-3)
    assert data["head_fwdbwd_ms_per_32768_tokens"] == pytest.approx(ms["head_step"] * TABLE_TOKENS / tokens,
                                                                     abs=1e-3)


def test_the_lm_head_term_comes_from_the_calibration_when_it_has_one(tmp_path, model):
    """A calibration that timed the chunked loss prices the head with it (per token; scaled by hidden x vocab to
    another shape); one without (the shipped file) prices its four vocab x hidden matmuls at the layer's rate."""
    shipped = json.loads(DEFAULT_CALIBRATION.read_text())
    assert "head_fwdbwd_ms_per_32768_tokens" not in shipped
    lin = model.linear_fb_per_token / LLAMA8B_LINEAR_FLOPS / 3  # seconds per forward FLOP of the linear part
    assert model.head_fb_per_token == pytest.approx(4 * LLAMA8B_HEAD_FLOPS * lin)
    path = tmp_path / "with_head.json"
    path.write_text(json.dumps({**shipped, "head_fwdbwd_ms_per_32768_tokens": 123.0}))
    measured = CostModel.from_calibration(path)
    assert measured.head_fb_per_token == pytest.approx(0.123 / 32768)
    assert measured.pack_time([4096]) - model.pack_time([4096]) == \
        pytest.approx(4096 * (measured.head_fb_per_token - model.head_fb_per_token))
    small = CostModel.from_calibration(path, model_shape="llama3.2-1b")  # hidden 2048 vs 4096, the same vocab
    assert small.head_fb_per_token == pytest.approx(0.5 * measured.head_fb_per_token)
    path.write_text(json.dumps({**shipped, "head_fwdbwd_ms_per_32768_tokens": -1}))
    with pytest.raises(UserError, match="head_fwdbwd_ms_per_32768_tokens"):
        CostModel.from_calibration(path)


@pytest.mark.parametrize("errors", [(0.05, -0.2, 0.0), (0.05, -0.08, 0.09), (-0.11, 0.0, 0.0)])
def test_validate_reports_absolute_errors_and_the_10_percent_verdict_of_the_worst_pack(monkeypatch, errors):
    """error = predicted / measured - 1 per pack; mean and max of |error|; within 10% only if every pack is."""
    from types import SimpleNamespace

    import torch

    from hbp_train.perf.calibrate import timing, validation

    predicted_s = 0.5
    measured_ms = iter([1e3 * predicted_s / (1 + e) for e in errors])
    monkeypatch.setattr(timing, "timer", _fake_timer(lambda fn: next(measured_ms)))
    model = SimpleNamespace(pack_time=lambda lengths: predicted_s, describe=lambda: "fixed")
    args = SimpleNamespace(seed=0, backend="auto", max_samples=8, num_packs=3, tokens=64, iters=1, warmup=0)
    report = validation.validate(parse_model_shape(TINY), model, args, torch.device("cpu"), torch.float32)
    assert [p["num_samples"] for p in report["packs"]] == [1, 3, 8]
    got = [p["error"] for p in report["packs"]]
    assert got == pytest.approx([p["predicted_s"] / p["measured_s"] - 1 for p in report["packs"]])
    assert got == pytest.approx(list(errors), abs=1e-9)
    assert report["mean_abs_error"] == pytest.approx(np.mean(np.abs(errors)))
    assert report["max_abs_error"] == pytest.approx(np.max(np.abs(errors)))
    assert report["within_10_percent"] == all(abs(e) <= 0.10 for e in errors)


def test_validate_accepts_as_many_samples_as_tokens_and_no_more(tmp_path, monkeypatch, capsys):
    """--max-samples may equal --tokens (every sample one token long); one more cannot be split and is refused."""
    from hbp_train.perf import calibrate
    from hbp_train.perf.calibrate import validation

    assert validation.random_pack(np.random.default_rng(0), 16, 16) == [1] * 16  # the edge is a valid pack
    seen = []
    monkeypatch.setattr(validation, "validate", lambda shape, model, args, device, dtype: seen.append(
        args.max_samples) or {"mean_abs_error": 0.0, "max_abs_error": 0.0})
    common = ["--device", "cpu", "--validate", "--model-shape", TINY, "--tokens", "16"]
    assert exit_code(calibrate.main, common + ["--max-samples", "16"]) == 0 and seen == [16]
    assert exit_code(calibrate.main, common + ["--max-samples", "17"]) == 2 and seen == [16]
    assert "--max-samples (17) cannot exceed --tokens (16)" in capsys.readouterr().err


def test_validate_times_the_trainers_chunked_loss_not_hf_logits(monkeypatch):
    """--validate times the program that trains: decoder + chunked LM-head loss; HF's full-logits forward never runs."""
    from types import SimpleNamespace

    import torch
    from transformers import LlamaForCausalLM

    import hbp_train.model.loss
    from hbp_train.common.labels import IGNORE_INDEX
    from hbp_train.perf.calibrate import timing, validation

    def no_hf_forward(*args, **kwargs):
        raise AssertionError("HF's forward (full T x vocab logits and HF's loss) was timed")

    chunked = []
    real = hbp_train.model.loss.chunked_token_losses

    def spy(hidden, weight, labels, chunk_size=4096, **kwargs):
        chunked.append((hidden.shape[-2], chunk_size, int((labels == IGNORE_INDEX).sum())))
        return real(hidden, weight, labels, chunk_size, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", no_hf_forward)
    monkeypatch.setattr(hbp_train.model.loss, "chunked_token_losses", spy)
    monkeypatch.setattr(timing, "timer", _fake_timer(lambda fn: fn() or 1.0))
    model = SimpleNamespace(pack_time=lambda lengths: 1e-3, describe=lambda: "fixed")
    args = SimpleNamespace(seed=0, backend="auto", max_samples=4, num_packs=2, tokens=64, iters=1, warmup=0)
    report = validation.validate(parse_model_shape(TINY), model, args, torch.device("cpu"), torch.float32)
    # one chunked loss per timed pack, at the trainer's chunk, each sample's last token without a label
    assert [(t, c) for t, c, _ in chunked] == [(64, timing.VALIDATE_LOSS_CHUNK)] * 2
    assert [n for _, _, n in chunked] == [p["num_samples"] for p in report["packs"]]


def test_validate_default_pack_fits_the_gpu():
    """32768 tokens of an 8B shape need more than 80 GB in one plain step: the default pack is the largest that fits."""
    from hbp_train.perf.calibrate import timing, validation
    from hbp_train.perf.memory import activation_bytes_per_token_layer

    gib80 = 80 * 2**30
    eight_b, one_b = parse_model_shape("llama3-8b"), parse_model_shape("llama3.2-1b")
    tokens = validation.validate_tokens(eight_b, gib80)
    need = lambda s, t: (4 * s.num_params + timing.VALIDATE_LOSS_CHUNK * s.vocab * 10  # noqa: E731
                         + t * (s.num_layers * activation_bytes_per_token_layer(s) + 6 * s.hidden))
    assert need(eight_b, 32768) > gib80 and tokens < 32768
    assert need(eight_b, tokens) <= validation.MEMORY_HEADROOM * gib80 < need(eight_b, 2 * tokens)
    assert validation.validate_tokens(one_b, gib80) == 32768 and validation.validate_tokens(eight_b, None) == 32768


def test_validation_sizes_its_pack_from_free_memory_and_halves_it_on_out_of_memory(tmp_path, monkeypatch, capsys):
    """The default validation pack fits the GPU's free memory (not its total; no GPU: 32768 tokens); a pack that
    still runs out of memory is retried at half the tokens, and calibrating out of memory is one line naming
    --tokens."""
    from hbp_train.perf import calibrate
    from hbp_train.perf.calibrate import layer, timing, validation

    shape = parse_model_shape("llama3-8b")
    free = 80 * 2**30
    monkeypatch.setattr(timing, "free_gpu_bytes", lambda: free)
    tried = []

    def validate(shape, model, args, device, dtype):
        tried.append(args.tokens)
        if args.tokens > 1024:
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return {"mean_abs_error": 0.0, "max_abs_error": 0.0, "tokens": args.tokens}

    monkeypatch.setattr(validation, "validate", validate)
    assert calibrate.main(["--allow-cpu", "--validate", "--model-shape", "llama3-8b", "--max-samples", "4"]) == 0
    assert validation.validate_tokens(shape, free) < validation.validate_tokens(shape, 140 * 2**30) < 32768
    assert tried[0] == 32768  # measured on the CPU: no GPU memory to size from
    assert len(tried) > 1 and tried[1:] == [t // 2 for t in tried[:-1]] and tried[-1] == 1024
    assert "out of memory: validating with packs of 1024 tokens" in capsys.readouterr().out
    free = 40 * 2**30

    def calibrate_oom(*args):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(layer, "calibrate", calibrate_oom)
    assert exit_code(calibrate.main, ["--allow-cpu", "--model-shape", TINY, "--out", str(tmp_path / "c.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rerun with --tokens 16384" in err and "40.0 GiB free" in err
    monkeypatch.setattr(validation, "validate", lambda *a: (_ for _ in ()).throw(RuntimeError("a real bug")))
    with pytest.raises(RuntimeError, match="a real bug"):  # anything else keeps its traceback
        calibrate.main(["--allow-cpu", "--validate", "--model-shape", TINY, "--max-samples", "4"])


def test_rounds_keep_each_points_median_and_report_the_spread():
    """--rounds: a calibration's every time and a validation's every pack is the median over the rounds (the
    errors and their summary computed from it); the spread is the largest max/min ratio of one point."""
    from hbp_train.perf.calibrate.cli import median_of_rounds

    def cal(linear, fb, f):
        return {"measured": "m", "linear_fwdbwd_ms_per_32768_tokens": linear, "head_fwdbwd_ms_per_32768_tokens": f,
                "attention_fwdbwd_ms_32768_tokens_by_doc_len": {"16": fb, "64": 2 * fb},
                "attention_fwd_ms_32768_tokens_by_doc_len": {"16": f, "64": 2 * f}}

    out = median_of_rounds([cal(10.0, 4.0, 1.0), cal(12.0, 5.0, 1.5), cal(30.0, 4.5, 1.2)])
    assert out["linear_fwdbwd_ms_per_32768_tokens"] == 12.0 and out["head_fwdbwd_ms_per_32768_tokens"] == 1.2
    assert out["attention_fwdbwd_ms_32768_tokens_by_doc_len"] == {"16": 4.5, "64": 9.0}
    assert out["attention_fwd_ms_32768_tokens_by_doc_len"] == {"16": 1.2, "64": 2.4}
    assert out["rounds"] == {"count": 3, "max_spread": 3.0} and out["measured"].endswith("median of 3 rounds")

    def val(*measured):
        return {"packs": [{"predicted_s": 1.0, "measured_s": m, "error": 1.0 / m - 1} for m in measured],
                "mean_abs_error": 0.0, "max_abs_error": 0.0, "within_10_percent": True}

    report = median_of_rounds([val(1.0, 2.0), val(0.8, 2.2), val(1.25, 1.0)])
    assert [p["measured_s"] for p in report["packs"]] == [1.0, 2.0]
    assert [p["error"] for p in report["packs"]] == pytest.approx([0.0, -0.5])
    assert report["mean_abs_error"] == pytest.approx(0.25) and report["max_abs_error"] == pytest.approx(0.5)
    assert report["within_10_percent"] is False and report["rounds"]["max_spread"] == pytest.approx(2.2)


def test_the_calibration_times_what_training_runs(tmp_path, monkeypatch):
    """The calibration and its validation time the trainer's program, not another one: the attention backend chosen
    for the model's head shape (so probed, as auto is in training), the decoder kernels model.kernels resolves to
    (Liger on a GPU; here a recorder stands in for it) on the timed layer and on the validated model, and the LM-head
    loss loss.impl resolves to (fused on a GPU; asked for here). Each is named in the file and the report."""
    from hbp_train.model import attention_setup, kernels, loss
    from hbp_train.model.attention_setup import HeadShape
    from hbp_train.perf import calibrate

    shapes, patched, fused_rows = [], [], []
    real_select, real_fused = attention_setup.select_backend, loss.fused_token_losses

    def select(requested, device, dtype=None, shape=None):
        shapes.append(shape)
        return real_select(requested, device, dtype, shape)

    def fused(hidden, *args, **kwargs):
        fused_rows.append(hidden.shape[0])
        return real_fused(hidden, *args, **kwargs)

    def liger_stand_in(model, requested="auto"):
        patched.append(len(model.layers if hasattr(model, "layers") else model.model.layers))
        return "liger (stand-in: RMSNorm, RoPE, SwiGLU)"

    monkeypatch.setattr(attention_setup, "select_backend", select)
    monkeypatch.setattr(kernels, "select_kernels", lambda requested, model_type, device, zero3=False: "liger")
    monkeypatch.setattr(kernels, "apply_liger", liger_stand_in)
    monkeypatch.setattr(loss, "fused_token_losses", fused)
    out, report = tmp_path / "c.json", tmp_path / "v.json"
    common = ["--device", "cpu", "--threads", "1", "--model-shape", TINY, "--tokens", "128", "--iters", "1",
              "--warmup", "0", "--loss-impl", "fused"]
    assert calibrate.main(common + ["--doc-lens", "32,128", "--out", str(out)]) == 0
    assert calibrate.main(common + ["--validate", "--calibration", str(out), "--max-samples", "2", "--num-packs", "2",
                                    "--validate-out", str(report)]) == 0
    assert shapes and all(s == HeadShape(4, 2, 8, 8) for s in shapes)
    assert patched == [1, 2]  # the timed layer (a one-layer model), then the whole validated model
    assert fused_rows  # the head's timing and every validated pack went through the fused loss
    data, rep = json.loads(out.read_text()), json.loads(report.read_text())
    for doc in (data, rep):
        assert doc["decoder_kernels"] == "liger (stand-in: RMSNorm, RoPE, SwiGLU)" and doc["loss_impl"] == "fused"
    assert "fused LM-head loss" in data["what"] and "liger" in data["what"]


def test_the_levers_time_costs():
    """Tiled MLP: every layer's MLP forward once more (its share of the linear FLOPs) and a fixed cost per tile and
    pass; activation offload: each checkpointed layer's input over PCIe to the host, hidden behind the next layer's
    forward when shorter, and back, exposed (DeepSpeed waits for it). Plain packs pay neither; empty packs nothing."""
    from hbp_train.perf.cost_model import TILED_MLP_TILE_S

    model = CostModel.from_calibration()
    s = model.shape
    tokens, sp, ckpt = 131072, 8, 32
    plain = model.pack_time([tokens], sp, ckpt)
    local = tokens // sp
    mlp_share = 3 * s.hidden * s.ffn / (s.linear_params(active=True) / s.num_layers)
    tiles = local // s.hidden
    tiled = model.pack_time([tokens], sp, ckpt, tiled_mlp=True)
    assert tiled - plain == pytest.approx(s.num_layers * (model.linear_fb_per_token / 3 * mlp_share * local
                                                          + 2 * tiles * TILED_MLP_TILE_S))
    layer_forward = (model.attention_fwd([tokens]).sum() + model.linear_fb_per_token / 3 * tokens) / sp
    for gbps in (25.0, 0.5):  # a PCIe link, and one slower than a layer's forward
        copy = local * s.hidden * 2 / (gbps * 1e9)
        offload = model.pack_time([tokens], sp, ckpt, offload_activations=True, pcie_gbps=gbps)
        assert offload - plain == pytest.approx(ckpt * (max(0.0, copy - layer_forward) + copy))
        assert (copy < layer_forward) == (gbps == 25.0)
    assert model.pack_times([], [0, 0], 1, 0, tiled_mlp=True, offload_activations=True)[0] == 0.0
