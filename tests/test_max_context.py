"""``hbp-profile --max-context`` (hbp_train/profiler/max_context.py): the longest sample a number of GPUs trains, lever
by lever, modelled."""

from __future__ import annotations

import json

from hbp_train.perf.memory import memory_breakdown
from hbp_train.perf.shape import MODEL_SHAPES
from hbp_train.profiler import cli
from hbp_train.profiler.max_context import GIB, GRANULE, LADDER, ZERO_SETUPS, base_job, build_parser, largest_sp


def run(argv, capsys):
    rc = cli.main(["--max-context", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_the_ladder_of_llama3_8b_on_8_gpus(tmp_path, capsys):
    """Each row adds a lever, so the longest sample never shrinks; each row's length fits the model under its ZeRO
    setup and one granule more does not (under any setup); SP spans all 8 GPUs from its row on; the table says it is
    modelled and names the ZeRO setup of every row."""
    path = tmp_path / "ladder.json"
    rc, out, err = run(["--model", "llama3-8b", "--gpus", "8", "--json", str(path)], capsys)
    assert rc == 0, err
    assert out.startswith("MODELLED") and all(rung.name in out for rung in LADDER)
    data = json.loads(path.read_text())
    rows = data["rows"]
    lengths = [r["tokens"] for r in rows]
    assert all(a <= b for a, b in zip(lengths, lengths[1:])) and lengths[0] > 0
    assert lengths[-1] > 1_000_000 and lengths[-1] > 10 * lengths[0]
    assert [r["sp"] for r in rows] == [1] + [8] * 5
    args = build_parser().parse_args(["--model", "llama3-8b", "--gpus", "8"])
    shape, budget = MODEL_SHAPES["llama3-8b"], 0.9 * 80 * GIB
    for rung, row in zip(LADDER, rows):
        setup = next(s for s in ZERO_SETUPS if s.describe() == row["zero"])
        assert row["zero"] in out

        def peak(tokens, setup=setup):
            job = base_job(args, setup, args.loss_chunk if rung.tiled_loss else tokens)
            return memory_breakdown(shape, tokens, row["sp"], row["ckpt_layers"], 8, job, rung.tiled_mlp,
                                    rung.offload).peak
        assert peak(row["tokens"]) <= budget
        assert all(memory_breakdown(shape, row["tokens"] + GRANULE, row["sp"], row["ckpt_layers"], 8,
                                    base_job(args, s, args.loss_chunk if rung.tiled_loss else row["tokens"] + GRANULE),
                                    rung.tiled_mlp, rung.offload).peak > budget for s in ZERO_SETUPS)
        assert row["step_s"] > 0 and row["bound_by"] in ("loss", "backward_plain", "backward_ckpt", "step")


def test_sp_beyond_the_heads_is_refused_in_one_line(capsys):
    """Llama-3-8B has 32 query and 8 key/value heads: perf.shape's rule allows sp=32 (kv heads replicated 4x), so 32
    GPUs run SP over all of them; 64 GPUs stop at 32, and one line says why 64 is refused."""
    shape = MODEL_SHAPES["llama3-8b"]
    assert largest_sp(shape, 32) == (32, "")
    sp, note = largest_sp(shape, 64)
    assert sp == 32 and "sp=64 does not divide the model's 32 attention heads" in note
    rc, out, _ = run(["--model", "llama3-8b", "--gpus", "64"], capsys)
    assert rc == 0 and out.count("SP over all 64 GPUs refused: sp=64") == 1


def test_target_tokens_names_the_term_that_prevents_it(capsys):
    """At a length past the last row, --target-tokens prints the moment that bounds it and its terms, largest first."""
    rc, out, _ = run(["--model", "llama3-8b", "--gpus", "1", "--target-tokens", "500000"], capsys)
    assert rc == 0
    line = next(l for l in out.splitlines() if l.startswith("at 500,000 tokens"))
    assert "bound by backward_ckpt" in line and "checkpointed layers' inputs" in line


def test_bad_input_is_one_line(tmp_path, capsys):
    rc, _, err = run(["--model", str(tmp_path), "--gpus", "8"], capsys)
    assert rc == 2 and "config.json" in err and len(err.strip().splitlines()) == 1
    rc, _, err = run(["--model", "llama3-8b", "--gpus", "8", "--headroom", "2"], capsys)
    assert rc == 2 and "--headroom" in err
