"""Which packed attention backend runs, and installing it on a Hugging Face model.

`available_backends` lists the backends hbp_train/model/attention_backends.py implements that are installed and
usable on a device, in preference order; "auto" (`select_backend`) takes the first that also passes `probe_backend`
(a small packed forward and backward on the device with the model's head shape and the features its layers ask
for: a sliding window, a soft-cap; output and q/k/v gradients checked against sdpa_block), so a kernel that imports
but cannot run this model is skipped with one warning line instead of failing at the first step (one that cannot
apply a feature at all, `attention_backends.feature_problem`, is skipped without running); a kernel the user named
is refused in one line instead. The backends after the chosen one are handed to attention.py as what a kernel that
still fails on the first real pack gives way to (`attention.set_fallbacks`).
`describe_backend` names the kernel, its library and version for the start-of-run log. `register_packed_attention`
installs `attention.hf_packed_attention` on a model under the name "hbp_packed" with the chosen backend.
"""

from __future__ import annotations

import importlib.metadata
import logging
from dataclasses import dataclass

import torch

from hbp_train.common.errors import UserError
from hbp_train.model import attention
from hbp_train.model import attention_kernels as kernels
from hbp_train.model.attention_backends import feature_problem

log = logging.getLogger(__name__)


def _capability_major(device: torch.device) -> int:
    return torch.cuda.get_device_capability(device)[0]


def available_backends(device: torch.device, dtype: torch.dtype | None = None) -> list[str]:
    """The backends installed and usable on `device`, in preference order (sdpa_block is always last and there).

    With a dtype, the flash kernels (fp16/bf16 only) are left out for other dtypes.
    """
    device = torch.device(device)
    found = []
    if device.type == "cuda":
        half = dtype is None or dtype in kernels.HALF_DTYPES
        flash = half and (kernels.fa3_fn() is not None or kernels.fa4_registered())
        major = _capability_major(device) if flash else None
        if major in kernels.FA3_CAPABILITIES and kernels.fa3_fn() is not None:
            found.append("fa3")
        if major in kernels.FA4_CAPABILITIES and kernels.fa4_registered():
            found.append("fa4")
        if half and kernels.has_flash_attn():
            found.append("flash_varlen")
        if half and kernels.torch_varlen_fn() is not None:
            found.append("torch_varlen")
        if kernels.has_flex():
            found.append("flex")
    found.append("sdpa_block")
    return found


@dataclass(frozen=True)
class HeadShape:
    """What a probe call needs of the model's attention: query heads, key/value heads, q/k and v head dims, and the
    features its layers ask for (the smallest sliding window, a soft-cap; None: none)."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    v_head_dim: int
    window: int | None = None
    softcap: float | None = None

    @classmethod
    def of(cls, hf_config) -> "HeadShape":
        """From what the model's layers hand the attention function (attention_calls.py: the real heads and
        features); from the config's fields when its forward cannot be recorded (GQA heads, an explicit head_dim, or
        MLA's qk_nope + qk_rope and v_head_dim)."""
        from hbp_train.model.attention_calls import attention_calls

        calls = attention_calls(hf_config)
        if calls.heads is not None:
            windows, softcaps = calls.windows, calls.softcaps
            return cls(*calls.heads, window=min(windows) if windows else None,
                       softcap=min(softcaps) if softcaps else None)
        heads = int(hf_config.num_attention_heads)
        kv = int(getattr(hf_config, "num_key_value_heads", None) or heads)
        softcap = getattr(hf_config, "attn_logit_softcapping", None)
        features = dict(window=getattr(hf_config, "sliding_window", None) or None,
                        softcap=float(softcap) if softcap else None)
        if getattr(hf_config, "qk_rope_head_dim", None) is not None:  # MLA
            qk = int(hf_config.qk_nope_head_dim) + int(hf_config.qk_rope_head_dim)
            return cls(heads, kv, qk, int(hf_config.v_head_dim), **features)
        dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)
        return cls(heads, kv, dim, dim, **features)

    def features(self) -> str:
        """The features a probe checks, named for a message ("" when none)."""
        named = [f"sliding window {self.window}" if self.window else "", f"soft-cap {self.softcap:g}" if
                 self.softcap else ""]
        return " and ".join(n for n in named if n)


# The probe's window: small, so that a kernel off by one key (HF's window W is W keys, FlashAttention's left W - 1)
# changes its output far beyond the tolerance.
PROBE_WINDOW = 8


