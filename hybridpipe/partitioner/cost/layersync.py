"""The hybrid per-layer all-reduce policy (seed 000), made quantitative.

A replicated stage's backward runs its layers last to first; each layer's gradient is ready when
its backward ends and its all-reduce starts then, queued behind earlier ones on a single
communication lane. The layer is needed again at its next forward, which starts after the whole
backward (plus the forward of the layers before it). The wait a layer's forward makes for its own
sync delays every later forward, so the stage's exposed (non-overlapped) sync time is the largest
lateness ``finish_l - needed_l`` over the layers (0 if all syncs finish in time).

Which algorithm per layer? Every finish time grows with every earlier layer's all-reduce time
on the lane and with the layer's own, so picking the fastest algorithm for each layer's size
minimises all finish times at once, and hence the exposed time: an exchange argument, checked
against brute force over all assignments in the tests. That is the hybrid policy: butterfly
(latency-bound) for small layers, ring or hierarchical (bandwidth-bound) for large ones, with
the crossover taken from the (calibrated) cost model, not a fixed threshold.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from hybridpipe.partitioner.cost.collectives import ALGORITHMS
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.cost.syncunits import LayerSync, assign_units

# per-layer numbers: a list, or a slice of the model costs' arrays
Floats = Sequence[float] | np.ndarray


@dataclass(frozen=True)
class LaneResult:
    """Per-layer (forward order) finish time and incremental exposed time; their total."""

    finish_ms: tuple[float, ...]
    exposed_ms: tuple[float, ...]
    total_exposed_ms: float


@dataclass(frozen=True)
class StageSync:
    """The chosen algorithm per synchronised layer and the stage's exposed sync time per sync."""

    layers: tuple[LayerSync, ...]
    exposed_ms: float
    busy_ms: float                # sum of all-reduce times (the lane's busy time)


def simulate_lane(sync_ms: Sequence[float], backward_ms: Floats, forward_ms: Floats, gap_ms: float = 0.0) -> LaneResult:
    """Queue the layers' all-reduces (``sync_ms``; 0 = nothing to sync) on one lane.

    All lists are in forward order. Time 0 is the start of the stage's backward; the next
    forward starts ``gap_ms`` after the backward ends (a pipeline's drain and fill).
    """
    n = len(sync_ms)
    finish = [0.0] * n
    t = lane = 0.0
    ready = [0.0] * n
    for k in range(n - 1, -1, -1):
        t += backward_ms[k]
        ready[k] = t
    for k in range(n - 1, -1, -1):
        if sync_ms[k] > 0:
            lane = max(lane, ready[k]) + sync_ms[k]
            finish[k] = lane
    needed = t + gap_ms                         # the next forward starts when the backward ends (+ gap)
    delay = 0.0
    exposed = [0.0] * n
    for k in range(n):
        if sync_ms[k] > 0:
            late = max(delay, finish[k] - needed)
            exposed[k] = late - delay
            delay = late
        needed += forward_ms[k]
    return LaneResult(tuple(finish), tuple(exposed), delay)


def choose_layer_algorithms(names: Sequence[str], nbytes: Floats, backward_ms: Floats, forward_ms: Floats,
                            ranks: Sequence[int], model: CostModel,
                            algorithms: Sequence[str] = ALGORITHMS,
                            params: Sequence[Sequence[str]] | None = None, gap_ms: float = 0.0, *,
                            fuse_small: bool = True, two_lanes: bool = True,
                            lane_algorithms: Sequence[str] = (),
                            fastest: Callable[[float, Sequence[int]], tuple[str, float]] | None = None) -> StageSync:
    """The hybrid policy for one replicated stage or data-parallel model (what HDP calls).

    ``names``, ``nbytes`` (gradient bytes, 0 for layers without parameters), ``backward_ms`` and
    ``forward_ms`` are per layer in forward order; ``ranks`` the global ranks that sum them;
    ``gap_ms`` idle time between the end of the backward and the next forward (0 for plain data
    parallelism). Returns a LayerSync (algorithm, predicted and exposed ms, sync unit and lane:
    ``syncunits.assign_units`` with the keyword arguments) for every layer with bytes to sync.
    The exposed times are those of the single lane, layer by layer: fused units and the second
    lane only shorten what the layers wait. ``fastest(nbytes, ranks)``: (algorithm, seconds) of a
    layer's sync (default the cheapest all-reduce; a sharded stage's reduce-scatter + all-gather:
    ``sharded.fastest_pair``).
    """
    if len(ranks) <= 1:
        return StageSync((), 0.0, 0.0)
    algos, sync = [], []
    for b in nbytes:
        if b > 0:
            a, s = model.fastest_allreduce(b, ranks, algorithms) if fastest is None else fastest(b, ranks)
            algos.append(a)
            sync.append(s * 1e3)
        else:
            algos.append("")
            sync.append(0.0)
    lane = simulate_lane(sync, backward_ms, forward_ms, gap_ms)
    params = params or [()] * len(names)
    layers = tuple(LayerSync(names[k], tuple(params[k]), int(nbytes[k]), algos[k], sync[k], lane.exposed_ms[k])
                   for k in range(len(names)) if nbytes[k] > 0)
    layers = assign_units(layers, ranks, model, fuse_small=fuse_small, two_lanes=two_lanes,
                          lane_algorithms=lane_algorithms)
    return StageSync(layers, lane.total_exposed_ms, sum(sync))


def plan_layer_syncs(nodes: Sequence, ranks: Sequence[int], model: CostModel,
                     algorithms: Sequence[str] = ALGORITHMS, gap_ms: float = 0.0) -> StageSync:
    """The policy for a stage's profile nodes (anything with name, params, param_bytes, forward_ms, backward_ms)."""
    return choose_layer_algorithms([n.name for n in nodes], [n.param_bytes for n in nodes],
                                   [n.backward_ms for n in nodes], [n.forward_ms for n in nodes], ranks, model,
                                   algorithms, params=[n.params for n in nodes], gap_ms=gap_ms)
