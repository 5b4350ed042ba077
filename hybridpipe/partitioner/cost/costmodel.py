"""What moving and summing bytes costs: point-to-point transfers and every all-reduce algorithm.

The alpha-beta-gamma model on the cluster's links. A level's link belongs to each unit one level
below it (level 0: each worker's own link; the network level: each host's NIC) and is full
duplex. An algorithm is a list of rounds of concurrent messages (``collectives.py``); a message
between ranks whose innermost common unit is at level l travels on the level-l links of the two
sub-units it leaves and enters. A round costs ``steps * alpha`` (the largest alpha among its
messages' levels) plus ``S * max over links (bytes on the link / S) * beta(link level)`` plus
``S * reduce * gamma``. So messages of one round that cross the same NIC share its bandwidth,
and a ring spanning hosts is priced at the NIC, not at the fast links inside a host (each round's
busiest link per level: ``roundloads.py``).

alpha and beta come from the cluster file (nominal: the level's latency plus a software cost
per message, 1/bandwidth) unless a calibration (``hybridpipe bench-allreduce``) measured that
level: then every algorithm it timed uses its own fitted alpha/beta there, and untimed ones use
the measured point-to-point fit. Costs are linear in the message size S for a fixed algorithm
and group, so each (algorithm, group) is reduced once to ``seconds = A + B * S`` and cached.
A refined calibration (``refine/refinement.py``) adds a measured slowdown per all-reduce size class on top
(:meth:`CostModel.allreduce_factor`) and a compute slowdown the planner applies to the profile.
Pure computation; no torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from hybridpipe.errors import UserError
from hybridpipe.partitioner.cost import collectives as co
from hybridpipe.partitioner.cost import fastlines
from hybridpipe.partitioner.cost.calibration import Calibration, LinkFit
from hybridpipe.partitioner.cost.cluster import Cluster, Level
from hybridpipe.partitioner.cost.collectives import ALGORITHMS
from hybridpipe.partitioner.cost.groupfactor import group_factor, least_group_factor, size_factor
from hybridpipe.partitioner.cost.priced import PricedRound, priced
from hybridpipe.partitioner.cost.roundloads import RoundLoad, round_loads

# Nominal costs used where no calibration measured a level.
NOMINAL_SOFTWARE_ALPHA_S = 30e-6      # per message step, on top of the link's latency
NOMINAL_GAMMA_S_PER_BYTE = 1 / 4e9    # summing float32 at ~4 GB/s on a CPU core


@dataclass(frozen=True)
class Line:
    """``seconds = alpha_s + s_per_byte * nbytes`` for one algorithm on one group."""

    alpha_s: float
    s_per_byte: float

    def seconds(self, nbytes: float) -> float:
        return self.alpha_s + self.s_per_byte * nbytes if nbytes > 0 else 0.0


class CostModel:
    """Costs on a cluster, with measured calibrations (one per level) overriding nominal numbers.

    ``aggregator_dedicated`` prices the ``aggregator`` algorithm with a dedicated aggregator
    process on a spare port (seed 001's switch) instead of on the group's lowest rank.
    ``wire_bytes``: what one profiled (float32) byte of gradients costs on the wire (0.5 when
    all-reduces travel in bf16 or fp16): every all-reduce's per-byte cost is scaled by it.
    ``activation_wire_bytes`` (default ``wire_bytes``): the same for activations between stages,
    which travel in the dtype the profiled forward produced them in (plan.py ``activation_wire``).
    """

    def __init__(self, cluster: Cluster, calibration: Calibration | Sequence[Calibration] | None = None,
                 aggregator_dedicated: bool = False, wire_bytes: float = 1.0,
                 activation_wire_bytes: float | None = None):
        self.cluster = cluster
        self.wire_bytes = wire_bytes
        self.activation_wire_bytes = wire_bytes if activation_wire_bytes is None else activation_wire_bytes
        self.aggregator_dedicated = aggregator_dedicated
        cals = [] if calibration is None else [calibration] if isinstance(calibration, Calibration) \
            else list(calibration)
        self.calibrations: dict[int, Calibration] = {}
        for cal in cals:
            level = self._calibrated_level(cal)
            if level in self.calibrations:
                raise UserError(f"two calibrations measure level {cluster.levels[level].name!r}; "
                                "give one calibration per cluster level")
            self.calibrations[level] = cal
        gamma = (sum(c.gamma_s_per_byte for c in cals) / len(cals)) if cals else NOMINAL_GAMMA_S_PER_BYTE
        self.gamma = gamma * wire_bytes
        # compute a worker loses per byte on its link (calibration.py); 0: communication takes no CPU from compute
        self.interference_s_per_byte = max((c.interference_s_per_byte for c in cals), default=0.0) * wire_bytes
        # an all-reduce beside compute takes this much longer than alone (calibration.py)
        self.overlap_slowdown = max((c.overlap_slowdown for c in cals), default=1.0)
        # what runs on the cluster taught (refine/refinement.py): all-reduce slowdown by size, compute slowdown
        self.allreduce_points = tuple(sorted(p for c in cals for p in c.allreduce_slowdown))
        self.allreduce_groups = tuple(sorted(g for c in cals for g in c.allreduce_slowdown_groups))
        self.compute_slowdown = max((c.compute_slowdown for c in cals if c.refined), default=1.0)
        self.step_overhead_ms = max((c.step_overhead_ms for c in cals), default=0.0)
        self.tied_slowdown = max((c.tied_slowdown for c in cals if c.refined), default=1.0)
        # stage compute terms by replica count and gradient accumulation (computeterms.py; neutral: () and 0)
        self.replica_compute = next((c.replica_compute for c in cals if c.replica_compute), ())
        self.accumulate_s_per_byte = max((c.accumulate_s_per_byte for c in cals), default=0.0)
        self._spans = [cluster.span(k) for k in range(len(cluster.levels))]
        self._collectives: dict[tuple, tuple[co.Collective, list[PricedRound]]] = {}
        self._structure: dict[tuple, tuple[RoundLoad, ...]] = {}
        self._lines: dict[tuple, Line] = {}

    @classmethod
    def from_calibration(cls, cal: Calibration, memory_gb: float = 16.0,
                         inner_bandwidth_gbps: float = 100.0) -> CostModel:
        """A model of the very group a calibration measured (for ``auto`` outside a plan).

        ``world_size`` ranks on ``hosts`` hosts, consecutive ranks per host; the measured level is
        the network between hosts (or the one host's fabric when ``hosts`` is 1 or every rank has
        its own host). Unmeasured inner links get ``inner_bandwidth_gbps`` nominally.
        """
        gbps = 8e-9 / cal.p2p.beta_s_per_byte if cal.p2p.beta_s_per_byte > 0 else inner_bandwidth_gbps
        per_host = cal.world_size // cal.hosts if cal.world_size % cal.hosts == 0 else 1
        levels: tuple[Level, ...]
        if cal.hosts in (1, cal.world_size) or per_host == 1:
            levels = (Level(cal.level or "measured", cal.world_size, gbps),)
        else:
            levels = (Level("host", per_host, inner_bandwidth_gbps),
                      Level(cal.level or "network", cal.hosts, gbps))
        cal = cal if cal.level else _with_level(cal, levels[-1].name)
        return cls(Cluster(levels, memory_gb), cal)

    # ---- levels and links --------------------------------------------------------------
    def _calibrated_level(self, cal: Calibration) -> int:
        names = [lv.name for lv in self.cluster.levels]
        if cal.level:
            if cal.level not in names:
                raise UserError(f"the calibration was measured at level {cal.level!r}, which the cluster does not "
                                f"have (its levels: {', '.join(names)}); re-run bench-allreduce with --level NAME")
            return names.index(cal.level)
        return len(names) - 1 if cal.hosts > 1 else 0

    def level_between(self, a: int, b: int) -> int:
        """Innermost level whose units hold both ranks."""
        for k, span in enumerate(self._spans):
            if a // span == b // span:
                return k
        raise UserError(f"ranks {a} and {b} are outside a cluster of {self.cluster.total_workers} workers")

    def span_level(self, ranks: Sequence[int]) -> int:
        """The outermost level the ranks' links cross (0 if they share an innermost unit)."""
        lo, hi = min(ranks), max(ranks)
        if hi >= self.cluster.total_workers or lo < 0:
            bad = hi if hi >= 0 else lo
            raise UserError(f"rank {bad} is outside a cluster of {self.cluster.total_workers} workers")
        return self.level_between(lo, hi) if len(ranks) > 1 else 0

    def sub_unit(self, rank: int, level: int) -> int:
        """Index of the unit, one level below ``level``, whose level-``level`` link ``rank`` uses."""
        return rank // self._spans[level - 1] if level > 0 else rank

    def link(self, level: int, algorithm: str = "p2p", ranks: int = 0) -> LinkFit:
        """alpha/beta for messages at ``level``, per profiled byte: calibrated where measured, else nominal
        (``p2p``: activations between stages; any other name: that all-reduce algorithm's, on a group of
        ``ranks`` ranks: the calibration's fit for that group size, ``Calibration.algorithm_fit``; 0: its
        world size)."""
        cal = self.calibrations.get(level)
        if cal is not None:
            fit = (cal.algorithm_fit(algorithm, ranks) or cal.p2p) if algorithm != "p2p" else cal.p2p
        else:
            lv = self.cluster.levels[level]
            fit = LinkFit(lv.latency_us * 1e-6 + NOMINAL_SOFTWARE_ALPHA_S, 1 / lv.bytes_per_s)
        scale = self.activation_wire_bytes if algorithm == "p2p" else self.wire_bytes
        return fit if scale == 1.0 else replace(fit, beta_s_per_byte=fit.beta_s_per_byte * scale)

    def _fits(self, algorithm: str, ranks: int = 0) -> list[LinkFit]:
        """``link(level, algorithm, ranks)`` for every level (the pricing loop's lookup)."""
        return [self.link(level, algorithm, ranks) for level in range(len(self._spans))]

    def p2p_seconds(self, nbytes: float, level: int, share: float = 1.0) -> float:
        """One transfer of ``nbytes`` at ``level``; ``share`` of the link's bandwidth is its own."""
        if nbytes <= 0:
            return 0.0
        fit = self.link(level)
        return fit.alpha_s + nbytes * fit.beta_s_per_byte / share

    # ---- all-reduce --------------------------------------------------------------------
    def groups(self, ranks: Sequence[int]) -> list[list[int]]:
        """Hierarchical groups: the ranks' units one level below the outermost level they span."""
        ranks = sorted(ranks)
        top = self.span_level(ranks)
        if top == 0:
            return [ranks]
        out: dict[int, list[int]] = {}
        for r in ranks:
            out.setdefault(r // self._spans[top - 1], []).append(r)
        return list(out.values())

    def torus_shape(self, ranks: Sequence[int]) -> tuple[int, int]:
        """Default torus2d rows x cols: a row per equal inner group, else the squarest grid."""
        sizes = {len(g) for g in self.groups(ranks)}
        return co.torus_shape(len(ranks), sizes.pop() if len(sizes) == 1 else 1)

    def collective(self, algorithm: str, ranks: Sequence[int], *, halving: bool = False,
                   shape: tuple[int, int] | None = None) -> co.Collective:
        """The rounds ``algorithm`` runs on ``ranks``, as the executors run them (``collectives.py``):
        endpoints are positions, position i being the i-th smallest rank (a process group's numbering)."""
        return self._described(algorithm, ranks, halving, shape)[0]

    def _priced(self, algorithm: str, ranks: Sequence[int], halving: bool = False,
                shape: tuple[int, int] | None = None) -> list[PricedRound]:
        """:meth:`collective` priced (``priced.py``), endpoints still positions."""
        return self._described(algorithm, ranks, halving, shape)[1]

    def _described(self, algorithm: str, ranks: Sequence[int], halving: bool,
                   shape: tuple[int, int] | None) -> tuple[co.Collective, list[PricedRound]]:
        """(rounds, priced rounds), cached by what they depend on: the group's size and shape."""
        ranks = sorted(ranks)
        n = len(ranks)
        if algorithm not in ALGORITHMS:
            raise UserError(f"unknown all-reduce algorithm {algorithm!r}; choose from {', '.join(ALGORITHMS)}")
        units = torus = None
        if algorithm == "hierarchical":
            position = {r: i for i, r in enumerate(ranks)}
            units = tuple(tuple(position[r] for r in g) for g in self.groups(ranks)) if n else ()
            if len(units) <= 1:                      # one host: a ring
                algorithm, units = "ring", None
        if algorithm == "torus2d":
            rows, cols = torus = shape or self.torus_shape(ranks)
            if rows * cols != n or rows < 1:
                raise UserError(f"torus2d shape {rows}x{cols} does not hold {n} ranks; choose rows x cols = {n}")
        root = co.SWITCH if algorithm == "aggregator" and self.aggregator_dedicated else 0
        key = ("ring" if algorithm == "native" else algorithm, n, halving and algorithm == "butterfly", units,
               torus, root)
        hit = self._collectives.get(key)
        if hit is None:
            rounds = co.rounds_for(key[0], n, halving=key[2], units=units, shape=torus, root=root)
            hit = self._collectives[key] = (rounds, priced(rounds))
        return hit

    def rounds(self, algorithm: str, ranks: Sequence[int], *, halving: bool = False,
               shape: tuple[int, int] | None = None) -> list[PricedRound]:
        """The rounds the model prices for ``algorithm`` on ``ranks``: :meth:`collective` through
        ``priced.py``, with the ranks' own numbers as endpoints."""
        of = np.asarray(sorted(ranks) + [co.SWITCH], dtype=np.int64)     # position -1 (SWITCH) stays SWITCH
        return [PricedRound(of[r.src], of[r.dst], r.share, r.reduce, r.repeat, r.steps)
                for r in self._priced(algorithm, ranks, halving, shape)]

    def structure(self, algorithm: str, ranks: Sequence[int], *, halving: bool = False,
                  shape: tuple[int, int] | None = None) -> tuple[RoundLoad, ...]:
        """The rounds reduced to per-level busiest-link loads (independent of alpha, beta, S)."""
        key = ("ring" if algorithm == "native" else algorithm, tuple(sorted(ranks)), halving, shape)
        hit = self._structure.get(key)
        if hit is None:
            top = self.span_level(key[1]) if len(key[1]) > 1 else 0
            hit = self._structure[key] = round_loads(self._priced(algorithm, key[1], halving, shape), key[1], top,
                                                     self._spans, self.cluster.total_workers)
        return hit

    def line(self, algorithm: str, ranks: Sequence[int], *, halving: bool = False,
             shape: tuple[int, int] | None = None) -> Line:
        """``seconds = A + B * nbytes`` for one all-reduce with this algorithm (and variant) on ranks.

        With the default torus shape every algorithm's line on the group is computed at once by
        ``fastlines.py`` (the same numbers as :meth:`priced_line`, without building every message:
        a ring over thousands of ranks would otherwise hold millions of them)."""
        key = (algorithm, tuple(sorted(ranks)), halving, shape)
        hit = self._lines.get(key)
        if hit is None and shape is None and algorithm in ALGORITHMS:
            self.span_level(key[1])                   # ranks outside the cluster: a clear error first
            self._fill_lines(key[1])
            hit = self._lines.get(key)
        if hit is None:
            hit = self._lines[key] = self.priced_line(algorithm, key[1], halving=halving, shape=shape)
        return hit

    def priced_line(self, algorithm: str, ranks: Sequence[int], *, halving: bool = False,
                    shape: tuple[int, int] | None = None) -> Line:
        """:meth:`line` from the collective's priced rounds, message by message (the reference)."""
        alpha = per_byte = 0.0
        fits = self._fits(algorithm, len(ranks))
        for rl in self.structure(algorithm, ranks, halving=halving, shape=shape):
            a, b = self.price(rl, algorithm, fits)
            alpha += a
            per_byte += b
        return Line(alpha * self.overlap_slowdown, per_byte * self.overlap_slowdown)

    def _fill_lines(self, key: tuple[int, ...]) -> None:
        variants = [(a, h) for a in ALGORITHMS for h in ((False, True) if a == "butterfly" else (False,))]
        for (a, h), (_, ln) in zip(variants, self.fast_lines(key, ALGORITHMS), strict=True):
            self._lines.setdefault((a, key, h, None), ln)

    def fast_lines(self, ranks: Sequence[int] | np.ndarray, algorithms: Sequence[str] = ALGORITHMS
                   ) -> list[tuple[str, Line]]:
        """The same list as :meth:`lines`, every variant at once from ``fastlines.link_loads`` (not cached):
        its rounds priced as :meth:`price` and summed in order as :meth:`priced_line`."""
        ll = fastlines.link_loads(self.cluster, ranks, algorithms, self.aggregator_dedicated)
        count, levels = len(ll.algorithms), len(self.cluster.levels)
        alpha_l = np.zeros((count, 1, levels))
        beta_l = np.zeros((count, 1, levels))
        for v, algo in enumerate(ll.algorithms):
            fits = self._fits(algo, len(ranks))
            alpha_l[v, 0] = [f.alpha_s for f in fits]
            beta_l[v, 0] = [f.beta_s_per_byte for f in fits]
        present = ll.loads > 0
        some = present.any(axis=2)
        a = np.where(some, np.where(present, alpha_l, -np.inf).max(axis=2, initial=-np.inf), 0.0)
        b = np.where(some, np.where(present, ll.loads * beta_l, -np.inf).max(axis=2, initial=-np.inf), 0.0)
        # padding rounds repeat 0 times and add exactly 0.0 after the real ones
        alpha = np.cumsum(np.concatenate([np.zeros((count, 1)), ll.repeat * (a * ll.steps)], axis=1), axis=1)[:, -1]
        per_byte = np.cumsum(np.concatenate([np.zeros((count, 1)), ll.repeat * (b + ll.reduce * self.gamma)],
                                            axis=1), axis=1)[:, -1]
        return [(algo, Line(float(x) * self.overlap_slowdown, float(y) * self.overlap_slowdown))
                for algo, x, y in zip(ll.algorithms, alpha, per_byte, strict=True)]

    def price(self, rl: RoundLoad, algorithm: str, fits: Sequence[LinkFit] | None = None) -> tuple[float, float]:
        """(seconds, seconds per byte of S) of one priced-out round, all its repeats (``fits``: the group's,
        default the calibration's world size)."""
        fits = fits or self._fits(algorithm)
        alpha = max((fits[lvl].alpha_s for lvl, _ in rl.level_loads), default=0.0) * rl.steps
        per_byte = max((load * fits[lvl].beta_s_per_byte for lvl, load in rl.level_loads), default=0.0)
        return rl.repeat * alpha, rl.repeat * (per_byte + rl.reduce * self.gamma)

    def lines(self, ranks: Sequence[int], algorithms: Iterable[str] = ALGORITHMS) -> list[tuple[str, Line]]:
        """Every candidate's line(s) on ``ranks``; butterfly contributes both of its variants."""
        variants = [(a, h) for a in algorithms for h in ((False, True) if a == "butterfly" else (False,))]
        key = tuple(sorted(ranks))
        return [(a, self.line(a, key, halving=h)) for a, h in variants]

    def butterfly_halving(self, nbytes: float, ranks: Sequence[int]) -> bool:
        """True when halving + doubling (Rabenseifner) beats recursive doubling at this size."""
        halving = self.line("butterfly", ranks, halving=True).seconds(nbytes)
        return halving < self.line("butterfly", ranks).seconds(nbytes)

    def allreduce_seconds(self, algorithm: str, nbytes: float, ranks: Sequence[int], *,
                          shape: tuple[int, int] | None = None) -> float:
        """Predicted time of one all-reduce of ``nbytes`` over ``ranks`` with ``algorithm``.

        Butterfly takes the cheaper of its two variants at this size (the comm layer asks
        ``butterfly_halving`` for the same choice); torus2d uses ``shape`` or ``torus_shape``.
        """
        if algorithm not in ALGORITHMS:
            raise UserError(f"unknown all-reduce algorithm {algorithm!r}; choose from {', '.join(ALGORITHMS)}")
        if len(ranks) <= 1 or nbytes <= 0:
            return 0.0
        t = self.line(algorithm, ranks, shape=shape).seconds(nbytes)
        if algorithm == "butterfly":
            t = min(t, self.line(algorithm, ranks, halving=True).seconds(nbytes))
        refined = self.allreduce_points or self.allreduce_groups
        return t * float(self.allreduce_factor(nbytes, len(ranks))) if refined else t

    def allreduce_factor(self, nbytes, ranks: int = 0):
        """The measured slowdown of an all-reduce of ``nbytes`` (a number or a numpy array; 1 unrefined) over a
        group of ``ranks`` ranks (``groupfactor.py``: per group size where refinement learnt it so; 0: the
        least over the group sizes, a lower bound for any group)."""
        if not self.allreduce_groups:
            return size_factor(self.allreduce_points, nbytes)
        if ranks <= 0:
            return least_group_factor(self.allreduce_groups, (), nbytes)
        return group_factor(self.allreduce_groups, nbytes, ranks)

    def fastest_allreduce(self, nbytes: float, ranks: Sequence[int],
                          algorithms: Sequence[str] = ALGORITHMS) -> tuple[str, float]:
        """(algorithm, seconds) of the cheapest of ``algorithms``; ties go to the earlier one."""
        if not algorithms:
            raise UserError("no all-reduce algorithm to choose from; name at least one")
        best = min(algorithms, key=lambda a: (self.allreduce_seconds(a, nbytes, ranks), algorithms.index(a)))
        return best, self.allreduce_seconds(best, nbytes, ranks)


def _with_level(cal: Calibration, level: str) -> Calibration:
    return replace(cal, level=level)
