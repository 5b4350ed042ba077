"""The recurrence of ``dp.py`` over the states and stages the relaxation leaves, exactly as the exhaustive one.

State (p, y): nodes ``0..p-1`` on the copy's ranks ``0..y-1``. ``A[p, y]`` is the best objective of
such a prefix: the largest stage term (``total=False``) or, among prefixes whose every term is within
the bound, the smallest sum of terms (``total=True``). Stages are taken from every start node i in
turn (all A[i, .] are final by then); a candidate for ``A[j+1, y]`` replaces the current one when it
is smaller, or equal with a smaller x (the exhaustive solver's order: the first block x, then the
first start node i, reaching the minimum). Only states inside ``relaxation.windows`` and stages no
smaller than ``relaxation.min_block`` are visited: the plans left out all have a term above the bound.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hybridpipe.limits import check_deadline
from hybridpipe.partitioner.search.objective import StageSpec
from hybridpipe.partitioner.search.relaxation import max_block
from hybridpipe.partitioner.search.stageterms import Candidates, StageTerms


@dataclass(frozen=True)
class RegionResult:
    """What :func:`solve_region` found: the best plan's value and stages, and how many candidates it priced."""

    value: float                     # objective (or sum of terms) of the best plan; inf: none within the bound
    stages: tuple[StageSpec, ...]
    candidates: int                  # stage terms evaluated


def candidates(i: int, xs: np.ndarray, bmin_row: np.ndarray, lo: np.ndarray, hi: np.ndarray,
               most: int) -> Candidates:
    """Every stage i..j on copy ranks x..y-1 with x in ``xs`` and (j+1, y) inside the windows."""
    n = len(bmin_row)
    js = np.arange(i, n)
    js = js[np.isfinite(bmin_row[i:]) & (lo[i + 1:] <= hi[i + 1:])]
    if js.size == 0 or xs.size == 0:
        empty = np.zeros(0, dtype=np.int64)
        return Candidates(i, empty, empty, empty)
    jj = np.repeat(js, xs.size)
    xx = np.tile(xs, js.size)
    ylo = np.maximum(lo[jj + 1], xx + bmin_row[jj]).astype(np.int64)
    yhi = np.minimum(hi[jj + 1], xx + most).astype(np.int64)
    count = np.maximum(yhi - ylo + 1, 0)
    total = int(count.sum())
    pick = np.repeat(np.arange(jj.size), count)
    start = np.repeat(np.cumsum(count) - count, count)
    y = ylo[pick] + (np.arange(total) - start)
    return Candidates(i, jj[pick], xx[pick], y)


def solve_region(t: StageTerms, bmin: np.ndarray, lo: np.ndarray, hi: np.ndarray, bound: float, *,
                 total: bool = False, keep_below: float = math.inf, deadline: float | None = None,
                 tick: Callable[[], None] | None = None) -> RegionResult:
    """The best plan of this copy count inside the region (see the module docstring).

    ``total=False``: the smallest objective over the region's plans, within ``bound`` or not: exact
    (the optimum) when it is within ``bound``, else the objective of a real plan above it.
    ``total=True``: the smallest sum of terms among plans whose every term is within ``bound``.
    ``keep_below``: prefixes whose objective is above it are not extended (a plan worse than one
    already known is of no use; ``bound`` or more keeps the result exact).
    """
    n, wc = t.n, t.wc
    most = max_block(t)
    value = np.full((n + 1, wc + 1), np.inf)
    from_x = np.zeros((n + 1, wc + 1), dtype=np.int32)
    from_i = np.zeros((n + 1, wc + 1), dtype=np.int32)
    if not (lo[0] <= 0 <= hi[0] and lo[n] <= wc <= hi[n]):
        return RegionResult(math.inf, (), 0)
    value[0, 0] = 0.0
    seen = 0
    for i in range(n):
        if lo[i] > hi[i]:
            continue
        xs = np.arange(int(lo[i]), int(hi[i]) + 1)
        prefix = value[i, xs]
        xs = xs[np.isfinite(prefix) & (total or prefix <= keep_below)]
        c = candidates(i, xs, bmin[i], lo, hi, most)
        if c.j.size == 0:
            continue
        check_deadline(deadline)
        prefix, ceiling = value[i, c.x], value[c.j + 1, c.y]
        if total:                              # a term over the bound, or a sum over the target's: no use
            def useful(k, lower, prefix=prefix, ceiling=ceiling):
                return (lower <= bound) & (prefix[k] + lower <= ceiling[k])
        else:                                  # only values matter here: ties cannot change the objective
            def useful(k, lower, prefix=prefix, ceiling=ceiling):
                return (lower <= keep_below) & (np.maximum(prefix[k], lower) < ceiling[k])
        term = t.evaluate(c, useful)
        seen += c.j.size
        if total:
            val = value[i, c.x] + np.where(term <= bound, term, np.inf)
            keep = np.isfinite(val)
        else:
            val = np.maximum(value[i, c.x], term)
            keep = np.isfinite(val) & (val <= keep_below)
        if keep.any():
            _relax(value, from_x, from_i, i, c.j[keep] + 1, c.y[keep], c.x[keep], val[keep])
        if tick is not None:
            tick()
    best = float(value[n, wc])
    if not math.isfinite(best):
        return RegionResult(math.inf, (), seen)
    stages = []
    p, y = n, wc
    while p > 0:
        i, x = int(from_i[p, y]), int(from_x[p, y])
        stages.append(StageSpec(i, p - 1, tuple(c * wc + q for q in range(x, y) for c in range(t.copies))))
        p, y = i, x
    return RegionResult(best, tuple(reversed(stages)), seen)


def _relax(value: np.ndarray, from_x: np.ndarray, from_i: np.ndarray, i: int, p: np.ndarray, y: np.ndarray,
           x: np.ndarray, val: np.ndarray) -> None:
    """Write each target's best candidate (smallest value, then smallest x) where it beats the current one."""
    width = value.shape[1]
    key = p * width + y
    order = np.lexsort((x, val, key))
    key, x, val = key[order], x[order], val[order]
    first = np.ones(key.size, dtype=bool)
    first[1:] = key[1:] != key[:-1]
    key, x, val = key[first], x[first], val[first]
    flat_v, flat_x, flat_i = value.reshape(-1), from_x.reshape(-1), from_i.reshape(-1)
    old_v, old_x = flat_v[key], flat_x[key]
    better = (val < old_v) | ((val == old_v) & (x < old_x))
    key = key[better]
    flat_v[key] = val[better]
    flat_x[key] = x[better]
    flat_i[key] = i
