"""The link loads behind ``CostModel.lines`` for one group, without building its messages one by one.

The scalable DP prices the all-reduces of thousands of rank blocks, some of thousands of ranks;
describing each algorithm's rounds (``collectives.py``), pricing them (``priced.py``) and loading
every message onto the links (``CostModel._loads``) costs milliseconds to a tenth of a second per
block. A round's price only needs, per level, the busiest link's share of the vector. Here:

* rounds whose messages are O(n) (ring, torus rows and columns, hierarchical's rings, butterfly's
  fold, aggregator) are loaded as arrays of group positions, as ``_loads`` does, all at once;
* butterfly's exchange rounds (O(n log n) messages) are counted in closed form: a link of level l
  belongs to a unit U of level l-1, whose members are a range of survivor indices; the messages it
  carries are those i in U whose partner ``i ^ d`` lies in U's level-l unit but not in U, counted
  with bit arithmetic over ranges;
* hierarchical's lock-stepped reduce / broadcast rounds (unequal units) are combined per unit size:
  a unit's ring loads each link with one message of 1/g, its gather puts all of the unit's messages
  at one level on the leader's link, and a merged round takes the largest per level.

Shares are the ones ``priced.py`` derives from the collective's parts (a ring over a unit's shard
moves 1/n of the vector, not (1/g)/m); every busiest-link load is the same sum of the same shares
(the shares on one link are all equal, so the order of addition does not matter; ``seqsum`` adds
them one at a time as ``np.bincount`` does); rounds fold as ``priced.py`` folds them.
:func:`link_loads` returns them for every variant; ``CostModel.fast_lines`` prices them as
``CostModel.price`` and sums them in order as ``CostModel.line`` (this module knows nothing of
prices). ``tests/partitioner/test_dp_scale.py`` checks equality with ``CostModel.lines`` on random
groups and clusters.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hybridpipe.partitioner.cost import collectives as co
from hybridpipe.partitioner.cost.cluster import Cluster
from hybridpipe.partitioner.cost.collectives import ALGORITHMS

SW = -1                      # position of the dedicated aggregator (collectives.SWITCH)


@dataclass(frozen=True)
class LinkLoads:
    """Every variant's rounds reduced to what pricing needs (rounds padded to one width with repeat 0)."""

    algorithms: list[str]    # per variant: the algorithm (butterfly twice: recursive doubling, then halving)
    loads: np.ndarray        # [variant, round, level]: the busiest link's bytes / S (0: the level is not used)
    repeat: np.ndarray       # [variant, round]: how many times the round runs (0: padding)
    steps: np.ndarray        # [variant, round]: message latencies per run
    reduce: np.ndarray       # [variant, round]: bytes / S summed per run


@dataclass(frozen=True)
class _Round:
    loads: np.ndarray | int  # busiest link's bytes / S per level (or the index of a message set to load)
    reduce: float = 0.0
    repeat: int = 1
    steps: int = 1


