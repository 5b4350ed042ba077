"""Refinement of the replicas' all-reduces from the runs' sync waits (issue 18; see refinement.py).

A replicated stage's measured wait for its gradients after its last backward is compared with
the per-layer lane of ``layersync.py``: each layer's all-reduce (the algorithm it ran, priced by
the model) queued as the backward frees it. Each stage's evidence is first the common factor on
its all-reduce times that makes the lane's wait equal the measured one; it belongs to the size
class (powers of 4 bytes) of its layers' bytes. A class's factor starts as the weighted
geometric mean of its estimates; then, since the model applies the classes' factors to each
layer by its own size (log-log between the classes), the factors are refitted until every
stage's lane, with each layer at its interpolated factor, waits what it measured (each round
multiplies a class's factor by the weighted geometric mean of what its stages still need).
With stages of several replica counts the classes are fitted per group size (:func:`fit_groups`), since the
model already prices each size's structure and what is left differs by size (``cost/groupfactor.py``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from hybridpipe.partitioner.cost.costmodel import CostModel, size_factor
from hybridpipe.partitioner.cost.layersync import Floats, simulate_lane
from hybridpipe.partitioner.plan import ALGORITHMS
from hybridpipe.partitioner.refine.observed import StageObservation
from hybridpipe.partitioner.search.modelcosts import ModelCosts

SIZE_CLASS_BASE = 4.0          # all-reduce size classes: [4^k, 4^(k+1)) bytes
FACTOR_RANGE = (1 / 64, 64.0)  # the all-reduce factor is solved within this range
CLASS_ROUNDS = 30              # refitting rounds of the classes' factors
GROUP_ROUNDS = 10              # alternating rounds of the classes and the group sizes (fit_groups)


@dataclass(frozen=True)
class SyncEvidence:
    """One replicated stage of one run: what its sync wait says about its all-reduces."""

    run: str
    stage: int
    nbytes: float                # the stage's layers' bytes (geometric mean weighted by all-reduce time)
    allreduce_ms: float          # the model's all-reduce time of its layers per step (the lane's busy time)
    predicted_wait_ms: float     # the lane's wait with the model's all-reduce times
    measured_wait_ms: float
    factor: float
    sync_ms: tuple[float, ...] = ()       # per node of the stage: the model's all-reduce time (0: no weights)
    sizes: tuple[float, ...] = ()         # its bytes
    backward_ms: tuple[float, ...] = ()   # the lane's backward and forward per node
    forward_ms: tuple[float, ...] = ()
    ranks: int = 0                        # the replicas (the all-reduces' group size); 0: unknown


def lane_wait_ms(sync_ms: Sequence[float], backward_ms: Floats, forward_ms: Floats) -> float:
    """How long the stage waits after its backward for the last all-reduce on the lane (0: all hidden)."""
    if not any(s > 0 for s in sync_ms):
        return 0.0
    lane = simulate_lane(sync_ms, backward_ms, forward_ms, 0.0)
    return max(0.0, max(lane.finish_ms) - float(sum(backward_ms)))


def solve_factor(wait_of: Callable[[float], float], measured_ms: float, lo: float = FACTOR_RANGE[0],
                 hi: float = FACTOR_RANGE[1]) -> float:
    """The factor f (within [lo, hi]) whose lane wait ``wait_of(f)`` (nondecreasing) equals ``measured_ms``.

    Where the measured wait is 0, the largest f whose wait is still 0 (within a microsecond)."""
    if wait_of(hi) <= measured_ms:
        return hi
    if wait_of(lo) > max(measured_ms, 1e-3):
        return lo
    a, b = math.log(lo), math.log(hi)
    for _ in range(80):
        mid = (a + b) / 2
        if wait_of(math.exp(mid)) <= max(measured_ms, 1e-3):
            a = mid
        else:
            b = mid
    return math.exp((a + b) / 2)


def stage_sync_evidence(run: str, index: int, st: StageObservation, costs: ModelCosts, model: CostModel,
                        f_fwd: np.ndarray, f_bwd: np.ndarray, algorithms: Sequence[str]) -> SyncEvidence | None:
    """The all-reduce factor one replicated stage's measured wait implies (None: it says nothing)."""
    if len(st.ranks) < 2 or st.sync_wait_ms is None or st.backward_ms is None:
        return None
    nodes = range(st.first, st.last + 1)
    sync_ms = []
    for i in nodes:
        nbytes = float(costs.param_bytes[i])
        if nbytes <= 0:
            sync_ms.append(0.0)
            continue
        algo = st.algorithms.get(costs.names[i])
        if algo not in ALGORITHMS:
            algo = model.fastest_allreduce(nbytes, st.ranks, algorithms)[0]
        sync_ms.append(model.allreduce_seconds(algo, nbytes, st.ranks) * 1e3)
    busy = sum(sync_ms)
    if busy <= 0:
        return None
    bwd = np.array([costs.backward_ms[i] * f_bwd[i] for i in nodes])
    fwd = np.array([costs.forward_ms[i] * f_fwd[i] for i in nodes])
    bwd = bwd * (st.backward_ms / bwd.sum()) if bwd.sum() > 0 else np.full(len(bwd), st.backward_ms / len(bwd))
    predicted = lane_wait_ms(sync_ms, bwd, fwd)
    noise = max(0.2, 0.01 * busy)                  # waits this short are the call's own cost, not the lane's
    if st.sync_wait_ms <= noise and predicted <= noise:
        return None
    factor = solve_factor(lambda f: lane_wait_ms([s * f for s in sync_ms], bwd, fwd), st.sync_wait_ms)
    weights = [s for s in sync_ms if s > 0]
    sizes = [float(costs.param_bytes[i]) for i, s in zip(nodes, sync_ms, strict=True) if s > 0]
    nbytes = math.exp(sum(w * math.log(b) for w, b in zip(weights, sizes, strict=True)) / busy)
    return SyncEvidence(run, index, nbytes, busy, float(predicted), st.sync_wait_ms, factor, tuple(sync_ms),
                        tuple(float(costs.param_bytes[i]) for i in nodes), tuple(float(x) for x in bwd),
                        tuple(float(x) for x in fwd), len(st.ranks))


