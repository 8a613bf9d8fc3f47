"""data_tools/preprocessing/chat_labels.py on chat templates written in the styles of real families, none with
generation markers: header tokens (Llama 3), an injected default system prompt (Qwen2.5), a renamed role (Gemma's
``model``, the system prompt folded into the first user turn) and earlier turns rewritten (Qwen3 drops the reasoning
of earlier assistant turns). Each sample's labelled text is checked against its rendered text, turn by turn; a
template whose assistant text cannot be located is a counted drop whose reason says what to do."""

from __future__ import annotations

import numpy as np
import pytest

from data_tools.preprocessing.chat_labels import ChatEncoder
from data_tools.preprocessing.formats import FormatError, Sample
from hbp_train.common.labels import IGNORE_INDEX
from tests.test_preprocess import tokenizer_with_template

LLAMA3 = ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n'"
          " + m['content'] | trim + '<|eot_id|>' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}")
QWEN25 = ("{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are Qwen, a helpful assistant."
          "<|im_end|>\\n' }}{% endif %}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content']"
          " + '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
GEMMA = ("{{ bos_token }}{% if messages[0]['role'] == 'system' %}{% set first = messages[0]['content'] + '\\n\\n' %}"
         "{% set turns = messages[1:] %}{% else %}{% set first = '' %}{% set turns = messages %}{% endif %}"
         "{% for m in turns %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
         "{{ '<start_of_turn>' + role + '\\n' + (first if loop.first else '') + m['content'] | trim"
         " + '<end_of_turn>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\\n' }}{% endif %}")
QWEN3 = ("{% set ns = namespace(last_query=-1) %}{% for m in messages %}{% if m['role'] == 'user' %}"
         "{% set ns.last_query = loop.index0 %}{% endif %}{% endfor %}{% for m in messages %}"
         "{% if m['role'] == 'assistant' %}{% set content = m['content'] %}{% set reasoning = '' %}"
         "{% if '</think>' in content %}{% set reasoning = content.split('</think>')[0].split('<think>')[-1]"
         ".strip('\\n') %}{% set content = content.split('</think>')[-1].lstrip('\\n') %}{% endif %}"
         "{% if loop.index0 > ns.last_query %}{{ '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n'"
         " + content + '<|im_end|>\\n' }}{% else %}{{ '<|im_start|>assistant\\n' + content + '<|im_end|>\\n' }}"
         "{% endif %}{% else %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endif %}"
         "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
# Lists every answer again after the conversation: rendering up to an earlier turn is no prefix of the whole, and
# the turn's content appears twice, so substitution cannot place it either.
SUMMARY = ("{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\n' }}{% endfor %}"
           "{{ 'answers so far: ' }}{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] + ' | ' }}"
           "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'assistant: ' }}{% endif %}")

THINK_1, THINK_2 = "<think>\nadd two and two\n</think>\n\nIt is 4.", "<think>\nadd again\n</think>\n\nIt is 6."
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": THINK_1},
     {"role": "user", "content": "And 3+3?"}, {"role": "assistant", "content": THINK_2}],
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Name a colour."},
     {"role": "assistant", "content": "Blue."}],
]

# What each style trains on, per assistant turn, in rendering order (written from the templates by hand).
EXPECTED = {
    "llama3": [[THINK_1 + "<|eot_id|>", THINK_2 + "<|eot_id|>"], ["Blue.<|eot_id|>"]],
    "qwen25": [[THINK_1 + "<|im_end|>", THINK_2 + "<|im_end|>"], ["Blue.<|im_end|>"]],
    "gemma": [[THINK_1 + "<end_of_turn>", THINK_2 + "<end_of_turn>"], ["Blue.<end_of_turn>"]],
    # earlier reasoning dropped from the render, so not trained on; the last turn keeps it
    "qwen3": [["It is 4.<|im_end|>", THINK_2 + "<|im_end|>"], ["<think>\n\n</think>\n\nBlue.<|im_end|>"]],
}
TEMPLATES = {"llama3": LLAMA3, "qwen25": QWEN25, "gemma": GEMMA, "qwen3": QWEN3}


