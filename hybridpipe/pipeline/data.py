"""Micro-batches from a map-style dataset, addressed by (step, micro-batch): the engine's data source.

Micro-batch m of step k holds samples ``(k * M + m) * B ... + B - 1`` (modulo the dataset's
length, so a run may go over it several times): every rank computes the same indices, so stage 0
and the last stage see the inputs and targets of the same samples without talking. Samples are
collated by the dataset's own ``collate_fn`` attribute when it has one (e.g. padding each batch
to its longest sequence), else by torch's ``default_collate``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree
from torch.utils.data import Dataset, default_collate


class DataSource(Protocol):
    """What the engine reads its micro-batches from (:class:`MicroBatches` is one): micro-batch
    ``micro_batch`` of step ``step``'s input, and its target (None when the model computes its own loss)."""

    def input(self, step: int, micro_batch: int) -> Any: ...
    def target(self, step: int, micro_batch: int) -> Any: ...


class MicroBatches:
    """``input(step, m)`` / ``target(step, m)`` over ``dataset`` of (input, target) samples, or of
    inputs alone (``targets=False``: a model that computes its own loss; ``target`` is None)."""

    def __init__(self, dataset: Dataset, batch_size: int, micro_batches: int, *, targets: bool = True,
                 shuffle_seed: int | None = None):
        if batch_size < 1 or micro_batches < 1:
            raise ValueError(f"need batch_size >= 1 and micro_batches >= 1, got {batch_size}, {micro_batches}")
        self.dataset, self.batch_size, self.micro_batches = dataset, batch_size, micro_batches
        self.targets, self.shuffle_seed = targets, shuffle_seed
        self._cached: tuple[tuple[int, int], tuple[Any, Any]] | None = None
        self._order: tuple[int, list[int]] | None = None        # (epoch, its permutation)

    def indices(self, step: int, micro_batch: int) -> list[int]:
        start = (step * self.micro_batches + micro_batch) * self.batch_size
        # torch's Dataset declares no __len__, map-style datasets have one (resolve_dataset checks)
        n = len(self.dataset)  # type: ignore[arg-type]
        if self.shuffle_seed is None:
            return [(start + i) % n for i in range(self.batch_size)]
        return [self._permutation((start + i) // n)[(start + i) % n] for i in range(self.batch_size)]

    def _permutation(self, epoch: int) -> list[int]:
        """Epoch ``epoch``'s order (randperm seeded by shuffle_seed + epoch, as DistributedSampler)."""
        order = self._order
        if order is None or order[0] != epoch:
            g = torch.Generator().manual_seed(int(self.shuffle_seed or 0) + epoch)
            order = (epoch, torch.randperm(len(self.dataset), generator=g).tolist())  # type: ignore[arg-type]
            self._order = order
        return order[1]

    def batch(self, step: int, micro_batch: int) -> tuple[Any, Any]:
        """(inputs, targets) of one micro-batch (the last one fetched is cached; safe to share
        between threads: the cache entry is replaced whole)."""
        key = (step, micro_batch)
        cached = self._cached
        if cached is None or cached[0] != key:
            samples = [self.dataset[i] for i in self.indices(step, micro_batch)]
            collate = getattr(self.dataset, "collate_fn", None) or default_collate
            pair = tuple(collate(samples)) if self.targets else (collate(samples), None)
            cached = (key, pair)
            self._cached = cached
        return cached[1]

    def global_batch(self, step: int) -> tuple[Any, Any]:
        """The step's M micro-batches concatenated (what single-process training would use)."""
        xs, ys = zip(*(self.batch(step, m) for m in range(self.micro_batches)), strict=True)
        return concat(xs), (concat(ys) if self.targets else None)

    def input(self, step: int, micro_batch: int) -> Any:
        return self.batch(step, micro_batch)[0]

    def target(self, step: int, micro_batch: int) -> Any:
        return self.batch(step, micro_batch)[1]


def concat(batches: Sequence[Any]) -> Any:
    """Batches (tensors, or tuples/dicts of them) concatenated along the batch dimension."""
    leaves = [pytree.tree_flatten(b) for b in batches]
    spec = leaves[0][1]
    joined = [torch.cat(parts) if isinstance(parts[0], torch.Tensor) else parts[0]
              for parts in zip(*(flat for flat, _ in leaves), strict=True)]
    return pytree.tree_unflatten(joined, spec)
