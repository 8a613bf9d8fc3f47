"""Export CLI: --help and one-line errors. (The round trip, ZeRO-2 and ZeRO-3 checkpoints to HF and logits equal to
the trained model's, runs where the checkpoints are made: tests/test_trainer.py and tests/test_trainer_dist.py.)"""

from __future__ import annotations

import json

import pytest

from hbp_train.common.errors import UserError
from hbp_train.export import main
from tests.cli_exit import exit_code


def test_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "--checkpoint" in text and "--out" in text and "--dtype" in text and "--adapter" in text


def test_not_a_checkpoint_is_one_line_exit_2(tmp_path, capsys):
    assert exit_code(main, ["--checkpoint", str(tmp_path), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("export error:") and "not a checkpoint" in err and "\n" not in err
    (tmp_path / "step_00000001").mkdir()
    assert exit_code(main, ["--checkpoint", str(tmp_path / "step_00000001"), "--out", str(tmp_path / "hf")]) == 2
    assert "no manifest.json" in capsys.readouterr().err  # a folder no save finished


def test_bad_out_is_one_line_exit_2(tmp_path, capsys):
    a_file = tmp_path / "file.txt"
    a_file.write_text("x")
    assert exit_code(main, ["--checkpoint", str(tmp_path), "--out", str(a_file)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"python -m hbp_train.export: error: --out: {a_file}: is a file, not a folder (give a folder path)"


def test_missing_or_untrained_checkpoint_says_why(tmp_path, capsys):
    assert exit_code(main, ["--checkpoint", str(tmp_path / "nope"), "--out", str(tmp_path / "hf")]) == 2
    assert f"--checkpoint: {tmp_path / 'nope'}: no such folder" in capsys.readouterr().err
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)  # a run that has not saved yet
    assert exit_code(main, ["--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"export error: {tmp_path / 'run' / 'checkpoints'}: no checkpoint saved yet") and "\n" not in err


def test_out_holding_another_model_is_refused(tmp_path, capsys):
    base = tmp_path / "base_model"
    base.mkdir()
    (base / "model.safetensors").write_bytes(b"weights")
    assert exit_code(main, ["--checkpoint", str(tmp_path), "--out", str(base)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"export error: --out {base}: directory is not empty") and "hbp_export.json" in err
    assert (base / "model.safetensors").read_bytes() == b"weights"
    (base / "hbp_export.json").write_text("{}")  # an earlier export may be replaced: the checkpoint is checked next
    assert exit_code(main, ["--checkpoint", str(tmp_path), "--out", str(base)]) == 2
    assert "not a checkpoint" in capsys.readouterr().err


def _checkpoint_with_hf(tmp_path, tokenizer_dir, tied):
    """A checkpoint tag folder holding only its hf/ part (config with use_cache=False as training saves it, and the
    tokenizer), plus the reference model whose weights the stand-in consolidation returns."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig

    from tests.assets.packed_fixture import TINY_LLAMA

    tag = tmp_path / "checkpoints" / "step_00000003"
    shutil.copytree(tokenizer_dir, tag / "hf")
    config = LlamaConfig(**{**TINY_LLAMA, "tie_word_embeddings": tied}, vocab_size=4096, use_cache=False)
    config.save_pretrained(tag / "hf")
    # As hbp_train/runtime/checkpoint.py saves it for a model built from a config: derived from the config, so with
    # LlamaConfig's default token ids (bos 1, eos 2), which are not the tokenizer's, and use_cache=False.
    GenerationConfig.from_model_config(config).save_pretrained(tag / "hf")
    _complete(tag)
    torch.manual_seed(0)
    return tag, AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def _complete(tag):
    """What a finished save adds: resume.json, the RNG file and the manifest over all of it."""
    import torch

    from hbp_train.runtime import checkpoint

    from hbp_train.runtime import manifest

    (tag / "resume.json").write_text(json.dumps({"next_step": 3, "world_size": 1}))
    torch.save(checkpoint.rng_state(), tag / "rng_rank0.pt")
    manifest.write(str(tag), 3, 1)


def test_a_damaged_checkpoint_is_one_line_naming_the_file(tmp_path, tokenizer_dir, capsys):
    tag, _ = _checkpoint_with_hf(tmp_path, tokenizer_dir, tied=True)
    (tag / "hf" / "config.json").write_text("{}")
    assert exit_code(main, ["--checkpoint", str(tag), "--out", str(tmp_path / "hf_out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{tag / 'hf' / 'config.json'} has 2 bytes, the manifest says" in err


def _consolidated(monkeypatch, reference, drop=()):
    """Stand in for DeepSpeed's ZeRO consolidation: the engine's names (``model.`` + HF name), fp32, as it would
    return them (a tied LM head is not stored separately)."""
    import deepspeed.utils.zero_to_fp32 as z2f

    state = {"model." + k: v.detach().clone().float() for k, v in reference.state_dict().items() if k not in drop}
    monkeypatch.setattr(z2f, "get_fp32_state_dict_from_zero_checkpoint", lambda root, tag=None: state)


def test_adapter_export_of_a_run_without_adapters_is_one_line_exit_2(tmp_path, tokenizer_dir, capsys):
    tag, _ = _checkpoint_with_hf(tmp_path, tokenizer_dir, tied=True)
    assert main(["--checkpoint", str(tag), "--out", str(tmp_path / "adapter"), "--adapter"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "trained without adapters (model.lora.r=0)" in err
    assert not (tmp_path / "adapter").exists()  # refused before anything is written


def test_export_of_a_tied_model_enables_the_cache_and_reloads_the_same_weights(tmp_path, tokenizer_dir, monkeypatch):
    import torch
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hbp_train.export import MARKER, export

    tag, reference = _checkpoint_with_hf(tmp_path, tokenizer_dir, tied=True)
    _consolidated(monkeypatch, reference, drop=("lm_head.weight",))
    out = tmp_path / "hf_out"
    out.mkdir()  # an empty folder is as good as a new one
    export(str(tag), str(out))
    saved = json.loads((out / "config.json").read_text())
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert saved["use_cache"] is True
    # Training teaches the model to end its answer with ChatML's <|im_end|>; eos (<|endoftext|>) stops text.
    stops = [tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert (saved["eos_token_id"], saved["pad_token_id"]) == (stops, tokenizer.pad_token_id)
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["eos_token_id"], generation["bos_token_id"]) == (stops, tokenizer.bos_token_id)
    assert generation["use_cache"] is True
    assert json.loads((out / MARKER).read_text()) == {"checkpoint": str(tag), "dtype": "fp32", "adapter": False}
    loaded = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    ids = torch.arange(1, 20)[None]
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, reference(ids).logits)
    assert torch.equal(loaded.lm_head.weight, reference.model.embed_tokens.weight)
    export(str(tag), str(out), dtype="bf16")  # an earlier export may be replaced
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}
    assert json.loads((out / MARKER).read_text())["dtype"] == "bf16"


def test_export_of_an_untied_model_missing_its_head_is_refused(tmp_path, tokenizer_dir, monkeypatch):
    from hbp_train.export import export

    tag, reference = _checkpoint_with_hf(tmp_path, tokenizer_dir, tied=False)
    _consolidated(monkeypatch, reference, drop=("lm_head.weight",))
    with pytest.raises(UserError, match=r"weights do not match the model config \(missing \['lm_head.weight'\]"):
        export(str(tag), str(tmp_path / "hf_out"))
    assert not (tmp_path / "hf_out" / "model.safetensors").exists()


def _always_ends_its_turn(model, end_id: int) -> None:
    """Make ``model`` predict ``end_id`` after any prompt: every token gets the same embedding, so every position
    has the same final hidden state h, and the LM head row of ``end_id`` is set to score h far above the rest."""
    import torch

    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight[5].expand_as(
            model.model.embed_tokens.weight))
        h = model.model(input_ids=torch.tensor([[7, 8, 9]])).last_hidden_state[0, -1]
        model.lm_head.weight[end_id] = 50.0 * h / h.norm() ** 2


def test_exported_model_stops_generating_at_the_end_of_its_turn(tmp_path, tokenizer_dir, monkeypatch):
    """generate() with the exported generation config ends the answer at <|im_end|>; with eos alone (what the
    export wrote before) the same model runs on to max_new_tokens."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hbp_train.export import export

    tag, reference = _checkpoint_with_hf(tmp_path, tokenizer_dir, tied=False)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    _always_ends_its_turn(reference, im_end)
    _consolidated(monkeypatch, reference)
    out = tmp_path / "hf_out"
    export(str(tag), str(out))

    model = AutoModelForCausalLM.from_pretrained(out)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "Repeat these words: ba de"}],
                                           add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        answer = model.generate(**prompt, max_new_tokens=12, do_sample=False)[0, prompt["input_ids"].shape[1]:]
        eos_only = model.generate(**prompt, max_new_tokens=12, do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                  pad_token_id=tokenizer.pad_token_id)[0, prompt["input_ids"].shape[1]:]
    assert answer.tolist() == [im_end]
    assert eos_only.tolist() == [im_end] * 12


def test_export_keeps_the_base_generation_config(tmp_path, tokenizer_dir, monkeypatch):
    """A base model's own generation config (not derived from its config) keeps its sampling settings and eos
    list; eos and <|im_end|> are added once."""
    from transformers import AutoTokenizer, GenerationConfig

    from hbp_train.export import export

    tag, reference = _checkpoint_with_hf(tmp_path, tokenizer_dir, tied=False)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    GenerationConfig(do_sample=True, temperature=0.6, top_p=0.9, eos_token_id=[77, im_end]).save_pretrained(tag / "hf")
    _complete(tag)  # the manifest covers the replaced generation config
    _consolidated(monkeypatch, reference)
    export(str(tag), str(tmp_path / "hf_out"))
    saved = GenerationConfig.from_pretrained(tmp_path / "hf_out")
    assert (saved.do_sample, saved.temperature, saved.top_p) == (True, 0.6, 0.9)
    assert saved.eos_token_id == [77, im_end, tokenizer.eos_token_id]
    assert saved.pad_token_id == tokenizer.pad_token_id


@pytest.mark.parametrize("template, expected", [
    (None, "<|im_end|>"),  # no template: data_tools.preprocess trained with its default ChatML template
    ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|pad|>\n{% endfor %}", "<|pad|>"),
    ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}", None),  # plain text ends a turn
])
def test_end_of_turn_token_is_read_from_the_chat_template(tokenizer_dir, template, expected):
    from transformers import AutoTokenizer

    from hbp_train.export import end_of_turn_ids

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = template
    assert end_of_turn_ids(tokenizer) == ([] if expected is None else [tokenizer.convert_tokens_to_ids(expected)])