def labelled_texts(encoder, ids, labels) -> tuple[str, list[str]]:
    """The rendered text and, per maximal run of labelled tokens, the text it covers (by character offsets)."""
    text = encoder.tokenizer.decode(ids)
    encoded = encoder.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    assert encoded["input_ids"] == ids.tolist()  # the offsets belong to these very tokens
    offsets = encoded["offset_mapping"]
    runs, start = [], None
    for k, label in enumerate([*labels.tolist(), IGNORE_INDEX]):
        if label != IGNORE_INDEX and start is None:
            start = k
        elif label == IGNORE_INDEX and start is not None:
            runs.append(text[offsets[start][0]:offsets[k - 1][1]])
            start = None
    return text, runs


@pytest.mark.parametrize("style", sorted(TEMPLATES))
def test_assistant_masks_of_each_template_style(tmp_path, style):
    encoder = ChatEncoder(tokenizer_with_template(tmp_path, TEMPLATES[style]))
    assert encoder.label_mode == "incremental"
    for turns, expected in zip(CONVERSATIONS, EXPECTED[style]):
        ids, labels = encoder.encode(turns)
        rendered = encoder.render(turns)
        text, runs = labelled_texts(encoder, ids, labels)
        assert text == rendered.removeprefix(encoder.tokenizer.bos_token or "") or text == rendered
        # each labelled run is one assistant turn's text as rendered (a token may carry the whitespace before it)
        assert [run.strip() for run in runs] == [e.strip() for e in expected], (style, runs)
        assert all(run.strip() in rendered for run in runs)
        # nothing else is labelled: the prompt, system prompt (injected or folded) and headers are not trained
        unlabelled = "".join(encoder.tokenizer.decode([t]) for t in ids[labels == IGNORE_INDEX])
        assert "Answer briefly." in unlabelled or "What is 2+2?" in unlabelled
        assert not any(e.strip() in unlabelled for e in expected)


def test_a_template_that_hides_the_assistant_text_is_a_counted_drop_saying_what_to_do(tmp_path):
    from tests.test_preprocess import run, write_jsonl

    encoder = ChatEncoder(tokenizer_with_template(tmp_path, SUMMARY))
    with pytest.raises(FormatError) as err:
        encoder.encode(CONVERSATIONS[0])
    assert err.value.reason == "template_not_incremental" and "generation" in str(err.value)
    data = write_jsonl(tmp_path / "chats.jsonl", [{"messages": turns} for turns in CONVERSATIONS])
    from data_tools.preprocessing.pipeline import PreprocessError

    with pytest.raises(PreprocessError, match=r"no sample kept out of 2 read \(template_not_incremental: 2\)"):
        run(tmp_path, [data], tokenizer=tokenizer_with_template(tmp_path / "t", SUMMARY), on_error="skip")


# Templates with generation markers, in the same styles: the batch encoder must equal transformers' own
# apply_chat_template(..., return_assistant_tokens_mask=True) token for token.
GENERATION_TEMPLATES = {
    "chatml": None,  # the shipped tokenizer's template
    "llama3": ("{{ bos_token }}{% for m in messages %}{{ '<|start_header_id|>' + m['role'] + '<|end_header_id|>\\n\\n' }}"
               "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] | trim + '<|eot_id|>' }}"
               "{% endgeneration %}{% else %}{{ m['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"),
    # a space before the answer that BPE merges into its first token; an empty generation block per turn
    "spaced": ("{% for m in messages %}{{ m['role'] + ':' }}{% if m['role'] == 'assistant' %}{% generation %}"
               "{{ ' ' + m['content'] }}{% endgeneration %}{% generation %}{% endgeneration %}{% else %}"
               "{{ ' ' + m['content'] }}{% endif %}{{ '\\n' }}{% endfor %}"),
    "rejecting": ("{% for m in messages %}{% if m['content'] == 'reject me' %}{{ raise_exception('no') }}{% endif %}"
                  "{{ m['role'] + ': ' }}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
                  "{% endgeneration %}{% else %}{{ m['content'] }}{% endif %}{{ '\\n' }}{% endfor %}"),
}


