"""Part of bench/trainer/bench_trainer.py: the timed training paths — ours (hbp_train's own ``build.build_run`` and
``trainer.train_step``) and the plain HF packed baselines — and the timing loop they share."""

from __future__ import annotations

import gc
import os
import platform
import sys
import time
from dataclasses import dataclass
from types import SimpleNamespace

ZERO_STAGE = 2  # our path's DeepSpeed ZeRO stage
OPTIMIZER_SCOPE = "hbp/optimizer"  # the profiler range around each path's optimizer step (bench/gpu/step_profile.py)


# -------------------------------------------------------------------------------------------- device helpers
def sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def release(device) -> None:
    """Give freed tensors back (after an OOM or between paths) so the next path starts from an empty device."""
    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def device_info(device, peak_flops) -> dict:
    import torch
    import transformers

    info = {"type": device.type, "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "peak_flops": peak_flops}
    try:
        import deepspeed

        info["deepspeed"] = deepspeed.__version__
    except ImportError:
        info["deepspeed"] = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=torch.cuda.get_device_name(device), memory_gib=props.total_memory / 2**30,
                    cuda=torch.version.cuda)
    else:
        info["name"] = f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"
    return info


@dataclass
class Measured:
    """What one path measured over its timed steps."""

    step_times: list
    tokens: int
    flops: float
    losses: list
    peak_gib: float
    optimizer_times: list | None = None  # ours only: engine.step's seconds per timed step

    def summary(self, peak_flops) -> dict:
        total = sum(self.step_times)
        extra = {}
        if self.optimizer_times:
            extra["optimizer_step_s_mean"] = sum(self.optimizer_times) / len(self.optimizer_times)
        return {**extra, "tokens_per_s": self.tokens / total, "tflops": self.flops / total / 1e12,
                "mfu": self.flops / (total * peak_flops) if peak_flops else None,
                "step_time_s_mean": total / len(self.step_times), "step_times_s": self.step_times,
                "peak_mem_gib": self.peak_gib, "first_loss": self.losses[0] if self.losses else None,
                "losses": self.losses}


def timed_steps(step, batches: list, args, model_config, desc: str) -> Measured:
    """--warmup untimed, then --steps timed calls of ``step(batch, i) -> (seconds, loss)``, cycling over batches;
    with ``args.deadline`` (bench_trainer --time-budget-s), no step starts that would end past it once one step
    has been timed (the figures then hold fewer steps; ``Measured.step_times`` says how many).

    Tokens and FLOPs count the timed steps; the peak memory is the highest of every step's (reset before each)."""
    from tqdm import tqdm

    from hbp_train.perf.flops import pack_flops
    from hbp_train.perf.shape import parse_model_shape
    from hbp_train.observe.telemetry import peak_memory_gib, reset_peak_memory

    shape = parse_model_shape(model_config)
    times, losses, tokens, flops, peak = [], [], 0, 0.0, 0.0
    for i in tqdm(range(args.warmup + args.steps), desc=desc, unit="step", file=sys.stderr, leave=False):
        batch = batches[i % len(batches)]
        reset_peak_memory()  # train_step resets it too; the optimizer step is inside our window
        seconds, loss = step(batch, i)
        peak = max(peak, peak_memory_gib())
        losses.append(loss)
        if i >= args.warmup:
            times.append(seconds)
            tokens += batch["input_ids"].shape[1]
            flops += pack_flops(shape, batch["seq_lens"])
            deadline = getattr(args, "deadline", None)
            if deadline is not None and deadline.left() < seconds:
                break
    return Measured(times, tokens, flops, losses, peak)


# ---------------------------------------------------------------------------------------------------- ours
def build_ours(args, architecture: str, hf_config: dict, device):
    """A build.Run for our path, from the trainer's own build_run: one packing group of --pack-len tokens at sp=1 on
    one rank (so the plain packed attention, no Ulysses dispatcher), no shards and no tokenizer, built as a run whose
    steps hold one micro-batch each (one pack per step): DeepSpeed then accumulates bf16 gradients in bf16, as a
    real run of such a plan does, with no fp32 buffer (4.9 GB for a 1B model) and no pass to fill it. Returns (run,
    the attention backend chosen). The weights are made on the device: initialising a 1B model on the host first
    takes far longer."""
    from hbp_train.model import attention
    from hbp_train.build import DeepSpeedConfig, build_run
    from hbp_train.model.loss import LossConfig
    from hbp_train.model.hf_model import ModelConfig
    from hbp_train.trainer import TrainConfig

    cfg = SimpleNamespace(
        model=ModelConfig(config=hf_config, architecture=architecture, dtype=args.dtype,
                          attention_backend=args.backend, kernels=args.kernels, seed=args.seed),
        train=TrainConfig(lr=args.lr, warmup_steps=0, grad_clip=1.0, save_final=False),
        deepspeed=DeepSpeedConfig(zero_stage=ZERO_STAGE), loss=LossConfig(chunk_size=args.loss_chunk))
    group = {"pack_len": args.pack_len, "sp": 1, "ckpt_layers": args.ckpt_layers}
    # total_steps: a flat LR over the whole benchmark (the cosine's end is never reached)
    run = build_run(cfg, [group], total_steps=1 << 20, init_device=device, max_micro_batches=1)
    return run, attention.get_backend()


