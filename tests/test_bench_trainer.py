"""bench/trainer/bench_trainer.py (and its parts bench/trainer/*.py) works (it does NOT check speed): the CPU smoke run trains
both paths and writes the JSON; the HF baseline's batches carry exactly our packs and targets; the pack search
escalates checkpointing on OOM."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "bench" / "trainer" / "bench_trainer.py"


def _load_bench():
    spec = importlib.util.spec_from_file_location("bench_trainer", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


bench = _load_bench()  # puts the repository on sys.path, so its parts import as bench.trainer.*
from bench.trainer import paths  # noqa: E402
from bench.trainer import search  # noqa: E402
from bench.trainer import workload  # noqa: E402


@pytest.mark.slow
@pytest.mark.full  # the default tier runs the trainer check through gpu_acceptance's dry run (test_gpu_acceptance)
def test_cpu_smoke_run_writes_both_paths(tmp_path):
    out = tmp_path / "results.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu", "--model-shape", "tiny", "--pack-len", "1024", "--steps", "2",
         "--out", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(out.read_text())
    assert results["complete"]
    paths = results["paths"]
    assert set(paths) == {"ours", "hf_sdpa"}  # no faster HF attention trains on a CPU
    for name, path in paths.items():
        assert path["ran"], (name, path.get("error"))
        assert path["tokens_per_s"] > 0 and len(path["step_times_s"]) == 2
        assert path["device"].startswith("CPU") and path["mfu"] is None  # no peak FLOP/s for a CPU
    # Same initial weights, same packs, fp32: the first step's loss is the same in both paths.
    assert paths["ours"]["first_loss"] == pytest.approx(paths["hf_sdpa"]["first_loss"], rel=1e-4)
    assert paths["ours"]["attention"] == "hbp_packed/sdpa_block"
    assert results["sp1_check"]["speed_ratio_dispatcher_over_direct"] > 0  # ran; its value is not asserted
    assert "ours/hf_sdpa" in results["ratios"] and results["ratios"]["ours/best_hf"]["best_hf"] == "hf_sdpa"
    search = results["pack_search"]
    assert [a["pack_len"] for a in search["attempts"]] == [1024, 2048] and search["longest_ok"] == 2048
    assert "measured on CPU" in proc.stdout and "longest pack that trained: 2048" in proc.stdout


def test_hf_batch_holds_the_same_tokens_and_targets_as_ours():
    from hbp_train.batches.collate import collate_pack

    packs = workload.make_packs(2048, 3, 500, seed=1, prompt_frac=0.3)
    again = workload.make_packs(2048, 3, 500, seed=1, prompt_frac=0.3)
    for pack, twin in zip(packs, again):
        assert all(np.array_equal(a["input_ids"], b["input_ids"]) for a, b in zip(pack, twin))  # seeded
        assert sum(len(d["input_ids"]) for d in pack) == 2048  # every pack is exactly pack_len
        ours = collate_pack(workload.pack_row(pack))
        hf = paths.hf_batch(pack, flash_kwargs=True)
        assert torch.equal(hf["input_ids"], ours["input_ids"]) and torch.equal(hf["position_ids"], ours["position_ids"])
        # HF's loss shifts the flattened labels by one; the collator masks each sample's first label, so no sample
        # predicts its neighbour's first token: the targets are exactly our per-sample shifted labels.
        hf_targets = torch.cat([hf["labels"][0, 1:], torch.tensor([-100])])
        assert torch.equal(hf_targets, ours["shift_labels"][0])
        assert torch.equal(hf["cu_seq_lens_q"].to(torch.int32), ours["cu_seqlens"])


def test_pack_search_adds_checkpointing_after_oom(monkeypatch):
    """Fake engine: a pack of `length` tokens fits iff length * (layers - ckpt + 1) <= budget."""
    num_layers, budget = 8, 5 * 4096
    built, destroyed = [], []

    def fake_run():
        run = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(
            num_hidden_layers=num_layers, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=500)), device=torch.device("cpu"))
        built.append(run)
        return run

    def fake_step(run, batch, step, ckpt):
        assert all(run is not gone for gone in destroyed), "a destroyed engine was used again"
        if batch["input_ids"].shape[1] * (num_layers - ckpt + 1) > budget:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (fake)")
        return 0.5, 1.0

    monkeypatch.setattr(search, "ours_step", fake_step)
    monkeypatch.setattr(search, "destroy_ours", destroyed.append)
    args = SimpleNamespace(ckpt_levels=None, pack_len=1024, max_pack_search=32768, search_docs="single", seed=0,
                           prompt_frac=0.0, search_budget_s=60.0, search_steps=1)
    first = {"pack_len": 1024, "ckpt_layers": 0, "ok": True, "oom": False}
    saved = []  # attempts in the partial result handed over after each attempt (the bench saves it right then)
    result, run = search.pack_search(args, fake_run(), fake_run, {"vocab_size": 500}, torch.device("cpu"), None, first,
                                    lambda partial: saved.append(len(partial["attempts"])))
    tried = [(a["pack_len"], a["ckpt_layers"], a["ok"]) for a in result["attempts"]]
    # Levels 0, 2, 4, 6, 8, tried from the last one that fitted: 2048 fits at 0, 4096 needs 4, 8192 and 16384
    # need all 8, 32768 fits at none (the search stops there).
    assert tried == [(1024, 0, True), (2048, 0, True), (4096, 0, False), (4096, 2, False), (4096, 4, True),
                     (8192, 4, False), (8192, 6, False), (8192, 8, True), (16384, 8, True), (32768, 8, False)]
    assert all(a["oom"] for a in result["attempts"] if not a["ok"])
    assert result["longest_ok"] == 16384 and result["ckpt_layers_needed"] == 8 and not result["goal_met"]
    # One fresh engine per OOM, none after the last level failed (nothing is left to try).
    assert len(destroyed) == 5 and len(built) == 5 and run is None
    assert saved == list(range(2, 11))


def test_pack_search_holds_the_only_reference_to_the_engine(monkeypatch):
    """After an OOM the search destroys the engine and builds a fresh one: nothing in run_bench may still reference
    the old one, or its weights and optimizer states would stay on the GPU for the rest of the search."""
    import gc
    import weakref

    import hbp_train.distributed.groups

    class FakeRun:
        def __init__(self):
            from hbp_train.build import DeepSpeedConfig
            from hbp_train.model.loss import LossConfig

            self.model, self.device = torch.nn.Linear(2, 2), torch.device("cpu")
            self.model.config = None
            self.cfg = SimpleNamespace(loss=LossConfig(), deepspeed=DeepSpeedConfig())

    freed = []

    def fake_search(args, run, rebuild, *rest):
        gone = weakref.ref(run)
        del run
        gc.collect()
        freed.append(gone() is None)
        return {"goal_met": False}, None

    monkeypatch.setattr(hbp_train.distributed.groups, "init_distributed", lambda backend=None: None)
    monkeypatch.setattr(bench, "device_info", lambda device, peak_flops: {"name": "cpu", "type": "cpu"})
    monkeypatch.setattr(bench, "build_ours", lambda *args: (FakeRun(), "sdpa_block"))
    monkeypatch.setattr(bench, "measure_ours", lambda *args: paths.Measured([0.1], 64, 1e6, [1.0], 0.1))
    monkeypatch.setattr(bench, "pack_search", fake_search)
    args = bench.resolve_args(bench.build_parser().parse_args(
        ["--device", "cpu", "--pack-len", "64", "--steps", "1", "--baselines", "none", "--no-sp1-check"]))
    results = bench.run_bench(args)
    assert freed == [True] and results["pack_search"] == {"goal_met": False}


def test_bad_model_shape_is_one_line_exit_2(capsys, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # main() sets these for a CPU run; restored after the test
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    assert bench.main(["--device", "cpu", "--model-shape", "{\"hidden_size\": 8}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "missing HF config field" in err[0]


def test_ours_is_built_as_a_one_micro_batch_run(monkeypatch):
    """One pack per step is one micro-batch: ours must be built as such a run is (bf16 gradients accumulated in
    bf16), not with DeepSpeed's fp32 accumulation buffer and its extra pass, which a real run of that plan skips."""
    from hbp_train import build as builder

    class Built(Exception):
        pass

    seen = {}

    def spy(cfg, groups, total_steps, **kwargs):
        seen.update(kwargs, cfg=cfg, total_steps=total_steps)
        raise Built

    monkeypatch.setattr(builder, "build_run", spy)
    args = bench.resolve_args(bench.build_parser().parse_args(["--device", "cpu"]))
    with pytest.raises(Built):
        paths.build_ours(args, "llama", workload.parse_shape("tiny")[2], torch.device("cpu"))
    assert seen["max_micro_batches"] == 1
    cfg = seen["cfg"]
    ds = builder.deepspeed_config(cfg.deepspeed, cfg.train, seen["total_steps"], 1, True, seen["max_micro_batches"])
    assert "data_types" not in ds  # bf16 (a GPU run's dtype): no fp32 accumulation for a one-micro-batch step


