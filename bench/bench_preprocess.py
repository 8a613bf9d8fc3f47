"""Preprocessing benchmark: data_tools.preprocess against the plain datasets path a user would write, side by side.

    .venv/bin/python bench/bench_preprocess.py [--samples 50000] [--num-proc 2] [--repeats 1]

Both turn the same demo chats (``data_tools.make_demo_data``, written once to bench/out/demo_<N>.jsonl) into
input_ids and assistant-only labels with the shipped tokenizer, on the same number of worker processes, in this
process one after the other:

* plain: ``datasets.load_dataset("json")`` + ``.map(tokenizer.apply_chat_template(..., return_assistant_tokens_mask=
  True), batched=True, num_proc=N)`` (labels = ids where the mask is set, -100 elsewhere) + ``save_to_disk``;
* ours: ``data_tools.preprocessing.pipeline.preprocess(..., num_proc=N)``, which also writes the length, loss-token
  and source columns, report.json (drops by reason) and dropped.jsonl.

Prints the wall time of each (best of --repeats, alternating; each run starts from an empty datasets cache), the
ratio plain / ours against the target (>= 1.2), and checks that every row's input_ids and labels are identical.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

TOKENIZER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "data_tools", "assets", "tokenizer")
OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "out")
TARGET = 1.2


def demo_data(samples: int) -> str:
    """bench/out/demo_<samples>.jsonl, written by data_tools.make_demo_data the first time."""
    from data_tools import make_demo_data

    path = os.path.join(OUT, f"demo_{samples}.jsonl")
    if not os.path.isfile(path):
        os.makedirs(OUT, exist_ok=True)
        code = make_demo_data.main(["--out", path, "--num-samples", str(samples)])
        if code:
            sys.exit(code)
    return path


def plain_datasets(jsonl: str, out: str, num_proc: int, cache_dir: str) -> None:
    """The path a user writes by hand with datasets and transformers."""
    import datasets
    from transformers import AutoTokenizer

    from hbp_train.common.labels import IGNORE_INDEX

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER, local_files_only=True)

    def encode(batch):
        out = tokenizer.apply_chat_template(batch["messages"], tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        labels = [[t if m else IGNORE_INDEX for t, m in zip(ids, mask)]
                  for ids, mask in zip(out["input_ids"], out["assistant_masks"])]
        return {"input_ids": out["input_ids"], "labels": labels}

    ds = datasets.load_dataset("json", data_files=jsonl, split="train", cache_dir=cache_dir)
    ds = ds.map(encode, batched=True, num_proc=num_proc, remove_columns=ds.column_names)
    ds.save_to_disk(out)


def ours(jsonl: str, out: str, num_proc: int) -> dict:
    from data_tools.preprocessing.pipeline import preprocess

    return preprocess([jsonl], out, TOKENIZER, num_proc=num_proc, progress=False)


def flat(dataset, column: str) -> tuple[np.ndarray, np.ndarray]:
    """(row offsets, values) of a list column, as int64."""
    col = dataset.data.column(column).combine_chunks()
    return np.asarray(col.offsets, np.int64), np.asarray(col.values, np.int64)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--samples", type=int, default=50_000, help="demo chats to preprocess (default 50000)")
    ap.add_argument("--num-proc", type=int, default=2, help="worker processes for both paths (default 2)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of each path, alternating; best is kept (default 1)")
    args = ap.parse_args()
    if args.samples < 1 or args.num_proc < 1 or args.repeats < 1:
        ap.error("--samples, --num-proc and --repeats must be >= 1")
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    jsonl = demo_data(args.samples)
    times = {"plain": [], "ours": []}
    with tempfile.TemporaryDirectory(dir=OUT) as tmp:
        for r in range(args.repeats):
            for name in ("plain", "ours"):
                out = os.path.join(tmp, f"{name}_{r}")
                t0 = time.perf_counter()
                if name == "plain":
                    plain_datasets(jsonl, out, args.num_proc, os.path.join(tmp, f"cache_{r}"))
                else:
                    report = ours(jsonl, out, args.num_proc)
                times[name].append(time.perf_counter() - t0)
        plain_ds, our_ds = (datasets.load_from_disk(os.path.join(tmp, f"{n}_0")) for n in ("plain", "ours"))
        same = len(plain_ds) == len(our_ds) and all(
            all(np.array_equal(a, b) for a, b in zip(flat(plain_ds, col), flat(our_ds, col)))
            for col in ("input_ids", "labels"))
    plain, mine = min(times["plain"]), min(times["ours"])
    ratio = plain / mine
    print(f"{args.samples} chats ({report['tokens']:,} tokens), {args.num_proc} worker processes, best of "
          f"{args.repeats}")
    print(f"plain datasets path (load_dataset + map(apply_chat_template) + save_to_disk): {plain:.1f} s")
    print(f"data_tools.preprocess (+ length, loss tokens, source, report.json, dropped.jsonl): {mine:.1f} s")
    print(f"speed-up plain / ours: {ratio:.2f}x [target >= {TARGET}x: {'ok' if ratio >= TARGET else 'MISSED'}]")
    print(f"input_ids and labels identical on all {len(our_ds)} rows: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
