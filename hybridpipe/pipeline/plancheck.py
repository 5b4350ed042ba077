"""The plan checked against the captured model: one place, called once at start-up, and the
stages built from what it returns.

    checked = check_plan(captured, plan)                 # every rank, before any process group
    stages = checked.stages_of_rank(rank, loss=spec.loss)   # this rank's stage, or its model chunks

:func:`check_plan` refuses, in one line, a plan that

* was made for another graph: its last stage does not end at the capture's last node, or its
  profile signature is not the capture's;
* cuts where a value cannot cross (``profiles/cut.py`` check_cuts);
* leaves a buffer the training forward changes to several stages' copies, or to a replicated or
  recomputing stage that cannot keep it as one process would (``buffer_writes.py``);
* ties other parameters than its stages share in this model (``partitioner/tied.py``);
* syncs, on a replicated stage, other parameters than the stage holds but the tied ones
  (:func:`check_sync_layers`);
* shards replicas in a way the runtime cannot run (:func:`check_shards`: an asynchronous schedule,
  ZeRO-2/3 with micro-batches not a multiple of the replicas, ZeRO-3 gathers that would deadlock).

The plan against launch's flags (model name, batch size, workers) is ``partitioner/plan.py``'s
check_plan_fits, before the model is built.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from torch import fx, nn

from hybridpipe.errors import UserError
from hybridpipe.partitioner.plan import Plan, Stage
from hybridpipe.partitioner.tied import shared_across
from hybridpipe.pipeline.buffer_writes import check_plan_writes
from hybridpipe.pipeline.schedules import Topology, all_programs
from hybridpipe.pipeline.stage import LossFn, PipelineStage, captured_signature
from hybridpipe.pipeline.validate import ScheduleError, validate
from hybridpipe.profiles.capture import CapturedModel, tied_parameters
from hybridpipe.profiles.cut import StageBoundary, check_cuts, stage_boundaries, stage_graph_module
from hybridpipe.profiles.graphinfo import node_infos


@dataclass(frozen=True)
class CheckedPlan:
    """A plan that fits the captured model (:func:`check_plan`), with what its stages are built from."""

    plan: Plan
    captured: CapturedModel
    boundaries: tuple[StageBoundary, ...]       # per stage: its nodes, what it receives and sends

    def stage(self, index: int, *, loss: LossFn | None = None) -> PipelineStage:
        """Stage ``index`` of the plan (its recomputation and replicas), cut out of the capture."""
        s, boundary = self.plan.stages[index], self.boundaries[index]
        return PipelineStage(self._module(index), boundary, len(self.boundaries), self.captured, loss, s.recompute,
                             s.replicas)

    def stages_of_rank(self, rank: int, *, loss: LossFn | None = None) -> list[PipelineStage]:
        """This rank's stage, or with virtual stages its model chunks, in model order."""
        mine, _ = self.plan.stages_of_rank(rank)
        return [self.stage(s.index, loss=loss) for s in mine]

    def _module(self, index: int) -> fx.GraphModule:
        return stage_graph_module(self.captured, self.boundaries[index], last=index == len(self.boundaries) - 1)


def check_plan(captured: CapturedModel, plan: Plan) -> CheckedPlan:
    """``plan`` checked against ``captured`` (see the module docstring): the stages' boundaries."""
    n_nodes = len(captured.blocks)
    check_shards(plan)
    if plan.stages[-1].last_node != n_nodes - 1:
        raise UserError(f"the plan covers {plan.stages[-1].last_node + 1} graph nodes but the model has "
                        f"{n_nodes}: it was made for another version of the model; re-profile")
    signature = captured_signature(captured)
    if signature != plan.profile_signature:
        raise UserError("the model's traced graph differs from the one the plan was made for "
                        f"(signature {signature} vs {plan.profile_signature}); re-profile and re-partition")
    boundaries = stage_boundaries(captured, [(s.first_node, s.last_node) for s in plan.stages])
    check_cuts(captured, boundaries)
    check_plan_writes(captured, plan)
    checked = CheckedPlan(plan, captured, tuple(boundaries))
    _check_tied(checked)
    for stage in plan.stages:
        if stage.replicas > 1 and stage.layers:
            tied = [captured.module.get_parameter(t.param) for t in plan.tied if stage.index in t.stages]
            check_sync_layers(stage, checked._module(stage.index), tied)
    return checked


def build_stage(captured: CapturedModel, plan: Plan, rank: int, *, loss: LossFn | None = None) -> PipelineStage:
    """This rank's stage of ``captured`` under ``plan``, once :func:`check_plan` accepts the plan."""
    stage, _ = plan.stage_of_rank(rank)
    return check_plan(captured, plan).stage(stage.index, loss=loss)




