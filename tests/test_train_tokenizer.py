"""Tests for data_tools.train_tokenizer and the tokenizer shipped in data_tools/assets/tokenizer/."""

from __future__ import annotations

from data_tools.demo_data.bpe_tokenizer import BOS, EOS, IM_END, IM_START, PAD, train
from data_tools.train_tokenizer import main
from tests.cli_exit import exit_code


def test_training_is_deterministic_and_reproduces_the_shipped_files(tmp_path, tokenizer_dir):
    out = train(tmp_path / "tok")
    shipped = sorted(p.name for p in tokenizer_dir.iterdir())
    assert sorted(p.name for p in out.iterdir()) == shipped
    for name in shipped:
        assert (out / name).read_bytes() == (tokenizer_dir / name).read_bytes(), name
    assert sum((tokenizer_dir / name).stat().st_size for name in shipped) < 1_000_000


def test_shipped_tokenizer_loads_offline_with_specials_and_assistant_mask(tokenizer_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir), local_files_only=True)
    assert len(tokenizer) == 4096
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (BOS, EOS, PAD)
    assert tokenizer.convert_tokens_to_ids([BOS, EOS, PAD, IM_START, IM_END]) == [0, 1, 2, 3, 4]
    assert tokenizer("babo kas")["input_ids"][0] != tokenizer.bos_token_id  # plain text gets no specials
    text = "Sort these words: zed abo, then 12 ünïcödé!"
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text  # byte-level: any text round-trips

    messages = [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "Repeat: babo"},
                {"role": "assistant", "content": "babo"}, {"role": "user", "content": "Reverse: a b"},
                {"role": "assistant", "content": "b a"}]
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = out["input_ids"], out["assistant_masks"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode([i for i, m in zip(ids, mask) if m]) == f"babo{IM_END}b a{IM_END}"
    prompt = tokenizer.apply_chat_template(messages[:2], tokenize=False, add_generation_prompt=True)
    assert prompt == (f"{BOS}{IM_START}system\nBe exact.{IM_END}\n{IM_START}user\nRepeat: babo{IM_END}\n"
                      f"{IM_START}assistant\n")


def test_cli_bad_arguments_are_one_line_exit_2(tmp_path, capsys):
    assert exit_code(main, ["--out", str(tmp_path / "tok"), "--vocab-size", "10"]) == 2
    assert "--vocab-size: 10 is out of range (give a whole number in [300, 1048576])" in capsys.readouterr().err
    # A huge size would make the Rust trainer abort the process on its up-front allocation.
    assert exit_code(main, ["--out", str(tmp_path / "tok"), "--vocab-size", "99999999999"]) == 2
    assert "--vocab-size: 99999999999 is out of range" in capsys.readouterr().err
    assert not (tmp_path / "tok").exists()
    taken = tmp_path / "file"
    taken.write_text("x")
    assert exit_code(main, ["--out", str(taken)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith(f"error: --out: {taken}: is a file, not a folder (give a folder path)") and "\n" not in err