def size_classes(evidence: Sequence[SyncEvidence]) -> tuple[tuple[float, float], ...]:
    """(bytes, factor) per size class: weighted geometric means of the estimates in each class."""
    classes: dict[int, list[SyncEvidence]] = {}
    for e in evidence:
        classes.setdefault(math.floor(math.log(max(e.nbytes, 1.0), SIZE_CLASS_BASE)), []).append(e)
    out = []
    for k in sorted(classes):
        group = classes[k]
        total = sum(e.allreduce_ms for e in group)
        nbytes = math.exp(sum(e.allreduce_ms * math.log(e.nbytes) for e in group) / total)
        factor = math.exp(sum(e.allreduce_ms * math.log(e.factor) for e in group) / total)
        out.append((nbytes, factor))
    return tuple(out)


def size_class(nbytes: float) -> int:
    return math.floor(math.log(max(nbytes, 1.0), SIZE_CLASS_BASE))


def needed_factor(e: SyncEvidence, points: Sequence[tuple[float, float]]) -> float:
    """What ``e``'s all-reduces still need on top of the classes' interpolated factors."""
    if not e.sync_ms:
        return e.factor / (dict(points).get(e.nbytes, e.factor) or 1.0)
    base = [s * float(size_factor(points, b)) for s, b in zip(e.sync_ms, e.sizes, strict=True)]
    bwd, fwd = np.array(e.backward_ms), np.array(e.forward_ms)
    return solve_factor(lambda f: lane_wait_ms([x * f for x in base], bwd, fwd), e.measured_wait_ms)


def fit_classes(evidence: Sequence[SyncEvidence]) -> tuple[tuple[float, float], ...]:
    """(bytes, factor) per size class that reproduce every stage's measured wait (module docstring)."""
    points = list(size_classes(evidence))
    if len(points) < 2:
        return tuple(points)
    for _ in range(CLASS_ROUNDS):
        moved = 0.0
        for k, (nbytes, factor) in enumerate(points):
            mine = [e for e in evidence if size_class(e.nbytes) == size_class(nbytes)]
            total = sum(e.allreduce_ms for e in mine)
            step = math.exp(sum(e.allreduce_ms * math.log(needed_factor(e, points)) for e in mine) / total)
            lo, hi = FACTOR_RANGE
            points[k] = (nbytes, min(hi, max(lo, factor * step)))
            moved = max(moved, abs(math.log(step)))
        if moved < 1e-3:
            break
    return tuple(points)


def fit_groups(evidence: Sequence[SyncEvidence]) -> tuple[tuple[int, tuple[tuple[float, float], ...]], ...]:
    """Per group size (replicas) of the evidence, (bytes, factor) per size class; () where every stage had the
    same size (the pooled classes of :func:`fit_classes` are then the same thing).

    Separable in log: ``log factor(class, g) = u(class) + v(g)``, so each group size gets every class (a size
    class seen only on 2-replica stages still prices an 8-rank all-reduce of that size) and each group size
    its own level. Alternating: ``u`` is :func:`fit_classes` on the evidence with each stage's all-reduces
    scaled by its group's ``exp(v)``; ``v(g)`` the weighted geometric mean of what g's stages still need on
    top of ``u`` (:func:`needed_factor`); ``v`` normalised to a weighted mean of 0."""
    sizes = sorted({e.ranks for e in evidence if e.ranks >= 2})
    if len(sizes) < 2:
        return ()
    level = dict.fromkeys(sizes, 0.0)
    points = fit_classes(evidence)
    for _ in range(GROUP_ROUNDS):
        scaled = [replace(e, sync_ms=tuple(x * math.exp(level[e.ranks]) for x in e.sync_ms)) if e.ranks in level
                  else e for e in evidence]
        points = fit_classes(scaled) if all(e.sync_ms for e in evidence) else points
        new = {}
        for g in sizes:
            mine = [e for e in evidence if e.ranks == g]
            total = sum(e.allreduce_ms for e in mine)
            new[g] = sum(e.allreduce_ms * math.log(needed_factor(e, points)) for e in mine) / total
        weights = {g: sum(e.allreduce_ms for e in evidence if e.ranks == g) for g in sizes}
        mean = sum(weights[g] * new[g] for g in sizes) / sum(weights.values())
        new = {g: v - mean for g, v in new.items()}
        moved = max(abs(new[g] - level[g]) for g in sizes)
        level = new
        if moved < 1e-3:
            break
    lo, hi = FACTOR_RANGE
    return tuple((g, tuple((b, min(hi, max(lo, f * math.exp(level[g])))) for b, f in points)) for g in sizes)

