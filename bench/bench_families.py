"""Families table: every family of the support matrix (hbp_train/model/families.py) at its tiny test shape, in one process.

    .venv/bin/python bench/bench_families.py [--tokens 512] [--repeats 3]

Per family: parameters (the HF module's), active parameters per token (perf/shape.py: MoE top-k), training
throughput on this machine (forward + backward of one packed pack of --tokens tokens in 4 samples, through the
trainer's module: packed attention + chunked loss; best of --repeats) and its ratio to llama's in the same run, and
the packed attention backends usable here for it (hbp_train/model/compat.py accepts it; on a GPU also flash/torch
varlen and flex). A CPU figure at a tiny shape compares the families' code paths, not their real-size speed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hbp_train.model.attention_setup import available_backends  # noqa: E402
from hbp_train.model.packed_lm import PackedCausalLM  # noqa: E402
from hbp_train.model.compat import check_model_support  # noqa: E402
from hbp_train.common.errors import UserError  # noqa: E402
from hbp_train.model.families import FAMILIES, tiny_config  # noqa: E402
from hbp_train.model.hf_model import ModelConfig, build_model, hf_config_for, num_params  # noqa: E402
from hbp_train.perf.shape import parse_model_shape  # noqa: E402

VOCAB = 4096


def sample_lengths(num_tokens: int) -> list:
    """The 4 samples of the benchmarked pack."""
    return [num_tokens // 4] * 3 + [num_tokens - 3 * (num_tokens // 4)]


def tokens_per_second(model, num_tokens: int, repeats: int) -> float:
    lengths = sample_lengths(num_tokens)
    ids = torch.randint(0, VOCAB, (1, num_tokens), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    labels = ids.clone()
    cu = torch.tensor([0, *torch.cumsum(torch.tensor(lengths), 0).tolist()], dtype=torch.int32)
    wrapper = PackedCausalLM(model, chunk_size=1024)
    best = float("inf")
    for _ in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        wrapper(ids, positions, labels, cu, max(lengths)).sum().backward()
        best = min(best, time.perf_counter() - start)
    return num_tokens / best


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=512, help="tokens of the benchmarked pack")
    parser.add_argument("--repeats", type=int, default=3, help="timed repeats (best is reported)")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    rows, baseline = [], None
    for family in FAMILIES:
        cfg = ModelConfig(config=tiny_config(family, max_position_embeddings=max(512, args.tokens)),
                          architecture=family, dtype="fp32", attention_backend="sdpa_block")
        backends = []
        for backend in available_backends(torch.device("cpu")):
            try:
                check_model_support(hf_config_for(cfg, VOCAB), max(sample_lengths(args.tokens)), [1, 2], backend)
                backends.append(backend)
            except UserError as e:  # the feature it refuses, short
                backends.append(f"{backend} refused: {str(e).split(': ')[1].split(' (')[0]}")
        model = build_model(cfg, vocab_size=VOCAB)
        shape = parse_model_shape(model.config)
        speed = tokens_per_second(model, args.tokens, args.repeats)
        baseline = baseline or speed  # llama is the first family
        rows.append((family, num_params(model), shape.active_params - (shape.num_params - num_params(model)),
                     speed, speed / baseline, ",".join(backends) or "none"))
    print(f"families at their tiny test shape, {args.tokens}-token pack, CPU, fp32 (ratio: tokens/s over llama's)")
    print(f"{'family':<13}{'params':>10}{'active':>10}{'tokens/s':>11}{'ratio':>7}  backends (here)")
    for family, params, active, speed, ratio, backends in rows:
        print(f"{family:<13}{params:>10,}{active:>10,}{speed:>11.0f}{ratio:>7.2f}  {backends}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
