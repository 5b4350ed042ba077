"""The gradient sync of the DP's blocks, priced once per block shape: what ``stageterms.py`` reads.

A block shape is ``(offset, size)``: ``size`` copy ranks starting ``offset`` into the cluster's
period, in every one of the ``copies`` copies (``dp.py``'s layout). Per shape, ``sync_ms`` is each
node's all-reduce time with the fastest allowed algorithm (or, ``paired``, its reduce-scatter +
all-gather for a sharded stage: ``cost/sharded.py``) and ``exposure_row`` the exposed sync of every
stage ``i..j`` on it (``lanes.lane_row``). New shapes are priced in batches (``price``:
``blocklines.block_lines``, the same lines bit for bit as ``CostModel.fast_lines`` one shape at a time).
``ring_bound`` (``lanes.ring_bounds``) and ``exposure_floor`` bound the sync from above and below
without pricing a shape, which is what lets the search skip most of them.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridpipe.partitioner.cost.blocklines import block_lines
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.cost.sharded import pair_lines
from hybridpipe.partitioner.search.blocktables import grouped
from hybridpipe.partitioner.search.lanes import SAFETY, lane_row, lane_terms, ring_bounds, sync_floor
from hybridpipe.partitioner.search.modelcosts import ModelCosts

BATCH_RANKS = 1 << 20    # ranks in the block shapes priced at once (their units: the batch's memory)

Lane = tuple[np.ndarray, np.ndarray]        # lanes.lane_terms


class BlockSync:
    """Sync vectors, lanes and floors per block shape of one copy count (``copies`` x ``wc`` ranks)."""

    def __init__(self, costs: ModelCosts, model: CostModel, copies: int, wc: int, algorithms: Sequence[str],
                 spans: np.ndarray):
        self.costs, self.model, self.algorithms = costs, model, tuple(algorithms)
        self.copies, self.wc, self.spans = copies, wc, spans
        self.pf, self.pb = costs.prefix(costs.forward_ms), costs.prefix(costs.backward_ms)
        self.pp = costs.prefix(costs.param_bytes)
        self.pcount = costs.prefix((costs.param_bytes > 0).astype(float))
        self.param_nodes = costs.param_bytes > 0
        # [size, level]: (alpha, s per byte) of a ring bound of any layer's sync on a block (lanes.ring_bounds)
        self.ring_bound = ring_bounds(model, len(spans), wc, copies, self.algorithms)
        self._sync: dict[tuple[int, int, bool], np.ndarray] = {}
        self._lane: dict[tuple[int, int, bool], Lane] = {}
        self._half: dict[tuple[int, int], np.ndarray] = {}
        self._floor_lanes: dict[tuple[int, int], tuple[Lane, float]] = {}
        self.priced = 0                   # block shapes whose all-reduces were priced (for the benchmark)

    def sync_ms(self, offset: int, size: int, paired: bool = False) -> np.ndarray:
        """Each node's all-reduce time (fastest allowed algorithm) on the block shape's ranks
        (``paired``: its reduce-scatter + all-gather, ``cost/sharded.py``)."""
        key = (offset, size, paired)
        hit = self._sync.get(key)
        if hit is None and not paired:
            self.price([(offset, size)])
            hit = self._sync[key]
        if hit is None:
            ranks = np.add.outer(np.arange(self.copies) * self.wc, np.arange(offset, offset + size)).ravel()
            lines = pair_lines(self.model, ranks.tolist(), self.algorithms)
            nbytes = self.costs.param_bytes
            best = np.min([ln.alpha_s + ln.s_per_byte * nbytes for _, ln in lines], axis=0)
            best = best * self.model.allreduce_factor(nbytes, len(ranks))    # refined (refine/); 1 otherwise
            hit = self._sync[key] = np.where(self.param_nodes, best * 1e3, 0.0)
            self.priced += 1
        return hit

    def price(self, shapes: list[tuple[int, int]]) -> None:
        """``sync_ms`` (all-reduces) of every (offset, size) shape at once: ``blocklines.block_lines``, the same
        lines bit for bit as ``CostModel.fast_lines`` one shape at a time, then the same operations."""
        ranks = np.cumsum([self.copies * b for _, b in shapes])
        if len(shapes) > 1 and ranks[-1] > BATCH_RANKS:        # bounded memory: O(ranks) per batch at most
            cut = max(1, int(np.searchsorted(ranks, BATCH_RANKS, side="right")))
            self.price(shapes[:cut])
            self.price(shapes[cut:])
            return
        if not shapes:
            return
        offsets, sizes = (np.array(v, dtype=np.int64) for v in zip(*shapes, strict=True))
        _, alpha, per_byte = block_lines(self.model, self.copies, self.wc, offsets, sizes, self.algorithms)
        nbytes = self.costs.param_bytes
        best = (alpha[:, :, None] + per_byte[:, :, None] * nbytes).min(axis=1)
        if self.model.allreduce_groups:                          # refined per group size (cost/groupfactor.py)
            best = best * np.array([self.model.allreduce_factor(nbytes, self.copies * b) for _, b in shapes])
        else:
            best = best * self.model.allreduce_factor(nbytes)    # refined calibrations (refine/); 1 otherwise
        rows = np.where(self.param_nodes, best * 1e3, 0.0)
        for k, (o, b) in enumerate(shapes):
            self._sync[o, b, False] = rows[k]
        self.priced += len(shapes)

    def price_new(self, shapes: Sequence[tuple[int, int]]) -> None:
        """``price`` those of ``shapes`` (offset, size) whose all-reduces are not priced yet."""
        self.price([s for s in shapes if (*s, False) not in self._sync])

    def exposure_row(self, offset: int, size: int, i: int, paired: bool = False) -> np.ndarray:
        """E(i, j) for j = i..n-1 on the block shape (``lane_row``)."""
        key = (offset, size, paired)
        lane = self._lane.get(key)
        if lane is None:
            lane = self._lane[key] = lane_terms(self.sync_ms(offset, size, paired), self.costs.backward_ms,
                                                self.costs.forward_ms)
        return lane_row(lane, self.pb[i] + self.pf[i], i)

    def half_prefix(self, offset: int, size: int) -> np.ndarray:
        """Prefix sums over the nodes of half each one's paired sync on the block shape (``sharding.midstep_ms``)."""
        hit = self._half.get((offset, size))
        if hit is None:
            hit = self._half[offset, size] = self.costs.prefix(self.sync_ms(offset, size, True) / 2)
        return hit

    def exposure_floor(self, i: int, j: np.ndarray, x: np.ndarray, y: np.ndarray, top: np.ndarray) -> np.ndarray:
        """A lower bound of E(i, j) on the blocks x..y-1 (all copies; they span level ``top``), elementwise."""
        below = np.concatenate([[1], self.spans])[top]                    # the units a level-top link serves
        units = self.copies * ((y - 1) // below - x // below + 1)
        keys = top * (self.copies * self.wc + 1) + units
        out = np.zeros(len(j))
        row_start = self.pb[i] + self.pf[i]
        for key, sel in grouped(keys):
            lv, m = divmod(key, self.copies * self.wc + 1)
            lane = self._floor_lanes.get((lv, m))
            if lane is None:
                sync = sync_floor(self.model, lv, m, self.algorithms, self.costs.param_bytes)
                # rounding slack: the exact lane's prefix sums reach at most the ring bound's total
                most = (self.ring_bound[0][self.wc, lv] * self.pcount[-1] + self.ring_bound[1][self.wc, lv]
                        * self.pp[-1]) * 1e3
                if not np.isfinite(most):                     # no ring bound to scale by: no floor
                    sync, most = np.zeros(len(sync)), 0.0
                scale = SAFETY * (most + sync.sum() + self.pb[-1] + self.pf[-1])
                lane = self._floor_lanes[lv, m] = (lane_terms(sync, self.costs.backward_ms,
                                                              self.costs.forward_ms), scale)
            out[sel] = np.maximum(0.0, lane_row(lane[0], row_start, i)[j[sel] - i] - lane[1])
        return out
