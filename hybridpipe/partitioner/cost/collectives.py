"""Every all-reduce algorithm, written once: rounds of messages over parts of the vector.

An algorithm on a group of ``n`` ranks (numbered by *position*: the index in the group's sorted
global ranks, as ``torch.distributed.new_group`` numbers them) summing a vector of S bytes is a
:class:`Collective`: the vector cut into ``parts`` equal parts (as many as the algorithm's
splits need to be exact) and a list of :class:`Round` s. In a round every message moves parts
``[lo, hi)`` of its sender's vector to the same parts of its receiver's, which adds them
(``reduce``) or overwrites its own (copy). Messages of one round read the values the vector had
when the round began. A round marked ``cut_through`` runs alongside the round before it, chunk by
chunk (the aggregator's way back starts with the first summed chunk). A round holds its messages
as arrays (entry i = message i), so that rings of many ranks are built and priced quickly.

This one description is what runs and what is priced: the executors (``comm/allreduce``) run it
with the parts mapped to element ranges (:func:`element_bounds`), and the cost model
(``costmodel.py``) prices them as ``priced.py`` reads them (the same rounds, cut-through rounds
merged into the one they overlap, consecutive rounds that move the same amounts between the same
ranks folded into a repeat count). Pure functions; no torch.

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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

SWITCH = -1  # the dedicated aggregator process: an endpoint outside the group's positions
PHASES = ("fold", "unfold", "reduce_scatter", "all_gather", "exchange", "inner_reduce", "across",
          "inner_gather", "gather", "scatter", "to_root", "from_root")
ALGORITHMS = ("ring", "butterfly", "hierarchical", "torus2d", "aggregator", "native")


class Msg(NamedTuple):
    """Parts (or elements) ``[lo, hi)`` from position ``src`` to position ``dst``; summed there if ``reduce``."""

    src: int
    dst: int
    lo: int
    hi: int
    reduce: bool


class Round(NamedTuple):
    """Messages that travel at the same time, as parallel arrays (entry i = message i); ``phase``
    names the algorithm's stage (and its tag)."""

    phase: str
    src: np.ndarray
    dst: np.ndarray
    lo: np.ndarray
    hi: np.ndarray
    reduce: np.ndarray
    cut_through: bool = False       # overlaps the round before it, chunk by chunk

    @classmethod
    def of(cls, phase: str, msgs: Iterable[Msg], cut_through: bool = False) -> Round:
        """A round from a list of messages."""
        cols = list(zip(*msgs, strict=True)) or [()] * 5
        src, dst, lo, hi = (np.asarray(c, dtype=np.int64) for c in cols[:4])
        return cls(phase, src, dst, lo, hi, np.asarray(cols[4], dtype=bool), cut_through)

    @property
    def msgs(self) -> tuple[Msg, ...]:
        """The messages one by one."""
        return tuple(Msg(*m) for m in zip(self.src.tolist(), self.dst.tolist(), self.lo.tolist(), self.hi.tolist(),
                                          self.reduce.tolist(), strict=True))


@dataclass(frozen=True)
class Collective:
    """An algorithm's rounds on a vector cut into ``parts`` equal parts (messages count parts)."""

    rounds: tuple[Round, ...]
    parts: int = 1


