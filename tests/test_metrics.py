"""Step metrics: namespaced dict from every rank's gathered values (imbalance, MFU with sum-of-len^2 attention
FLOPs), the rank-0 line and the JSON-lines file."""

from __future__ import annotations

import json
import time

import pytest
import torch

from hbp_train.common.errors import UserError
from hbp_train.observe.step_timing import sp_mix_columns
from hbp_train.observe.telemetry import LoggingConfig, MetricsLogger, all_gather_floats, format_line
from hbp_train.trainer import STAT_COLUMNS
from tests.cli_exit import exit_code


def _gathered(rows, columns=STAT_COLUMNS):
    # columns a row does not name (e.g. the SP token counts) are 0
    return torch.tensor([[r.get(c, 0.0) for c in columns] for r in rows], dtype=torch.float64)


MIXED_COLUMNS = STAT_COLUMNS + sp_mix_columns([1, 2])


def _mixed_rows(step=0):
    """Two ranks of a step that ran groups 0 (sp=1) and 1 (sp=2): 40 of its 60 tokens at sp=1, 2 of its 8 compute
    seconds (both ranks)."""
    return [dict(compute_time=4.0 + step, loss_sum=3.0, loss_tokens=3, tokens=40, flops=1e9, tokens_sp1=30,
                 tokens_sp2=10, compute_time_sp1=1.0, compute_time_sp2=3.0),
            dict(compute_time=4.0, loss_sum=3.0, loss_tokens=3, tokens=20, flops=1e9, tokens_sp1=10, tokens_sp2=10,
                 compute_time_sp1=1.0, compute_time_sp2=3.0)]


def test_step_metrics_and_outputs(tmp_path):
    cfg = LoggingConfig(tensorboard=True, progress_bar=False, peak_flops=1e12)
    logger = MetricsLogger(cfg, str(tmp_path), rank=0, total_steps=10)
    rows = [dict(compute_time=2.0, loss_sum=30.0, loss_tokens=10, tokens=100, flops=3e12, nonfinite=0, stop=0,
                 peak_mem_gib=1.5),
            dict(compute_time=1.0, loss_sum=10.0, loss_tokens=30, tokens=50, flops=1e12, nonfinite=0, stop=0,
                 peak_mem_gib=2.5)]
    m = logger.step_metrics(step=3, total_steps=10, gathered=_gathered(rows), columns=STAT_COLUMNS, lr=1e-4,
                            grad_norm=0.5, step_time=2.0, data_time=0.5, group=1, sp=2, num_micro_batches=3,
                            plan_metrics={"ABR": 1.1, "DBR": 1.05}, skipped=False, num_skipped=0, pack_len=64,
                            num_packs=3)
    assert m["loss/train"] == pytest.approx(40.0 / 40)  # token-weighted over ranks
    assert m["perf/tokens_per_s"] == pytest.approx(75.0)
    assert m["balance/imbalance"] == pytest.approx(2.0 / 1.5)
    assert m["balance/live_BR"] == pytest.approx(((2.0 - 2.0) + (2.0 - 1.0)) / (2.0 * 2))  # the plan's ABR formula
    assert m["perf/mfu"] == pytest.approx(4e12 / (2 * 1e12 * 2.0))
    assert m["perf/tflops_per_device"] == pytest.approx(4e12 / 2 / 2.0 / 1e12)  # FLOPs of all ranks / ranks / s
    assert m["memory/peak_gib"] == 2.5 and m["perf/data_wait_pct"] == pytest.approx(25.0)
    # Namespaced, but for the step and epoch, which count from 1 as the line does (plan/step counts from 0).
    assert {k.split("/")[0] for k in m} == {"loss", "optim", "perf", "balance", "memory", "plan", "tokens", "step",
                                            "epoch", "time"}
    # Elapsed since the logger started (4 steps done), the ETA their mean time over the 6 steps left.
    assert m["time/eta_s"] == pytest.approx(m["time/elapsed_s"] / 4 * 6)
    assert (m["step"], m["epoch"], m["plan/step"]) == (4, 1, 3)
    assert m["tokens/ave_t"] == 150 / 2 and m["tokens/pad_ratio"] == pytest.approx(1 - 150 / (64 * 3))  # live Ave-T, PR
    logger.log(m)
    logger.close()
    line = format_line(m)
    assert "step 4/10" in line and "imb 1.333" in line and "BR live 0.250, plan ABR 1.100" in line and "mfu 100.0%" in line
    record = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])
    assert record["balance/plan_DBR"] == 1.05 and record["plan/sp"] == 2
    assert list((tmp_path / "tb").iterdir())
    assert (tmp_path / "metrics.png").stat().st_size > 0  # drawn when the logger closes (hbp_train/observe/metrics_plot.py)


