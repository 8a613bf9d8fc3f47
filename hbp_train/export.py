"""Export a training checkpoint to an HF safetensors directory that ``AutoModelForCausalLM.from_pretrained`` loads.

``python -m hbp_train.export --checkpoint RUN_DIR[/checkpoints[/step_N]] --out HF_DIR [--dtype bf16] [--adapter]``

The weights are consolidated from the DeepSpeed ZeRO-1/2/3 shards with DeepSpeed's zero_to_fp32 utilities (fp32
master weights, on the CPU, no GPU or process group needed); the HF config and the tokenizer come from the
checkpoint's ``hf/`` folder (saved by hbp_train/runtime/checkpoint.py). The tokenizer's files are written as the user
gave them (``write_tokenizer``: the run's tokenizer folder copied file for file, not re-saved by transformers). The
exported config re-enables the KV cache and the standard attention (training used use_cache=False and the packed
attention). LoRA/DoRA adapters (model.lora) are merged into the base weights (hbp_train/model/lora.py), or with
``--adapter`` written alone as a peft adapter folder (``peft.PeftModel.from_pretrained(base_model, HF_DIR)``) with
the tokenizer. ``--out`` must be new, empty or an earlier export (marked by the ``hbp_export.json`` written last), so
another model's files are never overwritten.

``generation_config.json`` starts from the base model's own (saved in ``hf/`` with its sampling settings and eos
list; else the one derived from the config) and adds to its ``eos_token_id`` the tokenizer's eos and the token that
ends an assistant turn in the chat template the model was trained with (``<|im_end|>`` for ChatML): a chat model
ends its answer with that token, not with eos, so without it ``generate()`` runs to ``max_new_tokens``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import sys

from hbp_train.common.cli import ArgumentParser, existing_dir, output_dir
from hbp_train.common.errors import EXIT_USER_ERROR, UserError
from hbp_train.common.library_bars import library_bars_on_a_terminal_only

DTYPES = ("fp32", "bf16", "fp16")
MARKER = "hbp_export.json"  # written last: marks a finished export (which checkpoint, dtype); --out may replace it


def export(checkpoint: str, out: str, dtype: str = "fp32", adapter: bool = False) -> str:
    """Write HF_DIR (config, safetensors weights, generation config, tokenizer; ``adapter``: the peft adapter folder
    and the tokenizer); returns it. Raises UserError on bad input."""
    import torch

    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        # Name DeepSpeed's accelerator before its import (as launch.sh does): without a GPU it picks the CPU anyway,
        # after a warning that it could not detect one. The consolidation runs on the CPU either way.
        os.environ["DS_ACCELERATOR"] = "cpu"
    from deepspeed.utils import zero_to_fp32
    from tqdm import tqdm as tqdm_std
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from hbp_train.runtime.checkpoint import resolve
    from hbp_train.model.lora import apply_lora, lora_settings_of, merge_lora, save_adapter

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
    except UserError:  # resolve's errors all describe the --checkpoint path
        ckpts = checkpoint if os.path.basename(os.path.normpath(checkpoint)) == "checkpoints" else \
            os.path.join(checkpoint, "checkpoints")
        if os.path.isdir(ckpts):
            raise UserError(f"{ckpts}: no checkpoint saved yet (training saves one at its end and every "
                            f"train.save_every steps)") from None
        raise
    from hbp_train.runtime.manifest import problem

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
    lora = lora_settings_of(config)
    if adapter and lora is None:
        raise UserError(f"--adapter: {os.path.join(root, tag)} was trained without adapters (model.lora.r=0); "
                        f"export it without --adapter")
    config.use_cache = True
    for name in ("eos_token_id", "pad_token_id", "bos_token_id"):
        if getattr(tokenizer, name, None) is not None:
            setattr(config, name, getattr(tokenizer, name))
    generation_config = build_generation_config(hf_dir, config, tokenizer)
    config.eos_token_id = generation_config.eos_token_id  # the same stop tokens for tools that read config.json
    try:  # before the (slow) consolidation of the shards
        os.makedirs(out, exist_ok=True)
    except OSError as e:
        raise UserError(f"--out {out}: cannot create it ({e.strerror})") from None
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    if zero_to_fp32.tqdm is tqdm_std and not sys.stderr.isatty():
        # Its "Loading checkpoint shards" bar takes no switch; in a log file it is a run of \r-joined frames.
        zero_to_fp32.tqdm = functools.partial(tqdm_std, disable=True)
    try:
        state = get_fp32_state_dict_from_zero_checkpoint(root, tag=tag)
    except FileNotFoundError as e:  # shards missing from a copied or partly deleted checkpoint
        raise UserError(f"{os.path.join(root, tag)}: incomplete checkpoint ({str(e).splitlines()[0]})") from None
    # The engine wraps the HF model as `model` (model/packed_lm.PackedCausalLM).
    state = {k.removeprefix("model."): v for k, v in state.items()}
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if lora is not None:  # trained with adapters: rebuild them to load the checkpoint, merged (or saved) below
        apply_lora(model, lora)
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = {k for k in missing if _is_tied(model, k)}
    if set(missing) - tied or unexpected:
        raise UserError(f"{os.path.join(root, tag)}: weights do not match the model config "
                        f"(missing {sorted(set(missing) - tied)[:3]}, unexpected {sorted(unexpected)[:3]})")
    _remove_other_kind(out, adapter)  # an earlier export of the other kind must not leave a mixed folder
    if adapter:  # the adapters alone, for peft over the base model (whose weights the frozen ones are)
        save_adapter(model, out, torch_dtype, base_model=_base_model_of(os.path.join(root, tag)))
    else:
        if lora is not None:
            merge_lora(model)  # full HF weights: base + the adapters' update
        model = model.to(torch_dtype)
        model.generation_config = generation_config
        model.save_pretrained(out, safe_serialization=True)
    write_tokenizer(os.path.join(root, tag), tokenizer, out)
    with open(os.path.join(out, MARKER), "w") as f:
        json.dump({"checkpoint": os.path.join(root, tag), "dtype": dtype, "adapter": adapter}, f)
        f.write("\n")
    return out


# What transformers' from_pretrained records of its own call and save_pretrained then writes into
# tokenizer_config.json: facts about one load, not settings of the tokenizer.
LOADER_KEYS = ("is_local", "local_files_only")
# A tokenizer's files besides the ones its class names (tokenizer.vocab_files_names).
TOKENIZER_FILES = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.json",
                   "chat_template.jinja", "chat_template.json", "additional_chat_templates")


def write_tokenizer(tag_dir: str, tokenizer, out: str) -> str:
    """Write the tokenizer's files into ``out`` as the user gave them; returns the folder they came from.

    The run's tokenizer folder (``model.tokenizer`` in the checkpoint's config.yaml) is copied file for file when it
    still holds the tokenizer the checkpoint saved (same vocabulary, special tokens and chat template): a re-save by
    transformers would rename a ``PreTrainedTokenizerFast`` class, move the chat template into its own file and add
    the keys of its own load (``LOADER_KEYS``). Otherwise (the folder moved or changed since training) the
    checkpoint's copy in ``hf/`` is written, without those keys."""
    names = {*TOKENIZER_FILES, *getattr(tokenizer, "vocab_files_names", {}).values()}
    for name in names:  # an earlier export's (checked: out is new, empty or an export)
        path = os.path.join(out, name)
        if os.path.isfile(path):
            os.remove(path)
        elif os.path.isdir(path):
            shutil.rmtree(path)
    source = _run_tokenizer_dir(tag_dir)
    if source is None or not _same_tokenizer(source, tokenizer):
        source = os.path.join(tag_dir, "hf")
    for name in sorted(names):
        path = os.path.join(source, name)
        if os.path.isdir(path):
            shutil.copytree(path, os.path.join(out, name))
        elif os.path.isfile(path):
            shutil.copyfile(path, os.path.join(out, name))
    config_path = os.path.join(out, "tokenizer_config.json")
    if source.endswith(os.sep + "hf") and os.path.isfile(config_path):
        with open(config_path, encoding="utf-8") as f:
            saved = json.load(f)
        if any(key in saved for key in LOADER_KEYS):
            with open(config_path, "w", encoding="utf-8") as f:
                json.dump({k: v for k, v in saved.items() if k not in LOADER_KEYS}, f, indent=2, ensure_ascii=False)
                f.write("\n")
    return source


