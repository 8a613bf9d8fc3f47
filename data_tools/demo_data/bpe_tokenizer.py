"""The small byte-level BPE tokenizer shipped in data_tools/assets/tokenizer/: ``train()`` (run once by
``python -m data_tools.train_tokenizer``; the output is committed), also on given texts (make_code_data's).

The tokenizer is trained, deterministically, on the demo chats (synthetic_chats.py) (plus the chat-template
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

import json
from pathlib import Path

from data_tools.preprocessing.chat_labels import DEFAULT_CHAT_TEMPLATE

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "assets" / "tokenizer"
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
    from data_tools.demo_data.synthetic_chats import generate

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


# The largest --vocab-size: the BPE trainer allocates tables of that size up front.
MAX_VOCAB_SIZE = 1 << 20
