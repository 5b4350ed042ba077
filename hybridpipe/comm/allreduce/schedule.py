"""All-reduce algorithms as plain data: rounds of point-to-point messages over element ranges.

An algorithm on a group of ``n`` ranks (numbered by *position*: the index in the group's sorted
global ranks, as ``torch.distributed.new_group`` numbers them) and a flat vector of ``numel``
elements is a list of :class:`Round` s. In a round every :class:`Msg` moves elements
``[lo, hi)`` of its sender's vector to the same range of its receiver's, which adds them
(``reduce``) or overwrites its own (copy). Messages of one round read the values the vector had
when the round began (the executor waits for a round's sends before overwriting what they
read), so a round is a simultaneous exchange.

The conventions are those of the partitioner's cost model (``partitioner/collectives.py``), so
its predictions describe exactly what runs here. The executors (``executor.py``) run a rank's
share of these rounds over ``torch.distributed`` isend/irecv; :func:`simulate` runs all ranks in
memory, for tests. Pure functions; no torch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import pairwise

PHASES = ("fold", "unfold", "reduce_scatter", "all_gather", "exchange", "inner_reduce", "across",
          "inner_gather", "gather", "scatter", "to_root", "from_root")


@dataclass(frozen=True)
class Msg:
    """Elements ``[lo, hi)`` from position ``src`` to position ``dst``; summed there if ``reduce``."""

    src: int
    dst: int
    lo: int
    hi: int
    reduce: bool


@dataclass(frozen=True)
class Round:
    """Messages that travel at the same time; ``phase`` names the algorithm's stage (and its tag)."""

    phase: str
    msgs: tuple[Msg, ...]


