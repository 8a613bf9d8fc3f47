"""Liger's decoder kernels checked on the training device before a model uses them (model/kernels.py calls
`probe_liger` from `apply_liger`).

Liger's Triton kernels compile at their first call, which would be inside the first training step: a kernel that
this Triton, this GPU or this model's widths reject would fail the run there, where nothing can give way. So, as
attention_setup.probe_backend does for the attention kernels, each kernel Liger would patch for the family (its
entry in kernels.LIGER_KERNELS: rms_norm, rope, swiglu) is run first, alone, on a one-layer copy of the model (its
widths, heads and RoPE; a small vocabulary; 64 tokens) on the training device in the model's dtype, forward and
backward, against the same copy with HF's own modules. A kernel that raises, gives a non-finite value, or differs
from HF's in the decoder's output or in any parameter's gradient by more than the dtype allows, is rejected with
its reason in one line; kernels.py then leaves it eager (HF's module) and keeps the others.

The probe changes nothing outside itself: transformers' modeling module (where Liger swaps the RoPE function and
module classes) is restored after each kernel, and the random number generators are left as they were.
"""

from __future__ import annotations

import copy
import importlib

import torch

PROBE_TOKENS = 64
PROBE_VOCAB = 128
# Relative error (of a tensor's norm) allowed against HF's modules in the same dtype: half-precision kernels that
# compute in another order than HF's differ by a few bf16 roundings (as attention_setup's probe allows); fp32 ones
# agree to rounding.
TOLERANCE = {torch.float32: 1e-4}
HALF_TOLERANCE = 5e-2


def probe_liger(hf_config, patch, kernels: dict, device, dtype) -> dict[str, str]:
    """{kernel: why it was rejected} for each kernel set in ``kernels`` (a LIGER_KERNELS entry), each probed alone:
    ``patch(model, parts)`` applies Liger to ``model`` with ``parts`` ({kernel: on or off}, every key of
    ``kernels``), as kernels.py applies it to the trained model. Empty: every kernel passed."""
    device = torch.device(device)
    wanted = [name for name, on in kernels.items() if on]
    if not wanted:
        return {}
    rejected = {}
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        try:
            eager = _probe_model(hf_config, device, dtype)
            reference = _forward_backward(eager, device)
        except Exception as exc:  # noqa: BLE001 - HF's own model cannot run the probe here: nothing to compare with
            why = f"the probe's HF reference failed ({_one_line(exc)})"
            return {name: why for name in wanted}
        modeling = importlib.import_module(type(eager).__module__)
        for name in wanted:
            before = dict(vars(modeling))
            try:
                fused = copy.deepcopy(eager)
                patch(fused, {k: k == name for k in kernels})
                why = _differs(_forward_backward(fused, device), reference, dtype)
            except Exception as exc:  # noqa: BLE001 - any failure of the kernel means: not this kernel
                why = _one_line(exc)
            finally:
                for key in [k for k in vars(modeling) if k not in before]:
                    delattr(modeling, key)
                for key, value in before.items():
                    if vars(modeling).get(key) is not value:
                        setattr(modeling, key, value)
            if why is not None:
                rejected[name] = why
    return rejected


def _probe_model(hf_config, device, dtype):
    """The model's one-layer copy with HF's modules and ``PROBE_VOCAB`` tokens, on ``device`` in ``dtype``."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(hf_config)
    config.num_hidden_layers = 1
    if isinstance(getattr(config, "layer_types", None), list):  # per-layer attention types (Gemma 3, Qwen 3)
        config.layer_types = config.layer_types[:1]
    config.vocab_size = PROBE_VOCAB
    for key in ("pad_token_id", "bos_token_id", "eos_token_id"):  # inside the small vocabulary or none
        if isinstance(getattr(config, key, None), int) and getattr(config, key) >= PROBE_VOCAB:
            setattr(config, key, None)
    config.use_cache = False
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.train()


def _forward_backward(model, device) -> dict[str, torch.Tensor]:
    """The decoder's output and every parameter's gradient (fp32, on the host) for one fixed input and upstream
    gradient, both made on the host (the same values on every device)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = torch.randint(0, PROBE_VOCAB, (1, PROBE_TOKENS), generator=gen, device="cpu").to(device)
    positions = torch.arange(PROBE_TOKENS, device="cpu")[None].to(device)
    decoder = model.base_model
    model.zero_grad(set_to_none=True)
    out = decoder(input_ids=ids, position_ids=positions).last_hidden_state
    upstream = torch.randn(out.shape, generator=gen, device="cpu").to(device, out.dtype)
    (out * upstream).float().sum().backward()
    found = {"output": out.detach().float().cpu()}
    found.update({name: p.grad.detach().float().cpu() for name, p in decoder.named_parameters() if p.grad is not None})
    return found


def _differs(found: dict, reference: dict, dtype) -> str | None:
    """Why ``found`` is not ``reference`` (a non-finite value, a missing gradient, a relative error past the dtype's
    tolerance), or None."""
    tolerance = TOLERANCE.get(dtype, HALF_TOLERANCE)
    for name, ref in reference.items():
        got = found.get(name)
        if got is None:
            return f"no gradient for {name}"
        if not bool(torch.isfinite(got).all()):
            return f"non-finite values in {'its output' if name == 'output' else name + ' gradient'}"
        error = float((got - ref).norm() / ref.norm().clamp_min(1e-12))
        if error > tolerance:
            what = "its output" if name == "output" else f"the {name} gradient"
            return f"{what} differs from HF's by {error:.3g} of its norm (> {tolerance:g})"
    return None


def _one_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
