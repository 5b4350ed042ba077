"""Where a block of copy ranks sits in the cluster, for many candidate blocks at once: table look-ups.

``StageTerms`` asks, for every candidate stage, the level two ranks share (``level_between``) and the
busiest link's share of a block's traffic (``busiest_share``, ``transfers.busiest_share``). Both
depend on a rank only through its place in the cluster's *period* (the span of the level below the
outermost one: every unit below the outermost level repeats with it) and on the block's length, so
they are tabulated once per copy count and read with one fancy index instead of integer divisions
over [candidate, level] arrays. The tables are built with the same operations as the direct forms
(kept for clusters whose tables would be too big), so the values are the same bit for bit.
"""

from __future__ import annotations

import numpy as np

TABLE_ENTRIES = 1 << 22          # entries of one table at most (else computed per candidate)


def level_of(spans: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Innermost level whose units (``spans[k]`` ranks each) hold both ranks, elementwise."""
    same = (a[..., None] // spans) == (b[..., None] // spans)
    return np.argmax(same, axis=-1)


def busiest_share_of(spans: np.ndarray, copies: int, x: np.ndarray, y: np.ndarray, level: np.ndarray
                     ) -> np.ndarray:
    """transfers.busiest_share of the blocks x..y-1 (in ``copies`` copies) behind one link of ``level``."""
    b = y - x
    s = np.concatenate([[1], spans])[level]              # ranks behind one link of the level
    first, last = x // s, (y - 1) // s
    head = np.minimum((first + 1) * s, y) - x
    tail = y - last * s
    most = np.where(first == last, b, np.maximum(np.maximum(head, tail), np.where(last - first >= 2, s, 0)))
    most = np.where(level == 0, 1, most)
    return most / (b * copies)


class BlockTables:
    """``level_between`` and ``busiest_share`` for blocks of one copy count (``copies`` x ``wc`` ranks)."""

    def __init__(self, spans: np.ndarray, period: int, copies: int, wc: int):
        self.spans, self.period, self.copies, self.wc = spans, period, copies, wc
        self._levels: np.ndarray | None = None          # [rank within the period, distance], flat
        self._shares: np.ndarray | None = None          # [level, x within the period, y - x], flat

    def level_between(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Innermost level whose units hold both ranks (elementwise; ``a <= b``)."""
        width = self.copies * self.wc
        if self._levels is None and self.period * width <= TABLE_ENTRIES:
            o = np.arange(self.period)[:, None]                 # flat: one 1-d gather per look-up
            self._levels = level_of(self.spans, o, o + np.arange(width)[None, :]).astype(np.int64).ravel()
        if self._levels is None:
            return level_of(self.spans, a, b)
        return self._levels[(a % self.period) * width + (b - a)]

    def busiest_share(self, x: np.ndarray, y: np.ndarray, level: np.ndarray) -> np.ndarray:
        """:func:`busiest_share_of` of the blocks x..y-1 (``x < y <= wc``)."""
        levels = len(self.spans)
        if self._shares is None and levels * self.period * (self.wc + 1) <= TABLE_ENTRIES:
            lv, o, b = np.broadcast_arrays(*np.ix_(np.arange(levels), np.arange(self.period),
                                                   np.arange(1, self.wc + 1)))
            shares = np.zeros((levels, self.period, self.wc + 1))
            shares[:, :, 1:] = busiest_share_of(self.spans, self.copies, o, o + b, lv)
            self._shares = shares.ravel()
        if self._shares is None:
            return busiest_share_of(self.spans, self.copies, x, y, level)
        return self._shares[(level * self.period + x % self.period) * (self.wc + 1) + (y - x)]


def grouped(keys: np.ndarray) -> list[tuple[int, np.ndarray]]:
    """(key, the indices holding it) for each distinct key, in increasing order (one sort, not a scan per key)."""
    order = np.argsort(keys, kind="stable")
    ordered = keys[order]
    cut = np.flatnonzero(ordered[1:] != ordered[:-1]) + 1
    return [(int(keys[k[0]]), k) for k in np.split(order, cut)] if len(keys) else []
