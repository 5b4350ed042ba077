"""A model's synchronisation units: the layers whose gradients are summed together, and the
grouping of small adjacent layers (pure functions; the grouping rule is a function of sizes)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class Layer:
    """A module that directly owns trainable parameters (``recurse=False``), in forward order."""

    name: str                          # qualified module name ('' for the root)
    module: nn.Module
    params: tuple[nn.Parameter, ...]
    param_names: tuple[str, ...]       # qualified parameter names (state_dict keys)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.params)


def model_layers(module: nn.Module, exclude: Collection[nn.Parameter] = ()) -> list[Layer]:
    """Every module with its own trainable parameters, in registration (forward) order.

    A parameter shared by several modules belongs to the first that registers it; ``exclude``d
    parameters belong to none (they are synced elsewhere, e.g. tied weights across stages).
    """
    seen: set[int] = {id(p) for p in exclude}
    layers = []
    for name, mod in module.named_modules():
        own = [(n, p) for n, p in mod.named_parameters(recurse=False) if p.requires_grad and id(p) not in seen]
        if not own:
            continue
        seen.update(id(p) for _, p in own)
        prefix = f"{name}." if name else ""
        layers.append(Layer(name, mod, tuple(p for _, p in own), tuple(prefix + n for n, _ in own)))
    return layers


def group_small(sizes: Sequence[int], small_bytes: float) -> list[list[int]]:
    """Group indices of adjacent layers (in the order given) while a group stays <= ``small_bytes``.

    Layers above ``small_bytes`` stay alone; runs of small ones are packed greedily, so a group
    costs about one all-reduce's latency instead of one per layer. Order is kept.
    """
    groups: list[list[int]] = []
    total = 0.0
    packing = False                        # the last group is a run of small layers
    for i, size in enumerate(sizes):
        small = size <= small_bytes
        if packing and small and total + size <= small_bytes:
            groups[-1].append(i)
            total += size
        else:
            groups.append([i])
            packing, total = small, float(size)
    return groups


def latency_bound_bytes(seconds: Callable[[float], float], limit: float = 1 << 30) -> float:
    """The largest size whose all-reduce costs at most twice that of a one-byte message.

    Below it an all-reduce is mostly fixed cost, so fusing two such layers nearly halves their
    time. ``seconds(nbytes)`` is the best algorithm's predicted time (non-decreasing in size).
    """
    base = seconds(1.0)
    if base <= 0:
        return 0.0
    lo, hi = 1.0, float(limit)
    if seconds(hi) <= 2 * base:
        return hi
    while hi / lo > 1.01:
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if seconds(mid) <= 2 * base else (lo, mid)
    return lo
