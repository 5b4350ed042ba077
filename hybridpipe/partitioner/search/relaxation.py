"""Necessary conditions for a plan whose every stage term is at most U, cheap enough to compute for all stages.

``dp.py`` searches only the (nodes, ranks) states and stages these conditions leave; they are
relaxations, never heuristics, so the search stays exact.

* ``min_block``: for every stage ``i..j`` the fewest ranks per copy ``b`` it can have with a term
  <= U. A term is at least ``base + kk (F + B) + optimizer + k * interference * p2p`` (the compute
  and overhead parts that do not depend on where the ranks sit; with the replicas' stretch ``rho`` below 1
  somewhere, ``F + B`` at its least ``rho`` and the trip less ``F + B``), with ``k = ceil(M / (b R))``
  falling as b grows, so the bound gives a largest k and hence a smallest b; it is at least the
  transfer with the cheapest link's alpha and beta and the smallest possible link share (1/r); and
  the stage must fit in memory with one micro-batch in flight and end at a free cut (sharded: with
  the least memory any allowed shard level has on every worker, ``sharding.least_static_bytes``).
  ``max_block``: at most ``min(W / R, M / R)`` ranks (every replica needs a micro-batch).
* ``windows``: a state (p nodes placed on the copy's first y ranks) can lie on such a plan only if
  y is at least the fewest ranks any relaxed plan of nodes ``0..p-1`` needs, leaves at least the
  fewest the rest needs, and is at most the most either can use.
* ``lower_bound``: the smallest U for which the relaxation has a plan at all (bisection; the
  relaxation only loosens as U grows): no plan of this copy count is better.

Every comparison carries a relative slack (``SAFETY``) so that rounding never excludes a stage the
exact terms of ``stageterms.py`` would accept.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from hybridpipe.partitioner.search.lanes import SAFETY
from hybridpipe.partitioner.search.options import OPTIMIZER_STATES
from hybridpipe.partitioner.search.sharding import least_static_bytes
from hybridpipe.partitioner.search.stageterms import StageTerms


def max_block(t: StageTerms) -> int:
    """Most ranks per copy one stage may have."""
    return min(t.wc, t.opts.micro_batches // t.copies)


class _Tables:
    """The parts of ``min_block`` that depend neither on the limit nor on the copy count (shared by all)."""

    def __init__(self, t: StageTerms):
        opts, n, m_b = t.opts, t.n, t.opts.micro_batches
        fb = (t.pf[None, 1:] - t.pf[:-1, None]) + (t.pb[None, 1:] - t.pb[:-1, None])
        floor = min([1.0, *(f for _, f in t.rho_points)])    # the replicas' least stretch (computeterms.py)
        opt_ms = t.po[None, 1:] - t.po[:-1, None]
        p2p = t.interference * 1e3 * (t.p2p_in[:, None] + t.p2p_out[None, :])
        if t.sharding and t.copies * t.wc > 1:          # a sharded stage steps 1/r of its weights
            opt_ms = opt_ms / (t.copies * t.wc)
        if floor < 1:             # rho (F + B) >= floor fb, and the stretch of its trip share >= (floor - 1) fb
            fb_k = fb * floor
        else:                     # rho >= 1 (or none): the terms only add (and accumulation always does)
            fb_k = fb
        if t.flushed:                                   # trip + (k-1) fb + opt + k p2p <= u
            per_k, self.fixed = fb_k + p2p, t.trip + opt_ms - fb
        else:                                           # k (fb + opt + p2p) <= u
            per_k, self.fixed = fb_k + opt_ms + p2p, np.zeros((n, n))
        self.free = np.nonzero(per_k <= 0)                # the term does not grow with k there
        with np.errstate(divide="ignore"):
            self.inv = np.where(per_k > 0, (1 + SAFETY) / per_k, 0.0)
        weights = t.weights
        stash = t.stash
        if t.sharding:                                  # the least any allowed shard level needs, on every worker
            least = least_static_bytes(opts.shard, weights, t.copies * t.wc, OPTIMIZER_STATES[opts.optimizer],
                                       *t.units)
        else:
            least = weights * (2 + OPTIMIZER_STATES[opts.optimizer])
        room = opts.memory_bytes * (1 + SAFETY) + SAFETY - least
        self.ok = np.triu(np.ones((n, n), dtype=bool)) & t.cut_ok[None, :] & ~(room < stash)
        self.kcap = np.full((n, n), float(m_b))
        if opts.schedule.forwards_first and opts.recompute == "none":     # all k micro-batches' activations held
            with np.errstate(divide="ignore", invalid="ignore"):
                self.kcap = np.minimum(self.kcap, np.where(stash > 0, np.floor(room / stash * (1 + SAFETY)), m_b))
        self.kcap = np.nan_to_num(self.kcap, nan=0.0)
        alpha, beta = float(t.alpha.min()), float(t.beta.min())
        self.sides = [(m_b * 1e3 * alpha * has * (1 - SAFETY), m_b * 1e3 * nbytes * beta * (1 - SAFETY))
                      for has, nbytes in ((t.has_in, np.maximum(t.g_out, t.a_in)),
                                          (t.has_out, np.maximum(t.a_out, t.g_in)))]
        self.last: tuple[float, np.ndarray] | None = None

    def replicas(self, u: float, m_b: int) -> np.ndarray:
        """[i, j]: fewest replicas (all copies) a stage needs for a term <= u (inf: impossible)."""
        if self.last is not None and self.last[0] == u:
            return self.last[1]
        with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
            kmax = np.floor((u - self.fixed) * self.inv)
            np.minimum(kmax, self.kcap, out=kmax)
            kmax[self.free] = np.where(self.fixed[self.free] <= u, self.kcap[self.free], 0.0)
            rmin = np.where(kmax >= 1, np.ceil(m_b / kmax), np.inf)
            need = [np.where(nbytes > 0, np.ceil(np.where(u > a, nbytes / (u - a), np.inf) - SAFETY),
                             np.where(u > a, 0.0, np.inf)) for a, nbytes in self.sides]   # M X <= u: replicas
            np.maximum(rmin, np.maximum.outer(need[0], need[1]), out=rmin)
        self.last = (u, rmin)
        return rmin


def _tables(t: StageTerms) -> _Tables:
    hit = t.shared.get("relaxation")
    if hit is None:
        hit = t.shared["relaxation"] = _Tables(t)
    return hit


def min_block(t: StageTerms, limit: float) -> np.ndarray:
    """[i, j]: fewest ranks per copy stage i..j needs for a term <= ``limit`` (inf: impossible)."""
    tab, n, m_b = _tables(t), t.n, t.opts.micro_batches
    u = limit * (1 + SAFETY) + SAFETY
    rmin = tab.replicas(u, m_b)
    bmin = np.maximum(np.ceil(rmin / t.copies - SAFETY), 1) if t.copies > 1 else np.maximum(rmin, 1)
    bmin = np.where(tab.ok & (bmin <= max_block(t)), bmin, np.inf)
    bmin[0, n - 1] = t.wc if t.whole_term() <= u and t.wc <= max_block(t) else np.inf   # its only block
    if t.kind.asynchronous:                        # r = b R must divide M
        allowed = np.array([b for b in range(1, max_block(t) + 1) if t.kind.replicas_ok(b * t.copies, m_b)]
                           + [np.inf])
        finite = np.isfinite(bmin)
        bmin[finite] = allowed[np.searchsorted(allowed, bmin[finite])]
    return bmin


def windows(t: StageTerms, bmin: np.ndarray, rounds: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(lo, hi) per node count p = 0..n: the copy ranks a state (p, y) of a plan can have (lo > hi: none)."""
    n, wc, most = t.n, t.wc, max_block(t)
    live = np.ones(n + 1, dtype=bool)
    lo = hi = np.zeros(n + 1)
    for _ in range(rounds):
        usable = np.isfinite(bmin) & live[:n, None] & live[None, 1:]
        lo_pre, hi_pre = _sweep(bmin, usable, most, wc)
        if not lo_pre[n] <= wc <= hi_pre[n]:              # no relaxed plan at all: skip the other half
            return lo_pre, np.minimum(hi_pre, -1)
        lo_suf, hi_suf = _sweep(bmin[::-1, ::-1].T, usable[::-1, ::-1].T, most, wc)
        lo = np.maximum(lo_pre, wc - hi_suf[::-1])
        hi = np.minimum(hi_pre, wc - lo_suf[::-1])
        now = lo <= hi
        if (now == live).all():
            break
        live = now
    return lo, hi


