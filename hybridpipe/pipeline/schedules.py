"""Pipeline schedules as pure functions: (topology, rank) -> this rank's instruction list for a step.

A stage with r replicas takes micro-batch m of a step on replica ``m % r``. Each replica runs a
sequence of forwards ``F(m)`` and backwards ``B(m)`` over its own micro-batches, expanded into
instructions (receive, compute, send; sync and optimizer step where the schedule says):

* ``gpipe``: all forwards, then all backwards; gradients accumulate; the last backward starts
  the replicas' all-reduce; one optimizer step (grads x 1/M) at the end of the step (flush).
* ``1f1b``: ``warm`` forwards, then one backward and one forward alternately, then the
  remaining backwards (drain); one step at the end, as in gpipe: the same update as SGD on the
  step's M micro-batches, with at most ``warm`` micro-batches' activations alive at once.
* ``zb-h1``: 1F1B's order with every backward split into ``BackwardInput`` (the gradients the
  previous stage waits for) and ``BackwardWeight`` (the parameters' gradients), a later stage
  holding back its first ``defer`` weight halves into the drain, where 1F1B's stages wait (see
  ``partitioner/schedule_registry.py``); one step at the end, as 1f1b.
* ``pipedream``: PipeDream's asynchronous 1F1B. No flush: every backward is followed by an
  optimizer step (replicas sum their grads, x 1/r, so each update is a round of r micro-batches),
  and the stream of micro-batches runs on from one step into the next. Weight stashing (in the
  engine) makes each backward use the weights of its own forward; the micro-batches in flight on
  a replica, hence the weight versions kept, are at most ``warm``. A step's list starts at the
  step's first forward; with ``drain=True`` it ends with every backward still owed, else those
  are left to the next step's list (where their micro-batch numbers are negative).

``warm`` = ceil(W / r) forwards before the first backward, with W the workers of this stage and
all later ones (PipeDream's NOAM): enough to keep a balanced pipeline busy.

What a schedule means (its op order, whether it flushes, splits the backward, ...) comes from its
``Schedule`` object (``partitioner/schedule_registry.py``); this module only expands ops into
instructions and cuts pipedream's endless stream into steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from hybridpipe.errors import UserError, counted
from hybridpipe.partitioner.chunk_orders import Place
from hybridpipe.partitioner.plan import Plan
from hybridpipe.partitioner.schedule_registry import Op, Schedule, one_f_one_b_ops
from hybridpipe.pipeline.instructions import (
    RECEIVES,
    SENDS,
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
    message_key,
)


@dataclass(frozen=True)
class Topology:
    """What a schedule needs of a plan: each stage's ranks (replica order) and micro-batches per step."""

    stage_ranks: tuple[tuple[int, ...], ...]
    micro_batches: int

    @classmethod
    def from_plan(cls, plan: Plan) -> Topology:
        return cls(tuple(tuple(s.ranks) for s in plan.stages), plan.micro_batches)

    @property
    def n_stages(self) -> int:
        return len(self.stage_ranks)

    def replicas(self, stage: int) -> int:
        return len(self.stage_ranks[stage])

    @property
    def world_size(self) -> int:
        return len({r for ranks in self.stage_ranks for r in ranks})

    @property
    def virtual_stages(self) -> int:
        """Model chunks (stages) per rank: V of a plan with virtual stages, else 1."""
        return self.n_stages // len(self.groups)

    @property
    def groups(self) -> tuple[tuple[int, ...], ...]:
        """The distinct rank groups (each stage's ranks), in the order of their first stage."""
        return tuple(dict.fromkeys(self.stage_ranks))

    def stages_of(self, rank: int) -> tuple[int, ...]:
        """The global stages (model chunks) ``rank`` runs, in model order."""
        return tuple(s for s, ranks in enumerate(self.stage_ranks) if rank in ranks)

    def locate(self, rank: int) -> tuple[int, int]:
        """(stage, replica) of a global rank that runs one stage (use :meth:`stages_of` and
        :meth:`replica_of` for a rank with several model chunks)."""
        stages = self.stages_of(rank)
        if not stages:
            raise UserError(f"rank {rank} has no stage (the plan uses ranks 0..{self.world_size - 1})")
        if len(stages) > 1:
            raise ValueError(f"rank {rank} runs {len(stages)} stages {list(stages)} (virtual stages); "
                             "use Topology.stages_of")
        return stages[0], self.stage_ranks[stages[0]].index(rank)

    def replica_of(self, rank: int) -> int:
        """The replica index of ``rank`` in its group (the same in each of its stages)."""
        stages = self.stages_of(rank)
        if not stages:
            raise UserError(f"rank {rank} has no stage (the plan uses ranks 0..{self.world_size - 1})")
        return self.stage_ranks[stages[0]].index(rank)

    def rank_for(self, stage: int, micro_batch: int) -> int:
        """The rank of ``stage`` that handles ``micro_batch`` (round-robin over its replicas)."""
        ranks = self.stage_ranks[stage]
        return ranks[micro_batch % len(ranks)]

    def warm(self, stage: int) -> int:
        """Forwards a replica runs before its first backward (PipeDream's NOAM)."""
        later = sum(len(r) for r in self.stage_ranks[stage:])
        return math.ceil(later / self.replicas(stage))

    def defer(self, stage: int) -> int:
        """Weight-gradient halves a replica of a split schedule holds back for the drain: as many
        as lift its micro-batches in flight to the whole pipeline's depth (the first stage's)."""
        return math.ceil(self.world_size / self.replicas(stage)) - self.warm(stage)


