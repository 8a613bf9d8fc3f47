"""Which tokenizer made a data set, and the check that the model reads the same token ids (before weights load).

Token ids mean words only under the tokenizer that made them. Preprocessing records its tokenizer in the tokenized
set's report.json (``identity``: its path, its size and a fingerprint of its vocabulary, plus the largest token id
the data holds); ``data_tools.pack --dataset`` copies that into the packed shards' plan ("tokenizer"); the trainer
compares it with model.tokenizer and with the model's vocabulary (``vocab_to_build``) before any weight is read:

* another tokenizer (another fingerprint): refused, the ids would name other tokens;
* a token id the pretrained model's embeddings do not hold (its vocabulary smaller than the data's largest id, or
  than the tokenizer when the data records none): refused, unless model.resize_vocab=true grows the embeddings
  for tokens added to the tokenizer on purpose (then said in one line);
* a model built from scratch always gets the tokenizer's vocabulary (model.build_model).

Plans written before the record existed carry none: then only the tokenizer's own size is checked.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Optional

from hbp_train.common.errors import UserError


def identity(tokenizer, path: str) -> dict:
    """What identifies a tokenizer: its folder, its size (len: added tokens included) and a fingerprint of its
    vocabulary (token -> id, added tokens included)."""
    vocab = sorted(tokenizer.get_vocab().items())
    digest = hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode("utf-8")).hexdigest()[:16]
    return {"path": str(path), "size": len(tokenizer), "sha256": digest}


def data_record(tokenizer, path: str, dataset) -> dict:
    """What preprocessing adds to a tokenized set's report.json: the identity of the tokenizer that made it and the
    largest token id in it (one pass over the memory-mapped input_ids column)."""
    import pyarrow.compute as pc

    max_id = pc.max(pc.list_flatten(dataset.data.column("input_ids"))).as_py()
    return {"tokenizer_identity": identity(tokenizer, path), "max_token_id": max_id}


def recorded_tokenizer(dataset_dir: str) -> Optional[dict]:
    """The tokenizer record of a tokenized set (its report.json, written by data_tools.preprocess), or None for a
    set without one (made elsewhere, or before the record existed)."""
    try:
        report = json.loads(Path(dataset_dir, "report.json").read_text())
    except (OSError, ValueError):
        return None
    record = report.get("tokenizer_identity") if isinstance(report, dict) else None
    if not isinstance(record, dict) or "sha256" not in record:
        return None
    return {**record, "max_token_id": report.get("max_token_id")}


def vocab_to_build(model_cfg, tokenizer, model_vocab: int, records: dict) -> tuple[Optional[int], Optional[str]]:
    """(the vocabulary to build the model with, a line to print or None); UserError when the data cannot be read
    by this model. ``model_vocab``: the vocab_size of the model's config (no resize); ``records``: {field naming the
    data (data.shards / data.eval_shards): its plan's tokenizer record or None}. The first value goes to
    build_model's vocab_size: the tokenizer's size to build a new model or grow a pretrained one, None to keep a
    pretrained model's own."""
    mine = identity(tokenizer, model_cfg.tokenizer)
    max_ids = []  # (the largest id, the field of the data holding it)
    for field, record in records.items():
        if not record:
            continue
        if record.get("sha256") != mine["sha256"]:
            raise UserError(f"{field}: tokenized with {record.get('path')} ({record.get('size')} tokens), but "
                            f"model.tokenizer={model_cfg.tokenizer} is another tokenizer ({mine['size']} tokens): its "
                            f"ids name other tokens; re-run data_tools.preprocess --tokenizer {model_cfg.tokenizer} "
                            f"and pack again, or set model.tokenizer={record.get('path')}")
        if record.get("max_token_id") is not None:
            max_ids.append((int(record["max_token_id"]), field))
    if model_cfg.name_or_path is None:
        return len(tokenizer), None
    if model_cfg.resize_vocab and len(tokenizer) > model_vocab:
        return len(tokenizer), (f"[train] model.resize_vocab: the embeddings and LM head of {model_cfg.name_or_path} "
                                f"grow from {model_vocab} to {len(tokenizer)} rows (the tokenizer's); the new rows "
                                "start untrained")
    # What the embeddings must hold: the data's ids (without a record, every id the tokenizer makes) and the pad id,
    # which empty (dummy) micro-batches are made of.
    pad = tokenizer.pad_token_id
    if max_ids and max(max_ids)[0] >= model_vocab:
        what = f"{max(max_ids)[1]} holds token id {max(max_ids)[0]}"
    elif pad is not None and pad >= model_vocab:
        what = f"model.tokenizer={model_cfg.tokenizer}'s pad token is id {pad} (empty micro-batches are made of it)"
    elif not max_ids and len(tokenizer) > model_vocab:
        what = f"model.tokenizer={model_cfg.tokenizer} has {len(tokenizer)} tokens"
    else:
        return None, None
    raise UserError(f"{what}, but the model's vocabulary ({model_cfg.name_or_path}/config.json vocab_size) has "
                    f"{model_vocab} ids: is the data tokenized with the model's own tokenizer? Re-run "
                    f"data_tools.preprocess --tokenizer {model_cfg.name_or_path}, or, for tokens added to the "
                    "tokenizer on purpose, set model.resize_vocab=true to grow the embeddings")