def _importable_kernels(monkeypatch, present: set[str]):
    """transformers says which flash packages are installed; our import says which of them really import."""
    import transformers.utils as tu

    for version in (2, 3, 4):
        monkeypatch.setattr(tu, f"is_flash_attn_{version}_available", lambda *a, v=version, **k: True)
    monkeypatch.setattr(tu, "is_torch_flex_attn_available", lambda: True)
    monkeypatch.setattr(paths, "_kernel_imports", lambda impl: impl in present)


def test_the_best_hf_path_tries_flash_attention_4_3_2_then_flex(monkeypatch):
    """With flash-attn-4 present HF trains with attn_implementation="flash_attention_4": the best HF path must be
    that, not flex while ours runs FA4. A kernel transformers lists but that does not import is not offered."""
    cuda = torch.device("cuda")  # only its type is read: no GPU needed
    _importable_kernels(monkeypatch, {"flash_attention_4", "flash_attention_3", "flash_attention_2"})
    assert paths.hf_attention_candidates(cuda, "bf16") == ["flash_attention_4", "flash_attention_3",
                                                           "flash_attention_2", "flex_attention", "sdpa"]
    (best,), _ = paths.resolve_baselines(["best"], cuda, "bf16")
    assert (best.impl, best.fallbacks) == ("flash_attention_4", ("flash_attention_3", "flash_attention_2",
                                                                "flex_attention"))
    _importable_kernels(monkeypatch, {"flash_attention_2"})  # FA4/FA3 listed by transformers but broken here
    assert paths.hf_attention_candidates(cuda, "bf16") == ["flash_attention_2", "flex_attention", "sdpa"]
    assert paths.hf_attention_candidates(cuda, "fp32") == ["flex_attention", "sdpa"]  # flash kernels: half only


