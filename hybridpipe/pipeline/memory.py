"""What a stage holds in memory, measured per step (next to the partitioner's prediction).

On a GPU: ``torch.cuda.max_memory_allocated`` over the step. On the CPU, where the allocator
keeps no such count, the bytes of the tensors the stage holds at its peak, every storage once:

* each micro-batch's activations from its forward until its backward is done: every tensor
  autograd saves (seen through ``torch.autograd.graph.saved_tensors_hooks``, the loss's included)
  until the graph that saved it is freed, and the tensors the engine keeps for the backward (the
  stage's inputs, the outputs it sent, the model's output and loss: ``hold`` / ``drop``);
* on a recomputing stage, what its forward's rerun inside the backward saves, from the rerun until
  the backward has used it (``backward``: torch.utils.checkpoint's own saved-tensor hooks are
  wrapped for the rerun);
* the weights, their gradients, the optimizer's state and the stashed weight versions
  (pipedream), counted at the end of the step, when all of them exist. Buffers (batch norm's
  running statistics) are neither activations nor counted, as in the partitioner's prediction.

Between a split backward's input and weight halves (zb-h1, zbv: ``splitback.py``) a micro-batch
holds, besides its inputs and outputs, what the weight half reads (``WeightWork.held``) and the
gradients the input half recorded for it (``WeightWork.recorded``: the logits' on an LM head stage;
every output's on the first stage), each storage once, until the weight half.

The peak is the most activation bytes alive at once during the step plus those. Temporaries an
operation frees before it returns (and gradients flowing through a backward) are not counted.

A step the meter does not measure (``begin_step(measure=False)``: the engine's ``memory_every``)
costs nothing: no saved-tensor hooks, no counting; what an earlier measured step counted is still
released as it is freed.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.utils._pytree as pytree


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


def _key(t: torch.Tensor) -> int:
    """The meter's key of a CPU tensor's storage (the meter counts on the CPU only)."""
    return t.untyped_storage().data_ptr()


def _leaves(values: Iterable[Any]) -> Iterator[Any]:
    """The leaves of nested values: tensors, dicts, lists and tuples walked directly (they are
    what a stage holds), anything else (a model's output class) through pytree."""
    for v in values:
        kind = type(v)
        if isinstance(v, torch.Tensor):
            yield v
        elif kind is dict:
            yield from _leaves(v.values())
        elif kind is list or kind is tuple:
            yield from _leaves(v)
        elif v is not None:
            yield from pytree.tree_leaves(v)


_NOTHING = contextlib.nullcontext()     # reusable: what an unmeasured forward or backward is wrapped in


class _Saved:
    """A saved tensor as autograd holds it: releases its count when the graph drops it."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, tensor: torch.Tensor, key: int, meter: MemoryMeter):
        self.tensor, self.key, self.meter = tensor, key, meter

    def __del__(self) -> None:
        self.meter._release(self.key)


class MemoryMeter:
    """Peak bytes of one stage per step (see the module docstring).

    ``static()`` returns the tensors held outside the graph (weights, optimizer state, stashed
    versions); their storages are never counted as activations. ``grad_bytes()``: the bytes of
    the weights' gradients at the step's peak (they are freed after each optimizer step).
    ``modules``: the stage's modules (one per model chunk the rank holds), whose buffers are not
    activations; :meth:`backward` names the one whose forward a recomputing stage reruns.
    The static tensors are listed once per step (at the first forward after ``begin_step``): the
    weights and the optimizer's state keep their storages within a step. ``static_changes``: list
    them at every forward instead (pipedream's stash makes weight versions inside a step)."""

    def __init__(self, static: Callable[[], Iterable[torch.Tensor]], grad_bytes: Callable[[], int],
                 device: torch.device, modules: Sequence[torch.nn.Module] = (), *, static_changes: bool = False):
        self.static, self.grad_bytes, self.device, self.modules = static, grad_bytes, device, tuple(modules)
        self.static_changes = static_changes
        self._skip_known = False    # _skip lists this step's static storages
        self._counts: dict[int, int] = {}
        self._bytes: dict[int, int] = {}
        self._skip: set[int] = set()
        self._held: dict[Hashable, set[int]] = {}
        self._rerun: list[bool] = []
        self.measuring = True       # this step is measured (begin_step)
        self.held = 0               # activation bytes alive now
        self.peak = 0               # most activation bytes alive at once this step

    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

    def begin_step(self, measure: bool = True) -> None:
        """A step starts; ``measure=False``: do not measure it (nothing is counted, at no cost)."""
        self.measuring = measure
        self.peak = self.held
        self._skip_known = False
        if self.on_cuda and measure:
            torch.cuda.reset_peak_memory_stats(self.device)

    def end_step(self) -> int:
        """The step's peak bytes (0 for a step not measured)."""
        if not self.measuring:
            return 0
        if self.on_cuda:
            return int(torch.cuda.max_memory_allocated(self.device))
        return self.peak + tensors_bytes(self.static()) + self.grad_bytes()

    def forward(self) -> contextlib.AbstractContextManager:
        """Count what autograd saves inside (wrap a stage's forward and the loss)."""
        return _NOTHING if self.on_cuda or not self.measuring else self._counting()

    @contextlib.contextmanager
    def _counting(self) -> Iterator[None]:
        if not self._skip_known or self.static_changes:
            buffers = [b for m in self.modules for b in m.buffers()]
            self._skip = {_key(t) for t in (*self.static(), *buffers)
                          if isinstance(t, torch.Tensor) and t.numel() > 0}
            self._skip_known = True
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            yield

    def hold(self, owner: Hashable, *values: Any) -> None:
        """Count the tensors in ``values`` (nested) as held for micro-batch ``owner`` until ``drop(owner)``."""
        if self.on_cuda or not self.measuring:
            return
        keys = self._held.setdefault(owner, set())
        for t in _leaves(values):
            if isinstance(t, torch.Tensor) and t.numel() > 0:
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in keys and key not in self._skip:
                    keys.add(key)
                    self._add(key, storage.nbytes())

    def drop(self, owner: Hashable) -> None:
        """Micro-batch ``owner``'s backward is done: what ``hold`` counted for it is released."""
        for key in self._held.pop(owner, ()):
            self._release(key)

    def backward(self, recompute: bool, module: torch.nn.Module | None = None) -> contextlib.AbstractContextManager:
        """Wrap a backward; on a recomputing stage (``module``: its chunk's), count what the rerun
        of its forward saves."""
        if self.on_cuda or not recompute or module is None or not self.measuring or _top_hooks() is None:
            return _NOTHING
        return self._rerun_counted(module)

    @contextlib.contextmanager
    def _rerun_counted(self, module: torch.nn.Module) -> Iterator[None]:
        pre = module.register_forward_pre_hook(lambda *_: self._begin_rerun())
        post = module.register_forward_hook(lambda *_: self._end_rerun(), always_call=True)
        try:
            yield
        finally:
            pre.remove()
            post.remove()

    def _begin_rerun(self) -> None:
        """The module's forward starts inside a backward: checkpoint's rerun; wrap its saved-tensor hooks."""
        top = _top_hooks()
        current = top() if top is not None else None
        if current is None:
            self._rerun.append(False)
            return
        pack, unpack = current

        def counted(x: torch.Tensor) -> Any:
            # a new tensor object of our own (detach), so that checkpoint keeps this very object and
            # its end is seen (the op's own output object may outlive the storage's use elsewhere)
            y = x.detach()
            if y.numel() > 0 and (key := _key(y)) not in self._skip:
                self._add(key, y.untyped_storage().nbytes())
                weakref.finalize(y, self._release, key)
            return pack(y)

        torch._C._autograd._push_saved_tensors_default_hooks(counted, unpack)
        self._rerun.append(True)

    def _end_rerun(self) -> None:
        if self._rerun and self._rerun.pop():
            torch._C._autograd._pop_saved_tensors_default_hooks()

    def _add(self, key: int, size: int) -> None:
        n = self._counts.get(key, 0)
        self._counts[key] = n + 1
        if n == 0:
            self._bytes[key] = size
            self.held += size
            self.peak = max(self.peak, self.held)

    def _pack(self, t: torch.Tensor):
        if t.numel() == 0:
            return t
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self._skip:
            return t
        self._add(key, storage.nbytes())
        return _Saved(t.detach(), key, self)     # detached: no cycle through a saved output's grad_fn

    @staticmethod
    def _unpack(saved) -> torch.Tensor:
        return saved.tensor if isinstance(saved, _Saved) else saved

    def _release(self, key: int) -> None:
        n = self._counts.get(key, 0) - 1
        if n > 0:
            self._counts[key] = n
            return
        self._counts.pop(key, None)
        self.held -= self._bytes.pop(key, 0)


def _top_hooks() -> Callable[[], Any] | None:
    """torch's accessor of the innermost saved-tensor hooks (None where this torch has none)."""
    autograd = torch._C._autograd
    if not all(hasattr(autograd, f"_{op}_saved_tensors_default_hooks") for op in ("top", "push", "pop")):
        return None
    return lambda: autograd._top_saved_tensors_default_hooks(False)


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors of an optimizer's state (momentum buffers, Adam's moments)."""
    state = getattr(optimizer, "state", {})
    return [v for per_param in state.values() for v in per_param.values() if isinstance(v, torch.Tensor)]