def destroy_ours(run) -> None:
    if run is not None:
        run.engine.destroy()


def step_batch(micro_batch: dict, step: int, ckpt_layers: int):
    """A StepBatch (batches/collate.py) of one pack on the only rank (what PackedData.step_batch returns for world size 1)."""
    from hbp_train.batches.collate import StepBatch

    return StepBatch(step=step, plan_step=step, group=0, sp=1, replica=0, micro_batches=[micro_batch],
                     rank_loss_tokens=micro_batch["num_loss_tokens"], rank_num_samples=micro_batch["num_samples"],
                     global_loss_tokens=micro_batch["num_loss_tokens"],
                     global_num_samples=micro_batch["num_samples"], dp_size=1, ckpt_layers=ckpt_layers)


def ours_step(run, micro_batch: dict, step: int, ckpt_layers: int) -> tuple[float, float]:
    """One timed trainer.train_step (forward, backward, optimizer): (seconds, mean token loss)."""
    from hbp_train.trainer import STAT_COLUMNS, train_step

    sync(run.device)
    start = time.perf_counter()
    gathered, _, _ = train_step(run, step_batch(micro_batch, step, ckpt_layers))
    sync(run.device)
    seconds = time.perf_counter() - start
    loss_sum, loss_tokens = (float(gathered[0, STAT_COLUMNS.index(c)]) for c in ("loss_sum", "loss_tokens"))
    return seconds, loss_sum / max(loss_tokens, 1)


def measure_ours(run, batches: list, args, model_config, desc: str) -> Measured:
    """Our timed steps, with the optimizer step's share timed apart (``engine.step`` between two device syncs; the
    rest of a step is the forward and backward, the gradient reduction and the per-step statistics)."""
    engine_step, optimizer_s = run.engine.step, []

    def timed_engine_step(*a, **kw):
        sync(run.device)
        t0 = time.perf_counter()
        out = engine_step(*a, **kw)
        sync(run.device)
        optimizer_s.append(time.perf_counter() - t0)
        return out

    run.engine.step = timed_engine_step
    try:
        measured = timed_steps(lambda batch, i: ours_step(run, batch, i, args.ckpt_layers), batches, args,
                               model_config, desc)
    finally:
        del run.engine.step  # the instance attribute goes; the engine's own method is back
    measured.optimizer_times = optimizer_s[args.warmup:]
    return measured


