"""What moving and summing bytes costs: point-to-point transfers and every all-reduce algorithm.

Each all-reduce algorithm is described by its *structure* for a group: a list of phases, each
``(level, a, b, c)`` = a sequential message steps, ``b * S`` bytes on one rank's link and
``c * S`` bytes summed, on the links of cluster level ``level``. A phase costs
``a * alpha + b * S * beta + c * S * gamma`` (the alpha-beta-gamma model); alpha and beta
come from the cluster file (nominal) or a calibration (measured), gamma from the calibration
or a nominal memory-bandwidth figure. Pure functions over plain data: no torch here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from hybridpipe.errors import UserError
from hybridpipe.partitioner.calibration import Calibration, LinkFit, Sample
from hybridpipe.partitioner.cluster import Cluster
from hybridpipe.partitioner.plan import ALGORITHMS

# Nominal costs used when no calibration is given.
NOMINAL_SOFTWARE_ALPHA_S = 30e-6      # per message step, on top of the link's latency
NOMINAL_GAMMA_S_PER_BYTE = 1 / 4e9    # summing float32 at ~4 GB/s on a CPU core


@dataclass(frozen=True)
class Phase:
    """One phase of a collective: a steps, b*S bytes sent per rank, c*S bytes reduced, at ``level``."""

    level: int
    a: float
    b: float
    c: float


def _log2_floor_pow(n: int) -> int:
    return 1 << (n.bit_length() - 1)


def ring_phases(n: int, level: int, scale: float = 1.0) -> list[Phase]:
    """Reduce-scatter + all-gather around a ring of n ranks, on S * scale bytes."""
    if n <= 1:
        return []
    return [Phase(level, 2 * (n - 1), 2 * (n - 1) / n * scale, (n - 1) / n * scale)]


def _shared_ring(n: int, g: int, level: int) -> list[Phase]:
    """g concurrent rings of n ranks, each on S/g, whose streams share each unit's link at ``level``.

    A level's bandwidth is that of one unit's link (a host's NIC), shared by the workers inside:
    the link carries all g rings' bytes (b as for one ring on S); each rank sums only S/g.
    """
    if n <= 1:
        return []
    return [Phase(level, 2 * (n - 1), 2 * (n - 1) / n, (n - 1) / n / g)]


def butterfly_phases(n: int, level: int, large: bool) -> list[Phase]:
    """Recursive doubling (small) or halving+doubling (large, Rabenseifner) with the non-power-of-two fold.

    The n - p extra ranks (p = largest power of two <= n) first send their data to a partner
    (one step, S bytes, S summed) and get the result back at the end (one step, S bytes).
    """
    if n <= 1:
        return []
    p = _log2_floor_pow(n)
    k = int(math.log2(p))
    phases = [Phase(level, 2, 2, 1)] if n != p else []
    if large:
        phases.append(Phase(level, 2 * k, 2 * (p - 1) / p, (p - 1) / p))
    else:
        phases.append(Phase(level, k, k, k))
    return phases


def aggregator_phases(n: int, level: int, dedicated: bool) -> list[Phase]:
    """Everyone sends S to one aggregator and gets the sum back, cut-through in chunks.

    With the aggregator on a worker rank its link carries the other n-1 ranks' data each way;
    a dedicated aggregator (a switch with a port per host) leaves each link carrying S each way.
    """
    if n <= 1:
        return []
    fan = 1 if dedicated else n - 1
    return [Phase(level, 2, fan, fan)]


def torus_shape(n: int, inner: int) -> tuple[int, int]:
    """Rows x columns for torus2d: rows = inner-level groups when they tile n, else the squarest split."""
    if 1 < inner < n and n % inner == 0:
        return n // inner, inner
    cols = max(c for c in range(1, int(math.isqrt(n)) + 1) if n % c == 0)
    return n // cols, cols


class CostModel:
    """Costs on a given cluster, optionally overridden by a measured calibration."""

    def __init__(self, cluster: Cluster, calibration: Calibration | None = None,
                 aggregator_dedicated: bool = False):
        self.cluster = cluster
        self.calibration = calibration
        self.aggregator_dedicated = aggregator_dedicated
        self.gamma = calibration.gamma_s_per_byte if calibration else NOMINAL_GAMMA_S_PER_BYTE
        names = [lv.name for lv in cluster.levels]
        if calibration and calibration.level and calibration.level not in names:
            raise UserError(f"the calibration was measured at level {calibration.level!r}, which the cluster "
                            f"does not have (its levels: {', '.join(names)})")
        self.calibrated_level = (names.index(calibration.level) if calibration and calibration.level
                                 else len(names) - 1)

    # ---- links -----------------------------------------------------------------------
    def link(self, level: int, algorithm: str = "p2p") -> LinkFit:
        """alpha/beta for messages at ``level``: calibrated where measured, else nominal."""
        cal = self.calibration
        if cal is not None and level == self.calibrated_level:
            if algorithm == "p2p":
                return cal.p2p
            if algorithm in cal.algorithms:
                return cal.algorithms[algorithm]
        lv = self.cluster.levels[level]
        return LinkFit(lv.latency_us * 1e-6 + NOMINAL_SOFTWARE_ALPHA_S, 1 / lv.bytes_per_s)

    def span_level(self, ranks: Sequence[int]) -> int:
        """The outermost level the ranks' links cross (0 if they share an innermost unit)."""
        ranks = list(ranks)
        if len(ranks) <= 1:
            return 0
        return max(self.cluster.level_between(ranks[0], r) for r in ranks[1:])

    def p2p_seconds(self, nbytes: float, level: int) -> float:
        """One transfer of ``nbytes`` between two ranks whose link is at ``level``."""
        if nbytes <= 0:
            return 0.0
        fit = self.link(level)
        return fit.alpha_s + nbytes * fit.beta_s_per_byte

    # ---- all-reduce ------------------------------------------------------------------
    def phases(self, algorithm: str, ranks: Sequence[int], nbytes: float = 0.0,
               fit: LinkFit | None = None) -> list[Phase]:
        """The algorithm's structure for a group of ranks (global ranks, for their levels).

        Butterfly takes recursive doubling or halving+doubling, whichever is cheaper for
        ``nbytes`` under the link costs (or ``fit``, when given); the comm layer makes the same
        choice through ``butterfly_halving``.
        """
        n = len(ranks)
        top = self.span_level(ranks)
        if algorithm in ("ring", "native"):
            return ring_phases(n, top)
        if algorithm == "butterfly":
            small, large = butterfly_phases(n, top, False), butterfly_phases(n, top, True)
            return min(small, large, key=lambda ph: self._phase_cost(ph, nbytes, algorithm, fit))
        if algorithm == "aggregator":
            return aggregator_phases(n, top, self.aggregator_dedicated)
        inner_level, g = self._inner_groups(ranks)
        if algorithm == "hierarchical":
            if g in (1, n):
                return ring_phases(n, top)
            return ring_phases(g, inner_level) + _shared_ring(n // g, g, top)
        if algorithm == "torus2d":
            rows, cols = torus_shape(n, g)
            row_level = inner_level if cols == g and g > 1 else top
            half = [Phase(row_level, cols - 1, (cols - 1) / cols, (cols - 1) / cols)] if cols > 1 else []
            gather = [Phase(row_level, cols - 1, (cols - 1) / cols, 0.0)] if cols > 1 else []
            column = _shared_ring(rows, cols, top) if row_level != top else ring_phases(rows, top, 1 / cols)
            return half + column + gather
        raise UserError(f"unknown all-reduce algorithm {algorithm!r}; choose from {', '.join(ALGORITHMS)}")

    def allreduce_seconds(self, algorithm: str, nbytes: float, ranks: Sequence[int]) -> float:
        """Predicted time of one all-reduce of ``nbytes`` over ``ranks`` with ``algorithm``."""
        if len(ranks) <= 1 or nbytes <= 0:
            return 0.0
        return self._phase_cost(self.phases(algorithm, ranks, nbytes), nbytes, algorithm)

    def fastest_allreduce(self, nbytes: float, ranks: Sequence[int],
                          candidates: Sequence[str] = ALGORITHMS) -> tuple[str, float]:
        """(algorithm, seconds) of the cheapest candidate; ties go to the earlier candidate."""
        best = min(candidates, key=lambda a: (self.allreduce_seconds(a, nbytes, ranks), candidates.index(a)))
        return best, self.allreduce_seconds(best, nbytes, ranks)

    # ---- internals -------------------------------------------------------------------
    def butterfly_halving(self, nbytes: float, ranks: Sequence[int]) -> bool:
        """True when halving+doubling (Rabenseifner) beats recursive doubling for this size."""
        return self.phases("butterfly", ranks, nbytes) == butterfly_phases(len(ranks), self.span_level(ranks), True)

    def _phase_cost(self, phases: list[Phase], nbytes: float, algorithm: str, fit: LinkFit | None = None) -> float:
        total = 0.0
        for ph in phases:
            f = fit or self.link(ph.level, algorithm)
            total += ph.a * f.alpha_s + ph.b * nbytes * f.beta_s_per_byte + ph.c * nbytes * self.gamma
        return total

    def _inner_groups(self, ranks: Sequence[int]) -> tuple[int, int]:
        """(level, group size) of the largest equal inner-level groups that tile ``ranks``."""
        top = self.span_level(ranks)
        for k in range(top - 1, -1, -1):
            units: dict[int, int] = {}
            for r in ranks:
                units[r // self.cluster.span(k)] = units.get(r // self.cluster.span(k), 0) + 1
            sizes = set(units.values())
            if len(sizes) == 1 and (g := sizes.pop()) > 1:
                return k, g
        return top, 1


def fit_link(samples: Sequence[Sample], algorithm: str, n: int, gamma: float) -> LinkFit:
    """Least-squares alpha, beta (>= 0) for ``algorithm`` timed on a flat group of n ranks.

    Fits relative error (each sample weighted by 1/seconds) so that small and large messages
    count alike. Butterfly's small/large switch is re-evaluated with the current fit (two passes).
    ``algorithm`` may be "p2p" for one-way transfers (one step, S bytes).
    """
    import numpy as np

    from hybridpipe.partitioner.cluster import Level

    pts = [s for s in samples if s.algorithm == algorithm and s.seconds > 0]
    if len(pts) < 2:
        raise UserError(f"need at least two timed sizes to fit {algorithm!r}, got {len(pts)}")
    flat = CostModel(Cluster((Level("flat", max(n, 1), 1.0),), 1.0))
    flat.gamma = gamma

    def counts(nbytes: int, fit: LinkFit) -> tuple[float, float, float]:
        if algorithm == "p2p":
            return (1.0, 1.0, 0.0)
        ph = flat.phases(algorithm, range(n), nbytes, fit=fit)
        return (sum(p.a for p in ph), sum(p.b for p in ph), sum(p.c for p in ph))

    fit = LinkFit(NOMINAL_SOFTWARE_ALPHA_S, 1e-9)
    for _ in range(2):
        rows, rhs = [], []
        for s in pts:
            a, b, c = counts(s.bytes, fit)
            w = 1.0 / s.seconds
            rows.append([a * w, b * s.bytes * w])
            rhs.append((s.seconds - c * s.bytes * gamma) * w)
        sol, *_ = np.linalg.lstsq(np.array(rows), np.array(rhs), rcond=None)
        fit = LinkFit(*(max(float(x), 0.0) for x in sol))
    errs = []
    for s in pts:
        a, b, c = counts(s.bytes, fit)
        pred = a * fit.alpha_s + b * s.bytes * fit.beta_s_per_byte + c * s.bytes * gamma
        errs.append(abs(pred - s.seconds) / s.seconds)
    return LinkFit(fit.alpha_s, fit.beta_s_per_byte, float(np.median(errs)))
