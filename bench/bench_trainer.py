"""Trainer benchmark (issue #5; the sp=1 no-regression check of issue #6): our training step against a plain HF
packed baseline, on the same packs, in the same process, on one device.

    python bench/bench_trainer.py --out runs/bench_trainer.json                     # a GPU (llama3.2-1b shape)
    python bench/bench_trainer.py --device cpu --model-shape tiny --pack-len 1024 --steps 2   # CPU smoke run

Paths, each trained for --warmup untimed and --steps timed steps of one pack per step (the same packs, in the
same order, from the same initial weights):
  ours      hbp_train's real step, ``trainer.train_step``: a DeepSpeed engine at world size 1 (ZeRO-2, bf16 with fp32
            master weights, torch AdamW, gradient clipping 1.0), our packed varlen attention (best backend of
            hbp_train.attention), the chunked LM-head loss, --ckpt-layers checkpointed layers. The engine is built
            from the trainer's public pieces the way ``trainer.build`` does it, without packed shards on disk
            (no ``datasets`` needed): packs are made in memory and collated by ``data.collate_pack``.
  hf_sdpa   a plain transformers model, ``attn_implementation="sdpa"``, batches from transformers'
            ``DataCollatorWithFlattening`` (position_ids restart per sample, each sample's first label masked; HF
            then builds the block-diagonal mask from the position_ids), HF's own loss (full logits), a plain
            ``torch.optim.AdamW`` step (fused on GPU) with the same clipping. bf16 parameters by default
            (--baseline-precision amp: fp32 parameters under bf16 autocast, as HF Trainer without a bf16 load).
  hf_<best> the same with the best packed-capable HF attention present: flash_attention_3/2 if flash-attn is
            installed (handed the collator's cu_seq_lens), else flex_attention (GPU only; HF builds a document
            BlockMask from the position_ids). Which one ran is in the table and the JSON.
Then the longest single pack our path trains (--pack-len, doubling up to --max-pack-search; --search-docs single
= one document of the whole length, the worst case for attention) with the fewest checkpointed layers that fit:
for each length the checkpoint levels (--ckpt-levels, default 0, L/4, L/2, 3L/4, L) are tried from the last one
that fitted; an out-of-memory error rebuilds the engine and tries the next level.

Figures: tokens/s and MFU over the timed steps (MFU = FLOPs / (time x peak); FLOPs from hbp_train.model.pack_flops
for every path: linear FLOPs per token plus causal attention FLOPs with sum of len^2 over the samples, never T^2;
recompute not counted), peak memory (CUDA max allocated; on a CPU the process's peak RSS, which only grows), the
first step's loss of each path (same weights and data: they must agree), and ours/baseline ratios. Targets
(issue #5): >= 1.2x the best HF baseline's tokens/s, >= 45% MFU, a 128K pack for a 1B shape. Every figure is
labelled with the device it was measured on; nothing is compared across devices.

The sp=1 check (issue #6): in a run whose plan also has SP groups, trainer.build installs the Ulysses dispatcher and
sp=1 steps go through it; an sp=1-only run (like ours here) keeps the plain packed attention. The same engine is
timed both ways, alternating step by step; the ratio should be ~1.0 (the rest of train_step's SP code runs in both).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

IGNORE_INDEX = -100
TARGET_RATIO = 1.2
TARGET_MFU = 0.45
TARGET_PACK = 131072

# Model shapes as HF config fields ("model_type" picks the architecture). llama3.2-1b and the qwen2.5 shapes are the
# published configs (tied embeddings); tiny is for the CPU smoke run.
PRESETS = {
    "tiny": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
             "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 4096, "tie_word_embeddings": False},
    "llama3.2-1b": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
                    "rope_theta": 500000.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-5},
    "qwen2.5-0.5b": {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 151936,
                     "rope_theta": 1000000.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-6},
    "qwen2.5-1.5b": {"model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                     "num_attention_heads": 12, "num_key_value_heads": 2, "vocab_size": 151936,
                     "rope_theta": 1000000.0, "tie_word_embeddings": True, "rms_norm_eps": 1e-6},
}


class BenchError(ValueError):
    """A user mistake: printed as one line, exit code 2."""


# ------------------------------------------------------------------------------------------------ arguments
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python bench/bench_trainer.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-shape", default=None,
                   help=f"preset ({', '.join(PRESETS)}), a JSON object of HF config fields, or a JSON / HF "
                        "config.json file; 'model_type' picks the architecture (default llama). Default: "
                        "llama3.2-1b on cuda, tiny on cpu")
    p.add_argument("--pack-len", type=int, default=None,
                   help="tokens per pack for the comparison (default 16384 on cuda, 1024 on cpu)")
    p.add_argument("--steps", type=int, default=10, help="timed steps per path, one pack each (default 10)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3 on cuda, 1 on cpu)")
    p.add_argument("--dtype", choices=("bf16", "fp32"), default=None,
                   help="parameter dtype of both paths (default bf16 on cuda, fp32 on cpu)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cuda (default) or cpu (a smoke run with a tiny shape: gloo, fp32, sdpa_block)")
    p.add_argument("--ckpt-layers", type=int, default=0,
                   help="activation-checkpointed layers of our path in the comparison (default 0; the baselines "
                        "use none)")
    p.add_argument("--backend", default="auto",
                   help="our packed attention backend (hbp_train.attention: auto, flash_varlen, torch_varlen, "
                        "flex, sdpa_block; default auto = best available)")
    p.add_argument("--baselines", default="sdpa,best",
                   help="HF baselines, comma separated: sdpa, best (best packed-capable attention present), or an "
                        "attn_implementation name (flash_attention_2, flex_attention); 'none' = skip (default "
                        "sdpa,best)")
    p.add_argument("--baseline-precision", choices=("bf16", "amp"), default="bf16",
                   help="HF baselines with --dtype bf16: bf16 parameters and AdamW states (default; the faster "
                        "baseline) or amp (fp32 parameters, bf16 autocast)")
    p.add_argument("--max-pack-search", type=int, default=None,
                   help="longest pack to try in the search (default 131072 on cuda, 2x --pack-len on cpu; 0 = no "
                        "search)")
    p.add_argument("--search-docs", choices=("single", "mix"), default="single",
                   help="search packs: one document of the whole length (default) or the realistic mix")
    p.add_argument("--ckpt-levels", default=None,
                   help="checkpointed-layer counts the search tries, comma separated (default 0,L/4,L/2,3L/4,L)")
    p.add_argument("--search-steps", type=int, default=1,
                   help="steps per search attempt; the last one is timed (default 1)")
    p.add_argument("--search-budget-s", type=float, default=300.0,
                   help="start no search attempt after this many seconds of searching (default 300)")
    p.add_argument("--no-sp1-check", action="store_true", help="skip the sp=1 dispatcher-vs-direct check")
    p.add_argument("--prompt-frac", type=float, default=0.0,
                   help="share of each sample's first tokens with label -100 (a prompt). 0 (default) trains every "
                        "token; > 0 lets our loss skip those LM-head rows while MFU still counts them")
    p.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate of all paths (default 1e-5)")
    p.add_argument("--loss-chunk", type=int, default=4096, help="our LM-head chunk in tokens (default 4096)")
    p.add_argument("--peak-tflops", type=float, default=0.0,
                   help="peak TFLOP/s of the device for MFU (default 0 = look the GPU up; none on a CPU)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data and the initial weights (default 0)")
    p.add_argument("--out", default=None, metavar="JSON", help="write the results here")
    return p


def resolve_args(args) -> argparse.Namespace:
    """Fill device-dependent defaults and validate; BenchError names the flag."""
    cpu = args.device == "cpu"
    args.model_shape = args.model_shape or ("tiny" if cpu else "llama3.2-1b")
    args.pack_len = args.pack_len or (1024 if cpu else 16384)
    args.warmup = args.warmup if args.warmup is not None else (1 if cpu else 3)
    args.dtype = args.dtype or ("fp32" if cpu else "bf16")
    if args.max_pack_search is None:
        args.max_pack_search = 2 * args.pack_len if cpu else TARGET_PACK
    if args.pack_len < 16:
        raise BenchError(f"--pack-len {args.pack_len}: must be >= 16")
    if args.steps < 1 or args.warmup < 0 or args.search_steps < 1:
        raise BenchError("--steps and --search-steps must be >= 1 and --warmup >= 0")
    if args.max_pack_search and args.max_pack_search < args.pack_len:
        raise BenchError(f"--max-pack-search {args.max_pack_search}: must be 0 or >= --pack-len {args.pack_len}")
    if not 0 <= args.prompt_frac < 1:
        raise BenchError(f"--prompt-frac {args.prompt_frac}: must be in [0, 1)")
    if args.ckpt_layers < 0 or args.loss_chunk < 1 or args.lr <= 0 or args.peak_tflops < 0:
        raise BenchError("--ckpt-layers, --peak-tflops must be >= 0; --loss-chunk, --lr must be > 0")
    if cpu and args.dtype == "bf16":
        raise BenchError("--dtype bf16 with --device cpu: the CPU smoke run is fp32")
    args.baselines = [] if args.baselines.strip() in ("", "none") else [b.strip() for b in args.baselines.split(",")]
    return args


def parse_shape(spec: str) -> tuple[str, str, dict]:
    """(name, architecture, HF config fields) from a preset, a JSON object or a JSON file."""
    if spec in PRESETS:
        fields, name = dict(PRESETS[spec]), spec
    else:
        text = spec
        if not spec.lstrip().startswith("{"):
            if not Path(spec).is_file():
                raise BenchError(f"--model-shape {spec!r}: not a preset ({', '.join(PRESETS)}), a JSON object or "
                                 "a file")
            text = Path(spec).read_text()
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as exc:
            raise BenchError(f"--model-shape: invalid JSON ({exc})") from None
        if not isinstance(fields, dict):
            raise BenchError("--model-shape: the JSON must be an object of HF config fields")
        name = str(fields.pop("name", "custom"))
    missing = {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"} - set(fields)
    if missing:
        raise BenchError(f"--model-shape: missing HF config field(s) {', '.join(sorted(missing))}")
    architecture = str(fields.pop("model_type", "llama"))
    fields.pop("architectures", None)
    # Dropout would change the work per step and HF's cache would disable packed masks (TECH-NOTES).
    fields.update(attention_dropout=0.0, use_cache=False)
    return name, architecture, fields


# ---------------------------------------------------------------------------------------------------- data
def doc_lengths(rng: np.random.Generator, num: int, max_len: int) -> np.ndarray:
    """A long-tailed SFT length mix (as bench_planner's): 95% chat-like (lognormal, median 600 tokens, sigma 1.2),
    5% long documents (log-uniform from max_len/8 to max_len); all clipped to [16, max_len]."""
    num_long = rng.random(num) < 0.05
    chat = np.round(rng.lognormal(np.log(600), 1.2, num))
    long = np.round(np.exp(rng.uniform(np.log(max(16, max_len // 8)), np.log(max_len), num)))
    return np.clip(np.where(num_long, long, chat), 16, max_len).astype(np.int64)


def make_doc(rng: np.random.Generator, length: int, vocab: int, prompt_frac: float) -> dict:
    """One sample: random token ids; the first prompt_frac of it (a prompt) carries label -100."""
    ids = rng.integers(3, vocab, size=length, dtype=np.int64)
    labels = ids.copy()
    labels[: int(length * prompt_frac)] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels}


def make_packs(pack_len: int, num_packs: int, vocab: int, seed: int, prompt_frac: float,
               docs: str = "mix") -> list[list[dict]]:
    """num_packs packs of exactly pack_len tokens (steady step times). mix: documents drawn (seeded) from
    `doc_lengths` until the pack is full, the last one cut to fit; single: one document of pack_len tokens."""
    rng = np.random.default_rng(seed)
    packs = []
    for _ in range(num_packs):
        if docs == "single":
            packs.append([make_doc(rng, pack_len, vocab, prompt_frac)])
            continue
        pack, room = [], pack_len
        while room > 0:
            length = int(doc_lengths(rng, 1, pack_len)[0])
            length = min(length, room)  # the last document is cut to fill the pack exactly
            pack.append(make_doc(rng, length, vocab, prompt_frac))
            room -= length
        packs.append(pack)
    return packs


def pack_row(pack: list[dict]) -> dict:
    """A packed-shard row (docs/architecture.md) of one pack, for data.collate_pack."""
    lengths = [len(d["input_ids"]) for d in pack]
    return {"input_ids": np.concatenate([d["input_ids"] for d in pack]),
            "labels": np.concatenate([d["labels"] for d in pack]),
            "position_ids": np.concatenate([np.arange(n) for n in lengths]),
            "cu_seqlens": np.concatenate([[0], np.cumsum(lengths)])}


def describe_packs(packs: list[list[dict]]) -> dict:
    lengths = np.array([len(d["input_ids"]) for p in packs for d in p])
    tokens = int(lengths.sum())
    return {"num_packs": len(packs), "docs_per_pack_mean": float(len(lengths) / len(packs)),
            "doc_len_p50": int(np.percentile(lengths, 50)), "doc_len_p90": int(np.percentile(lengths, 90)),
            "doc_len_max": int(lengths.max()),
            "attention_sum_len2_over_T2": float((lengths.astype(float) ** 2).sum()
                                                / sum(sum(len(d["input_ids"]) for d in p) ** 2 for p in packs)),
            "loss_token_share": float(sum(int((d["labels"][1:] != IGNORE_INDEX).sum()) for p in packs for d in p)
                                      / tokens)}


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


def reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device) -> float:
    """CUDA max allocated since the last reset; on a CPU the process's peak RSS (never resets)."""
    import torch

    from hbp_train.telemetry import peak_memory_gib

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return peak_memory_gib()


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

    def summary(self, peak_flops) -> dict:
        total = sum(self.step_times)
        return {"tokens_per_s": self.tokens / total, "tflops": self.flops / total / 1e12,
                "mfu": self.flops / (total * peak_flops) if peak_flops else None,
                "step_time_s_mean": total / len(self.step_times), "step_times_s": self.step_times,
                "peak_mem_gib": self.peak_gib, "first_loss": self.losses[0] if self.losses else None,
                "losses": self.losses}


# ---------------------------------------------------------------------------------------------------- ours
def build_ours(args, architecture: str, hf_config: dict, device):
    """A trainer.Run for our path, built as trainer.build builds it for a plan with only sp=1 groups (world size
    1), minus shards, tokenizer and Hydra: the engine comes from trainer.build_engine itself."""
    import torch

    from hbp_train import attention
    from hbp_train.distributed import ulysses
    from hbp_train.loss import LossConfig
    from hbp_train.model import ModelConfig, build_model
    from hbp_train.distributed.groups import build_parallel_state
    from hbp_train.trainer import DeepSpeedConfig, Run, TrainConfig, build_engine

    model_cfg = ModelConfig(config=hf_config, architecture=architecture, dtype=args.dtype,
                            attention_backend=args.backend, seed=args.seed)
    train_cfg = TrainConfig(out_dir=str(REPO / "runs" / "bench_trainer"), lr=args.lr, warmup_steps=0, grad_clip=1.0,
                            save_final=False)
    cfg = SimpleNamespace(model=model_cfg, train=train_cfg, deepspeed=DeepSpeedConfig(zero_stage=2),
                          loss=LossConfig(chunk_size=args.loss_chunk))
    pstate = build_parallel_state([1])
    ulysses.set_active_sp(1)
    total_steps = 1 << 20  # a flat LR over the whole benchmark (the cosine's end is never reached)
    # Built directly on the device: initialising a 1B model on the host first takes far longer.
    with torch.device(device):
        model = build_model(model_cfg)
    backend = attention.get_backend()
    ulysses.teardown_sequence_parallel()  # as trainer.build for sp=1-only plans: the plain packed attention
    engine = build_engine(cfg, model, total_steps, world_size=1)
    run = Run(cfg=cfg, engine=engine, model=model, data=None, pstate=pstate, device=engine.device, tokenizer=None,
              total_steps=total_steps, grad_divisor=engine.dp_world_size)
    return run, backend


def destroy_ours(run) -> None:
    if run is None:
        return
    from hbp_train.distributed.ulysses import teardown_sequence_parallel

    teardown_sequence_parallel()
    run.engine.destroy()


def step_batch(micro_batch: dict, step: int, ckpt_layers: int):
    """A data.StepBatch of one pack on the only rank (what PackedData.step_batch returns for world size 1)."""
    from hbp_train.data import StepBatch

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
    loss = float(gathered[0, STAT_COLUMNS.index("loss_sum")]) / max(float(gathered[0, STAT_COLUMNS.index("loss_tokens")]), 1)
    return seconds, loss


def measure_ours(run, batches: list, args, model_config, desc: str) -> Measured:
    from tqdm import tqdm

    from hbp_train.model import pack_flops

    times, losses, tokens, flops, peak = [], [], 0, 0.0, 0.0
    for i in tqdm(range(args.warmup + args.steps), desc=desc, unit="step", file=sys.stderr, leave=False):
        batch = batches[i % len(batches)]
        reset_peak(run.device)  # train_step resets it too; the optimizer step is inside our window
        seconds, loss = ours_step(run, batch, i, args.ckpt_layers)
        peak = max(peak, peak_gib(run.device))
        losses.append(loss)
        if i >= args.warmup:
            times.append(seconds)
            tokens += batch["input_ids"].shape[1]
            flops += pack_flops(model_config, batch["seq_lens"])
    return Measured(times, tokens, flops, losses, peak)


def sp1_check(run, batches: list, args) -> dict:
    """Issue #6: an sp=1 step of a run that also has SP groups goes through the Ulysses dispatcher; time it against
    the packed attention called directly (what an sp=1-only run uses), same engine, alternating steps."""
    from hbp_train.distributed import ulysses
    from hbp_train.attention import ATTN_IMPLEMENTATION as DIRECT
    from hbp_train.attention import use_attention
    from hbp_train.distributed.ulysses import ATTN_IMPLEMENTATION as DISPATCH

    def use(name):
        use_attention(run.model, name)

    times = {DISPATCH: [], DIRECT: []}
    ulysses.setup_sequence_parallel(run.model, run.pstate)  # degree 1 only: the dispatcher, no all-to-all wrappers
    try:
        for i in range(2 * args.steps):
            # ABBA order: neither variant always runs right after the other (clock and allocator drift).
            name = (DISPATCH, DIRECT)[(i % 2) ^ ((i // 2) % 2)]
            use(name)
            seconds, _ = ours_step(run, batches[(i // 2) % len(batches)], 10_000 + i, args.ckpt_layers)
            times[name].append(seconds)
    finally:
        ulysses.teardown_sequence_parallel()
        use(DIRECT)
    dispatch, direct = sum(times[DISPATCH]), sum(times[DIRECT])
    return {"dispatcher_step_s_mean": dispatch / args.steps, "direct_step_s_mean": direct / args.steps,
            "speed_ratio_dispatcher_over_direct": direct / dispatch,
            "note": "same engine and packs, steps alternated (ABBA); ratio = tokens/s through the Ulysses "
                    "dispatcher at sp=1 over tokens/s with hbp_packed attention called directly (target ~1.0). The "
                    "rest of train_step's SP code runs in both variants (O(1) per micro-batch at sp=1)"}


# ------------------------------------------------------------------------------------------------ baseline
def hf_attention_candidates(device, dtype_name: str) -> list[str]:
    """Packed-capable HF attention implementations present here, best first (sdpa always last)."""
    from transformers.utils import is_flash_attn_2_available, is_torch_flex_attn_available

    found = []
    if device.type == "cuda":
        if dtype_name == "bf16":
            try:
                from transformers.utils import is_flash_attn_3_available

                if is_flash_attn_3_available():
                    found.append("flash_attention_3")
            except ImportError:
                pass
            if is_flash_attn_2_available():
                found.append("flash_attention_2")
        if is_torch_flex_attn_available():
            found.append("flex_attention")  # its backward has no CPU kernel
    found.append("sdpa")
    return found


def resolve_baselines(requested: list, device, dtype_name: str) -> tuple[list, list]:
    """(implementations to run, notes). 'best' resolves to the best non-sdpa implementation present."""
    available = hf_attention_candidates(device, dtype_name)
    impls, notes = [], []
    for name in requested:
        if name == "best":
            better = [a for a in available if a != "sdpa"]
            if better:
                name = better[0]
            else:
                notes.append(f"best: no packed-capable HF attention faster than sdpa on {device.type} "
                             "(flash-attn not installed, flex_attention needs a GPU); only sdpa ran")
                continue
        elif name not in available:
            notes.append(f"{name}: not available here (available: {', '.join(available)}); skipped")
            continue
        if name not in impls:
            impls.append(name)
    return impls, notes


def build_hf(args, architecture: str, hf_config: dict, impl: str, device):
    """The plain HF model (same config, seed and so initial weights as ours) and a torch AdamW."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    amp = args.dtype == "bf16" and args.baseline_precision == "amp"
    dtype = torch.float32 if (amp or args.dtype == "fp32") else torch.bfloat16
    config = AutoConfig.for_model(architecture, **hf_config)
    torch.manual_seed(args.seed)  # as hbp_train.model.build_model: the same initial weights
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=impl)
    model.config.use_cache = False
    model.train()
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
    torch.nn.utils.clip_grad_norm_(params, 1.0)  # as our DeepSpeed config's gradient_clipping
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    loss = float(out.loss.detach())
    sync(device)
    return time.perf_counter() - start, loss


def measure_hf(args, architecture, hf_config, impl: str, packs: list, device) -> Measured:
    from tqdm import tqdm

    from hbp_train.model import pack_flops

    model, optimizer, amp = build_hf(args, architecture, hf_config, impl, device)
    try:
        params = [p for p in model.parameters() if p.requires_grad]
        batches = [hf_batch(p, impl.startswith("flash_attention")) for p in packs]
        times, losses, tokens, flops, peak = [], [], 0, 0.0, 0.0
        for i in tqdm(range(args.warmup + args.steps), desc=f"hf {impl}", unit="step", file=sys.stderr, leave=False):
            batch = batches[i % len(batches)]
            reset_peak(device)
            seconds, loss = hf_step(model, optimizer, params, batch, device, amp)
            peak = max(peak, peak_gib(device))
            losses.append(loss)
            if i >= args.warmup:
                times.append(seconds)
                tokens += batch["input_ids"].shape[1]
                flops += pack_flops(model.config, batch["seq_lens"])
        return Measured(times, tokens, flops, losses, peak)
    finally:
        del model, optimizer
        release(device)


# -------------------------------------------------------------------------------------------------- search
def ckpt_levels(spec, num_layers: int) -> list[int]:
    if spec:
        try:
            levels = sorted({int(x) for x in spec.split(",")})
        except ValueError:
            raise BenchError(f"--ckpt-levels {spec!r}: comma-separated integers") from None
        if levels[0] < 0 or levels[-1] > num_layers:
            raise BenchError(f"--ckpt-levels {spec!r}: each must be in [0, {num_layers}] (the model's layers)")
        return levels
    return sorted({0, num_layers // 4, num_layers // 2, 3 * num_layers // 4, num_layers})


def search_lengths(pack_len: int, max_len: int) -> list[int]:
    lengths, length = [], pack_len
    while length <= max_len:
        lengths.append(length)
        length *= 2
    if lengths and lengths[-1] < max_len:
        lengths.append(max_len)
    return lengths


def pack_search(args, run, rebuild, hf_config, device, peak_flops, first: dict | None,
                on_attempt=lambda partial: None) -> tuple:
    """The longest single pack our path trains, with the fewest checkpointed layers (of the levels) that fit.

    Returns (result dict, the run in use): an OOM destroys the engine (its ZeRO buffers may be half-way through a
    backward) and builds a fresh one. on_attempt(partial result) runs after every attempt.
    """
    from tqdm import tqdm

    from hbp_train.data import collate_pack
    from hbp_train.telemetry import is_oom
    from hbp_train.model import pack_flops

    num_layers = run.model.config.num_hidden_layers
    levels = ckpt_levels(args.ckpt_levels, num_layers)
    level_index = 0
    attempts = [first] if first else []
    if first:  # the comparison's step at --pack-len: go on from its level (the next one up if it ran out of memory)
        above = first["ckpt_layers"] + (0 if first["ok"] else 1)
        level_index = next((i for i, c in enumerate(levels) if c >= above), len(levels))
    lengths = [n for n in search_lengths(args.pack_len, args.max_pack_search)
               if not (first and first["ok"] and n == first["pack_len"])]
    start, skipped, longest = time.perf_counter(), [], (first if first and first["ok"] else None)
    bar = tqdm(total=len(lengths), desc="pack search", unit="len", file=sys.stderr, leave=False)
    for length in lengths:
        batch = collate_pack(pack_row(make_packs(length, 1, hf_config["vocab_size"], args.seed + length,
                                                 args.prompt_frac, args.search_docs)[0]), check_counts=False)
        fitted = False
        while level_index < len(levels):
            if time.perf_counter() - start > args.search_budget_s:
                skipped.append({"pack_len": length, "ckpt_layers": levels[level_index], "why": "search budget"})
                break
            ckpt = levels[level_index]
            attempt = {"pack_len": length, "ckpt_layers": ckpt, "docs": args.search_docs, "ok": False, "oom": False,
                       "device": device_info_name(device)}
            reset_peak(device)
            try:
                for s in range(args.search_steps):
                    seconds, loss = ours_step(run, batch, 20_000 + s, ckpt)
                flops = pack_flops(run.model.config, batch["seq_lens"])
                attempt.update(ok=True, step_time_s=seconds, tokens_per_s=length / seconds, loss=loss,
                               mfu=flops / (seconds * peak_flops) if peak_flops else None,
                               peak_mem_gib=peak_gib(device))
            except Exception as exc:  # noqa: BLE001 - an OOM is a result here; anything else ends the search
                if not is_oom(exc):
                    attempt["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
                    attempts.append(attempt)
                    on_attempt(finish_search(attempts, skipped, longest, args, levels))
                    bar.close()
                    return finish_search(attempts, skipped, longest, args, levels, stopped=attempt["error"]), run
                attempt.update(oom=True, peak_mem_gib=peak_gib(device))
            attempts.append(attempt)
            if attempt["ok"]:
                fitted, longest = True, attempt
            on_attempt(finish_search(attempts, skipped, longest, args, levels))
            if fitted:
                break
            destroy_ours(run)
            run = None
            release(device)
            level_index += 1
            if level_index < len(levels):
                run = rebuild()
        bar.update(1)
        if not fitted:
            break
    bar.close()
    return finish_search(attempts, skipped, longest, args, levels), run


def finish_search(attempts, skipped, longest, args, levels, stopped=None) -> dict:
    return {"docs": args.search_docs, "ckpt_levels": levels, "max_pack_search": args.max_pack_search,
            "attempts": attempts, "skipped": skipped, "stopped_by_error": stopped,
            "longest_ok": longest["pack_len"] if longest else None,
            "ckpt_layers_needed": longest["ckpt_layers"] if longest else None,
            "goal": TARGET_PACK, "goal_met": bool(longest and longest["pack_len"] >= TARGET_PACK)}


def device_info_name(device) -> str:
    import torch

    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


# ------------------------------------------------------------------------------------------------- report
def fmt(value, spec, missing="n/a") -> str:
    return missing if value is None else format(value, spec)


def print_report(results: dict) -> None:
    dev = results["device"]
    model, data, settings = results["model"], results["data"], results["settings"]
    print(f"\nTrainer benchmark on {dev['name']} ({dev['type']}, {settings['dtype']}), torch {dev['torch']}, "
          f"transformers {dev['transformers']}, deepspeed {dev['deepspeed']}")
    print(f"model {model['shape']} ({model['num_params'] / 1e9:.3f}B params, {model['architecture']}); packs of "
          f"{settings['pack_len']} tokens, {data['docs_per_pack_mean']:.1f} docs/pack (p50 {data['doc_len_p50']}, "
          f"max {data['doc_len_max']}); {settings['steps']} timed steps after {settings['warmup']} warm-up; "
          f"MFU peak {fmt(dev['peak_flops'] and dev['peak_flops'] / 1e12, '.0f')} TFLOP/s")
    head = f"{'path':<12}{'attention':<28}{'tokens/s':>11}{'TFLOP/s':>9}{'MFU %':>8}{'step s':>9}{'peak GiB':>10}{'1st loss':>10}"
    print(f"[measured on {dev['name']}]\n{head}\n{'-' * len(head)}")
    for name, r in results["paths"].items():
        if not r.get("ran"):
            print(f"{name:<12}{r.get('attention', ''):<28}  did not run: {r.get('error')}")
            continue
        print(f"{name:<12}{r['attention']:<28}{r['tokens_per_s']:>11,.0f}{r['tflops']:>9.1f}"
              f"{fmt(r['mfu'] and 100 * r['mfu'], '.1f'):>8}{r['step_time_s_mean']:>9.3f}{r['peak_mem_gib']:>10.2f}"
              f"{fmt(r['first_loss'], '.4f'):>10}")
    for note in results["notes"]:
        print(f"note: {note}")
    for name, ratio in results["ratios"].items():
        print(f"ratio {name}: {ratio['tokens_per_s']:.2f}x tokens/s, "
              f"peak memory {fmt(ratio['peak_mem'], '.2f')}x  [{dev['name']}]")
    t = results["targets"]
    print(f"targets: ours/best HF >= {TARGET_RATIO}x tokens/s: {fmt(t['ratio_met'], '')} | ours MFU >= "
          f"{100 * TARGET_MFU:.0f}%: {fmt(t['mfu_met'], '')} | pack >= {TARGET_PACK}: {fmt(t['pack_met'], '')}")
    if results.get("sp1_check"):
        c = results["sp1_check"]
        if "error" in c:
            print(f"sp=1 check: {c['error']}")
        else:
            print(f"sp=1 check [{dev['name']}]: Ulysses dispatcher {c['dispatcher_step_s_mean']:.3f} s/step vs direct "
                  f"{c['direct_step_s_mean']:.3f} s/step -> {c['speed_ratio_dispatcher_over_direct']:.3f}x")
    search = results.get("pack_search")
    if search:
        print(f"pack search (ours, {search['docs']} docs, ckpt levels {search['ckpt_levels']}) [{dev['name']}]:")
        for a in search["attempts"]:
            status = "ok" if a["ok"] else ("OOM" if a["oom"] else f"error {a.get('error')}")
            extra = (f" {a['step_time_s']:.2f} s/step, {a['tokens_per_s']:,.0f} tok/s, MFU "
                     f"{fmt(a['mfu'] and 100 * a['mfu'], '.1f')}{'%' if a['mfu'] else ''}" if a["ok"] else "")
            print(f"  {a['pack_len']:>8} tokens, {a['ckpt_layers']:>3} ckpt layers: {status:<4} peak "
                  f"{fmt(a.get('peak_mem_gib'), '.2f')} GiB{extra}")
        for s in search["skipped"]:
            print(f"  {s['pack_len']:>8} tokens, {s['ckpt_layers']:>3} ckpt layers: skipped ({s['why']})")
        print(f"  longest pack that trained: {search['longest_ok']} tokens with {search['ckpt_layers_needed']} "
              f"checkpointed layers (goal {TARGET_PACK}: {'met' if search['goal_met'] else 'not met'})")


def ratios(paths: dict) -> tuple[dict, str | None]:
    ours = paths.get("ours")
    out, best = {}, None
    if not ours or not ours.get("ran"):
        return out, None
    ran = {k: v for k, v in paths.items() if k != "ours" and v.get("ran")}
    for name, r in ran.items():
        out[f"ours/{name}"] = {"tokens_per_s": ours["tokens_per_s"] / r["tokens_per_s"],
                               "mfu": ours["mfu"] / r["mfu"] if ours["mfu"] and r["mfu"] else None,
                               "peak_mem": ours["peak_mem_gib"] / r["peak_mem_gib"] if r["peak_mem_gib"] else None}
    if ran:
        best = max(ran, key=lambda k: ran[k]["tokens_per_s"])
        out["ours/best_hf"] = dict(out[f"ours/{best}"], best_hf=best)
    return out, best


# ---------------------------------------------------------------------------------------------------- main
def save(results: dict, out) -> None:
    """Write the results so far (also after every phase: a run stopped by a time limit keeps what it measured)."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=1, default=float) + "\n")


def run_bench(args) -> dict:
    import torch

    from hbp_train.data import collate_pack
    from hbp_train.telemetry import is_oom, resolve_peak_flops
    from hbp_train.model import num_params
    from hbp_train.distributed.groups import init_distributed

    if args.device == "cuda" and not torch.cuda.is_available():
        raise BenchError("--device cuda: no CUDA device here; use --device cpu --model-shape tiny for a smoke run")
    name, architecture, hf_config = parse_shape(args.model_shape)
    hf_config.setdefault("max_position_embeddings", max(131072, args.max_pack_search or 0, args.pack_len))
    if args.ckpt_layers > int(hf_config["num_hidden_layers"]):
        raise BenchError(f"--ckpt-layers {args.ckpt_layers}: the model has {hf_config['num_hidden_layers']} layers")
    ckpt_levels(args.ckpt_levels, int(hf_config["num_hidden_layers"]))  # a bad list fails now, not after the comparison
    if args.device == "cpu" and args.backend == "auto":
        args.backend = "sdpa_block"
    init_distributed("gloo" if args.device == "cpu" else "nccl")
    device = torch.device("cuda", torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    peak_flops = resolve_peak_flops(args.peak_tflops * 1e12)
    packs = make_packs(args.pack_len, args.warmup + args.steps, hf_config["vocab_size"], args.seed, args.prompt_frac)
    results = {"bench": "bench_trainer", "version": 1, "complete": False, "command": " ".join(sys.argv),
               "device": device_info(device, peak_flops),
               "model": {"shape": name, "architecture": architecture, "config": hf_config},
               "data": describe_packs(packs),
               "settings": {"pack_len": args.pack_len, "steps": args.steps, "warmup": args.warmup, "dtype": args.dtype,
                            "ckpt_layers": args.ckpt_layers, "zero_stage": 2, "loss_chunk": args.loss_chunk,
                            "lr": args.lr, "grad_clip": 1.0, "baseline_precision": args.baseline_precision,
                            "prompt_frac": args.prompt_frac, "seed": args.seed,
                            "cuda_alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF")},
               "paths": {}, "notes": [], "ratios": {}}
    label = results["device"]["name"]
    if device.type == "cpu":
        results["notes"].append("CPU smoke run: the figures only show that every path trains; they say nothing about "
                                "GPU speed, and CPU peak memory is the process's peak RSS")

    # 1. HF baselines first: plain torch frees cleanly; the DeepSpeed engine comes last and stays for the search.
    impls, notes = resolve_baselines(args.baselines, device, args.dtype)
    results["notes"] += notes
    for impl in impls:
        key = f"hf_{impl}"
        entry = {"label": f"HF {impl} + DataCollatorWithFlattening + HF loss + torch AdamW", "attention": impl,
                 "device": label, "ran": False}
        try:
            entry.update(measure_hf(args, architecture, hf_config, impl, packs, device).summary(peak_flops), ran=True)
        except Exception as exc:  # noqa: BLE001 - a baseline that fails (OOM, missing kernel) is reported, not fatal
            entry["error"] = ("out of memory" if is_oom(exc) else
                              f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
        release(device)  # after the except block: its traceback held the failed step's tensors
        results["paths"][key] = entry
        save(results, args.out)

    # 2. Ours, then the sp=1 check and the pack search on the same engine.
    def rebuild():
        return build_ours(args, architecture, hf_config, device)[0]

    run, backend = build_ours(args, architecture, hf_config, device)
    results["model"]["num_params"] = num_params(run.model)
    entry = {"label": "hbp_train train_step: DeepSpeed ZeRO-2 + packed varlen attention + chunked LM-head loss",
             "attention": f"hbp_packed/{backend}", "backend": backend, "device": label, "ran": False,
             "ckpt_layers": args.ckpt_layers}
    batches = [collate_pack(pack_row(p), check_counts=False) for p in packs]
    first = None
    try:
        measured = measure_ours(run, batches, args, run.model.config, "ours")
        entry.update(measured.summary(peak_flops), ran=True)
        first = {"pack_len": args.pack_len, "ckpt_layers": args.ckpt_layers, "docs": "mix", "ok": True, "oom": False,
                 "device": label, "step_time_s": entry["step_time_s_mean"], "tokens_per_s": entry["tokens_per_s"],
                 "mfu": entry["mfu"], "peak_mem_gib": entry["peak_mem_gib"], "from": "comparison"}
    except Exception as exc:  # noqa: BLE001
        if not is_oom(exc):
            raise
        entry["error"] = "out of memory"
        first = {"pack_len": args.pack_len, "ckpt_layers": args.ckpt_layers, "docs": "mix", "ok": False, "oom": True,
                 "device": label, "from": "comparison"}
    if not entry["ran"]:  # outside the except block, whose traceback held the failed step's tensors
        destroy_ours(run)
        run = None  # drop the old engine before building the next one
        release(device)
        run = rebuild()
    results["paths"] = {"ours": entry, **results["paths"]}
    results["ratios"], best = ratios(results["paths"])
    save(results, args.out)
    if not args.no_sp1_check and entry["ran"]:
        try:
            results["sp1_check"] = sp1_check(run, batches, args)
        except Exception as exc:  # noqa: BLE001 - reported; the rest of the benchmark still counts
            results["sp1_check"] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"}
    if args.max_pack_search:

        def on_attempt(partial):
            results["pack_search"] = partial
            save(results, args.out)

        # Hand the engine over with no reference left here (popped straight into the call): after an OOM the search
        # drops it before building the next one, and a reference held here would keep its weights, gradients and
        # optimizer states (~20 GB for the 1B shape) on the GPU for the rest of the search.
        handover = [run]
        del run
        results["pack_search"], run = pack_search(args, handover.pop(), rebuild, hf_config, device, peak_flops,
                                                  first, on_attempt)
    destroy_ours(run)
    best_ratio = results["ratios"].get("ours/best_hf", {}).get("tokens_per_s")
    search = results.get("pack_search")
    results["targets"] = {
        "tokens_per_s_ratio": TARGET_RATIO, "mfu": TARGET_MFU, "pack_len": TARGET_PACK, "best_hf": best,
        "ratio_met": None if best_ratio is None else best_ratio >= TARGET_RATIO,
        "mfu_met": None if entry.get("mfu") is None else entry["mfu"] >= TARGET_MFU,
        "pack_met": None if not search else search["goal_met"]}
    return results


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args = resolve_args(args)
        if args.device == "cpu":
            # Keep torch and DeepSpeed off any GPU for the smoke run (must precede the first CUDA query).
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        else:
            os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")  # long packs fragment less
        for key in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            os.environ.setdefault(key, "1")
        results = run_bench(args)
    except BenchError as exc:
        print(f"bench_trainer: {exc}", file=sys.stderr)
        return 2
    results["complete"] = True
    save(results, args.out)
    print_report(results)
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