def _run_tokenizer_dir(tag_dir: str):
    """The run's ``model.tokenizer`` (its config.yaml in the checkpoint) when that folder exists, else None."""
    from omegaconf import OmegaConf

    try:
        path = OmegaConf.select(OmegaConf.load(os.path.join(tag_dir, "config.yaml")), "model.tokenizer")
    except Exception:  # noqa: BLE001 -- no or an unreadable config.yaml: the checkpoint's own copy serves
        return None
    return str(path) if path and os.path.isdir(str(path)) else None


def _same_tokenizer(folder: str, tokenizer) -> bool:
    """Whether ``folder`` holds the tokenizer the checkpoint saved: the same vocabulary (added tokens included),
    special tokens and chat template."""
    from transformers import AutoTokenizer

    try:
        other = AutoTokenizer.from_pretrained(folder)
    except Exception:  # noqa: BLE001 -- an unloadable folder is not the run's tokenizer any more
        return False
    return (other.get_vocab() == tokenizer.get_vocab() and other.special_tokens_map == tokenizer.special_tokens_map
            and other.chat_template == tokenizer.chat_template)


def build_generation_config(hf_dir: str, config, tokenizer):
    """The base model's generation config (``hf_dir/generation_config.json``) with the tokenizer's eos and the chat
    template's end-of-turn token added to its ``eos_token_id`` list, and the KV cache on.

    A generation config that was only derived from the model config (``_from_model_config``: a model built from a
    config, or a base model that shipped none) holds the config class's default token ids, which need not match the
    tokenizer, and training's ``use_cache=False``: it is derived again from ``config``, whose token ids the caller
    took from the tokenizer."""
    from transformers import GenerationConfig

    generation_config = None
    if os.path.isfile(os.path.join(hf_dir, "generation_config.json")):
        generation_config = GenerationConfig.from_pretrained(hf_dir)
    if generation_config is None or getattr(generation_config, "_from_model_config", False):
        generation_config = GenerationConfig.from_model_config(config)
        generation_config._from_model_config = False  # now the model's own: a later export keeps it
    generation_config.use_cache = True  # training saved use_cache=False; generate() would recompute every step
    eos = generation_config.eos_token_id
    eos = [] if eos is None else [int(eos)] if isinstance(eos, int) else [int(t) for t in eos]
    for token_id in [tokenizer.eos_token_id, *end_of_turn_ids(tokenizer)]:
        if token_id is not None and token_id not in eos:
            eos.append(int(token_id))
    generation_config.eos_token_id = eos
    for name in ("pad_token_id", "bos_token_id"):
        if getattr(generation_config, name, None) is None and getattr(tokenizer, name, None) is not None:
            setattr(generation_config, name, getattr(tokenizer, name))
    return generation_config


