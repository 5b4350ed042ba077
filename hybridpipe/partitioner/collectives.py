"""Every all-reduce algorithm, written once: rounds of messages over parts of the vector.

An algorithm on a group of ``n`` ranks (numbered by *position*: the index in the group's sorted
global ranks, as ``torch.distributed.new_group`` numbers them) summing a vector of S bytes is a
list of :class:`Round` s. In a round every :class:`Msg` moves the part ``[lo, hi)`` of its
sender's vector (exact fractions of the vector, ``0 <= lo < hi <= 1``) to the same part of its
receiver's, which adds it (``reduce``) or overwrites its own (copy). Messages of one round read
the values the vector had when the round began. A round marked ``cut_through`` runs alongside
the round before it, chunk by chunk (the aggregator's way back starts with the first summed chunk).

This one description is what runs and what is priced: the executors (``comm/allreduce``) run it
with the parts mapped to element ranges (:func:`element_bounds`), and the cost model
(``costmodel.py``) prices :func:`priced` (the same rounds, cut-through rounds merged into the one
they overlap, consecutive rounds that move the same amounts between the same ranks folded into a
repeat count). Pure functions; no torch.

Conventions ("position" as above):

* ring / native: position k sends to k+1 (mod n). Reduce-scatter: n-1 rounds of S/n, summed;
  all-gather: n-1 rounds of S/n.
* butterfly: p = largest power of two <= n, e = n - p. Fold: for k < e position 2k sends its whole
  vector to 2k+1, which sums it; the p survivors (2k+1 for k < e, then 2e..n-1) run recursive
  doubling (log2 p rounds exchanging all S with the partner at distance 1, 2, 4, ... in survivor
  order) or Rabenseifner (reduce-scatter by recursive halving, nearest partner first, S/2, S/4,
  ...; then all-gather in reverse order); unfold: 2k+1 sends the result back to 2k.
* hierarchical (``units``: the positions of each host). Equal units of g: ring reduce-scatter
  inside each unit, g concurrent rings across units (local index t with local index t) on the
  shard t owns, ring all-gather inside. Unequal units: reduce to each unit's first position
  (reduce-scatter + gather), a ring across those leaders on S, broadcast inside (scatter +
  all-gather).
* torus2d (R x C): rows are C consecutive positions. Ring reduce-scatter along rows (S/C
  shards), ring all-reduce down each column on its shard, ring all-gather along rows.
* aggregator: the root (position 0, or a dedicated process, ``SWITCH``) receives every other
  vector and sends the sum back, cut-through.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

SWITCH = -1  # the dedicated aggregator process: an endpoint outside the group's positions
PHASES = ("fold", "unfold", "reduce_scatter", "all_gather", "exchange", "inner_reduce", "across",
          "inner_gather", "gather", "scatter", "to_root", "from_root")
ALGORITHMS = ("ring", "butterfly", "hierarchical", "torus2d", "aggregator", "native")
ZERO, ONE = Fraction(0), Fraction(1)


@dataclass(frozen=True)
class Msg:
    """Part ``[lo, hi)`` of the vector from position ``src`` to position ``dst``; summed there if ``reduce``."""

    src: int
    dst: int
    lo: Fraction
    hi: Fraction
    reduce: bool


@dataclass(frozen=True)
class Round:
    """Messages that travel at the same time; ``phase`` names the algorithm's stage (and its tag)."""

    phase: str
    msgs: tuple[Msg, ...]
    cut_through: bool = False       # overlaps the round before it, chunk by chunk


def split(lo: Fraction, hi: Fraction, parts: int) -> list[tuple[Fraction, Fraction]]:
    """``[lo, hi)`` cut into ``parts`` equal contiguous parts."""
    step = (hi - lo) / parts
    cuts = [lo + step * i for i in range(parts)] + [hi]
    return [(cuts[i], cuts[i + 1]) for i in range(parts)]