def sp1_check(run, batches: list, args) -> dict:
    """Issue #6: an sp=1 step of a run that also has SP groups goes through the Ulysses dispatcher; time it against
    the packed attention called directly (what an sp=1-only run uses), same engine, alternating steps."""
    from hbp_train.model.attention import ATTN_IMPLEMENTATION as DIRECT
    from hbp_train.model.attention_setup import use_attention
    from hbp_train.model.ulysses import ATTN_IMPLEMENTATION as DISPATCH

    times = {DISPATCH: [], DIRECT: []}
    run.sp.install(run.model)  # degree 1 only: the dispatcher, no all-to-all wrappers
    try:
        for i in range(2 * args.steps):
            # ABBA order: neither variant always runs right after the other (clock and allocator drift).
            name = (DISPATCH, DIRECT)[(i % 2) ^ ((i // 2) % 2)]
            use_attention(run.model, name)
            seconds, _ = ours_step(run, batches[(i // 2) % len(batches)], 10_000 + i, args.ckpt_layers)
            times[name].append(seconds)
    finally:
        run.sp.uninstall(run.model)
    dispatch, direct = sum(times[DISPATCH]), sum(times[DIRECT])
    return {"dispatcher_step_s_mean": dispatch / args.steps, "direct_step_s_mean": direct / args.steps,
            "speed_ratio_dispatcher_over_direct": direct / dispatch,
            "note": "same engine and packs, steps alternated (ABBA); ratio = tokens/s through the Ulysses "
                    "dispatcher at sp=1 over tokens/s with hbp_packed attention called directly (target ~1.0). The "
                    "rest of train_step's SP code runs in both variants (O(1) per micro-batch at sp=1)"}


# ------------------------------------------------------------------------------------------------ baseline
# The flash kernels HF trains with through attn_implementation, best first: transformers' own check (which tells
# flash-attn 2 and flash-attn-4 apart, both installing flash_attn/) and the module it calls, imported for real (a
# build that does not match the installed torch is listed by transformers and fails at the first step).
HF_FLASH_KERNELS = {"flash_attention_4": (4, "flash_attn.cute.interface", "flash_attn_varlen_func"),
                    "flash_attention_3": (3, "flash_attn_interface", "flash_attn_varlen_func"),
                    "flash_attention_2": (2, "flash_attn", "flash_attn_varlen_func")}


def _kernel_imports(impl: str) -> bool:
    """transformers offers the flash implementation ``impl`` here and its kernel module imports."""
    import transformers.utils as tu

    from hbp_train.model.attention_kernels import import_kernel as _import_kernel

    version, module, attr = HF_FLASH_KERNELS[impl]
    if not getattr(tu, f"is_flash_attn_{version}_available", lambda: False)():
        return False
    return _import_kernel(module, attr, f"FlashAttention-{version} for HF ({module})") is not None


def hf_attention_candidates(device, dtype_name: str) -> list[str]:
    """Packed-capable HF attention implementations present here, best first (sdpa always last): FA4, FA3, FA2 where
    they import (bf16 only), flex_attention (its backward has no CPU kernel), sdpa."""
    import transformers.utils as tu

    found = []
    if device.type == "cuda":
        if dtype_name == "bf16":
            found += [impl for impl in HF_FLASH_KERNELS if _kernel_imports(impl)]
        if tu.is_torch_flex_attn_available():
            found.append("flex_attention")
    found.append("sdpa")
    return found


# The two ways HF users train in bf16 (--baselines NAME or NAME:amp): for speed, bf16 parameters and bf16 AdamW
# states; for accuracy, fp32 master weights under bf16 autocast (what HF Trainer does with bf16=True and an fp32
# load). Keys and labels of the results name which one a path is.
PRECISIONS = {"bf16": ("", "HF speed path: parameters and AdamW states in the run's dtype (bf16 on a GPU)"),
              "amp": ("_amp", "HF accuracy path: fp32 master weights, bf16 autocast")}


@dataclass(frozen=True)
class Baseline:
    """One HF baseline to run: its attention implementation and precision (a key of PRECISIONS), and for "best" the
    implementations to try next, in order, if this one fails to build or to train (its first step, a kernel's
    compile for this shape, can fail where a probe would not)."""

    impl: str
    precision: str
    fallbacks: tuple = ()

    @property
    def key(self) -> str:
        return f"hf_{self.impl}{PRECISIONS[self.precision][0]}"

    @property
    def label(self) -> str:
        return f"{PRECISIONS[self.precision][1]}: HF {self.impl} + DataCollatorWithFlattening + HF loss + torch AdamW"

    def tries(self) -> list["Baseline"]:
        """This baseline, then each fallback, as plain baselines."""
        return [Baseline(impl, self.precision) for impl in (self.impl, *self.fallbacks)]


def resolve_baselines(requested: list, device, dtype_name: str, default_precision: str = "bf16") -> tuple[list, list]:
    """(Baselines to run, notes). 'best' resolves to the best non-sdpa implementation present, the others present as
    its fallbacks; a name may end in ':amp' or ':bf16' (the precision; default ``default_precision``)."""
    available = hf_attention_candidates(device, dtype_name)
    baselines, notes = [], []
    for entry in requested:
        name, _, precision = entry.partition(":")
        precision = precision or default_precision
        if precision not in PRECISIONS:
            notes.append(f"{entry}: unknown precision {precision!r} (bf16 or amp); skipped")
            continue
        fallbacks = ()
        if name == "best":
            better = [a for a in available if a != "sdpa"]
            if not better:
                notes.append(f"{entry}: no packed-capable HF attention faster than sdpa on {device.type} "
                             "(flash-attn not installed, flex_attention needs a GPU); only sdpa ran")
                continue
            name, fallbacks = better[0], tuple(better[1:])
        elif name not in available:
            notes.append(f"{entry}: not available here (available: {', '.join(available)}); skipped")
            continue
        baseline = Baseline(name, precision, fallbacks)
        if all((b.impl, b.precision) != (name, precision) for b in baselines):
            baselines.append(baseline)
    return baselines, notes


def free_device_bytes(device) -> int | None:
    import torch

    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None


# What HF's loss holds at least at once per token and vocabulary entry: the bf16 logits, their fp32 copy and the fp32
# log-softmax (transformers' ForCausalLMLoss upcasts the logits, cross_entropy keeps its log-softmax for backward).
HF_LOGITS_BYTES = 2 + 4 + 4
# What an HF path's model states hold per parameter through its step: the speed path's bf16 parameters, gradients
# and two AdamW states; the accuracy path's fp32 ones.
HF_STATE_BYTES = {"bf16": 2 + 2 + 2 * 2, "amp": 4 + 4 + 2 * 4}


def hf_cannot_fit(pack_len: int, vocab: int, num_params: int, precision: str, device) -> str | None:
    """Why an HF path cannot fit this pack on ``device``: its full logits and its model states alone exceed the free
    memory (a lower bound: activations come on top, so a path that might fit is never left out); None to run it."""
    if device.type != "cuda":  # a CPU's memory is not the question a smoke run asks
        return None
    free = free_device_bytes(device)
    logits = pack_len * vocab * HF_LOGITS_BYTES
    states = num_params * HF_STATE_BYTES[precision]
    if free is None or logits + states <= free:
        return None
    return (f"cannot fit: its full logits need at least {logits / 2**30:.1f} GiB ({pack_len} tokens x {vocab} "
            f"vocabulary, bf16 and twice fp32) and its model states {states / 2**30:.1f} GiB ({num_params / 1e9:.2f}B "
            f"parameters, {PRECISIONS[precision][1].split(':')[0]}): {(logits + states) / 2**30:.1f} GiB, with "
            f"{free / 2**30:.1f} GiB free on the GPU")


def build_hf(args, architecture: str, hf_config: dict, impl: str, device, precision: str = "bf16"):
    """The plain HF model (same config, seed and so initial weights as ours) and a torch AdamW. HF's own modules:
    a Liger RoPE that an earlier model of ours put into transformers is taken out first."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from hbp_train.model.kernels import restore_hf_modules

    restore_hf_modules()
    amp = precision == "amp"
    dtype = torch.float32 if (amp or args.dtype == "fp32") else torch.bfloat16
    config = AutoConfig.for_model(architecture, **hf_config)
    torch.manual_seed(args.seed)  # as hbp_train.model.hf_model.build_model: the same initial weights
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=impl)
    model.config.use_cache = False
    model.train()
    if getattr(args, "baseline_ckpt", False):  # what an HF user turns on for long packs: every layer recomputed
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0,
                                  **({"fused": True} if device.type == "cuda" else {}))
    return model, optimizer, amp


def hf_batch(pack: list[dict], flash_kwargs: bool) -> dict:
    """The pack through transformers' DataCollatorWithFlattening (what a plain HF packed SFT run feeds the model)."""
    from transformers import DataCollatorWithFlattening

    collator = DataCollatorWithFlattening(return_flash_attn_kwargs=flash_kwargs)
    batch = collator([{"input_ids": d["input_ids"].tolist(), "labels": d["labels"].tolist()} for d in pack],
                     return_tensors="pt")
    batch["seq_lens"] = [len(d["input_ids"]) for d in pack]
    return batch


def hf_step(model, optimizer, params, batch: dict, device, amp: bool) -> tuple[float, float]:
    import torch

    sync(device)
    start = time.perf_counter()
    inputs = {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v
              for k, v in batch.items() if k != "seq_lens"}
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
        out = model(**inputs, use_cache=False)
    out.loss.backward()
    with torch.profiler.record_function(OPTIMIZER_SCOPE):  # bench/gpu/step_profile.py: what engine.step is for ours
        torch.nn.utils.clip_grad_norm_(params, 1.0)  # as our DeepSpeed config's gradient_clipping
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    loss = float(out.loss.detach())
    sync(device)
    return time.perf_counter() - start, loss


def measure_hf_best(args, architecture, hf_config, baseline: Baseline, packs: list, device, measure=None):
    """(Measured, the Baseline that ran, "impl: why" for each tried before it that failed): ``baseline`` and then
    its fallbacks, until one trains. Running out of memory ends the search (the next kernel would not fit either:
    HF's full logits dominate a long pack) and, like a failure of the last one, is raised."""
    from hbp_train.observe.telemetry import is_oom

    measure = measure or measure_hf
    tried = []
    candidates = baseline.tries()
    for i, candidate in enumerate(candidates):
        try:
            return measure(args, architecture, hf_config, candidate, packs, device), candidate, tried
        except Exception as exc:  # noqa: BLE001 - this kernel cannot train here: the next one is tried
            if is_oom(exc) or i == len(candidates) - 1:
                exc.hbp_tried = tried
                raise
            tried.append(f"{candidate.impl}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300])
        release(device)  # out of the except block: its traceback held the failed step's tensors
    raise AssertionError("unreachable")


def measure_hf(args, architecture, hf_config, baseline: Baseline, packs: list, device) -> Measured:
    model, optimizer, amp = build_hf(args, architecture, hf_config, baseline.impl, device, baseline.precision)
    try:
        params = [p for p in model.parameters() if p.requires_grad]
        batches = [hf_batch(p, baseline.impl.startswith("flash_attention")) for p in packs]
        return timed_steps(lambda batch, i: hf_step(model, optimizer, params, batch, device, amp), batches, args,
                           model.config, baseline.key)
    finally:
        del model, optimizer
        release(device)
