"""The cluster description (``--cluster cluster.json``): a hierarchy of levels, innermost first.

Example, 4 hosts x 1 worker on 1 Gbit/s::

    {"levels": [{"name": "node", "workers": 1, "bandwidth_gbps": 1000},
                {"name": "network", "workers": 4, "bandwidth_gbps": 1, "latency_us": 50}],
     "memory_gb": 16}

``workers`` is the fan-out at that level, so the cluster holds the product of all fan-outs.
``bandwidth_gbps`` is the bandwidth of one unit's link at that level (a host's NIC for the
network level), shared by all workers inside the unit.
Global ranks are laid out innermost first: rank r sits in unit ``r // span(k)`` of level k,
where ``span(k)`` is the product of the fan-outs of levels 0..k.
"""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

from hybridpipe.errors import UserError
from hybridpipe.jsonfile import MAX_FIGURE, field, figure, read_json, short_json

CLUSTER_KIND = "cluster"
CLUSTER_FORMAT = 1
MIN_BANDWIDTH_GBPS = 1e-6       # 1 kbit/s: below it a transfer's seconds are no longer a figure (1e-300 was accepted)


@dataclass(frozen=True)
class Level:
    """One level of the hierarchy: ``workers`` units of the level below, joined at ``bandwidth_gbps``."""

    name: str
    workers: int
    bandwidth_gbps: float
    latency_us: float = 0.0

    @property
    def bytes_per_s(self) -> float:
        return self.bandwidth_gbps * 1e9 / 8


@dataclass(frozen=True)
class Cluster:
    levels: tuple[Level, ...]
    memory_gb: float

    @property
    def total_workers(self) -> int:
        return math.prod(lv.workers for lv in self.levels)

    def span(self, k: int) -> int:
        """Workers inside one unit of level ``k`` (product of fan-outs 0..k)."""
        return math.prod(lv.workers for lv in self.levels[: k + 1])

    def level_between(self, rank_a: int, rank_b: int) -> int:
        """Index of the innermost level whose units hold both ranks (their link's level)."""
        for k in range(len(self.levels)):
            if rank_a // self.span(k) == rank_b // self.span(k):
                return k
        raise UserError(f"ranks {rank_a} and {rank_b} are outside a cluster of {self.total_workers} workers")

    def with_workers(self, n: int) -> Cluster:
        """The same cluster cut down (outermost fan-out first) to ``n`` workers; error if impossible."""
        if n == self.total_workers:
            return self
        inner = self.span(len(self.levels) - 2) if len(self.levels) > 1 else 1
        if n <= 0 or n % inner:
            raise UserError(f"--workers {n} does not fit the cluster: it must be a positive multiple of "
                            f"{inner} (the workers in one {self.levels[-2].name if len(self.levels) > 1 else 'unit'})")
        outer = self.levels[-1]
        return Cluster(self.levels[:-1] + (Level(outer.name, n // inner, outer.bandwidth_gbps, outer.latency_us),),
                       self.memory_gb)

    def to_dict(self) -> dict:
        return {"kind": CLUSTER_KIND, "format": CLUSTER_FORMAT,
                "levels": [asdict(lv) for lv in self.levels], "memory_gb": self.memory_gb}

    @classmethod
    def from_dict(cls, data: object, source: str = "cluster") -> Cluster:
        """Validate a cluster description; ``kind``/``format`` are optional in hand-written files."""
        if not isinstance(data, dict):
            raise UserError(f"{source}: expected a JSON object with \"levels\" and \"memory_gb\"")
        if data.get("kind", CLUSTER_KIND) != CLUSTER_KIND:
            raise UserError(f"{source}: not a cluster file (its \"kind\" is {short_json(data.get('kind'))}); pass "
                            f"a cluster description (\"kind\": \"{CLUSTER_KIND}\" or none), e.g. "
                            "examples/clusters/4x1gbit.json")
        if data.get("format", CLUSTER_FORMAT) != CLUSTER_FORMAT:
            raise UserError(f"{source}: cluster format {short_json(data.get('format'))} is not supported (this "
                            f"hybridpipe reads format {CLUSTER_FORMAT}); write \"format\": {CLUSTER_FORMAT} or leave "
                            "it out")
        raw = field(data, "levels", list, source)
        if not raw:
            raise UserError(f"{source}: \"levels\" is empty; give at least one level, innermost first")
        levels = []
        for i, lv in enumerate(raw):
            where = f"{source}: level {i}"
            if not isinstance(lv, dict):
                raise UserError(f"{where}: expected an object with workers and bandwidth_gbps")
            bw = figure(lv, "bandwidth_gbps", float, where, minimum=MIN_BANDWIDTH_GBPS)
            levels.append(Level(name=field(lv, "name", str, where, default=f"level{i}"),
                                workers=figure(lv, "workers", int, where, minimum=1),
                                bandwidth_gbps=bw,
                                latency_us=figure(lv, "latency_us", float, where, default=0.0)))
        total = math.prod(lv.workers for lv in levels)
        if total > MAX_FIGURE:
            raise UserError(f"{source}: the levels' workers multiply to more than {MAX_FIGURE:g} workers; describe the "
                            "cluster you have")
        names = [lv.name for lv in levels]
        if len(set(names)) != len(names):
            raise UserError(f"{source}: level names must be unique, got {names}")
        mem = figure(data, "memory_gb", float, source)
        if mem <= 0:
            raise UserError(f"{source}: memory_gb must be > 0, got {mem}")
        return cls(tuple(levels), mem)


def load_cluster(path: str | os.PathLike) -> Cluster:
    """Read and validate a cluster file."""
    return Cluster.from_dict(read_json(path, "cluster"), source=str(path))
