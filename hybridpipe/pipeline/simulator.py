"""Predicting a plan's step time by simulating its schedule: the same instruction lists the engine
runs, timed with the plan's per-stage costs and the partitioner's cost model.

Discrete-event model, per rank, in instruction order:

* Forward / Backward occupy the rank for the stage's ``forward_ms`` / ``backward_ms`` (one
  micro-batch on one replica; the last stage's include the loss). A split backward's halves
  take ``input_share`` and the rest of it (stage 0 computes no input gradients: all of it is
  BackwardWeight's).
* Sends are posted and the rank moves on; each directed link (sender, receiver) carries one
  message at a time, in posting order, for the stage's ``send_ms`` (activations, and gradients
  back over the same cut), or, when only ``send_bytes`` is known, the cost model's transfer time
  at the level of the link between the two ranks. A receive waits for the message's arrival.
  A message to the rank itself (zbv's stages p-1 and p share a rank) takes no time.
* A synced Backward makes the stage's layer gradients ready one after another across the
  backward (last layer first, evenly spaced); each layer's all-reduce starts when every replica
  has it ready and the replica group's previous all-reduce is done, and lasts the layer's
  ``predicted_ms`` (or, with no layer list, one all-reduce of the stage's ``sync_ms`` after the
  backward). SyncWait waits for the last one: overlap with the rest of the backward and the
  gradient sends is what hides it. A sharded stage's layer syncs are a reduce-scatter then an
  all-gather, half of the layer's ``predicted_ms`` each (``partitioner/cost/sharded.py``); the
  collectives its level adds inside the step (``sharding.midstep_ms``) lengthen its backwards. (What each
  stage is charged: ``partitioner/search/simcosts.py``, which the virtual-chunk search reads too.)
  The compute a stage loses beside its replicas' collectives while they overlap its compute
  (the plan's ``overlapped_ring_ms``) lengthens the synced Backward but not its gradients' ready
  times, so the step pays the larger of it and the exposed sync (``objective.predict_step_ms``).
  Where a stage's costs say ``lost_after`` (the refined prediction's, ``simcosts.evaluated_costs``), that
  compute lengthens nothing here: :func:`barrier_step_ms` charges it; and where they give ``ready_share``,
  each layer's gradient is ready at that share of the backward.
* A Step takes the ``step_ms`` of the rank's stages (0 unless given: the plan's optimizer steps are spread
  over its backwards, ``simcosts.one_stage_costs``); data loading and the loss's bookkeeping take no time.

The step time is measured between the ends of consecutive steps (t_k = when the last rank
finishes step k's list) in the steady state: the later half of the simulated steps, leaving
out the first and pipedream's warm-up (which may span several steps) and draining last step.
Utilisation is measured over the same window. :func:`barrier_step_ms` is one step alone, every rank
starting it together, as the runtime runs them (:func:`predicted_step_ms`: the refined prediction).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from typing_extensions import assert_never

from hybridpipe.partitioner.cost.calibration import Calibration
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.cost.wire import WIRE_BYTES, activation_wire
from hybridpipe.partitioner.plan import Plan
from hybridpipe.partitioner.schedule_registry import Schedule
from hybridpipe.partitioner.search.modelcosts import ModelCosts
from hybridpipe.partitioner.search.objective import Evaluation, Options, StageSpec, predict_step_ms
from hybridpipe.partitioner.search.simcosts import StageCosts, evaluated_costs, stage_costs
from hybridpipe.pipeline.instructions import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    Instruction,
    LoadInput,
    LoadTarget,
    Loss,
    RecvActivations,
    RecvGradients,
    SendActivations,
    SendGradients,
    Step,
    SyncStart,
    SyncWait,
)
from hybridpipe.pipeline.schedules import Topology, all_programs, settle_phase

COMPUTE = ("F", "B", "W")       # the intervals that occupy a rank


@dataclass(frozen=True)
class Interval:
    """Something that took time: on a rank ("F"/"B"), a link ("act"/"grad") or a replica group ("allreduce")."""

    kind: str
    micro_batch: int        # global micro-batch id (-1 for none)
    t0: float               # ms
    t1: float
    where: str              # "rank 3", "link 1->2", "stage 2 group"
    label: str = ""
    stage: int = -1         # the stage (model chunk) it belongs to (-1: none)


@dataclass
class SimResult:
    schedule: str
    steps: int
    step_ms: float                          # predicted time per step (steady state)
    step_ends: list[float]                  # t_k
    utilisation: list[float]                # per stage: busy fraction of its replicas in the measured window
    #                                         (a rank group holding several chunks: the group's, for each chunk)
    window: tuple[float, float]             # the measured window (ms)
    intervals: list[Interval] = field(default_factory=list)

    @property
    def makespan_ms(self) -> float:
        return self.step_ends[-1] if self.step_ends else 0.0


def plan_cost_model(plan: Plan, calibration: Calibration | None = None) -> CostModel:
    """The cost model ``plan`` was priced with: its cluster, ``calibration``, its wire precision."""
    return CostModel(plan.cluster, calibration, wire_bytes=WIRE_BYTES[plan.reduce_dtype],
                     activation_wire_bytes=activation_wire(plan.precision, plan.profile_precision))


def simulate(plan: Plan, *, schedule: Schedule | None = None, steps: int | None = None,
             micro_batches: int | None = None, cost_model: CostModel | None = None) -> SimResult:
    """Simulate ``steps`` consecutive steps of the plan's schedule (pipedream drains in the last one;
    default: enough steps for a steady state, see :func:`default_steps`)."""
    schedule = schedule or plan.kind
    topo = Topology(tuple(tuple(s.ranks) for s in plan.stages), micro_batches or plan.micro_batches)
    costs = stage_costs(plan)
    model = cost_model or plan_cost_model(plan)
    return simulate_topology(topo, schedule, costs, steps=steps, link_ms=_link_ms(costs, topo, model))


def _link_ms(costs: Sequence[StageCosts], topo: Topology, model: CostModel):
    def transfer(stage_cut: int, src: int, dst: int) -> float:
        c = costs[stage_cut]
        if c.send_ms > 0 or c.send_bytes <= 0:
            return c.send_ms
        return 1000 * model.p2p_seconds(c.send_bytes, model.cluster.level_between(src, dst))
    return transfer


def settle_steps(topo: Topology, schedule: Schedule) -> int:
    """Steps to leave out of the steady-state measurement: the first (flushed schedules), or
    pipedream's warm-up, which may span several steps."""
    return max(1, settle_phase(topo, schedule) - 1)


