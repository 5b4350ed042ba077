"""Real data for a pipelined job: each rank loads only the micro-batches it reads, through a DataLoader.

    for part in trainer.loader(dataset, epoch=e, num_workers=2):    # one epoch
        loss = trainer.train_step(part)

An epoch is a permutation of the dataset (``torch.randperm`` seeded by ``seed + epoch``, as
``DistributedSampler`` does; or the dataset's order without ``shuffle``), cut into steps of
micro-batch size x micro-batches samples (an incomplete last step is dropped; ``start`` skips the
epoch's first steps without loading them: a run resumed inside an epoch). Micro-batch m of
a step is the step's samples ``m*B .. m*B + B - 1``, exactly what a single process would see in
that order. A stage with r replicas runs micro-batch m on replica ``m % r``, so each replica of
the first stage loads only its own micro-batches (different samples: every sample of an epoch is
read once across them), the last stage's replicas load the same micro-batches for their targets,
and the stages in between load nothing. Loading is torch's DataLoader: ``num_workers``
processes, ``pin_memory`` on GPU, the dataset's ``collate_fn`` attribute (or the argument, or
``default_collate``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from hybridpipe.errors import UserError


@dataclass
class MicroBatchSlice:
    """This rank's micro-batches of one step, by their index in the step (what a loader yields and
    ``Trainer.train_step`` takes): inputs (first stage), targets (last stage) or None."""

    inputs: dict[int, Any] | None
    targets: dict[int, Any] | None


def epoch_order(n: int, *, seed: int, epoch: int, shuffle: bool) -> list[int]:
    """The epoch's sample order (DistributedSampler's: randperm seeded by seed + epoch)."""
    if not shuffle:
        return list(range(n))
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()


def micro_batch_indices(order: Sequence[int], step: int, micro_batch: int, batch_size: int,
                        micro_batches: int) -> list[int]:
    """The dataset indices of micro-batch ``micro_batch`` of ``step`` in an epoch's ``order``."""
    start = (step * micro_batches + micro_batch) * batch_size
    return list(order[start:start + batch_size])


class RankMicroBatches(Sampler[list[int]]):
    """A batch sampler yielding, step after step from step ``start``, the index lists of the
    micro-batches ``mine``; :attr:`steps` counts the steps it yields."""

    def __init__(self, order: Sequence[int], batch_size: int, micro_batches: int, mine: Sequence[int],
                 start: int = 0) -> None:
        self.order, self.batch_size, self.micro_batches, self.mine = list(order), batch_size, micro_batches, list(mine)
        self.start = start
        self.steps = max(0, len(self.order) // (batch_size * micro_batches) - start)

    def __iter__(self) -> Iterator[list[int]]:
        for k in range(self.start, self.start + self.steps):
            for m in self.mine:
                yield micro_batch_indices(self.order, k, m, self.batch_size, self.micro_batches)

    def __len__(self) -> int:
        return self.steps * len(self.mine)


class StepLoader:
    """One epoch of :class:`MicroBatchSlice` per step for one rank (see the module docstring);
    ``len()`` is the number of steps. A rank that reads nothing yields None per step."""

    def __init__(self, dataset: Dataset, *, batch_size: int, micro_batches: int, mine: Sequence[int],
                 inputs: bool, targets: bool, pairs: bool, seed: int = 0, epoch: int = 0, shuffle: bool = True,
                 num_workers: int = 0, pin_memory: bool = False, collate_fn: Any = None, start: int = 0) -> None:
        n = len(dataset)  # type: ignore[arg-type]
        if n < batch_size * micro_batches:
            raise UserError(f"the dataset has {n} samples, fewer than one step's {batch_size * micro_batches} "
                            "(micro-batch size x micro-batches)")
        self.inputs, self.targets, self.pairs = inputs, targets, pairs
        if start < 0:
            raise UserError(f"start must be >= 0 (the epoch's first step to yield), got {start}")
        self.sampler = RankMicroBatches(epoch_order(n, seed=seed, epoch=epoch, shuffle=shuffle), batch_size,
                                        micro_batches, mine if inputs or targets else [], start)
        collate = collate_fn or getattr(dataset, "collate_fn", None) or default_collate
        self.loader = DataLoader(dataset, batch_sampler=self.sampler, num_workers=num_workers,
                                 pin_memory=pin_memory, collate_fn=collate)

    def __len__(self) -> int:
        return self.sampler.steps

    def __iter__(self) -> Iterator[MicroBatchSlice | None]:
        it = iter(self.loader)
        for _ in range(self.sampler.steps):
            if not self.sampler.mine:
                yield None
                continue
            xs: dict[int, Any] = {}
            ys: dict[int, Any] = {}
            for m in self.sampler.mine:
                batch = next(it)
                x, y = (batch[0], batch[1]) if self.pairs else (batch, None)
                xs[m], ys[m] = x, y
            yield MicroBatchSlice(xs if self.inputs else None, ys if self.targets and self.pairs else None)
