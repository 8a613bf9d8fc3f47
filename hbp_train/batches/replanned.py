"""The packed shards of a re-plan (planning/replan.py), placed in the run's global step numbering.

A run resumed on another number of ranks at global step ``start``, in epoch ``epoch``, trains the re-plan's shards
(written under RUN_DIR/elastic/, runtime/elastic.py). Their plan is the epoch's untrained samples (the *rest*),
preceded, when more epochs follow, by the trained ones (the *head*, ``head_steps`` optimizer steps), so that it is a
whole epoch at the new world size. Steps ``start`` .. ``start + rest_steps - 1`` run the rest in plan order; every
later epoch runs the whole plan, in its own seeded order when data.shuffle_epochs (as PackedData's later epochs).
Everything else (collate, step batches, the length mix) is PackedData's.
"""

from __future__ import annotations

from hbp_train.batches.loader import PackedData


class ReplannedData(PackedData):
    """PackedData of a re-plan, serving global steps from ``start`` on (see the module docstring)."""

    def __init__(self, path: str, start: int, epoch: int, check_counts: bool = True, shuffle_epochs: bool = False,
                 seed: int = 0):
        super().__init__(path, check_counts, shuffle_epochs, seed)
        self.start, self.epoch = int(start), int(epoch)
        replanned = self.plan.get("replanned") or {}  # what planning/replan.py recorded in the plan
        self.head_steps = int(replanned.get("head_steps", 0))
        """Optimizer steps of the head (the epoch's trained samples), first in the plan."""
        self.rest_steps = self.num_steps - self.head_steps
        """Optimizer steps of the resumed epoch's rest."""
        self.has_head = self.head_steps > 0 or not replanned.get("trained")
        """Whether the plan is a whole epoch, which later epochs can run (a head, or nothing trained before)."""

    def plan_step(self, step: int) -> int:
        if step < self.start:
            raise ValueError(f"step {step} was run before the re-plan (it starts at step {self.start})")
        i = step - self.start
        if i < self.rest_steps:
            return self.head_steps + i
        epoch, index = divmod(i - self.rest_steps, self.num_steps)
        return self.epoch_step(self.epoch + 1 + epoch, index)

    def epoch_of(self, step: int) -> int:
        i = step - self.start
        return self.epoch if i < self.rest_steps else self.epoch + 1 + (i - self.rest_steps) // self.num_steps

    def run_steps(self, epochs: int) -> int:
        if epochs <= self.epoch:  # resumed after the run's last epoch: nothing is left to train
            return self.start
        return self.start + self.rest_steps + (epochs - self.epoch - 1) * self.num_steps

    def record(self) -> dict:
        """What a checkpoint of the resumed run records, to open these shards again at a resume (resume.json)."""
        return {"shards": self.path, "start": self.start, "epoch": self.epoch}
