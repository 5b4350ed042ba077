"""Measured communication costs (``hybridpipe bench-allreduce`` output, JSON ``"format": 1``, 2 or 3).

The cost model's alpha-beta-gamma form: a collective that takes ``a`` sequential message
steps, puts ``b * S`` bytes on a rank's link and reduces ``c * S`` bytes costs
``a * alpha + b * S * beta + c * S * gamma``. ``gamma`` (seconds per byte summed) is measured
locally; ``alpha`` and ``beta`` are fitted per algorithm from timed runs, with ``a, b, c``
given by the algorithm's structure for the measured group (see costmodel.py).

``interference_s_per_byte``: compute time a worker loses per byte its link carries while it
computes (the CPU that sockets, copies and reductions take from a host with few cores),
measured by running a compute loop with and without an all-reduce beside it; 0 if unmeasured.
``overlap_slowdown``: how much longer an all-reduce takes beside that compute than alone (>= 1;
1 if unmeasured); the cost model stretches every all-reduce by it, since syncs overlap compute.

Format 2 adds what ``hybridpipe partition --refine`` / ``autotune`` learnt from runs on the
cluster (``partitioner/refine/refinement.py``); a calibration without it is still written as format 1:

* ``allreduce_slowdown``: ``[[bytes, factor], ...]`` sorted by bytes, one point per size class:
  a measured all-reduce of that size, beside what ran with it in the run, took ``factor`` times
  the model's prediction (interpolated in log-log between points, constant beyond the ends).
* ``compute_slowdown``: every node's compute in a run took this many times the profile's (the
  cluster's contention; a refined profile's per-node corrections come on top of it).
* ``step_overhead_ms``: what the runs' steps took beyond everything the model prices (per-step
  runtime costs, waits of busy ranks); added to every plan's predicted step (no ranking changes).
* ``interference_s_per_byte`` (a format-1 field) is replaced by what the runs showed: the
  measured compute already holds the loss, so the calibrated figure would count it twice.
* ``tied_slowdown``: the tied weights' sums across stages (one float32 all-reduce each, at the
  step's end) took this many times their price (1 if unmeasured).
* ``refined_from``: the run directories the corrections were learnt from.
* ``allreduce_slowdown_groups``: ``{"g": [[bytes, factor], ...]}``, the same per group size of ``g`` ranks
  where the runs had replicated stages of several sizes (``cost/groupfactor.py``); where present the model
  prices by it instead of ``allreduce_slowdown`` (which then holds the pooled classes, for older readers).
* ``replica_compute``: ``[[replicas, factor], ...]``, a stage of that many replicas computes ``factor`` times
  what its nodes compute unreplicated; ``accumulate_s_per_byte``: what each backward that adds to existing
  gradients costs per parameter byte (``cost/computeterms.py``). Absent: neither is charged.

Format 3 adds ``group_fits``: ``{"N": {algorithm: fit}}``, every algorithm fitted again on the
calibration group's first N ranks (``bench-allreduce --group-sizes``), for each N measured other than
``world_size`` (whose fits stay ``algorithms``); its samples carry ``ranks`` (the group they were timed
on). An all-reduce over a group of n ranks is priced with the fit measured at n ranks, alpha and beta
interpolated linearly in log n between the nearest measured sizes, the nearest size's fit beyond them
(:meth:`Calibration.algorithm_fit`); the algorithm's structure at n (rounds, link loads) applies as before.
Formats 1 and 2 (no ``group_fits``) are read as one size, ``world_size``.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass
from dataclasses import field as dc_field
from pathlib import Path

from hybridpipe.errors import UserError
from hybridpipe.jsonfile import check_header, field, figure, read_json, write_json

CALIBRATION_KIND = "calibration"
CALIBRATION_FORMAT = 3
FORMATS_READ = (1, 2, 3)


@dataclass(frozen=True)
class LinkFit:
    """Fitted latency per message step and seconds per byte on the wire."""

    alpha_s: float
    beta_s_per_byte: float
    rel_error: float = 0.0       # median |predicted - measured| / measured over the samples


@dataclass(frozen=True)
class Sample:
    algorithm: str               # an all-reduce algorithm name, or "p2p" for a one-way transfer
    bytes: int
    seconds: float               # median over repeats
    ranks: int = 0               # the size of the group it was timed on; 0: the calibration's world_size


@dataclass(frozen=True)
class Calibration:
    world_size: int              # ranks that took part
    hosts: int                   # distinct hosts among them
    backend: str                 # "gloo" or "nccl"
    device: str                  # "cpu" or "cuda"
    level: str                   # the cluster level the ranks spanned (its name), "" if unknown
    gamma_s_per_byte: float
    p2p: LinkFit
    algorithms: dict[str, LinkFit]
    samples: tuple[Sample, ...] = ()
    created: str = ""
    notes: tuple[str, ...] = dc_field(default=())
    interference_s_per_byte: float = 0.0
    overlap_slowdown: float = 1.0
    allreduce_slowdown: tuple[tuple[float, float], ...] = ()   # (bytes, factor) per size class, by bytes
    compute_slowdown: float = 1.0
    step_overhead_ms: float = 0.0
    refined_from: tuple[str, ...] = ()
    tied_slowdown: float = 1.0
    group_fits: dict[int, dict[str, LinkFit]] = dc_field(default_factory=dict)   # ranks -> algorithm -> fit
    allreduce_slowdown_groups: tuple[tuple[int, tuple[tuple[float, float], ...]], ...] = ()   # per group size
    replica_compute: tuple[tuple[int, float], ...] = ()       # (replicas, compute factor): computeterms.py
    accumulate_s_per_byte: float = 0.0                        # per accumulating backward: computeterms.py

    def algorithm_fit(self, algorithm: str, ranks: int = 0) -> LinkFit | None:
        """``algorithm``'s fit for a group of ``ranks`` ranks (0: ``world_size``): the one measured at that size,
        else alpha and beta interpolated linearly in log(ranks) between the nearest measured sizes, else the
        nearest measured size's; None where the algorithm was not measured."""
        by_size = {n: fits[algorithm] for n, fits in self.group_fits.items() if algorithm in fits}
        if algorithm in self.algorithms:
            by_size[self.world_size] = self.algorithms[algorithm]
        if not by_size:
            return None
        n = ranks or self.world_size
        if n in by_size:
            return by_size[n]
        sizes = sorted(by_size)
        if n <= sizes[0] or n >= sizes[-1]:
            return by_size[sizes[0] if n <= sizes[0] else sizes[-1]]
        hi = next(k for k in sizes if k > n)
        lo = max(k for k in sizes if k < n)
        w = (math.log(n) - math.log(lo)) / (math.log(hi) - math.log(lo))
        a, b = by_size[lo], by_size[hi]
        return LinkFit(a.alpha_s + w * (b.alpha_s - a.alpha_s),
                       a.beta_s_per_byte + w * (b.beta_s_per_byte - a.beta_s_per_byte),
                       max(a.rel_error, b.rel_error))

    @property
    def refined(self) -> bool:
        return (bool(self.allreduce_slowdown or self.allreduce_slowdown_groups or self.refined_from
                     or self.step_overhead_ms or self.replica_compute or self.accumulate_s_per_byte)
                or self.compute_slowdown != 1.0 or self.tied_slowdown != 1.0)

    def to_dict(self) -> dict:
        d: dict = {"kind": CALIBRATION_KIND, "format": 3 if self.group_fits else 2 if self.refined else 1}
        d.update(asdict(self))
        d["samples"] = [{k: v for k, v in asdict(s).items() if k != "ranks" or v} for s in self.samples]
        d["notes"] = list(self.notes)
        if self.group_fits:
            d["group_fits"] = {str(n): {a: asdict(f) for a, f in sorted(fits.items())}
                               for n, fits in sorted(self.group_fits.items())}
        else:
            del d["group_fits"]
        if self.refined:
            d["allreduce_slowdown"] = [list(p) for p in self.allreduce_slowdown]
            d["allreduce_slowdown_groups"] = {str(g): [list(p) for p in pts]
                                              for g, pts in self.allreduce_slowdown_groups}
            if not self.allreduce_slowdown_groups:
                del d["allreduce_slowdown_groups"]
            d["refined_from"] = list(self.refined_from)
            d["replica_compute"] = [list(p) for p in self.replica_compute]
            for key in ("replica_compute", "accumulate_s_per_byte"):     # absent where neutral (older readers)
                if not d[key]:
                    del d[key]
        else:
            for key in ("allreduce_slowdown", "allreduce_slowdown_groups", "compute_slowdown", "step_overhead_ms",
                        "refined_from", "tied_slowdown", "replica_compute", "accumulate_s_per_byte"):
                del d[key]
        return d

    @classmethod
    def from_dict(cls, data: object, source: str = "calibration") -> Calibration:
        version = data.get("format") if isinstance(data, dict) else None
        d = check_header(data, CALIBRATION_KIND, version if version in FORMATS_READ else CALIBRATION_FORMAT, source)
        algos = field(d, "algorithms", dict, source)
        samples = []
        for i, s in enumerate(field(d, "samples", list, source, default=[])):
            where = f"{source}: sample {i}"
            if not isinstance(s, dict):
                raise UserError(f"{where}: expected an object")
            samples.append(Sample(field(s, "algorithm", str, where), figure(s, "bytes", int, where),
                                  figure(s, "seconds", float, where),
                                  field(s, "ranks", int, where, minimum=0, default=0) if version == 3 else 0))
        return cls(
            world_size=field(d, "world_size", int, source, minimum=1),
            hosts=field(d, "hosts", int, source, minimum=1),
            backend=field(d, "backend", str, source),
            device=field(d, "device", str, source),
            level=field(d, "level", str, source, default=""),
            gamma_s_per_byte=figure(d, "gamma_s_per_byte", float, source),
            p2p=_fit_from_dict(field(d, "p2p", dict, source), f"{source}: p2p"),
            algorithms={k: _fit_from_dict(v, f"{source}: algorithms.{k}") for k, v in algos.items()},
            samples=tuple(samples),
            created=field(d, "created", str, source, default=""),
            notes=tuple(str(x) for x in field(d, "notes", list, source, default=[])),
            interference_s_per_byte=figure(d, "interference_s_per_byte", float, source, default=0.0),
            overlap_slowdown=figure(d, "overlap_slowdown", float, source, minimum=1, default=1.0),
            **(_refinement_from_dict(d, source) if version in (2, 3) else {}),
            group_fits=_group_fits_from_dict(d, source) if version == 3 else {},
        )


