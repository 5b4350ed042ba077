"""The sync lane in closed form and its floor: what ``stageterms.py`` prices per block shape.

``lane_terms`` / ``lane_row``: the exposed sync of every stage i..j of a block shape at once (the
closed form of ``layersync.simulate_lane``); ``sync_floor``: a lower bound of any all-reduce of a
group, which lets the search skip pricing candidates that cannot matter.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridpipe.partitioner.cost.costmodel import CostModel

SAFETY = 1e-9     # relative slack of every bound used to skip exact work (floating-point rounding)



def lane_terms(sync_ms: np.ndarray, backward_ms: np.ndarray, forward_ms: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(h, d) of ``lane_row``: h_k = Pc[k+1] - Pb[k]; d_l = Pc[l] + Pf[l] for layers with a sync, else inf."""
    pc = np.concatenate([[0.0], np.cumsum(sync_ms)])
    pb = np.concatenate([[0.0], np.cumsum(backward_ms)])
    pf = np.concatenate([[0.0], np.cumsum(forward_ms)])
    return pc[1:] - pb[:-1], np.where(sync_ms > 0, pc[:-1] + pf[:-1], np.inf)


def lane_row(lane: tuple[np.ndarray, np.ndarray], start: float, i: int) -> np.ndarray:
    """Exposed sync E(i, j) of every stage i..j (j = i..n-1): the closed form of ``layersync.simulate_lane``.

    With prefix sums Pc (sync), Pb, Pf and ``start`` = Pb[i] + Pf[i], the sync of layer l finishes at
    ``Pb[j+1] - Pc[l] + max over l <= k <= j of (Pc[k+1] - Pb[k])`` and is needed at
    ``Pb[j+1] - Pb[i] + Pf[l] - Pf[i]``; E is the largest lateness (or 0):
    ``max over i <= l <= k <= j of (h_k - d_l) + start``, computed as the running maximum over k of
    ``h_k - min over i <= l <= k of d_l``. Rounding is monotone, so this is the same floating-point
    number as the full table's max over (l, j) of running maxima (``reference_dp.exposure_table``).
    """
    h, d = lane
    return np.maximum(0.0, start + np.maximum.accumulate(h[i:] - np.minimum.accumulate(d[i:])))


def group_sizes(model: CostModel) -> tuple[int, ...]:
    """The group sizes whose all-reduce fits differ by calibration (``Calibration.group_fits``); () if none."""
    return tuple(sorted({n for c in model.calibrations.values() if c.group_fits
                         for n in (*c.group_fits, c.world_size)}))


def sync_floor(model: CostModel, top: int, units: int, algorithms: Sequence[str],
               param_bytes: np.ndarray) -> np.ndarray:
    """Each node's all-reduce time (ms) is at least this on a group spanning level ``top`` over ``units``
    units of level ``top - 1`` (ranks, at level 0).

    Take one element of the vector. Every unit needs the sum of every unit's part, so the messages
    carrying it between units form a one-way gossip among the ``units`` units, which takes at least
    ``2 (units - 1)`` messages (the first unit to know the sum needs one from each other unit; each
    other unit then needs one more): at least ``2 (units - 1) S`` bytes cross level-``top`` links, each
    on its sender's outgoing and its receiver's incoming link, so one of the ``2 units``
    link-directions carries ``2 (units - 1) / units S`` over the whole all-reduce (``S`` with the
    dedicated aggregator, a process outside every unit that each unit's part goes to and comes
    from). A round costs at least its busiest level-``top`` load times that level's beta, at least
    one round holds a level-``top`` message (its alpha), rounds add up and reductions cost >= 0: a
    line is at least ``alpha_top + beta_top share S`` (the smallest over the allowed algorithms'
    fits), times the overlap slowdown and the refined size factor, as ``CostModel.fast_lines`` and
    ``StageTerms.sync_ms``. Zero where a fit is negative (the rounds would not add up) or below two units.
    """
    sizes = group_sizes(model) or (0,)          # a fit per group size (calibration.py): the least of them
    fits = [model.link(lv, a, n) for a in algorithms for lv in range(len(model.cluster.levels)) for n in sizes]
    if units < 2 or not algorithms or min(min(f.alpha_s, f.beta_s_per_byte) for f in fits) < 0 or model.gamma < 0:
        return np.zeros(len(param_bytes))
    share = 1.0 if "aggregator" in algorithms and model.aggregator_dedicated else 2 * (units - 1) / units
    alpha = min(model.link(top, a, n).alpha_s for a in algorithms for n in sizes)
    beta = min(model.link(top, a, n).beta_s_per_byte for a in algorithms for n in sizes)
    line = alpha * model.overlap_slowdown + beta * share * model.overlap_slowdown * param_bytes
    line = line * model.allreduce_factor(param_bytes) * (1 - SAFETY)
    return np.where(param_bytes > 0, line * 1e3, 0.0)


def ring_bounds(model: CostModel, levels: int, wc: int, copies: int, algorithms: Sequence[str]
                ) -> tuple[np.ndarray, np.ndarray]:
    """Upper bound of every node's sync for each block size (``copies`` blocks of 0..wc ranks) and
    outermost level spanned (``StageTerms``' ring bound).

    The fastest allowed algorithm is at most the ring's (or native's) cost; on sorted ranks a
    ring sends one chunk of S/n out of (and into) every link per round, so with the largest
    alpha and beta up to the level the group spans, n ranks cost at most
    ``2 (n - 1) alpha + (n - 1) / n (2 beta + gamma) S``, times the overlap slowdown.
    Tables [size, level] of (alpha part, per-byte part) in seconds; inf without ring/native.
    """
    sizes = np.arange(wc + 1) * copies
    a = np.full((wc + 1, levels), np.inf)
    per_byte = np.full((wc + 1, levels), np.inf)
    n = np.maximum(sizes, 1)
    per_size = bool(group_sizes(model))          # fits by group size (calibration.py): each size its own
    for algo in ("ring", "native"):
        if algo not in algorithms:
            continue
        fits = np.array([[(f.alpha_s, f.beta_s_per_byte) for f in model._fits(algo, int(k) if per_size else 0)]
                         for k in (n if per_size else n[:1])])             # [sizes or 1, levels, 2]
        for top in range(levels):
            al = fits[:, :top + 1, 0].max(axis=1)
            be = fits[:, :top + 1, 1].max(axis=1)
            a[:, top] = np.minimum(a[:, top], model.overlap_slowdown * 2 * (n - 1) * al)
            per_byte[:, top] = np.minimum(per_byte[:, top],
                                          model.overlap_slowdown * (n - 1) / n * (2 * be + model.gamma))
    return a, per_byte
