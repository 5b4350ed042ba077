"""What a stage holds in memory, measured per step (next to the partitioner's prediction).

On a GPU: ``torch.cuda.max_memory_allocated`` over the step. On the CPU, where the allocator
keeps no such count, the bytes of the tensors the stage holds at its peak:

* the activations autograd keeps for the backward: every tensor saved during the stage's
  forwards, seen through ``torch.autograd.graph.saved_tensors_hooks`` and counted once per
  storage until the graph that saved it is freed (a recomputing stage keeps only its inputs;
  what it recomputes inside the backward is transient and not counted);
* the weights, their gradients, the optimizer's state and the stashed weight versions
  (pipedream), counted at the end of the step, when all of them exist.

The peak is the most activation bytes alive at once during the step plus those.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator

import torch


def storage_key(t: torch.Tensor) -> tuple[str, int]:
    """Identifies the memory a tensor lives in (views of one storage share it)."""
    return (str(t.device), t.untyped_storage().data_ptr())


def tensors_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors``."""
    seen: dict[tuple[str, int], int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel() > 0:
            seen[storage_key(t)] = t.untyped_storage().nbytes()
    return sum(seen.values())


class _Saved:
    """A saved tensor as autograd holds it: releases its count when the graph drops it."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, tensor: torch.Tensor, key: tuple[str, int], meter: MemoryMeter):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter._release(self.key)


class MemoryMeter:
    """Peak bytes of one stage per step (see the module docstring).

    ``static()`` returns the tensors held outside the graph (weights, optimizer state, stashed
    versions); their storages are never counted as activations. ``grad_bytes()``: the bytes of
    the weights' gradients at the step's peak (they are freed after each optimizer step)."""

    def __init__(self, static: Callable[[], Iterable[torch.Tensor]], grad_bytes: Callable[[], int],
                 device: torch.device):
        self.static, self.grad_bytes, self.device = static, grad_bytes, device
        self._counts: dict[tuple[str, int], int] = {}
        self._bytes: dict[tuple[str, int], int] = {}
        self._skip: set[tuple[str, int]] = set()
        self.held = 0               # activation bytes alive now
        self.peak = 0               # most activation bytes alive at once this step

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def begin_step(self) -> None:
        self.peak = self.held
        if self.on_cuda:
            torch.cuda.reset_peak_memory_stats(self.device)

    def end_step(self) -> int:
        """The step's peak bytes."""
        if self.on_cuda:
            return int(torch.cuda.max_memory_allocated(self.device))
        return self.peak + tensors_bytes(self.static()) + self.grad_bytes()

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """Count what autograd saves inside (wrap a stage's forward)."""
        if self.on_cuda:
            yield
            return
        self._skip = {storage_key(t) for t in self.static() if isinstance(t, torch.Tensor) and t.numel() > 0}
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def _pack(self, t: torch.Tensor):
        if t.numel() == 0:
            return t
        key = storage_key(t)
        if key in self._skip:
            return t
        n = self._counts.get(key, 0)
        self._counts[key] = n + 1
        if n == 0:
            size = t.untyped_storage().nbytes()
            self._bytes[key] = size
            self.held += size
            self.peak = max(self.peak, self.held)
        return _Saved(t.detach(), key, self)     # detached: no cycle through a saved output's grad_fn

    @staticmethod
    def _unpack(saved) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: tuple[str, int]) -> None:
        n = self._counts.get(key, 0) - 1
        if n > 0:
            self._counts[key] = n
            return
        self._counts.pop(key, None)
        self.held -= self._bytes.pop(key, 0)


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors of an optimizer's state (momentum buffers, Adam's moments)."""
    state = getattr(optimizer, "state", {})
    return [v for per_param in state.values() for v in per_param.values() if isinstance(v, torch.Tensor)]
