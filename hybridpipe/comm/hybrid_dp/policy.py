"""Which algorithm syncs each layer (the hybrid policy of seed 000, or one fixed algorithm).

``hybrid`` asks the partitioner's per-layer policy (``partitioner/layersync.py``): every layer's
all-reduce queues behind the earlier ones on one lane and must finish before the layer's next
forward; picking the cheapest algorithm for each layer's size minimises every finish time, so
small (latency-bound) layers get butterfly and large ones ring or hierarchical, with the
crossover taken from the calibrated cost model. Runs of adjacent layers small enough that their
all-reduce is mostly fixed cost are fused into one sync unit.

Two lanes: on one FIFO lane a small layer needed early in the next forward (conv1) waits behind
the big ones that backward produced before it (fc1's 151 MB in AlexNet), so the next forward
cannot start until all communication is done. Such *urgent* units (:func:`urgent_units`) go on a
second lane that runs beside the first (other message tags, same process group): they share the
links with the big syncs for a short while, and the forward of the early layers overlaps the big
syncs' remainder. Both lanes keep a fixed order, so every rank issues the same sequence on each.
Urgent units use the scheduled algorithms only (``native`` is gloo's collective, which must not
be issued from two threads on one group; the dedicated aggregator takes one connection per rank).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridpipe.comm.allreduce.api import ALGORITHMS
from hybridpipe.comm.allreduce.costs import AUTO_CANDIDATES, GroupCosts
from hybridpipe.comm.hybrid_dp.units import Layer, group_small, latency_bound_bytes
from hybridpipe.partitioner.layersync import choose_layer_algorithms

POLICIES = ("hybrid",) + ALGORITHMS
URGENT_CANDIDATES = ("ring", "butterfly", "hierarchical", "torus2d")
URGENT_RATIO = 8          # a unit is urgent when later-needed units hold >= 8x its bytes (and the largest does)


@dataclass(frozen=True)
class SyncUnit:
    """Layers whose gradients are summed by one all-reduce, with its algorithm and predicted time."""

    index: int
    layers: tuple[Layer, ...]
    algorithm: str
    predicted_ms: float
    lane: int = 0                  # 0: the main lane; 1: the urgent lane (see the module docstring)

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


def urgent_units(sizes: Sequence[float], ratio: float = URGENT_RATIO) -> list[int]:
    """Indices (forward order) of units that a FIFO lane would queue behind much bigger later ones.

    Unit i is urgent when the units after it in forward order (which backward produces, and a
    FIFO lane syncs, before it) hold at least ``ratio`` times its bytes, and so does the largest
    unit alone: a model of equal layers has none, AlexNet's convolutions are all urgent.
    """
    largest = max(sizes, default=0)
    out, later = [], 0.0
    for i in range(len(sizes) - 1, -1, -1):
        if 0 < sizes[i] and sizes[i] * ratio <= later and sizes[i] * ratio <= largest:
            out.append(i)
        later += sizes[i]
    return sorted(out)


def plan_units(layers: Sequence[Layer], policy: str, costs: GroupCosts, *, fuse_small: bool = True,
               forward_ms: Sequence[float] | None = None, backward_ms: Sequence[float] | None = None,
               two_lanes: bool = True) -> list[SyncUnit]:
    """Sync units in forward order for ``layers`` (forward order) on the group ``costs`` models.

    ``forward_ms`` / ``backward_ms`` per layer (from a profile) only refine the hybrid policy's
    predicted exposure; the choice of algorithm depends on sizes alone. ``two_lanes``: urgent
    units (:func:`urgent_units`) go on lane 1 with a scheduled algorithm (not with a fixed
    ``native`` or ``aggregator`` policy, which keep one lane).
    """
    units = _plan_one_lane(layers, policy, costs, fuse_small, forward_ms, backward_ms)
    if not two_lanes or policy in ("native", "aggregator"):
        return units
    urgent = set(urgent_units([u.nbytes for u in units]))
    out = []
    for u in units:
        if u.index in urgent:
            algo = costs.fastest(u.nbytes, URGENT_CANDIDATES) if policy == "hybrid" else policy
            u = SyncUnit(u.index, u.layers, algo, costs.seconds(algo, u.nbytes) * 1e3, lane=1)
        out.append(u)
    return out


def _plan_one_lane(layers: Sequence[Layer], policy: str, costs: GroupCosts, fuse_small: bool,
                   forward_ms: Sequence[float] | None, backward_ms: Sequence[float] | None) -> list[SyncUnit]:
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