def check_shards(plan: Plan) -> None:
    """A shard level (every one of plan_parts.SHARD_LEVELS runs: ZeRO-1/2/3) needs a flushing schedule
    (pipedream's asynchronous updates keep stashed whole weights), and ZeRO-3's gathers must not
    deadlock: the replicas of a stage that shards its parameters all-gather the weights for each
    forward (and, resharding after the forward, regather them for each backward) together, so the
    n-th of every replica is one collective. With unequal replica counts per stage the replicas'
    lists are one pipeline's order cut apart, and the collective can tie a replica waiting for a
    gradient to one whose gradient waits on it (zbv with 1 and 3 replicas): such a plan is refused,
    as is ZeRO-2/3 on r replicas with micro-batches not a multiple of r (a replica with fewer
    micro-batches would miss the others' per-micro-batch reduce-scatters: both hung until the timeout)."""
    for s in plan.stages:
        if s.shard != "none" and not plan.kind.flushed:
            raise UserError(f"stage {s.index} shards its replicas ({s.shard}), which needs a flushing schedule; "
                            f"{plan.schedule} updates asynchronously: use 1f1b, gpipe, zb-h1, interleaved-1f1b or zbv")
        if s.shard in ("gradients", "parameters") and plan.micro_batches % s.replicas:
            raise UserError(f"stage {s.index} shards its {s.shard} over {s.replicas} replicas, whose reduce-scatters "
                            f"run per micro-batch, so each replica needs as many micro-batches: use a multiple of "
                            f"{s.replicas} micro-batches (not {plan.micro_batches}), or shard \"optimizer\"")
    gathers = {s.index: "each" if s.reshard_after_forward else "first" for s in plan.stages
               if s.shard == "parameters" and s.replicas > 1}
    if not gathers:
        return
    topo = Topology.from_plan(plan)
    lists = [all_programs(topo, plan.kind)]
    try:
        validate(topo, lists, gathers=gathers)
    except ScheduleError:
        validate(topo, lists)           # the lists alone are sound (else that error, a bug, propagates)
        stages = ", ".join(map(str, sorted(gathers)))
        raise UserError(f"stage(s) {stages} shard their parameters (ZeRO-3) over replicas whose {plan.schedule} lists "
                        "would deadlock in the weight gathers (each waits for every replica of the stage, and one "
                        "replica's gradients wait on another's gather: replica counts differ between stages); use "
                        "shard \"gradients\", or the same replica count on every stage") from None


def build_stages(captured: CapturedModel, plan: Plan, rank: int, *,
                 loss: LossFn | None = None) -> list[PipelineStage]:
    """This rank's stages of ``captured`` under ``plan`` in model order (one, or with virtual stages
    its V model chunks), once :func:`check_plan` accepts the plan."""
    return check_plan(captured, plan).stages_of_rank(rank, loss=loss)


def check_sync_layers(stage: Stage, module: nn.Module, exclude: Collection[nn.Parameter] = ()) -> None:
    """A replicated stage's planned sync layers must cover exactly its trainable parameters (but
    the ``exclude``d: tied across stages, summed apart); a plan listing none gets the partitioner's
    choice at launch (runtime/sync.py). A planned parameter the stage holds frozen is accepted: it
    has no gradient, and launch leaves it out of the sync (runtime/sync.py trainable_layers)."""
    if not stage.layers:
        return
    skip = {id(p) for p in exclude}
    have = {name for name, p in module.named_parameters()
            if p.requires_grad and p.numel() > 0 and id(p) not in skip}
    frozen = {name for name, p in module.named_parameters() if not p.requires_grad}
    planned = {p for lv in stage.layers for p in lv.params} - frozen
    if planned - have:
        extra = sorted(planned - have)
        raise UserError(f"stage {stage.index}: the plan syncs parameter {extra[0]!r}, which the stage does not have "
                        f"({len(extra)} such); the plan was made for another model: re-partition")
    if have - planned:
        missing = sorted(have - planned)
        raise UserError(f"stage {stage.index}: the plan's layers do not sync parameter {missing[0]!r} "
                        f"({len(missing)} such); add it to a layer of the plan's stage or re-partition")


def _check_tied(checked: CheckedPlan) -> None:
    """The plan's tied groups must be exactly the parameters its stages share in this model."""
    captured, plan = checked.captured, checked.plan
    infos = node_infos(captured)
    found = {(p, stages) for p, stages in shared_across(
        [i.params for i in infos], [i.shared for i in infos], tied_parameters(captured.module),
        [(s.first_node, s.last_node) for s in plan.stages])}
    planned = {(t.param, t.stages) for t in plan.tied}
    if found != planned:
        missing = sorted(found - planned)
        what = (f"parameter {missing[0][0]!r} is read by stages {list(missing[0][1])}" if missing
                else f"the plan ties {sorted(planned - found)[0][0]!r}, which its stages do not share")
        raise UserError(f"the plan's tied parameters do not match the model ({what}); the plan was made by an "
                        "older hybridpipe or for another model: re-profile and re-partition")