def check_schedulable(topo: Topology, schedule: Schedule) -> None:
    """Refuse (one line) a schedule the topology cannot run."""
    layout = schedule.layout_error(topo.stage_ranks, topo.virtual_stages)
    if layout:
        raise UserError(f"{layout}; re-partition for it (hybridpipe partition --schedule {schedule.name})")
    if topo.micro_batches < 1:
        raise UserError(f"a step needs at least one micro-batch, got {topo.micro_batches}")
    r_max = max(topo.replicas(s) for s in range(topo.n_stages))
    if topo.micro_batches < r_max:
        m = topo.micro_batches
        raise UserError(f"{counted(m, 'micro-batch')} per step leave{'s' if m == 1 else ''} "
                        f"replicas of a {r_max}-replica stage idle; use --micro-batches >= {r_max}")
    bad = [s for s in range(topo.n_stages) if not schedule.replicas_ok(topo.replicas(s), topo.micro_batches)]
    if bad:
        s = bad[0]
        raise UserError(f"{schedule.name} updates each stage once per round of its replicas, so micro-batches per step "
                            f"({topo.micro_batches}) must be a multiple of every stage's replica count (stage {s} "
                            f"has {topo.replicas(s)}); choose --micro-batches accordingly")


def rank_program(topo: Topology, rank: int, schedule: Schedule, *, phase: int = 0,
                 drain: bool = True) -> list[Instruction]:
    """This rank's instructions for one step.

    gpipe/1f1b: every step is the same self-contained list (``phase``/``drain`` are ignored).
    pipedream: ``phase`` = steps since the pipeline was (re)started (0 = warm-up from empty);
    ``drain`` = finish every micro-batch in flight at the end of this step.
    """
    check_schedulable(topo, schedule)
    kind = schedule
    if kind.chunk_ops is not None:
        return _chunked_program(topo, rank, kind)
    stage, replica = topo.locate(rank)
    r = topo.replicas(stage)
    if kind.asynchronous:
        chunk = [(op, m, stage) for op, m in _pipedream_chunk(topo, stage, replica, phase, drain)]
        return _expand(topo, chunk, sync_on=lambda i: r > 1, step_after=lambda i: 1.0 / r)
    mine = [m for m in range(topo.micro_batches) if m % r == replica]
    assert kind.replica_ops is not None
    ops = [(op, m, stage) for op, m in kind.replica_ops(mine, topo.warm(stage), topo.defer(stage))]
    return _flushed(topo, ops, r, kind.split_backward)


def _chunked_program(topo: Topology, rank: int, kind: Schedule) -> list[Instruction]:
    """The list of a rank holding V chunks (interleaved-1f1b, zbv): the schedule's chunk ops over
    the replica's micro-batches, local chunk v = the rank's v-th stage in model order. Two chunks
    share a link (looped: group p-1 sends group 0 activations and gradients), and a link is FIFO,
    so messages are received in the order the peer sends them (see :func:`_expand`)."""
    ops = _chunked_ops(topo, rank, kind)
    peers = {r for s in topo.stages_of(rank) for t in (s - 1, s + 1) if 0 <= t < topo.n_stages
             for r in topo.stage_ranks[t]}
    incoming = {peer: [msg for to, msg in _sends(topo, _chunked_ops(topo, peer, kind)) if to == rank]
                for peer in sorted(peers)}
    return _flushed(topo, ops, topo.replicas(ops[0][2]), kind.split_backward, incoming)


def _chunked_ops(topo: Topology, rank: int, kind: Schedule) -> list[StageOp]:
    assert kind.chunk_ops is not None
    stages, replica = topo.stages_of(rank), topo.replica_of(rank)
    r = topo.replicas(stages[0])
    place = Place(stages[0], tuple(len(g) for g in topo.groups), topo.micro_batches)
    mine = [m for m in range(topo.micro_batches) if m % r == replica]
    return [(op, m, stages[v]) for op, m, v in kind.chunk_ops(mine, place, topo.virtual_stages)]