@pytest.mark.parametrize("style", sorted(GENERATION_TEMPLATES))
def test_batch_encoding_equals_apply_chat_template_with_assistant_masks(tmp_path, style):
    from data_tools.demo_data.synthetic_chats import generate
    from tests.test_preprocess import TOKENIZER

    template = GENERATION_TEMPLATES[style]
    encoder = ChatEncoder(TOKENIZER if template is None else tokenizer_with_template(tmp_path, template))
    assert encoder.label_mode == "generation"
    unicode = [{"role": "user", "content": "Ünïcode ✓ 日本語 🙂?"}, {"role": "assistant", "content": "🙂 ✓ 日本"}]
    empty = [{"role": "user", "content": "say nothing"}, {"role": "assistant", "content": ""}]
    rejected = [{"role": "user", "content": "reject me"}, {"role": "assistant", "content": "x"}]
    batch = [r["messages"] for r in generate(40, 512, seed=5)] + CONVERSATIONS + [unicode, empty, rejected]
    ids, labels, row_ptr, errors = encoder.encode_batch([Sample("messages", turns) for turns in batch])
    for i, turns in enumerate(batch):
        try:
            out = encoder.tokenizer.apply_chat_template(turns, chat_template=encoder.template, tokenize=True,
                                                        return_dict=True, return_assistant_tokens_mask=True)
        except Exception:  # noqa: BLE001 -- the rejecting template: a counted template_error, an empty row
            assert errors[i].reason == "template_error" and row_ptr[i] == row_ptr[i + 1]
            continue
        expected = np.where(np.asarray(out["assistant_masks"], bool), out["input_ids"], IGNORE_INDEX)
        assert ids[row_ptr[i]:row_ptr[i + 1]].tolist() == out["input_ids"], (style, i)
        assert labels[row_ptr[i]:row_ptr[i + 1]].tolist() == expected.tolist(), (style, i)
    assert set(errors) == ({len(batch) - 1} if style == "rejecting" else set())


@pytest.mark.parametrize("style", sorted(TEMPLATES))
def test_a_weight_0_turn_is_left_out_of_the_labels_in_each_template_style(tmp_path, style):
    """The first answer kept as context (untrained), the second trained exactly as before, in every style: found by
    prefixes (llama3, qwen25, gemma) or by substitution (qwen3, which rewrites earlier turns)."""
    encoder = ChatEncoder(tokenizer_with_template(tmp_path, TEMPLATES[style]))
    turns = CONVERSATIONS[0]
    ids, labels = encoder.encode(turns, untrained={1: "weight_0"})
    _text, runs = labelled_texts(encoder, ids, labels)
    assert [run.strip() for run in runs] == [EXPECTED[style][0][1].strip()]
    all_ids, all_labels = encoder.encode(turns)
    assert np.array_equal(ids, all_ids)  # the same tokens, fewer of them trained
    assert set(np.flatnonzero(labels != IGNORE_INDEX)) < set(np.flatnonzero(all_labels != IGNORE_INDEX))


def test_a_batch_of_every_kind_of_sample_equals_encoding_them_one_by_one():
    """encode_batch batches the plain conversations and encodes the others (weights, plain text, tools) one by one:
    the rows come back in order, each equal to encode_sample, the failures as errors with empty rows."""
    from data_tools.demo_data.synthetic_chats import generate
    from data_tools.preprocessing.formats import parse_record
    from tests.test_preprocess import TOKENIZER

    encoder = ChatEncoder(TOKENIZER)
    records = generate(6, 256, seed=7)
    first_answer = {**records[1]["messages"][1], "weight": 0}
    records[1] = {"messages": [records[1]["messages"][0], first_answer, *records[1]["messages"][2:]]}
    records[3] = {"text": "plain text"}
    records[4] = {"messages": records[4]["messages"], "tools": [{"type": "function", "function": {"name": "f"}}]}
    records.append({"prompt": "a", "completion": "b"})
    samples = [parse_record(r) for r in records]
    assert samples[1].untrained == {1: "weight_0"}
    ids, labels, row_ptr, errors = encoder.encode_batch(samples)
    assert set(errors) == {4} and errors[4].reason == "template_without_tools"
    for i, sample in enumerate(samples):
        row = slice(row_ptr[i], row_ptr[i + 1])
        if i in errors:
            assert row_ptr[i] == row_ptr[i + 1]
            continue
        expected_ids, expected_labels = encoder.encode_sample(sample)
        assert np.array_equal(ids[row], expected_ids) and np.array_equal(labels[row], expected_labels), i
