"""Export a training checkpoint to an HF safetensors directory that ``AutoModelForCausalLM.from_pretrained`` loads.

``python -m hbp_train.export --checkpoint RUN_DIR[/checkpoints[/step_N]] --out HF_DIR [--dtype bf16]``

The weights are consolidated from the DeepSpeed ZeRO-1/2/3 shards with DeepSpeed's zero_to_fp32 utilities (fp32
master weights, on the CPU, no GPU or process group needed); the HF config and the tokenizer come from the
checkpoint's ``hf/`` folder (saved by hbp_train/checkpoint.py). The exported config re-enables the KV cache and
the standard attention (training used use_cache=False and the packed attention). ``--out`` must be new, empty or
an earlier export (marked by the ``hbp_export.json`` written last), so another model's files are never overwritten.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from hbp_train.errors import UserError

DTYPES = ("fp32", "bf16", "fp16")
MARKER = "hbp_export.json"  # written last: marks a finished export (which checkpoint, dtype); --out may replace it


def export(checkpoint: str, out: str, dtype: str = "fp32") -> str:
    """Write HF_DIR (config, safetensors weights, tokenizer); returns it. Raises UserError on bad input."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from hbp_train.checkpoint import resolve

    if os.path.exists(out) and not os.path.isdir(out):
        raise UserError(f"--out {out}: exists and is not a directory")
    if os.path.isdir(out) and os.listdir(out) and not os.path.isfile(os.path.join(out, MARKER)):
        # Never write model files over another model (e.g. the base model's own directory).
        raise UserError(f"--out {out}: directory is not empty and holds no earlier export ({MARKER}); choose a "
                         f"new or empty --out directory")
    if not os.path.isdir(checkpoint):
        raise UserError(f"--checkpoint {checkpoint}: no such directory; pass RUN_DIR (train.out_dir), "
                         f"RUN_DIR/checkpoints or RUN_DIR/checkpoints/step_<n>")
    try:
        root, tag = resolve(checkpoint)
    except UserError:
        ckpts = checkpoint if os.path.basename(os.path.normpath(checkpoint)) == "checkpoints" else \
            os.path.join(checkpoint, "checkpoints")
        if os.path.isdir(ckpts):
            raise UserError(f"{ckpts}: no checkpoint saved yet (training saves one at its end and every "
                             f"train.save_every steps)") from None
        raise
    from hbp_train.manifest import problem

    why = problem(os.path.join(root, tag))  # a damaged or unfinished save: say which file, not DeepSpeed's error
    if why:
        raise UserError(f"--checkpoint {checkpoint}: {why}; export another checkpoint (RUN_DIR/checkpoints/step_<n>)")
    hf_dir = os.path.join(root, tag, "hf")
    if not os.path.isfile(os.path.join(hf_dir, "config.json")):
        raise UserError(f"{os.path.join(root, tag)}: no hf/config.json (not written by hbp_train.train?)")
    try:
        config = AutoConfig.from_pretrained(hf_dir)
        tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    except (OSError, ValueError, TypeError) as e:  # a damaged hf/ folder: transformers' message, first line
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"{hf_dir}: cannot load the saved config/tokenizer ({first})") from None
    config.use_cache = True
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if getattr(tokenizer, name, None) is not None:
            setattr(config, name, getattr(tokenizer, name))
    try:  # before the (slow) consolidation of the shards
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create it ({e.strerror})") from None
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    try:
        state = get_fp32_state_dict_from_zero_checkpoint(root, tag=tag)
    except FileNotFoundError as e:  # a checkpoint folder missing its ZeRO shards
        raise UserError(f"{os.path.join(root, tag)}: incomplete checkpoint ({e})") from None
    # The engine wraps the HF model as `model` (build.PackedCausalLM).
    state = {k.removeprefix("model."): v for k, v in state.items()}
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if _is_tied(model, k)}
    if set(missing) - tied or unexpected:
        raise UserError(f"{os.path.join(root, tag)}: weights do not match the model config "
                         f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})")
    model = model.to(torch_dtype)
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    with open(os.path.join(out, MARKER), "w") as f:
        json.dump({"checkpoint": os.path.join(root, tag), "dtype": dtype}, f)
        f.write("\n")
    return out


def _is_tied(model, key: str) -> bool:
    """A missing key that is the tied LM head (shares the embedding)."""
    head = model.get_output_embeddings()
    return bool(getattr(model.config, "tie_word_embeddings", False)) and head is not None and key.endswith("weight") \
        and "lm_head" in key


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m hbp_train.export",
        description="Export an hbp-train checkpoint (DeepSpeed ZeRO-1/2/3) to an HF safetensors model directory "
                    "with its tokenizer.")
    parser.add_argument("--checkpoint", required=True,
                        help="a checkpoint: RUN_DIR or RUN_DIR/checkpoints (its 'latest' is used), or "
                             "RUN_DIR/checkpoints/step_N")
    parser.add_argument("--out", required=True,
                        help="output directory for the HF model: new, empty or an earlier export (which is "
                             "overwritten); created if missing. A finished export holds hbp_export.json")
    parser.add_argument("--dtype", default="fp32", choices=DTYPES,
                        help="dtype of the saved weights (default fp32: the optimizer's master weights as they are)")
    args = parser.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out, args.dtype)
    except UserError as e:
        print(f"export error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 2
    print(f"[export] wrote {out} (load with AutoModelForCausalLM.from_pretrained({out!r}))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
