"""The Plan (``hybridpipe partition`` output, JSON ``"format": 1``), read as is by launch.py.

Semantics every package relies on:

* A stage is a contiguous range ``first_node..last_node`` (inclusive) of the profile's nodes in
  topological order. Stage 0 holds the input placeholder, the last stage the ``output`` node:
  it ends at node ``graph_nodes - 1`` (the profile's node count; plans without the field: not
  checked until launch captures the model).
* A stage with ``replicas`` r runs on ``ranks`` (r global ranks); micro-batch m goes to
  replica ``m % r`` of every stage (round-robin).
* Virtual stages (``virtual_stages`` V > 1, schedules interleaved-1f1b and zbv): ``stages`` lists
  all p*V model chunks in model order, and the same rank tuple (a rank group) runs V of them, laid
  out as the schedule says (``schedule_registry.Layout``: interleaved-1f1b puts stage s on group
  s % p; zbv (V = 2) on group s for s < p, on group 2p-1-s after). Groups are disjoint; a rank's
  replica index is the same in each of its stages. Plans without the field have V = 1.
* One training step = ``micro_batches`` micro-batches of the profile's ``batch_size`` samples
  each. ``gpipe`` and ``1f1b`` flush at the end of the step and give the same update as one
  SGD step on the concatenated global batch; ``pipedream`` never flushes (weight stashing).
* Replicas of a stage sum their gradients as ``layers`` says, and the runtime does exactly that:
  each layer (a profile node; ``params`` are its parameters' state_dict names) has an
  ``algorithm``; adjacent layers with the same ``unit`` number share one all-reduce (they must
  have the same algorithm and lane); ``lane`` 1 is the second sync lane (``syncunits.py``), for
  :data:`SECOND_LANE_ALGORITHMS` only. A layer without ``unit`` is a unit of its own. A
  replicated stage whose plan lists no layers gets, at launch, the partitioner's own choice on
  the plan's cluster.
* ``loss_normalization`` (profiles/losses.py): ``micro-batch`` (plans without the field) makes a
  step's loss the mean of its micro-batches' mean losses; ``tokens`` divides the step's summed
  per-token loss by its valid tokens over all micro-batches and replicas (flushed schedules only).
* Predicted figures (``hybridpipe partition``) come from ``objective.py``; ``sync_ms`` is what
  the stage's syncs add to a step after overlapping its backward, next forward and (gpipe,
  1f1b) the pipeline's drain and fill.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hybridpipe.errors import UserError
from hybridpipe.jsonfile import MAX_FIGURE, MAX_PLAN_FIGURE, check_header, field, figure, read_json, write_json
from hybridpipe.partitioner.cost import collectives as co
from hybridpipe.partitioner.cost.cluster import Cluster
from hybridpipe.partitioner.cost.syncunits import SECOND_LANE_ALGORITHMS, LayerSync, sync_units
from hybridpipe.partitioner.cost.wire import WIRE_BYTES
from hybridpipe.partitioner.schedule_registry import REGISTRY, Schedule, get_schedule
from hybridpipe.profiles.loss_normalization import LOSS_NORMALIZATIONS

PLAN_KIND = "plan"
PLAN_FORMAT = 1
SCHEDULES = tuple(REGISTRY)     # the schedules by name (schedule_registry.py describes each)
ALGORITHMS = co.ALGORITHMS      # the all-reduce algorithms (collectives.py describes each)
STRATEGIES = ("optimal", "pipedream", "dp", "uniform", "params", "time", "torchtitan", "megatron")
OPTIMIZERS = ("sgd", "adam", "adamw")
# what each optimizer name runs (runtime/parts.py make_optimizer), for every --optimizer's help
OPTIMIZER_HELP = ("sgd: torch.optim.SGD with --momentum; adam: torch.optim.Adam, whose weight decay is L2 (added to "
                  "the gradient, so scaled by the moments); adamw: torch.optim.AdamW, weight decay decoupled from "
                  "the moments (what transformer recipes mean by weight decay)")
PRECISIONS = tuple(WIRE_BYTES)
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

    @property
    def node_ids(self) -> range:
        return range(self.first_node, self.last_node + 1)

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


@dataclass(frozen=True)
class Plan:
    model: str                    # the profile's model spec (zoo name or module:factory)
    batch_size: int               # samples per micro-batch (the profile's batch size)
    input_shape: tuple[int, ...]
    profile_signature: str        # Profile.signature(): the traced graph's identity
    cluster: Cluster
    strategy: str
    schedule: str                 # a name in the schedule registry (the object: :attr:`kind`)
    micro_batches: int
    optimizer: str
    stages: tuple[Stage, ...]
    predicted_step_ms: float = 0.0         # one step (micro_batches micro-batches)
    predicted_samples_per_s: float = 0.0
    created: str = ""
    granularity: str = "blocks"            # the profile's grouping of operations into nodes (to re-capture alike)
    precision: str = "fp32"                # what the transfers were priced in (launch runs it unless told otherwise)
    profile_precision: str = "fp32"        # the profile's: its activation bytes are that precision's (cost/wire.py)
    reduce_dtype: str = "fp32"             # what replicas sum gradients in (launch runs it unless told otherwise)
    tied: tuple[TiedGroup, ...] = ()       # parameters read by several stages
    virtual_stages: int = 1                # model chunks (stages) per rank: interleaved-1f1b, zbv (see above)
    graph_nodes: int = 0                   # the profile's node count (0: not recorded)
    search: SearchRecord | None = None     # strategy optimal: how far from the optimum the plan can be
    loss_normalization: str = "micro-batch"    # or "tokens" (see above; launch runs it unless told otherwise)

    @property
    def world_size(self) -> int:
        return len({r for s in self.stages for r in s.ranks})

    @property
    def kind(self) -> Schedule:
        """The plan's schedule, the object (what it means: schedule_registry.py)."""
        return get_schedule(self.schedule)

    def stages_of_rank(self, rank: int) -> tuple[tuple[Stage, ...], int]:
        """(the stages ``rank`` runs in model order, its replica index); UserError if none."""
        mine = tuple(s for s in self.stages if rank in s.ranks)
        if not mine:
            raise UserError(f"rank {rank} has no stage in the plan (it uses ranks 0..{self.world_size - 1}); "
                            f"launch with --nproc-per-node x --nnodes = {self.world_size}")
        return mine, mine[0].ranks.index(rank)

    def stage_of_rank(self, rank: int) -> tuple[Stage, int]:
        """(stage, replica index) that ``rank`` runs; UserError if the plan has no such rank;
        ValueError for a rank with several stages (virtual stages: use :meth:`stages_of_rank`)."""
        mine, replica = self.stages_of_rank(rank)
        if len(mine) > 1:
            raise ValueError(f"rank {rank} runs {len(mine)} stages (virtual stages); use Plan.stages_of_rank")
        return mine[0], replica

    def to_dict(self) -> dict:
        d = {"kind": PLAN_KIND, "format": PLAN_FORMAT}
        d.update(asdict(self))
        d["cluster"] = self.cluster.to_dict()
        d["input_shape"] = list(self.input_shape)
        d["tied"] = [dict(asdict(t), stages=list(t.stages)) for t in self.tied]
        d["stages"] = [dict(asdict(s), ranks=list(s.ranks), layers=[_layer_dict(lv) for lv in s.layers])
                       for s in self.stages]
        return d

    @classmethod
    def from_dict(cls, data: object, source: str = "plan") -> Plan:
        """Validate ``data`` and build a Plan; every defect is a one-line UserError."""
        d = check_header(data, PLAN_KIND, PLAN_FORMAT, source)
        raw_stages = field(d, "stages", list, source)
        if not raw_stages:
            raise UserError(f"{source}: \"stages\" is empty")
        plan = cls(
            model=field(d, "model", str, source),
            batch_size=field(d, "batch_size", int, source, minimum=1, maximum=MAX_FIGURE),
            input_shape=tuple(field(d, "input_shape", list, source, items=int)),
            profile_signature=field(d, "profile_signature", str, source),
            cluster=Cluster.from_dict(field(d, "cluster", dict, source), f"{source}: cluster"),
            strategy=field(d, "strategy", str, source, choices=STRATEGIES),
            schedule=field(d, "schedule", str, source, choices=SCHEDULES),
            micro_batches=field(d, "micro_batches", int, source, minimum=1, maximum=MAX_FIGURE),
            optimizer=field(d, "optimizer", str, source, choices=OPTIMIZERS),
            stages=tuple(_stage_from_dict(s, i, source) for i, s in enumerate(raw_stages)),
            predicted_step_ms=_figure(d, "predicted_step_ms", float, source, default=0.0),
            predicted_samples_per_s=_figure(d, "predicted_samples_per_s", float, source, default=0.0),
            created=field(d, "created", str, source, default=""),
            granularity=field(d, "granularity", str, source, default="blocks"),
            precision=field(d, "precision", str, source, default="fp32", choices=PRECISIONS),
            profile_precision=field(d, "profile_precision", str, source, default="fp32", choices=PRECISIONS),
            reduce_dtype=field(d, "reduce_dtype", str, source, default="fp32", choices=PRECISIONS),
            tied=tuple(_tied_from_dict(t, i, source) for i, t in enumerate(field(d, "tied", list, source, default=[]))),
            virtual_stages=field(d, "virtual_stages", int, source, minimum=1, default=1),
            graph_nodes=field(d, "graph_nodes", int, source, minimum=0, default=0),
            search=_search_from_dict(d.get("search"), f"{source}: search"),
            loss_normalization=field(d, "loss_normalization", str, source, default="micro-batch",
                                     choices=LOSS_NORMALIZATIONS),
        )
        _check_stages(plan, source)
        return plan


def load_plan(path: str | os.PathLike) -> Plan:
    """Read and validate a plan file."""
    return Plan.from_dict(read_json(path, "plan"), source=str(path))


def save_plan(plan: Plan, path: str | os.PathLike) -> Path:
    return write_json(path, plan.to_dict())


def check_plan_fits(plan: Plan, *, model: str | None, batch_size: int | None, world_size: int | None) -> None:
    """Refuse (one line) a plan made for another model name, batch size or world size (None: not
    checked); against the captured model itself: pipeline/plancheck.py."""
    if model is not None and model != plan.model:
        raise UserError(f"the plan was made for model {plan.model!r}, not {model!r}; "
                        f"profile and partition {model!r} first, or drop --model")
    if batch_size is not None and batch_size != plan.batch_size:
        raise UserError(f"the plan was made for batch size {plan.batch_size}, not {batch_size}; "
                        "re-profile at this batch size and re-partition, or drop --batch-size")
    if world_size is not None and world_size != plan.world_size:
        raise UserError(f"the plan needs {plan.world_size} workers but the job has {world_size}; "
                        f"launch {plan.world_size} processes or re-partition with --workers {world_size}")


def check_plan_memory(plan: Plan) -> None:
    """Refuse (one line) a plan with a stage predicted to need more memory per worker than the
    plan's cluster has (``memory_gb``: the cluster's, or ``partition --memory-gb``)."""
    budget = plan.cluster.memory_gb * 1e9
    for s in plan.stages:
        if s.memory_bytes > budget:
            raise UserError(f"stage {s.index} is predicted to need {s.memory_bytes / 1e9:.2f} GB per worker, more "
                            f"than the plan's {plan.cluster.memory_gb:g} GB; re-partition (--recompute auto, more "
                            "workers or fewer --micro-batches) or give the cluster more memory_gb")