def probe_backend(backend: str, device: torch.device, dtype: torch.dtype, shape: HeadShape) -> str | None:
    """None if ``backend`` runs a small packed forward and backward of this head shape on ``device`` and matches
    sdpa_block on the same inputs (computed in fp32) in its output and in the gradients of q, k and v (a kernel can
    be right forward and wrong backward, e.g. dk/dv not summed over a query group); else the reason, in one line.
    With the model's features: a sliding window (probed at PROBE_WINDOW keys, so that it binds on the probe's
    samples) and a soft-cap (the model's, with queries scaled so that the logits reach it). Leaves the backend chosen
    before the call active.

    Everything is made inside the ``try``, on the host then moved to ``device``: a caller may build its model under
    a default device (``with torch.device("cuda")``), where a tensor made without a device lands on that device and
    a host generator cannot fill it; any failure here means "not this backend", never a crash."""
    previous = attention.get_backend()
    lengths = (48, 80)  # two samples: a boundary is crossed if the kernel ignores cu_seqlens
    num_tokens = sum(lengths)
    features = {}
    if shape.window:
        features["window"] = min(shape.window, PROBE_WINDOW)
    if shape.softcap:
        features["softcap"] = shape.softcap
    try:
        gen = torch.Generator(device="cpu").manual_seed(0)

        def make(heads, dim, size=1.0):  # the same values on every device: made on the host, whatever the default
            return (torch.randn(num_tokens, heads, dim, generator=gen, device="cpu") * size).to(device, dtype)

        # scaled logits of about the soft-cap's size: capped or not, the softmax differs
        qkv = [make(shape.num_heads, shape.head_dim, shape.softcap or 1.0), make(shape.num_kv_heads, shape.head_dim),
               make(shape.num_kv_heads, shape.v_head_dim)]
        grad_out = make(shape.num_heads, shape.v_head_dim)
        cu = torch.tensor([0, lengths[0], num_tokens], dtype=torch.int32, device=device)
        attention.set_backend(backend)
        inputs = [x.clone().requires_grad_() for x in qkv]
        out = attention.packed_attention(*inputs, cu, max(lengths), backend, **features)
        grads = torch.autograd.grad(out, inputs, grad_out)
        ref_inputs = [x.detach().float().requires_grad_() for x in qkv]
        ref = attention.packed_attention(*ref_inputs, cu, max(lengths), "sdpa_block", **features)
        ref_grads = torch.autograd.grad(ref, ref_inputs, grad_out.float())
        if not all(bool(torch.isfinite(g).all()) for g in grads):
            return "its backward gave non-finite gradients"
        error = float((out.detach().float() - ref.detach()).abs().max())
        # each gradient relative to its largest element: dv sums over up to 80 keys, dq does not
        grad_errors = [float((g.float() - r).abs().max() / r.abs().max().clamp_min(1e-6))
                       for g, r in zip(grads, ref_grads)]
    except Exception as exc:  # noqa: BLE001 - any failure of the kernel means: not this backend
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
    finally:
        attention.set_backend(previous)
    half = dtype != torch.float32
    tolerance, grad_tolerance = (5e-2, 5e-2) if half else (1e-4, 1e-3)  # fp16/bf16 inputs, fp32 reference
    with_features = f" with {shape.features()}" if features else ""
    if error > tolerance:
        return f"its output{with_features} differs from sdpa_block by {error:.3g} (> {tolerance})"
    for name, grad_error in zip("qkv", grad_errors):
        if grad_error > grad_tolerance:
            return (f"its {name} gradient{with_features} differs from sdpa_block's by {grad_error:.3g} of its largest "
                    f"element (> {grad_tolerance})")
    return None


def select_backend(requested: str, device: torch.device, dtype: torch.dtype | None = None,
                   shape: HeadShape | None = None) -> str:
    """Resolve "auto" to the best available backend; raise UserError for an unknown or unusable name (the name comes
    from the user: model.attention_backend, a --backend flag).

    With the model's head ``shape`` (and a dtype), every GPU kernel considered is checked first: one that cannot
    apply the model's window or soft-cap at all (`feature_problem`) and one that fails its probe (`probe_backend`)
    are skipped by "auto" with a warning line naming why; a requested one is a UserError instead.
    """
    available = available_backends(device, dtype)
    if requested == "auto":
        for name in available:
            why = _probe_if_needed(name, device, dtype, shape)
            if why is None:
                return name
            log.warning("attention backend %s is installed but failed its check here (%s); trying the next one",
                        name, why)
        raise AssertionError("sdpa_block is exact everywhere and never fails its probe")
    if requested not in available:
        why = "unknown" if requested not in attention.BACKENDS else f"not available on {torch.device(device)}"
        if requested in attention.BACKENDS and dtype is not None:
            why += f" with {dtype}"
        raise UserError(
            f"attention backend {requested!r} is {why}; available here: {', '.join(available)} (or 'auto')"
        )
    why = _probe_if_needed(requested, device, dtype, shape)
    if why is not None:
        raise UserError(f"attention backend {requested!r} is installed but fails on this model's attention ({why}); "
                        f"available here: {', '.join(available)} (or 'auto')")
    return requested