def test_step_and_epoch_count_from_one_across_epochs(tmp_path):
    logger = MetricsLogger(LoggingConfig(tensorboard=False, progress_bar=False), str(tmp_path), rank=0, total_steps=6)
    row = dict(compute_time=1.0, loss_sum=1.0, loss_tokens=1, tokens=8)
    for step in range(6):  # 3 optimizer steps per epoch, 2 epochs
        logger.log(logger.step_metrics(step=step, total_steps=6, gathered=_gathered([row]), columns=STAT_COLUMNS,
                                       lr=1e-4, grad_norm=0.5, step_time=1.0, data_time=0.0, group=0, sp=1,
                                       num_micro_batches=1, plan_metrics={}, skipped=False, num_skipped=0,
                                       steps_per_epoch=3))
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["epoch"], r["plan/step"]) for r in rows] == [(1, 1, 0), (2, 1, 1), (3, 1, 2), (4, 2, 3),
                                                                       (5, 2, 4), (6, 2, 5)]


def test_run_plot_reads_resumed_logs_and_refuses_damaged_ones(tmp_path, capsys):
    from hbp_train.observe.metrics_plot import read_metrics
    from hbp_train.run_plot import main

    base = {"loss/train": 5.0, "perf/tokens_per_s": 10.0, "plan/sp": 1, "balance/imbalance": 1.1,
            "balance/plan_ABR": 0.05, "memory/peak_gib": 1.0, "sp/cr": 0.0}
    lines = [{**base, "plan/step": 0}, {**base, "plan/step": 1, "loss/train": 4.0},
             {**base, "plan/step": 1, "loss/train": 3.5, "loss/eval": 3.9, "plan/sp": 2}]  # step 1 again (resume)
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["plan/step"] for r in records] == [0, 1] and records[1]["loss/train"] == 3.5
    assert main([str(tmp_path), "--out", str(tmp_path / "p.png")]) == 0 and (tmp_path / "p.png").stat().st_size
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write("{not json\n")
    assert main([str(tmp_path)]) == 2
    assert "metrics.jsonl:4: not a step record" in capsys.readouterr().err
    assert exit_code(main, [str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"error: run_dir: {tmp_path / 'nowhere'}: no such folder" in err, err


def test_a_mixed_step_reports_every_sp_degree_with_its_share_of_tokens_and_time(tmp_path):
    """A step that mixes groups at sp=1 and sp=2: plan/sp_degrees, the per-degree token and time shares in the JSON
    row, TensorBoard and the rank-0 line; plan/sp and plan/group are the largest it ran. A one-degree step keeps its
    short line."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(LoggingConfig(progress_bar=False), str(tmp_path), rank=0, total_steps=2)
    common = dict(total_steps=2, columns=MIXED_COLUMNS, lr=1e-4, grad_norm=0.5, step_time=4.0, data_time=0.0,
                  num_micro_batches=4, plan_metrics={}, skipped=False, num_skipped=0)
    mixed = logger.step_metrics(step=0, gathered=_gathered(_mixed_rows(), MIXED_COLUMNS), group=0, sp=1,
                                groups=[1, 0], **common)
    assert mixed["plan/sp_degrees"] == [1, 2] and mixed["plan/groups"] == [0, 1]
    assert mixed["plan/sp"] == 2 and mixed["plan/group"] == 1
    assert mixed["sp/token_share/sp1"] == pytest.approx(40 / 60)
    assert mixed["sp/token_share/sp2"] == pytest.approx(20 / 60)
    assert mixed["sp/time_share/sp1"] == pytest.approx(0.25) and mixed["sp/time_share/sp2"] == pytest.approx(0.75)
    assert "| groups 0+1 sp=1 (67% tokens, 25% time) + sp=2 (33%, 75%) m 4 |" in format_line(mixed)
    one = [dict(compute_time=1.0, tokens=10, tokens_sp1=10, compute_time_sp1=1.0)] * 2
    single = logger.step_metrics(step=1, gathered=_gathered(one, MIXED_COLUMNS), group=0, sp=1, groups=[0], **common)
    assert single["plan/sp_degrees"] == [1] and single["sp/time_share/sp2"] == 0.0
    assert "| group 0 sp=1 m 4 |" in format_line(single)
    for m in (mixed, single):
        logger.log(m)
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["plan/sp_degrees"] for r in rows] == [[1, 2], [1]] and rows[0]["sp/time_share/sp2"] == 0.75
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [e.value for e in events.Scalars("sp/time_share/sp2")] == pytest.approx([0.75, 0.0])
    assert [e.value for e in events.Scalars("sp/token_share/sp1")] == pytest.approx([40 / 60, 1.0])
    assert (tmp_path / "metrics.png").stat().st_size > 0  # tokens/s as "sp=1+2" and "sp=1", time at SP > 1


def test_mfu_is_na_without_a_peak_on_cpu(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("auto peak FLOPs may be known on this GPU")
    logger = MetricsLogger(LoggingConfig(jsonl=False, tensorboard=False, progress_bar=False), str(tmp_path), 0, 1)
    row = dict(compute_time=1.0, loss_sum=1.0, loss_tokens=1, tokens=1, flops=1.0, nonfinite=0, stop=0,
               peak_mem_gib=0.1)
    m = logger.step_metrics(step=0, total_steps=1, gathered=_gathered([row]), columns=STAT_COLUMNS, lr=0.1,
                            grad_norm=None, step_time=1.0, data_time=0.0, group=0, sp=1, num_micro_batches=1,
                            plan_metrics={}, skipped=True, num_skipped=1)
    assert m["perf/mfu"] is None
    assert "mfu n/a" in format_line(m) and "(skipped)" in format_line(m) and "gnorm n/a" in format_line(m)


def test_all_gather_without_process_group_is_local():
    assert all_gather_floats([1.0, 2.0], torch.device("cpu")).tolist() == [[1.0, 2.0]]
    with pytest.raises(UserError, match="logging.log_every"):
        LoggingConfig(log_every=0)


def test_a_fresh_run_replaces_metrics_jsonl_and_a_resumed_one_continues_it(tmp_path):
    cfg = LoggingConfig(tensorboard=False, progress_bar=False)
    (tmp_path / "metrics.jsonl").write_text('{"plan/step": 0, "from": "an earlier attempt"}\n')
    for start_step, expected_rows in ((3, 2), (0, 1)):
        logger = MetricsLogger(cfg, str(tmp_path), rank=0, total_steps=10, start_step=start_step)
        row = dict(compute_time=1.0, loss_sum=1.0, loss_tokens=1, tokens=10, flops=1e9, nonfinite=0, stop=0)
        logger.log(logger.step_metrics(step=start_step, total_steps=10, gathered=_gathered([row]), columns=STAT_COLUMNS,
                                       lr=1e-4, grad_norm=0.5, step_time=1.0, data_time=0.0, group=0, sp=1,
                                       num_micro_batches=1, plan_metrics={}, skipped=False, num_skipped=0))
        logger.close()
        rows = (tmp_path / "metrics.jsonl").read_text().splitlines()
        assert len(rows) == expected_rows, (start_step, rows)


def test_a_resumed_run_drops_the_rows_of_the_steps_it_reruns(tmp_path):
    # An attempt logged steps 0..6, saved at 4 and was killed while writing row 7: the resume at step 4 keeps 0..3.
    rows = [json.dumps({"plan/step": s, "loss/train": 10.0 - s}) for s in range(7)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(rows) + '\n{"plan/step": 7, "loss/tr')
    cfg = LoggingConfig(tensorboard=False, progress_bar=False)
    logger = MetricsLogger(cfg, str(tmp_path), rank=0, total_steps=10, start_step=4)
    row = dict(compute_time=1.0, loss_sum=1.0, loss_tokens=1, tokens=10, flops=1e9, nonfinite=0, stop=0)
    logger.log(logger.step_metrics(step=4, total_steps=10, gathered=_gathered([row]), columns=STAT_COLUMNS,
                                   lr=1e-4, grad_norm=0.5, step_time=1.0, data_time=0.0, group=0, sp=1,
                                   num_micro_batches=1, plan_metrics={}, skipped=False, num_skipped=0))
    logger.jsonl.close()
    logged = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["plan/step"] for m in logged] == [0, 1, 2, 3, 4]
    assert [m["loss/train"] for m in logged[:4]] == [10.0, 9.0, 8.0, 7.0] and logged[4]["loss/train"] == 1.0


def test_last_step_line_is_printed_whatever_log_every(tmp_path, capsys):
    cfg = LoggingConfig(log_every=5, jsonl=False, tensorboard=False, progress_bar=False)
    logger = MetricsLogger(cfg, str(tmp_path), rank=0, total_steps=8)
    row = dict(compute_time=1.0, loss_sum=1.0, loss_tokens=1, tokens=1, flops=1.0, nonfinite=0, stop=0,
               peak_mem_gib=0.1)
    for step in range(8):
        logger.log(logger.step_metrics(step=step, total_steps=8, gathered=_gathered([row]), columns=STAT_COLUMNS,
                                       lr=0.1, grad_norm=1.0, step_time=1.0, data_time=0.0, group=0, sp=1,
                                       num_micro_batches=1, plan_metrics={}, skipped=False, num_skipped=0))
    printed = [line.split(" | ")[0] for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert printed == ["step 1/8", "step 6/8", "step 8/8"]  # steps 0 and 5 (every 5th) and the last one


def test_read_metrics_skips_blank_lines_and_orders_steps(tmp_path):
    """Blank lines (an editor, a cut-short append) are not records; steps come back in step order, each once with
    its last row, whatever order the file holds them in."""
    from hbp_train.observe.metrics_plot import read_metrics

    rows = [{"plan/step": 2, "loss/train": 1.0}, {"plan/step": 0, "loss/train": 3.0},
            {"plan/step": 2, "loss/train": 0.5}, {"plan/step": 1, "loss/train": 2.0}]
    text = "\n".join(json.dumps(r) for r in rows[:2]) + "\n\n   \n" + "\n".join(json.dumps(r) for r in rows[2:]) + "\n"
    (tmp_path / "metrics.jsonl").write_text(text)
    last = {r["plan/step"]: r for r in rows}  # later rows of a step win
    assert read_metrics(tmp_path / "metrics.jsonl") == [last[s] for s in sorted(last)]


def _wandb_records(path) -> list:
    """The protobuf records of a W&B transaction log (run-*.wandb): a 7-byte file header, then LevelDB-log blocks of
    32 KiB whose records carry a 7-byte header (crc32, length, type 1 full / 2 first / 3 middle / 4 last)."""
    import struct

    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, records, parts = 7, 32768, [], b""
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:
            break
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


def _wandb_history(run_dir) -> list:
    """The history rows (key -> value) of the one offline W&B run under run_dir."""
    (log,) = list((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    return [{"/".join(item.nested_key) if item.nested_key else item.key: json.loads(item.value_json)
             for item in record.history.item}
            for record in _wandb_records(log) if record.WhichOneof("record_type") == "history"]


def test_wandb_sink_logs_the_same_keys_on_rank_0_only_with_one_line_per_rank(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = LoggingConfig(tensorboard=False, progress_bar=False, wandb=True, wandb_run_name="t")
    other = MetricsLogger(cfg, str(tmp_path / "rank1"), rank=1, total_steps=3)
    assert other.wandb is None
    logger = MetricsLogger(cfg, str(tmp_path), rank=0, total_steps=3)
    logged = []
    for step in range(3):
        # steps that mix sp=1 and sp=2: their per-degree shares (sp/token_share/sp<d>, ...) reach W&B too
        m = logger.step_metrics(step=step, total_steps=3, gathered=_gathered(_mixed_rows(step), MIXED_COLUMNS),
                                columns=MIXED_COLUMNS, lr=1e-4, grad_norm=0.5, step_time=2.0, data_time=0.1, group=0,
                                sp=1, num_micro_batches=1, plan_metrics={"ABR": 0.1}, skipped=False, num_skipped=0,
                                groups=[0, 1])
        assert m["sp/time_share/sp2"] == 0.75
        m.update({"time/compute_s/rank0": 1.0 + step, "time/compute_s/rank1": 2.0})
        logger.log(m)
        other.log(m)
        logged.append(m)
    logger.close()
    other.close()
    assert not (tmp_path / "rank1" / "wandb").exists()
    # W&B's service process writes the offline file; on a loaded machine its last records can land a moment after
    # finish() returns, so the rows are read until all three are there (at most half a minute).
    deadline = time.monotonic() + 30
    while True:
        history = _wandb_history(tmp_path)
        steps = [r for r in history if "loss/train" in r]
        if len(steps) == 3 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert len(steps) == 3
    for row, m in zip(steps, logged):
        assert "step" not in row  # a key W&B keeps for itself: its own step axis (plan/step) says it
        for key, value in m.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
                assert row[key] == pytest.approx(value), key
    chart = [r for r in history if "time/compute_s_per_rank" in r or any("compute_s_per_rank" in k for k in r)]
    assert len(chart) == 1  # the per-rank times as one chart, one line per rank


def test_wandb_without_the_package_is_a_user_error(tmp_path, monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_wandb(name, *args, **kwargs):
        if name == "wandb":
            raise ImportError("No module named 'wandb'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    with pytest.raises(UserError, match=r"logging.wandb=true needs the wandb package"):
        MetricsLogger(LoggingConfig(tensorboard=False, progress_bar=False, wandb=True), str(tmp_path), 0, 1)


def test_step_length_mix_shows_in_the_line():
    """mix/tv (telemetry.StepLengthMix, tested on packed shards in test_planning_shards.py) shows in the rank-0 line
    when the step metrics carry it."""
    cfg = LoggingConfig(tensorboard=False, progress_bar=False, jsonl=False)
    logger = MetricsLogger(cfg, "unused", rank=1, total_steps=1)
    row = dict(compute_time=1.0, loss_sum=1.0, loss_tokens=1, tokens=1, flops=1.0)
    m = logger.step_metrics(step=0, total_steps=1, gathered=_gathered([row]), columns=STAT_COLUMNS, lr=0.1,
                            grad_norm=1.0, step_time=1.0, data_time=0.0, group=0, sp=1, num_micro_batches=1,
                            plan_metrics={}, skipped=False, num_skipped=0)
    assert "mix tv" not in format_line(m)
    m.update({"mix/tv": 0.4321, "mix/le_16": 1.0})
    assert "| mix tv 0.43" in format_line(m)


def test_comm_waits_are_timed_on_sampled_gpu_steps_only():
    """Timing a collective's wait costs a device sync around it (ZeRO's overlap of reduction and backward is lost):
    on a GPU only every comm_wait_every-th step is timed, the others run with nothing wrapped; a CPU, a single rank
    and exclude_comm_wait=false never pay for it."""
    from hbp_train.observe.step_timing import comm_wait_mode

    cfg = LoggingConfig(comm_wait_every=4)
    assert [comm_wait_mode(cfg, s, on_gpu=True, world_size=8) for s in range(9)] == \
        ["exclude", "skip", "skip", "skip", "exclude", "skip", "skip", "skip", "exclude"]
    assert {comm_wait_mode(cfg, s, on_gpu=False, world_size=8) for s in range(9)} == {"exclude"}
    assert {comm_wait_mode(cfg, s, on_gpu=True, world_size=1) for s in range(9)} == {"include"}
    assert comm_wait_mode(LoggingConfig(exclude_comm_wait=False), 0, on_gpu=True, world_size=8) == "include"
    assert LoggingConfig().comm_wait_every > 1  # the default does not serialise every step
    with pytest.raises(UserError, match="logging.comm_wait_every"):
        LoggingConfig(comm_wait_every=0)


def test_comm_wait_timer_wraps_deepspeeds_collectives_only_when_enabled():
    import deepspeed.comm as ds_comm

    from hbp_train.observe.step_timing import DS_COLLECTIVES, comm_wait_timer

    originals = {name: getattr(ds_comm, name) for name in DS_COLLECTIVES if hasattr(ds_comm, name)}
    with comm_wait_timer(False) as waited:
        assert all(getattr(ds_comm, name) is fn for name, fn in originals.items())
    with comm_wait_timer(True):
        assert all(getattr(ds_comm, name) is not fn for name, fn in originals.items())
    assert all(getattr(ds_comm, name) is fn for name, fn in originals.items()) and waited == [0.0]


def test_a_step_whose_compute_times_were_not_taken_reports_balance_as_na(tmp_path):
    """A GPU step between two timed ones gathers NaN compute times: balance/* and time/compute_s/rank<r> are null
    (n/a in the line, left out of TensorBoard and the plot), never a made-up 0 or 1."""
    from hbp_train.model.ulysses import SPStats

    logger = MetricsLogger(LoggingConfig(tensorboard=True, progress_bar=False), str(tmp_path), 0, 2)
    for step, compute in enumerate([(2.0, 1.0), (float("nan"), float("nan"))]):
        rows = [dict(compute_time=c, loss_sum=1.0, loss_tokens=1, tokens=10, flops=1e9) for c in compute]
        m = logger.step_metrics(step=step, total_steps=2, gathered=_gathered(rows), columns=STAT_COLUMNS, lr=1e-4,
                                grad_norm=0.5, step_time=1.0, data_time=0.0, group=0, sp=1, num_micro_batches=1,
                                plan_metrics={"ABR": 0.1}, skipped=False, num_skipped=0)
        m.update(SPStats().step_metrics(list(compute), [10, 10], [0, 0]))
        logger.log(m)
    assert m["balance/imbalance"] is None and m["balance/live_BR"] is None and m["time/compute_s/rank0"] is None
    assert "imb n/a (BR live n/a, plan ABR 0.100" in format_line(m)
    logger.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["balance/imbalance"] == pytest.approx(2.0 / 1.5) and records[1]["balance/imbalance"] is None
    assert (tmp_path / "metrics.png").stat().st_size > 0


def test_all_gather_floats_takes_values_kept_on_the_device():
    """0-dim (or one-element) tensors join the row where they stand, numbers around them; one host tensor out."""
    row = all_gather_floats([1.5, torch.tensor(2.0, dtype=torch.float64), 3.0, torch.tensor([4.0])],
                            torch.device("cpu"))
    assert row.dtype == torch.float64 and row.tolist() == [[1.5, 2.0, 3.0, 4.0]]
