"""Micro-batches from a map-style dataset, addressed by (step, micro-batch): the engine's data source.

Micro-batch m of step k holds samples ``(k * M + m) * B ... + B - 1`` (modulo the dataset's
length, so a run may go over it several times): every rank computes the same indices, so stage 0
and the last stage see the inputs and targets of the same samples without talking.
"""

from __future__ import annotations

import torch
from torch.utils.data import Dataset, default_collate


class MicroBatches:
    """``input(step, m)`` / ``target(step, m)`` over ``dataset`` of (input, target) samples."""

    def __init__(self, dataset: Dataset, batch_size: int, micro_batches: int):
        if batch_size < 1 or micro_batches < 1:
            raise ValueError(f"need batch_size >= 1 and micro_batches >= 1, got {batch_size}, {micro_batches}")
        self.dataset, self.batch_size, self.micro_batches = dataset, batch_size, micro_batches
        self._cached: tuple[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None

    def indices(self, step: int, micro_batch: int) -> list[int]:
        start = (step * self.micro_batches + micro_batch) * self.batch_size
        # torch's Dataset declares no __len__, map-style datasets have one (resolve_dataset checks)
        n = len(self.dataset)  # type: ignore[arg-type]
        return [(start + i) % n for i in range(self.batch_size)]

    def batch(self, step: int, micro_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of one micro-batch (the last one fetched is cached; safe to share
        between threads: the cache entry is replaced whole)."""
        key = (step, micro_batch)
        cached = self._cached
        if cached is None or cached[0] != key:
            cached = (key, tuple(default_collate([self.dataset[i] for i in self.indices(step, micro_batch)])))
            self._cached = cached
        return cached[1]

    def global_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's M micro-batches concatenated (what single-process training would use)."""
        xs, ys = zip(*(self.batch(step, m) for m in range(self.micro_batches)), strict=True)
        return torch.cat(xs), torch.cat(ys)

    def input(self, step: int, micro_batch: int) -> torch.Tensor:
        return self.batch(step, micro_batch)[0]

    def target(self, step: int, micro_batch: int) -> torch.Tensor:
        return self.batch(step, micro_batch)[1]
