"""Held-out loss and perplexity of a model on a tokenized dataset (the ``data_tools.preprocess`` format).

Token-weighted over label tokens only: ``loss = sum of -log p(label) over every target / number of targets``,
where the targets follow the HF convention of the tokenized format (``labels`` unshifted, position ``t`` predicts
``labels[t + 1]``, ``-100`` = not scored), and ``perplexity = exp(loss)``. This is the same normalization as the
trainer's token loss, so the numbers are comparable with training curves.

Each sample runs alone (no padding, no cross-sample attention). The LM head is applied only to the positions that
have a target, in chunks, so a long sample never materializes a ``[T, vocab]`` logits tensor.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from hbp_train.common.errors import UserError
from hbp_train.common.labels import IGNORE_INDEX

REQUIRED_COLUMNS = ("input_ids", "labels")
# Config fields that change logits after the LM head; models with any of them take the plain forward path.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale")


def load_tokenized(dataset_dir: Path):
    """The tokenized dataset at ``dataset_dir`` (``save_to_disk`` format); one-line error if it is not one."""
    from datasets import DatasetDict, load_from_disk

    dataset_dir = Path(dataset_dir).expanduser().resolve()
    if not dataset_dir.is_dir():
        raise UserError(f"--dataset {dataset_dir}: no such directory; pass a data_tools.preprocess output directory")
    try:
        dataset = load_from_disk(str(dataset_dir))
    except (FileNotFoundError, ValueError, OSError) as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise UserError(f"--dataset {dataset_dir}: not an HF dataset saved with save_to_disk ({first})") from None
    if isinstance(dataset, DatasetDict):
        raise UserError(f"--dataset {dataset_dir}: is a DatasetDict; pass one split's directory")
    missing = [c for c in REQUIRED_COLUMNS if c not in dataset.column_names]
    if missing:
        raise UserError(f"--dataset {dataset_dir}: missing column(s) {', '.join(missing)}; "
                         f"expected the data_tools.preprocess format (input_ids, labels, ...)")
    if len(dataset) == 0:
        raise UserError(f"--dataset {dataset_dir}: has no rows")
    return dataset


def _uses_plain_forward(model) -> bool:
    config = model.config
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in _LOGIT_TRANSFORMS):
        return True
    return model.get_output_embeddings() is None


@torch.inference_mode()
def sample_nll(model, input_ids: torch.Tensor, labels: torch.Tensor, chunk_size: int = 4096) -> tuple[float, int]:
    """``(summed negative log-likelihood, number of targets)`` of one unpadded sample (1-D tensors)."""
    targets = labels[1:]
    scored = targets != IGNORE_INDEX
    num_targets = int(scored.sum())
    if num_targets == 0:
        return 0.0, 0
    if _uses_plain_forward(model):
        logits = model(input_ids=input_ids[None]).logits[0, :-1].float()
        return float(F.cross_entropy(logits[scored], targets[scored], reduction="sum")), num_targets
    hidden = model.get_decoder()(input_ids=input_ids[None]).last_hidden_state[0, :-1][scored]
    lm_head = model.get_output_embeddings()
    wanted = targets[scored]
    total = 0.0
    for start in range(0, num_targets, chunk_size):
        logits = lm_head(hidden[start:start + chunk_size]).float()
        total += float(F.cross_entropy(logits, wanted[start:start + chunk_size], reduction="sum"))
    return total, num_targets


def run_perplexity(model, dataset_dir: Path, max_samples: int | None = None, progress: bool = True) -> dict:
    """Token-weighted loss and perplexity over (the first ``max_samples`` rows of) the dataset."""
    dataset = load_tokenized(dataset_dir)
    num_rows = len(dataset)
    if max_samples is not None and max_samples < num_rows:
        dataset = dataset.select(range(max_samples))
    device = next(model.parameters()).device
    total_nll, total_targets, skipped = 0.0, 0, 0
    columns = dataset.select_columns(list(REQUIRED_COLUMNS)).with_format("numpy")
    for row in tqdm(columns, total=len(columns), desc="perplexity", unit="sample", disable=None if progress else True):
        input_ids = torch.from_numpy(np.asarray(row["input_ids"], dtype=np.int64)).to(device)
        labels = torch.from_numpy(np.asarray(row["labels"], dtype=np.int64)).to(device)
        if input_ids.shape != labels.shape:
            raise UserError(f"--dataset {dataset_dir}: a row has {len(input_ids)} input_ids but {len(labels)} labels")
        nll, count = sample_nll(model, input_ids, labels)
        if count == 0:
            skipped += 1  # no trainable target: contributes nothing to a token mean; counted so it is not lost
        total_nll += nll
        total_targets += count
    if total_targets == 0:
        raise UserError(f"--dataset {dataset_dir}: no row has a label token (labels all -100)")
    loss = total_nll / total_targets
    return {
        "dataset": str(Path(dataset_dir).expanduser().resolve()),
        "num_rows": num_rows,
        "num_samples": len(columns),
        "num_samples_without_targets": skipped,
        "num_loss_tokens": total_targets,
        "loss": loss,
        "perplexity": math.exp(loss),
    }
