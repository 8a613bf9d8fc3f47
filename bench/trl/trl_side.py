"""TRL's side of bench/trl/bench_trl.py: one SFTTrainer run, in the TRL venv (bench/trl/venv.py).

    .venv-trl/bin/python bench/trl/trl_side.py SPEC.json

SPEC (written by bench_trl.py): model (an HF folder: the initial weights both sides load), train (the chats, OpenAI
``messages`` JSONL), tokenizer, out, max_len, seed, threads, attention ("sdpa": what TRL runs on a CPU, or
"hbp_block": our per-document attention, hbp_train/model/attention.py's sdpa_block, registered with transformers),
prepare_only, and the optimiser: lr, betas, eps, grad_clip and the learning-rate schedule (DeepSpeed's WarmupCosineLR
as our trainer configures it: warmup, warmup_min_ratio, total, cos_min_ratio).

TRL as users run it: ``SFTConfig(packing=True, packing_strategy="bfd", assistant_only_loss=True)`` (bfd packing
makes the batches padding-free), one pack per step, fp32, its own tokenisation of the chats with the chat template's
generation marks, its own data order (the Trainer's sampler, seeded). Changed from TRL's defaults, to equal ours: the
optimiser's settings and the schedule (a LambdaLR of the same formula), torch threads. Recorded (OUT/trl.json): every
step's end time, learning rate and loss, every batch's real tokens, and every document it trained on (a hash of its
token ids and its trained targets) for the bench's check that both sides train the same tokens and masks. The
trained model is saved to OUT/model for the held-out loss. ``prepare_only`` stops after TRL has tokenised and packed
(the pack count sets the steps of both sides).
"""

from __future__ import annotations

import hashlib
import json
import math
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # hbp_train's modules used here import torch at most

from hbp_train.common.labels import IGNORE_INDEX as IGNORE  # noqa: E402  (transformers' and TRL's too)


def schedule(spec: dict):
    """DeepSpeed's WarmupCosineLR ratio at iteration i, as hbp_train/build.py configures it (linear warm-up)."""
    warmup, start, total, floor = spec["warmup"], spec["warmup_min_ratio"], spec["total"], spec["cos_min_ratio"]

    def ratio(i: int) -> float:
        if i < warmup:
            return start + (1.0 - start) * i / warmup
        progress = min(1.0, (i - warmup + 1) / max(1, total - warmup))
        return max(0.0, floor + (1.0 - floor) * (1 + math.cos(math.pi * progress)) / 2)

    return ratio


def documents(batch: dict) -> list:
    """The documents of one padding-free batch: (hash of ids and target mask, tokens, targets). The target mask
    leaves out each document's first position, which no side trains (nothing before it in the document)."""
    ids = batch["input_ids"][0].tolist()
    labels = batch["labels"][0].tolist()
    starts = [i for i, p in enumerate(batch["position_ids"][0].tolist()) if p == 0] + [len(ids)]
    out = []
    for a, b in zip(starts, starts[1:]):
        doc_ids, doc_labels = ids[a:b], labels[a:b]
        mask = [int(lab != IGNORE) for lab in doc_labels[1:]]
        assert all(lab in (IGNORE, tok) for lab, tok in zip(doc_labels, doc_ids)), "labels are not the ids"
        out.append((doc_hash(doc_ids, mask), b - a, sum(mask)))
    return out


def doc_hash(ids: list, mask: list) -> str:
    return hashlib.sha1(json.dumps([ids, mask]).encode()).hexdigest()[:20]


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(spec["threads"])
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    datasets.disable_progress_bars()
    out = Path(spec["out"])
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32, attn_implementation="sdpa")
    if spec["attention"] == "hbp_block":  # hbp_train.model.attention imports torch only
        from transformers import AttentionInterface

        from hbp_train.model import attention

        attention.set_backend("sdpa_block")
        AttentionInterface.register(attention.ATTN_IMPLEMENTATION, attention.hf_packed_attention)
        model.set_attn_implementation(attention.ATTN_IMPLEMENTATION)
    tokenizer = AutoTokenizer.from_pretrained(spec["tokenizer"])
    train = datasets.load_dataset("json", data_files=spec["train"], split="train").select_columns(["messages"])
    args = SFTConfig(
        output_dir=str(out / "trainer"), max_length=spec["max_len"], packing=True, packing_strategy="bfd",
        assistant_only_loss=True, per_device_train_batch_size=1, gradient_accumulation_steps=1, num_train_epochs=1,
        learning_rate=spec["lr"], weight_decay=0.0, adam_beta1=spec["betas"][0], adam_beta2=spec["betas"][1],
        adam_epsilon=spec["eps"], max_grad_norm=spec["grad_clip"], optim="adamw_torch", seed=spec["seed"],
        data_seed=spec["seed"], logging_steps=1, save_strategy="no", eval_strategy="no", report_to=[], use_cpu=True,
        bf16=False, fp16=False, dataloader_num_workers=0, dataloader_pin_memory=False, disable_tqdm=True)
    trainer = SFTTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer)
    packs = len(trainer.train_dataset)
    record = {"packs": packs, "attention": spec["attention"], "attn_implementation": model.config._attn_implementation}
    if spec.get("prepare_only"):
        (out / "trl.json").write_text(json.dumps(record))
        return 0

    ratio = schedule(spec)

    def create_scheduler(num_training_steps, optimizer=None):
        # the same formula as our trainer's DeepSpeed WarmupCosineLR, made once like the Trainer's own
        if trainer.lr_scheduler is None:
            trainer.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer or trainer.optimizer, ratio)
        return trainer.lr_scheduler

    trainer.create_scheduler = create_scheduler
    batches, docs = [], []
    collate = trainer.data_collator

    def recording_collator(examples):
        batch = collate(examples)
        batches.append(int(batch["input_ids"].numel()))
        docs.extend(documents(batch))
        return batch

    trainer.data_collator = recording_collator
    steps = {"end": [], "lr": []}

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            steps["lr"].append(trainer.optimizer.param_groups[0]["lr"])

        def on_step_end(self, args, state, control, **kwargs):
            steps["end"].append(time.perf_counter())

    trainer.add_callback(Clock())
    start = time.perf_counter()
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    trainer.save_model(str(out / "model"))
    tokenizer.save_pretrained(str(out / "model"))
    record.update(start=start, step_end=steps["end"], lr=steps["lr"], loss=losses, batch_tokens=batches,
                  docs=docs, steps=trainer.state.global_step)
    (out / "trl.json").write_text(json.dumps(record))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
