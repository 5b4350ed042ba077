"""In-place recovery of a lost replica, the decisions (plain values; runtime/recovery.py runs them).

When ranks of a job are lost (their host died) and every stage keeps at least one replica, the
survivors go on in the same processes: the same stages, the lost ranks' micro-batches taken over
round-robin by the replicas left (the global batch is unchanged: micro-batch m goes to replica
``m % r`` of every stage), and the failed step redone from the replicas' state, which is
identical. :func:`shrink_plan` is the plan of that smaller world; :func:`decide` says whether the
survivors' reports allow it or the job must restart (torchrun, resume from the newest checkpoint).

A survivor's report says how many steps it completed (``steps``: the trainer's step count, which
counts a step only once its optimizer update was applied), what it was doing (``phase``:
``step`` inside a training step, anything else outside one) and whether a stage of it combines
running statistics across replicas (``stats``: batch norm, pipeline/batch_stats.py; not re-formed
in place, so such a job restarts). The step's global all-reduce before
the optimizer update (the non-finite check, runtime/nonfinite.py) is the commit point: a rank
reaches it only once every rank's gradients of the step are complete, so either no survivor
applied the step (redo it), or all did (go on with the next), or -- when the lost rank died
inside that very all-reduce -- some did and some did not: then the job restarts, as it does
when a failure falls outside a training step (a checkpoint being written, an evaluation).
"""

from __future__ import annotations

import json
from collections.abc import Collection, Mapping
from dataclasses import asdict, dataclass, replace

from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.plan import Plan, Stage
from hybridpipe.runtime.sync import override_layers

IN_PLACE = "in place"
RESTART = "restart"
STEP = "step"           # a report's phase: inside a training step


@dataclass(frozen=True)
class Decision:
    """What the survivors agreed: ``kind`` IN_PLACE (``survivors``, ranks of the old world in
    order, go on as ranks 0..n-1 of the new one; ``steps`` steps are done) or RESTART
    (``reason``, one line)."""

    kind: str
    survivors: tuple[int, ...]
    lost: tuple[int, ...]
    steps: int = 0
    reason: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: str | bytes) -> Decision:
        d = json.loads(raw)
        return cls(d["kind"], tuple(d["survivors"]), tuple(d["lost"]), int(d["steps"]), str(d["reason"]))

    def new_rank(self, rank: int) -> int | None:
        """``rank``'s rank in the new world (None: it was counted lost)."""
        return self.survivors.index(rank) if rank in self.survivors else None


def shrink_plan(plan: Plan, survivors: Collection[int]) -> Plan:
    """``plan`` without the ranks not in ``survivors``, the others renumbered 0..n-1 in their
    order: each stage keeps its nodes and its surviving replicas in their order; a stage whose
    replica count changed gets its layers' all-reduce algorithms re-chosen by the partitioner's
    policy for the smaller group (none for a single replica). ValueError when a stage keeps no
    replica or the schedule cannot run the result."""
    index = {old: new for new, old in enumerate(sorted(survivors))}
    model = CostModel(plan.cluster)
    stages: list[Stage] = []
    for s in plan.stages:
        ranks = tuple(index[r] for r in s.ranks if r in index)
        if not ranks:
            raise ValueError(f"stage {s.index} lost every replica ({list(s.ranks)})")
        layers = s.layers
        if len(ranks) != len(s.ranks):
            layers = () if len(ranks) == 1 or not s.layers else override_layers(s.layers, "hybrid", ranks, model)
        stages.append(replace(s, replicas=len(ranks), ranks=ranks, layers=layers))
    shrunk = replace(plan, stages=tuple(stages))
    try:
        return Plan.from_dict(shrunk.to_dict(), source="the plan of the survivors")
    except Exception as e:          # noqa: BLE001 - the plan's own checks (layout, micro-batches)
        raise ValueError(str(e)) from None


def decide(plan: Plan, world_size: int, reports: Mapping[int, Mapping], lost: Collection[int], *,
           flushing: bool, unreported: Collection[int] = ()) -> Decision:
    """The survivors' decision from their ``reports`` (rank -> ``{"steps", "phase"}``) and the
    ranks counted ``lost``; ``unreported``: ranks known alive that sent no report in time (then
    the job restarts: it cannot go on without them nor count them lost). ``flushing``: the
    schedule takes one optimizer step per step on every rank (runtime/config.flushes)."""
    survivors = tuple(sorted(reports))
    gone = tuple(sorted(set(lost) | set(unreported)))

    def restart(reason: str) -> Decision:
        return Decision(RESTART, survivors, gone, 0, reason)

    if not lost:
        return restart("no rank was lost")
    if unreported:
        return restart(f"rank {min(unreported)} is alive but did not leave its step in time")
    if not flushing or plan.virtual_stages > 1:
        return restart(f"schedule {plan.schedule}{' with virtual stages' if plan.virtual_stages > 1 else ''} "
                       "has no step that every rank completes together")
    stats = sorted(r for r, rep in reports.items() if rep.get("stats"))
    if stats:
        return restart(f"rank {stats[0]}'s stage combines running statistics (batch norm) across its replicas, "
                       "which in-place recovery does not re-form")
    outside = sorted(r for r, rep in reports.items() if rep.get("phase") != STEP)
    if outside:
        return restart(f"rank {outside[0]} was outside a training step ({reports[outside[0]].get('phase')})")
    if set(reports) | set(lost) != set(range(world_size)):
        return restart("the survivors' reports do not account for every rank")
    try:                # before the steps: a plan the survivors cannot run is the reason whenever the kill lands
        shrink_plan(plan, survivors)
    except ValueError as e:
        return restart(str(e))
    steps = sorted({int(rep["steps"]) for rep in reports.values()})
    if len(steps) > 1:
        return restart(f"the survivors had completed different numbers of steps ({steps[0]} and {steps[-1]}): "
                       "the rank was lost while some of them applied the step's update")
    return Decision(IN_PLACE, survivors, gone, steps[0])
