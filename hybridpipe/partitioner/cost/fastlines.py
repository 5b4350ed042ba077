"""The link loads behind ``CostModel.lines`` for one group, in closed form from the group's layout.

The scalable DP prices the all-reduces of thousands of rank blocks, some of thousands of ranks;
describing each algorithm's rounds (``collectives.py``), pricing them (``priced.py``) and loading
every message onto the links (``CostModel._loads``) costs milliseconds to a tenth of a second per
block. A round's price only needs, per level, the busiest link's share of the vector, and that
follows from the group's *layout*: the sorted ranks cut into the units of every level, each unit
an interval of positions (``_Layout``). A link of level l serves one unit V of level l-1 (level 0:
one rank); it carries the messages of level exactly l that leave V (egress) or enter it (ingress),
i.e. whose other end lies in V's unit W of level l but outside V. Per algorithm:

* rings over consecutive positions (the ring, torus rows, hierarchical's rings inside a unit):
  at most two messages leave an interval V (from V's last position, and from the end of a row that
  starts before V back to its start), at most two enter it;
* rings over positions ``c`` apart (torus columns, hierarchical's rings across units): the senders
  leaving V (to ``p + c``, or wrapping back from the last row) are intervals of positions, counted
  from V's and W's ends;
* butterfly's fold pairs neighbours (one message per link at most); its exchange rounds (survivor i
  with ``i ^ d``) are counted with bit arithmetic over the survivor ranges of V and W, only for
  ``d`` below W's size (farther partners leave W; at the outermost level every partner is in W);
* hierarchical with unequal units runs lock-stepped reduce / broadcast rounds (``_lockstep``);
* the aggregator loads the root's link (or, dedicated, every unit's) with one message per sender.

Each busiest-link load is the same sum of the same shares as ``CostModel._loads``' ``np.bincount``
(the shares on one link are all equal; ``_sum`` adds them one at a time), rounds fold as
``priced.py`` folds them. :func:`link_loads` returns them for every variant; ``CostModel.fast_lines``
prices them as ``CostModel.price`` and sums them in order as ``CostModel.line`` (this module knows
nothing of prices). ``tests/partitioner/test_dp_scale.py`` and ``test_fastlines.py`` check equality
with ``CostModel.priced_line`` (message by message) on random groups, blocks and clusters.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from hybridpipe.partitioner.cost import collectives as co
from hybridpipe.partitioner.cost.cluster import Cluster
from hybridpipe.partitioner.cost.collectives import ALGORITHMS


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
    loads: np.ndarray        # busiest link's bytes / S per level
    reduce: float = 0.0
    repeat: int = 1
    steps: int = 1


def _sum(part: float, count):
    """``part`` added ``count`` times one at a time from 0.0 (a link's sum in ``np.bincount``); elementwise."""
    if isinstance(count, int) and count <= 64:      # one link: the same additions in Python floats
        total = 0.0
        for _ in range(count):
            total += part
        return total
    count = np.asarray(count, dtype=np.int64)
    most = int(count.max(initial=0))
    table = np.concatenate([[0.0], np.cumsum(np.full(most, part))])
    return table[count]


class _Layout:
    """A sorted group of ranks as intervals of positions: the units of every level it touches.

    ``starts[k]`` / ``ends[k]``: first / last position of each unit of level k; ``top``: the level of
    the whole group (the levels below it cut it into several units)."""

    def __init__(self, cluster: Cluster, ranks: Sequence[int] | np.ndarray):
        g = np.asarray(ranks, dtype=np.int64)
        if len(g) > 1 and (g[1:] < g[:-1]).any():        # the DP's blocks come sorted
            g = np.sort(g)
        self.n = n = len(g)
        self.levels = levels = len(cluster.levels)
        self.starts: list[np.ndarray] = []
        self.ends: list[np.ndarray] = []
        self.top = 0
        for k in range(levels):
            if k == levels - 1 or (k and len(self.starts[-1]) == 1):   # one unit holds every rank
                self.starts.append(np.zeros(1, dtype=np.int64))
                self.ends.append(np.full(1, n - 1, dtype=np.int64))
                continue
            unit = g // cluster.span(k)
            cut = np.flatnonzero(unit[1:] != unit[:-1]) + 1
            self.starts.append(np.concatenate([[0], cut]))
            self.ends.append(np.concatenate([cut, [n]]) - 1)
            self.top = k + 1 if len(cut) else self.top
        self._parents: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}

    def adjacent(self, pos: np.ndarray) -> np.ndarray:
        """The level of each pair (pos - 1, pos): the number of levels at which pos starts a unit."""
        out = np.zeros(len(pos), dtype=np.int64)
        for k in range(self.top):
            at = np.minimum(np.searchsorted(self.starts[k], pos), len(self.starts[k]) - 1)
            out += self.starts[k][at] == pos
        return out

    def parents(self, level: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(a, b, wa, wb): each unit V = [a, b] of ``level - 1`` and its unit W = [wa, wb] of ``level``."""
        hit = self._parents.get(level)
        if hit is None:
            a, b = self.starts[level - 1], self.ends[level - 1]
            up = np.searchsorted(self.starts[level], a, side="right") - 1
            hit = self._parents[level] = (a, b, self.starts[level][up], self.ends[level][up])
        return hit


def _span(lo, hi):
    """Size of the integer interval [lo, hi] (0 when empty), elementwise."""
    return np.maximum(np.asarray(hi) - np.asarray(lo) + 1, 0)


def _rows(lay: _Layout, c: int, chunk: float) -> list[_Round]:
    """Rings over consecutive positions, rows [t c, t c + c - 1] (c divides n), each message ``chunk``."""
    if c <= 1:
        return []
    loads = np.zeros(lay.levels)
    a, b = lay.starts[0], lay.ends[0]
    if ((b - a >= 2) | ((b - a == 1) & (a % c != c - 1))).any():     # two ranks of a row share a unit
        loads[0] = chunk
    for lv in range(1, lay.top + 1):
        a, b, wa, wb = lay.parents(lv)
        rs_a, re_b = a - a % c, b - b % c + c - 1
        re_a = rs_a + c - 1
        out = ((b < re_b) & (b + 1 <= wb)).astype(np.int64) + ((a > rs_a) & (re_a <= b) & (rs_a >= wa))
        into = ((a > rs_a) & (a - 1 >= wa)).astype(np.int64) + ((re_b - c + 1 >= a) & (re_b > b) & (re_b <= wb))
        loads[lv] = _sum(chunk, max(int(out.max()), int(into.max())))
    return [_Round(loads, chunk, c - 1), _Round(loads, 0.0, c - 1)]


def _columns(lay: _Layout, c: int, chunk: float) -> list[_Round]:
    """Rings over positions ``c`` apart (columns of the r x c grid of positions), each message ``chunk``."""
    n = lay.n
    r = n // c
    if r <= 1:
        return []
    w = (r - 1) * c                                  # the wrap: last row -> first row
    loads = np.zeros(lay.levels)
    a, b = lay.starts[0], lay.ends[0]
    if ((np.minimum(b - c, n - 1 - c) >= a) | (b >= np.maximum(np.maximum(a, n - c), a + w))).any():
        loads[0] = chunk
    for lv in range(1, lay.top + 1):
        a, b, wa, wb = lay.parents(lv)
        out = (_span(np.maximum(a, b - c + 1), np.minimum(np.minimum(b, n - 1 - c), wb - c))
               + _span(np.maximum(np.maximum(a, n - c), wa + w), np.minimum(b, a - 1 + w)))
        into = (_span(np.maximum(np.maximum(a, c), wa + c), np.minimum(b, a - 1 + c))
                + _span(np.maximum(a, b + 1 - w), np.minimum(np.minimum(b, c - 1), wb - w)))
        loads[lv] = _sum(chunk, max(int(out.max()), int(into.max())))
    return [_Round(loads, chunk, r - 1), _Round(loads, 0.0, r - 1)]


def _butterfly(lay: _Layout, halving: bool, counts: np.ndarray) -> list[_Round]:
    n = lay.n
    if n <= 1:
        return []
    p = 1 << (n.bit_length() - 1)
    e = n - p
    log_p = p.bit_length() - 1
    rounds = []
    if e:
        fold = np.zeros(lay.levels)                          # pairs (2i, 2i + 1), i < e: one message a link
        fold[np.bincount(lay.adjacent(np.arange(1, 2 * e, 2)), minlength=lay.levels) > 0] = 1.0
        rounds.append(_Round(fold, 1.0))
    if halving:
        halves = [1.0 / (2 << k) for k in range(log_p)]
        loads = [c * h for c, h in zip(counts, halves, strict=True)]    # sums of powers of two: exact
        rounds += [_Round(ld, h) for ld, h in zip(loads, halves, strict=True)]
        rounds += [_Round(loads[k]) for k in reversed(range(log_p))]
    else:
        rounds += [_Round(c * 1.0, 1.0) for c in counts]
    if e:
        rounds.append(_Round(rounds[0].loads))
    return rounds


def _exchange_counts(lay: _Layout) -> np.ndarray:
    """[round, level]: the busiest link's message count when survivor i sends to i ^ d (d = 2^round).

    Survivors: the odd positions below 2e, then every position from 2e (e = n - p). Partners ``d``
    or more apart leave any survivor range of fewer than ``d``: only smaller ``d`` need counting."""
    n = lay.n
    p = 1 << (n.bit_length() - 1)
    e = n - p
    log_p = p.bit_length() - 1
    out = np.zeros((log_p, lay.levels), dtype=np.int64)

    def index(pos):                                   # survivors before position pos
        return np.where(pos <= 2 * e, pos // 2, pos - e)

    def small(width: int) -> np.ndarray:              # the distances below width, as a column
        return (1 << np.arange(min(log_p, max(width - 1, 0).bit_length())))[:, None]

    def inside(level: int) -> tuple[np.ndarray, np.ndarray]:    # per unit of level: size, pairs within
        lo, hi = index(lay.starts[level]), index(lay.ends[level] + 1)
        return hi - lo, _pairs(lo, hi, lo, hi, small(int((hi - lo).max(initial=0))))

    size, own = inside(0)
    out[:len(own), 0] = (own > 0).any(axis=1)             # a rank's own link: one message
    for lv in range(1, lay.top + 1):
        if lv == lay.top:                             # W holds every survivor: V's own pairs stay
            size, own = (size, own) if lv == 1 else inside(lv - 1)
            out[:, lv] = int(size.max(initial=0))
            out[:len(own), lv] = (size - own).max(axis=1, initial=0)
            continue
        a, b, wa, wb = lay.parents(lv)
        lo, hi, plo, phi = index(a), index(b + 1), index(wa), index(wb + 1)
        d = small(int((phi - plo).max(initial=0)))
        out[:len(d), lv] = (_pairs(lo, hi, plo, lo, d) + _pairs(lo, hi, hi, phi, d)).max(axis=1, initial=0)
    return out


def _pairs(lo: np.ndarray, hi: np.ndarray, jlo: np.ndarray, jhi: np.ndarray, d: np.ndarray) -> np.ndarray:
    """[d, unit]: #{i in [lo, hi) : i ^ d in [jlo, jhi)} (d a power of two)."""
    two = 2 * d
    shift = np.log2(d).astype(np.int64)

    def clear_below(m):                  # #{0 <= i < m : bit d of i clear} (m // 2d * d + min(m % 2d, d))
        m = np.maximum(m, 0)
        return ((m >> (shift + 1)) << shift) + np.minimum(m & (two - 1), d)

    up_lo, up_hi = np.maximum(lo, jlo - d), np.minimum(hi, jhi - d)       # bit clear: partner i + d
    dn_lo, dn_hi = np.maximum(lo, jlo + d), np.minimum(hi, jhi + d)       # bit set: partner i - d
    clear_up = np.where(up_hi > up_lo, clear_below(up_hi) - clear_below(up_lo), 0)
    set_dn = np.where(dn_hi > dn_lo, (dn_hi - dn_lo) - (clear_below(dn_hi) - clear_below(dn_lo)), 0)
    return clear_up + set_dn


def _hierarchical(lay: _Layout, starts: np.ndarray, sizes: np.ndarray) -> list[_Round]:
    """collectives.hierarchical on the units of consecutive positions ``starts`` / ``sizes``."""
    m = len(sizes)
    if m <= 1:
        return _rows(lay, lay.n, 1 / lay.n)
    if (sizes == sizes[0]).all():
        g = int(sizes[0])
        inner = _rows(lay, g, 1 / g)
        return inner[:1] + _columns(lay, g, 1 / lay.n) + inner[1:]    # ring t over the shard t owns
    reduce, broadcast = _lockstep(lay, starts, sizes)
    leaders = np.zeros(lay.levels)                   # one leader per unit: one message a link, all at top
    leaders[lay.top] = 1 / m
    return reduce + [_Round(leaders, 1 / m, m - 1), _Round(leaders, 0.0, m - 1)] + broadcast


def _lockstep(lay: _Layout, starts: np.ndarray, sizes: np.ndarray) -> tuple[list[_Round], list[_Round]]:
    """collectives.hierarchical's lock-stepped reduce-to-leader rounds, and its broadcast-from-leader rounds.

    Group k (size s >= 2) unrolls to s rounds: reduce: s - 1 ring reduce-scatter rounds, then the
    gather to its first rank; broadcast: the scatter, then s - 1 ring all-gather rounds. Round i merges
    the groups still running; consecutive merged rounds with the same groups in the same phases are
    equal and fold into one. A link belongs to one group, so a merged round's busiest link per level is
    the largest of its groups' own: the ring puts one message (1/s) on a link of each level its
    neighbours part at; the gather (scatter) puts every message of a level on the leader's link (the
    members of the leader's unit of that level but not of the one below). Groups of one size run in
    step, so only the largest load per size matters.
    """
    levels, top = lay.levels, lay.top
    ends = starts + sizes - 1
    ring_on = np.zeros((len(sizes), levels), dtype=bool)
    edge = np.zeros((len(sizes), levels), dtype=np.int64)
    below, parts = np.ones(len(sizes), dtype=np.int64), sizes
    for lv in range(top):              # a group's units of every level start at its first rank
        first = np.searchsorted(lay.starts[lv], starts)
        inside = np.searchsorted(lay.starts[lv], ends, side="right") - first
        ring_on[:, lv] = parts > inside              # neighbours in one unit of lv, not of the level below
        size = lay.ends[lv][first] - starts + 1
        edge[:, lv] = size - below
        below, parts = size, inside
    kinds = sorted(s for s in set(sizes.tolist()) if s >= 2)
    ring_max, edge_max = {}, {}
    for s in kinds:
        mine = sizes == s
        ring_max[s] = np.where(ring_on[mine].any(axis=0), 1.0 / s, 0.0).tolist()
        most = edge[mine].max(axis=0)
        edge_max[s] = np.where(most > 0, _sum(1.0 / s, most), 0.0).tolist()
    return _merged(tuple((s, tuple(ring_max[s]), tuple(edge_max[s])) for s in kinds))


@functools.lru_cache(maxsize=4096)
def _merged(kinds: tuple[tuple[int, tuple[float, ...], tuple[float, ...]], ...]
            ) -> tuple[list[_Round], list[_Round]]:
    """:func:`_lockstep`'s merged rounds from each group size's (ring loads, gather loads) per level."""
    ring_max = {s: ring for s, ring, _ in kinds}
    edge_max = {s: edge for s, _, edge in kinds}
    sizes = [s for s, _, _ in kinds]
    out = []
    for gather in (True, False):
        merged: list[_Round] = []
        last = None
        for i in range(max(sizes, default=0)):
            running = [s for s in sizes if i < s]
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


def _torus(lay: _Layout, rows: int, cols: int) -> list[_Round]:
    row = _rows(lay, cols, 1 / cols)
    return row[:1] + _columns(lay, cols, 1 / lay.n) + row[1:]    # one part of n per message


def _aggregator(lay: _Layout, dedicated: bool) -> list[_Round]:
    n, top = lay.n, lay.top
    if n <= 1:
        return []
    loads = np.zeros(lay.levels)
    if dedicated:             # every message at the top level: each unit below it sends and receives its own
        loads[top] = float((lay.ends[top - 1] - lay.starts[top - 1] + 1).max()) if top else 1.0
    else:                     # the root's link of each level carries every member that first joins it there
        sizes = [1] + [int(lay.ends[k][0]) + 1 for k in range(top + 1)]
        loads[:top + 1] = np.diff(sizes)
    return [_Round(loads, float(n - 1), 1, 2)]


def link_loads(cluster: Cluster, ranks: Sequence[int] | np.ndarray, algorithms: Sequence[str] = ALGORITHMS,
               dedicated: bool = False) -> LinkLoads:
    """The rounds of every variant of ``algorithms`` on ``ranks`` (butterfly: both), as link loads;
    ``dedicated``: the aggregator is a process of its own (``CostModel.aggregator_dedicated``)."""
    lay = _Layout(cluster, ranks)
    n = lay.n
    if lay.top == 0 or n <= 1:
        starts, sizes = np.array([0]), np.array([n])
    else:
        starts = lay.starts[lay.top - 1]
        sizes = lay.ends[lay.top - 1] - starts + 1
    shape = co.torus_shape(n, int(sizes[0]) if (sizes == sizes[0]).all() else 1) if n else (0, 0)
    built: dict[tuple[str, bool], list[_Round]] = {}
    counts: list[np.ndarray] = []
    variants = []
    for a in algorithms:
        for halving in ((False, True) if a == "butterfly" else (False,)):
            kind = ("ring" if a == "native" else a, halving)
            if kind not in built:
                if kind[0] == "butterfly" and not counts and n > 1:
                    counts.append(_exchange_counts(lay))
                built[kind] = _rounds(lay, kind[0], halving, (starts, sizes), shape, dedicated, counts)
            variants.append((a, built[kind]))
    width = max((len(r) for _, r in variants), default=0)
    flat = [r for _, rounds in variants for r in rounds]
    where = np.array([v * width + k for v, (_, rounds) in enumerate(variants) for k in range(len(rounds))],
                     dtype=np.int64)
    flat_loads = np.zeros((len(variants) * width, lay.levels))
    columns = [np.zeros(len(variants) * width, dtype=t) for t in (np.int64, np.int64, float)]
    if flat:
        flat_loads[where] = np.stack([r.loads for r in flat])
        for col, values in zip(columns, zip(*((r.repeat, r.steps, r.reduce) for r in flat), strict=True),
                               strict=True):
            col[where] = values
    shape = (len(variants), width)
    loads = flat_loads.reshape(*shape, lay.levels)
    repeat, steps, reduce = (col.reshape(shape) for col in columns)
    return LinkLoads([a for a, _ in variants], loads, repeat, steps, reduce)


def _rounds(lay: _Layout, algorithm: str, halving: bool, groups: tuple[np.ndarray, np.ndarray],
            shape: tuple[int, int], dedicated: bool, counts: list[np.ndarray]) -> list[_Round]:
    if algorithm == "ring":
        return _rows(lay, lay.n, 1 / lay.n) if lay.n > 1 else []
    if algorithm == "butterfly":
        return _butterfly(lay, halving, counts[0]) if lay.n > 1 else []
    if algorithm == "hierarchical":
        return _hierarchical(lay, *groups) if lay.n > 1 else []
    if algorithm == "torus2d":
        return _torus(lay, *shape)
    if algorithm == "aggregator":
        return _aggregator(lay, dedicated)
    raise ValueError(f"unknown all-reduce algorithm {algorithm!r}")
