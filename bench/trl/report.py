"""bench/trl/bench_trl.py's figures and the block of docs/benchmarks.md they render (pure arithmetic on the
results file).

Per run: real tokens of the timed steps (all but the first, the warm-up) over the wall time from the end of the
warm-up step to the end of the last step, every cost of the loop inside it (data, forward, backward, optimizer,
logging). Per round, ours and TRL-with-our-attention over TRL (paired: the runs of a round ran one after the
other), median [min–max] over rounds; bold only when the spread lies wholly above 1 (bench/speed/verdicts.py's
speed rule). Held-out loss per round (each round trains from the same initial weights in its own data order);
ours against TRL judged by the paired 95% t-interval of bench/speed/verdicts.py.
"""

from __future__ import annotations

import numpy as np

from bench.speed import verdicts

VARIANTS = ("trl", "trl_block", "ours")
LABELS = {"trl": "TRL, transformers' sdpa (its CPU path)",
          "trl_block": "TRL with our per-document attention (sdpa_block)",
          "ours": "ours (hbp_train)"}
NOT_EQUALISED = [
    "the packs, and so each step's documents: TRL packs best-fit-decreasing per 1,000-sample chunk and takes one pack "
    "a step, ours plans hbp (one group, world size 1) and cuts steps of equal real tokens (τ ± one pack); the step "
    "count and the total tokens are equal",
    "the data order: each side shuffles with the round's seed in its own way",
    "the loss's implementation (the formula is the same: the token mean over the step's trained targets): TRL's "
    "fused LM head, which also computes entropy and token accuracy every step; ours the chunked LM-head loss",
    "the engine around the step: the HF Trainer with accelerate against DeepSpeed ZeRO-2 at world size 1",
]


def spread(values: list) -> dict:
    values = [float(v) for v in values]
    return {"values": values, "median": float(np.median(values)), "min": min(values), "max": max(values)}


def figures(rounds: list) -> dict:
    """From the rounds' runs ([{variant: run figures}]): per variant tokens/s and held-out loss over rounds; paired
    ratios over TRL per round; ours - TRL held-out loss judged for seed noise; the attention's share."""
    out = {v: {"tokens_per_s": spread([r[v]["tokens_per_s"] for r in rounds]),
               "heldout_loss": [r[v]["heldout_loss"] for r in rounds]} for v in VARIANTS}
    for v in VARIANTS:
        out[v]["over_trl"] = spread([r[v]["tokens_per_s"] / r["trl"]["tokens_per_s"] for r in rounds])
    out["ours"]["over_trl_block"] = spread([r["ours"]["tokens_per_s"] / r["trl_block"]["tokens_per_s"]
                                            for r in rounds])
    out["loss_ours_minus_trl"] = verdicts.paired_interval([r["ours"]["heldout_loss"] - r["trl"]["heldout_loss"]
                                                           for r in rounds])
    out["trl_block_loss_max_abs_diff"] = max(r["trl_block"]["loss_max_abs_diff_vs_trl"] for r in rounds)
    return out


def _x(s: dict) -> str:
    return f"{s['median']:.2f}× [{s['min']:.2f}–{s['max']:.2f}]"


def _bold(s: dict, text: str) -> str:
    """Bold when every round lies above 1 (two rounds at least: one has no spread)."""
    return f"**{text}**" if s["min"] > 1.0 and len(s["values"]) >= 2 else text


def render(results: dict) -> str:
    """The block: what ran, the table, the attention's share, what was not equalised."""
    figs, setup, prov = results["figures"], results["setup"], results.get("provenance", {})
    machine = prov.get("machine", {})
    n = len(results["rounds"])
    commit = (prov.get("commit") or "unknown")[:10]
    shape = setup["shape"]
    checks = results["checks"]
    lines = [
        f"`python bench/trl/bench_trl.py` ({results['wall_s'] / 60:.0f} minutes on {machine.get('cores', '?')} cores "
        f"of {machine.get('cpu', 'a CPU')}, one process a side with {setup['threads']} torch thread"
        f"{'s' if setup['threads'] != 1 else ''}, measured on commit "
        f"{commit}" + (" with uncommitted changes" if prov.get("dirty") else "") + f", {prov.get('date', '')}; "
        "bench/results/bench_trl.json): TRL " + results["trl_version"] + "'s `SFTTrainer` (BFD packing, padding-free, "
        f"assistant-only loss) against ours on the same CPU, from the same initial weights (a Llama of hidden "
        f"{shape['hidden']}, {shape['layers']} layers, {setup['max_len']}-token packs, fp32). Checked before the "
        f"figures count: both sides train the same {checks['documents']:,} documents ({checks['tokens']:,} tokens), "
        f"each with the same token ids and trained targets; the same {checks['steps']} optimizer steps; the same "
        f"learning rate at every step (AdamW, warm-up and cosine; largest relative difference "
        f"{checks['lr_max_rel_diff']:.1e}). Runs alternate, {n} round{'s' if n != 1 else ''}; tokens/s of the timed steps (all but the "
        "first), wall clock from the end of the warm-up step to the end of the last. **Bold** only where the ratio "
        "lies above 1 in every round.",
        "",
        "| run | tokens/s (median) | over TRL, paired by round | held-out loss, round by round |",
        "|---|---|---|---|",
    ]
    for v in VARIANTS:
        f = figs[v]
        ratio = "1.00×" if v == "trl" else _bold(f["over_trl"], _x(f["over_trl"]))
        lines.append(f"| {LABELS[v]} | {f['tokens_per_s']['median']:,.0f} | {ratio} | "
                     + " / ".join(f"{x:.3f}" for x in f["heldout_loss"]) + " |")
    attention, rest = figs["trl_block"]["over_trl"], figs["ours"]["over_trl_block"]
    loss = figs["loss_ours_minus_trl"]
    diff = figs["trl_block_loss_max_abs_diff"]
    judged = ("one round: not judged" if loss["beyond"] is None else
              "beyond seed noise" if loss["beyond"] else f"within seed noise (n = {loss['n']})")
    lines += [
        "",
        f"Of ours' {figs['ours']['over_trl']['median']:.2f}× over TRL, the attention is {attention['median']:.2f}× "
        f"[{attention['min']:.2f}–{attention['max']:.2f}]: TRL's padding-free batches carry no attention mask, so "
        "transformers builds a block-diagonal causal T × T boolean mask from the position ids, and SDPA on a CPU "
        "computes all T² pairs of the pack, masked or not (exact, but the work of one T-token document). Our "
        "`sdpa_block` runs one causal SDPA per document; "
        + (f"TRL with it trains the same losses (largest per-step difference {diff:.1e})" if diff < 1e-3 else
           f"TRL's per-step losses with it differ from its own by up to {diff:.1e}")
        + f". The rest, {_x(rest)} (ours over TRL with our attention), is the step around it. On a GPU TRL's "
        "padding-free batches go to a FlashAttention varlen kernel, per document like ours, so the attention's "
        "share is this CPU's; the rest is this CPU's figure too, not a GPU one. Held-out loss, ours minus TRL: "
        + (f"{loss['mean']:+.3f}, {judged}." if loss["mean"] is not None else "n/a."),
        "",
        "Not equalised:",
        *(f"* {item};" if i < len(NOT_EQUALISED) - 1 else f"* {item}." for i, item in enumerate(NOT_EQUALISED)),
    ]
    return "\n".join(lines)