def _sweep(bmin: np.ndarray, usable: np.ndarray, most: int, wc: int, block: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Fewest and most ranks of relaxed plans of nodes 0..p-1 (inf / -inf: none).

    ``lo[p] = min over usable i < p of lo[i] + bmin[i, p-1]``, ``hi[p] = min(wc, max hi[i] + most)``:
    per block of targets, the sources before the block at once, the ones inside it one by one.
    When one stage may hold every rank (``most >= wc``), ``hi`` is ``wc`` wherever a plan exists.
    """
    n = bmin.shape[0]
    lo = np.full(n + 1, np.inf)
    hi = np.full(n + 1, -np.inf)
    lo[0] = hi[0] = 0
    cost = np.where(usable, bmin, np.inf)
    track_hi = most < wc
    for p0 in range(1, n + 1, block):
        p1 = min(p0 + block, n + 1)
        live = lo[:p0] <= hi[:p0]
        c = cost[:p0, p0 - 1:p1 - 1]
        c_lo = (np.where(live, lo[:p0], np.inf)[:, None] + c).min(axis=0).tolist()
        c_hi = (np.where(np.isfinite(c), np.where(live, hi[:p0], -np.inf)[:, None], -np.inf).max(axis=0).tolist()
                if track_hi else None)
        inner = cost[p0:p1 - 1, p0 - 1:p1 - 1].tolist()
        los: list[float] = []
        his: list[float] = []
        for k in range(p1 - p0):
            best_lo = c_lo[k]
            best_hi = c_hi[k] if c_hi is not None else -np.inf
            for i in range(k):                          # source p0 + i, target p0 + k
                w = inner[i][k]
                if w != np.inf and los[i] <= his[i]:
                    if los[i] + w < best_lo:
                        best_lo = los[i] + w
                    if his[i] > best_hi:
                        best_hi = his[i]
            los.append(best_lo)
            if not track_hi:
                his.append(wc if best_lo < np.inf else -np.inf)
            else:
                his.append(min(wc, best_hi + most) if best_hi > -np.inf else -np.inf)
        lo[p0:p1] = los
        hi[p0:p1] = his
    return lo, hi


def feasible(t: StageTerms, limit: float) -> bool:
    """Does the relaxation have a plan with every term <= ``limit``?"""
    bmin = min_block(t, limit)
    lo, hi = _sweep(bmin, np.isfinite(bmin), max_block(t), t.wc)
    return bool(lo[-1] <= t.wc <= hi[-1])


def lower_bound(t: StageTerms, ceiling: float, rel: float = 1e-4,
                on_lower: Callable[[float], None] | None = None) -> float:
    """Largest U found with no relaxed plan <= U (a lower bound of this copy count's optimum); inf if none at all.

    ``ceiling``: a value known to be enough (a feasible plan's objective), or inf to search upward.
    ``on_lower`` is told every bound proven on the way.
    """
    if not math.isfinite(ceiling):
        ceiling = max(t.trip, 1.0)
        while not feasible(t, ceiling):
            ceiling *= 4
            if ceiling > 1e18:
                return math.inf
    elif not feasible(t, ceiling):
        return math.inf
    lo, hi = 0.0, ceiling
    if feasible(t, lo):
        return 0.0
    while hi - lo > rel * hi:
        mid = (lo + hi) / 2
        if feasible(t, mid):
            hi = mid
        else:
            lo = mid
            if on_lower is not None:
                on_lower(lo)
    return lo