Message = tuple[str, int, int]      # ("act" | "grad", producing stage, micro-batch): what a message key names


def _sends(topo: Topology, ops: Sequence[StageOp]) -> list[tuple[int, Message]]:
    """(receiver, message) of every send ``ops`` make, in order."""
    out = []
    for op, m, stage in ops:
        if op == "F" and stage < topo.n_stages - 1:
            out.append((topo.rank_for(stage + 1, m), ("act", stage, m)))
        elif op == "B" and stage > 0:
            out.append((topo.rank_for(stage - 1, m), ("grad", stage - 1, m)))
    return out


def _flushed(topo: Topology, ops: Sequence[StageOp], replicas: int, split_backward: bool,
             incoming: dict[int, list[Message]] | None = None) -> list[Instruction]:
    """The instructions of a flushed schedule's ops: each stage's last weight-completing op starts
    its all-reduce (when replicated), one optimizer step after the rank's last such op."""
    weights_done = "W" if split_backward else "B"      # the op after which a micro-batch's weight gradients are whole
    last_of = {stage: i for i, (op, _, stage) in enumerate(ops) if op == weights_done}
    synced = set(last_of.values())
    last = max(synced)
    scale = 1.0 / topo.micro_batches
    return _expand(topo, ops, split_backward=split_backward, sync_on=lambda i: i in synced and replicas > 1,
                   step_after=lambda i: scale if i == last else None, incoming=incoming)


def forwarded(topo: Topology, schedule: Schedule, stage: int, *, phase: int = 0, drain: bool = True) -> tuple[int, ...]:
    """The micro-batches (relative to the step, as in the lists) whose forward on ``stage`` one
    step's lists run, on any of its replicas, in order."""
    return tuple(sorted({ins.micro_batch for r in topo.stage_ranks[stage]
                         for ins in rank_program(topo, r, schedule, phase=phase, drain=drain)
                         if isinstance(ins, Forward) and ins.stage == stage}))


def eval_program(topo: Topology, rank: int) -> list[Instruction]:
    """This rank's list for one forward-only evaluation step: each of its micro-batches (round-robin
    over the stage's replicas, as in training) received or loaded, forwarded, and sent on or scored
    (last stage); no backward, no sync, no optimizer step. The same list for every schedule."""
    replica = topo.replica_of(rank)
    mine = [("F", m, stage) for stage in topo.stages_of(rank)
            for m in range(topo.micro_batches) if m % topo.replicas(stage) == replica]
    return _expand(topo, mine, sync_on=lambda i: False, step_after=lambda i: None)


def all_programs(topo: Topology, schedule: Schedule, *, phase: int = 0,
                 drain: bool = True) -> dict[int, list[Instruction]]:
    """Every rank's list for one step."""
    return {rank: rank_program(topo, rank, schedule, phase=phase, drain=drain)
            for ranks in topo.groups for rank in ranks}


# ---- pipedream: one endless 1F1B stream cut into steps ----------------------------------------
def _pipedream_stream(topo: Topology, stage: int, replica: int, steps: int) -> list[Op]:
    """The replica's uncut 1F1B stream over ``steps`` steps; micro-batches numbered from the restart."""
    r = topo.replicas(stage)
    mine = [g for g in range(steps * topo.micro_batches) if g % r == replica]
    return list(one_f_one_b_ops(mine, topo.warm(stage)))


def settle_phase(topo: Topology, schedule: Schedule) -> int:
    """The first step (counted from a (re)start) from which every rank's list repeats unchanged
    (micro-batches counted from each step's start): 0 for gpipe/1f1b; for pipedream, once the
    warm-up (which may span several steps) is over."""
    if not schedule.asynchronous:
        return 0
    return max(_stage_settle(topo, s) for s in range(topo.n_stages))


def _stage_settle(topo: Topology, stage: int) -> int:
    per_step = topo.micro_batches // topo.replicas(stage)
    return math.ceil(topo.warm(stage) / per_step) + 1


