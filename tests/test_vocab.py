"""hbp_train/batches/vocab.py: preprocessing records the tokenizer that made a data set, pack carries the record into the
packed shards, and the trainer refuses data the model would read with other token ids, before any weight is
loaded (a 2000-token model on data of a 4096-token tokenizer used to be resized silently)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from hbp_train.common.errors import UserError
from hbp_train.batches.vocab import identity, vocab_to_build


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


def test_identity_tells_tokenizers_apart(tokenizer, tokenizer_dir):
    from transformers import AutoTokenizer

    same = AutoTokenizer.from_pretrained(tokenizer_dir)
    assert identity(same, "a") == {**identity(tokenizer, "a")} and identity(tokenizer, "a")["size"] == 4096
    same.add_tokens(["<|tool|>"])
    grown = identity(same, "a")
    assert grown["size"] == 4097 and grown["sha256"] != identity(tokenizer, "a")["sha256"]


def _model_cfg(name_or_path="/models/mine", resize_vocab=False, tokenizer="/models/mine"):
    return SimpleNamespace(name_or_path=name_or_path, resize_vocab=resize_vocab, tokenizer=tokenizer)


def test_vocab_to_build_refuses_ids_the_model_lacks_unless_asked_to_grow(tokenizer):
    record = {**identity(tokenizer, "/models/mine"), "max_token_id": 4000}
    data = {"data.shards": record}
    # A model built from scratch gets the tokenizer's vocabulary; a pretrained one that holds every id keeps its own.
    assert vocab_to_build(_model_cfg(name_or_path=None), tokenizer, 32000, data) == (4096, None)
    assert vocab_to_build(_model_cfg(), tokenizer, 4096, data) == (None, None)
    assert vocab_to_build(_model_cfg(), tokenizer, 4001, data) == (None, None)  # ids up to 4000: enough
    with pytest.raises(UserError, match=r"data.shards holds token id 4000, but the model's vocabulary "
                                        r"\(/models/mine/config.json vocab_size\) has 2000 ids.*--tokenizer "
                                        r"/models/mine.*model.resize_vocab=true") as err:
        vocab_to_build(_model_cfg(), tokenizer, 2000, data)
    assert "\n" not in str(err.value)
    size, line = vocab_to_build(_model_cfg(resize_vocab=True), tokenizer, 2000, data)
    assert size == 4096 and "grow from 2000 to 4096 rows" in line
    # Shards without a record (packed elsewhere, or before the record existed): every id the tokenizer makes.
    with pytest.raises(UserError, match="model.tokenizer=/models/mine has 4096 tokens"):
        vocab_to_build(_model_cfg(), tokenizer, 2000, {"data.shards": None})


def test_data_of_another_tokenizer_is_refused_naming_both(tokenizer, tokenizer_dir):
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(tokenizer_dir)
    other.add_tokens(["<|tool|>"])
    record = {**identity(other, "/data/tok-other"), "max_token_id": 12}
    with pytest.raises(UserError, match=r"data.eval_shards: tokenized with /data/tok-other \(4097 tokens\), but "
                                        r"model.tokenizer=/models/mine is another tokenizer \(4096 tokens\)"):
        vocab_to_build(_model_cfg(), tokenizer, 32000, {"data.shards": None, "data.eval_shards": record})


def _chats(path, n=24):
    from data_tools.demo_data.synthetic_chats import generate

    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in generate(n, max_tokens=200, seed=2))


def test_preprocess_records_the_tokenizer_and_pack_carries_it(tmp_path, tokenizer, tokenizer_dir):
    import datasets
    import numpy as np

    from data_tools import pack, preprocess
    from hbp_train.batches.loader import PackedData

    _chats(tmp_path / "chats.jsonl")
    assert preprocess.main(["--input", str(tmp_path / "chats.jsonl"), "--output", str(tmp_path / "tok"),
                            "--tokenizer", str(tokenizer_dir)]) == 0
    report = json.loads((tmp_path / "tok" / "report.json").read_text())
    ids = datasets.load_from_disk(str(tmp_path / "tok"))["input_ids"]
    assert report["max_token_id"] == max(max(row) for row in ids)
    assert report["tokenizer_identity"] == identity(tokenizer, str(tokenizer_dir))
    for fmt in ("json", "npz"):
        out = tmp_path / f"packed_{fmt}"
        assert pack.main(["--dataset", str(tmp_path / "tok"), "--shards", str(out), "--world-size", "1", "--groups",
                          "512:1", "--plan-format", fmt, "--quiet"]) == 0
        carried = PackedData(str(out)).plan["tokenizer"]
        assert carried == {**report["tokenizer_identity"], "max_token_id": report["max_token_id"]}
        assert np.int64(carried["max_token_id"]) < 4096


def test_a_smaller_vocabulary_model_is_refused_before_its_weights_load(tmp_path, tokenizer_dir, monkeypatch):
    """The issue's case: a 2000-token model (its own folder, the data's 4096-token tokenizer saved beside it) on
    data tokenized with that tokenizer. The build stops in one line before any weight is read."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from data_tools import pack, preprocess
    from hbp_train import build, config
    from hbp_train.model import hf_model as model

    model_dir = tmp_path / "small-vocab"
    AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "qwen2", hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=2000)).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(model_dir)
    _chats(tmp_path / "chats.jsonl")
    assert preprocess.main(["--input", str(tmp_path / "chats.jsonl"), "--output", str(tmp_path / "tok"),
                            "--tokenizer", str(model_dir)]) == 0
    assert pack.main(["--dataset", str(tmp_path / "tok"), "--shards", str(tmp_path / "packed"), "--world-size", "1",
                      "--groups", "512:1", "--quiet"]) == 0
    monkeypatch.setattr(model, "build_model", lambda *a, **k: pytest.fail("read the weights first"))
    given = [f"model.name_or_path={model_dir}", f"data.shards={tmp_path / 'packed'}", f"train.out_dir={tmp_path}/r"]
    with pytest.raises(UserError, match=r"data.shards holds token id \d+, but the model's vocabulary .* has 2000 ids"):
        build.build(config.load(given))
