"""Checking a schedule without running it: execute every rank's instruction lists symbolically.

Sends are posted (they never block); a receive blocks until the next message from that peer
arrives and must name the micro-batch, kind and producing stage it expects (FIFO per peer, as
the transport is); ``SyncWait(stage)`` blocks until every replica of the stage has run as many
synced backwards of it (an all-reduce is a collective). A rank may hold several stages (virtual
stages): each instruction acts on its ``stage``'s state, which must be one of the rank's. Ranks
are advanced until all finish or none can move; the latter is a cycle of waits and is reported
with what each stuck rank waits for. Along the way each
instruction is checked against what the stage may do (only stage 0 loads inputs, a backward
follows its forward, messages go to the replica that owns the micro-batch, ...).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from typing_extensions import assert_never

from hybridpipe.partitioner.schedule_registry import Schedule
from hybridpipe.pipeline.instructions import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    Instruction,
    LoadInput,
    LoadTarget,
    Loss,
    MicroBatchInstruction,
    RecvActivations,
    RecvGradients,
    SendActivations,
    SendGradients,
    Step,
    StepInstruction,
    SyncStart,
    SyncWait,
)
from hybridpipe.pipeline.schedules import Topology, all_programs, settle_phase

# messages posted and not yet received, per (sender, receiver): ("act"|"grad", producing stage, global micro-batch)
_Queues = dict[tuple[int, int], deque[tuple[str, int, int]]]


class ScheduleError(ValueError):
    """The instruction lists are inconsistent or deadlock."""


@dataclass
class _Chunk:
    """What one stage of a rank holds."""

    stage: int
    have_input: set[int] = field(default_factory=set)
    forwarded: set[int] = field(default_factory=set)
    have_target: set[int] = field(default_factory=set)
    lossed: set[int] = field(default_factory=set)
    have_grad: set[int] = field(default_factory=set)
    backwarded: set[int] = field(default_factory=set)          # whole backward, or its weight half, done
    input_grads: set[int] = field(default_factory=set)         # input gradients computed (Backward or BackwardInput)
    sync_pending: int | None = None
    gathered: int = 0           # gathering ops (``gathers``) done, and reached (waiting in the collective)
    reached: int = 0
    gathered_step: int = -1     # the last step whose first forward gathered ("first")
    synced: int = 0
    waited: int = 0
    in_flight: int = 0
    max_in_flight: int = 0


@dataclass
class _Rank:
    rank: int
    chunks: dict[int, _Chunk]                   # by global stage
    replica: int
    program: list[tuple[int, Instruction]]      # (step, instruction)
    pc: int = 0
    in_flight: int = 0
    max_in_flight: int = 0
    steps: list[float] = field(default_factory=list)
    forward_order: list[int] = field(default_factory=list)
    backward_order: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class Report:
    """What a valid run of the lists did, per rank."""

    max_in_flight: dict[int, int]       # most micro-batches forwarded but not yet backwarded at once
    max_in_flight_stage: dict[tuple[int, int], int]     # the same per (rank, stage): one model chunk's
    forwards: dict[int, list[int]]      # global micro-batch ids, in order
    backwards: dict[int, list[int]]
    steps: dict[int, list[float]]       # grad_scale of every optimizer step, in order


def validate(topo: Topology, steps: Sequence[Mapping[int, Sequence[Instruction]]], *,
             step_barrier: bool = True, gathers: Mapping[int, str] | None = None) -> Report:
    """Run the lists of consecutive steps (``steps[k][rank]``) symbolically; raise ScheduleError.

    Micro-batch m of step k is global micro-batch ``k * M + m``. The run must end with every
    message received, every forwarded micro-batch backwarded, and all replicas of a stage having
    run the same number of syncs and optimizer steps. With ``step_barrier`` every rank must be
    able to finish step k before any rank starts step k+1 (so workers may meet in a collective
    between steps: metrics, checkpoints); messages may still be received a step later.
    ``gathers``: stage -> "each" (every forward and every input-gradient backward all-gathers
    across the stage's replicas: ZeRO-3 resharding after each forward) or "first" (the step's
    first forward only: ZeRO-3 keeping the weights over the step).
    """
    ranks = _ranks(topo, steps)
    queues: _Queues = {}
    for limit in (range(len(steps)) if step_barrier else [len(steps) - 1]):
        _run_until(topo, ranks, queues, limit, gathers or {})
        stuck = [st for st in ranks.values() if st.pc < len(st.program) and st.program[st.pc][0] <= limit]
        if stuck:
            waits = "; ".join(f"rank {st.rank} waits at {st.program[st.pc][1]} (step {st.program[st.pc][0]})"
                              for st in stuck)
            where = f"step {limit} cannot finish before step {limit + 1} starts: " if step_barrier else ""
            raise ScheduleError(f"the lists deadlock: {where}{waits}")
    left = [f"{list(q)} from rank {a} to rank {b}" for (a, b), q in sorted(queues.items()) if q]
    if left:
        raise ScheduleError(f"messages never received: {'; '.join(left)}")
    for st in ranks.values():
        for c in st.chunks.values():
            if c.forwarded != c.backwarded:
                raise ScheduleError(f"rank {st.rank} never ran the backward of micro-batches "
                                    f"{sorted(c.forwarded - c.backwarded)} on stage {c.stage}")
            if c.sync_pending is not None:
                raise ScheduleError(f"rank {st.rank}: SyncStart({c.sync_pending}) of stage {c.stage} without its "
                                    "Backward")
            if c.waited != c.synced:
                raise ScheduleError(f"rank {st.rank} started {c.synced} syncs of stage {c.stage} but waited for "
                                    f"{c.waited}")
    for s, stage_ranks in enumerate(topo.stage_ranks):
        counts = {(ranks[r].chunks[s].synced, len(ranks[r].steps)) for r in stage_ranks}
        if len(counts) > 1:
            raise ScheduleError(f"replicas of stage {s} disagree on (syncs, optimizer steps): {sorted(counts)}")
    return Report({r: st.max_in_flight for r, st in ranks.items()},
                  {(r, s): c.max_in_flight for r, st in ranks.items() for s, c in st.chunks.items()},
                  {r: st.forward_order for r, st in ranks.items()},
                  {r: st.backward_order for r, st in ranks.items()},
                  {r: st.steps for r, st in ranks.items()})


def _ranks(topo: Topology, steps: Sequence[Mapping[int, Sequence[Instruction]]]) -> dict[int, _Rank]:
    ranks: dict[int, _Rank] = {}
    for stage_ranks in topo.groups:
        for j, r in enumerate(stage_ranks):
            prog = [(k, ins) for k, step in enumerate(steps) for ins in step.get(r, ())]
            ranks[r] = _Rank(r, {s: _Chunk(s) for s in topo.stages_of(r)}, j, prog)
    extra = {r for step in steps for r in step} - set(ranks)
    if extra:
        raise ScheduleError(f"lists given for ranks {sorted(extra)} that have no stage")
    return ranks


def in_transit(topo: Topology, schedule: Schedule, phase: int) -> dict[int, list[tuple[int, str, int]]]:
    """Messages sent but not yet received when every rank has finished step ``phase`` after a
    (re)start: per receiver, ``(sender, "act"|"grad", micro-batch)`` in arrival order, the
    micro-batch numbered from the start of the *next* step (so negative). Empty for gpipe/1f1b.
    """
    M = topo.micro_batches
    p = min(phase, settle_phase(topo, schedule) + 1)       # the lists repeat from there on
    steps = [all_programs(topo, schedule, phase=k, drain=False) for k in range(p + 1)]
    ranks = _ranks(topo, steps)
    queues: _Queues = {}
    for limit in range(p + 1):
        _run_until(topo, ranks, queues, limit, {})
    out: dict[int, list[tuple[int, str, int]]] = {r: [] for r in ranks}
    for (src, dst), q in sorted(queues.items()):
        out[dst] += [(src, kind, g - (p + 1) * M) for kind, _, g in q]
    return out


def _run_until(topo: Topology, ranks: dict[int, _Rank], queues: _Queues, limit: int,
               gathers: Mapping[int, str]) -> None:
    """Advance every rank as far as it can without starting a step after ``limit``."""
    M = topo.micro_batches
    moved = True
    while moved:
        moved = False
        for st in ranks.values():
            while st.pc < len(st.program) and st.program[st.pc][0] <= limit:
                k, ins = st.program[st.pc]
                if isinstance(ins, MicroBatchInstruction):
                    done = (_gathered(topo, ranks, st, ins, k, gathers.get(ins.stage))
                            and _execute(topo, ranks, queues, st, ins.micro_batch, k * M + ins.micro_batch, ins))
                else:
                    done = _execute_step_level(topo, ranks, st, ins)
                if not done:
                    break
                st.pc += 1
                moved = True


def _gathered(topo: Topology, ranks: dict[int, _Rank], st: _Rank, ins: MicroBatchInstruction, step: int,
              mode: str | None) -> bool:
    """Whether ``ins`` may run as far as its stage's weight gathers go (see ``validate``): True for
    an instruction that gathers nothing; for one that does, once every replica reached its own."""
    c = st.chunks.get(ins.stage)
    if mode is None or c is None:
        return True
    if mode == "first":
        gathering = isinstance(ins, Forward) and c.gathered_step < step
    else:
        gathering = isinstance(ins, (Forward, Backward, BackwardInput))
    if not gathering:
        return True
    if c.reached == c.gathered:
        c.reached += 1
    if any(ranks[r].chunks[c.stage].reached < c.reached for r in topo.stage_ranks[c.stage]):
        return False
    c.gathered += 1
    c.gathered_step = step
    return True


def _fail(st: _Rank, ins: Instruction, why: str) -> ScheduleError:
    return ScheduleError(f"rank {st.rank} (stages {sorted(st.chunks)} replica {st.replica}): {ins}: {why}")


def _execute(topo: Topology, ranks: dict[int, _Rank], queues: _Queues, st: _Rank, m: int, g: int,
             ins: MicroBatchInstruction) -> bool:
    """Apply one instruction (micro-batch m of its step, g of the run); False if it must wait."""
    c = st.chunks.get(ins.stage)
    if c is None:
        raise _fail(st, ins, f"stage {ins.stage} is not one of the rank's")
    s = c.stage
    first, last = s == 0, s == topo.n_stages - 1
    if m % topo.replicas(s) != st.replica:
        raise _fail(st, ins, f"micro-batch {m} of the step belongs to replica {m % topo.replicas(s)}")
    match ins:
        case LoadInput():
            if not first:
                raise _fail(st, ins, "only stage 0 loads inputs")
            c.have_input.add(g)
        case RecvActivations():
            if first or ins.peer != topo.rank_for(s - 1, m):
                raise _fail(st, ins, "activations come from the previous stage's replica of the micro-batch")
            if not _take(queues, ins.peer, st.rank, ("act", s - 1, g), st, ins):
                return False
            c.have_input.add(g)
        case Forward():
            if g not in c.have_input or g in c.forwarded:
                raise _fail(st, ins, "forward without its input, or twice")
            c.forwarded.add(g)
            st.forward_order.append(g)
            st.in_flight += 1
            st.max_in_flight = max(st.max_in_flight, st.in_flight)
            c.in_flight += 1
            c.max_in_flight = max(c.max_in_flight, c.in_flight)
        case SendActivations():
            if last or g not in c.forwarded or ins.peer != topo.rank_for(s + 1, m):
                raise _fail(st, ins, "send activations after the forward, to the next stage's replica")
            queues.setdefault((st.rank, ins.peer), deque()).append(("act", s, g))
        case LoadTarget():
            if not last:
                raise _fail(st, ins, "only the last stage loads targets")
            c.have_target.add(g)
        case Loss():
            if not last or g not in c.forwarded or g not in c.have_target:
                raise _fail(st, ins, "the loss needs the last stage's forward and the target")
            c.lossed.add(g)
        case RecvGradients():
            if last or ins.peer != topo.rank_for(s + 1, m):
                raise _fail(st, ins, "gradients come from the next stage's replica of the micro-batch")
            if not _take(queues, ins.peer, st.rank, ("grad", s, g), st, ins):
                return False
            c.have_grad.add(g)
        case Backward() | BackwardInput():
            ready = g in (c.lossed if last else c.have_grad)
            if g not in c.forwarded or g in c.input_grads or not ready:
                raise _fail(st, ins, "backward needs its forward and its loss / output gradients, once")
            c.input_grads.add(g)
            if isinstance(ins, Backward):
                _weights_done(st, c, ins, g)
        case BackwardWeight():
            if g not in c.input_grads or g in c.backwarded:
                raise _fail(st, ins, "the weight half of a backward follows its input half, once")
            _weights_done(st, c, ins, g)
        case SendGradients():
            if first or g not in c.input_grads or ins.peer != topo.rank_for(s - 1, m):
                raise _fail(st, ins, "send gradients after the backward, to the previous stage's replica")
            queues.setdefault((st.rank, ins.peer), deque()).append(("grad", s - 1, g))
        case SyncStart():
            if c.sync_pending is not None:
                raise _fail(st, ins, "two SyncStarts without a Backward between them")
            c.sync_pending = g
        case _:
            assert_never(ins)
    return True


def _weights_done(st: _Rank, c: _Chunk, ins: Instruction, g: int) -> None:
    """Micro-batch g's parameter gradients of chunk c are in (a Backward or BackwardWeight): its
    activations are released, and a pending SyncStart of the chunk must have been for it."""
    if c.sync_pending is not None:
        if c.sync_pending != g:
            raise _fail(st, ins, f"SyncStart was for micro-batch {c.sync_pending}")
        c.sync_pending = None
        c.synced += 1
    c.backwarded.add(g)
    st.backward_order.append(g)
    st.in_flight -= 1
    c.in_flight -= 1


def _execute_step_level(topo: Topology, ranks: dict[int, _Rank], st: _Rank, ins: StepInstruction) -> bool:
    """Apply a SyncWait or Step; False if it must wait."""
    match ins:
        case SyncWait():
            c = st.chunks.get(ins.stage)
            if c is None:
                raise _fail(st, ins, f"stage {ins.stage} is not one of the rank's")
            if c.waited >= c.synced:
                raise _fail(st, ins, "no synced backward to wait for")
            need = c.waited + 1
            if any(ranks[r].chunks[c.stage].synced < need for r in topo.stage_ranks[c.stage]):
                return False
            c.waited += 1
        case Step():
            for c in st.chunks.values():
                if c.waited != c.synced or c.sync_pending is not None:
                    raise _fail(st, ins, f"optimizer step before the gradient sync of stage {c.stage} finished")
                if c.input_grads - c.backwarded:
                    raise _fail(st, ins, f"optimizer step before the weight gradients of micro-batches "
                                         f"{sorted(c.input_grads - c.backwarded)} of stage {c.stage}")
            st.steps.append(ins.grad_scale)
        case _:
            assert_never(ins)
    return True


def _take(queues: _Queues, src: int, dst: int, want: tuple[str, int, int], st: _Rank, ins: Instruction) -> bool:
    q = queues.get((src, dst))
    if not q:
        return False
    if q[0] != want:
        have = "/".join(map(str, q[0]))
        raise _fail(st, ins, f"the next message from rank {src} is {have}, not {'/'.join(map(str, want))}")
    q.popleft()
    return True
