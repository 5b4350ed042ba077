"""Every all-reduce line of many DP block shapes in one vectorised pass: ``fastlines.py`` batched.

``StageTerms`` prices thousands of block shapes (``blocklayout.py``), most of them a few hundred at a
time. ``fastlines.link_loads`` + ``CostModel.fast_lines`` price one shape with ~200 small numpy
calls; here every step works on all the shapes at once: the per-unit arrays of every shape are
concatenated (``BlockLayout``), per-shape maxima are ``reduceat`` over them, and each algorithm's
rounds fill fixed *slots* of a [shape, slot, level] array (a shape with fewer rounds leaves its extra
slots at repeat 0, which add exactly 0.0 to the sums, in the same order). Each step is the one of
``fastlines.py`` with the same operations on the same numbers, so every line is bit for bit the
same as ``CostModel.fast_lines`` (and so ``CostModel.priced_line``, message by message):
``tests/partitioner/test_blocklines.py``.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from hybridpipe.partitioner.cost import collectives as co
from hybridpipe.partitioner.cost.blocklayout import BlockLayout, sums
from hybridpipe.partitioner.cost.fastlines import _merged, _pairs, _sum

if TYPE_CHECKING:
    from hybridpipe.partitioner.cost.costmodel import CostModel


@dataclass(frozen=True)
class Rounds:
    """One variant's rounds over G shapes: [G, slot, level] loads, [G, slot] reduce / repeat / steps."""

    loads: np.ndarray
    reduce: np.ndarray
    repeat: np.ndarray
    steps: np.ndarray

    @staticmethod
    def one(loads: np.ndarray, reduce, repeat: np.ndarray, steps: int = 1) -> Rounds:
        """A single slot (``reduce`` a number or one per shape)."""
        g = len(loads)
        return Rounds(loads[:, None, :], np.broadcast_to(np.asarray(reduce, dtype=float), (g,))[:, None],
                      np.asarray(repeat, dtype=np.int64)[:, None], np.full((g, 1), steps, dtype=np.int64))

    @staticmethod
    def concat(parts: Sequence[Rounds]) -> Rounds:
        return Rounds(*(np.concatenate([getattr(p, f) for p in parts], axis=1)
                        for f in ("loads", "reduce", "repeat", "steps")))


def _span(lo, hi):
    return np.maximum(hi - lo + 1, 0)


def _subset(lay: BlockLayout, level: int, active: np.ndarray, arrays: Sequence[np.ndarray]
            ) -> tuple[np.ndarray, list[np.ndarray], np.ndarray]:
    """The units of ``level`` of the shapes ``active``: (their shapes, ``arrays`` cut to them, each
    active shape's first among them) -- inactive shapes cost nothing."""
    keep, first = lay.units[level].within(active)
    return lay.units[level].gid[keep], [x[keep] for x in arrays], first


def _rows(lay: BlockLayout, c: np.ndarray, chunk: np.ndarray, active: np.ndarray) -> list[Rounds]:
    """``fastlines._rows`` per shape: rings over consecutive positions in rows of ``c``, messages ``chunk``."""
    active = active & (c > 1)
    chunk = np.broadcast_to(chunk, (lay.g,))
    loads = np.zeros((lay.g, lay.levels))
    if active.any():
        gid, (a, b), first = _subset(lay, 0, active, (lay.units[0].a, lay.units[0].b))
        cu = c[gid]
        hit = (b - a >= 2) | ((b - a == 1) & (a % cu != cu - 1))
        loads[active, 0] = np.where(np.maximum.reduceat(hit.astype(np.int8), first) > 0, chunk[active], 0.0)
        for lv in range(1, lay.max_top + 1):
            gid, (a, b, wa, wb), first = _subset(lay, lv - 1, active, lay.parents(lv))
            cu = c[gid]
            rs_a, re_b = a - a % cu, b - b % cu + cu - 1
            re_a = rs_a + cu - 1
            out = ((b < re_b) & (b + 1 <= wb)).astype(np.int64) + ((a > rs_a) & (re_a <= b) & (rs_a >= wa))
            into = ((a > rs_a) & (a - 1 >= wa)).astype(np.int64) + ((re_b - cu + 1 >= a) & (re_b > b) & (re_b <= wb))
            count = np.maximum.reduceat(np.maximum(out, into), first)
            loads[active, lv] = np.where(lv <= lay.top[active], sums(chunk[active], count), 0.0)
    repeat = np.where(active, c - 1, 0)
    return [Rounds.one(loads, np.where(active, chunk, 0.0), repeat), Rounds.one(loads, 0.0, repeat)]


