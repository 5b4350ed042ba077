"""Op orders of the schedules with several model chunks per rank (virtual stages): pure functions
of plain data, expanded into instructions by ``pipeline/schedules.py``.

A rank group g (0..p-1) holds V chunks; ``local`` chunk v is the group's v-th stage in model
order (``schedule_registry.Layout``). One replica of the group runs its micro-batches ``mine``
(those with m % r == replica, as for every schedule) and yields ``(op, micro-batch, v)`` with op
``"F"`` forward, ``"B"`` backward (input gradients only in a split schedule), ``"W"`` the weight
gradients of a split backward.

* :func:`interleaved_ops` -- Megatron's interleaved 1F1B (Narayanan et al., "Efficient Large-Scale
  Language Model Training on GPU Clusters Using Megatron-LM", SC'21, section 2.2): forwards go
  round by round, each round's micro-batches through chunk 0, then chunk 1, ...; backwards in the
  same order with the chunks reversed; ``warm`` forwards, then one forward and one backward
  alternately, then the drain. A round is W consecutive micro-batches or more (W = the
  pipeline's workers; the step's M micro-batches are cut into max(1, M // W) rounds as equal as
  possible), so M needs no particular multiple (torch's flexible variant asks M to be a multiple
  of the rounds; Megatron asks M % p == 0). Warm-up forwards: Megatron's (V-1) * q + 2 (p-1-g),
  + 1 for the steady state's first forward, with q the replica's micro-batches in the first round
  and the 2 (p-1-g) hops measured in this replica's ops (2 x later groups' workers / r).
* :func:`zbv_ops` -- ZB-V (Qi et al., "Pipeline Parallelism with Controllable Memory", 2024; the
  order of torch's ScheduleZBVZeroBubble): V = 2 chunks in a V (group g holds stages g and
  2p-1-g), each backward split in B and W. Warm-up: 2(p-g)-1 forwards of chunk 0, g pairs
  (chunk 1, chunk 0), p-g times (F, B, W) of chunk 1; steady: F0 B0 W0 F1 B1 W1; cool-down:
  g pairs B0 B1, p-g pairs B0 W0, then the held-back W's. Fewer micro-batches than 2p-1: the
  order of 2p-1 with the missing ones left out (as torch does). Replicas: p and g are counted in
  this replica's ops (workers of all / earlier / this and later groups over r), which is exact
  for equal replica counts.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

ChunkOp = tuple[str, int, int]      # ("F" | "B" | "W", micro-batch, local chunk 0..V-1)


@dataclass(frozen=True)
class Place:
    """Where a replica sits: its group, every group's replica count (pipeline order), M per step."""

    group: int
    replicas: tuple[int, ...]       # per group 0..p-1
    micro_batches: int

    @property
    def workers(self) -> int:
        return sum(self.replicas)

    def hops(self) -> int:
        """Later groups' workers in units of this group's replicas (p-1-g without replicas)."""
        return math.ceil(sum(self.replicas[self.group + 1:]) / self.replicas[self.group])

    def before(self) -> int:
        """Earlier groups' workers in units of this group's replicas (g without replicas)."""
        return math.ceil(sum(self.replicas[:self.group]) / self.replicas[self.group])

    def span(self) -> int:
        """All workers in units of this group's replicas (p without replicas)."""
        return math.ceil(self.workers / self.replicas[self.group])

    def depth(self) -> int:
        """This group's and later groups' workers in units of its replicas (p-g without replicas)."""
        return math.ceil(sum(self.replicas[self.group:]) / self.replicas[self.group])


def replicated(ops: Callable[[Sequence[int], Place, int], Iterator[ChunkOp]],
               mine: Sequence[int], place: Place, virtual: int) -> Iterator[ChunkOp]:
    """``ops``' order for a replica when groups may have several replicas.

    Equal replica counts: replica j of every group takes the same micro-batches (m % r == j), so
    the replicas of index j form a pipeline of their own, and ``ops`` orders it as given.
    Unequal counts: the order the group's rank has in the pipeline with ONE replica per group and
    all M micro-batches, restricted to this replica's micro-batches. That is deadlock-free
    whenever the one-replica pipeline is: a run of it orders all ops of all ranks in one sequence
    that respects every dependency, and each replica's list is a subsequence of it."""
    if len(set(place.replicas)) == 1:
        yield from ops(mine, place, virtual)
        return
    alone = Place(place.group, (1,) * len(place.replicas), place.micro_batches)
    own = set(mine)
    yield from (op for op in ops(range(place.micro_batches), alone, virtual) if op[1] in own)


def rounds(micro_batches: int, workers: int) -> list[range]:
    """The step's micro-batches cut into max(1, M // W) consecutive rounds as equal as possible."""
    n = max(1, micro_batches // workers)
    bounds = [k * micro_batches // n for k in range(n + 1)]
    return [range(bounds[k], bounds[k + 1]) for k in range(n)]


def interleaved_ops(mine: Sequence[int], place: Place, virtual: int) -> Iterator[ChunkOp]:
    """Megatron's interleaved 1F1B order for one replica (see the module docstring)."""
    own = set(mine)
    per_round = [[m for m in rnd if m in own] for rnd in rounds(place.micro_batches, place.workers)]
    forwards = [("F", m, v) for mbs in per_round for v in range(virtual) for m in mbs]
    backwards = [("B", m, v) for mbs in per_round for v in reversed(range(virtual)) for m in mbs]
    warm = min(len(forwards), (virtual - 1) * max(map(len, per_round)) + 2 * place.hops() + 1)
    yield from forwards[:warm]
    for i, b in enumerate(backwards):
        yield b
        if warm + i < len(forwards):
            yield forwards[warm + i]


def zbv_ops(mine: Sequence[int], place: Place) -> Iterator[ChunkOp]:
    """The ZB-V order for one replica (see the module docstring): local chunk 0 = stage g, 1 = 2p-1-g."""
    depth, before = place.depth(), place.before()
    n = max(2 * place.span() - 1, len(mine))       # padded: ops of indices >= len(mine) are left out
    count = {"F0": 0, "F1": 0, "B0": 0, "B1": 0, "W0": 0, "W1": 0}
    order: list[tuple[str, int]] = []

    def op(kind: str) -> None:
        order.append((kind, count[kind]))
        count[kind] += 1

    for _ in range(2 * depth - 1):
        op("F0")
    for _ in range(before):
        op("F1")
        op("F0")
    for _ in range(depth):
        op("F1")
        op("B1")
        op("W1")
    while count["F1"] < count["F0"] or count["F0"] < n:
        if count["F0"] < n:
            op("F0")
        for kind in ("B0", "W0", "F1", "B1", "W1"):
            op(kind)
    for _ in range(before):
        op("B0")
        op("B1")
    for _ in range(depth):
        op("B0")
        op("W0")
    while count["W1"] < count["B1"]:
        op("W1")
    while count["W0"] < count["B0"]:
        op("W0")
    for kind, i in order:
        if i < len(mine):
            yield kind[0], mine[i], int(kind[1])
