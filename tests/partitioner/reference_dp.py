"""Test reference: the exhaustive DP exactly as ``hybridpipe/partitioner/search/dp.py`` was before the
scalable solver (main at 887659e). The new solver must return the same optimum and the same
tie-broken plan (so the same predicted step) wherever this one finishes. Do not optimise it.

The optimal partition: PipeDream's recurrence, generalised, solved exactly over its search space.

Search space (a *layout*): R identical copies of one pipeline, copy c on the top-level units
``c*W/R .. (c+1)*W/R - 1`` (R divides the top level's fan-out; R = 1 is a single pipeline over
every worker). Inside a copy, stages are contiguous node ranges on contiguous blocks of
ranks, in stage order; a stage's replicas are its block in every copy. So the inner level is
solved first and its result (a pipeline on W/R workers) becomes the unit replicated at the
outer level, and blocks keep a stage's replicas together inside inner units where the block
allows. Every stage term of ``objective.py`` depends only on the stage's node range and its
block, so with ``A[p, y]`` = the best objective for nodes ``0..p-1`` on copy ranks ``0..y-1``::

    A[p, y] = min over i < p, x < y of max(A[i, x], term(nodes i..p-1, block x..y-1))

is exact (the brute-force tests enumerate every layout). Terms for all ranges ``(i, j)`` of a
block come at once as N x N numpy tables; the exposed-sync table uses the closed form of the
single-lane queue (``layersync.py``) with running maxima, and is shared by all blocks whose
ranks sit alike in the cluster. Cost: O(N^2 W^2) table operations for R = 1, less for R > 1.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from hybridpipe.partitioner.cost.calibration import LinkFit
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.search.modelcosts import ModelCosts
from hybridpipe.partitioner.search.objective import StageSpec, overhead_ms
from hybridpipe.partitioner.search.options import OPTIMIZER_STATES, Options
from hybridpipe.partitioner.search.transfers import busiest_share


@dataclass(frozen=True)
class Solution:
    stages: tuple[StageSpec, ...]
    objective_ms: float
    copies: int


def copy_counts(model: CostModel, workers: int) -> list[int]:
    """R values to try: 1, and every divisor of the top level's fan-out when there are >= 2 levels."""
    levels = model.cluster.levels
    if len(levels) < 2 or workers != model.cluster.total_workers:
        return [1]
    top = levels[-1].workers
    return [r for r in range(1, top + 1) if top % r == 0]


TIE = 1e-9          # relative slack when re-solving for plans that reach the optimal objective


def solve(costs: ModelCosts, model: CostModel, workers: int, opts: Options,
          upper_bound: float = math.inf) -> Solution:
    """The best layout over every copy count.

    ``upper_bound`` is the objective of any feasible plan (e.g. pure data parallelism): prefixes
    and stages costing more cannot be part of a better plan, so they are skipped; the result is
    still exact. Copy counts are solved from the cheapest (most copies) down, each result
    tightening the bound for the next. Many plans usually share the optimal bottleneck; a second
    pass picks, among them, the one with the smallest sum of stage terms (less work and traffic
    off the critical stage; ties to fewer copies).
    """
    found = []
    bound = upper_bound * (1 + TIE) + TIE         # the bound's own plan must survive rounding
    for copies in sorted(copy_counts(model, workers), reverse=True):
        solver = _Solver(costs, model, workers, copies, opts)
        found.append((solver, solver.run(bound).objective_ms))
        bound = min(bound, found[-1][1])
    optimum = min(value for _, value in found)
    if not math.isfinite(optimum):
        return Solution((), math.inf, 1)
    cap = optimum * (1 + TIE) + TIE
    tied = [solver.run(cap, total=True) for solver, value in found if value <= cap]
    best = min((s for s in tied if s.stages), key=lambda s: (s.objective_ms, s.copies))
    return Solution(best.stages, optimum, best.copies)


