"""Shared by the profiler tests: injected time/memory curves, a fake clock, brute-force answers, a tiny model."""

from __future__ import annotations

from hbp_train.profiler.backends import CurveBackend
from hbp_train.perf.profile_config import ProfileConfig

GB = 10 ** 9


LAYERS = 16


class FakeClock:
    """Simulated seconds; the curve backend advances it by the simulated cost of each measurement."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def linear_mem(base=20 * GB, full=3e5, kept=5e4):
    """Bytes per rank: fixed states + per-token activations, full for plain layers, `kept` for checkpointed."""
    return lambda l, sp, c: base + (l / sp) * ((LAYERS - c) * full + c * kept)


def compute_time(comm_per_token=2e-7, recompute=0.3):
    """Seconds per pack: work/sp (attention quadratic), recompute for checkpointed layers, comm growing with sp."""
    def time_fn(l, sp, c):
        work = LAYERS * (1e-6 * l + 2e-12 * l * l)
        return work * (1 + recompute * c / LAYERS) / sp + (comm_per_token * l * (sp - 1) / sp if sp > 1 else 0)
    return time_fn


def cfg(**kw) -> ProfileConfig:
    base = dict(max_len=131072, min_len=8192, world_size=8, headroom=0.9, memory_metric="torch", iters=2,
                progress=False, time_budget_s=1e9)
    base.update(kw)
    return ProfileConfig(**base)


def backend(time_fn=None, mem_fn=None, device=80 * GB, num_gpus=8, clock=None):
    return CurveBackend(time_fn or compute_time(), mem_fn or linear_mem(), LAYERS, device, num_gpus=num_gpus,
                        sleep=clock.advance if clock else None)


def brute_min_ckpt(mem_fn, l, sp, budget):
    """The fewest checkpointed layers whose memory fits, by trying every count (None if none fits)."""
    return next((c for c in range(LAYERS + 1) if mem_fn(l, sp, c) <= budget), None)


TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=4096, tie_word_embeddings=False, vocab_size=512)