def default_steps(topo: Topology, schedule: Schedule) -> int:
    """gpipe/1f1b: 3 (a flush makes every step after the first alike). pipedream: its lists
    repeat after the warm-up, but a slow stage's backlog takes up to about two steps per stage
    to reach its steady rhythm, so twice that, plus the draining step."""
    if not schedule.asynchronous:
        return 3
    return 2 * (settle_steps(topo, schedule) + 2 * topo.n_stages) + 1


def simulate_topology(topo: Topology, schedule: Schedule, costs: Sequence[StageCosts], *, steps: int | None = None,
                      link_ms=None) -> SimResult:
    """The simulation itself, over plain per-stage costs. ``link_ms(cut, src, dst)`` gives a
    transfer's duration over the cut after stage ``cut`` (default: that stage's ``send_ms``)."""
    steps = default_steps(topo, schedule) if steps is None else steps
    if steps < 1:
        raise ValueError(f"simulate at least one step, got {steps}")
    link_ms = link_ms or (lambda cut, src, dst: costs[cut].send_ms)
    programs = dict(step_programs(topo, schedule, steps))
    sim = _Sim(topo, costs, link_ms, programs)
    sim.run()
    ends = [max(sim.step_end[r].get(k, 0.0) for r in programs) for k in range(steps)]
    lo, hi = _window(schedule.asynchronous, steps, settle_steps(topo, schedule))
    t_a = ends[lo - 1] if lo > 0 else 0.0
    t_b = ends[hi - 1]
    step_ms = (t_b - t_a) / (hi - lo)
    util = []
    for ranks in topo.stage_ranks:
        names = {f"rank {r}" for r in ranks}        # built once per stage, not per interval
        busy = sum(max(0.0, min(iv.t1, t_b) - max(iv.t0, t_a)) for iv in sim.intervals
                   if iv.kind in COMPUTE and iv.where in names)
        util.append(busy / (len(ranks) * (t_b - t_a)) if t_b > t_a else 0.0)
    return SimResult(schedule.name, steps, step_ms, ends, util, (t_a, t_b), sim.intervals)


