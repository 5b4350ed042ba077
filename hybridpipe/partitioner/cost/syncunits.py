"""Sync units and lanes: which layers share one all-reduce, and which run on the second lane.

Once every layer of a replicated stage has its algorithm (``layersync.py``), two more decisions
make the plan's sync complete, and the runtime runs them as written:

* **Fusion.** Adjacent layers with the same algorithm whose all-reduce is mostly fixed cost
  (at most :func:`latency_bound_bytes` together: the size whose all-reduce costs twice a
  one-byte one) share one all-reduce, a *sync unit*, so a run of small layers pays about one
  latency instead of one each. Layers above the bound stay alone (:func:`group_small`). A
  fused all-reduce costs at most the sum of its layers' (costs are affine in the size), so
  per-layer predictions stay an upper bound.
* **Lanes.** All units' all-reduces queue in backward order on one lane; a small unit needed
  early in the next forward (AlexNet's convolutions) would wait behind the big ones backward
  produced just before it (fc1). Such *urgent* units (:func:`urgent_units`) go on a second lane
  that runs beside the first, when their algorithm can run there (:data:`SECOND_LANE_ALGORITHMS`:
  not ``native``, gloo's collective, which two threads must not issue on one group, nor the
  ``aggregator``, one connection per rank). Where it cannot, ``lane_algorithms`` (the comm
  layer's own hybrid policy) gives the cheapest one that can; the partitioner passes none and
  so keeps every algorithm it priced.

Pure functions over sizes and the cost model.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

from hybridpipe.partitioner.cost.costmodel import CostModel

SECOND_LANE_ALGORITHMS = ("ring", "butterfly", "hierarchical", "torus2d")   # may run on sync lane 1
URGENT_RATIO = 8     # a unit is urgent when later-needed units hold >= 8x its bytes (and the largest does)


@dataclass(frozen=True)
class LayerSync:
    """How one layer's gradients are summed across a stage's replicas."""

    layer: str                    # the owning node's name in the profile
    params: tuple[str, ...]       # qualified parameter names (the model's state_dict keys)
    bytes: int                    # gradient bytes
    algorithm: str                # one of ALGORITHMS (collectives.py)
    predicted_ms: float = 0.0     # all-reduce time by the cost model
    exposed_ms: float = 0.0       # how much it delays the stage's next forward (layersync.py's FIFO lane)
    unit: int | None = None       # adjacent layers with one unit number share an all-reduce (None: alone)
    lane: int = 0                 # 0: the main sync lane; 1: the second (syncunits.py)



def sync_units(layers: Sequence[LayerSync]) -> list[tuple[LayerSync, ...]]:
    """``layers`` grouped into sync units: runs of adjacent layers with one ``unit`` number (None: alone)."""
    units: list[list[LayerSync]] = []
    for lv in layers:
        if units and lv.unit is not None and units[-1][-1].unit == lv.unit:
            units[-1].append(lv)
        else:
            units.append([lv])
    return [tuple(u) for u in units]


def group_small(sizes: Sequence[float], small_bytes: float) -> list[list[int]]:
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
    time. ``seconds(nbytes)`` is the algorithm's predicted time (non-decreasing in size).
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


def fuse(layers: Sequence[LayerSync], ranks: Sequence[int], model: CostModel) -> list[list[int]]:
    """Sync units (lists of layer indices, forward order): runs of adjacent layers with one
    algorithm, packed up to that algorithm's latency bound on ``ranks``."""
    units: list[list[int]] = []
    start = 0
    for end in range(1, len(layers) + 1):
        if end < len(layers) and layers[end].algorithm == layers[start].algorithm:
            continue
        bound = latency_bound_bytes(partial(_seconds, model, layers[start].algorithm, ranks))
        units += [[start + i for i in g] for g in group_small([lv.bytes for lv in layers[start:end]], bound)]
        start = end
    return units


def _seconds(model: CostModel, algorithm: str, ranks: Sequence[int], nbytes: float) -> float:
    return model.allreduce_seconds(algorithm, nbytes, ranks)


def assign_units(layers: Sequence[LayerSync], ranks: Sequence[int], model: CostModel, *, fuse_small: bool = True,
                 two_lanes: bool = True, lane_algorithms: Sequence[str] = ()) -> tuple[LayerSync, ...]:
    """``layers`` (forward order, each with its algorithm) with their sync ``unit`` and ``lane``.

    See the module docstring. An urgent unit whose algorithm cannot run on the second lane
    changes algorithm only when ``lane_algorithms`` names candidates (its layers' predicted
    times then follow); otherwise it stays on lane 0.
    """
    units = fuse(layers, ranks, model) if fuse_small else [[i] for i in range(len(layers))]
    urgent = set(urgent_units([sum(layers[i].bytes for i in u) for u in units])) if two_lanes else set()
    lane_ok = [a for a in lane_algorithms if a in SECOND_LANE_ALGORITHMS]
    out = list(layers)
    for k, unit in enumerate(units):
        algorithm, lane = layers[unit[0]].algorithm, 0
        if k in urgent and algorithm in SECOND_LANE_ALGORITHMS:
            lane = 1
        elif k in urgent and lane_ok:
            algorithm, _ = model.fastest_allreduce(sum(layers[i].bytes for i in unit), ranks, lane_ok)
            lane = 1
        for i in unit:
            lv = layers[i]
            predicted = lv.predicted_ms if algorithm == lv.algorithm else \
                model.allreduce_seconds(algorithm, lv.bytes, ranks) * 1e3
            out[i] = dataclasses.replace(lv, algorithm=algorithm, predicted_ms=predicted, unit=k, lane=lane)
    return tuple(out)


def with_algorithm(layers: Sequence[LayerSync], algorithm: str, ranks: Sequence[int], model: CostModel, *,
                   fuse_small: bool = True, two_lanes: bool = True) -> tuple[LayerSync, ...]:
    """Every layer on ``algorithm`` (predicted times recomputed), then units and lanes (one fixed
    algorithm: urgent units go on the second lane only if it can run there)."""
    fixed = [dataclasses.replace(lv, algorithm=algorithm, predicted_ms=model.allreduce_seconds(algorithm, lv.bytes,
                                                                                                ranks) * 1e3)
             for lv in layers]
    return assign_units(fixed, ranks, model, fuse_small=fuse_small, two_lanes=two_lanes)
