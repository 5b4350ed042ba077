"""Which algorithm syncs each layer, which layers share an all-reduce, on which lane.

Explicit choices (:class:`UnitChoice`, e.g. a plan's, which the runtime passes as written) are
checked and mapped onto the module's parameters (:func:`units_from_choices`). Otherwise a
policy decides, with the partitioner's rules, so a plan and HybridDataParallel alone decide
alike: ``hybrid`` asks the partitioner's per-layer policy (``partitioner/cost/layersync.py``): every
layer's all-reduce queues behind the earlier ones on one lane and must finish before the layer's
next forward; picking the cheapest algorithm for each layer's size minimises every finish time, so
small (latency-bound) layers get butterfly and large ones ring or hierarchical, with the crossover
taken from the calibrated cost model. A fixed policy gives every layer one algorithm. Then
``partitioner/cost/syncunits.py`` fuses runs of adjacent small layers with one algorithm into one sync
unit and puts *urgent* units (small ones a FIFO lane would queue behind much bigger ones that
backward produced before them, like AlexNet's convolutions behind fc1) on a second lane that runs
beside the first (other message tags, same process group). Both lanes keep a fixed order, so every
rank issues the same sequence on each. The second lane runs the scheduled algorithms only
(``native`` is gloo's collective, which must not be issued from two threads on one group; the
dedicated aggregator takes one connection per rank): under ``hybrid`` an urgent unit takes the
cheapest of those, under a fixed ``native`` or ``aggregator`` policy units keep one lane.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridpipe.comm.allreduce.api import ALGORITHMS
from hybridpipe.comm.allreduce.costs import AUTO_CANDIDATES, GroupCosts
from hybridpipe.comm.hybrid_dp.units import Layer
from hybridpipe.partitioner.cost.layersync import choose_layer_algorithms
from hybridpipe.partitioner.cost.syncunits import (
    SECOND_LANE_ALGORITHMS,
    URGENT_RATIO,
    LayerSync,
    urgent_units,
    with_algorithm,
)

POLICIES = ("hybrid",) + ALGORITHMS
URGENT_CANDIDATES = SECOND_LANE_ALGORITHMS

__all__ = ["POLICIES", "URGENT_CANDIDATES", "URGENT_RATIO", "SyncUnit", "UnitChoice", "check_policy", "plan_units",
           "units_from_choices", "urgent_units"]


@dataclass(frozen=True)
class SyncUnit:
    """Layers whose gradients are summed by one all-reduce, with its algorithm and predicted time."""

    index: int
    layers: tuple[Layer, ...]
    algorithm: str
    predicted_ms: float
    lane: int = 0                  # 0: the main lane; 1: the urgent lane (see the module docstring)
    label: str = ""                # the caller's name for it (e.g. the plan's layers); default: the modules'

    @property
    def name(self) -> str:
        return self.label or "+".join(layer.name or "<root>" for layer in self.layers)

    @property
    def params(self) -> tuple:
        return tuple(p for layer in self.layers for p in layer.params)

    @property
    def param_names(self) -> tuple[str, ...]:
        return tuple(n for layer in self.layers for n in layer.param_names)

    @property
    def nbytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)


@dataclass(frozen=True)
class UnitChoice:
    """One all-reduce as the caller wants it: the parameters it sums (qualified names, as the
    wrapped module's ``named_parameters()`` gives them), the algorithm and the lane."""

    params: tuple[str, ...]
    algorithm: str
    lane: int = 0
    name: str = ""
    predicted_ms: float = 0.0


def check_policy(policy: str) -> None:
    if policy not in POLICIES:
        raise ValueError(f"unknown sync policy {policy!r}; choose hybrid or one algorithm: {', '.join(ALGORITHMS)}")


def units_from_choices(layers: Sequence[Layer], choices: Sequence[UnitChoice]) -> list[SyncUnit]:
    """Sync units that run ``choices`` as given (in order) on ``layers`` (``model_layers``).

    Every trainable parameter (but empty ones) must be in exactly one choice; ValueError (one line) otherwise, or
    for an unknown algorithm or lane, or a second-lane unit with an algorithm that cannot run there.
    """
    owner: dict[str, int] = {}
    for i, c in enumerate(choices):
        if c.algorithm not in ALGORITHMS:
            raise ValueError(f"sync unit {c.name or i}: unknown all-reduce algorithm {c.algorithm!r}; "
                             f"choose from {', '.join(ALGORITHMS)}")
        if c.lane not in (0, 1) or (c.lane == 1 and c.algorithm not in URGENT_CANDIDATES):
            raise ValueError(f"sync unit {c.name or i}: lane {c.lane} cannot run {c.algorithm} "
                             f"(lane 1 runs {', '.join(URGENT_CANDIDATES)}; lane 0 any)")
        for p in c.params:
            if p in owner:
                raise ValueError(f"parameter {p!r} is in sync units {owner[p]} and {i}; give it one")
            owner[p] = i
    pieces: list[list[Layer]] = [[] for _ in choices]
    known = set()
    for layer in layers:
        by_unit: dict[int, list[int]] = {}
        for k, name in enumerate(layer.param_names):
            known.add(name)
            if name not in owner:
                if layer.params[k].numel() == 0:          # nothing to sum
                    continue
                raise ValueError(f"parameter {name!r} is in no sync unit; every trainable parameter needs one")
            by_unit.setdefault(owner[name], []).append(k)
        for unit, ks in by_unit.items():
            pieces[unit].append(Layer(layer.name, layer.module, tuple(layer.params[k] for k in ks),
                                      tuple(layer.param_names[k] for k in ks)))
    unknown = sorted(set(owner) - known)
    if unknown:
        raise ValueError(f"sync units name parameter {unknown[0]!r}, which the module has not (or not trainable)")
    return [SyncUnit(i, tuple(pieces[i]), c.algorithm, c.predicted_ms, c.lane, c.name)
            for i, c in enumerate(choices) if pieces[i]]


def plan_units(layers: Sequence[Layer], policy: str, costs: GroupCosts, *, fuse_small: bool = True,
               forward_ms: Sequence[float] | None = None, backward_ms: Sequence[float] | None = None,
               two_lanes: bool = True) -> list[SyncUnit]:
    """Sync units in forward order for ``layers`` (forward order) on the group ``costs`` models.

    ``forward_ms`` / ``backward_ms`` per layer (from a profile) only refine the hybrid policy's
    predicted exposure; the choice of algorithm depends on sizes alone. ``two_lanes``: urgent
    units may go on lane 1 (see the module docstring).
    """
    check_policy(policy)
    if not layers:
        return []
    names = [layer.name for layer in layers]
    sizes = [layer.nbytes for layer in layers]
    params = [layer.param_names for layer in layers]
    zeros = [0.0] * len(layers)
    if policy == "hybrid":
        chosen = choose_layer_algorithms(names, sizes, backward_ms or zeros, forward_ms or zeros, costs.ranks,
                                         costs.model, AUTO_CANDIDATES, params=params, fuse_small=fuse_small,
                                         two_lanes=two_lanes, lane_algorithms=URGENT_CANDIDATES).layers
    else:
        chosen = with_algorithm([LayerSync(n, tuple(p), b, policy) for n, p, b in zip(names, params, sizes,
                                                                                      strict=True) if b > 0],
                                policy, costs.ranks, costs.model, fuse_small=fuse_small, two_lanes=two_lanes)
    choices: list[tuple[int | None, list[LayerSync]]] = []
    for lv in chosen:
        if choices and lv.unit == choices[-1][0]:
            choices[-1][1].append(lv)
        else:
            choices.append((lv.unit, [lv]))
    return units_from_choices(layers, [
        UnitChoice(tuple(p for lv in grp for p in lv.params), grp[0].algorithm, grp[0].lane, "",
                   costs.seconds(grp[0].algorithm, sum(lv.bytes for lv in grp)) * 1e3) for _, grp in choices])
