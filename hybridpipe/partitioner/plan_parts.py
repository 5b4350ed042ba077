"""A plan's parts (plan.py describes the format): its stages with their layers' syncs, its tied
groups and the optimal strategy's search record, and reading each from JSON, every defect a
one-line UserError naming where it is."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from hybridpipe.errors import UserError
from hybridpipe.jsonfile import MAX_PLAN_FIGURE, field, figure
from hybridpipe.partitioner.cost import collectives as co
from hybridpipe.partitioner.cost.syncunits import SECOND_LANE_ALGORITHMS, LayerSync, sync_units

# What a stage's replicas shard (ZeRO): none (each replica holds everything), optimizer (ZeRO-1: each keeps
# and updates 1/R of the optimizer state), gradients (ZeRO-2: and 1/R of the reduced gradients), parameters
# (ZeRO-3: and 1/R of the weights, gathered for use).
SHARD_LEVELS = ("none", "optimizer", "gradients", "parameters")


@dataclass(frozen=True)
class TiedGroup:
    """A parameter read by several stages (tied weights): each holds a copy, and every step the
    copies' gradients are summed over all ranks of those stages, so the copies stay identical."""

    param: str                    # the parameter's name in the model (its first name in named_parameters)
    stages: tuple[int, ...]       # the stages that read it (ascending)
    bytes: int                    # its gradient's bytes
    predicted_ms: float = 0.0     # the all-reduce over those stages' ranks, by the cost model


@dataclass(frozen=True)
class Stage:
    """One stage of a plan: its nodes, the ranks of its replicas, its per-layer all-reduces and predicted figures."""

    index: int
    first_node: int
    last_node: int
    replicas: int
    ranks: tuple[int, ...]
    compute_ms: float = 0.0       # forward + backward of one micro-batch on one replica
    forward_ms: float = 0.0       # the forward part of compute_ms
    backward_ms: float = 0.0      # the backward part of compute_ms
    sync_ms: float = 0.0          # exposed sync per step: layers' exposed_ms summed, x syncs per step
    #                               (1 for gpipe/1f1b; pipedream syncs after each of a replica's minibatches)
    send_ms: float = 0.0          # one micro-batch's activations to the next stage (latency; grads likewise)
    send_bytes: int = 0           # bytes crossing the cut after this stage per micro-batch (one way)
    memory_bytes: int = 0         # predicted peak memory per worker
    transient_bytes: int = 0      # of it, kernels' temporaries at the worst moment (an allocator's peak sees them)
    layers: tuple[LayerSync, ...] = ()
    overhead_ms: float = 0.0      # per step: optimizer steps + compute lost to communication (objective.py)
    ring_ms: float = 0.0          # of overhead_ms: the compute lost beside the replicas' own collectives
    overlapped_ring_ms: float = 0.0   # of ring_ms: the part lost while compute ran (the rest takes none from it)
    recompute: bool = False       # drop inner activations after forward, recompute them in backward
    shard: str = "none"           # what the replicas shard (SHARD_LEVELS): none, optimizer, gradients, parameters
    reshard_after_forward: bool = True    # shard "parameters": free gathered weights after each forward

    def sync_units(self) -> list[tuple[LayerSync, ...]]:
        """The layers grouped into sync units (one all-reduce each), in order."""
        return sync_units(self.layers)


@dataclass(frozen=True)
class SearchRecord:
    """How the optimal strategy found the stages: searched to the optimum (``complete``), or stopped
    by its time budget with the best plan found so far. ``objective_ms``: that plan's steady-state
    step; ``lower_bound_ms``: no plan's is below it; ``gap``: objective / lower bound - 1, the most
    the plan can be slower than the optimum (0 when complete; None: no bound proven yet)."""

    complete: bool
    seconds: float                      # the search's wall-clock time
    budget_s: float | None              # --time-budget (None: none)
    objective_ms: float
    lower_bound_ms: float
    gap: float | None


def plan_figure(obj: dict, key: str, kind: type, where: str, default: Any = ...) -> Any:
    """A predicted figure of the plan: a number from 0 to MAX_PLAN_FIGURE."""
    return figure(obj, key, kind, where, maximum=MAX_PLAN_FIGURE, default=default)


def search_from_dict(d: object, where: str) -> SearchRecord | None:
    """A plan's ``search`` record from JSON (None when absent); UserError naming a malformed field."""
    if d is None:
        return None
    if not isinstance(d, dict):
        raise UserError(f"{where}: expected an object or null")
    gap = None if d.get("gap") is None else plan_figure(d, "gap", float, where)
    return SearchRecord(complete=field(d, "complete", bool, where), seconds=plan_figure(d, "seconds", float, where),
                        budget_s=None if d.get("budget_s") is None else plan_figure(d, "budget_s", float, where),
                        objective_ms=plan_figure(d, "objective_ms", float, where),
                        lower_bound_ms=plan_figure(d, "lower_bound_ms", float, where), gap=gap)


