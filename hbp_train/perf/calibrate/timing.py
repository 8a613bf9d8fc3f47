"""What the calibration command's measurements share: the timer (with the --procs barrier), the device a
calibration names, the Llama-shaped config its layers are built from, the trainer's LM-head chunk.
"""

from __future__ import annotations

import platform
import statistics
import time

import numpy as np

from hbp_train.perf.cost_model import TABLE_TOKENS
from hbp_train.perf.shape import ModelShape

VALIDATE_LOSS_CHUNK = 4096  # loss.chunk_size's default: the trainer's LM-head chunk

# Set in every process of a --procs measurement: all of them wait here before each point, so they time together.
barrier = None


def timer(device):
    """A function timing fn() -> milliseconds (CUDA events on GPU, perf_counter on CPU); the median of the timed
    iterations, after waiting at ``barrier`` (when set) before the warm-ups and before the timing."""
    import torch

    def run(fn, iters: int, warmup: int) -> float:
        if barrier is not None:
            barrier.wait()
        for _ in range(warmup):
            fn()
        if barrier is not None:  # the warm-ups can differ in length between the processes
            barrier.wait()
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    return run


def device_name(device) -> str:
    """The GPU's name, or the CPU's model and the threads this process computes with."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU {_cpu_model()}, {torch.get_num_threads()} thread(s)"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:  # not Linux
        pass
    return platform.processor() or platform.machine()


def device_fields(device, dtype, procs: int = 1) -> dict:
    """What a calibration file says about where it was measured ("gpu" is the field older files have)."""
    import torch

    fields = {"device": device.type, "dtype": str(dtype).removeprefix("torch."), "gpu": device_name(device)}
    if device.type == "cpu":
        fields.update(gpu=None, cpu=device_name(device), threads=torch.get_num_threads(), procs=procs)
    return fields


def llama_config(shape: ModelShape, attn_implementation: str = "sdpa"):
    """A transformers LlamaConfig with the shape (no dropout, no cache, RoPE theta of Llama 3)."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=shape.hidden, num_hidden_layers=shape.num_layers,
                      num_attention_heads=shape.num_heads, num_key_value_heads=shape.num_kv_heads,
                      head_dim=shape.head_dim, intermediate_size=shape.ffn, vocab_size=shape.vocab,
                      max_position_embeddings=max(131072, TABLE_TOKENS), rope_theta=500000.0,
                      attention_dropout=0.0, use_cache=False, tie_word_embeddings=shape.tie_word_embeddings)
    cfg._attn_implementation = attn_implementation
    return cfg


def training_program(args, device, dtype, shape: ModelShape):
    """What training runs on this device, resolved as the trainer resolves it: (attention backend, the decoder kernels'
    choice, whether the LM-head loss is the fused one). The backend is chosen for the model's head shape, so auto
    probes the GPU kernels as a training run does."""
    from hbp_train.model import kernels
    from hbp_train.model.attention_setup import HeadShape, select_backend
    from hbp_train.model.loss import LossConfig

    head_shape = HeadShape(shape.num_heads, shape.num_kv_heads, shape.head_dim, shape.head_dim)
    backend = select_backend(args.backend, device, dtype, head_shape)
    chosen = kernels.select_kernels(getattr(args, "kernels", "auto"), "llama", device)
    return backend, chosen, LossConfig(impl=getattr(args, "loss_impl", "auto")).fused_on(device)


def head_loss(hidden, weight, labels, fused: bool):
    """The scalar the trainer back-propagates through its LM head: the fused loss's weighted sum (weight 1 per
    trained token), or the chunked loss's per-token losses summed."""
    from hbp_train.common.labels import IGNORE_INDEX
    from hbp_train.model import loss

    if fused:
        weights = (labels.reshape(-1) != IGNORE_INDEX).float()
        return loss.fused_token_losses(hidden, weight, labels, weights, VALIDATE_LOSS_CHUNK)[0]
    return loss.chunked_token_losses(hidden, weight, labels, VALIDATE_LOSS_CHUNK).sum()


def cu_seqlens_for(lengths, device):
    import torch

    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device=device)


def free_gpu_bytes() -> int | None:
    """Free memory of the current GPU now (what other processes, this one and the CUDA context leave), or None
    without a GPU. The total would overstate it on a shared or busy GPU."""
    import torch

    return torch.cuda.mem_get_info()[0] if torch.cuda.is_available() else None
