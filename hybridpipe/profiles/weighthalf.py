"""What a block holds between a zero-bubble schedule's split backward's input and weight halves.

Given the split backward (``pipeline/splitback.backward_input``, handed in by the caller, as this
package imports nothing of the pipeline), :func:`weight_half_split` runs its input half on a fresh
forward of the block and splits, as ``measure.saved_split`` does, what is still held then: the
saved tensors the freed graph did not release and those the weight half keeps for its formulas;
and it counts the gradients the input half recorded for the weight half. ``pipeline/memory.py``'s
meter counts the same, until the weight half.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.utils._pytree as pytree

from hybridpipe.profiles.capture import CapturedModel
from hybridpipe.profiles.measure import (
    BlockModule,
    LossFn,
    SavedSplit,
    _autocast,
    _leaf,
    _own_loss,
    _storage,
    storage_keys,
    tensors,
)


class WeightHalf(Protocol):
    """What a split backward's input half leaves for its weight half (``pipeline/splitback.WeightWork``)."""

    def held(self) -> list[torch.Tensor]:
        """The saved tensors it keeps for the weight half."""
        ...

    def recorded(self) -> list[torch.Tensor]:
        """The gradients it recorded for the weight half."""
        ...

    @property
    def keeps_graph(self) -> bool:
        """It kept the whole graph (then so does a stage holding this block: every block's saved tensors stay)."""
        ...


# (outputs, their gradients (None: a scalar loss), inputs, parameters) -> the weight half's work,
# the inputs' gradients accumulated: ``pipeline/splitback.backward_input``
SplitBackward = Callable[[Sequence[torch.Tensor], Sequence[torch.Tensor | None], Sequence[torch.Tensor],
                          Sequence[torch.nn.Parameter]], WeightHalf]


@dataclass(frozen=True)
class WeightHalfCost:
    """What a block holds between a split backward's input and weight halves (:func:`weight_half_split`)."""

    kept: SavedSplit | None       # of its saved tensors, what stays (None: the input half kept the whole graph)
    grad_bytes: int               # the gradients recorded for the weight half, its inputs' not among them


class _Kept:
    """A saved tensor as the graph holds it: the object dies when the graph releases it."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


class _Survivors:
    """The tensors autograd saves inside the context, of which :meth:`alive` the graph still holds."""

    def __init__(self) -> None:
        self._kept: weakref.WeakSet[_Kept] = weakref.WeakSet()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda k: k.tensor)

    def _pack(self, t: torch.Tensor) -> _Kept:
        kept = _Kept(t.detach())        # detached: no cycle through a saved output's grad_fn (_SavedStorages)
        self._kept.add(kept)
        return kept

    def alive(self) -> list[torch.Tensor]:
        return [k.tensor for k in list(self._kept)]

    def __enter__(self) -> _Survivors:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def weight_half_split(captured: CapturedModel, block: BlockModule, env: dict[str, Any], *, loss: LossFn | None,
                      target: Any, split: SplitBackward, autocast: torch.dtype | None = None,
                      device: torch.device | str = "cpu") -> WeightHalfCost:
    """What one forward of ``block`` (with the loss on the last block) on fresh leaves of its recorded
    inputs still holds after ``split``, the input half of a split backward, has run from its outputs
    (random gradients; the last block: from the loss): the saved tensors its graph did not release and
    those the weight half keeps, split as :func:`saved_split` splits them (the loss's among the inner ones),
    None where the input half kept the whole graph (a block without weight formulas, Llama's RMSNorm:
    a stage holding it keeps every block's graph, so none of its blocks frees anything); and the bytes
    of the gradients it recorded for the weight half, by storage: at its intermediates and the outputs'
    its intermediates take as they are (the logits' at an LM head), all its outputs' where no input
    needs a gradient; one that is an input's gradient is the producing block's (not counted here)."""
    fixed = {t.untyped_storage().data_ptr() for t in (*block.module.parameters(), *block.module.buffers())}
    inputs = {name: pytree.tree_map(lambda t: _leaf(t.clone()) if isinstance(t, torch.Tensor) else t, env[name])
              for name in block.inputs}
    with torch.enable_grad(), _autocast(device, autocast), _Survivors() as saved:
        result = block.module(*inputs.values())
        if block.last:
            output = captured.rebuild_output(result)
            roots: list[torch.Tensor] = [loss(output, target) if loss is not None else _own_loss(output)]
            root_grads: list[torch.Tensor | None] = [None]
            values: dict[str, Any] = {}
            outside = storage_keys(output)
        else:
            values = {name: v for name, v in zip(block.outputs, result, strict=True) if name in block.produced}
            roots = [t for v in values.values() for t in tensors(v) if t.requires_grad]
            root_grads = [torch.ones_like(t) if t.dim() == 0 else torch.randn_like(t) for t in roots]
            outside = set()
    leaves = [t for v in inputs.values() for t in tensors(v) if t.requires_grad]
    work = split(roots, root_grads, leaves, list(block.module.parameters())) if roots else None
    given = {_storage(t.grad)[0] for t in leaves if t.grad is not None}
    grads = dict(map(_storage, work.recorded() if work else ()))
    grad_bytes = sum(size for ptr, size in grads.items() if ptr not in given)
    if work is not None and work.keeps_graph:
        del work, roots, result
        block.module.zero_grad(set_to_none=True)
        return WeightHalfCost(None, grad_bytes)
    held = {ptr: size for ptr, size in map(_storage, (*saved.alive(), *(work.held() if work else ())))}
    named = {**{n: storage_keys(v) for n, v in inputs.items()}, **{n: storage_keys(v) for n, v in values.items()}}
    boundary = set().union(outside, *named.values())
    inner = sum(size for ptr, size in held.items() if ptr not in fixed and ptr not in boundary)
    saves = tuple(name for name, keys in named.items() if keys & set(held))
    del work, roots, result
    block.module.zero_grad(set_to_none=True)
    return WeightHalfCost(SavedSplit(inner, saves), grad_bytes)
