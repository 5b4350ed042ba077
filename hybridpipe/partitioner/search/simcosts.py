"""What the schedule simulator (``hybridpipe.pipeline.simulator``) charges each stage of a plan: one place
for the rule, read by the simulator and by the virtual-chunk search (``virtual.py``), which compares chunks'
charges to skip shard levels that cannot be simulated faster; and of an evaluated stage list
(:func:`evaluated_costs`), which the refined prediction simulates (``simulator.predicted_step_ms``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridpipe.partitioner.plan import Plan
from hybridpipe.partitioner.plan_parts import Stage
from hybridpipe.partitioner.schedule_registry import Schedule
from hybridpipe.partitioner.search.modelcosts import ModelCosts
from hybridpipe.partitioner.search.objective import Evaluation, Options, StageSpec, overhead_ms
from hybridpipe.partitioner.search.sharding import Variant, midstep_ms


@dataclass(frozen=True)
class StageCosts:
    """One stage's charges in the simulator, per micro-batch unless named otherwise (ms)."""

    forward_ms: float
    backward_ms: float
    send_ms: float                          # per message over the cut after this stage (each way)
    send_bytes: int
    allreduce_ms: tuple[float, ...]         # per layer, in forward order (empty: no sync)
    input_share: float = 0.5                # of backward_ms, the input-gradient half's (split schedules)
    sharded: bool = False                   # each layer's sync is a reduce-scatter + an all-gather (halves)
    lost_ms: float = 0.0                    # compute a synced backward loses beside its replicas' collectives
    lost_after: bool = False                # lost_ms lengthens no backward: simulator.barrier_step_ms charges it
    step_ms: float = 0.0                    # each Step of the stage's rank: its optimizer step and what else the
    #                                         stage charges once per step after its sync
    ready_share: tuple[float, ...] = ()     # per layer of allreduce_ms: the share of the backward done when its
    #                                         gradient is ready (empty: evenly spaced, last layer first)

    def __post_init__(self) -> None:
        if self.ready_share and len(self.ready_share) != len(self.allreduce_ms):
            raise ValueError(f"{len(self.ready_share)} ready shares for {len(self.allreduce_ms)} layer syncs")


def stage_costs(plan: Plan) -> list[StageCosts]:
    """Per-stage costs from the plan (:func:`one_stage_costs` of each)."""
    return [one_stage_costs(s, plan.micro_batches, plan.kind) for s in plan.stages]


def one_stage_costs(s: Stage, micro_batches: int, kind: Schedule) -> StageCosts:
    """A stage's costs; a stage with only ``compute_ms`` splits it 1:2 (forward:backward).

    Its ``overhead_ms`` (optimizer steps, compute lost to communication) is spread over the backwards
    of its replica's micro-batches, but for the compute lost beside its replicas' own collectives
    (``ring_ms``): only the part lost while compute ran (``overlapped_ring_ms``) counts, per sync, on the
    backward that starts the sync (``lost_ms``), as objective.predict_step_ms counts it."""
    f, b = s.forward_ms, s.backward_ms
    if f == 0 and b == 0 and s.compute_ms > 0:
        f, b = s.compute_ms / 3, 2 * s.compute_ms / 3
    k = -(-micro_batches // s.replicas)
    if s.shard != "none":
        half = sum(lv.predicted_ms for lv in s.layers) / 2
        b += float(midstep_ms(Variant(s.shard, s.reshard_after_forward), k, half, f, b)) / k
    b += (s.overhead_ms - s.ring_ms) / k
    lost = s.overlapped_ring_ms / kind.syncs_per_step(k)
    if s.replicas > 1 and s.layers:
        ar = tuple(lv.predicted_ms for lv in s.layers)
    elif s.replicas > 1 and s.sync_ms > 0:
        ar = (s.sync_ms,)
    else:
        ar = ()
    return StageCosts(f, b, s.send_ms, s.send_bytes, ar, 0.0 if s.index == 0 else 0.5, s.shard != "none", lost)


def evaluated_costs(ev: Evaluation, costs: ModelCosts, stages: Sequence[StageSpec], opts: Options) -> list[StageCosts]:
    """Per stage of an evaluated stage list (``objective.evaluate`` of ``stages`` on ``costs``): the terms
    ``objective.predict_step_ms`` adds, each where it happens in the step. Its optimizer steps at its rank's
    ``Step``, after its sync; the rest of its overhead (gradient accumulation, compute lost beside its
    transfers) and a sharded stage's collectives inside the step on its backwards; the compute lost beside
    its replicas' collectives while compute ran (``overlapped_ring_ms``) after the compute it slows
    (``simulator.barrier_step_ms``: the larger of it and the exposed sync, as predict_step_ms); each layer's
    gradient ready once the backward has passed it (its nodes' backward times, last node first, as
    ``layersync.simulate_lane``)."""
    out = []
    for idx, (s, spec) in enumerate(zip(ev.stages, stages, strict=True)):
        r, k = len(spec.ranks), s.micro_batches
        variant = Variant(s.shard, s.reshard_after_forward)
        optimizer = float(costs.optimizer_ms(opts.optimizer)[spec.first:spec.last + 1].sum())
        stepped = min(float(overhead_ms(optimizer, 0.0, 0.0, r, k, s.syncs_per_step, 0.0, variant)),
                      s.overhead_ms - s.ring_ms)
        layers = tuple(lv.predicted_ms for lv in s.sync.layers) if r > 1 else ()
        out.append(StageCosts(s.forward_ms, s.backward_ms + (s.midstep_ms + s.overhead_ms - s.ring_ms - stepped) / k,
                              s.send_ms, int(s.send_bytes), layers, 0.0 if idx == 0 else 0.5, s.shard != "none",
                              s.overlapped_ring_ms / s.syncs_per_step, lost_after=True, step_ms=stepped,
                              ready_share=ready_shares(costs, spec) if layers else ()))
    return out


def ready_shares(costs: ModelCosts, spec: StageSpec) -> tuple[float, ...]:
    """Per node of the stage with gradient bytes, in forward order: the share of the stage's backward
    done when its gradients are ready (the backward runs the nodes last first)."""
    back = [float(b) for b in costs.backward_ms[spec.first:spec.last + 1]]
    nbytes = costs.param_bytes[spec.first:spec.last + 1]
    total = sum(back)
    return tuple(sum(back[n:]) / total if total > 0 else 1.0 for n in range(len(back)) if nbytes[n] > 0)