def _lockstep(lists: Sequence[list[Round]]) -> list[Round]:
    """Several independent groups' rounds run at once: round i merges every list's i-th round."""
    out = []
    for i in range(max((len(x) for x in lists), default=0)):
        here = [x[i] for x in lists if i < len(x)]
        out.append(Round(here[0].phase, tuple(m for r in here for m in r.msgs)))
    return out


def _rename(rounds: list[Round], phase: str) -> list[Round]:
    return [Round(phase, r.msgs, r.cut_through) for r in rounds]


# ---- ring ------------------------------------------------------------------------------------

def ring_reduce_scatter(ring: Sequence[int], lo: Fraction = ZERO, hi: Fraction = ONE) -> list[Round]:
    """n-1 rounds; afterwards ``ring[k]`` holds the sum of segment ``(k + 1) % n`` of ``[lo, hi)``."""
    n = len(ring)
    segs = split(lo, hi, n)
    return [Round("reduce_scatter", tuple(Msg(ring[k], ring[(k + 1) % n], *segs[(k - s) % n], True)
                                          for k in range(n))) for s in range(n - 1)]


def ring_all_gather(ring: Sequence[int], lo: Fraction = ZERO, hi: Fraction = ONE) -> list[Round]:
    """n-1 rounds; ``ring[k]`` starts with segment ``(k + 1) % n``, everyone ends with all."""
    n = len(ring)
    segs = split(lo, hi, n)
    return [Round("all_gather", tuple(Msg(ring[k], ring[(k + 1) % n], *segs[(k + 1 - s) % n], False)
                                      for k in range(n))) for s in range(n - 1)]


def owned_segment(ring: Sequence[int], member: int, lo: Fraction = ZERO,
                  hi: Fraction = ONE) -> tuple[Fraction, Fraction]:
    """The segment ``member`` holds after :func:`ring_reduce_scatter` over ``ring``."""
    n = len(ring)
    return split(lo, hi, n)[(list(ring).index(member) + 1) % n]


def rings(groups: Sequence[Sequence[int]], lo: Fraction = ZERO, hi: Fraction = ONE) -> list[Round]:
    """Equal-size rings all-reducing ``[lo, hi)`` at once (one per group)."""
    if not groups or len(groups[0]) <= 1:
        return []
    return (_lockstep([ring_reduce_scatter(g, lo, hi) for g in groups])
            + _lockstep([ring_all_gather(g, lo, hi) for g in groups]))


def ring(n: int) -> list[Round]:
    """Ring all-reduce: reduce-scatter then all-gather, position k sending to k+1."""
    return rings([list(range(n))])


# ---- butterfly -------------------------------------------------------------------------------

def fold(n: int) -> tuple[list[int], list[tuple[int, int]]]:
    """(survivors, fold pairs (sender, receiver)) for the non-power-of-two case (module docstring)."""
    p = 1 << (n.bit_length() - 1)
    e = n - p
    return [2 * k + 1 for k in range(e)] + list(range(2 * e, n)), [(2 * k, 2 * k + 1) for k in range(e)]


