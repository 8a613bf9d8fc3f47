"""The next step's batch collated while the current step computes (the trainer's data path on a GPU).

On a GPU the trainer's step reads nothing back from the device, so the host runs ahead; the collate of the next
step's packs (reading the memory-mapped shards, shifting labels, data.py) then overlaps the GPU's work instead of
leaving the GPU idle between steps, and its tensors are pinned so that the copies to the device are asynchronous.
On the CPU the collate would compete with the step for the same cores: batches are made when asked.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Optional

import torch

from hbp_train.batches.collate import StepBatch


class StepPrefetcher:
    """This rank's step batches in the trainer's order, the next one collated while the current step computes.

    ``make(step)`` builds a step's batch (PackedData.step_batch). On a GPU ``get(step, next_step)`` hands over step's
    batch and starts collating ``next_step``'s in a background thread, its tensors pinned so that the trainer's
    copies to the device do not wait on the host; elsewhere (the CPU trains on the same cores) every batch is made
    when asked. Either way ``get`` returns exactly ``make(step)`` (a resume asks for its first step and gets it made
    then), and an error in the thread is raised by the ``get`` of that step."""

    def __init__(self, make, device, background: Optional[bool] = None):
        self.make = make
        on_gpu = torch.device(device).type == "cuda"
        self.pin = on_gpu
        background = on_gpu if background is None else background
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="hbp-prefetch") if background else None
        self._pending = None  # (step, future) being made

    def get(self, step: int, next_step: Optional[int] = None) -> StepBatch:
        """Step ``step``'s batch; with ``next_step``, start making that one."""
        pending, self._pending = self._pending, None
        if pending is not None and pending[0] == step:
            batch = pending[1].result()
        else:
            if pending is not None:
                pending[1].cancel()
            batch = self._made(step)
        if next_step is not None and self._pool is not None:
            self._pending = (next_step, self._pool.submit(self._made, next_step))
        return batch

    def _made(self, step: int) -> StepBatch:
        batch = self.make(step)
        if self.pin:
            batch.micro_batches = [{k: v.pin_memory() if isinstance(v, torch.Tensor) else v for k, v in mb.items()}
                                   for mb in batch.micro_batches]
        return batch

    def close(self) -> None:
        """Stop the thread (a batch being made is finished and dropped)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._pending = None
