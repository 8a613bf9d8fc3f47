"""Offline needle-in-a-haystack check: the samples of ``eval/tasks/needle.py`` scored on a loaded model.

Each sample's prompt is the user turn rendered with the model's chat template followed by the answer prefix
"The special magic number for <key> is" (as RULER does), so the next tokens should be the value. Two scores per
sample:

- **loglik**: the summed log-likelihood of " <value>" against ``num_distractors`` random values that split into
  the same number of tokens (``eval/tasks/needle.py`` draws them so: with a tokenizer that merges digits, a value of
  fewer tokens would otherwise win for that alone); correct when the true value scores strictly highest. Cheap and
  informative even for tiny models. Chance is 1 / (num_distractors + 1), and ``baseline_needle`` measures it: the
  same samples scored by the model's config with random weights (or by a base model).
- **greedy**: greedy decoding until an end token or ``max_new_tokens``; correct when the first number in the
  output equals the value.

The prompt is encoded once; the KV cache the model returns is handed to every later call under the keyword its
``forward`` names it by (``cache`` in recent transformers, ``past_key_values`` before); every candidate and the
greedy loop continue from it, and it is cropped back afterwards, so a sample costs one prefill plus a few short
decodes. The OpenCompass suite (``eval/suite.py``) asks the same samples without the answer prefix.
"""

from __future__ import annotations

import inspect
import re
import warnings

import torch
from tqdm import tqdm

from eval.tasks.needle import NeedleConfig, NeedleSample, candidate_tokens, generate_samples


def _cache_keyword(model) -> str:
    """The keyword ``model.forward`` takes its KV cache by, and the name of the output field holding it:
    transformers renamed ``past_key_values`` to ``cache`` (the old name still works there, with a deprecation
    warning)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@torch.inference_mode()
def score_sample(model, tokenizer, sample: NeedleSample, max_new_tokens: int, stop_ids: set[int]) -> dict:
    """``{"loglik_correct", "greedy_correct", "greedy_text", "logliks"}`` for one sample (see the module doc)."""
    candidates = [candidate_tokens(tokenizer, c) for c in [sample.value, *sample.distractors]]
    if len({len(ids) for ids in candidates}) > 1:  # generate_samples never makes such a sample
        raise ValueError(f"needle sample {sample.value}: candidates of {sorted({len(i) for i in candidates})} tokens; "
                         "summed log-likelihoods compare only candidates of equal token counts")
    device = next(model.parameters()).device
    prompt = torch.tensor([sample.prompt_ids], device=device)
    # logits_to_keep=1: only the last position's logits, not [T, vocab] for a long prompt. The model makes the
    # cache its layers need (a hybrid model's is not a plain KV cache).
    out = model(input_ids=prompt, use_cache=True, logits_to_keep=1)
    keyword = _cache_keyword(model)  # the output's field has the same name
    cache = getattr(out, keyword)
    past = {keyword: cache, "use_cache": True}
    last_logprobs = out.logits[0, -1].float().log_softmax(-1)

    logliks = []
    for ids in candidates:
        total = last_logprobs[ids[0]]
        if len(ids) > 1:
            step = model(input_ids=torch.tensor([ids[:-1]], device=device), **past)
            logprobs = step.logits[0].float().log_softmax(-1)
            targets = torch.tensor(ids[1:], device=device)
            total = total + logprobs[torch.arange(len(ids) - 1, device=device), targets].sum()
            # A negative crop removes that many tokens (the positive form changed meaning across versions).
            cache.crop(-(len(ids) - 1))
        logliks.append(float(total))
    loglik_correct = logliks[0] > max(logliks[1:])

    generated: list[int] = []
    next_id = int(last_logprobs.argmax())
    for _ in range(max_new_tokens):
        if next_id in stop_ids:
            break
        generated.append(next_id)
        step = model(input_ids=torch.tensor([[next_id]], device=device), **past)
        next_id = int(step.logits[0, -1].argmax())
    text = tokenizer.decode(generated, skip_special_tokens=True)
    match = re.search(r"\d+", text)
    greedy_correct = match is not None and match.group(0) == sample.value
    return {"loglik_correct": bool(loglik_correct), "greedy_correct": bool(greedy_correct),
            "greedy_text": text, "logliks": logliks}


def run_needle(model, tokenizer, config: NeedleConfig, stop_ids: set[int], max_new_tokens: int = 16,
               progress: bool = True, samples: list[NeedleSample] | None = None) -> dict:
    """Run the sweep (``samples`` from ``generate_samples`` if already made); returns per-cell and overall
    accuracies (JSON-ready). ``max_new_tokens`` is the greedy-decoding budget per sample."""
    max_positions = getattr(model.config, "max_position_embeddings", None)
    if max_positions and max(config.lengths) > max_positions:
        warnings.warn(f"--lengths: {max(config.lengths)} exceeds the model's max_position_embeddings "
                      f"({max_positions}); results there measure extrapolation", stacklevel=2)
    if samples is None:
        samples = generate_samples(tokenizer, config)
    results = [score_sample(model, tokenizer, s, max_new_tokens, stop_ids)
               for s in tqdm(samples, desc="needle", unit="sample", disable=None if progress else True)]

    cells = []
    for length in config.lengths:
        for depth in config.depths:
            picked = [(s, r) for s, r in zip(samples, results) if s.length == length and s.depth == depth]
            cells.append({
                "length": length,
                "depth": depth,
                "trials": len(picked),
                "mean_tokens": sum(len(s.prompt_ids) for s, _ in picked) / len(picked),
                "loglik_acc": sum(r["loglik_correct"] for _, r in picked) / len(picked),
                "greedy_acc": sum(r["greedy_correct"] for _, r in picked) / len(picked),
            })
    examples = [{"length": s.length, "tokens": len(s.prompt_ids), "depth": s.depth, "value": s.value,
                 "greedy_text": r["greedy_text"]}
                for s, r in list(zip(samples, results))[:: max(1, len(samples) // 5)]]
    return {
        "lengths": config.lengths,
        "depths": config.depths,
        "trials": config.trials,
        "num_distractors": config.num_distractors,
        "seed": config.seed,
        "chance_loglik_acc": 1.0 / (config.num_distractors + 1),
        "value_tokens": sorted({s.value_tokens for s in samples}),
        "loglik_acc": sum(r["loglik_correct"] for r in results) / len(results),
        "greedy_acc": sum(r["greedy_correct"] for r in results) / len(results),
        "cells": cells,
        "examples": examples,
    }


def baseline_needle(model, tokenizer, config: NeedleConfig, stop_ids: set[int], samples: list[NeedleSample],
                    label: str, max_new_tokens: int = 16, progress: bool = True) -> dict:
    """The same samples scored by a reference model: the untrained one (the model's config, random weights) or a
    base model. What the evaluated model's scores are read against: the untrained model's loglik_acc measures the
    chance level rather than assuming it. ``{"model": label, "loglik_acc", "greedy_acc", "cells"}``."""
    scored = run_needle(model, tokenizer, config, stop_ids, max_new_tokens=max_new_tokens, progress=progress,
                        samples=samples)
    return {"model": label, "loglik_acc": scored["loglik_acc"], "greedy_acc": scored["greedy_acc"],
            "cells": [{k: c[k] for k in ("length", "depth", "loglik_acc", "greedy_acc")} for c in scored["cells"]]}