def butterfly(n: int, halving: bool) -> list[Round]:
    """Recursive doubling (``halving=False``) or Rabenseifner's halving + doubling, with the fold."""
    if n <= 1:
        return []
    survivors, pairs = fold(n)
    p = len(survivors)
    rounds = []
    if pairs:
        rounds.append(Round("fold", tuple(Msg(a, b, ZERO, ONE, True) for a, b in pairs)))
    distances = [1 << k for k in range(p.bit_length() - 1)]
    if not halving:
        for d in distances:
            rounds.append(Round("exchange", tuple(Msg(survivors[i], survivors[i ^ d], ZERO, ONE, True)
                                                  for i in range(p))))
    else:
        owned = [(ZERO, ONE)] * p
        history = []
        for d in distances:                       # reduce-scatter, nearest partner first
            msgs, nxt = [], []
            for i in range(p):
                lo, hi = owned[i]
                mid = (lo + hi) / 2
                keep, give = ((lo, mid), (mid, hi)) if i & d == 0 else ((mid, hi), (lo, mid))
                msgs.append(Msg(survivors[i], survivors[i ^ d], *give, True))
                nxt.append(keep)
            rounds.append(Round("reduce_scatter", tuple(msgs)))
            history.append(owned)
            owned = nxt
        for d in reversed(distances):             # all-gather, in reverse order
            rounds.append(Round("all_gather", tuple(Msg(survivors[i], survivors[i ^ d], *owned[i], False)
                                                    for i in range(p))))
            owned = history.pop()
    if pairs:
        rounds.append(Round("unfold", tuple(Msg(b, a, ZERO, ONE, False) for a, b in pairs)))
    return rounds


# ---- hierarchical and 2-D torus --------------------------------------------------------------

def hierarchical(units: Sequence[Sequence[int]]) -> list[Round]:
    """Inside each unit, across units, inside again (see the module docstring)."""
    groups = [list(g) for g in units if g]
    if len(groups) <= 1:
        return rings(groups)
    sizes = {len(g) for g in groups}
    if len(sizes) == 1:
        g = sizes.pop()
        inner = [ring_reduce_scatter(grp) for grp in groups]
        across = [rings([[grp[t] for grp in groups]], *owned_segment(groups[0], groups[0][t])) for t in range(g)]
        gather = [ring_all_gather(grp) for grp in groups]
        return (_rename(_lockstep(inner), "inner_reduce") + _rename(_lockstep(across), "across")
                + _rename(_lockstep(gather), "inner_gather"))
    reduce = _lockstep([_reduce_to_leader(grp) for grp in groups])
    across = _rename(rings([[grp[0] for grp in groups]]), "across")
    bcast = _lockstep([_broadcast_from_leader(grp) for grp in groups])
    return reduce + across + bcast


def _reduce_to_leader(group: Sequence[int]) -> list[Round]:
    if len(group) <= 1:
        return []
    gather = Round("gather", tuple(Msg(r, group[0], *owned_segment(group, r), False) for r in group[1:]))
    return _rename(ring_reduce_scatter(group), "inner_reduce") + [gather]


def _broadcast_from_leader(group: Sequence[int]) -> list[Round]:
    if len(group) <= 1:
        return []
    scatter = Round("scatter", tuple(Msg(group[0], r, *owned_segment(group, r), False) for r in group[1:]))
    return [scatter] + _rename(ring_all_gather(group), "inner_gather")


def torus2d(n: int, rows: int, cols: int) -> list[Round]:
    """R x C grid, rows = C consecutive positions: rows reduce-scatter, columns all-reduce, rows all-gather."""
    if rows * cols != n or rows < 1:
        raise ValueError(f"a {rows}x{cols} torus does not hold {n} ranks")
    if cols == 1:
        return ring(n)
    row_groups = [list(range(r * cols, (r + 1) * cols)) for r in range(rows)]
    rs = _lockstep([ring_reduce_scatter(g) for g in row_groups])
    columns = [rings([[r * cols + c for r in range(rows)]], *owned_segment(row_groups[0], c)) for c in range(cols)]
    ag = _lockstep([ring_all_gather(g) for g in row_groups])
    return rs + _rename(_lockstep(columns), "across") + ag


