"""Fitting measured all-reduce times to the cost model: alpha and beta per algorithm, >= 0.

``hybridpipe bench-allreduce`` times each algorithm at several sizes on a group of
``world_size`` ranks spread over ``hosts`` hosts (consecutive ranks per host) and calls
:func:`fit_calibration`. For each algorithm the model's own structure of that group (rounds,
busiest links, ``costmodel.py``) gives every sample a row ``seconds = a * alpha + b * S * beta +
known``, where ``known`` holds the reduction (gamma, measured separately) and any rounds that run
only on unmeasured inner links (nominal). Non-negative least squares on relative error (each row
scaled by 1/seconds, so 4 KB and 64 MB count alike) gives alpha and beta. Which level bounds a
mixed round depends on the fit itself, so the fit is repeated a few times from nominal values.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from hybridpipe.errors import UserError
from hybridpipe.partitioner.cost.calibration import Calibration, LinkFit, Sample
from hybridpipe.partitioner.cost.collectives import ALGORITHMS
from hybridpipe.partitioner.cost.costmodel import NOMINAL_SOFTWARE_ALPHA_S, CostModel

_PASSES = 4


def nnls(a: np.ndarray, b: np.ndarray, tol: float = 1e-12) -> np.ndarray:
    """argmin ||a x - b|| subject to x >= 0 (Lawson and Hanson's active-set method).

    Columns are scaled to unit norm first, so coefficients of very different magnitudes
    (seconds per message vs seconds per byte) are treated alike.
    """
    a = np.asarray(a, dtype=float)
    b = np.asarray(b, dtype=float)
    norms = np.linalg.norm(a, axis=0)
    norms[norms == 0] = 1.0
    a = a / norms
    n = a.shape[1]
    passive = np.zeros(n, dtype=bool)
    x = np.zeros(n)
    for _ in range(3 * n + 10):
        w = a.T @ (b - a @ x)
        free = ~passive & (w > tol)
        if not free.any():
            break
        passive[np.argmax(np.where(free, w, -np.inf))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > tol).all():
                x = z
                break
            bad = passive & (z <= tol)
            step = np.min(x[bad] / np.maximum(x[bad] - z[bad], 1e-300))
            x = x + step * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
    return x / norms


def measurement_model(world_size: int, hosts: int, level: str = "", gamma: float | None = None) -> CostModel:
    """The cost model of the measured group itself (its calibrated level is the outermost)."""
    if world_size < 1 or hosts < 1 or hosts > world_size:
        raise UserError(f"a calibration group needs 1 <= hosts <= world_size, got {hosts} hosts for {world_size} ranks")
    probe = Calibration(world_size, hosts, "", "", level, gamma if gamma is not None else 0.0,
                        LinkFit(NOMINAL_SOFTWARE_ALPHA_S, 1e-9), {})
    model = CostModel.from_calibration(probe)
    model.calibrations.clear()           # priced with the fit being made, not the probe
    if gamma is not None:
        model.gamma = gamma
    return model


def fit_link(samples: Sequence[Sample], algorithm: str, world_size: int, gamma: float,
             hosts: int | None = None) -> LinkFit:
    """alpha, beta (>= 0) of ``algorithm`` from its timed samples on ``world_size`` ranks over ``hosts``.

    ``algorithm`` may be ``"p2p"`` for one-way transfers between two ranks (one message of S).
    """
    pts = [s for s in samples if s.algorithm == algorithm and s.seconds > 0]
    if len({s.bytes for s in pts}) < 2:
        raise UserError(f"need at least two timed sizes to fit {algorithm!r}, got {len({s.bytes for s in pts})}; "
                        "benchmark more sizes (--sizes)")
    hosts = hosts or world_size
    model = measurement_model(world_size, hosts, gamma=gamma)
    level = len(model.cluster.levels) - 1
    ranks = list(range(world_size))
    fit = model.link(level)
    for _ in range(_PASSES):
        rows, rhs = [], []
        for s in pts:
            a, b, known = _row(model, algorithm, ranks, level, fit, s.bytes)
            w = 1.0 / s.seconds
            rows.append([a * w, b * s.bytes * w])
            rhs.append((s.seconds - known) * w)
        fit = LinkFit(*(float(v) for v in nnls(np.array(rows), np.array(rhs))))
    errs = [abs(_predict(model, algorithm, ranks, level, fit, s.bytes) - s.seconds) / s.seconds for s in pts]
    return LinkFit(fit.alpha_s, fit.beta_s_per_byte, float(np.median(errs)))


def fit_calibration(samples: Sequence[Sample], *, world_size: int, hosts: int, backend: str, device: str,
                    gamma_s_per_byte: float, level: str = "", created: str = "",
                    notes: Sequence[str] = (), interference_s_per_byte: float = 0.0,
                    overlap_slowdown: float = 1.0) -> Calibration:
    """A Calibration from timed samples: a fit per algorithm and one for point-to-point.

    Samples timed on a smaller group (``Sample.ranks``: the calibration group's first ``ranks`` ranks, consecutive
    ranks per host as in the whole group) are fitted per group size into ``group_fits``; the others into
    ``algorithms`` and ``p2p``."""
    names = sorted({s.algorithm for s in samples})
    unknown = [n for n in names if n != "p2p" and n not in ALGORITHMS]
    if unknown:
        raise UserError(f"samples name unknown algorithm(s) {', '.join(unknown)}; expected p2p or one of "
                        f"{', '.join(ALGORITHMS)}")
    sizes = sorted({s.ranks for s in samples} - {0, world_size})
    bad = [n for n in sizes if not 2 <= n < world_size]
    if bad:
        raise UserError(f"samples timed on groups of {bad} ranks; a calibration of {world_size} ranks takes groups "
                        f"of 2 to {world_size} ranks")
    group_fits = {}
    per_host = world_size // hosts if hosts and world_size % hosts == 0 else 1
    for n in sizes:
        mine = [s for s in samples if s.ranks == n and s.algorithm != "p2p"]
        group_fits[n] = {a: fit_link(mine, a, n, gamma_s_per_byte, -(-n // per_host))
                         for a in sorted({s.algorithm for s in mine})}
    samples_world = [s for s in samples if s.ranks in (0, world_size)]
    names = sorted({s.algorithm for s in samples_world})
    fits = {n: fit_link(samples_world, n, world_size, gamma_s_per_byte, hosts) for n in names if n != "p2p"}
    notes = list(notes)
    if "p2p" in names:
        p2p = fit_link(samples_world, "p2p", world_size, gamma_s_per_byte, hosts)
    elif fits:
        p2p = fits.get("native") or next(iter(fits.values()))
        notes.append("no point-to-point samples: p2p uses an all-reduce fit")
    else:
        raise UserError("no samples to fit; benchmark at least one algorithm at two sizes")
    return Calibration(world_size, hosts, backend, device, level, gamma_s_per_byte, p2p, fits,
                       tuple(samples), created, tuple(notes), interference_s_per_byte, overlap_slowdown,
                       group_fits=group_fits)


def refit(cal: Calibration) -> Calibration:
    """The same calibration with every fit recomputed from its stored samples."""
    fresh = fit_calibration(cal.samples, world_size=cal.world_size, hosts=cal.hosts, backend=cal.backend,
                            device=cal.device, gamma_s_per_byte=cal.gamma_s_per_byte, level=cal.level,
                            created=cal.created, notes=cal.notes,
                            interference_s_per_byte=cal.interference_s_per_byte,
                            overlap_slowdown=cal.overlap_slowdown)
    return replace(fresh, notes=cal.notes)


def with_groups(whole: Calibration, parts: Sequence[Calibration]) -> Calibration:
    """``whole`` with fits per group size from ``parts``: calibrations each timed on the first ``world_size`` ranks
    of ``whole``'s group (separate ``bench-allreduce`` runs, the same as ``--group-sizes`` times in one); their
    samples join ``whole``'s tagged with their size, and everything is fitted again."""
    tagged = [replace(s, ranks=part.world_size) for part in parts for s in part.samples if s.algorithm != "p2p"]
    bad = sorted({p.world_size for p in parts if not 2 <= p.world_size < whole.world_size})
    if bad or len({p.world_size for p in parts}) < len(parts):
        raise UserError(f"each part must time a different group of 2 to {whole.world_size - 1} ranks, got "
                        f"{sorted(p.world_size for p in parts)}")
    fresh = fit_calibration([*(s for s in whole.samples if not s.ranks), *tagged], world_size=whole.world_size,
                            hosts=whole.hosts, backend=whole.backend, device=whole.device,
                            gamma_s_per_byte=whole.gamma_s_per_byte, level=whole.level, created=whole.created,
                            notes=(*whole.notes, f"group fits from separate runs on the first "
                                   f"{', '.join(str(p.world_size) for p in parts)} ranks"),
                            interference_s_per_byte=whole.interference_s_per_byte,
                            overlap_slowdown=whole.overlap_slowdown)
    return replace(fresh, algorithms=whole.algorithms, p2p=whole.p2p)


# ---- rows of the least-squares problem ----------------------------------------------------

def _variant(model: CostModel, algorithm: str, ranks: list[int], level: int, fit: LinkFit, nbytes: int):
    """The structure the algorithm runs at this size (butterfly: the cheaper variant under ``fit``)."""
    if algorithm != "butterfly":
        return model.structure(algorithm, ranks)
    options = [model.structure(algorithm, ranks, halving=h) for h in (False, True)]
    return min(options, key=lambda st: sum(_round_row(model, rl, level, fit, nbytes)[3] for rl in st))


def _row(model: CostModel, algorithm: str, ranks: list[int], level: int, fit: LinkFit,
         nbytes: int) -> tuple[float, float, float]:
    """(alpha count, beta bytes/S count, known seconds) for one sample."""
    if algorithm == "p2p":
        return 1.0, 1.0, 0.0
    a = b = known = 0.0
    for rl in _variant(model, algorithm, ranks, level, fit, nbytes):
        ra, rb, rk, _ = _round_row(model, rl, level, fit, nbytes)
        a, b, known = a + ra, b + rb, known + rk
    return a, b, known


def _round_row(model: CostModel, rl, level: int, fit: LinkFit, nbytes: int) -> tuple[float, float, float, float]:
    """One round's (alpha count, beta count, known seconds, total seconds under ``fit``)."""
    fits = {lv: (fit if lv == level else model.link(lv)) for lv, _ in rl.level_loads}
    # the measured level bounds the round on ties (that is what its samples can tell)
    a_lv = max(fits, key=lambda lv: (fits[lv].alpha_s, lv == level))
    b_lv, load = max(rl.level_loads, key=lambda t: (t[1] * fits[t[0]].beta_s_per_byte, t[0] == level))
    known = rl.repeat * rl.reduce * nbytes * model.gamma
    a = b = 0.0
    if a_lv == level:
        a = rl.repeat * rl.steps
    else:
        known += rl.repeat * rl.steps * fits[a_lv].alpha_s
    if b_lv == level:
        b = rl.repeat * load
    else:
        known += rl.repeat * load * nbytes * fits[b_lv].beta_s_per_byte
    total = known + a * fit.alpha_s + b * nbytes * fit.beta_s_per_byte
    return a, b, known, total


def _predict(model: CostModel, algorithm: str, ranks: list[int], level: int, fit: LinkFit, nbytes: int) -> float:
    a, b, known = _row(model, algorithm, ranks, level, fit, nbytes)
    return a * fit.alpha_s + b * nbytes * fit.beta_s_per_byte + known
