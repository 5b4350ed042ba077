"""The partitioner's cost model, seen from one process group: what ``auto`` and the hybrid policy ask.

A group's positions are mapped onto a small cluster that has the group's shape: one level when
all positions share a host (or each has its own), two levels (``host`` inside, ``network``
across) otherwise, a host's level as wide as the largest host (so the model's groups are the
topology's hosts, which ``hierarchical`` runs over). A calibration (``hybridpipe bench-allreduce``) replaces
the nominal numbers of the level it measured. Alternatively a caller that has the real cluster
(the runtime, with the plan's cost model) passes that model and the group's global ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hybridpipe.comm.allreduce.topology import Topology
from hybridpipe.partitioner.cost.calibration import Calibration
from hybridpipe.partitioner.cost.cluster import Cluster, Level
from hybridpipe.partitioner.cost.costmodel import CostModel

NOMINAL_HOST_GBPS = 100.0      # between processes of one host (shared memory / loopback)
NOMINAL_NETWORK_GBPS = 10.0
NOMINAL_NETWORK_LATENCY_US = 50.0

# ``auto`` candidates, in order of preference on a tie (native first: gloo's own C++ loop).
AUTO_CANDIDATES = ("native", "ring", "butterfly", "hierarchical", "torus2d", "aggregator")


@dataclass(frozen=True)
class GroupCosts:
    """A cost model and the model's rank for each position of the group (for a plan's cost
    model: the group's global ranks)."""

    model: CostModel
    ranks: tuple[int, ...]

    def topology(self) -> Topology:
        """The model's hierarchical groups as positions (position i = the i-th smallest rank,
        as ``torch.distributed.new_group`` numbers a group's global ranks)."""
        position = {r: i for i, r in enumerate(sorted(self.ranks))}
        return Topology(tuple(tuple(sorted(position[r] for r in g))
                              for g in sorted(self.model.groups(self.ranks), key=min)))

    def fastest(self, nbytes: float, candidates: Sequence[str] = AUTO_CANDIDATES) -> str:
        """The cheapest candidate for an all-reduce of ``nbytes`` (ties: the earlier candidate)."""
        return self.model.fastest_allreduce(nbytes, self.ranks, tuple(candidates))[0]

    def seconds(self, algorithm: str, nbytes: float) -> float:
        return self.model.allreduce_seconds(algorithm, nbytes, self.ranks)

    def halving(self, nbytes: float) -> bool:
        """Butterfly: Rabenseifner (True) or recursive doubling, as the model prices them."""
        return self.model.butterfly_halving(nbytes, self.ranks)

    def torus_shape(self) -> tuple[int, int]:
        return self.model.torus_shape(self.ranks)


def group_costs(topology: Topology, calibration: Calibration | None = None,
                dedicated_aggregator: bool = False) -> GroupCosts:
    """A cost model of the group described by ``topology`` (see the module docstring)."""
    n = topology.size
    g = max((len(u) for u in topology.units), default=1)
    levels: tuple[Level, ...]
    cal_level = calibration.level if calibration else ""
    if 1 < g < n:
        inner, outer = ("host", "network")
        if calibration is not None and cal_level:
            if calibration.hosts > 1:
                outer = cal_level if cal_level != inner else outer
            else:
                inner = cal_level if cal_level != outer else inner
        levels = (Level(inner, g, NOMINAL_HOST_GBPS),
                  Level(outer, len(topology.units), NOMINAL_NETWORK_GBPS, NOMINAL_NETWORK_LATENCY_US))
        rank_of = {p: k * g + i for k, unit in enumerate(topology.units) for i, p in enumerate(unit)}
        ranks = tuple(rank_of[p] for p in range(n))
    else:
        one_host = len(topology.units) == 1
        name = cal_level or ("host" if one_host else "network")
        levels = (Level(name, max(n, 1), NOMINAL_HOST_GBPS) if one_host
                  else Level(name, n, NOMINAL_NETWORK_GBPS, NOMINAL_NETWORK_LATENCY_US),)
        ranks = tuple(range(n))
    cluster = Cluster(levels, memory_gb=1.0)
    return GroupCosts(CostModel(cluster, calibration, aggregator_dedicated=dedicated_aggregator), ranks)