def tied_from_dict(t: object, i: int, source: str) -> TiedGroup:
    """Tied group ``i`` of a plan from JSON; UserError naming a malformed field."""
    where = f"{source}: tied group {i}"
    if not isinstance(t, dict):
        raise UserError(f"{where}: expected an object")
    stages = field(t, "stages", list, where)
    if len(stages) < 2 or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in stages):
        raise UserError(f"{where}: \"stages\" must list at least two stage indices")
    return TiedGroup(param=field(t, "param", str, where), stages=tuple(sorted(stages)),
                     bytes=plan_figure(t, "bytes", int, where),
                     predicted_ms=plan_figure(t, "predicted_ms", float, where, default=0.0))


def layer_dict(lv: LayerSync) -> dict:
    """A layer's all-reduce choice as a JSON object."""
    d = dict(asdict(lv), params=list(lv.params))
    if lv.unit is None:
        del d["unit"]
    return d


# a stage's figures as plans write them (0 where absent), read in this order
STAGE_FIGURES: tuple[tuple[str, type], ...] = (
    ("compute_ms", float), ("forward_ms", float), ("backward_ms", float), ("sync_ms", float), ("send_ms", float),
    ("send_bytes", int), ("memory_bytes", int), ("transient_bytes", int), ("overhead_ms", float), ("ring_ms", float),
    ("overlapped_ring_ms", float))


def stage_from_dict(s: object, i: int, source: str) -> Stage:
    """Stage ``i`` of a plan from JSON; UserError naming a malformed field."""
    where = f"{source}: stage {i}"
    if not isinstance(s, dict):
        raise UserError(f"{where}: expected an object")
    ranks = field(s, "ranks", list, where)
    if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks):
        raise UserError(f"{where}: \"ranks\" must be a list of non-negative integers")
    layers = []
    for j, lv in enumerate(field(s, "layers", list, where, default=[])):
        lw = f"{where}: layer {j}"
        if not isinstance(lv, dict):
            raise UserError(f"{lw}: expected an object")
        layers.append(_layer_from_dict(lv, lw))
    _check_layers(layers, where)
    stage = Stage(index=field(s, "index", int, where, minimum=0),
                 first_node=field(s, "first_node", int, where, minimum=0),
                 last_node=field(s, "last_node", int, where, minimum=0),
                 replicas=field(s, "replicas", int, where, minimum=1),
                 ranks=tuple(ranks),
                 **{name: plan_figure(s, name, kind, where, default=kind(0)) for name, kind in STAGE_FIGURES},
                 layers=tuple(layers),
                 recompute=field(s, "recompute", bool, where, default=False),
                 shard=field(s, "shard", str, where, default="none", choices=SHARD_LEVELS),
                 reshard_after_forward=field(s, "reshard_after_forward", bool, where, default=True))
    if stage.shard != "none" and stage.replicas == 1:
        raise UserError(f"{where}: shard {stage.shard!r} needs replicas to shard over, and the stage has one; "
                        "set \"shard\": \"none\" or re-partition with replicas")
    return stage


def _layer_from_dict(lv: dict, where: str) -> LayerSync:
    name = field(lv, "layer", str, where)
    where = f"{where} ({name!r})"
    params = field(lv, "params", list, where)
    if not all(isinstance(p, str) for p in params):
        raise UserError(f"{where}: \"params\" must be a list of parameter names")
    algorithm = field(lv, "algorithm", str, where)
    if algorithm not in co.ALGORITHMS:
        raise UserError(f"{where}: unknown all-reduce algorithm {algorithm!r}; use one of {', '.join(co.ALGORITHMS)}")
    lane = field(lv, "lane", int, where, default=0, choices=(0, 1))
    if lane == 1 and algorithm not in SECOND_LANE_ALGORITHMS:
        raise UserError(f"{where}: {algorithm} cannot run on sync lane 1 (only {', '.join(SECOND_LANE_ALGORITHMS)} "
                        "can); set \"lane\": 0")
    return LayerSync(layer=name, params=tuple(params), bytes=plan_figure(lv, "bytes", int, where),
                     algorithm=algorithm,
                     predicted_ms=plan_figure(lv, "predicted_ms", float, where, default=0.0),
                     exposed_ms=plan_figure(lv, "exposed_ms", float, where, default=0.0),
                     unit=field(lv, "unit", int, where, minimum=0, default=None), lane=lane)


def _check_layers(layers: list[LayerSync], where: str) -> None:
    """Each parameter synced once; a unit is a run of adjacent layers with one algorithm and lane."""
    owner: dict[str, str] = {}
    for lv in layers:
        for p in lv.params:
            if p in owner:
                raise UserError(f"{where}: parameter {p!r} is synced by two layers, {owner[p]!r} and {lv.layer!r}; "
                                "keep it in one")
            owner[p] = lv.layer
    seen: dict[int, LayerSync] = {}
    for k, lv in enumerate(layers):
        if lv.unit is None:
            continue
        first = seen.setdefault(lv.unit, lv)
        if first is not lv and layers[k - 1].unit != lv.unit:
            raise UserError(f"{where}: sync unit {lv.unit} holds {first.layer!r} and {lv.layer!r}, which are not "
                            "adjacent; a unit is a run of adjacent layers (renumber the units)")
        if (first.algorithm, first.lane) != (lv.algorithm, lv.lane):
            raise UserError(f"{where}: layers {first.layer!r} and {lv.layer!r} share sync unit {lv.unit} but not their "
                            f"algorithm and lane ({first.algorithm}/{first.lane} vs {lv.algorithm}/{lv.lane}); give "
                            "them the same, or different units")
