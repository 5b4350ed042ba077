"""The all-reduce rounds the executors run: the partitioner's description, over element ranges.

Every algorithm is written once, in ``partitioner/cost/collectives.py``, as rounds of messages over
exact parts of the vector; the cost model prices those rounds and :func:`elements` turns the same
rounds into element ranges ``[lo, hi)`` of a flat vector of ``numel`` elements for the executors
(``executor.py``), which run a rank's share of them over ``torch.distributed`` isend/irecv. So a
prediction describes exactly what runs. Messages of one round read the values the vector had
when the round began (the executor waits for a round's sends before overwriting what they read),
so a round is a simultaneous exchange. :func:`simulate` runs all ranks in memory, for tests.
Pure functions; no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

from hybridpipe.partitioner.cost import collectives as co

PHASES = co.PHASES


Msg = co.Msg          # here ``lo`` and ``hi`` count elements of the flat vector


@dataclass(frozen=True)
class Round:
    """Messages that travel at the same time; ``phase`` names the algorithm's stage (and its tag)."""

    phase: str
    msgs: tuple[Msg, ...]


def elements(collective: co.Collective, numel: int) -> list[Round]:
    """The described rounds on a vector of ``numel`` elements (empty messages left out)."""
    out = []
    for rnd in collective.rounds:
        lo = co.element_bounds(rnd.lo, collective.parts, numel)
        hi = co.element_bounds(rnd.hi, collective.parts, numel)
        keep = hi > lo
        out.append(Round(rnd.phase, tuple(Msg(*m) for m in zip(
            rnd.src[keep].tolist(), rnd.dst[keep].tolist(), lo[keep].tolist(), hi[keep].tolist(),
            rnd.reduce[keep].tolist(), strict=True))))
    return out


def split(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into ``parts`` contiguous ranges whose lengths differ by at most one."""
    length = hi - lo
    cuts = [lo + (i * length) // parts for i in range(parts + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(parts)]


# ---- the algorithms on ``numel`` elements (the description of collectives.py) --------------------

def ring(n: int, numel: int) -> list[Round]:
    """Ring all-reduce: reduce-scatter then all-gather, position k sending to k+1."""
    return elements(co.ring(n), numel)


def butterfly(n: int, numel: int, halving: bool) -> list[Round]:
    """Recursive doubling (``halving=False``) or Rabenseifner's halving + doubling, with the fold."""
    return elements(co.butterfly(n, halving), numel)


def hierarchical(units: Sequence[Sequence[int]], numel: int) -> list[Round]:
    """Inside each unit (host), across units, inside again."""
    return elements(co.hierarchical(units), numel)


def torus2d(n: int, numel: int, rows: int, cols: int) -> list[Round]:
    """R x C grid, rows = C consecutive positions: rows reduce-scatter, columns all-reduce, rows all-gather."""
    return elements(co.torus2d(n, rows, cols), numel)


def aggregator(n: int, numel: int, root: int = 0) -> list[Round]:
    """Every other position sends everything to ``root``, which sums and sends the sum back.

    Two rounds here; the pipelined executor overlaps them chunk by chunk (cut-through): the sum
    of a chunk leaves as soon as every rank's copy of that chunk has arrived.
    """
    return elements(co.aggregator(n, root), numel)


# ---- checking --------------------------------------------------------------------------------

def check(rounds: Sequence[Round], n: int, numel: int) -> None:
    """Structural rules the executors rely on; ValueError naming the first broken one.

    Positions in range, ranges inside ``[0, numel)`` and non-empty, at most one message per
    ordered pair per round, and a range written twice in one round only by sums.
    """
    for i, rnd in enumerate(rounds):
        pairs = set()
        writes: dict[int, list[Msg]] = {}
        for m in rnd.msgs:
            if not (0 <= m.src < n and 0 <= m.dst < n) or m.src == m.dst:
                raise ValueError(f"round {i}: message {m} has a bad endpoint for {n} ranks")
            if not 0 <= m.lo < m.hi <= numel:
                raise ValueError(f"round {i}: message {m} has an empty or out-of-range span for {numel} elements")
            if (m.src, m.dst) in pairs:
                raise ValueError(f"round {i}: two messages from {m.src} to {m.dst}")
            pairs.add((m.src, m.dst))
            writes.setdefault(m.dst, []).append(m)
        for dst, ms in writes.items():
            spans = sorted(ms, key=lambda m: m.lo)
            for a, b in pairwise(spans):
                if b.lo < a.hi and not (a.reduce and b.reduce):
                    raise ValueError(f"round {i}: rank {dst} gets overlapping copies {a} and {b}")


def simulate(rounds: Sequence[Round], vectors: Sequence[Sequence[float]]) -> list[list[float]]:
    """Run the rounds on every rank's vector in memory (round semantics as the executors)."""
    state = [list(v) for v in vectors]
    for rnd in rounds:
        before = [list(v) for v in state]
        for m in rnd.msgs:
            for x in range(m.lo, m.hi):
                if m.reduce:
                    state[m.dst][x] += before[m.src][x]
                else:
                    state[m.dst][x] = before[m.src][x]
    return state