@functools.lru_cache(maxsize=16)
def step_programs(topo: Topology, schedule: Schedule, steps: int
                  ) -> tuple[tuple[int, tuple[tuple[int, Instruction], ...]], ...]:
    """Each rank's instructions over ``steps`` consecutive steps (the last one draining), as (step, instruction)
    pairs, ranks in the order of their groups. They depend on the shape alone (not on costs), so plans that
    differ only in costs or shard levels (the virtual-chunk search simulates up to 256 of them) share them:
    cached, immutable."""
    programs: dict[int, list[tuple[int, Instruction]]] = {r: [] for rs in topo.groups for r in rs}
    for k in range(steps):
        for r, prog in all_programs(topo, schedule, phase=k, drain=k == steps - 1).items():
            programs[r] += [(k, ins) for ins in prog]
    return tuple((r, tuple(prog)) for r, prog in programs.items())


def _window(asynchronous: bool, steps: int, settle: int) -> tuple[int, int]:
    """Steps [lo, hi) whose durations give the steady-state step time: the later half of the
    steps after the warm-up, without pipedream's draining last step (as far as ``steps`` allows)."""
    hi = steps - 1 if asynchronous and steps >= 2 else steps
    lo = min(max(settle, hi // 2), hi - 1)
    return lo, hi


class _Sim:
    def __init__(self, topo: Topology, costs, link_ms, programs: Mapping[int, Sequence[tuple[int, Instruction]]]):
        self.topo, self.costs, self.link_ms, self.programs = topo, costs, link_ms, programs
        self.clock = {r: 0.0 for r in programs}
        self.pc = {r: 0 for r in programs}
        self.step_end: dict[int, dict[int, float]] = {r: {} for r in programs}
        self.link_free: dict[tuple[int, int], float] = {}
        # (src, dst, kind, producing stage, g) -> arrival
        self.arrivals: dict[tuple[int, int, str, int, int], float] = {}
        self.sync_next: dict[tuple[int, int], int] = {}                 # (rank, stage) -> micro-batch of its SyncStart
        self.ready: dict[tuple[int, int], list[list[float]]] = {}       # (stage, n-th sync) -> per replica ready times
        self.synced: dict[tuple[int, int], int] = {}                    # (rank, stage) -> syncs started
        self.waited: dict[tuple[int, int], int] = {}
        self.sync_done: dict[tuple[int, int], float] = {}
        self.group_free: dict[tuple[int, ...], float] = {}      # a replica group's all-reduces run one at a time
        self.intervals: list[Interval] = []

    def run(self) -> None:
        moved = True
        while moved:
            moved = False
            for r in self.programs:
                while self.pc[r] < len(self.programs[r]) and self._advance(r):
                    self.pc[r] += 1
                    moved = True
        stuck = [r for r in self.programs if self.pc[r] < len(self.programs[r])]
        if stuck:
            raise RuntimeError(f"the simulated schedule deadlocks at ranks {stuck} (validate the schedule)")

    def _advance(self, r: int) -> bool:
        k, ins = self.programs[r][self.pc[r]]
        stage = getattr(ins, "stage", -1)           # every instruction but Step names its stage
        c = self.costs[stage]
        M = self.topo.micro_batches
        g = k * M + ins.micro_batch if hasattr(ins, "micro_batch") else -1
        now = self.clock[r]
        match ins:
            case RecvActivations() | RecvGradients():
                kind = "act" if isinstance(ins, RecvActivations) else "grad"
                producer = stage - 1 if kind == "act" else stage
                t = self.arrivals.pop((ins.peer, r, kind, producer, g), None)
                if t is None:
                    return False
                self.clock[r] = max(now, t)
            case SendActivations() | SendGradients():
                kind = "act" if isinstance(ins, SendActivations) else "grad"
                cut = stage if kind == "act" else stage - 1         # the producing stage: the cut after it
                start = max(now, self.link_free.get((r, ins.peer), 0.0))
                end = start + (self.link_ms(cut, r, ins.peer) if ins.peer != r else 0.0)    # to itself: a hand-over
                self.link_free[(r, ins.peer)] = end
                self.arrivals[(r, ins.peer, kind, cut, g)] = end
                if end > start:
                    self.intervals.append(Interval(kind, g, start, end, f"link {r}->{ins.peer}", f"{kind} {g}", stage))
            case Forward():
                self._busy(r, "F", g, c.forward_ms, stage)
            case SyncStart():
                self.sync_next[(r, stage)] = g
            case BackwardInput():
                self._busy(r, "B", g, c.backward_ms * (c.input_share if stage > 0 else 0.0), stage)
            case Backward() | BackwardWeight():
                t0 = now
                ms = c.backward_ms
                if isinstance(ins, BackwardWeight):
                    ms *= 1.0 - (c.input_share if stage > 0 else 0.0)
                synced = self.sync_next.get((r, stage)) == g
                # the compute lost beside the sync stretches this backward, not its gradients' ready times
                stretch = c.lost_ms if synced and not c.lost_after else 0.0
                self._busy(r, "B" if isinstance(ins, Backward) else "W", g, ms + stretch, stage)
                if synced:
                    del self.sync_next[(r, stage)]
                    n = len(c.allreduce_ms)
                    shares = c.ready_share[::-1] or [(i + 1) / n for i in range(n)]     # last layer first
                    times = [t0 + ms * f for f in shares]               # i-th gradient ready
                    nth = self.synced.get((r, stage), 0)
                    self.ready.setdefault((stage, nth), []).append(times)
                    self.synced[(r, stage)] = nth + 1
            case SyncWait():
                key = (stage, self.waited.get((r, stage), 0))
                done = self._sync_end(stage, key)
                if done is None:
                    return False
                self.clock[r] = max(now, done)
                self.waited[(r, stage)] = key[1] + 1
            case Step():
                self.clock[r] = now + sum(self.costs[s].step_ms for s in self.topo.stages_of(r))
            case LoadInput() | LoadTarget() | Loss():
                pass                # no time of their own: in the stage's forward / backward and the step's sync
            case _:
                assert_never(ins)
        self.step_end[r][k] = self.clock[r]
        return True

    def _busy(self, r: int, kind: str, g: int, ms: float, stage: int) -> None:
        t0 = self.clock[r]
        self.clock[r] = t0 + ms
        self.intervals.append(Interval(kind, g, t0, t0 + ms, f"rank {r}", f"{kind}{g}", stage))

    def _sync_end(self, stage: int, key: tuple[int, int]) -> float | None:
        """When the replica group's key-th all-reduce round ends (None: not every replica is ready)."""
        if key in self.sync_done:
            return self.sync_done[key]
        slots = self.ready.get(key, [])
        if len(slots) < self.topo.replicas(stage):
            return None
        group = self.topo.stage_ranks[stage]
        t = self.group_free.get(group, 0.0)
        layers = self.costs[stage].allreduce_ms[::-1]          # gradients arrive last layer first
        sharded = self.costs[stage].sharded
        for i, ms in enumerate(layers):
            start = max(t, max(times[i] for times in slots))
            t = start + ms
            where = f"stage {stage} group"
            if sharded:
                mid = start + ms / 2
                self.intervals.append(Interval("reduce_scatter", -1, start, mid, where, f"reduce-scatter {i}", stage))
                self.intervals.append(Interval("all_gather", -1, mid, t, where, f"all-gather {i}", stage))
            else:
                self.intervals.append(Interval("allreduce", -1, start, t, where, f"allreduce {i}", stage))
        self.group_free[group] = t
        self.sync_done[key] = t
        return t


def barrier_step_ms(topo: Topology, schedule: Schedule, costs: Sequence[StageCosts]) -> float:
    """One flushed step that every rank starts together and that ends when the last rank has synced and
    stepped: how the runtime runs every step, which it ends with the step's loss summed over all ranks
    (``Trainer._mean``), so that nothing of the next step overlaps this one's syncs.

    A stage's compute lost beside its collectives (``lost_ms`` where ``lost_after``) slows what computes
    beside them: where its sync starts before the step's last compute ends (the drain of the other stages;
    hosts that share CPUs slow each other's compute), that last compute ends that much later, else its own
    last backward (then it steps, ``step_ms``): the step pays the larger of that and the exposed sync."""
    res = simulate_topology(topo, schedule, costs, steps=1)
    end = res.step_ends[0]
    last = max((iv.t1 for iv in res.intervals if iv.kind in COMPUTE), default=0.0)
    for stage, c in enumerate(costs):
        if c.lost_after and c.lost_ms:
            first = min((iv.t0 for iv in res.intervals if iv.kind == "allreduce" and iv.stage == stage), default=last)
            own = max(iv.t1 for iv in res.intervals if iv.kind in COMPUTE and iv.stage == stage)
            end = max(end, (last if first < last else own) + c.lost_ms + c.step_ms)
    return end


def predicted_step_ms(ev: Evaluation, costs: ModelCosts, stages: Sequence[StageSpec], opts: Options) -> float:
    """The step of an evaluated stage list (``objective.evaluate``) as its schedule's critical path: one step
    from a barrier (:func:`barrier_step_ms`) of the terms ``objective.predict_step_ms`` adds, each where it
    happens in the step (``simcosts.evaluated_costs``); never below a stage's transfer term. That is where
    a replicated stage's sync starts once its last backward is done, which may wait for later stages to
    drain, and what its replicas' idle time in the fill costs: the formula's closed form sees neither.
    Asynchronous schedules (no step boundary) and infeasible lists: ``predict_step_ms``."""
    if opts.schedule.asynchronous or not ev.fits:
        return predict_step_ms(ev, opts)
    topo = Topology(tuple(tuple(s.ranks) for s in stages), opts.micro_batches)
    step = barrier_step_ms(topo, opts.schedule, evaluated_costs(ev, costs, stages, opts))
    return max(step, max(opts.micro_batches * s.transfer_ms for s in ev.stages))


def closed_form_ms(micro_batches: int, n_stages: int, forward_ms: float, backward_ms: float) -> float:
    """(M + S - 1) x (f + b): one flushed step of a balanced pipeline with free communication."""
    return (micro_batches + n_stages - 1) * (forward_ms + backward_ms)


def stage_busy_ms(result: SimResult, ranks: Sequence[int]) -> float:
    names = {f"rank {r}" for r in ranks}
    return math.fsum(iv.t1 - iv.t0 for iv in result.intervals if iv.where in names and iv.kind in COMPUTE)


def bubble_fraction(result: SimResult) -> float:
    """The idle share of the stages' time in the steady-state window: 1 - their mean utilisation
    (for a flushed schedule of p balanced stages and M micro-batches, 1F1B's (p - 1) / (M + p - 1))."""
    return 1.0 - sum(result.utilisation) / len(result.utilisation) if result.utilisation else 0.0