def split(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into ``parts`` contiguous ranges whose lengths differ by at most one."""
    length = hi - lo
    cuts = [lo + (i * length) // parts for i in range(parts + 1)]
    return [(cuts[i], cuts[i + 1]) for i in range(parts)]


def _nonempty(msgs) -> tuple[Msg, ...]:
    return tuple(m for m in msgs if m.hi > m.lo)


def _lockstep(lists: Sequence[list[Round]]) -> list[Round]:
    """Several independent groups' rounds run at once: round i merges every list's i-th round."""
    out = []
    for i in range(max((len(x) for x in lists), default=0)):
        here = [x[i] for x in lists if i < len(x)]
        out.append(Round(here[0].phase, tuple(m for r in here for m in r.msgs)))
    return out


# ---- ring ------------------------------------------------------------------------------------

def ring_reduce_scatter(ring: Sequence[int], lo: int, hi: int) -> list[Round]:
    """n-1 rounds; afterwards ``ring[k]`` holds the sum of segment ``(k + 1) % n`` of ``[lo, hi)``."""
    n = len(ring)
    segs = split(lo, hi, n)
    return [Round("reduce_scatter", _nonempty(
        Msg(ring[k], ring[(k + 1) % n], *segs[(k - s) % n], True) for k in range(n)))
        for s in range(n - 1)]


def ring_all_gather(ring: Sequence[int], lo: int, hi: int) -> list[Round]:
    """n-1 rounds; ``ring[k]`` starts with segment ``(k + 1) % n``, everyone ends with all."""
    n = len(ring)
    segs = split(lo, hi, n)
    return [Round("all_gather", _nonempty(
        Msg(ring[k], ring[(k + 1) % n], *segs[(k + 1 - s) % n], False) for k in range(n)))
        for s in range(n - 1)]


def owned_segment(ring: Sequence[int], member: int, lo: int, hi: int) -> tuple[int, int]:
    """The segment ``member`` holds after :func:`ring_reduce_scatter` over ``ring``."""
    n = len(ring)
    return split(lo, hi, n)[(list(ring).index(member) + 1) % n]


def ring(n: int, numel: int) -> list[Round]:
    """Ring all-reduce: reduce-scatter then all-gather, position k sending to k+1."""
    return rings([list(range(n))], 0, numel)


def rings(groups: Sequence[Sequence[int]], lo: int, hi: int) -> list[Round]:
    """Equal-size rings all-reducing ``[lo, hi)`` at once (one per group)."""
    if not groups or len(groups[0]) <= 1:
        return []
    return (_lockstep([ring_reduce_scatter(g, lo, hi) for g in groups])
            + _lockstep([ring_all_gather(g, lo, hi) for g in groups]))


# ---- butterfly -------------------------------------------------------------------------------

def fold(n: int) -> tuple[list[int], list[tuple[int, int]]]:
    """(survivors, fold pairs (sender, receiver)) for the non-power-of-two case.

    p = largest power of two <= n, e = n - p: position 2k sends to 2k+1 for k < e; the
    survivors are 2k+1 (k < e) followed by 2e .. n-1.
    """
    p = 1 << (n.bit_length() - 1)
    e = n - p
    return [2 * k + 1 for k in range(e)] + list(range(2 * e, n)), [(2 * k, 2 * k + 1) for k in range(e)]


def butterfly(n: int, numel: int, halving: bool) -> list[Round]:
    """Recursive doubling (``halving=False``) or Rabenseifner's halving + doubling, with the fold."""
    if n <= 1:
        return []
    survivors, pairs = fold(n)
    p = len(survivors)
    rounds = []
    if pairs:
        rounds.append(Round("fold", _nonempty(Msg(a, b, 0, numel, True) for a, b in pairs)))
    distances = [1 << k for k in range(p.bit_length() - 1)]
    if not halving:
        for d in distances:
            rounds.append(Round("exchange", _nonempty(
                Msg(survivors[i], survivors[i ^ d], 0, numel, True) for i in range(p))))
    else:
        owned = [(0, numel)] * p
        history = []
        for d in distances:                       # reduce-scatter, nearest partner first
            msgs, nxt = [], []
            for i in range(p):
                lo, hi = owned[i]
                mid = lo + (hi - lo) // 2
                keep, give = ((lo, mid), (mid, hi)) if i & d == 0 else ((mid, hi), (lo, mid))
                msgs.append(Msg(survivors[i], survivors[i ^ d], *give, True))
                nxt.append(keep)
            rounds.append(Round("reduce_scatter", _nonempty(msgs)))
            history.append(owned)
            owned = nxt
        for d in reversed(distances):             # all-gather, in reverse order
            rounds.append(Round("all_gather", _nonempty(
                Msg(survivors[i], survivors[i ^ d], *owned[i], False) for i in range(p))))
            owned = history.pop()
    if pairs:
        rounds.append(Round("unfold", _nonempty(Msg(b, a, 0, numel, False) for a, b in pairs)))
    return rounds


# ---- hierarchical and 2-D torus --------------------------------------------------------------

def hierarchical(groups: Sequence[Sequence[int]], numel: int) -> list[Round]:
    """Inside each group, across groups, inside again.

    Equal groups of g: ring reduce-scatter inside every group, g concurrent rings across the
    groups (local index t with local index t) on the shard t owns, ring all-gather inside.
    Unequal groups: reduce to each group's first rank (reduce-scatter + gather), a ring across
    those leaders on everything, broadcast inside (scatter + all-gather).
    """
    groups = [list(g) for g in groups if g]
    if len(groups) <= 1:
        return rings(groups, 0, numel)
    sizes = {len(g) for g in groups}
    if len(sizes) == 1:
        g = sizes.pop()
        inner = [ring_reduce_scatter(grp, 0, numel) for grp in groups]
        across = []
        for t in range(g):
            column = [grp[t] for grp in groups]
            across.append(rings([column], *owned_segment(groups[0], groups[0][t], 0, numel)))
        gather = [ring_all_gather(grp, 0, numel) for grp in groups]
        return (_rename(_lockstep(inner), "inner_reduce") + _rename(_lockstep(across), "across")
                + _rename(_lockstep(gather), "inner_gather"))
    reduce = _lockstep([_reduce_to_leader(grp, numel) for grp in groups])
    leaders = [grp[0] for grp in groups]
    leader_ring = _rename(rings([leaders], 0, numel), "across")
    bcast = _lockstep([_broadcast_from_leader(grp, numel) for grp in groups])
    return reduce + leader_ring + bcast


def _rename(rounds: list[Round], phase: str) -> list[Round]:
    return [Round(phase, r.msgs) for r in rounds]


def _reduce_to_leader(group: Sequence[int], numel: int) -> list[Round]:
    if len(group) <= 1:
        return []
    rs = _rename(ring_reduce_scatter(group, 0, numel), "inner_reduce")
    gather = Round("gather", _nonempty(Msg(r, group[0], *owned_segment(group, r, 0, numel), False)
                                       for r in group[1:]))
    return rs + [gather]


def _broadcast_from_leader(group: Sequence[int], numel: int) -> list[Round]:
    if len(group) <= 1:
        return []
    scatter = Round("scatter", _nonempty(Msg(group[0], r, *owned_segment(group, r, 0, numel), False)
                                         for r in group[1:]))
    return [scatter] + _rename(ring_all_gather(group, 0, numel), "inner_gather")


def torus2d(n: int, numel: int, rows: int, cols: int) -> list[Round]:
    """R x C grid, rows = C consecutive positions: rows reduce-scatter, columns all-reduce, rows all-gather."""
    if rows * cols != n or rows < 1:
        raise ValueError(f"a {rows}x{cols} torus does not hold {n} ranks")
    row_groups = [list(range(r * cols, (r + 1) * cols)) for r in range(rows)]
    if cols == 1:
        return rings([list(range(n))], 0, numel)
    rs = _lockstep([ring_reduce_scatter(g, 0, numel) for g in row_groups])
    columns = []
    for c in range(cols):
        column = [r * cols + c for r in range(rows)]
        columns.append(rings([column], *owned_segment(row_groups[0], c, 0, numel)))
    ag = _lockstep([ring_all_gather(g, 0, numel) for g in row_groups])
    return rs + _rename(_lockstep(columns), "across") + ag


# ---- aggregator (on a worker rank) -----------------------------------------------------------

def aggregator(n: int, numel: int, root: int = 0) -> list[Round]:
    """Every other position sends everything to ``root``, which sums and sends the sum back.

    Two rounds here; the pipelined executor overlaps them chunk by chunk (cut-through): the sum
    of a chunk leaves as soon as every rank's copy of that chunk has arrived.
    """
    if n <= 1:
        return []
    others = [r for r in range(n) if r != root]
    return [Round("to_root", _nonempty(Msg(r, root, 0, numel, True) for r in others)),
            Round("from_root", _nonempty(Msg(root, r, 0, numel, False) for r in others))]


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