def _probe_if_needed(name: str, device, dtype, shape) -> str | None:
    """Why ``name`` cannot run this model's attention: a feature it cannot apply, or its probe's verdict, when the
    shape is known; sdpa_block (exact, every feature) and calls without a shape are not probed. (On the host
    sdpa_block is the only backend offered, so in practice only GPU kernels are probed.)"""
    if shape is None or dtype is None or name == "sdpa_block":
        return None
    problem = feature_problem(name, bool(shape.window), bool(shape.softcap))
    if problem:
        return f"it cannot apply this model's {shape.features()}: {problem}"
    return probe_backend(name, torch.device(device), dtype, shape)


def _distribution_version(*names: str) -> str | None:
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def describe_backend(name: str, device: torch.device) -> str:
    """One phrase for the start-of-run log: the backend, the library and version that provide its kernel, the
    device; e.g. ``fa3 (flash_attn_interface 3.0.0) on NVIDIA H100 80GB HBM3``."""
    device = torch.device(device)
    if name == "fa3":
        source = f"flash_attn_interface {_distribution_version('flash_attn_3', 'flash-attn-3') or '(version unknown)'}"
    elif name == "fa4":
        source = (f"flash-attn-4 {_distribution_version('flash-attn-4', 'flash_attn_4') or '(version unknown)'} "
                  f"through torch {torch.__version__} varlen_attn")
    elif name == "flash_varlen":
        source = f"flash_attn {_distribution_version('flash-attn', 'flash_attn') or '(version unknown)'}"
    elif name == "torch_varlen":
        source = f"torch {torch.__version__} varlen_attn, its bundled FA2 kernels"
    elif name == "flex":
        source = f"torch {torch.__version__} flex_attention"
    else:
        source = f"torch {torch.__version__} scaled_dot_product_attention per sample"
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return f"{name} ({source}) on {where}"


def training_device(model) -> torch.device:
    """The device the model will run on: its own if already on an accelerator, else the current GPU if any. A model
    on the meta device (built without data, to be materialised later) is not on an accelerator yet."""
    param = next(model.parameters(), None)
    if param is not None and param.device.type not in ("cpu", "meta"):
        return param.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def register_packed_attention(model, backend: str = "auto", device: torch.device | None = None) -> str:
    """Install `attention.hf_packed_attention` as the model's attention ("hbp_packed") and return the backend chosen.

    `device` is where training will run (default: see `training_device`); "auto" picks its best backend for
    that device and the model's dtype, probing the GPU kernels with the model's head shape (`select_backend`).
    """
    device = device if device is not None else training_device(model)
    shape = HeadShape.of(model.config) if hasattr(model, "config") else None
    dtype = getattr(model, "dtype", None)
    chosen = select_backend(backend, device, dtype, shape)
    attention.set_backend(chosen)
    # a kernel that fails on the first real pack (longer than the probe's) gives way to auto's next choice
    available = available_backends(device, dtype)
    later = available[available.index(chosen) + 1:] if chosen in available else ["sdpa_block"]
    attention.set_fallbacks(later, check=lambda name: _probe_if_needed(name, device, dtype, shape),
                            named=backend != "auto")
    use_attention(model, attention.ATTN_IMPLEMENTATION, attention.hf_packed_attention)
    return chosen


def use_attention(model, name: str, fn=None) -> None:
    """Point the model's attention layers at the implementation `name`, registering `fn` under it first if given.

    transformers 5 has a public setter; older versions only read config._attn_implementation. ``fn`` is registered
    behind `torch.compiler.disable`: a compiled decoder layer (hbp_train/model/kernels.py) runs it eagerly, between graphs.
    """
    if fn is not None:
        from transformers import AttentionInterface

        AttentionInterface.register(name, torch.compiler.disable(fn))
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:
        model.config._attn_implementation = name
