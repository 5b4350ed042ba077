"""A model's layers as the gradient sync sees them: each module that owns trainable parameters.

The grouping of layers into sync units and lanes is the partitioner's (``syncunits.py``: the
same rules decide a plan's units and HybridDataParallel's own); ``group_small`` and
``latency_bound_bytes`` are re-exported from there.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from torch import nn

from hybridpipe.partitioner.cost.syncunits import group_small, latency_bound_bytes

__all__ = ["Layer", "model_layers", "group_small", "latency_bound_bytes"]


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