class _Group:
    """A sorted group of ranks: each position's unit at every level, link numbering, pair levels."""

    def __init__(self, cluster: Cluster, ranks: Sequence[int]):
        self.g = np.sort(np.asarray(ranks, dtype=np.int64))
        self.n = n = len(self.g)
        self.levels = levels = len(cluster.levels)
        self.spans = np.array([cluster.span(k) for k in range(levels)], dtype=np.int64)
        self.units = self.g[:, None] // self.spans[None, :]                  # [pos, level]
        self.cols = [self.units[:, k].copy() for k in range(levels)]          # per level, contiguous
        below = np.concatenate([[1], self.spans[:-1]])                        # ranks behind one link
        linkunit = self.g[:, None] // below[None, :]
        self.link = np.zeros((n, levels), dtype=np.int64)                   # local link id of pos at level
        if n > 1:
            self.link[1:] = np.cumsum(linkunit[1:] != linkunit[:-1], axis=0)
        self.top = int(self.level(np.array([0]), np.array([n - 1]))[0]) if n > 1 else 0
        self._seq: dict[float, np.ndarray] = {}
        self._sets: list[tuple[np.ndarray, np.ndarray, float]] = []
        self._memo: dict[str, object] = {}

    def memo(self, key: str, make):
        """``make()``, computed once per group (shared by the algorithms that need it)."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]

    def level(self, p: np.ndarray, q: np.ndarray) -> np.ndarray:
        """Innermost level whose units hold both positions (elementwise)."""
        out = np.zeros(len(p), dtype=np.int64)          # units nest: the levels whose units differ
        for k in range(self.levels):
            col = self.cols[k]
            out += col[p] != col[q]
        return out

    def seqsum(self, part: float, count: np.ndarray) -> np.ndarray:
        """``part`` added ``count`` times (count <= n), one at a time from 0.0 (a link's sum in ``np.bincount``)."""
        table = self._seq.get(part)
        if table is None:
            table = self._seq[part] = np.concatenate([[0.0], np.cumsum(np.full(self.n, part))])
        return table[count]

    def explicit(self, src: np.ndarray, dst: np.ndarray, part: float) -> int:
        """A round of messages src -> dst (positions or SW), all of ``part``: loaded later, with the others."""
        self._sets.append((src, dst, part))
        return len(self._sets) - 1

    def load_all(self) -> np.ndarray:
        """[set, level]: each message set's busiest link (bytes / S), summed per link as ``CostModel._loads``."""
        if not self._sets:
            return np.zeros((0, self.levels))
        src = np.concatenate([x[0] for x in self._sets])
        dst = np.concatenate([x[1] for x in self._sets])
        which = np.repeat(np.arange(len(self._sets)), [len(x[0]) for x in self._sets])
        part = np.repeat([x[2] for x in self._sets], [len(x[0]) for x in self._sets])
        switch = (src == SW) | (dst == SW)
        level = np.where(switch, self.top, self.level(np.maximum(src, 0), np.maximum(dst, 0)))
        width = 2 * self.n + 2
        keys, weights = [], []
        for end, direction in ((src, 0), (dst, 1)):
            real = end != SW
            keys.append(((which * self.levels + level) * width + 2 * self.link[np.maximum(end, 0), level]
                         + direction)[real])
            weights.append(part[real])
        per_link = np.bincount(np.concatenate(keys), weights=np.concatenate(weights),
                               minlength=len(self._sets) * self.levels * width)
        return per_link.reshape(len(self._sets), self.levels, width).max(axis=2)


def _ring(grp: _Group, pos: np.ndarray, chunk: float | None = None) -> list[_Round]:
    """collectives.rings over ``pos`` (or the rows of a 2-D ``pos``, equal sizes), each message moving
    ``chunk`` of the vector (default 1/n: a ring over the whole vector)."""
    rows = pos if pos.ndim == 2 else pos[None, :]
    n = rows.shape[1]
    if n <= 1:
        return []
    chunk = 1 / n if chunk is None else chunk
    loads = grp.explicit(rows.ravel(), np.roll(rows, -1, axis=1).ravel(), chunk)
    return [_Round(loads, chunk, n - 1), _Round(loads, 0.0, n - 1)]


def _butterfly(grp: _Group, halving: bool) -> list[_Round]:
    n = grp.n
    if n <= 1:
        return []
    p = 1 << (n.bit_length() - 1)
    e = n - p
    pos = np.arange(n)
    survivors = np.concatenate([pos[1:2 * e:2], pos[2 * e:]])
    log_p = p.bit_length() - 1
    fold = grp.explicit(pos[0:2 * e:2], pos[1:2 * e:2], 1.0) if e else None
    counts = grp.memo("exchange", lambda: _exchange_counts(grp, survivors, [1 << k for k in range(log_p)]))
    rounds = [_Round(fold, 1.0)] if fold is not None else []
    if halving:
        halves = [1.0 / (2 << k) for k in range(log_p)]
        loads = [c * h for c, h in zip(counts, halves, strict=True)]    # sums of powers of two: exact
        rounds += [_Round(ld, h) for ld, h in zip(loads, halves, strict=True)]
        rounds += [_Round(loads[k]) for k in reversed(range(log_p))]
    else:
        rounds += [_Round(c * 1.0, 1.0) for c in counts]
    if fold is not None:
        rounds.append(_Round(grp.explicit(pos[1:2 * e:2], pos[0:2 * e:2], 1.0)))
    return rounds


def _exchange_counts(grp: _Group, survivors: np.ndarray, dist: list[int]) -> np.ndarray:
    """[round, level]: the busiest link's message count when survivor i sends to i ^ d (d = dist[round])."""
    out = np.zeros((len(dist), grp.levels), dtype=np.int64)
    if not dist:
        return out
    d = np.array(dist, dtype=np.int64)[:, None]
    lo, hi = _unit_ranges(grp, survivors, 0)
    out[:, 0] = (_pairs(lo, hi, lo, hi, d) > 0).any(axis=1)    # a rank's own link: one message at level 0
    for lv in range(1, grp.levels):
        lo, hi = _unit_ranges(grp, survivors, lv - 1)
        plo, phi = _unit_ranges(grp, survivors, lv, like=lv - 1)
        out[:, lv] = (_pairs(lo, hi, plo, lo, d) + _pairs(lo, hi, hi, phi, d)).max(axis=1, initial=0)
    return out


def _unit_ranges(grp: _Group, survivors: np.ndarray, level: int, like: int | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Survivor-index range [lo, hi) of every unit of ``level`` (or of the ``level`` unit around each unit of
    ``like``), one entry per unit of ``like``."""
    unit = grp.units[:, level]
    starts = np.concatenate([[0], np.nonzero(unit[1:] != unit[:-1])[0] + 1])
    ends = np.concatenate([starts[1:], [grp.n]])
    if like is not None:
        inner = grp.units[:, like]
        first = np.concatenate([[0], np.nonzero(inner[1:] != inner[:-1])[0] + 1])
        which = np.searchsorted(starts, first, side="right") - 1
        starts, ends = starts[which], ends[which]
    return np.searchsorted(survivors, starts), np.searchsorted(survivors, ends)


def _pairs(lo: np.ndarray, hi: np.ndarray, jlo: np.ndarray, jhi: np.ndarray, d: np.ndarray) -> np.ndarray:
    """[d, unit]: #{i in [lo, hi) : i ^ d in [jlo, jhi)} (d a power of two)."""
    two = 2 * d

    def clear_below(m):                  # #{0 <= i < m : bit d of i clear}
        m = np.maximum(m, 0)
        return (m // two) * d + np.minimum(m % two, d)

    up_lo, up_hi = np.maximum(lo, jlo - d), np.minimum(hi, jhi - d)       # bit clear: partner i + d
    dn_lo, dn_hi = np.maximum(lo, jlo + d), np.minimum(hi, jhi + d)       # bit set: partner i - d
    clear_up = np.where(up_hi > up_lo, clear_below(up_hi) - clear_below(up_lo), 0)
    set_dn = np.where(dn_hi > dn_lo, (dn_hi - dn_lo) - (clear_below(dn_hi) - clear_below(dn_lo)), 0)
    return clear_up + set_dn


def _hierarchical(grp: _Group, starts: np.ndarray, sizes: np.ndarray) -> list[_Round]:
    """collectives.hierarchical on the units of consecutive positions ``starts`` / ``sizes``."""
    m = len(sizes)
    if m <= 1:
        return _ring(grp, np.arange(grp.n))
    if (sizes == sizes[0]).all():
        g = int(sizes[0])
        stacked = np.arange(grp.n).reshape(m, g)
        inner = _ring(grp, stacked)
        across = _ring(grp, stacked.T.copy(), 1 / grp.n)          # ring t over the shard local index t owns
        return inner[:1] + across + inner[1:]
    reduce, broadcast = _lockstep(grp, starts, sizes)
    return reduce + _ring(grp, starts) + broadcast


def _lockstep(grp: _Group, starts: np.ndarray, sizes: np.ndarray) -> tuple[list[_Round], list[_Round]]:
    """collectives.hierarchical's lock-stepped reduce-to-leader rounds, and its broadcast-from-leader rounds.

    Group k (size s >= 2) unrolls to s rounds: reduce: s - 1 ring reduce-scatter rounds, then the
    gather to its first rank; broadcast: the scatter, then s - 1 ring all-gather rounds. Round i merges
    the groups still running; consecutive merged rounds with the same groups in the same phases are
    equal and fold into one. A link belongs to one group, so a merged round's busiest link per level is
    the largest of its groups' own: the ring puts one message (1/s) on a link; the gather (scatter) puts
    every message of a level on the leader's link. Groups of one size run in step, so only the largest
    load per size matters.
    """
    m, levels = len(sizes), grp.levels
    pos = np.arange(grp.n)
    member = np.repeat(np.arange(m), sizes)
    nxt = pos + 1
    nxt[np.cumsum(sizes) - 1] = starts
    ring_on = np.zeros((m, levels), dtype=bool)
    ring_on[member, grp.level(pos, nxt)] = True
    lead = np.repeat(starts, sizes)
    others = pos != lead
    edge = np.bincount(member[others] * levels + grp.level(lead[others], pos[others]),
                       minlength=m * levels).reshape(m, levels)
    kinds = [int(x) for x in np.unique(sizes) if x >= 2]
    ring_max, edge_max = {}, {}
    for s in kinds:
        mine = sizes == s
        ring_max[s] = np.where(ring_on[mine].any(axis=0), 1.0 / s, 0.0).tolist()
        most = edge[mine].max(axis=0)
        edge_max[s] = np.where(most > 0, grp.seqsum(1.0 / s, most), 0.0).tolist()
    out = []
    for gather in (True, False):
        merged: list[_Round] = []
        last = None
        for i in range(max(kinds, default=0)):
            running = [s for s in kinds if i < s]
            in_ring = [s for s in running if (i < s - 1 if gather else i >= 1)]
            sig = (tuple(running), tuple(in_ring))
            if sig == last:
                prev = merged[-1]
                merged[-1] = _Round(prev.loads, prev.reduce, prev.repeat + 1)
                continue
            last = sig
            loads = [max(col) for col in zip(*(ring_max[s] if s in in_ring else edge_max[s] for s in running),
                                             strict=True)]
            merged.append(_Round(np.array(loads), max((1.0 / s for s in in_ring), default=0.0) if gather else 0.0))
        out.append(merged)
    return out[0], out[1]


def _torus(grp: _Group, rows: int, cols: int) -> list[_Round]:
    grid = np.arange(grp.n).reshape(rows, cols)
    row = _ring(grp, grid)
    return row[:1] + _ring(grp, grid.T.copy(), 1 / grp.n) + row[1:]    # one part of n per message


def _aggregator(grp: _Group, dedicated: bool) -> list[_Round]:
    n = grp.n
    if n <= 1:
        return []
    pos = np.arange(n)
    if dedicated:
        sw = np.full(n, SW)
        loads = grp.explicit(np.concatenate([pos, sw]), np.concatenate([sw, pos]), 1.0)
    else:
        agg = np.zeros(n - 1, dtype=np.int64)
        loads = grp.explicit(np.concatenate([pos[1:], agg]), np.concatenate([agg, pos[1:]]), 1.0)
    return [_Round(loads, float(n - 1), 1, 2)]


def link_loads(cluster: Cluster, ranks: Sequence[int], algorithms: Sequence[str] = ALGORITHMS,
               dedicated: bool = False) -> LinkLoads:
    """The rounds of every variant of ``algorithms`` on ``ranks`` (butterfly: both), as link loads;
    ``dedicated``: the aggregator is a process of its own (``CostModel.aggregator_dedicated``)."""
    grp = _Group(cluster, ranks)
    n = grp.n
    if grp.top == 0 or n <= 1:
        starts, sizes = np.array([0]), np.array([n])
    else:
        unit = grp.units[:, grp.top - 1]
        starts = np.concatenate([[0], np.nonzero(unit[1:] != unit[:-1])[0] + 1])
        sizes = np.diff(np.concatenate([starts, [n]]))
    shape = co.torus_shape(n, int(sizes[0]) if (sizes == sizes[0]).all() else 1) if n else (0, 0)
    built: dict[tuple[str, bool], list[_Round]] = {}
    variants = []
    for a in algorithms:
        for halving in ((False, True) if a == "butterfly" else (False,)):
            kind = ("ring" if a == "native" else a, halving)
            if kind not in built:
                built[kind] = _rounds(grp, kind[0], halving, (starts, sizes), shape, dedicated)
            variants.append((a, built[kind]))
    table = grp.load_all()
    resolved = [[r if not isinstance(r.loads, int) else _Round(table[r.loads], r.reduce, r.repeat, r.steps)
                 for r in rounds] for _, rounds in variants]
    width = max((len(r) for r in resolved), default=0)
    count = len(resolved)
    loads = np.zeros((count, width, grp.levels))
    repeat = np.zeros((count, width), dtype=np.int64)
    steps = np.zeros((count, width), dtype=np.int64)
    reduce = np.zeros((count, width))
    for v, rounds in enumerate(resolved):
        for k, r in enumerate(rounds):
            loads[v, k], repeat[v, k], steps[v, k], reduce[v, k] = r.loads, r.repeat, r.steps, r.reduce
    return LinkLoads([a for a, _ in variants], loads, repeat, steps, reduce)


def _rounds(grp: _Group, algorithm: str, halving: bool, groups: tuple[np.ndarray, np.ndarray],
            shape: tuple[int, int], dedicated: bool) -> list[_Round]:
    if algorithm == "ring":
        return _ring(grp, np.arange(grp.n))
    if algorithm == "butterfly":
        return _butterfly(grp, halving)
    if algorithm == "hierarchical":
        return _hierarchical(grp, *groups)
    if algorithm == "torus2d":
        return _torus(grp, *shape)
    if algorithm == "aggregator":
        return _aggregator(grp, dedicated)
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r}")