def test_a_best_hf_kernel_that_fails_gives_way_to_the_next(monkeypatch):
    """The best HF path is tried through attn_implementation in order: one that transformers refuses or whose steps
    fail is noted and the next one runs (here, on the CPU, FA4 and FA3 are refused for real and sdpa trains)."""
    args = bench.resolve_args(bench.build_parser().parse_args(["--device", "cpu", "--steps", "1", "--warmup", "0"]))
    name, architecture, hf_config = workload.parse_shape("tiny")
    packs = workload.make_packs(128, 1, hf_config["vocab_size"], 0, 0.0)
    best = paths.Baseline("flash_attention_4", "bf16", fallbacks=("flash_attention_3", "sdpa"))
    measured, ran, tried = paths.measure_hf_best(args, architecture, hf_config, best, packs, torch.device("cpu"))
    assert ran == paths.Baseline("sdpa", "bf16") and measured.tokens == 128
    assert [t.split(":")[0] for t in tried] == ["flash_attention_4", "flash_attention_3"]
    assert "ImportError" in tried[0]


def test_an_hf_path_that_cannot_fit_is_not_run(monkeypatch):
    """HF's loss holds the pack's logits in bf16 and twice in fp32 (>= 10 B per token and vocabulary entry: 78.3 GiB at
    64K tokens of a 128K vocabulary), and its model states hold 8 B per parameter on the speed path (bf16 weights,
    gradients, two AdamW states; 16 B in fp32 on the accuracy path): on an 80 GB GPU the 1B shape's 64K pack cannot
    fit, although its logits alone would (the check that counted them alone let flex compile for minutes, then run
    out of memory). Such a path is reported as "cannot fit" with the figures, and costs nothing."""
    from hbp_train.perf.shape import parse_model_shape

    one_b = parse_model_shape(workload.parse_shape("llama3.2-1b")[2]).num_params
    monkeypatch.setattr(paths, "free_device_bytes", lambda device: 79 * 2**30)  # an H100's 80 GB, less the context
    why = paths.hf_cannot_fit(65536, 128256, one_b, "bf16", torch.device("cuda"))
    assert why.startswith("cannot fit: its full logits need at least 78.3 GiB") and "79.0 GiB free" in why
    assert "model states 9.2 GiB" in why and "HF speed path" in why
    assert paths.hf_cannot_fit(16384, 128256, one_b, "bf16", torch.device("cuda")) is None
    assert "model states 18.4 GiB" in paths.hf_cannot_fit(65536, 128256, one_b, "amp", torch.device("cuda"))
    monkeypatch.setattr(paths, "free_device_bytes", lambda device: 139 * 2**30)  # an H200: it fits, it is tried
    assert paths.hf_cannot_fit(65536, 128256, one_b, "bf16", torch.device("cuda")) is None
    assert paths.hf_cannot_fit(65536, 128256, one_b, "bf16", torch.device("cpu")) is None  # the CPU: not checked


