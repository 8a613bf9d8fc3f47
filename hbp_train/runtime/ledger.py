"""The sample ledger: which samples every optimizer step of a run trained, saved with every checkpoint.

Rank 0 records, after each optimizer step, the step, its epoch, the indices of every sample of its packs (all
replicas; the plan's numbering, i.e. the rows of the tokenized dataset) and whether the step was skipped (a NaN/inf
loss or gradient: its update was dropped, and like every consumed step it is not planned again). A checkpoint
holds the ledger of every step before it (``ledger.npz``, written by rank 0 beside resume.json and listed in the
manifest), so it says exactly which samples of the current epoch are trained: a resume on another number of ranks
re-plans the others (runtime/elastic.py, planning/replan.py), and a test can count that every sample of an epoch
was trained exactly once, across any number of resumes.

Format: npz (numpy arrays only, loaded with allow_pickle=False): ``step``, ``epoch``, ``skipped`` per recorded step,
``ptr`` (CSR over ``samples``: step k trained samples[ptr[k]:ptr[k + 1]]) and ``samples``. Size: 8 bytes per
sample per epoch (80 MB an epoch at 10M samples).
"""

from __future__ import annotations

import os
import zipfile
from typing import Optional

import numpy as np

from hbp_train.common.errors import UserError

FILE = "ledger.npz"


class SampleLedger:
    """The steps of a run and the samples each trained (module docstring)."""

    def __init__(self, arrays: Optional[dict] = None):
        self._steps, self._epochs, self._skipped, self._samples = [], [], [], []
        if arrays is not None:
            ptr = np.asarray(arrays["ptr"], np.int64)
            samples = np.asarray(arrays["samples"], np.int64)
            self._steps = np.asarray(arrays["step"], np.int64).tolist()
            self._epochs = np.asarray(arrays["epoch"], np.int64).tolist()
            self._skipped = np.asarray(arrays["skipped"], bool).tolist()
            self._samples = [samples[a:b] for a, b in zip(ptr[:-1], ptr[1:])]

    def __len__(self) -> int:
        return len(self._steps)

    def record(self, step: int, epoch: int, samples, skipped: bool = False) -> None:
        """Step ``step`` of epoch ``epoch`` trained ``samples`` (or was skipped)."""
        self._steps.append(int(step))
        self._epochs.append(int(epoch))
        self._skipped.append(bool(skipped))
        self._samples.append(np.asarray(samples, np.int64))

    def arrays(self) -> dict:
        sizes = [len(s) for s in self._samples]
        return {"step": np.asarray(self._steps, np.int64), "epoch": np.asarray(self._epochs, np.int64),
                "skipped": np.asarray(self._skipped, bool),
                "ptr": np.concatenate([[0], np.cumsum(sizes, dtype=np.int64)]).astype(np.int64),
                "samples": np.concatenate(self._samples) if self._samples else np.zeros(0, np.int64)}

    def epoch_samples(self, epoch: int) -> np.ndarray:
        """The samples the steps of ``epoch`` consumed (trained, or skipped), in step order."""
        parts = [s for s, e in zip(self._samples, self._epochs) if e == epoch]
        return np.concatenate(parts) if parts else np.zeros(0, np.int64)

    def epoch_steps(self, epoch: int) -> int:
        """How many optimizer steps of ``epoch`` ran."""
        return sum(1 for e in self._epochs if e == epoch)

    def counts(self, num_samples: int, epoch: int) -> np.ndarray:
        """int64 [num_samples]: how many times each sample was consumed in ``epoch`` (1 for all of a whole epoch)."""
        return np.bincount(self.epoch_samples(epoch), minlength=num_samples)

    def save(self, path: str) -> None:
        """Write the ledger to ``path`` (a file object or name; the caller writes it atomically)."""
        np.savez(path, **self.arrays())

    @classmethod
    def load(cls, tag_dir: str) -> Optional["SampleLedger"]:
        """The ledger a checkpoint folder holds, or None for a checkpoint saved without one."""
        path = os.path.join(tag_dir, FILE)
        if not os.path.isfile(path):
            return None
        try:
            with np.load(path, allow_pickle=False) as z:
                return cls({k: z[k] for k in ("step", "epoch", "skipped", "ptr", "samples")})
        except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
            raise UserError(f"{path}: not a sample ledger this trainer saved ({exc}); resume from another "
                            "checkpoint") from None
