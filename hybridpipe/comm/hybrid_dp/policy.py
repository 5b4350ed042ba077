"""Which algorithm syncs each layer (the hybrid policy of seed 000, or one fixed algorithm).

``hybrid`` asks the partitioner's per-layer policy (``partitioner/layersync.py``): every layer's
all-reduce queues behind the earlier ones on one lane and must finish before the layer's next
forward; picking the cheapest algorithm for each layer's size minimises every finish time, so
small (latency-bound) layers get butterfly and large ones ring or hierarchical, with the
crossover taken from the calibrated cost model. Runs of adjacent layers small enough that their
all-reduce is mostly fixed cost are fused into one sync unit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from hybridpipe.comm.allreduce.api import ALGORITHMS
from hybridpipe.comm.allreduce.costs import AUTO_CANDIDATES, GroupCosts
from hybridpipe.comm.hybrid_dp.units import Layer, group_small, latency_bound_bytes
from hybridpipe.partitioner.layersync import choose_layer_algorithms

POLICIES = ("hybrid",) + ALGORITHMS


@dataclass(frozen=True)
class SyncUnit:
    """Layers whose gradients are summed by one all-reduce, with its algorithm and predicted time."""

    index: int
    layers: tuple[Layer, ...]
    algorithm: str
    predicted_ms: float

    @property
    def name(self) -> str:
        return "+".join(layer.name or "<root>" for layer in self.layers)

    @property
    def params(self) -> tuple:
        return tuple(p for layer in self.layers for p in layer.params)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"unknown sync policy {policy!r}; choose hybrid or one algorithm: {', '.join(ALGORITHMS)}")


def plan_units(layers: Sequence[Layer], policy: str, costs: GroupCosts, *, fuse_small: bool = True,
               forward_ms: Sequence[float] | None = None, backward_ms: Sequence[float] | None = None
               ) -> list[SyncUnit]:
    """Sync units in forward order for ``layers`` (forward order) on the group ``costs`` models.

    ``forward_ms`` / ``backward_ms`` per layer (from a profile) only refine the hybrid policy's
    predicted exposure; the choice of algorithm depends on sizes alone.
    """
    check_policy(policy)
    if not layers:
        return []
    if policy == "hybrid":
        best = lambda nbytes: costs.seconds(costs.fastest(nbytes), nbytes)   # noqa: E731
    else:
        best = lambda nbytes: costs.seconds(policy, nbytes)                    # noqa: E731
    small = latency_bound_bytes(best) if fuse_small else 0.0
    groups = group_small([layer.nbytes for layer in layers], small)
    members = [tuple(layers[i] for i in g) for g in groups]
    sizes = [sum(layer.nbytes for layer in m) for m in members]
    if policy == "hybrid":
        zeros = [0.0] * len(members)
        fwd = _per_group(groups, forward_ms) if forward_ms is not None else zeros
        bwd = _per_group(groups, backward_ms) if backward_ms is not None else zeros
        names = ["+".join(layer.name for layer in m) for m in members]
        chosen = choose_layer_algorithms(names, sizes, bwd, fwd, costs.ranks, costs.model, AUTO_CANDIDATES).layers
        by_name = {c.layer: c for c in chosen}
        return [SyncUnit(i, m, by_name[names[i]].algorithm if names[i] in by_name else costs.fastest(sizes[i]),
                         by_name[names[i]].predicted_ms if names[i] in by_name else 0.0)
                for i, m in enumerate(members)]
    return [SyncUnit(i, m, policy, costs.seconds(policy, sizes[i]) * 1e3) for i, m in enumerate(members)]


def _per_group(groups: list[list[int]], values: Sequence[float]) -> list[float]:
    return [sum(values[i] for i in g) for g in groups]