def _pipedream_chunk(topo: Topology, stage: int, replica: int, phase: int, drain: bool) -> list[Op]:
    """Step ``phase``'s slice of the stream (from its first forward to the next step's first
    forward, or to the end with ``drain``), micro-batches renumbered from the step's start.

    The stream is periodic once warmed up, so a late phase is an early one shifted."""
    M = topo.micro_batches
    p = min(phase, _stage_settle(topo, stage))
    stream = _pipedream_stream(topo, stage, replica, p + 2)

    def first_forward(step: int) -> int:
        return next(i for i, (kind, g) in enumerate(stream) if kind == "F" and g // M == step)

    start = first_forward(p)
    if drain:   # the stream of p + 1 steps ends with the drain and shares the longer one's prefix
        chunk = _pipedream_stream(topo, stage, replica, p + 1)[start:]
    else:
        chunk = stream[start:first_forward(p + 1)]
    return [(kind, g - p * M) for kind, g in chunk]


# ---- expansion into instructions ------------------------------------------------------------
StageOp = tuple[str, int, int]      # ("F" | "B" | "W", micro-batch, global stage)


def _expand(topo: Topology, ops: Sequence[StageOp], sync_on, step_after, *,
            split_backward: bool = False, incoming: dict[int, list[Message]] | None = None) -> list[Instruction]:
    """Ops -> instructions. ``sync_on(i)``: op i (the one that completes its stage's weight
    gradients) starts the replicas' all-reduce of that stage; ``step_after(i)``: the grad scale of
    an optimizer step after op i, or None (the syncs started since the last step are waited for,
    in order, just before it); ``split_backward``: "B" computes input gradients only, "W" the weights'.

    ``incoming`` (per peer, the messages it sends this rank in its order): an op that needs
    message k from a peer first receives that peer's messages before k not yet received (links
    are FIFO); waiting for an earlier message never waits longer than for k itself. Without it
    every receive sits right before its op (each link then carries one kind of message in the
    receiver's order)."""
    out: list[Instruction] = []
    pending: list[int] = []         # stages whose all-reduce was started and not yet waited for
    taken = {peer: 0 for peer in incoming or {}}

    def receive(msg: Message, peer: int) -> None:
        if incoming is None:
            out.append(_receive(msg, peer))
            return
        queue = incoming[peer]
        if msg in queue[:taken[peer]]:
            return
        k = queue.index(msg, taken[peer])
        out.extend(_receive(x, peer) for x in queue[taken[peer]:k + 1])
        taken[peer] = k + 1

    for i, (op, m, stage) in enumerate(ops):
        first, last = stage == 0, stage == topo.n_stages - 1
        if op == "F":
            if first:
                out.append(LoadInput(m, stage))
            else:
                receive(("act", stage - 1, m), topo.rank_for(stage - 1, m))
            out.append(Forward(m, stage))
            out += ([LoadTarget(m, stage), Loss(m, stage)] if last
                    else [SendActivations(m, topo.rank_for(stage + 1, m), stage)])
            continue
        sync = sync_on(i)
        if op == "B":
            if not last:
                receive(("grad", stage, m), topo.rank_for(stage + 1, m))
            if sync and not split_backward:
                out.append(SyncStart(m, stage))
            out.append(BackwardInput(m, stage) if split_backward else Backward(m, stage))
            if not first:
                out.append(SendGradients(m, topo.rank_for(stage - 1, m), stage))
        else:       # "W"
            if sync:
                out.append(SyncStart(m, stage))
            out.append(BackwardWeight(m, stage))
        if sync:
            pending.append(stage)
        scale = step_after(i)
        if scale is not None:
            out += [SyncWait(st) for st in pending]
            pending.clear()
            out.append(Step(scale))
    return out


def _receive(msg: Message, peer: int) -> Instruction:
    kind, producer, m = msg
    return RecvActivations(m, peer, producer + 1) if kind == "act" else RecvGradients(m, peer, producer)


# ---- what the transport needs to know ahead of time -----------------------------------------
def channel_edges(topo: Topology) -> list[tuple[int, int]]:
    """Every pair of ranks that exchange messages (for ``pair_groups`` / ``open_channels``):
    each replica of a stage with each replica of the next stage that shares a micro-batch. Two
    consecutive stages on one rank (zbv's stages p-1 and p) hand over in the rank itself: their
    SendActivations / RecvActivations name the rank as its own peer and need no channel."""
    edges = set()
    for s in range(topo.n_stages - 1):
        for m in range(topo.micro_batches):
            edges.add((topo.rank_for(s, m), topo.rank_for(s + 1, m)))
    return sorted((a, b) for a, b in edges if a != b)


def transfer_program(topo: Topology, rank: int, schedule: Schedule) -> list[tuple[str, int, str]] | None:
    """This rank's ``("send"|"recv", peer, key)`` of one step, in order: the input of
    ``hybridpipe.comm.p2p.link_orders`` for the ``sra`` channel mode (keys as the engine uses
    them). None for pipedream, whose messages cross step boundaries: use ``sa`` there (``sra``
    without an order behaves like ``sa``)."""
    if schedule.asynchronous:
        return None
    out = []
    for ins in rank_program(topo, rank, schedule):
        if isinstance(ins, SENDS + RECEIVES) and ins.peer != rank:       # to itself: no channel (channel_edges)
            op = "send" if isinstance(ins, SENDS) else "recv"
            out.append((op, ins.peer, message_key(ins, ins.micro_batch, topo.micro_batches)))
    return out
