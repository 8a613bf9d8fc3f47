"""Loading an exported checkpoint (HF safetensors directory + tokenizer) for evaluation.

User mistakes (a missing directory, no config.json, no tokenizer) raise ``UserError`` (hbp_train/common/errors.py) with one
line that names the path and the fix; ``eval/run.py`` prints it and exits with code 2.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from hbp_train.common.errors import UserError

# torch is imported inside the functions that need it: the opencompass subcommand never does, and starts fast.


def pick_device(name: str) -> torch.device:
    """``auto`` → the first CUDA GPU when there is one, else the CPU; anything else is passed to torch."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UserError(f"--device {name}: no CUDA GPU is visible; use --device cpu or auto")
    try:
        return torch.device(name)
    except RuntimeError:  # torch's message lists every device type it knows; ours says what is meant
        raise UserError(f"--device {name}: not a device; use auto, cpu, cuda or cuda:N") from None


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto`` → bf16 on a GPU (what the trainer uses), fp32 on the CPU (bf16 matmuls are slow there)."""
    import torch

    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return torch.float32
    if name not in names:
        raise UserError(f"--dtype {name}: choose one of auto, {', '.join(names)}")
    return names[name]


# Below this many parameters a CPU forward is dominated by per-op overhead, and extra threads only add
# synchronisation (on a shared, loaded machine OpenMP spin-waits made a tiny model tens of times slower with 2 threads).
SMALL_MODEL_PARAMS = 100_000_000


def set_cpu_threads(model, threads: int) -> int:
    """Threads for CPU inference: ``threads`` if > 0, else 1 for small models and torch's default otherwise."""
    import torch

    if next(model.parameters()).device.type != "cpu":
        return torch.get_num_threads()
    if threads <= 0:
        threads = 1 if sum(p.numel() for p in model.parameters()) < SMALL_MODEL_PARAMS else torch.get_num_threads()
    torch.set_num_threads(threads)
    return threads


def check_model_dir(model_dir: Path) -> Path:
    """The model directory must exist and hold an HF ``config.json`` (what ``hbp_train.export`` writes)."""
    model_dir = Path(model_dir).expanduser().resolve()
    if not model_dir.is_dir():
        raise UserError(f"--model {model_dir}: no such directory; pass an exported checkpoint (hbp_train.export)")
    if not (model_dir / "config.json").is_file():
        raise UserError(f"--model {model_dir}: no config.json; pass an HF model directory (hbp_train.export output)")
    return model_dir


def load_tokenizer(model_dir: Path):
    """The tokenizer saved next to the weights."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError, TypeError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"--model {model_dir}: cannot load its tokenizer ({first}); "
                         "export the checkpoint with its tokenizer") from None


def load_model(model_dir: Path, device: torch.device, dtype: torch.dtype):
    """``(model, tokenizer)`` in eval mode on ``device``; the model keeps its own attention implementation."""
    from transformers import AutoModelForCausalLM

    model_dir = check_model_dir(model_dir)
    tokenizer = load_tokenizer(model_dir)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype)
    except (OSError, ValueError, KeyError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"--model {model_dir}: cannot load the model ({first})") from None
    model.to(device).eval()
    return model, tokenizer


def untrained_model(model_dir: Path, device: torch.device, dtype: torch.dtype, seed: int):
    """The model of ``model_dir/config.json`` with freshly initialised weights (seeded), in eval mode on ``device``:
    what training started from when the run built its model from a config, and the chance level of a score
    otherwise. The weights are made on ``device`` directly."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(str(model_dir))
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def check_same_vocabulary(model_dir: Path, baseline_dir: Path, tokenizer) -> None:
    """A base model scored on the model's samples must read their token ids as the model does: UserError if its
    tokenizer's vocabulary differs."""
    if load_tokenizer(baseline_dir).get_vocab() != tokenizer.get_vocab():
        raise UserError(f"--baseline {baseline_dir}: its tokenizer's vocabulary differs from {model_dir}'s, so it "
                        "cannot score the same token ids; pass the base model the export was trained from, or "
                        "--baseline untrained")


def stop_token_ids(model, tokenizer) -> set[int]:
    """Token ids that end an answer: the eos of the tokenizer and of the generation config, and the token that
    ends an assistant turn in the chat template (a chat model trained with ChatML ends its turn with
    ``<|im_end|>``, not with eos)."""
    return _stop_ids(tokenizer, getattr(model.generation_config, "eos_token_id", None))


def stop_token_ids_of_dir(model_dir: Path, tokenizer) -> set[int]:
    """``stop_token_ids`` for a model directory without loading the weights (its ``generation_config.json``)."""
    path = Path(model_dir) / "generation_config.json"
    eos = None
    if path.is_file():
        try:
            eos = json.loads(path.read_text()).get("eos_token_id")
        except (OSError, ValueError, AttributeError) as err:
            raise UserError(f"--model {model_dir}: generation_config.json is unreadable ({err}); re-export the "
                            "checkpoint") from None
    return _stop_ids(tokenizer, eos)


def _stop_ids(tokenizer, generation_eos) -> set[int]:
    from hbp_train.export import end_of_turn_ids

    ids: set[int] = set(end_of_turn_ids(tokenizer))
    for value in (tokenizer.eos_token_id, generation_eos):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids
