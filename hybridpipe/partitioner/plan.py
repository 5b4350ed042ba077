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

from hybridpipe.errors import UserError
from hybridpipe.jsonfile import MAX_FIGURE, check_header, field, read_json, write_json
from hybridpipe.partitioner.cost import collectives as co
from hybridpipe.partitioner.cost.cluster import Cluster
from hybridpipe.partitioner.cost.wire import WIRE_BYTES
from hybridpipe.partitioner.plan_parts import (
    SearchRecord,
    Stage,
    TiedGroup,
    layer_dict,
    plan_figure,
    search_from_dict,
    stage_from_dict,
    tied_from_dict,
)
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


@dataclass(frozen=True)
class Plan:
    """A partition: the profile and cluster it is for, the schedule, and every stage with its predictions."""

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
    profile_threads: int = 0               # a CPU profile's intra-op threads: its times are that setting's (0: unknown)
    reduce_dtype: str = "fp32"             # what replicas sum gradients in (launch runs it unless told otherwise)
    tied: tuple[TiedGroup, ...] = ()       # parameters read by several stages
    virtual_stages: int = 1                # model chunks (stages) per rank: interleaved-1f1b, zbv (see above)
    graph_nodes: int = 0                   # the profile's node count (0: not recorded)
    search: SearchRecord | None = None     # strategy optimal: how far from the optimum the plan can be
    loss_normalization: str = "micro-batch"    # or "tokens" (see above; launch runs it unless told otherwise)

    @property
    def world_size(self) -> int:
        """Ranks the plan runs on."""
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
        """The plan as the JSON object ``save_plan`` writes."""
        d = {"kind": PLAN_KIND, "format": PLAN_FORMAT}
        d.update(asdict(self))
        d["cluster"] = self.cluster.to_dict()
        d["input_shape"] = list(self.input_shape)
        d["tied"] = [dict(asdict(t), stages=list(t.stages)) for t in self.tied]
        d["stages"] = [dict(asdict(s), ranks=list(s.ranks), layers=[layer_dict(lv) for lv in s.layers])
                       for s in self.stages]
        return d

    @classmethod
    def from_dict(cls, data: object, source: str = "plan") -> Plan:
        """Validate ``data`` and build a Plan; every defect is a one-line UserError."""
        d = check_header(data, PLAN_KIND, PLAN_FORMAT, source)
        raw_stages = field(d, "stages", list, source)
        if not raw_stages:
            raise UserError(f"{source}: \"stages\" is empty; a plan needs at least one stage: write it with "
                            "hybridpipe partition PROFILE --cluster CLUSTER -o PLAN")
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
            stages=tuple(stage_from_dict(s, i, source) for i, s in enumerate(raw_stages)),
            predicted_step_ms=plan_figure(d, "predicted_step_ms", float, source, default=0.0),
            predicted_samples_per_s=plan_figure(d, "predicted_samples_per_s", float, source, default=0.0),
            created=field(d, "created", str, source, default=""),
            granularity=field(d, "granularity", str, source, default="blocks"),
            precision=field(d, "precision", str, source, default="fp32", choices=PRECISIONS),
            profile_precision=field(d, "profile_precision", str, source, default="fp32", choices=PRECISIONS),
            profile_threads=field(d, "profile_threads", int, source, minimum=0, maximum=MAX_FIGURE, default=0),
            reduce_dtype=field(d, "reduce_dtype", str, source, default="fp32", choices=PRECISIONS),
            tied=tuple(tied_from_dict(t, i, source) for i, t in enumerate(field(d, "tied", list, source, default=[]))),
            virtual_stages=field(d, "virtual_stages", int, source, minimum=1, default=1),
            graph_nodes=field(d, "graph_nodes", int, source, minimum=0, default=0),
            search=search_from_dict(d.get("search"), f"{source}: search"),
            loss_normalization=field(d, "loss_normalization", str, source, default="micro-batch",
                                     choices=LOSS_NORMALIZATIONS),
        )
        _check_stages(plan, source)
        return plan


def load_plan(path: str | os.PathLike) -> Plan:
    """Read and validate a plan file."""
    return Plan.from_dict(read_json(path, "plan"), source=str(path))


def save_plan(plan: Plan, path: str | os.PathLike) -> Path:
    """Write ``plan`` as JSON to ``path`` (atomically); the path."""
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
