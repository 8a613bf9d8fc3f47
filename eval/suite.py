"""The offline OpenCompass suite: our generated tasks written in OpenCompass's own dataset format.

``--datasets offline`` (or any of ``needle``, ``multikey``, ``variable_tracking``, ``demo_qa``) runs tasks that need
no download: each generator in ``eval/tasks/`` makes rows ``{"prompt", "answer": [...], ...}`` with the model's
tokenizer, and this module writes them as ``OUT/suite/<task>.jsonl`` plus a dataset config
``OUT/suite/<task>_gen.py`` (OpenCompass's ``CustomDataset`` reading that file, a zero-shot ``GenInferencer`` with the
user turn as the prompt, and OpenCompass's own evaluator). The run config imports them like any stock dataset.

| task | rows | evaluator (OpenCompass) | score |
|---|---|---|---|
| ``needle`` | lengths × depths × trials | ``RulerNiahEvaluator`` | % of samples whose answer contains the value |
| ``multikey`` | lengths × depths × trials, 4 keys | ``RulerNiahEvaluator`` | the same, asked for one of 4 keys |
| ``variable_tracking`` | lengths × depths × trials | ``RulerVtEvaluator`` | % of the chain's names in the answer |
| ``demo_qa`` | ``--qa-samples`` | ``EMEvaluator`` | % of exact answers |

OpenCompass reports one score per dataset; ``breakdown`` re-scores its saved predictions with the same rule to
split it by length and depth (needle) or by kind of question (demo QA), for the results table and heatmap.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

SUITE = ("needle", "multikey", "variable_tracking", "demo_qa")
ABBR_PREFIX = "hbp_"  # dataset names in OpenCompass's tables: hbp_needle, ...
MULTIKEY_KEYS = 4


@dataclass(frozen=True)
class TaskSpec:
    """How a generated task runs in OpenCompass."""

    evaluator_module: str
    evaluator: str
    rule: str
    """``contains`` (RULER's string match) or ``exact`` (EMEvaluator); ``breakdown`` re-scores with it."""
    max_out_len: int
    """Tokens an answer needs (the model's ``--max-out-len`` does not apply to these tasks)."""
    group_by: tuple[str, ...]
    """Row fields the breakdown groups scores by."""


TASKS = {
    "needle": TaskSpec("opencompass.datasets.ruler.ruler_niah", "RulerNiahEvaluator", "contains", 32,
                       ("length", "depth")),
    "multikey": TaskSpec("opencompass.datasets.ruler.ruler_niah", "RulerNiahEvaluator", "contains", 32,
                         ("length", "depth")),
    "variable_tracking": TaskSpec("opencompass.datasets.ruler.ruler_vt", "RulerVtEvaluator", "contains", 64,
                                  ("length",)),
    "demo_qa": TaskSpec("opencompass.openicl.icl_evaluator", "EMEvaluator", "exact", 48, ("kind",)),
}


@dataclass
class SuiteConfig:
    """Sizes of the generated tasks."""

    lengths: list[int] = field(default_factory=lambda: [256, 512, 1024])
    """Prompt lengths in tokens of the long-context tasks."""
    depths: list[float] = field(default_factory=lambda: [0.0, 0.25, 0.5, 0.75, 1.0])
    """Needle depths (0 = start of the haystack, 1 = end)."""
    trials: int = 2
    """Samples per (length, depth) cell; variable tracking draws as many per length as a needle length has."""
    qa_samples: int = 40
    """Questions in the demo QA set."""
    seed: int = 0
    """Seed of every generator."""


@dataclass(frozen=True)
class SuiteDataset:
    """One generated task as written for OpenCompass."""

    name: str
    abbr: str
    jsonl: Path
    config: Path
    variable: str
    num_rows: int


def generate(tokenizer, name: str, config: SuiteConfig) -> list[dict]:
    """The rows of task ``name``."""
    if name in ("needle", "multikey"):
        from eval.tasks.needle import NeedleConfig, generate_samples, to_record

        needle = NeedleConfig(lengths=config.lengths, depths=config.depths, trials=config.trials, seed=config.seed,
                              num_keys=1 if name == "needle" else MULTIKEY_KEYS)
        return [to_record(s) for s in generate_samples(tokenizer, needle)]
    if name == "variable_tracking":
        from eval.tasks.variable_tracking import VariableTrackingConfig, generate_records

        return generate_records(tokenizer, VariableTrackingConfig(
            lengths=config.lengths, samples_per_length=config.trials * len(config.depths), seed=config.seed))
    if name == "demo_qa":
        from eval.tasks.demo_qa import DemoQAConfig, generate_records

        return generate_records(tokenizer, DemoQAConfig(num_samples=config.qa_samples, seed=config.seed))
    raise AssertionError(name)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    """Rows as JSON lines, the format OpenCompass's ``CustomDataset`` reads."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    return path


def dataset_config(name: str, jsonl: Path) -> str:
    """The text of an OpenCompass dataset config defining ``<name>_datasets`` for the rows in ``jsonl``."""
    spec = TASKS[name]
    return "\n".join([
        f'"""OpenCompass dataset config for hbp-train\'s generated task `{name}` (eval/tasks/); rows: '
        f'{jsonl.name}."""',
        "",
        "from opencompass.datasets.custom import CustomDataset",
        f"from {spec.evaluator_module} import {spec.evaluator}",
        "from opencompass.openicl.icl_inferencer import GenInferencer",
        "from opencompass.openicl.icl_prompt_template import PromptTemplate",
        "from opencompass.openicl.icl_retriever import ZeroRetriever",
        "",
        f"{name}_datasets = [",
        "    dict(",
        f"        abbr={ABBR_PREFIX + name!r},",
        "        type=CustomDataset,",
        f"        path={str(jsonl)!r},",
        "        reader_cfg=dict(input_columns=['prompt'], output_column='answer'),",
        "        infer_cfg=dict(",
        "            prompt_template=dict(type=PromptTemplate,",
        "                                 template=dict(round=[dict(role='HUMAN', prompt='{prompt}')])),",
        "            retriever=dict(type=ZeroRetriever),",
        f"            inferencer=dict(type=GenInferencer, max_out_len={spec.max_out_len}),",
        "        ),",
        f"        eval_cfg=dict(evaluator=dict(type={spec.evaluator})),",
        "    )",
        "]",
        "",
    ])


