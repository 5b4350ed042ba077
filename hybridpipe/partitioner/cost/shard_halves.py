"""Reduce-scatter and all-gather for sharded replicas (ZeRO): the two halves of the all-reduces
described in collectives.py.

Ring, Rabenseifner's butterfly (n a power of two), hierarchical over equal hosts and torus2d are
each a reduce-scatter followed by its mirror all-gather: the first half of their rounds leaves
every part of the vector summed on exactly one position (its *owner*), the second half copies
each owner's parts to everyone. A sharded replica group runs the halves apart: the reduce-scatter
as the backward produces a unit's gradients, the all-gather of the updated weights after the step.
The other all-reduces have no such halves (the aggregator, recursive doubling, the fold of a
non-power-of-two butterfly, unequal hosts) and shard with the ring.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridpipe.partitioner.cost.collectives import Collective, rounds_for

SHARD_ALGORITHMS = ("ring", "butterfly", "hierarchical", "torus2d")


def shard_algorithm(algorithm: str, n: int, units: Sequence[Sequence[int]] | None = None) -> str:
    """The algorithm whose halves run for a unit the plan gives ``algorithm`` (the module's rule above)."""
    if algorithm == "butterfly" and n & (n - 1) == 0:
        return "butterfly"
    if algorithm == "hierarchical" and units is not None and len({len(u) for u in units}) == 1:
        return "hierarchical"
    if algorithm == "torus2d":
        return "torus2d"
    return "ring"


def halves(algorithm: str, n: int, *, units: Sequence[Sequence[int]] | None = None,
           shape: tuple[int, int] | None = None) -> tuple[Collective, Collective]:
    """(reduce-scatter, all-gather) of ``algorithm`` (one of :data:`SHARD_ALGORITHMS`) on ``n``
    positions: the first and second half of its all-reduce's rounds."""
    if algorithm not in SHARD_ALGORITHMS:
        raise ValueError(f"{algorithm!r} has no reduce-scatter half; choose from {', '.join(SHARD_ALGORITHMS)}")
    if algorithm == "butterfly" and n & (n - 1):
        raise ValueError(f"butterfly's halves need a power-of-two group, not {n}")
    whole = rounds_for(algorithm, n, halving=True, units=units, shape=shape)
    half = len(whole.rounds) // 2
    return Collective(whole.rounds[:half], whole.parts), Collective(whole.rounds[half:], whole.parts)


def owners(reduce_scatter: Collective, n: int) -> list[tuple[int, int]]:
    """Per position, the parts ``[lo, hi)`` it holds summed over all ``n`` positions after
    ``reduce_scatter`` (found by running it on sets of contributors). ValueError unless every part
    has exactly one owner and each position's parts are contiguous."""
    parts = reduce_scatter.parts
    held = np.zeros((n, parts, n), dtype=bool)
    held[np.arange(n), :, np.arange(n)] = True
    for rnd in reduce_scatter.rounds:
        before = held.copy()
        for m in rnd.msgs:
            if m.reduce:
                held[m.dst, m.lo:m.hi] |= before[m.src, m.lo:m.hi]
            else:
                held[m.dst, m.lo:m.hi] = before[m.src, m.lo:m.hi]
    full: np.ndarray = np.asarray(held.all(axis=2))             # [position, part]
    if (full.sum(axis=0) != 1).any():
        raise ValueError("a reduce-scatter must leave every part summed on exactly one position")
    out = []
    for k in range(n):
        mine = np.flatnonzero(full[k])
        if len(mine) and mine[-1] - mine[0] + 1 != len(mine):
            raise ValueError(f"position {k} owns parts {mine.tolist()}, not one contiguous range")
        out.append((int(mine[0]), int(mine[-1]) + 1) if len(mine) else (0, 0))
    return out
