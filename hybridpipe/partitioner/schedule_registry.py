"""One object per pipeline schedule: everything the partitioner, the simulator, the engine, the
validator and the CLI ask of a schedule, found by name in :data:`REGISTRY`.

A schedule is data plus one pure function: ``replica_ops(mine, warm, defer)`` gives the order in
which one replica runs its micro-batches' computations, as ``("F" | "B" | "W", micro-batch)``:

* ``F`` forward; ``B`` backward (the whole backward, or only the input gradients when the
  schedule ``split_backward``s); ``W`` the weight gradients of a split backward.
* ``mine`` the replica's micro-batches of a step in order, ``warm`` forwards before the first
  backward (PipeDream's NOAM, ``pipeline.schedules.Topology.warm``), ``defer`` how many weight
  gradients a split schedule may hold back to fill the drain's bubbles (``Topology.defer``).

``pipeline/schedules.py`` expands the ops into the instruction lists (receives, sends, syncs,
optimizer steps) that the engine runs, the validator checks and the simulator times. Adding a
schedule = adding an entry here (and, for a new kind of computation, an instruction).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import TypeVar

import numpy as np

from hybridpipe.errors import UserError
from hybridpipe.partitioner.chunk_orders import ChunkOp, Place, interleaved_ops, replicated, zbv_ops

Op = tuple[str, int]      # ("F" | "B" | "W", micro-batch)
Count = TypeVar("Count", int, np.ndarray)      # a count, or counts elementwise (the DP's candidate tables)

DEFAULT_SCHEDULE = "1f1b"      # the schedule of a plan or command that names none


class Layout(Enum):
    """Where a schedule puts the p*V model chunks (stages, in model order) on the p rank groups."""

    SINGLE = "single"   # one stage per group (V = 1): stage s on group s
    LOOPED = "looped"   # interleaved (Megatron): stage s on group s % p, so each group holds every p-th chunk
    V = "v"             # V shape (V = 2): stage s on group s for s < p and on group 2p-1-s after, so group 0
    #                     holds the first and the last chunk


OpsFn = Callable[[Sequence[int], int, int], Iterator[Op]]
ChunkOpsFn = Callable[[Sequence[int], Place, int], Iterator[ChunkOp]]    # (mine, place, V) -> (op, m, local chunk)


@dataclass(frozen=True)
class Schedule:
    """What a schedule means (see the module docstring)."""

    name: str
    summary: str                    # one line for help texts
    replica_ops: OpsFn | None       # (mine, warm, defer) -> ops of one replica in one step (one chunk per rank)
    asynchronous: bool = False      # no flush: an optimizer step after every backward, weights stashed
    split_backward: bool = False    # B = input gradients, W = weight gradients, scheduled apart
    drain_backward_share: float = 1.0   # of the other stages' backward, the part the fill + drain costs
    forwards_first: bool = False    # every forward of the step before any backward (holds all k)
    layout: Layout = Layout.SINGLE  # where model chunks live (see :class:`Layout`, :meth:`group_of`)
    chunk_ops: ChunkOpsFn | None = None     # the ops of a replica of a group holding V chunks (chunk_orders.py)

    def virtual_ok(self, virtual: int) -> bool:
        """Whether the schedule runs ``virtual`` model chunks per rank."""
        return {Layout.SINGLE: virtual == 1, Layout.LOOPED: virtual >= 1, Layout.V: virtual == 2}[self.layout]

    def virtual_need(self) -> str:
        """What :meth:`virtual_ok` asks of the chunks per rank, in words."""
        return {Layout.SINGLE: "1 (no virtual stages)", Layout.LOOPED: "1 or more",
                Layout.V: "2 (the V shape)"}[self.layout]

    @property
    def chunked(self) -> bool:
        """The schedule runs several model chunks per rank (virtual stages)."""
        return self.layout is not Layout.SINGLE

    def group_of(self, stage: int, groups: int) -> int:
        """The rank group (0..p-1, p = ``groups``) that holds global stage ``stage`` (see :class:`Layout`)."""
        if self.layout is Layout.V and stage >= groups:
            return 2 * groups - 1 - stage
        return stage % groups

    def layout_error(self, stage_ranks: Sequence[Sequence[int]], virtual: int) -> str | None:
        """What is wrong (a phrase) with the stages' ranks (model order) for ``virtual`` chunks per
        rank under this schedule, or None: groups disjoint, every rank in exactly ``virtual``
        stages, stage s on group :meth:`group_of` (s, p)."""
        if not self.virtual_ok(virtual):
            return f"schedule {self.name} runs {self.virtual_need()} model chunks per rank, not {virtual}"
        if len(stage_ranks) % virtual:
            return f"{len(stage_ranks)} stages cannot be {virtual} chunks on each rank group"
        p = len(stage_ranks) // virtual
        groups = [tuple(r) for r in stage_ranks[:p]]
        seen = [r for g in groups for r in g]
        if len(set(seen)) != len(seen):
            return "the first p stages must run on disjoint rank groups (each rank in one group)"
        for s, ranks in enumerate(stage_ranks):
            want = groups[self.group_of(s, p)]
            if tuple(ranks) != want:
                return (f"stage {s} runs on ranks {list(ranks)} but {self.name} with {virtual} chunks per rank puts it "
                        f"on group {self.group_of(s, p)} (ranks {list(want)})")
        return None

    @property
    def flushed(self) -> bool:
        """Every step ends with one optimizer step on the step's summed gradients (= sequential SGD)."""
        return not self.asynchronous

    @property
    def keeps_tied_weights(self) -> bool:
        """Copies of a weight that several stages share stay identical (needs a flush)."""
        return self.flushed

    def inflight(self, k: Count, depth: Count, depth_all: Count) -> Count:
        """Micro-batches whose activations a replica holds at once: ``k`` its micro-batches per
        step, ``depth`` its warm-up forwards (workers of its stage and later ones over its
        replicas), ``depth_all`` that of the whole pipeline (all workers over its replicas).
        Numbers, or numpy arrays elementwise."""
        if self.forwards_first:
            return k
        if self.asynchronous:
            return depth
        held = depth_all if self.split_backward else depth
        return np.minimum(k, held) if isinstance(k, np.ndarray) or isinstance(held, np.ndarray) else min(k, held)

    def whole(self, k: Count, depth: Count, depth_all: Count) -> Count:
        """Of :meth:`inflight`, the micro-batches holding their whole activations at the replica's peak;
        the rest sit between their backward's input and weight halves (a split schedule), holding only
        what the weight half reads. zb-h1 runs 1F1B's ``depth`` forwards ahead and holds back
        ``depth_all - depth`` weight halves (``pipeline.schedules.Topology.warm`` / ``defer``): after a
        forward of its steady state ``min(k, depth)`` micro-batches are whole and the rest halves, its
        peak where a half holds no more than a whole. Chunked schedules count on their op order
        (:meth:`held_peak`); the others hold every in-flight micro-batch whole."""
        total = self.inflight(k, depth, depth_all)
        if not self.split_backward or self.replica_ops is None:
            return total
        return np.minimum(k, depth) if isinstance(k, np.ndarray) or isinstance(depth, np.ndarray) else min(k, depth)

    def most_halves(self, k: Count, depth: Count, depth_all: Count) -> Count:
        """The most micro-batches a replica holds between their backward's input and weight halves at
        once: zb-h1 holds back ``depth_all - depth`` weight halves, one more right after a B (in its
        drain, with the wholes' count down by as many); 0 for a schedule without the split."""
        if not self.split_backward or self.replica_ops is None:
            return 0 * k
        most = self.inflight(k, depth, depth_all)
        return np.minimum(most, depth_all - depth + 1)

    def held_bytes(self, inflight: Count, whole: Count, halves: Count, stash: float | np.ndarray,
                   half: float | np.ndarray) -> float | np.ndarray:
        """The most activation bytes a replica holds at once, a micro-batch weighing ``stash`` whole
        and ``half`` between its B and W: after a forward, ``whole`` (:meth:`whole`) of the
        ``inflight`` whole and the rest halves; or, where a half outweighs a whole (the gradients its
        input half recorded: a big vocabulary's logits'), at the most ``halves`` (:meth:`most_halves`),
        the rest whole. Numbers, or numpy arrays elementwise."""
        after_forward = stash * whole + half * (inflight - whole)
        return np.maximum(after_forward, stash * (inflight - halves) + half * halves)

    def chunk_inflight(self, place: Place, virtual: int) -> tuple[int, ...]:
        """Per local chunk (0..V-1), the most micro-batches whose activations a replica of the
        group at ``place`` holds at once (forwarded, weight gradients not yet computed), counted
        on the schedule's own op order for its busiest replica (replica 0: ceil(M / r) of them).
        Megatron's interleaved order holds more on earlier chunks: its first rank runs
        (V-1) q + 2 (p-1) + 1 forwards (q micro-batches per round) before its first backward."""
        most = [0] * virtual
        for held in self._holding(place, virtual):
            most = [max(a, b) for a, b in zip(most, held, strict=True)]
        return tuple(most)

    def held_peak(self, place: Place, virtual: int, per_micro_batch: Sequence[float],
                  per_half: Sequence[float] | None = None) -> float:
        """The most bytes of activations a replica at ``place`` holds at once over its local chunks,
        chunk v's micro-batch weighing ``per_micro_batch[v]``, and ``per_half[v]`` between its
        backward's input and weight halves (a split schedule; default: the same): the chunks' own
        peaks (:meth:`chunk_inflight`) do not all come at one time, so their sum over-counts."""
        half = per_micro_batch if per_half is None else per_half
        return max((sum(n * b + m * h for n, m, b, h in zip(whole, halves, per_micro_batch, half, strict=True))
                    for whole, halves in self._split_holding(place, virtual)), default=0.0)

    def _holding(self, place: Place, virtual: int) -> Iterator[list[int]]:
        """After each op of the busiest replica at ``place``: the micro-batches each local chunk holds."""
        for whole, halves in self._split_holding(place, virtual):
            yield [a + b for a, b in zip(whole, halves, strict=True)]

    def _split_holding(self, place: Place, virtual: int) -> Iterator[tuple[list[int], list[int]]]:
        """After each op of the busiest replica at ``place``: per local chunk, the micro-batches holding
        their whole activations and those between their input and weight halves (a split schedule)."""
        assert self.chunk_ops is not None
        r = place.replicas[place.group]
        whole, halves = [0] * virtual, [0] * virtual
        for op, _, v in self.chunk_ops(range(0, place.micro_batches, r), place, virtual):
            if op == "F":
                whole[v] += 1
            elif op == "B":
                whole[v] -= 1
                halves[v] += 1 if self.split_backward else 0
            elif op == "W":
                halves[v] -= 1
            yield whole, halves

    def weight_versions(self, inflight: Count) -> Count | int:
        """Extra copies of the weights kept (weight stashing): one per in-flight micro-batch beyond the
        live one (numbers, or numpy arrays elementwise)."""
        return inflight - 1 if self.asynchronous else 0

    def syncs_per_step(self, k: Count) -> Count | int:
        """Gradient all-reduces (and optimizer steps) per step for a replica of ``k`` micro-batches
        (numbers, or numpy arrays elementwise)."""
        return k if self.asynchronous else 1

    def replicas_ok(self, replicas: Count, micro_batches: int) -> bool | np.ndarray:
        """Every replica gets micro-batches (r >= 1 and r <= M); asynchronous rounds need r to divide M
        (numbers, or numpy arrays elementwise)."""
        ok = (replicas >= 1) & (replicas <= micro_batches)
        if not self.asynchronous:
            return ok
        return ok & (micro_batches % np.maximum(replicas, 1) == 0)

    def replicas_need(self, replicas: int) -> str:
        """What :meth:`replicas_ok` asks of the micro-batches, in words."""
        return f"a multiple of {replicas}" if self.asynchronous else f"at least {replicas}"