_ANSWER = "\u2063hbp-answer\u2063"  # an answer text no template alters, found again in the rendered chat


def end_of_turn_ids(tokenizer) -> list[int]:
    """The special token that follows an assistant answer in the tokenizer's chat template (``<|im_end|>`` in
    ChatML, ``<|eot_id|>`` in Llama 3, ``<end_of_turn>`` in Gemma), as a one-element list; ``[]`` if the answer is
    followed by no special token. A tokenizer without a chat template was trained with data_tools.preprocess's
    default ChatML template, so that template is read instead."""
    template = tokenizer.chat_template
    if isinstance(template, dict):  # several named templates: the default one renders chats
        template = template.get("default") or next(iter(template.values()), None)
    if not template:
        from data_tools.preprocessing.chat_labels import DEFAULT_CHAT_TEMPLATE

        template = DEFAULT_CHAT_TEMPLATE
    chat = [{"role": "user", "content": "Hello."}, {"role": "assistant", "content": _ANSWER}]
    try:
        text = tokenizer.apply_chat_template(chat, chat_template=template, tokenize=False)
    except Exception:  # noqa: BLE001 -- jinja raises arbitrary errors (templates call raise_exception)
        return []
    if _ANSWER not in text:
        return []
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
    for token_id in tokenizer.encode(text.split(_ANSWER, 1)[1], add_special_tokens=False):
        if token_id in special:
            return [int(token_id)]
        if tokenizer.decode([token_id]).strip():
            return []  # text, not a special token, follows the answer
    return []


