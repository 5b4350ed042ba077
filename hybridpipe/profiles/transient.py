"""Transient memory: the most bytes a piece of work allocates above what is live when it starts.

A block's saved activations are what it leaves for its backward; its *transient* bytes are what its
kernels allocate on the way and free again before they return control: a softmax's output that only
its backward's gradient replaced, attention scores, the logits' log-softmax gradient beside the
logits' own, the gradients flowing through a backward. On a GPU they are a large part of a step's
peak (the plan adds them: ``partitioner/search/stagememory.py``'s ``transient_bytes``).

``PeakMeter(device)`` measures one piece of work: ``with meter: work()`` then ``meter.peak`` (the
most bytes above the start, at once) and ``meter.end`` (what is still allocated above the start
when it ends).

* CUDA: the caching allocator's own counts: ``torch.cuda.memory_allocated`` before,
  ``reset_peak_memory_stats`` / ``max_memory_allocated`` around the work (after a synchronize).
* CPU (no allocator statistics): a ``TorchDispatchMode`` sees every ATen operation; each output
  whose storage is new (not one of the operation's inputs' storages: views and in-place results are
  not allocations) is counted until that storage dies (``weakref.finalize`` on the untyped storage,
  whose Python object torch keeps as long as the storage lives). This approximates an allocator:
  storages allocated before the work and freed during it are not seen (so ``peak`` never falls
  below what was live at the start), nor is scratch memory a kernel allocates without an ATen
  tensor.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


def _storage_of(t: torch.Tensor) -> torch.UntypedStorage | None:
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):      # no storage (subclasses, fakes, sparse)
        return None


class LiveBytes(TorchDispatchMode):
    """Bytes of the storages ATen operations allocated inside the mode that are alive now (``live``),
    and the most at once since the mode started or :meth:`reset_peak` (``peak``)."""

    def __init__(self) -> None:
        super().__init__()
        self.live = 0
        self.peak = 0
        self._alive: dict[int, int] = {}

    def reset_peak(self) -> None:
        self.peak = self.live

    def _freed(self, key: int) -> None:
        self.live -= self._alive.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = set()
        for t in pytree.tree_leaves((args, kwargs)):
            if isinstance(t, torch.Tensor):
                st = _storage_of(t)
                if st is not None:
                    inputs.add(st.data_ptr())
        for t in pytree.tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            st = _storage_of(t)
            if st is None or st.nbytes() == 0:
                continue
            key = st.data_ptr()
            if key in inputs or key in self._alive:
                continue                    # a view or an in-place result, or already counted
            self._alive[key] = st.nbytes()
            self.live += st.nbytes()
            self.peak = max(self.peak, self.live)
            weakref.finalize(st, self._freed, key)
        return out


class PeakMeter:
    """``with PeakMeter(device) as m: work()``: ``m.peak`` and ``m.end``, bytes above the start
    (module docstring)."""

    def __init__(self, device: torch.device | str):
        self.device = torch.device(device)
        self.peak = 0
        self.end = 0
        self._start = 0
        self._mode: LiveBytes | None = None

    @property
    def transient(self) -> int:
        """What the work allocated at its peak and had freed again by its end."""
        return max(0, self.peak - self.end)

    def __enter__(self) -> PeakMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._mode = LiveBytes()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = max(0, torch.cuda.max_memory_allocated(self.device) - self._start)
            self.end = torch.cuda.memory_allocated(self.device) - self._start
            return
        assert self._mode is not None
        self._mode.__exit__(*exc)
        self.peak, self.end = self._mode.peak, self._mode.live