def torus_shapes(n: int) -> list[tuple[int, int]]:
    """Every factorisation rows x cols of n."""
    return [(n // c, c) for c in range(1, n + 1) if n % c == 0]


def torus_shape(n: int, inner: int) -> tuple[int, int]:
    """Default rows x cols: rows = inner-level groups of ``inner`` when they tile n, else the squarest."""
    if 1 < inner < n and n % inner == 0:
        return n // inner, inner
    cols = max(c for c in range(1, math.isqrt(n) + 1) if n % c == 0)
    return n // cols, cols


# ---- aggregator ------------------------------------------------------------------------------

def aggregator(n: int, root: int = 0) -> list[Round]:
    """Everyone sends its vector to ``root``, which sums and sends the sum back (cut-through).

    ``root = SWITCH``: a dedicated process that holds no vector; the first arrival is copied, the
    others summed (n - 1 sums, as on a worker root).
    """
    if n <= 1:
        return []
    senders = [r for r in range(n) if r != root]
    first = senders[0] if root == SWITCH else None
    return [Round("to_root", tuple(Msg(r, root, ZERO, ONE, r != first) for r in senders)),
            Round("from_root", tuple(Msg(root, r, ZERO, ONE, False) for r in senders), cut_through=True)]


def rounds_for(algorithm: str, n: int, *, halving: bool = False, units: Sequence[Sequence[int]] | None = None,
               shape: tuple[int, int] | None = None, root: int = 0) -> list[Round]:
    """The rounds ``algorithm`` runs on ``n`` positions; the one dispatch executors and prices share.

    ``halving``: butterfly's variant; ``units``: hierarchical's hosts (default: one); ``shape``:
    torus2d's rows x cols (default: the squarest); ``root``: the aggregator (SWITCH: dedicated).
    ``native`` (torch's own all-reduce) is described, and priced, as the ring gloo runs.
    """
    if algorithm in ("ring", "native"):
        return ring(n)
    if algorithm == "butterfly":
        return butterfly(n, halving)
    if algorithm == "hierarchical":
        return hierarchical(units if units is not None else [list(range(n))])
    if algorithm == "torus2d":
        rows, cols = shape or torus_shape(n, 1)
        return torus2d(n, rows, cols)
    if algorithm == "aggregator":
        return aggregator(n, root)
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r}; choose from {', '.join(ALGORITHMS)}")


# ---- what the executors and the cost model take from it ----------------------------------------

def element_bounds(part: Fraction, numel: int) -> int:
    """The element index where the part boundary ``part`` falls in a vector of ``numel`` elements.

    Monotone and the same for every message, so parts that tile a range tile its elements
    (some may be empty, and are left out by the executors).
    """
    return part.numerator * numel // part.denominator


@dataclass(frozen=True)
class PricedRound:
    """A round as the cost model prices it: at most ``reduce * S`` bytes summed per rank, each
    message ``(src, dst, part)`` moving ``part * S`` bytes; ``repeat`` times, ``steps`` latencies each."""

    messages: tuple[tuple[int, int, float], ...]
    reduce: float = 0.0
    repeat: int = 1
    steps: int = 1


def priced(rounds: Sequence[Round]) -> list[PricedRound]:
    """The rounds as the cost model prices them (see the module docstring); endpoints unchanged."""
    merged: list[tuple[list[tuple[int, int, Fraction]], Fraction, int]] = []
    for rnd in rounds:
        summed: dict[int, Fraction] = {}
        for m in rnd.msgs:
            if m.reduce:
                summed[m.dst] = summed.get(m.dst, ZERO) + (m.hi - m.lo)
        moves = [(m.src, m.dst, m.hi - m.lo) for m in rnd.msgs]
        reduce = max(summed.values(), default=ZERO)
        if rnd.cut_through and merged:
            msgs, red, steps = merged[-1]
            merged[-1] = (msgs + moves, red + reduce, steps + 1)
        else:
            merged.append((moves, reduce, 1))
    out: list[PricedRound] = []
    last = None
    for moves, reduce, steps in merged:
        key = (tuple(sorted(moves)), reduce, steps)
        if key == last:
            out[-1] = PricedRound(out[-1].messages, out[-1].reduce, out[-1].repeat + 1, steps)
            continue
        last = key
        out.append(PricedRound(tuple((s, d, float(p)) for s, d, p in moves), float(reduce), 1, steps))
    return out
