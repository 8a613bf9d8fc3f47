"""The cost of resuming on another number of ranks: converting a checkpoint to DeepSpeed's universal format
(hbp_train/runtime/elastic.py, ``convert_to_universal``), the figure docs/reliability.md gives under "Costs".

    python bench/bench_conversion.py                   # the tiny, 8M and 100M models below
    python bench/bench_conversion.py --sizes 100m      # one of them

For each size: a Llama of that shape built from its config (random weights, fp32), one ZeRO-2 step of torch AdamW on
one CPU rank (gloo), a checkpoint saved as the trainer saves it (with the universal_checkpoint_info its converter
needs), then the conversion timed as the trainer runs it: ``python -m deepspeed.checkpoint.ds_to_universal`` in a
subprocess, Python's and DeepSpeed's start included, with up to 4 extraction workers (one per core). Prints the
parameters, the checkpoint's size, the seconds and the rate. Needs about 20 bytes of memory per parameter.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SIZES = {  # name -> HF Llama config fields
    "tiny": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 4096},
    "8m": {"hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 6, "num_attention_heads": 8,
           "num_key_value_heads": 4, "vocab_size": 4096},
    "100m": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 10, "num_attention_heads": 12,
             "num_key_value_heads": 4, "vocab_size": 16000},
}


def measure(fields: dict, folder: str) -> tuple:
    """(parameters, checkpoint bytes, conversion seconds) of one model shape."""
    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from hbp_train.runtime.checkpoint import UNIVERSAL_INFO
    from hbp_train.runtime.elastic import convert_to_universal

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**fields, max_position_embeddings=256, tie_word_embeddings=False,
                                         use_cache=False))
    config = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2}, "steps_per_print": 1 << 30,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "torch_adam": True}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    ids = torch.randint(0, fields["vocab_size"], (1, 64))
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(folder, tag="step_1", client_state=dict(UNIVERSAL_INFO), save_latest=False)
    tag_dir = os.path.join(folder, "step_1")
    size = sum(p.stat().st_size for p in Path(tag_dir).rglob("*") if p.is_file())
    seconds = convert_to_universal(tag_dir, os.path.join(folder, "universal"), 1)
    return sum(p.numel() for p in model.parameters()), size, seconds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    args = p.parse_args(argv)
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29533"))
    import deepspeed

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # its JIT build takes a minute on a CPU
    deepspeed.init_distributed(dist_backend="gloo")
    print(f"{'size':<6} {'parameters':>12} {'checkpoint':>11} {'conversion':>11} {'rate':>10}   "
          f"({os.cpu_count()} cores, {min(4, os.cpu_count() or 1)} extraction workers)")
    for name in args.sizes:
        folder = tempfile.mkdtemp(prefix=f"hbp-conversion-{name}-")
        try:
            params, size, seconds = measure(SIZES[name], folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        rate = size / 1e9 / seconds
        print(f"{name:<6} {params / 1e6:>11.1f}M {size / 1e9:>9.3f}GB {seconds:>10.1f}s {rate:>7.2f}GB/s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