# ------------------------------------------------------------------------------------ the bench held to a budget
class _FakeRun:
    """What run_bench reads of ours' build.Run; its engine records being destroyed."""

    def __init__(self, destroyed: list):
        from hbp_train.build import DeepSpeedConfig
        from hbp_train.model.loss import LossConfig

        self.model, self.device = torch.nn.Linear(2, 2), torch.device("cpu")
        self.model.config = SimpleNamespace(num_hidden_layers=2)
        self.cfg = SimpleNamespace(loss=LossConfig(), deepspeed=DeepSpeedConfig())
        self.engine = SimpleNamespace(destroy=lambda: destroyed.append(self))


def _fake_paths(monkeypatch, order: list, destroyed: list, ours=None):
    import hbp_train.distributed.groups

    def measure_hf(args, architecture, hf_config, baseline, packs, device, measure=None):
        order.append(baseline.key)
        return paths.Measured([0.1], 64, 1e6, [1.0], 0.1), baseline, []

    monkeypatch.setattr(hbp_train.distributed.groups, "init_distributed", lambda backend=None: None)
    monkeypatch.setattr(bench, "device_info", lambda device, peak_flops: {"name": "cpu", "type": "cpu"})
    monkeypatch.setattr(bench, "build_ours", lambda *args: (_FakeRun(destroyed), "sdpa_block"))
    monkeypatch.setattr(bench, "measure_hf_best", measure_hf)
    monkeypatch.setattr(bench, "measure_ours", ours or (lambda *args: order.append("ours") or
                                                        paths.Measured([0.05], 64, 1e6, [1.0], 0.1)))


def test_with_a_budget_the_ratio_is_measured_before_the_accuracy_path(monkeypatch, tmp_path):
    """The headline is ours over the HF speed path: with --time-budget-s the speed path runs, then ours, and the results
    written right after ours hold the ratio; the accuracy path (whose first step compiles again) comes after, in the
    time left, and only when as much time is left as the speed path took."""
    order, destroyed, saved = [], [], []
    _fake_paths(monkeypatch, order, destroyed)
    real_save = bench.save
    monkeypatch.setattr(bench, "save", lambda results, out: (saved.append(json.loads(json.dumps(results, default=float))),
                                                            real_save(results, out)))
    argv = ["--device", "cpu", "--pack-len", "64", "--steps", "1", "--baselines", "sdpa,sdpa:amp", "--no-sp1-check",
            "--max-pack-search", "0", "--time-budget-s", "60", "--ours-reserve-s", "20", "--out",
            str(tmp_path / "r.json")]
    results = bench.run_bench(bench.resolve_args(bench.build_parser().parse_args(argv)))
    assert order == ["hf_sdpa", "ours", "hf_sdpa_amp"]
    after_ours = next(s for s in saved if "ours" in s["paths"])
    assert after_ours["ratios"]["ours/best_hf"]["tokens_per_s"] == pytest.approx(2.0)
    assert "hf_sdpa_amp" not in after_ours["paths"] and results["paths"]["hf_sdpa_amp"]["ran"]
    assert destroyed  # ours' engine was gone before the accuracy path was built
    # the speed path took longer than what is left: the accuracy path is skipped, and said why. It takes 1.5 s of the
    # 2.5 s budget, so at most 1 s is left whatever the set-up before it took (a 1 s path left it to chance)
    order.clear()
    real_measure = bench.measure_hf_best

    def slow_hf(*args, **kwargs):
        import time

        time.sleep(1.5)
        return real_measure(*args, **kwargs)

    monkeypatch.setattr(bench, "measure_hf_best", slow_hf)
    argv[argv.index("--time-budget-s") + 1], argv[argv.index("--ours-reserve-s") + 1] = "2.5", "0.5"
    results = bench.run_bench(bench.resolve_args(bench.build_parser().parse_args(argv)))
    assert order == ["hf_sdpa", "ours"] and not results["paths"]["hf_sdpa_amp"]["ran"]
    assert "it needs 2 s (what the first HF path took)" in results["paths"]["hf_sdpa_amp"]["error"]