def _pairs(items: list, where: str, name: str, kind: type, minimum: float) -> list[tuple]:
    """``[[name, factor], ...]`` validated: pairs of a ``kind`` >= ``minimum`` and a factor > 0."""
    points = []
    for i, p in enumerate(items):
        if not (isinstance(p, list) and len(p) == 2):
            raise UserError(f"{where}[{i}] must be a [{name}, factor] pair, got {p!r}")
        pair = {name: p[0], "factor": p[1]}
        points.append((figure(pair, name, kind, f"{where}[{i}]", minimum=minimum),
                       figure(pair, "factor", float, f"{where}[{i}]", minimum=1e-6)))
    return points


def _points_from_list(items: list, where: str) -> tuple[tuple[float, float], ...]:
    """``[[bytes, factor], ...]`` validated: pairs, sorted by bytes, each size once."""
    points = _pairs(items, where, "bytes", float, 1)
    if [b for b, _ in points] != sorted({b for b, _ in points}):
        raise UserError(f"{where} must be sorted by bytes, each size once")
    return tuple(points)


def _refinement_from_dict(d: dict, source: str) -> dict:
    """Format 2's fields (see the module docstring), validated."""
    points = _points_from_list(field(d, "allreduce_slowdown", list, source, default=[]),
                               f"{source}: allreduce_slowdown")
    groups = []
    for key, items in sorted(field(d, "allreduce_slowdown_groups", dict, source, default={}).items(),
                             key=lambda kv: int(kv[0]) if str(kv[0]).isdigit() else 0):
        if not (isinstance(key, str) and key.isdigit() and int(key) >= 2 and isinstance(items, list)):
            raise UserError(f"{source}: allreduce_slowdown_groups takes group sizes of 2 ranks or more, each with "
                            f"a list of [bytes, factor] pairs; got {key!r}")
        groups.append((int(key), _points_from_list(items, f"{source}: allreduce_slowdown_groups.{key}")))
    return {"allreduce_slowdown": points, "allreduce_slowdown_groups": tuple(groups),
            "compute_slowdown": figure(d, "compute_slowdown", float, source, minimum=1e-6, default=1.0),
            "step_overhead_ms": figure(d, "step_overhead_ms", float, source, default=0.0),
            "tied_slowdown": figure(d, "tied_slowdown", float, source, minimum=1e-6, default=1.0),
            "refined_from": tuple(field(d, "refined_from", list, source, default=[], items=str)),
            "replica_compute": _replica_points(field(d, "replica_compute", list, source, default=[]),
                                               f"{source}: replica_compute"),
            "accumulate_s_per_byte": figure(d, "accumulate_s_per_byte", float, source, minimum=0, default=0.0)}