def _figure(obj: dict, key: str, kind: type, where: str, default: Any = ...) -> Any:
    """A predicted figure of the plan: a number from 0 to MAX_PLAN_FIGURE."""
    return figure(obj, key, kind, where, maximum=MAX_PLAN_FIGURE, default=default)


def _search_from_dict(d: object, where: str) -> SearchRecord | None:
    if d is None:
        return None
    if not isinstance(d, dict):
        raise UserError(f"{where}: expected an object or null")
    gap = None if d.get("gap") is None else _figure(d, "gap", float, where)
    return SearchRecord(complete=field(d, "complete", bool, where), seconds=_figure(d, "seconds", float, where),
                        budget_s=None if d.get("budget_s") is None else _figure(d, "budget_s", float, where),
                        objective_ms=_figure(d, "objective_ms", float, where),
                        lower_bound_ms=_figure(d, "lower_bound_ms", float, where), gap=gap)


def _tied_from_dict(t: object, i: int, source: str) -> TiedGroup:
    where = f"{source}: tied group {i}"
    if not isinstance(t, dict):
        raise UserError(f"{where}: expected an object")
    stages = field(t, "stages", list, where)
    if len(stages) < 2 or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in stages):
        raise UserError(f"{where}: \"stages\" must list at least two stage indices")
    return TiedGroup(param=field(t, "param", str, where), stages=tuple(sorted(stages)),
                     bytes=_figure(t, "bytes", int, where),
                     predicted_ms=_figure(t, "predicted_ms", float, where, default=0.0))


