"""Stage terms of ``objective.py`` for arbitrary (nodes, ranks) candidates, vectorised: what ``dp.py`` minimises.

For one copy count R (``dp.py``'s layout: R copies of a pipeline on ``wc = W / R`` ranks each) a
candidate is a stage of nodes ``i..j`` on the block of copy ranks ``x..y-1`` (its replicas: that
block in every copy, ``r = (y - x) R``). ``StageTerms.evaluate`` returns the objective's stage term
for many candidates of one start node ``i`` at once, with the same floating-point operations, in
the same order, as the exhaustive solver kept in ``tests/partitioner/reference_dp.py`` (so the
values, and therefore the ties between plans, are bit for bit the same):

* ``work = base + kk (F + B) + overhead``: gpipe / 1f1b ``base`` = the trip of one micro-batch
  through all nodes and ``kk = k - 1``; pipedream ``base = 0``, ``kk = k`` (``k = ceil(M / r)``);
  with the replicas' stretch ``rho(r)`` (``cost/computeterms.py``) ``F``, ``B`` and the stage's own part of
  the trip scaled by it, and the gradient accumulation in the overhead, as ``objective.py`` prices them;
  infinite where the stage does not fit in memory (``memory_bytes``, in-flight micro-batches from
  the block's position) or ends at a blocked cut.
* ``xfer = M X``: the activation traffic through the links of the block's level and position.
* the exposed sync ``E`` of the block's all-reduces (``BlockSync.exposure_row``: the closed form of
  ``layersync.simulate_lane``), priced per distinct block shape (offset in the cluster's period,
  size: ``blocksync.py``). gpipe / 1f1b: ``busy = work + max(0, E - gap_i)``; the sync is never priced
  where an upper bound of its whole lane (``BlockSync.ring_bound``: the ring's cost, closed form)
  already fits in the gap, since then ``max(0, E - gap_i) = 0`` exactly. pipedream: ``busy = k (F + B + E) +
  overhead``.
* the term is ``max(busy, xfer)``; infinite where the replica count is not allowed.
* ``--shard`` (``sharding.py``): the same term for each variant the stage may take (memory, the
  lane of paired reduce-scatters and all-gathers, ``midstep_ms``, the optimizer step on 1/r), the
  smallest one kept (``none`` alone: the term above, bit for bit).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from hybridpipe.partitioner.cost.computeterms import accumulation_ms, replica_factor
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.cost.sharded import paired_algorithms
from hybridpipe.partitioner.search.blocksync import BlockSync
from hybridpipe.partitioner.search.blocktables import BlockTables, grouped
from hybridpipe.partitioner.search.lanes import SAFETY
from hybridpipe.partitioner.search.modelcosts import ModelCosts
from hybridpipe.partitioner.search.objective import overhead_ms
from hybridpipe.partitioner.search.options import OPTIMIZER_STATES, Options
from hybridpipe.partitioner.search.sharding import (
    NONE,
    Variant,
    largest_units,
    midstep_ms,
    runs_with,
    static_bytes,
)

Useful = Callable[[np.ndarray, np.ndarray], np.ndarray]
CHUNK = 1 << 15          # candidates evaluated at once (more: every temporary array is a fresh mapping)


def _shifted(useful: Useful, start: int) -> Useful:
    """``useful`` of a slice of the candidates that starts at ``start``."""
    return lambda index, lower: useful(index + start, lower)


@dataclass(frozen=True)
class Candidates:
    """Stages ``i..J[k]`` on copy ranks ``X[k]..Y[k]-1`` for one start node ``i``."""

    i: int
    j: np.ndarray
    x: np.ndarray
    y: np.ndarray


class StageTerms:
    """Per copy count: node prefix sums, the cluster's link table, sync vectors per block shape (``block_sync``)."""

    def __init__(self, costs: ModelCosts, model: CostModel, workers: int, copies: int, opts: Options,
                 shared: dict | None = None):
        self.costs, self.model, self.opts = costs, model, opts
        self.shared = {} if shared is None else shared        # what every copy count of one solve can reuse
        self.copies, self.wc = copies, workers // copies
        self.n = n = costs.n
        self.pf, self.pb = costs.prefix(costs.forward_ms), costs.prefix(costs.backward_ms)
        self.kind = kind = opts.schedule
        self.flushed, self.share = kind.flushed, kind.drain_backward_share
        # a split schedule's fill + drain leaves out the backwards (share 0), its own is added per stage
        self.trip = float(self.pf[-1] + self.share * self.pb[-1]) if self.flushed else 0.0
        self.gap = (self.pf[:-1] + self.pb[:-1]) if self.flushed else np.zeros(n)
        self.pp = costs.prefix(costs.param_bytes)
        self.po = costs.prefix(costs.optimizer_ms(opts.optimizer))
        self.pcount = costs.prefix((costs.param_bytes > 0).astype(float))
        self.pfrozen = costs.prefix(costs.held - costs.param_bytes)     # frozen: held, never synced
        a_in = np.concatenate([[0.0], costs.cut_bytes[:-1]])
        self.a_in, self.g_out = a_in, np.concatenate([[0.0], costs.cut_grad_bytes[:-1]])
        self.a_out, self.g_in = costs.cut_bytes.copy(), costs.cut_grad_bytes.copy()
        self.a_out[-1] = self.g_in[-1] = 0.0
        self.has_in = (np.arange(n) > 0).astype(float)
        self.has_out = (np.arange(n) < n - 1).astype(float)
        self.p2p_in, self.p2p_out = (self.a_in + self.g_out) / 2, (self.a_out + self.g_in) / 2
        self.cut_ok = costs.cut_ok
        self.weights = costs.weight_table()             # [i, j]: its parameters and tied copies (modelcosts.py)
        self.most_weights = float(self.weights.max(initial=0.0))
        self.stash, self.kept, self.rerun = costs.stash_table()      # [i, j] per micro-batch (modelcosts.py)
        self.half = costs.half_table()      # [i, j] between a split backward's input and weight halves
        self.recorded = costs.recorded_table()      # [i, j] of it, the recorded gradients
        # the most one micro-batch can add to a stage, with or without recomputation, whole or halved
        self.most_stash = float(np.maximum(np.maximum(self.stash, self.half),
                                           self.kept + self.recorded + self.rerun).max(initial=0.0))
        self.transient = costs.transient_table()        # [i, j]: stagememory.transient_bytes
        self.most_transient = float(self.transient.max(initial=0.0))
        self.interference = model.interference_s_per_byte
        self.rho_points, self.accumulate = model.replica_compute, model.accumulate_s_per_byte    # computeterms.py
        levels = model.cluster.levels
        self.period = model.cluster.span(len(levels) - 2) if len(levels) > 1 else 1
        self.spans = np.array([model.cluster.span(k) for k in range(len(levels))], dtype=np.int64)
        self.alpha = np.array([model.link(k).alpha_s for k in range(len(levels))])
        self.beta = np.array([model.link(k).beta_s_per_byte for k in range(len(levels))])
        self.block_sync = BlockSync(costs, model, copies, self.wc, opts.algorithms, self.spans)
        self.sharding = (opts.shard != "none" and self.flushed and bool(paired_algorithms(opts.algorithms)))
        if self.sharding:
            if "units" not in self.shared:
                self.shared["units"] = largest_units(costs.held)
            self.units: tuple[np.ndarray, np.ndarray] = self.shared["units"]
        self.tables = BlockTables(self.spans, self.period, copies, self.wc)
        self._whole: float | None = None

    # ---- the term --------------------------------------------------------------------------
    def whole_term(self) -> float:
        """The term of the one-stage layout (every node on every rank): its block is fixed, so exact."""
        if self._whole is None:
            one = np.array([self.n - 1])
            self._whole = float(self.evaluate(Candidates(0, one, np.array([0]), np.array([self.wc])))[0])
        return self._whole

    def evaluate(self, c: Candidates, useful: Useful | None = None) -> np.ndarray:
        """The stage term of every candidate (inf where infeasible): the least over the variants it may shard as.

        ``useful(index, lower)``: which of the candidates ``index`` (with these lower bounds of their
        terms) could still matter to the caller; those whose sync would need pricing and cannot
        matter are returned as inf instead of their term.
        """
        if len(c.j) > CHUNK:          # the same terms a slice at a time: temporaries stay in the cache
            return np.concatenate([self.evaluate(Candidates(c.i, c.j[s:s + CHUNK], c.x[s:s + CHUNK], c.y[s:s + CHUNK]),
                                                 None if useful is None else _shifted(useful, s))
                                   for s in range(0, len(c.j), CHUNK)])
        xfer = self.opts.micro_batches * self._transfer(c.i, c.j, c.x, c.y)
        term = self._term(c, useful, NONE, xfer)
        if not self.sharding:
            return term
        if self.opts.shard != "auto":                    # a level: every stage with replicas shards
            term = np.where((c.y - c.x) * self.copies > 1, np.inf, term)
        for v in self.opts.levels():
            if v != NONE:
                term = np.minimum(term, self._term(c, useful, v, xfer))
        return term

    def _term(self, c: Candidates, useful: Useful | None, v: Variant, xfer: np.ndarray) -> np.ndarray:
        """The stage term of every candidate when its replicas shard as ``v`` (``xfer``: M X)."""
        opts, m_b, i = self.opts, self.opts.micro_batches, c.i
        j, x, y = c.j, c.x, c.y
        b = y - x
        r = b * self.copies
        kind = self.kind
        ok = kind.replicas_ok(r, m_b) & (b >= 1) & self.cut_ok[j]
        sharded = v.level != "none"
        if sharded:
            ok = ok & (r > 1) & runs_with(v, r, m_b)
        r = np.maximum(r, 1)
        k = -(-m_b // r)
        kk = k if not self.flushed else k - 1
        depth = -(-(self.copies * (self.wc - x)) // r)
        depth_all = -(-(self.copies * self.wc) // r)
        inflight = kind.inflight(k, depth, depth_all)
        whole = kind.whole(k, depth, depth_all)     # the rest of inflight between their B and W
        halves = kind.most_halves(k, depth, depth_all)
        states = OPTIMIZER_STATES[opts.optimizer]
        static = 2 + states + kind.weight_versions(inflight)
        fwd = self.pf[j + 1] - self.pf[i]
        back = self.pb[j + 1] - self.pb[i]
        stretch = None
        if self.rho_points:                 # computeterms.replica_factor: F, B and its part of the trip stretched
            rho = replica_factor(self.rho_points, r.astype(float))
            stretch = (rho - 1) * (fwd + self.share * back)
            fwd, back = fwd * rho, back * rho
        fb = fwd + back
        weights = self.weights[i, j]
        stash, kept, rerun = self.stash[i, j], self.kept[i, j], self.rerun[i, j]
        transient = self.transient[i, j]
        rc = np.full(len(j), opts.recompute == "all")       # the stage reruns its forward in backward
        if sharded:                         # sharding.static_bytes (no weight versions: flushed schedules)
            held = self._static(v, weights, r, states, i, j)
            overflow = np.ones(len(j), dtype=bool)
        else:
            held = weights * static
            overflow = (static * self.most_weights + self.most_stash * inflight + self.most_transient
                        > opts.memory_bytes)
        if np.any(overflow):
            half, half_rc = self.half[i, j], kept + self.recorded[i, j]
            fits = held + kind.held_bytes(inflight, whole, halves, stash, half) + transient <= opts.memory_bytes
            fits_rc = (held + kind.held_bytes(inflight, whole, halves, kept, half_rc) + rerun + transient
                       <= opts.memory_bytes)
            if opts.recompute == "all":
                feasible = fits_rc
            elif opts.recompute == "auto":                   # recompute only where keeping everything does not fit
                rc, feasible = ~fits, fits | fits_rc
            else:
                feasible = fits
            fb = np.where(overflow & ~feasible, np.inf, fb)
        fb = fb + np.where(rc, fwd, 0.0)
        fb = np.where(ok, fb, np.inf)
        times = np.where(kk == 0, np.where(np.isfinite(fb), 0.0, np.inf), kk * np.where(kk == 0, 0.0, fb))
        extra = self._overhead(i, j, r, k, weights - (self.pfrozen[j + 1] - self.pfrozen[i]), v)
        work = self.trip + times if stretch is None else self.trip + stretch + times
        if self.flushed and self.share < 1:                 # the stage's own backward (and rerun forward)
            work = work + (1 - self.share) * back
            if rc.any():
                work = work + (1 - self.share) * np.where(rc, fwd, 0.0)
        work = work + extra

        def lower(index: np.ndarray, e_low: np.ndarray) -> np.ndarray:
            """The term of candidates ``index`` with an exposed sync of ``e_low`` (<= E) instead of E."""
            if self.flushed:
                low = work[index] + np.maximum(0.0, e_low - self.gap[i])
            else:
                low = k[index] * (fb[index] + e_low) + extra[index]
            return np.maximum(low, xfer[index]) * (1 - SAFETY)

        exposed = self._exposed(c, r, work, xfer, useful, lower, sharded)
        if self.flushed:
            busy = work + np.maximum(0.0, exposed - self.gap[i])
            if sharded:
                busy = busy + self._midstep(c, r, k, fwd, back + np.where(rc, fwd, 0.0), v, ok & np.isfinite(work))
        else:
            busy = k * (fb + exposed) + extra
        return np.where(ok & ~np.isnan(exposed), np.maximum(busy, xfer), np.inf)

    def _overhead(self, i: int, j: np.ndarray, r: np.ndarray, k: np.ndarray, weights: np.ndarray,
                  v: Variant = NONE) -> np.ndarray:
        """objective.overhead_ms per candidate (optimizer steps, compute lost to communication)."""
        syncs = self.kind.syncs_per_step(k)
        extra: np.ndarray = overhead_ms(self.po[j + 1] - self.po[i], weights, self.p2p_in[i] + self.p2p_out[j], r, k,
                                        syncs, self.interference, v)
        if self.accumulate:
            extra = extra + accumulation_ms(self.accumulate, self.pp[j + 1] - self.pp[i], k, syncs)
        return extra

    def _static(self, v: Variant, weights: np.ndarray, r: np.ndarray, states: int, i: int, j: np.ndarray
                ) -> np.ndarray:
        """sharding.static_bytes per candidate."""
        return static_bytes(v, weights, r, states, self.units[0][i, j], self.units[1][i, j])

    def _midstep(self, c: Candidates, r: np.ndarray, k: np.ndarray, fwd: np.ndarray, back: np.ndarray, v: Variant,
                 live: np.ndarray) -> np.ndarray:
        """sharding.midstep_ms per candidate (0 where there is nothing to shard or it is infeasible anyway)."""
        i, j = c.i, c.j
        half = np.zeros(len(j))
        need = live & (r > 1) & (self.pcount[j + 1] - self.pcount[i] > 0)
        if v.level in ("none", "optimizer") or not need.any():
            return half
        where = np.nonzero(need)[0]
        keys = (c.x[where] % self.period) * (self.wc + 1) + (c.y - c.x)[where]
        for key, at in grouped(keys):
            sel = where[at]
            prefix = self.block_sync.half_prefix(*divmod(int(key), self.wc + 1))
            half[sel] = prefix[j[sel] + 1] - prefix[i]
        return midstep_ms(v, k, half, fwd, back)

    # ---- where a block sits ------------------------------------------------------------------
    def level_between(self, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """Innermost level whose units hold both ranks (elementwise; ``a <= b``; ``blocktables.py``)."""
        return self.tables.level_between(a, b)

    def busiest_share(self, x: np.ndarray, y: np.ndarray, level: np.ndarray) -> np.ndarray:
        """transfers.busiest_share of the block's ranks (all copies) behind one link of ``level``."""
        return self.tables.busiest_share(x, y, level)

    def _transfer(self, i: int, j: np.ndarray, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """X in ms (transfers.transfer_ms): the stage's activation traffic per micro-batch."""
        span = self.level_between(x, y - 1)
        lv_in = np.where(x > 0, np.maximum(span, self.level_between(np.maximum(x - 1, 0), x)), span)
        lv_out = np.where(y < self.wc, np.maximum(span, self.level_between(y - 1, np.minimum(y, self.wc - 1))), span)
        s_in, s_out = self.busiest_share(x, y, lv_in), self.busiest_share(x, y, lv_out)
        a_in, g_out, has_in = self.a_in[i], self.g_out[i], self.has_in[i]
        a_out, g_in, has_out = self.a_out[j], self.g_in[j], self.has_out[j]
        al_in, be_in, al_out, be_out = self.alpha[lv_in], self.beta[lv_in], self.alpha[lv_out], self.beta[lv_out]
        load = np.maximum(g_out + a_out, a_in + g_in)
        same = al_in * (has_in + has_out) + load * s_in * be_in
        t_in = al_in * has_in + max(g_out, a_in) * s_in * be_in
        t_out = al_out * has_out + np.maximum(a_out, g_in) * s_out * be_out
        return np.where(lv_in == lv_out, same, np.maximum(t_in, t_out)) * 1e3

    # ---- the sync ----------------------------------------------------------------------------
    def _exposed(self, c: Candidates, r: np.ndarray, work: np.ndarray, xfer: np.ndarray,
                 useful: Useful | None, lower: Callable[[np.ndarray, np.ndarray], np.ndarray],
                 paired: bool = False) -> np.ndarray:
        """E per candidate: 0 without replicas or parameters, and where it provably hides in the gap;
        nan where it would need pricing but ``useful`` says the candidate cannot matter, even with
        the least sync its block can have (``lower(index, e_low)``: the term with a smaller E).
        ``paired``: each layer's reduce-scatter + all-gather instead of its all-reduce (the ring bound
        and the floor hold for them too: the pair is one of the all-reduces they bound)."""
        i, j = c.i, c.j
        exposed = np.zeros(len(j))
        count = self.pcount[j + 1] - self.pcount[i]
        where = np.nonzero((r > 1) & (count > 0) & np.isfinite(work))[0]      # the candidates still open
        x, y = c.x[where], c.y[where]
        top = self.level_between(x, (self.copies - 1) * self.wc + y - 1)
        if self.flushed and len(where):
            flat = (y - x) * len(self.spans) + top
            ring = self.block_sync.ring_bound
            bound = (ring[0].ravel()[flat] * count[where] + ring[1].ravel()[flat]
                     * (self.pp[j[where] + 1] - self.pp[i])) * 1e3
            where, x, y, top = self._kept(bound * (1 + SAFETY) + 1e-6 + SAFETY * self.gap[i] > self.gap[i],
                                          where, x, y, top)
        if len(where) and useful is not None:
            # lower() grows with E and the floor is >= 0: what cannot matter with no sync needs no floor
            fast = useful(where, lower(where, np.zeros(len(where))))
            exposed[where[~fast]] = np.nan
            where, x, y, top = self._kept(fast, where, x, y, top)
            keep = useful(where, lower(where, self.block_sync.exposure_floor(i, j[where], x, y, top)))
            exposed[where[~keep]] = np.nan
            where, x, y, top = self._kept(keep, where, x, y, top)
        if not len(where):
            return exposed
        keys = (x % self.period) * (self.wc + 1) + (y - x)
        shapes = [(divmod(key, self.wc + 1), at) for key, at in grouped(keys)]
        if not paired:                                  # every new shape priced in one pass
            self.block_sync.price_new([ob for ob, _ in shapes])
        for (o, b), at in shapes:
            sel = where[at]
            exposed[sel] = self.block_sync.exposure_row(o, b, i, paired)[j[sel] - i]
        return exposed

    @staticmethod
    def _kept(keep: np.ndarray, *arrays: np.ndarray) -> tuple[np.ndarray, ...]:
        return tuple(a[keep] for a in arrays)