def _remove_other_kind(out: str, adapter: bool) -> None:
    """Delete from ``out`` (empty or an earlier export: checked above) the files an export of the other kind wrote:
    a full model's config and weights before an adapter is written, an adapter's before a full model is."""
    for name in os.listdir(out):
        model_file = name in ("config.json", "generation_config.json") or (
            name.startswith("model") and (name.endswith(".safetensors") or name.endswith(".safetensors.index.json")))
        adapter_file = name in ("adapter_config.json", "adapter_model.safetensors")
        if (model_file if adapter else adapter_file) and os.path.isfile(os.path.join(out, name)):
            os.remove(os.path.join(out, name))


def _base_model_of(tag_dir: str):
    """The run's ``model.name_or_path`` (its config.yaml in the checkpoint), for the adapter's
    ``base_model_name_or_path``; None for a model built from a config or an unreadable config."""
    from omegaconf import OmegaConf

    try:
        return OmegaConf.select(OmegaConf.load(os.path.join(tag_dir, "config.yaml")), "model.name_or_path")
    except Exception:  # noqa: BLE001 -- only a label in adapter_config.json; the weights do not depend on it
        return None


def _is_tied(model, key: str) -> bool:
    """A missing key that is the tied LM head (shares the embedding)."""
    head = model.get_output_embeddings()
    return bool(getattr(model.config, "tie_word_embeddings", False)) and head is not None and key.endswith("weight") \
        and "lm_head" in key


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m hbp_train.export",
        description="Export an hbp-train checkpoint (DeepSpeed ZeRO-1/2/3) to an HF safetensors model directory "
                    "with its tokenizer.")
    parser.add_argument("--checkpoint", required=True, type=existing_dir,
                        help="a checkpoint: RUN_DIR or RUN_DIR/checkpoints (its 'latest' is used), or "
                             "RUN_DIR/checkpoints/step_N")
    parser.add_argument("--out", required=True, type=output_dir,
                        help="output directory for the HF model: new, empty or an earlier export (which is "
                             "overwritten); created if missing. A finished export holds hbp_export.json")
    parser.add_argument("--dtype", default="fp32", choices=DTYPES,
                        help="dtype of the saved weights (default fp32: the optimizer's master weights as they are)")
    parser.add_argument("--adapter", action="store_true",
                        help="a run trained with model.lora: write the peft adapter folder (adapter_config.json, "
                             "adapter_model.safetensors) instead of merging the adapters into full weights")
    return parser


def main(argv: list | None = None) -> int:
    args = build_parser().parse_args(argv)
    library_bars_on_a_terminal_only()
    try:
        out = export(args.checkpoint, args.out, args.dtype, adapter=args.adapter)
    except UserError as e:
        print(f"export error: {str(e).splitlines()[0]}", file=sys.stderr)
        return EXIT_USER_ERROR
    load = "peft.PeftModel.from_pretrained(base_model, {!r})" if args.adapter else \
        "AutoModelForCausalLM.from_pretrained({!r})"
    print(f"[export] wrote {out} (load with {load.format(out)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
