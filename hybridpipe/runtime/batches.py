"""What ``Trainer.train_step`` / ``eval_step`` are given, turned into the engine's data source.

A step is given either its *global batch* (a tensor, or a tuple/list/dict of tensors, whose first
dimension is micro-batch size x micro-batches: micro-batch m is rows ``m*B .. m*B + B - 1``, the
order a single process would see them in) plus the targets in the same layout, or an *iterator*
of micro-batches (each the model's input, or ``(input, target)`` when the model takes targets).
Non-tensor leaves (flags, ints) are given to every micro-batch unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree

from hybridpipe.errors import UserError


def split_batch(batch: Any, micro_batches: int, batch_size: int, what: str = "batch") -> list[Any]:
    """The ``micro_batches`` micro-batches of a global batch (see the module docstring)."""
    leaves, spec = pytree.tree_flatten(batch)
    rows = {int(t.shape[0]) for t in leaves if isinstance(t, torch.Tensor) and t.dim() > 0}
    want = micro_batches * batch_size
    if rows != {want}:
        got = ", ".join(map(str, sorted(rows))) or "no tensor"
        raise UserError(f"the {what} has {got} rows, but a step of the plan takes {micro_batches} micro-batches of "
                        f"{batch_size} = {want} rows; pass the global batch (or an iterator of micro-batches)")
    parts = [t.split(batch_size) if isinstance(t, torch.Tensor) and t.dim() > 0 else [t] * micro_batches
             for t in leaves]
    return [pytree.tree_unflatten([p[m] for p in parts], spec) for m in range(micro_batches)]


def is_micro_batch_stream(batch: Any) -> bool:
    """Whether ``batch`` is an iterator/iterable of micro-batches rather than one global batch."""
    return isinstance(batch, Iterable) and not isinstance(batch, (torch.Tensor, tuple, list, dict, str, bytes))


def take_micro_batches(stream: Iterable, micro_batches: int, *, targets: bool) -> tuple[list[Any], list[Any] | None]:
    """The next ``micro_batches`` items of ``stream``: (inputs, targets or None)."""
    it: Iterator = iter(stream)
    items = []
    for _ in range(micro_batches):
        try:
            items.append(next(it))
        except StopIteration:
            raise UserError(f"the micro-batch iterator ended after {len(items)} of the step's {micro_batches} "
                            "micro-batches") from None
    if not targets:
        return items, None
    if not all(isinstance(x, (tuple, list)) and len(x) == 2 for x in items):
        raise UserError("the model takes targets, so each micro-batch of the iterator must be (input, target)")
    return [x[0] for x in items], [x[1] for x in items]


class GivenBatches:
    """The engine's data source over the micro-batches given to the steps (see ``Trainer``):
    ``put(step, inputs, targets)``; steps older than ``keep`` are forgotten (pipedream reads a
    step's targets in the next step's list). ``fallback`` serves steps given nothing (launch's
    synthetic or dataset micro-batches). ``targets=False``: the model computes its own loss (every
    target is None)."""

    def __init__(self, keep: int = 1, fallback: Any = None, rank: int = 0, targets: bool = True) -> None:
        self.keep, self.fallback, self.rank, self.targets = keep, fallback, rank, targets
        self._given: dict[int, tuple[Any, Any]] = {}

    def put(self, step: int, inputs: Sequence[Any] | Mapping[int, Any] | None,
            targets: Sequence[Any] | Mapping[int, Any] | None) -> None:
        """The step's micro-batches (by index in the step: a list, or a dict of this rank's own)."""
        self._given[step] = (inputs, targets)
        for old in [s for s in self._given if s <= step - self.keep]:
            del self._given[old]

    def input(self, step: int, micro_batch: int) -> Any:
        return self._get(step, micro_batch, 0, "inputs")

    def target(self, step: int, micro_batch: int) -> Any:
        return self._get(step, micro_batch, 1, "targets") if self.targets else None

    def _get(self, step: int, micro_batch: int, which: int, what: str) -> Any:
        given = self._given.get(step)
        if given is None and self.fallback is not None:
            return self.fallback.input(step, micro_batch) if which == 0 else self.fallback.target(step, micro_batch)
        values = given[which] if given is not None else None
        if values is None or (isinstance(values, Mapping) and micro_batch not in values):
            stage = "first" if which == 0 else "last"
            raise UserError(f"rank {self.rank} runs the {stage} stage, which reads the step's {what}, but it was "
                            f"given none: pass {'the batch' if which == 0 else 'target='} on this rank too")
        return values[micro_batch]