def _columns(lay: BlockLayout, c: np.ndarray, chunk: np.ndarray, active: np.ndarray) -> list[Rounds]:
    """``fastlines._columns`` per shape: rings over positions ``c`` apart, messages ``chunk``."""
    c = np.where(active & (c >= 1), c, 1)
    n = lay.n
    r = n // c
    active = active & (r > 1)
    w = (r - 1) * c
    chunk = np.broadcast_to(chunk, (lay.g,))
    loads = np.zeros((lay.g, lay.levels))
    if active.any():
        gid, (a, b), first = _subset(lay, 0, active, (lay.units[0].a, lay.units[0].b))
        nn, cc, ww = n[gid], c[gid], w[gid]
        hit = (np.minimum(b - cc, nn - 1 - cc) >= a) | (b >= np.maximum(np.maximum(a, nn - cc), a + ww))
        loads[active, 0] = np.where(np.maximum.reduceat(hit.astype(np.int8), first) > 0, chunk[active], 0.0)
        for lv in range(1, lay.max_top + 1):
            gid, (a, b, wa, wb), first = _subset(lay, lv - 1, active, lay.parents(lv))
            nn, cc, ww = n[gid], c[gid], w[gid]
            out = (_span(np.maximum(a, b - cc + 1), np.minimum(np.minimum(b, nn - 1 - cc), wb - cc))
                   + _span(np.maximum(np.maximum(a, nn - cc), wa + ww), np.minimum(b, a - 1 + ww)))
            into = (_span(np.maximum(np.maximum(a, cc), wa + cc), np.minimum(b, a - 1 + cc))
                    + _span(np.maximum(a, b + 1 - ww), np.minimum(np.minimum(b, cc - 1), wb - ww)))
            count = np.maximum.reduceat(np.maximum(out, into), first)
            loads[active, lv] = np.where(lv <= lay.top[active], sums(chunk[active], count), 0.0)
    repeat = np.where(active, r - 1, 0)
    return [Rounds.one(loads, np.where(active, chunk, 0.0), repeat), Rounds.one(loads, 0.0, repeat)]