def _layer_dict(lv: LayerSync) -> dict:
    d = dict(asdict(lv), params=list(lv.params))
    if lv.unit is None:
        del d["unit"]
    return d


def _stage_from_dict(s: object, i: int, source: str) -> Stage:
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
                 compute_ms=_figure(s, "compute_ms", float, where, default=0.0),
                 forward_ms=_figure(s, "forward_ms", float, where, default=0.0),
                 backward_ms=_figure(s, "backward_ms", float, where, default=0.0),
                 sync_ms=_figure(s, "sync_ms", float, where, default=0.0),
                 send_ms=_figure(s, "send_ms", float, where, default=0.0),
                 send_bytes=_figure(s, "send_bytes", int, where, default=0),
                 memory_bytes=_figure(s, "memory_bytes", int, where, default=0),
                 transient_bytes=_figure(s, "transient_bytes", int, where, default=0),
                 layers=tuple(layers),
                 overhead_ms=_figure(s, "overhead_ms", float, where, default=0.0),
                 ring_ms=_figure(s, "ring_ms", float, where, default=0.0),
                 overlapped_ring_ms=_figure(s, "overlapped_ring_ms", float, where, default=0.0),
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
    if algorithm not in ALGORITHMS:
        raise UserError(f"{where}: unknown all-reduce algorithm {algorithm!r}; use one of {', '.join(ALGORITHMS)}")
    lane = field(lv, "lane", int, where, default=0, choices=(0, 1))
    if lane == 1 and algorithm not in SECOND_LANE_ALGORITHMS:
        raise UserError(f"{where}: {algorithm} cannot run on sync lane 1 (only {', '.join(SECOND_LANE_ALGORITHMS)} "
                        "can); set \"lane\": 0")
    return LayerSync(layer=name, params=tuple(params), bytes=_figure(lv, "bytes", int, where),
                     algorithm=algorithm,
                     predicted_ms=_figure(lv, "predicted_ms", float, where, default=0.0),
                     exposed_ms=_figure(lv, "exposed_ms", float, where, default=0.0),
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


def _check_stages(plan: Plan, source: str) -> None:
    expected_first = 0
    seen: set[int] = set()
    for i, s in enumerate(plan.stages):
        where = f"{source}: stage {i}"
        if s.index != i:
            raise UserError(f"{where}: index is {s.index}; stages must be listed in order")
        if s.first_node != expected_first:
            raise UserError(f"{where}: starts at node {s.first_node} but must start at node {expected_first} "
                            "(stages are contiguous node ranges covering the graph)")
        if s.last_node < s.first_node:
            raise UserError(f"{where}: last_node {s.last_node} is before first_node {s.first_node}")
        if len(s.ranks) != s.replicas:
            raise UserError(f"{where}: {s.replicas} replicas but {len(s.ranks)} ranks {list(s.ranks)}")
        dup = seen.intersection(s.ranks) if plan.virtual_stages == 1 else set()
        if dup or len(set(s.ranks)) != len(s.ranks):
            raise UserError(f"{where}: rank {sorted(dup or s.ranks)[0]} is given to more than one stage/replica")
        seen.update(s.ranks)
        expected_first = s.last_node + 1
    if plan.graph_nodes and expected_first != plan.graph_nodes:
        raise UserError(f"{source}: the last stage ends at node {expected_first - 1} but the graph's last node is "
                        f"{plan.graph_nodes - 1} (\"graph_nodes\": {plan.graph_nodes}); stages must cover the graph "
                        "exactly: re-partition")
    layout = plan.kind.layout_error([s.ranks for s in plan.stages], plan.virtual_stages)
    if layout:
        raise UserError(f"{source}: {layout}; re-partition (hybridpipe partition --schedule {plan.schedule})")
    if seen != set(range(plan.world_size)):
        raise UserError(f"{source}: stage ranks must be exactly 0..{plan.world_size - 1}, got {sorted(seen)}")
    for t in plan.tied:
        if t.stages[-1] >= len(plan.stages):
            raise UserError(f"{source}: tied parameter {t.param!r} names stage {t.stages[-1]}, but the plan has "
                            f"{len(plan.stages)} stages")
    if plan.world_size > plan.cluster.total_workers:
        raise UserError(f"{source}: {plan.world_size} workers planned but the cluster has {plan.cluster.total_workers}")