def split(lo: int, hi: int, parts: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut into ``parts`` equal contiguous ranges (``parts`` must divide its length)."""
    step, rest = divmod(hi - lo, parts)
    if rest:
        raise ValueError(f"[{lo}, {hi}) does not split into {parts} equal parts")
    return [(lo + step * i, lo + step * (i + 1)) for i in range(parts)]


def _lockstep(lists: Sequence[Sequence[Round]]) -> list[Round]:
    """Several independent groups' rounds run at once: round i merges every list's i-th round."""
    out = []
    for i in range(max((len(x) for x in lists), default=0)):
        here = [x[i] for x in lists if i < len(x)]
        if len(here) == 1:
            out.append(here[0])
            continue
        src, dst, lo, hi, reduce = (np.concatenate([r[f] for r in here]) for f in range(1, 6))
        out.append(Round(here[0].phase, src, dst, lo, hi, reduce))
    return out


def _rename(rounds: Sequence[Round], phase: str) -> list[Round]:
    return [r._replace(phase=phase) for r in rounds]


# ---- rings -----------------------------------------------------------------------------------

Groups = Sequence[Sequence[int]] | np.ndarray         # rows of positions


def _ring_rounds(groups: Groups, lo: Sequence[int], hi: Sequence[int], gather: bool) -> list[Round]:
    """Equal-size rings (one per row of ``groups``), ring i over parts ``[lo[i], hi[i])``, all at once.

    Reduce-scatter (``gather=False``): n-1 rounds; afterwards ``ring[k]`` holds the sum of segment
    ``(k + 1) % n``. All-gather: ``ring[k]`` starts with segment ``(k + 1) % n``, all end with all.
    """
    g = np.asarray(groups, dtype=np.int64)
    m, n = g.shape
    if n <= 1:
        return []
    lo_a, hi_a = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
    step, rest = np.divmod(hi_a - lo_a, n)
    if rest.any():
        raise ValueError(f"ring ranges {list(zip(lo, hi, strict=True))} do not split into {n} equal parts")
    k = np.arange(n)
    src, dst = g.ravel(), g[:, (k + 1) % n].ravel()
    shift = np.arange(n - 1)[:, None]
    seg = (k[None, :] + 1 - shift) % n if gather else (k[None, :] - shift) % n             # [round, k]
    start = (lo_a[None, :, None] + step[None, :, None] * seg[:, None, :]).reshape(n - 1, m * n)
    end = start + np.repeat(step, n)[None, :]
    flag = np.full(m * n, not gather)
    phase = "all_gather" if gather else "reduce_scatter"
    return [Round(phase, src, dst, start[s], end[s], flag) for s in range(n - 1)]


def ring_reduce_scatter(ring: Sequence[int], lo: int, hi: int) -> list[Round]:
    """n-1 rounds; afterwards ``ring[k]`` holds the sum of segment ``(k + 1) % n`` of ``[lo, hi)``."""
    return _ring_rounds([ring], [lo], [hi], False)


def ring_all_gather(ring: Sequence[int], lo: int, hi: int) -> list[Round]:
    """n-1 rounds; ``ring[k]`` starts with segment ``(k + 1) % n``, everyone ends with all."""
    return _ring_rounds([ring], [lo], [hi], True)


def owned_segment(ring: Sequence[int], member: int, lo: int, hi: int) -> tuple[int, int]:
    """The segment ``member`` holds after :func:`ring_reduce_scatter` over ``ring``."""
    n = len(ring)
    return split(lo, hi, n)[(list(ring).index(member) + 1) % n]


def rings(groups: Sequence[Sequence[int]], lo: Sequence[int], hi: Sequence[int]) -> list[Round]:
    """Equal-size rings all-reducing at once, ring i over parts ``[lo[i], hi[i])``."""
    if not groups or len(groups[0]) <= 1:
        return []
    return _ring_rounds(groups, lo, hi, False) + _ring_rounds(groups, lo, hi, True)


def ring(n: int) -> Collective:
    """Ring all-reduce: reduce-scatter then all-gather, position k sending to k+1."""
    return Collective(tuple(rings([list(range(n))], [0], [n])), max(n, 1))


# ---- butterfly -------------------------------------------------------------------------------

def fold(n: int) -> tuple[list[int], list[tuple[int, int]]]:
    """(survivors, fold pairs (sender, receiver)) for the non-power-of-two case (module docstring)."""
    p = 1 << (n.bit_length() - 1)
    e = n - p
    return [2 * k + 1 for k in range(e)] + list(range(2 * e, n)), [(2 * k, 2 * k + 1) for k in range(e)]


def butterfly(n: int, halving: bool) -> Collective:
    """Recursive doubling (``halving=False``) or Rabenseifner's halving + doubling, with the fold."""
    if n <= 1:
        return Collective(())
    survivors, pairs = fold(n)
    p = len(survivors)
    whole = p if halving else 1
    rounds = []
    if pairs:
        rounds.append(Round.of("fold", (Msg(a, b, 0, whole, True) for a, b in pairs)))
    distances = [1 << k for k in range(p.bit_length() - 1)]
    if not halving:
        for d in distances:
            rounds.append(Round.of("exchange", (Msg(survivors[i], survivors[i ^ d], 0, whole, True)
                                                for i in range(p))))
    else:
        owned = [(0, whole)] * p
        history = []
        for d in distances:                       # reduce-scatter, nearest partner first
            msgs, nxt = [], []
            for i in range(p):
                lo, hi = owned[i]
                mid = (lo + hi) // 2
                keep, give = ((lo, mid), (mid, hi)) if i & d == 0 else ((mid, hi), (lo, mid))
                msgs.append(Msg(survivors[i], survivors[i ^ d], *give, True))
                nxt.append(keep)
            rounds.append(Round.of("reduce_scatter", msgs))
            history.append(owned)
            owned = nxt
        for d in reversed(distances):             # all-gather, in reverse order
            rounds.append(Round.of("all_gather", (Msg(survivors[i], survivors[i ^ d], *owned[i], False)
                                                  for i in range(p))))
            owned = history.pop()
    if pairs:
        rounds.append(Round.of("unfold", (Msg(b, a, 0, whole, False) for a, b in pairs)))
    return Collective(tuple(rounds), whole)


# ---- hierarchical and 2-D torus --------------------------------------------------------------

def hierarchical(units: Sequence[Sequence[int]]) -> Collective:
    """Inside each unit, across units, inside again (see the module docstring)."""
    groups = [list(g) for g in units if g]
    if len(groups) <= 1:
        whole = max(len(groups[0]), 1) if groups else 1
        return Collective(tuple(rings(groups, [0], [whole])), whole)
    sizes = {len(g) for g in groups}
    m = len(groups)
    if len(sizes) == 1:
        g = sizes.pop()
        whole = g * m
        columns = [[grp[t] for grp in groups] for t in range(g)]
        shards = [split(0, whole, g)[(t + 1) % g] for t in range(g)]       # what local index t owns
        inner = [0] * m, [whole] * m
        return Collective(tuple(_rename(_ring_rounds(groups, *inner, False), "inner_reduce")
                                + _rename(rings(columns, [a for a, _ in shards], [b for _, b in shards]), "across")
                                + _rename(_ring_rounds(groups, *inner, True), "inner_gather")), whole)
    whole = math.lcm(m, *sizes)
    classes = [np.asarray([grp for grp in groups if len(grp) == g], dtype=np.int64) for g in sorted(sizes) if g > 1]
    reduce = _lockstep([_reduce_to_leaders(c, whole) for c in classes])
    across = _rename(rings([[grp[0] for grp in groups]], [0], [whole]), "across")
    bcast = _lockstep([_broadcast_from_leaders(c, whole) for c in classes])
    return Collective(tuple(reduce + across + bcast), whole)


def _owned_by_members(groups: np.ndarray, whole: int) -> tuple[np.ndarray, np.ndarray]:
    """Parts ``[lo, hi)`` that members 1..g-1 of each equal-size group (rows) own after a ring
    reduce-scatter over the group, flattened like ``groups[:, 1:]``."""
    k, g = groups.shape
    seg = (np.arange(1, g) + 1) % g * (whole // g)
    return np.tile(seg, k), np.tile(seg + whole // g, k)


def _reduce_to_leaders(groups: np.ndarray, whole: int) -> list[Round]:
    """Reduce-scatter inside each group (rows of equal size), then gather every shard to its first rank."""
    k, g = groups.shape
    lo, hi = _owned_by_members(groups, whole)
    gather = Round("gather", groups[:, 1:].ravel(), np.repeat(groups[:, 0], g - 1), lo, hi, np.zeros(len(lo), bool))
    return _rename(_ring_rounds(groups, [0] * k, [whole] * k, False), "inner_reduce") + [gather]


def _broadcast_from_leaders(groups: np.ndarray, whole: int) -> list[Round]:
    """Scatter from each group's first rank, then all-gather inside each group."""
    k, g = groups.shape
    lo, hi = _owned_by_members(groups, whole)
    scatter = Round("scatter", np.repeat(groups[:, 0], g - 1), groups[:, 1:].ravel(), lo, hi, np.zeros(len(lo), bool))
    return [scatter] + _rename(_ring_rounds(groups, [0] * k, [whole] * k, True), "inner_gather")


def torus2d(n: int, rows: int, cols: int) -> Collective:
    """R x C grid, rows = C consecutive positions: rows reduce-scatter, columns all-reduce, rows all-gather."""
    if rows * cols != n or rows < 1:
        raise ValueError(f"a {rows}x{cols} torus does not hold {n} ranks")
    if cols == 1:
        return ring(n)
    row_groups = [list(range(r * cols, (r + 1) * cols)) for r in range(rows)]
    columns = [[r * cols + c for r in range(rows)] for c in range(cols)]
    shards = [owned_segment(row_groups[0], c, 0, n) for c in range(cols)]
    whole = [0] * rows, [n] * rows
    return Collective(tuple(_ring_rounds(row_groups, *whole, False)
                            + _rename(rings(columns, [a for a, _ in shards], [b for _, b in shards]), "across")
                            + _ring_rounds(row_groups, *whole, True)), n)


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

def aggregator(n: int, root: int = 0) -> Collective:
    """Everyone sends its vector to ``root``, which sums and sends the sum back (cut-through).

    ``root = SWITCH``: a dedicated process that holds no vector; the first arrival is copied, the
    others summed (n - 1 sums, as on a worker root).
    """
    if n <= 1:
        return Collective(())
    senders = [r for r in range(n) if r != root]
    first = senders[0] if root == SWITCH else None
    return Collective((Round.of("to_root", (Msg(r, root, 0, 1, r != first) for r in senders)),
                       Round.of("from_root", (Msg(root, r, 0, 1, False) for r in senders), cut_through=True)))


def rounds_for(algorithm: str, n: int, *, halving: bool = False, units: Sequence[Sequence[int]] | None = None,
               shape: tuple[int, int] | None = None, root: int = 0) -> Collective:
    """What ``algorithm`` runs on ``n`` positions; the one dispatch executors and prices share.

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

def element_bounds(bounds: np.ndarray, parts: int, numel: int) -> np.ndarray:
    """The elements where part boundaries ``bounds`` (of ``parts``) fall in a vector of ``numel``.

    Monotone and the same for every message, so parts that tile a range tile its elements
    (some may be empty, and are left out by the executors).
    """
    return bounds * numel // parts