def write(out_dir: Path, tasks: dict[str, list[dict]]) -> list[SuiteDataset]:
    """Write each task's rows (``generate``) as ``out_dir/<name>.jsonl`` + ``out_dir/<name>_gen.py``."""
    written = []
    for name, rows in tasks.items():
        jsonl = write_jsonl(Path(out_dir) / f"{name}.jsonl", rows).resolve()
        config_path = Path(out_dir) / f"{name}_gen.py"
        config_path.write_text(dataset_config(name, jsonl))
        written.append(SuiteDataset(name, ABBR_PREFIX + name, jsonl, config_path, f"{name}_datasets", len(rows)))
    return written


def read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _general_postprocess(text: str) -> str:
    """OpenCompass's ``general_postprocess`` (what ``EMEvaluator`` compares): up to the first newline, period or
    comma, without punctuation and English articles, single-spaced."""
    text = re.split(r"[\n.,]", text, maxsplit=1)[0]
    text = re.sub(r"[^\w\s]", "", text)
    text = re.sub(r"\b(a|an|the)\b", "", text, flags=re.IGNORECASE)
    return re.sub(r"\s+", " ", text).strip()


def score(rule: str, prediction: str, answers: list[str]) -> float:
    """One sample's score in percent, as OpenCompass's evaluator for the rule computes it."""
    if rule == "contains":  # RulerNiahEvaluator / RulerVtEvaluator
        return 100.0 * sum(a.lower() in prediction.lower() for a in answers) / len(answers)
    assert rule == "exact", rule  # EMEvaluator
    processed = {_general_postprocess(a) for a in answers} | set(answers)
    return 100.0 if _general_postprocess(prediction) in processed else 0.0


def breakdown(name: str, rows: list[dict], predictions: list[str]) -> dict:
    """``{"score", "groups": [{<group fields>, "samples", "score"}]}``: the task's predictions re-scored per
    sample and averaged overall and per group (``TaskSpec.group_by``)."""
    assert len(rows) == len(predictions), (name, len(rows), len(predictions))
    spec = TASKS[name]
    scores = [score(spec.rule, p, row["answer"]) for row, p in zip(rows, predictions)]
    groups: dict[tuple, list[float]] = {}
    for row, value in zip(rows, scores):
        groups.setdefault(tuple(row[k] for k in spec.group_by), []).append(value)
    return {
        "score": sum(scores) / len(scores),
        "group_by": list(spec.group_by),
        "groups": [{**dict(zip(spec.group_by, key)), "samples": len(v), "score": sum(v) / len(v)}
                   for key, v in sorted(groups.items())],
    }
