"""Many DP block shapes at once as units of positions: ``fastlines._Layout`` batched over groups.

A block shape (``StageTerms.sync_ms``) is the group of ranks ``c * stride + offset .. c * stride +
offset + size - 1`` for every copy ``c < copies``; its position ``c * size + t`` is the ``t``-th rank
of copy ``c``. ``BlockLayout`` holds, for G shapes of one copy count and every cluster level, the
units each shape's sorted ranks fall into (first and last position, the shape they belong to),
computed from the blocks' ends instead of from every rank, so a shape of thousands of ranks costs
O(units). The units of one level are sorted by shape, then position, and every shape has at least
one unit at every level, so per-shape reductions are ``np.ufunc.reduceat`` over ``first``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from hybridpipe.partitioner.cost.cluster import Cluster


@dataclass(frozen=True)
class Units:
    """The units of one level over every shape (``a``/``b``: first/last position, ``gid``: its shape)."""

    gid: np.ndarray
    a: np.ndarray
    b: np.ndarray
    first: np.ndarray        # [G]: index of each shape's first unit
    count: np.ndarray        # [G]: units per shape
    keys: np.ndarray         # gid * (largest n + 1) + a: sorted, for searches across shapes

    def per_group_max(self, values: np.ndarray) -> np.ndarray:
        """The largest of ``values`` (last axis: one per unit) over each shape's units."""
        return np.maximum.reduceat(values, self.first, axis=-1)

    def within(self, sel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(which units belong to the shapes ``sel``, each selected shape's first among those units)."""
        per = self.count[sel]
        return sel[self.gid], np.cumsum(per) - per


class BlockLayout:
    """G block shapes of ``copies`` blocks (copy stride ``stride``) as units of every level."""

    def __init__(self, cluster: Cluster, copies: int, stride: int, offsets: np.ndarray, sizes: np.ndarray):
        offsets = np.asarray(offsets, dtype=np.int64)
        sizes = np.asarray(sizes, dtype=np.int64)
        self.g = g = len(sizes)
        self.n = n = copies * sizes
        self.levels = levels = len(cluster.levels)
        self.width = int(n.max(initial=0)) + 1
        lo = np.arange(copies, dtype=np.int64)[None, :] * stride + offsets[:, None]      # [G, R] first rank
        base = np.arange(copies, dtype=np.int64)[None, :] * sizes[:, None]               # its position
        hi = lo + sizes[:, None] - 1
        self.units: list[Units] = []
        for k in range(levels):
            span = cluster.span(k)
            first, last = lo // span, hi // span
            flag = np.ones((g, copies), dtype=np.int64)       # a unit starts at the copy's first position
            flag[:, 1:] = first[:, 1:] != last[:, :-1]
            count = flag + (last - first)
            row = np.repeat(np.arange(g * copies), count.ravel())
            t = np.arange(len(row)) - np.repeat(np.cumsum(count.ravel()) - count.ravel(), count.ravel())
            f = flag.ravel()[row]
            pos = base.ravel()[row] + np.where(t < f, 0, (first.ravel()[row] + 1 + t - f) * span - lo.ravel()[row])
            gid = row // copies
            per = count.sum(axis=1)
            start = np.cumsum(per) - per
            b = np.empty_like(pos)
            b[:-1] = pos[1:] - 1
            b[start + per - 1] = n - 1                         # a shape's last unit ends at its last position
            self.units.append(Units(gid, pos, b, start, per, gid * self.width + pos))
        # the level of the whole shape: the levels below it cut it into several units (they nest)
        self.top: np.ndarray = np.zeros(g, dtype=np.int64)
        for u in self.units[:-1]:
            self.top += u.count > 1
        self.max_top = int(self.top.max(initial=0))
        self._parents: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}

    def parents(self, level: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(a, b, wa, wb): each unit V = [a, b] of ``level - 1`` and its unit W = [wa, wb] of ``level``."""
        hit = self._parents.get(level)
        if hit is None:
            v, w = self.units[level - 1], self.units[level]
            up = np.searchsorted(w.keys, v.keys, side="right") - 1
            hit = self._parents[level] = (v.a, v.b, w.a[up], w.b[up])
        return hit

    def first_sizes(self) -> np.ndarray:
        """[G, level]: the size of each shape's first unit of every level."""
        return np.stack([u.b[u.first] + 1 for u in self.units], axis=1)


def sums(part: np.ndarray, count: np.ndarray) -> np.ndarray:
    """``part`` added ``count`` times one at a time from 0.0, elementwise (``fastlines._sum`` batched)."""
    part, count = np.broadcast_arrays(np.asarray(part, dtype=float), np.asarray(count, dtype=np.int64))
    total = np.zeros(part.shape)
    for t in range(1, int(count.max(initial=0)) + 1):
        total = np.where(count >= t, total + part, total)
    return total