def _replica_points(items: list, where: str) -> tuple[tuple[int, float], ...]:
    """``[[replicas, factor], ...]`` validated: pairs of a replica count >= 2 and a factor > 0, each count once."""
    points = _pairs(items, where, "replicas", int, 2)
    if len({r for r, _ in points}) != len(points):
        raise UserError(f"{where} gives a replica count twice")
    return tuple(sorted(points))


def _group_fits_from_dict(d: dict, source: str) -> dict[int, dict[str, LinkFit]]:
    """Format 3's ``group_fits`` (module docstring), validated."""
    out = {}
    for key, fits in field(d, "group_fits", dict, source, default={}).items():
        where = f"{source}: group_fits.{key}"
        if not (isinstance(key, str) and key.isdigit() and int(key) >= 2):
            raise UserError(f"{where}: keys must be group sizes of 2 ranks or more, got {key!r}")
        if not isinstance(fits, dict):
            raise UserError(f"{where}: expected an object of algorithm fits")
        out[int(key)] = {a: _fit_from_dict(f, f"{where}.{a}") for a, f in fits.items()}
    return out


def _fit_from_dict(d: object, where: str) -> LinkFit:
    if not isinstance(d, dict):
        raise UserError(f"{where}: expected an object with alpha_s and beta_s_per_byte")
    return LinkFit(figure(d, "alpha_s", float, where), figure(d, "beta_s_per_byte", float, where),
                   figure(d, "rel_error", float, where, default=0.0))


def load_calibration(path: str | os.PathLike) -> Calibration:
    """Read and validate a calibration file."""
    return Calibration.from_dict(read_json(path, "calibration"), source=str(path))


def save_calibration(cal: Calibration, path: str | os.PathLike) -> Path:
    return write_json(path, cal.to_dict())
