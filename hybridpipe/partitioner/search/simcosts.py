"""What the schedule simulator (``hybridpipe.pipeline.simulator``) charges each stage of a plan: one place
for the rule, read by the simulator and by the virtual-chunk search (``virtual.py``), which compares chunks'
charges to skip shard levels that cannot be simulated faster.
"""

from __future__ import annotations

from dataclasses import dataclass

from hybridpipe.partitioner.plan import Plan
from hybridpipe.partitioner.plan_parts import Stage
from hybridpipe.partitioner.schedule_registry import Schedule
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
