"""Measured communication costs (``hybridpipe bench-allreduce`` output, JSON ``"format": 1``).

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
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from dataclasses import field as dc_field
from pathlib import Path

from hybridpipe.errors import UserError
from hybridpipe.jsonfile import check_header, field, read_json, write_json

CALIBRATION_KIND = "calibration"
CALIBRATION_FORMAT = 1


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

    def to_dict(self) -> dict:
        d = {"kind": CALIBRATION_KIND, "format": CALIBRATION_FORMAT}
        d.update(asdict(self))
        d["samples"] = [asdict(s) for s in self.samples]
        d["notes"] = list(self.notes)
        return d

    @classmethod
    def from_dict(cls, data: object, source: str = "calibration") -> Calibration:
        d = check_header(data, CALIBRATION_KIND, CALIBRATION_FORMAT, source)
        algos = field(d, "algorithms", dict, source)
        samples = []
        for i, s in enumerate(field(d, "samples", list, source, default=[])):
            where = f"{source}: sample {i}"
            if not isinstance(s, dict):
                raise UserError(f"{where}: expected an object")
            samples.append(Sample(field(s, "algorithm", str, where), field(s, "bytes", int, where, minimum=0),
                                  field(s, "seconds", float, where, minimum=0)))
        return cls(
            world_size=field(d, "world_size", int, source, minimum=1),
            hosts=field(d, "hosts", int, source, minimum=1),
            backend=field(d, "backend", str, source),
            device=field(d, "device", str, source),
            level=field(d, "level", str, source, default=""),
            gamma_s_per_byte=field(d, "gamma_s_per_byte", float, source, minimum=0),
            p2p=_fit_from_dict(field(d, "p2p", dict, source), f"{source}: p2p"),
            algorithms={k: _fit_from_dict(v, f"{source}: algorithms.{k}") for k, v in algos.items()},
            samples=tuple(samples),
            created=field(d, "created", str, source, default=""),
            notes=tuple(str(x) for x in field(d, "notes", list, source, default=[])),
            interference_s_per_byte=field(d, "interference_s_per_byte", float, source, minimum=0, default=0.0),
            overlap_slowdown=field(d, "overlap_slowdown", float, source, minimum=1, default=1.0),
        )


def _fit_from_dict(d: object, where: str) -> LinkFit:
    if not isinstance(d, dict):
        raise UserError(f"{where}: expected an object with alpha_s and beta_s_per_byte")
    return LinkFit(field(d, "alpha_s", float, where, minimum=0), field(d, "beta_s_per_byte", float, where, minimum=0),
                   field(d, "rel_error", float, where, minimum=0, default=0.0))


def load_calibration(path: str | os.PathLike) -> Calibration:
    """Read and validate a calibration file."""
    return Calibration.from_dict(read_json(path, "calibration"), source=str(path))


def save_calibration(cal: Calibration, path: str | os.PathLike) -> Path:
    return write_json(path, cal.to_dict())
