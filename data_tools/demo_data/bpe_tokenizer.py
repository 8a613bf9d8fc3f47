"""Train the small byte-level BPE tokenizer shipped in data_tools/assets/tokenizer/ (run once; output is committed).

The tokenizer is trained, deterministically, on text from ``data_tools.make_demo_data`` (plus the chat-template
role names), so demo conversations tokenize compactly; being byte-level it still encodes any text. It is saved as
an HF tokenizer directory that loads offline with ``AutoTokenizer.from_pretrained(DIR)``.

Special tokens: ``<|begin_of_text|>`` (bos), ``<|endoftext|>`` (eos), ``<|pad|>`` (pad), ``<|im_start|>`` and
``<|im_end|>`` (ChatML turn markers). Encoding plain text adds no special tokens; the chat template adds the bos.

Chat template (ChatML, in tokenizer_config.json)::

    <|begin_of_text|><|im_start|>system\\n{content}<|im_end|>\\n<|im_start|>user\\n{content}<|im_end|>\\n
    <|im_start|>assistant\\n{content}<|im_end|>\\n ...   [+ "<|im_start|>assistant\\n" with add_generation_prompt]

The assistant's ``{content}<|im_end|>`` is wrapped in ``{% generation %}...{% endgeneration %}``, so
``apply_chat_template(..., return_dict=True, return_assistant_tokens_mask=True)`` returns the assistant mask; the
model learns to end its answer with ``<|im_end|>``, which is therefore the token generation should stop on.

Usage: ``python -m data_tools.train_tokenizer [--out DIR] [--vocab-size 4096]``
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from data_tools.chat_labels import DEFAULT_CHAT_TEMPLATE
from hbp_train.common.cli import ArgumentParser, int_range, output_dir
from hbp_train.common.errors import EXIT_USER_ERROR

DEFAULT_OUT = Path(__file__).resolve().parent / "assets" / "tokenizer"
BOS, EOS, PAD, IM_START, IM_END = "<|begin_of_text|>", "<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, IM_START, IM_END]  # ids 0..4, in this order

# The shipped tokenizer carries the same ChatML template preprocessing gives tokenizers that have none.
CHAT_TEMPLATE = DEFAULT_CHAT_TEMPLATE

# Training text: demo conversations, fixed arguments (the tokenizer must not change when demo defaults do).
TRAIN_NUM_SAMPLES = 3000
TRAIN_MAX_TOKENS = 1024
TRAIN_SEED = 12345


def training_texts() -> list[str]:
    """The texts the BPE is trained on: every turn of the demo conversations, plus role names and digits."""
    from data_tools.make_demo_data import generate

    texts = ["system\n", "user\n", "assistant\n", "0 1 2 3 4 5 6 7 8 9 10 100 1000"]
    for record in generate(TRAIN_NUM_SAMPLES, TRAIN_MAX_TOKENS, TRAIN_SEED):
        texts.extend(message["content"] for message in record["messages"])
    return texts


def train(out: Path = DEFAULT_OUT, vocab_size: int = 4096, texts: list[str] | None = None) -> Path:
    """Train the BPE on ``texts`` (default: ``training_texts()``, the shipped tokenizer's) and save the HF tokenizer
    directory ``out``; returns ``out``. data_tools.make_code_data passes the text of its train split."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)  # before training: an unusable --out fails at once
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes: any text encodes
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_texts() if texts is None else texts, trainer=trainer)

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=1_000_000,  # a property of the model, not of this tokenizer; keep HF from warning
        clean_up_tokenization_spaces=False,
    )
    hf_tokenizer.save_pretrained(str(out))
    # The chat template lives in tokenizer_config.json (read by every transformers version, one file to review),
    # and the class is named by its portable alias rather than transformers 5's internal "TokenizersBackend".
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = CHAT_TEMPLATE
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


MAX_VOCAB_SIZE = 1 << 20


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="python -m data_tools.train_tokenizer",
        description="Train the small byte-level BPE tokenizer shipped with hbp-train (deterministic).",
    )
    parser.add_argument("--out", type=output_dir.path, default=DEFAULT_OUT,
                        help=f"output tokenizer directory (default {DEFAULT_OUT})")
    # 300: the 256 bytes, the special tokens and some merges; the trainer allocates tables of the size up front.
    parser.add_argument("--vocab-size", type=int_range(300, MAX_VOCAB_SIZE), default=4096,
                        help=f"BPE vocabulary size incl. special tokens, 300..{MAX_VOCAB_SIZE} (default 4096)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = train(args.out, args.vocab_size)
    except OSError as e:  # the --out path: a file in the way, no permission, a full disk
        print(f"error: cannot write {args.out}: {e.strerror or e}; pass a writable --out directory", file=sys.stderr)
        return EXIT_USER_ERROR
    print(f"saved tokenizer to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
