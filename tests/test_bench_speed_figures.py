"""The measured figures say what they measured: bench/speed/verdicts.py's rules (bold only beyond the noise the runs
measured: paired by round for speed, paired by seed for quality), the quality clock without the warm-up step, the
table bench/speed/results_table.py renders from a results file, docs/benchmarks.md's block against the committed
results file (bench/results/bench_speed.json), and the README's headlines against that page."""

from __future__ import annotations

import math
import re

import pytest

from bench import results_file
from bench.speed import results_table, report, verdicts
from tests.test_bench_speed import _run


def _timed_run(round_, seconds, step_tokens, evals=()):
    """A run recorded as the bench records it now: per-step tokens and the warm-up step."""
    run = _run(round_, seconds, evals=evals)
    run.update(step_tokens=list(step_tokens), warmup_steps=report.WARMUP_STEPS, tokens=sum(step_tokens))
    return run


def test_speed_best_only_when_ahead_in_every_round_else_parity():
    # Round by round (tokens 1000 a step, seconds per step): hbp ahead of sorted in rounds 0 and 2, behind in round 1.
    runs = {"isf": [_run(r, [10, 10]) for r in range(3)],
            "sorted": [_run(0, [8, 8]), _run(1, [7, 7]), _run(2, [8, 8])],
            "hbp": [_run(0, [7, 7]), _run(1, [7.5, 7.5]), _run(2, [7, 7])]}
    v = verdicts.speed_verdict(runs, report.timed)
    # The leader by median over isf is hbp (10/7 against sorted's 10/8), but round 1 reads 7/7.5 < 1: parity.
    assert v["leader"] == "hbp" and v["best"] is None and v["parity"] == ["hbp", "sorted"]
    assert v["against"]["sorted"]["ratios"] == pytest.approx([8 / 7, 7 / 7.5, 8 / 7])
    runs["hbp"][1] = _run(1, [6, 6])
    v = verdicts.speed_verdict(runs, report.timed)
    assert v["best"] == "hbp" and v["parity"] == [] and v["against"]["isf"]["min"] == pytest.approx(10 / 7)


def test_seed_noise_is_a_paired_t_interval():
    same_sign_tight = verdicts.paired_interval([-0.03, -0.031, -0.029])
    assert same_sign_tight["beyond"] is True and same_sign_tight["high"] < 0
    # mean -0.02, sd 0.02: half width 4.303 * 0.02 / sqrt(3) = 0.0497 > 0.02
    noisy = verdicts.paired_interval([-0.04, 0.0, -0.02])
    assert noisy["beyond"] is False and noisy["low"] == pytest.approx(-0.02 - 4.303 * 0.02 / math.sqrt(3))
    assert verdicts.paired_interval([0.5])["beyond"] is None  # one seed: no noise estimate
    assert verdicts.t975(2) == 4.303 and verdicts.t975(100) == 1.96


def test_loss_and_time_verdicts_pair_by_seed():
    def evals(final):
        return [(1.0, 2, final + 0.5), (2.0, 4, final)]

    # kk is lower than isf by 0.03-0.05 in every seed (beyond noise); hbp's seeds scatter around isf's (within).
    finals = {"isf": [6.40, 6.38, 6.42], "kk": [6.36, 6.35, 6.37], "hbp": [6.30, 6.41, 6.44]}
    runs = {n: [_run(s, [1, 1, 1, 1], evals=evals(f)) for s, f in enumerate(v)] for n, v in finals.items()}
    lv = verdicts.loss_verdict(runs)
    assert lv["leader"] == "kk" and lv["against"]["isf"]["beyond"] is True and lv["within_noise"] == ["hbp"]
    assert lv["best"] is None and lv["seeds"] == 3
    ttq = {"isf": {"ratios": [1.0, 1.0, 1.0], "median": 1.0, "reached": 3, "seeds": 3},
           "hbp": {"ratios": [0.5, 0.55, 0.52], "median": 0.52, "reached": 3, "seeds": 3},
           "sorted": {"ratios": [0.4, 0.9, None], "median": 0.65, "reached": 2, "seeds": 3}}
    tv = verdicts.time_verdict(ttq)
    assert tv["leader"] == "hbp" and tv["against"]["isf"]["beyond"] is True
    assert tv["against"]["sorted"]["n"] == 2 and tv["against"]["sorted"]["beyond"] is False  # the seed never: left out


def test_the_quality_clock_leaves_out_the_warm_up_step_as_the_speed_figures_do():
    # Step 1 (the warm-up) took 9 s; evaluations after steps 2 and 4.
    run = _timed_run(0, [9, 1, 2, 3], [100] * 4, evals=[(10, 2, 5.5), (15, 4, 5.0)])
    assert report.quality_evals(run) == [(1.0, 2, 5.5), (6.0, 4, 5.0)]
    assert report.timed(run)[1] == 6.0  # the speed clock: the same seconds
    isf = _timed_run(0, [1, 2, 2, 2], [100] * 4, evals=[(3, 2, 5.2), (7, 4, 5.0)])
    # Without the warm-up, hbp reaches 5.0 in 6 s and isf in 6 s: 1.0, where the raw clock read 15 / 7.
    assert report.time_to_quality({"isf": [isf], "hbp": [run]})["hbp"]["ratios"] == [pytest.approx(1.0)]


def test_the_equal_steps_check_publishes_each_strategys_worst_step_over_the_target():
    checked = report.check_equal_steps({"isf": [[6, 20, 10]], "hbp": [[13, 11, 12]]}, world=2, pack_len=4)
    assert checked["isf"]["worst_over_target"] == pytest.approx(20 / 12)  # the step farthest from 12 tokens
    assert checked["hbp"]["worst_over_target"] == pytest.approx(13 / 12) and checked["isf"]["slot_tokens"] == 8


def _results(hbp_round1: float) -> dict:
    names = ["isf", "sorted", "hbp"]
    finals = {"isf": [6.40, 6.38, 6.42], "sorted": [6.39, 6.37, 6.40], "hbp": [6.30, 6.41, 6.44]}

    def runs(speed):
        return {n: [_timed_run(r, [5] + [speed[n][r]] * 4, [1000] * 5,
                               evals=[(0, 2, finals[n][r] + 0.5), (0, 5, finals[n][r])]) for r in range(3)]
                for n in names}

    one = runs({"isf": [10, 10, 10], "sorted": [8, 8, 8], "hbp": [7, hbp_round1, 7]})
    four = runs({"isf": [10, 10, 10], "sorted": [9, 9, 9], "hbp": [7, 7, 7]})
    steps = {n: {"steps": 5, "target": 1000, "worst_over_target": 1.5, "slot_tokens": 16384} for n in names}
    replay = {"8": {n: {"replayed_speedup": 1.0 + 0.1 * i, "plan_simulated_speedup": 1.0 + 0.12 * i}
                    for i, n in enumerate(names)}}
    return {"strategies": names, "runs": {"1": one, "4": four}, "equal_steps": {"1": steps, "4": steps},
            "describe": {"nproc": 2, "data": "code"}, "wall_s": 2400, "replay": replay,
            "provenance": {"commit": "0123456789abcdef", "dirty": True, "date": "2026-12-05",
                           "machine": {"cpu": "Test CPU", "cores": 2, "load_1min": 0.0}}}


def test_the_results_table_bolds_only_what_lies_beyond_the_noise():
    text = results_table.render(_results(hbp_round1=8.5))
    rows = {line.split(" | ")[0]: line for line in text.splitlines() if line.startswith("| ")}
    one = rows["| raw tokens/s over isf, 1 long pack per rank per step"]
    four = rows["| raw tokens/s over isf, 4 long packs per rank per step"]
    # 1 pack: hbp behind sorted in round 1 (8.5 s against 8 s a step): parity, no bold. 4 packs: ahead in every round.
    assert "**" not in one and "parity: hbp, sorted (hbp over sorted" in one
    assert "**1.429× [1.429–1.429]**" in four and "hbp best: above every other in every round" in four
    loss = rows["| held-out loss, mean (seeds 0, 1, 2)"]
    assert "**" not in loss and "within seed noise (n = 3)" in loss and "6.383 (6.300 / 6.410 / 6.440)" in loss
    assert "| 1.50× → 1.50× |" in rows["| worst step, its real tokens over τ, 1 → 4 packs"]
    assert "commit 0123456789 with uncommitted changes" in text and "2 cores of Test CPU" in text
    assert "| replayed (drawn steps' measured over simulated time, whole plan) | 1.00× | 1.10× | 1.20× |" in text
    # Both the speed rows and the time-to-quality row run on the clock without the warm-up step (5 s here).
    assert "time to isf's final held-out loss" in text
    table = [line for line in results_table.render(_results(hbp_round1=6)).splitlines() if line.startswith("| ")]
    assert "\n".join(table).count("**") == 4 and "**" in table[1] and "**" in table[2]  # hbp best at both budgets
    # hbp reached isf's loss in 1 seed of 3: the leader is one that reached it in every seed, and no pair is judged
    assert "not judged: some comparison has fewer than 2 seeds" in rows["| time to isf's final held-out loss over "
                                                                         "isf's time, median (per seed)"]


def test_the_page_blocks_round_trip(tmp_path):
    readme = tmp_path / "benchmarks.md"
    begin, end = results_file._markers("x")
    readme.write_text(f"# t\n{begin}\nold\n{end}\ntail\n")
    results_file.write_block("x", "new\ntable", readme)
    assert results_file.read_block("x", readme) == "new\ntable" and readme.read_text().endswith(f"{end}\ntail\n")
    with pytest.raises(ValueError, match="no block"):
        results_file.read_block("y", readme)
    places = {tmp_path / "work": "WORK"}
    assert results_file.portable({"a": [str(tmp_path / "work" / "c.json")]}, places) == {"a": ["WORK/c.json"]}


def test_the_pages_measured_table_is_what_the_committed_results_file_renders():
    """docs/benchmarks.md's block equals the render of bench/results/bench_speed.json. Until a full run has committed that
    file, the block must say that its figures are not rendered from one (and from which code they came)."""
    block = results_file.read_block(results_table.NAME)
    results = results_file.read_results(results_table.NAME)
    if results is None:
        assert "Not yet rendered from a results file" in block and "commit" in block
        return
    assert block == results_table.render(results), "run: python bench/speed/results_table.py --write"


def test_every_figure_the_readme_quotes_is_on_the_benchmarks_page():
    """The README's "Measured" section quotes headlines of docs/benchmarks.md (whose tables are checked against their
    results files above): each ratio, loss and context length it names must stand on that page, so they cannot
    drift apart."""
    readme = (results_file.REPO / "README.md").read_text()
    section = readme.split("\n## Measured\n", 1)[1].split("\n## ", 1)[0]
    figures = re.findall(r"\b\d+(?:\.\d+)?[×KM]|\b\d\.\d{3}\b", section)
    page = results_file.PAGE.read_text()
    assert len(figures) >= 10, figures
    assert [f for f in figures if f not in page] == []