class _Solver:
    """One copy count: tables shared across blocks, then the recurrence over (nodes, ranks)."""

    def __init__(self, costs: ModelCosts, model: CostModel, workers: int, copies: int, opts: Options):
        self.costs, self.model, self.opts = costs, model, opts
        self.copies, self.wc = copies, workers // copies
        n = self.n = costs.n
        self.pf, self.pb = costs.prefix(costs.forward_ms), costs.prefix(costs.backward_ms)
        kind = self.kind = opts.schedule
        flushed, share = kind.flushed, kind.drain_backward_share
        self.trip = float(self.pf[-1] + share * self.pb[-1]) if flushed else 0.0   # fill + drain every stage waits
        self.gap = (self.pf[:-1] + self.pb[:-1]) if flushed else np.zeros(n)  # drain + fill before node i
        upper = np.triu(np.ones((n, n), dtype=bool))
        self.upper = upper
        fb = (self.pf[None, 1:] - self.pf[:-1, None]) + (self.pb[None, 1:] - self.pb[:-1, None])
        self.fb = np.where(upper, fb, np.inf)
        # a split schedule's trip leaves out the backwards (share 0) but the stage's own: added back
        own_back = (1 - share) * (self.pb[None, 1:] - self.pb[:-1, None]) if flushed and share < 1 else None
        self.own_back = None if own_back is None else np.where(upper, own_back, 0.0)
        self.fwd = np.where(upper, self.pf[None, 1:] - self.pf[:-1, None], 0.0)     # a recomputing stage's extra
        self.share = share
        pp = costs.prefix(costs.param_bytes)
        self.weights = pp[None, 1:] - pp[:-1, None]
        a_in = np.concatenate([[0.0], costs.cut_bytes[:-1]])
        self.stash, self.kept, self.rerun = costs.stash_table()
        self.a_in, self.g_out = a_in, np.concatenate([[0.0], costs.cut_grad_bytes[:-1]])
        self.a_out, self.g_in = costs.cut_bytes.copy(), costs.cut_grad_bytes.copy()
        self.a_out[-1] = self.g_in[-1] = 0.0
        self.has_in = (np.arange(n) > 0).astype(float)
        self.has_out = (np.arange(n) < n - 1).astype(float)
        self.param_nodes = costs.param_bytes > 0
        po = costs.prefix(costs.optimizer_ms(opts.optimizer))
        self.opt_ms = po[None, 1:] - po[:-1, None]
        self.p2p_in, self.p2p_out = (self.a_in + self.g_out) / 2, (self.a_out + self.g_in) / 2
        self._extra: dict[tuple[int, int], np.ndarray | None] = {}
        levels = model.cluster.levels
        # translating a block by this many ranks changes nothing about how it sits in the cluster
        self.period = model.cluster.span(len(levels) - 2) if len(levels) > 1 else 1
        self.most_weights = float(costs.param_bytes.sum())
        # the most one micro-batch can add to a stage, with or without recomputation
        self.most_stash = float(np.maximum(self.stash, self.kept + self.rerun).max(initial=0.0))
        self.transient = costs.transient_table()
        self.most_transient = float(self.transient.max(initial=0.0))
        self._exposure: dict[object, np.ndarray] = {}
        self._blocks: dict[tuple, _Block] = {}

    # ---- the recurrence ------------------------------------------------------------------
    def run(self, bound: float = math.inf, total: bool = False) -> Solution:
        """The recurrence; exact for results <= ``bound``.

        ``total=False``: the objective (largest stage term); prefixes above ``bound`` are never
        extended. ``total=True``: the smallest sum of stage terms among plans whose every term is
        within ``bound``; the Solution's objective is then that sum.
        """
        n, wc = self.n, self.wc
        best = np.full((n + 1, wc + 1), np.inf)
        best[0, 0] = 0.0
        from_i = np.zeros((n + 1, wc + 1), dtype=np.int64)
        from_x = np.zeros((n + 1, wc + 1), dtype=np.int64)
        for y in range(1, wc + 1):
            for x in range(y):
                found = self.relax(best, x, y, bound, total)
                if found is None:
                    continue
                cols, rows, val = found
                better = val < best[cols + 1, y]
                best[cols[better] + 1, y] = val[better]
                from_i[cols[better] + 1, y] = rows[better]
                from_x[cols[better] + 1, y] = x
        if not (np.isfinite(best[n, wc]) if total else best[n, wc] <= bound):
            return Solution((), math.inf, self.copies)
        stages = []
        p, y = n, wc
        while p > 0:
            i, x = int(from_i[p, y]), int(from_x[p, y])
            stages.append(StageSpec(i, p - 1, self.ranks(x, y)))
            p, y = i, x
        return Solution(tuple(reversed(stages)), float(best[n, wc]), self.copies)

    def ranks(self, x: int, y: int) -> tuple[int, ...]:
        """Global ranks of block x..y-1 in every copy, replica-major (micro-batch m stays in copy m % R)."""
        return tuple(c * self.wc + q for q in range(x, y) for c in range(self.copies))

    # ---- one block: every (start, end) at once -----------------------------------------------
    def relax(self, best: np.ndarray, x: int, y: int, bound: float, total: bool = False):
        """Candidates for best[j+1, y] with the last stage on block x..y-1: (cols, argmin rows, values).

        Combines a prefix and the last stage's term by max (or sum when ``total``, with terms over
        ``bound`` excluded). Only starts whose prefix is within ``bound``, ends whose compute
        alone stays within it, and (before the exposed-sync table is looked up) ends where the
        rest of the term could still beat the current best are considered; all pruning is by
        lower bounds, so nothing optimal is lost.
        """
        opts, n = self.opts, self.n
        combine = np.add if total else np.maximum
        keep = np.isfinite(best[:n, x]) if total else best[:n, x] <= bound
        live = np.nonzero(keep)[0]
        if live.size == 0:
            return None
        blk = self.block(x, y)
        r = blk.replicas
        if not opts.replicas_ok(r):
            return None
        k = -(-opts.micro_batches // r)
        kk, base = (k, 0.0) if self.kind.asynchronous else (k - 1, self.trip)
        first, last = int(live[0]), int(live[-1])
        reach = np.nonzero(base + _times(kk, self.fb[last]) <= bound)[0]   # busy >= base + kk (F+B), grows in j
        end = max(int(reach[-1]) if reach.size else last, last)
        rows, cols = slice(first, last + 1), slice(first, end + 1)      # contiguous: views, not copies
        prev = np.where(keep[rows], best[rows, x], np.inf)[:, None]
        fb, rc = self.fb[rows, cols], None
        inflight = self.inflight(x, r, k)
        if opts.recompute == "all":
            rc = np.ones(fb.shape, dtype=bool)
        if (self.static_factor(inflight) * self.most_weights + self.most_stash * inflight + self.most_transient
                > opts.memory_bytes):
            weights = self.weights[rows, cols] * self.static_factor(inflight)
            kept = self.kept[rows, cols]
            transient = self.transient[rows, cols]
            fits_rc = weights + kept * inflight + self.rerun[rows, cols] + transient <= opts.memory_bytes
            fits = weights + self.stash[rows, cols] * inflight + transient <= opts.memory_bytes
            if opts.recompute == "all":
                ok = fits_rc
            elif opts.recompute == "auto":          # recompute only where keeping everything does not fit
                rc, ok = ~fits, fits | fits_rc
            else:
                ok = fits
            fb = np.where(ok, fb, np.inf)
        if rc is not None:                                  # recomputation reruns the forward in backward
            fb = fb + np.where(rc, self.fwd[rows, cols], 0.0)
        xfer = opts.micro_batches * self.transfer_table(blk, rows, cols)
        extra = self.extra_table(r, k)
        work = base + _times(kk, fb)
        if self.own_back is not None:
            work = work + self.own_back[rows, cols]
            if rc is not None:
                work = work + (1 - self.share) * np.where(rc, self.fwd[rows, cols], 0.0)
        if extra is not None:
            extra = extra[rows, cols]
            work = work + extra
        lower = np.maximum(work, xfer)
        table = combine(prev, np.where(lower <= bound, lower, np.inf) if total else lower)
        if r > 1 and self.param_nodes[first:end + 1].any():
            if not (table.min(axis=0) < best[first + 1:end + 2, y]).any():   # the sync only adds
                return None
            exposed = self.exposure_table(blk)[rows, cols]
            if self.kind.asynchronous:
                busy = k * (fb + exposed) + (0.0 if extra is None else extra)
            else:                                                          # the sync may also hide in the gap
                busy = work + np.maximum(0.0, exposed - self.gap[rows, None])
            term = np.maximum(busy, xfer)
            table = combine(prev, np.where(term <= bound, term, np.inf) if total else term)
        arg = table.argmin(axis=0)
        return np.arange(first, end + 1), arg + first, table[arg, np.arange(end + 1 - first)]

    def extra_table(self, r: int, k: int) -> np.ndarray | None:
        """overhead_ms(i, j) for every stage i..j with r replicas of k micro-batches each; None when all 0."""
        key = (r, k)
        if key not in self._extra:
            table = overhead_ms(self.opt_ms, self.weights, self.p2p_in[:, None] + self.p2p_out[None, :], r, k,
                                self.kind.syncs_per_step(k), self.model.interference_s_per_byte)
            self._extra[key] = table if np.any(table[self.upper]) else None
        return self._extra[key]

    def inflight(self, x: int, r: int, k: int) -> int:
        """Micro-batches a replica of a block starting at x (r ranks in all copies) holds at once."""
        depth = -(-self.copies * (self.wc - x) // r)
        return self.kind.inflight(k, depth, -(-self.copies * self.wc // r))

    def static_factor(self, inflight: int) -> int:
        """Copies of the weights a worker keeps: weights, gradients, optimizer state, stashed versions."""
        versions = self.kind.weight_versions(inflight)
        return 2 + OPTIMIZER_STATES[self.opts.optimizer] + versions

    def block(self, x: int, y: int) -> _Block:
        """Where block x..y-1 sits: its ranks, transfer levels and link shares (cached by shape)."""
        key = (x % self.period, y - x, x == 0, y == self.wc)
        hit = self._blocks.get(key)
        if hit is None:
            model = self.model
            ranks = self.ranks(x, y)
            span = model.level_between(x, y - 1)                     # copy 0 holds ranks x..y-1
            lv_in = max(span, model.level_between(x - 1, x)) if x > 0 else span
            lv_out = max(span, model.level_between(y - 1, y)) if y < self.wc else span
            hit = self._blocks[key] = _Block(ranks, (x % self.period, y - x), model.link(lv_in), model.link(lv_out),
                                             busiest_share(model, ranks, lv_in), busiest_share(model, ranks, lv_out),
                                             lv_in == lv_out)
        return hit

    def transfer_table(self, blk: _Block, rows: slice, cols: slice) -> np.ndarray:
        """X(i, j) in ms: the stage's activation traffic per micro-batch (transfers.transfer_ms)."""
        f_in, f_out, s_in, s_out = blk.fit_in, blk.fit_out, blk.share_in, blk.share_out
        a_in, g_out, has_in = self.a_in[rows], self.g_out[rows], self.has_in[rows]
        a_out, g_in, has_out = self.a_out[cols], self.g_in[cols], self.has_out[cols]
        if blk.same_level:
            load = np.maximum(g_out[:, None] + a_out[None, :], a_in[:, None] + g_in[None, :])
            x_s = f_in.alpha_s * (has_in[:, None] + has_out[None, :]) + load * s_in * f_in.beta_s_per_byte
        else:
            t_in = f_in.alpha_s * has_in + np.maximum(g_out, a_in) * s_in * f_in.beta_s_per_byte
            t_out = f_out.alpha_s * has_out + np.maximum(a_out, g_in) * s_out * f_out.beta_s_per_byte
            x_s = np.maximum(t_in[:, None], t_out[None, :])
        return x_s * 1e3

    def exposure_table(self, blk: _Block) -> np.ndarray:
        """E(i, j) in ms: exposed sync of stage i..j on the block's ranks (0 without replicas)."""
        hit = self._exposure.get(blk.shape)
        if hit is None:
            sync = self.sync_ms(blk.ranks)
            same = sync.tobytes()                      # different placements often cost the same
            hit = self._exposure.get(same)
            if hit is None:
                hit = self._exposure[same] = exposure_table(sync, self.costs.backward_ms, self.costs.forward_ms)
            self._exposure[blk.shape] = hit
        return hit

    def sync_ms(self, ranks: tuple[int, ...]) -> np.ndarray:
        """Each node's all-reduce time (fastest allowed algorithm) on ``ranks``, 0 without parameters."""
        lines = self.model.lines(ranks, self.opts.algorithms)
        nbytes = self.costs.param_bytes
        best = np.min([ln.alpha_s + ln.s_per_byte * nbytes for _, ln in lines], axis=0)
        return np.where(self.param_nodes, best * 1e3, 0.0)


def _times(count: int, table: np.ndarray) -> np.ndarray:
    """count * table, keeping inf (impossible stages) inf when count is 0."""
    return count * table if count else np.where(np.isfinite(table), 0.0, np.inf)


@dataclass(frozen=True)
class _Block:
    ranks: tuple[int, ...]           # global ranks of one block with this shape (all copies)
    shape: tuple[int, int]           # (offset within a top-level sub-unit, ranks per copy)
    fit_in: LinkFit
    fit_out: LinkFit
    share_in: float
    share_out: float
    same_level: bool

    @property
    def replicas(self) -> int:
        return len(self.ranks)


def exposure_table(sync_ms: np.ndarray, backward_ms: np.ndarray, forward_ms: np.ndarray) -> np.ndarray:
    """Exposed sync E(i, j) for every stage i..j at once (closed form of ``simulate_lane``).

    With prefix sums Pc, Pb, Pf: the sync of layer l finishes at
    ``Pb[j+1] - Pc[l] + max_{l<=k<=j} (Pc[k+1] - Pb[k])`` and is needed at
    ``Pb[j+1] - Pb[i] + Pf[l] - Pf[i]``; E is the largest lateness over layers with a sync.
    """
    n = len(sync_ms)
    pc = np.concatenate([[0.0], np.cumsum(sync_ms)])
    pb = np.concatenate([[0.0], np.cumsum(backward_ms)])
    pf = np.concatenate([[0.0], np.cumsum(forward_ms)])
    upper = np.triu(np.ones((n, n), dtype=bool))
    h = pc[1:] - pb[:-1]
    run_max = np.maximum.accumulate(np.where(upper, h[None, :], -np.inf), axis=1)   # [l, j]
    late = run_max - (pc[:-1] + pf[:-1])[:, None]
    late[sync_ms <= 0, :] = -np.inf
    worst = np.maximum.accumulate(late[::-1], axis=0)[::-1]                          # [i, j]: max over l >= i
    with np.errstate(invalid="ignore"):
        e = np.maximum(0.0, (pb[:-1] + pf[:-1])[:, None] + worst)
    return np.where(upper, e, 0.0)