def test_a_stop_from_outside_destroys_ours_engine(monkeypatch):
    """The acceptance stops a check at its budget from outside (bench/trainer/deadline.py): ours' engine must be
    destroyed on the way out, not left (~20 GB for the 1B shape) to the garbage collector before the next check."""
    import time

    from bench.trainer.deadline import run_limited

    def stuck(*args):
        while True:
            time.sleep(0.01)

    order, destroyed = [], []
    _fake_paths(monkeypatch, order, destroyed, ours=stuck)
    args = bench.resolve_args(bench.build_parser().parse_args(
        ["--device", "cpu", "--pack-len", "64", "--steps", "1", "--baselines", "none", "--no-sp1-check"]))
    result, over = run_limited(lambda: bench.run_bench(args), 0.5, "trainer")
    assert over and len(destroyed) == 1
    # the same in the pack search, which holds the engine it built after an out-of-memory error
    search_destroyed, built = [], []

    def oom_then_stuck(run, batch, step, ckpt):
        if len(built) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (fake)")
        stuck()

    monkeypatch.setattr(search, "ours_step", oom_then_stuck)
    monkeypatch.setattr(search, "destroy_ours", lambda run: run is not None and search_destroyed.append(run))
    fake = SimpleNamespace(model=SimpleNamespace(config=SimpleNamespace(
        num_hidden_layers=4, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=500)), device=torch.device("cpu"))
    built.append(fake)
    args = SimpleNamespace(ckpt_levels=None, pack_len=64, max_pack_search=128, search_docs="single", seed=0,
                           prompt_frac=0.0, search_budget_s=60.0, search_steps=1)

    def rebuild():
        built.append(SimpleNamespace(**vars(fake)))
        return built[-1]

    _, over = run_limited(lambda: search.pack_search(args, fake, rebuild, {"vocab_size": 500}, torch.device("cpu"),
                                                     None, None), 0.5, "longest_pack")
    assert over and search_destroyed == built  # the first after its OOM, the rebuilt one by the stop


def test_a_stop_while_the_results_are_written_leaves_the_last_ones_whole(monkeypatch, tmp_path):
    """A stop from outside is a signal: it can land inside the write of the results. The last results written must
    stay whole (the acceptance reads them back as the check's partial result)."""
    from bench.trainer.deadline import OverBudget

    out = tmp_path / "trainer.json"
    bench.save({"paths": {"ours": {"ran": True}}, "ratios": {}}, out)
    real_write = Path.write_text

    def cut_short(self, text, *args, **kwargs):
        real_write(self, text[: len(text) // 2])
        raise OverBudget(SimpleNamespace(what="trainer", seconds=1.0))

    monkeypatch.setattr(Path, "write_text", cut_short)
    with pytest.raises(OverBudget):
        bench.save({"paths": {"ours": {"ran": True}, "hf_sdpa": {"ran": True}}, "ratios": {}}, out)
    monkeypatch.undo()
    assert json.loads(out.read_text()) == {"paths": {"ours": {"ran": True}}, "ratios": {}}
    assert [p.name for p in tmp_path.iterdir()] == ["trainer.json"]  # no temporary file left behind