def _exchange_counts(lay: BlockLayout, e: np.ndarray, log_p: np.ndarray) -> np.ndarray:
    """[G, round, level]: ``fastlines._exchange_counts`` per shape (rounds past a shape's log p are 0).

    As there, only distances below the widest unit concerned are counted (the others leave it); each
    level's two cases run on the units of the shapes they concern only."""
    g, levels = lay.g, lay.levels
    most = int(log_p.max(initial=0))
    out = np.zeros((g, most, levels), dtype=np.int64)

    def index(pos, gid):
        ee = e[gid]
        return np.where(pos <= 2 * ee, pos // 2, pos - ee)

    def small(width: int) -> np.ndarray:
        return (1 << np.arange(min(most, max(width - 1, 0).bit_length())))[:, None]

    def inside(level: int, keep) -> tuple[np.ndarray, np.ndarray]:
        u = lay.units[level]
        lo, hi = index(u.a[keep], u.gid[keep]), index(u.b[keep] + 1, u.gid[keep])
        return hi - lo, _pairs(lo, hi, lo, hi, small(int((hi - lo).max(initial=0))))

    size0, own0 = inside(0, slice(None))
    out[:, :len(own0), 0] = (lay.units[0].per_group_max((own0 > 0).astype(np.int64)) > 0).T
    for lv in range(1, lay.max_top + 1):
        u = lay.units[lv - 1]
        at = lay.top == lv                            # W holds every survivor: V's own pairs stay
        if at.any():
            keep, first = u.within(at)
            size, own = (size0[keep], own0[:, keep]) if lv == 1 else inside(lv - 1, keep)
            at_top = np.repeat(np.maximum.reduceat(size, first)[:, None], most, axis=1)
            at_top[:, :len(own)] = np.maximum.reduceat(size - own, first, axis=1).T
            out[at, :, lv] = at_top
        up = lay.top > lv
        if up.any():
            keep, first = u.within(up)
            a, b, wa, wb = (x[keep] for x in lay.parents(lv))
            gid = u.gid[keep]
            lo, hi, plo, phi = index(a, gid), index(b + 1, gid), index(wa, gid), index(wb + 1, gid)
            d = small(int((phi - plo).max(initial=0)))
            pairs = _pairs(lo, hi, plo, lo, d) + _pairs(lo, hi, hi, phi, d)
            out[np.flatnonzero(up)[:, None], np.arange(len(d))[None, :], lv] = np.maximum.reduceat(pairs, first,
                                                                                                  axis=1).T
    out[np.arange(most)[None, :] >= log_p[:, None]] = 0
    return out


def _butterfly(lay: BlockLayout, halving: bool, counts: np.ndarray, e: np.ndarray, log_p: np.ndarray
               ) -> list[Rounds]:
    """``fastlines._butterfly`` per shape: the fold, the exchanges (halving: and back), the unfold."""
    g, levels = lay.g, lay.levels
    live = lay.n > 1
    folded = live & (e > 0)
    odd = []                                     # per level below the top: odd unit starts before 2e
    for k in range(levels):
        u = lay.units[k]
        hit = (u.a % 2 == 1) & (u.a < 2 * e[u.gid])
        odd.append(np.where(k < lay.top, np.bincount(u.gid[hit], minlength=g), 0))
    fold = np.zeros((g, levels))
    fold[:, 0] = e - odd[0] > 0
    for lv in range(1, levels):
        fold[:, lv] = odd[lv - 1] - odd[lv] > 0
    fold[~folded] = 0.0
    most = counts.shape[1]
    ks = np.arange(most)
    real = (ks[None, :] < log_p[:, None]) & live[:, None]
    rounds = [Rounds.one(fold, np.where(folded, 1.0, 0.0), folded)]
    if halving:
        halves = np.array([1.0 / (2 << k) for k in range(most)])
        loads = counts * halves[None, :, None]
        rounds.append(Rounds(loads, np.where(real, halves[None, :], 0.0), real.astype(np.int64),
                             np.ones((g, most), dtype=np.int64)))
        back = np.clip(log_p[:, None] - 1 - ks[None, :], 0, None)          # slot t: round log p - 1 - t
        rounds.append(Rounds(np.take_along_axis(loads, back[:, :, None], axis=1), np.zeros((g, most)),
                             real.astype(np.int64), np.ones((g, most), dtype=np.int64)))
    else:
        rounds.append(Rounds(counts * 1.0, np.where(real, 1.0, 0.0), real.astype(np.int64),
                             np.ones((g, most), dtype=np.int64)))
    rounds.append(Rounds.one(fold, 0.0, folded))
    return rounds


def _lockstep(lay: BlockLayout, sel: np.ndarray) -> tuple[Rounds, Rounds]:
    """``fastlines._lockstep`` for the shapes ``sel`` (unequal units below the top): reduce and broadcast."""
    g, levels = lay.g, lay.levels
    gids, sizes, rings, edges = [], [], [], []
    for top in np.unique(lay.top[sel]).tolist():
        u = lay.units[top - 1]
        m = (sel & (lay.top == top))[u.gid]
        gid, a, b = u.gid[m], u.a[m], u.b[m]
        ring_on = np.zeros((len(a), levels), dtype=bool)
        edge = np.zeros((len(a), levels), dtype=np.int64)
        below, parts = np.ones(len(a), dtype=np.int64), b - a + 1
        for lv in range(top):          # a group's units of every level start at its first rank
            w = lay.units[lv]
            if lv == top - 1:          # the groups are these units themselves
                first, inside = np.flatnonzero(m), np.ones(len(a), dtype=np.int64)
            else:
                first = np.searchsorted(w.keys, gid * lay.width + a)
                inside = np.searchsorted(w.keys, gid * lay.width + b, side="right") - first
            ring_on[:, lv] = parts > inside
            size = w.b[first] - a + 1
            edge[:, lv] = size - below
            below, parts = size, inside
        gids.append(gid)
        sizes.append(b - a + 1)
        rings.append(ring_on)
        edges.append(edge)
    gid, size = np.concatenate(gids), np.concatenate(sizes)
    ring_on, edge = np.concatenate(rings), np.concatenate(edges)
    keep = size >= 2
    gid, size, ring_on, edge = gid[keep], size[keep], ring_on[keep], edge[keep]
    order = np.argsort(gid * (int(size.max(initial=0)) + 1) + size, kind="stable")
    gid, size, ring_on, edge = gid[order], size[order], ring_on[order], edge[order]
    cut = np.flatnonzero((gid[1:] != gid[:-1]) | (size[1:] != size[:-1])) + 1
    seg = np.concatenate([[0], cut]) if len(gid) else np.zeros(0, dtype=np.int64)
    kinds = np.concatenate([size[seg, None],
                            np.maximum.reduceat(ring_on.astype(np.int64), seg, axis=0) if len(seg) else
                            np.zeros((0, levels), dtype=np.int64),
                            np.maximum.reduceat(edge, seg, axis=0) if len(seg) else
                            np.zeros((0, levels), dtype=np.int64)], axis=1)
    kgid = gid[seg]
    per = np.bincount(kgid, minlength=g)
    rank = np.arange(len(kgid)) - np.repeat(np.cumsum(per) - per, per)
    table = np.zeros((g, int(per.max(initial=0)), 1 + 2 * levels), dtype=np.int64)
    table[kgid, rank] = kinds
    which = np.flatnonzero(sel)
    distinct, inverse = np.unique(table[which].reshape(len(which), -1), axis=0, return_inverse=True)
    merged = [_merged(_kinds(row.reshape(-1, 1 + 2 * levels), levels)) for row in distinct]
    return (_placed([m[0] for m in merged], inverse.reshape(-1), which, g, levels),
            _placed([m[1] for m in merged], inverse.reshape(-1), which, g, levels))


def _kinds(rows: np.ndarray, levels: int) -> tuple:
    """``_merged``'s key from one shape's (size, ring on per level, most gather messages per level) rows."""
    out = []
    for row in rows:
        s = int(row[0])
        if s < 2:
            continue
        ring = np.where(row[1:1 + levels] > 0, 1.0 / s, 0.0).tolist()
        most = row[1 + levels:]
        out.append((s, tuple(ring), tuple(np.where(most > 0, _sum(1.0 / s, most), 0.0).tolist())))
    return tuple(out)


def _placed(distinct: list, inverse: np.ndarray, which: np.ndarray, g: int, levels: int) -> Rounds:
    """Each distinct shape's merged rounds, padded to one width, given to the shapes ``which``."""
    width = max((len(r) for r in distinct), default=0)
    loads = np.zeros((len(distinct), width, levels))
    reduce = np.zeros((len(distinct), width))
    repeat = np.zeros((len(distinct), width), dtype=np.int64)
    for d, rounds in enumerate(distinct):
        for k, r in enumerate(rounds):
            loads[d, k], reduce[d, k], repeat[d, k] = r.loads, r.reduce, r.repeat
    out = Rounds(np.zeros((g, width, levels)), np.zeros((g, width)), np.zeros((g, width), dtype=np.int64),
                 np.ones((g, width), dtype=np.int64))
    out.loads[which], out.reduce[which], out.repeat[which] = loads[inverse], reduce[inverse], repeat[inverse]
    return out


def _first_of(lay: BlockLayout, level: np.ndarray, values: list[np.ndarray]) -> np.ndarray:
    """Per shape, ``values[level[g]][g]`` (``values``: one [G] array per level)."""
    return np.take_along_axis(np.stack(values, axis=1), level[:, None], axis=1)[:, 0]


def _hierarchical(lay: BlockLayout, m: np.ndarray, equal: np.ndarray, g0: np.ndarray) -> list[Rounds]:
    """``fastlines._hierarchical`` per shape: one ring (one unit), rings in and across equal units, or
    the lock-stepped reduce / leaders' ring / broadcast; slots in that order, each shape using its own."""
    n, live = lay.n, lay.n > 1
    flat, eq = live & (m <= 1), live & (m >= 2) & equal
    uneq = live & (m >= 2) & ~equal
    c = np.where(flat, n, g0)
    inner = _rows(lay, c, 1.0 / c, flat | eq)
    parts = [inner[0], *_columns(lay, g0, 1.0 / n, eq), inner[1]]
    if uneq.any():
        reduce, broadcast = _lockstep(lay, uneq)
        leaders = np.zeros((lay.g, lay.levels))           # one leader per unit: one message a link, all at top
        leaders[np.arange(lay.g), lay.top] = np.where(uneq, 1.0 / m, 0.0)
        repeat = np.where(uneq, m - 1, 0)
        parts += [reduce, Rounds.one(leaders, np.where(uneq, 1.0 / m, 0.0), repeat), Rounds.one(leaders, 0.0, repeat),
                  broadcast]
    return parts


@functools.lru_cache(maxsize=1 << 16)
def _torus_cols(n: int, inner: int) -> int:
    return co.torus_shape(n, inner)[1] if n else 0


def _aggregator(lay: BlockLayout, dedicated: bool, below_max: np.ndarray) -> list[Rounds]:
    """``fastlines._aggregator`` per shape (``below_max``: the largest unit below the top)."""
    live = lay.n > 1
    if dedicated:             # every message at the top level: each unit below it sends and receives its own
        loads = np.zeros((lay.g, lay.levels))
        loads[np.arange(lay.g), lay.top] = np.where(lay.top > 0, below_max, 1.0)
    else:                     # the root's link of each level carries every member that first joins it there
        sizes = lay.first_sizes()
        loads = np.diff(np.concatenate([np.ones((lay.g, 1), dtype=np.int64), sizes], axis=1), axis=1).astype(float)
    loads[~live] = 0.0
    return [Rounds.one(loads, np.where(live, (lay.n - 1).astype(float), 0.0), live, 2)]


def block_rounds(lay: BlockLayout, algorithms: Sequence[str], dedicated: bool) -> list[tuple[str, Rounds]]:
    """Every variant of ``algorithms`` (butterfly: doubling, then halving) on every shape of ``lay``."""
    n, top = lay.n, lay.top
    below = np.maximum(top - 1, 0)
    sized = [u.b - u.a + 1 for u in lay.units]
    m = np.where(top > 0, _first_of(lay, below, [u.count for u in lay.units]), 1)
    most = _first_of(lay, below, [u.per_group_max(s) for u, s in zip(lay.units, sized, strict=True)])
    least = _first_of(lay, below, [np.minimum.reduceat(s, u.first) for u, s in zip(lay.units, sized, strict=True)])
    equal = (top == 0) | (most == least)
    g0 = np.where(top > 0, _first_of(lay, below, [s[u.first] for u, s in zip(lay.units, sized, strict=True)]), n)
    p = np.array([1 << (int(x).bit_length() - 1) for x in n.tolist()], dtype=np.int64)
    e, log_p = n - p, np.array([int(x).bit_length() - 1 for x in p.tolist()], dtype=np.int64)
    built: dict[tuple[str, bool], Rounds] = {}
    counts: list[np.ndarray] = []
    out = []
    for a in algorithms:
        for halving in ((False, True) if a == "butterfly" else (False,)):
            kind = ("ring" if a == "native" else a, halving)
            if kind not in built:
                if kind[0] == "ring":
                    parts = _rows(lay, n, 1.0 / n, n > 1)
                elif kind[0] == "butterfly":
                    if not counts:
                        counts.append(_exchange_counts(lay, e, log_p))
                    parts = _butterfly(lay, halving, counts[0], e, log_p)
                elif kind[0] == "hierarchical":
                    parts = _hierarchical(lay, m, equal, g0)
                elif kind[0] == "torus2d":
                    cols = np.array([_torus_cols(int(a), int(b)) for a, b in
                                     zip(n.tolist(), np.where(equal, g0, 1).tolist(), strict=True)], dtype=np.int64)
                    row = _rows(lay, cols, 1.0 / np.maximum(cols, 1), n > 1)
                    parts = [row[0], *_columns(lay, cols, 1.0 / n, n > 1), row[1]]
                elif kind[0] == "aggregator":
                    parts = _aggregator(lay, dedicated, most)
                else:
                    raise ValueError(f"unknown all-reduce algorithm {a!r}")
                built[kind] = Rounds.concat(parts)
            out.append((a, built[kind]))
    return out


def block_lines(model: CostModel, copies: int, stride: int, offsets: np.ndarray, sizes: np.ndarray,
                algorithms: Sequence[str]) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(variant names, alpha_s [G, V], s_per_byte [G, V]): ``CostModel.fast_lines`` of every block shape
    (``copies`` blocks of ``sizes[g]`` ranks at ``c * stride + offsets[g]``), bit for bit."""
    lay = BlockLayout(model.cluster, copies, stride, offsets, sizes)
    names, alphas, per_bytes = [], [], []
    zero = np.zeros((lay.g, 1))
    sizes_n = lay.n.tolist()
    for algo, r in block_rounds(lay, algorithms, model.aggregator_dedicated):
        # [G, 1, levels]: each shape's fits for its group size (Calibration.group_fits; the same for all without)
        by_n = {k: model._fits(algo, k) for k in set(sizes_n)}
        alpha_l = np.array([[f.alpha_s for f in by_n[k]] for k in sizes_n]).reshape(lay.g, 1, -1)
        beta_l = np.array([[f.beta_s_per_byte for f in by_n[k]] for k in sizes_n]).reshape(lay.g, 1, -1)
        present = r.loads > 0
        some = present.any(axis=2)
        a = np.where(some, np.where(present, alpha_l, -np.inf).max(axis=2, initial=-np.inf), 0.0)
        b = np.where(some, np.where(present, r.loads * beta_l, -np.inf).max(axis=2, initial=-np.inf), 0.0)
        # rounds in order, each shape's missing ones repeat 0 times and add exactly 0.0 (CostModel.fast_lines)
        alphas.append(np.cumsum(np.concatenate([zero, r.repeat * (a * r.steps)], axis=1), axis=1)[:, -1])
        per_bytes.append(np.cumsum(np.concatenate([zero, r.repeat * (b + r.reduce * model.gamma)], axis=1),
                                   axis=1)[:, -1])
        names.append(algo)
    shape = (lay.g, len(names))
    alpha = np.stack(alphas, axis=1) if names else np.zeros(shape)
    per_byte = np.stack(per_bytes, axis=1) if names else np.zeros(shape)
    return names, alpha * model.overlap_slowdown, per_byte * model.overlap_slowdown