def gpipe_ops(mine: Sequence[int], warm: int, defer: int) -> Iterator[Op]:  # noqa: ARG001
    """All forwards, then all backwards."""
    yield from (("F", m) for m in mine)
    yield from (("B", m) for m in mine)


def one_f_one_b_ops(mine: Sequence[int], warm: int, defer: int = 0) -> Iterator[Op]:  # noqa: ARG001
    """``warm`` forwards, then one backward and one forward alternately, then the drain."""
    warm = min(warm, len(mine))
    yield from (("F", m) for m in mine[:warm])
    for i, m in enumerate(mine):
        yield ("B", m)
        if i + warm < len(mine):
            yield ("F", mine[i + warm])


def zb_h1_ops(mine: Sequence[int], warm: int, defer: int) -> Iterator[Op]:
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): 1F1B's order with each
    backward split in B and W; a stage holds back its first ``defer`` W's (later stages more,
    so all hold as many micro-batches as the first stage's 1F1B) and runs them in the drain,
    where 1F1B waits for the next gradient. Order per micro-batch in the steady state: B, W, F."""
    warm = min(warm, len(mine))
    yield from (("F", m) for m in mine[:warm])
    done_w = 0
    for i, m in enumerate(mine):
        yield ("B", m)
        if i >= defer:
            yield ("W", mine[done_w])
            done_w += 1
        if i + warm < len(mine):
            yield ("F", mine[i + warm])
    yield from (("W", m) for m in mine[done_w:])


REGISTRY: dict[str, Schedule] = {s.name: s for s in (
    Schedule("gpipe", "all forwards, all backwards, one optimizer step (flush)", gpipe_ops, forwards_first=True),
    Schedule("1f1b", "one forward one backward, flush at the end of the step", one_f_one_b_ops),
    Schedule("pipedream", "PipeDream's asynchronous 1F1B with weight stashing, no flush", one_f_one_b_ops,
             asynchronous=True),
    Schedule("zb-h1", "zero-bubble H1: backward split in input (B) and weight (W) gradients, W fills the "
             "drain's bubbles; 1F1B memory, flush", zb_h1_ops, split_backward=True, drain_backward_share=0.0),
    Schedule("interleaved-1f1b", "Megatron's interleaved 1F1B: V model chunks per rank (--virtual-stages V), "
             "the fill and drain shrink by V; flush", None, layout=Layout.LOOPED,
             chunk_ops=lambda mine, place, virtual: replicated(interleaved_ops, mine, place, virtual)),
    Schedule("zbv", "zero-bubble V: two chunks per rank in a V, backward split in B and W; flush", None,
             split_backward=True, drain_backward_share=0.0, layout=Layout.V,
             chunk_ops=lambda mine, place, virtual: replicated(lambda m, pl, v: zbv_ops(m, pl), mine, place, virtual)),
)}


AUTO = "auto"       # the partitioner picks the fastest schedule of the same training semantics


def auto_candidates() -> tuple[str, ...]:
    """What ``--schedule auto`` chooses from: every flushed schedule (each gives the update of
    sequential SGD on the step's micro-batches; asynchronous ones change the training)."""
    return tuple(name for name, s in REGISTRY.items() if s.flushed and not s.chunked)


def get_schedule(name: str) -> Schedule:
    """The schedule called ``name``; a one-line UserError for an unknown one."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise UserError(f"unknown schedule {name!r}; choose one of {', '.join(REGISTRY)}") from None
