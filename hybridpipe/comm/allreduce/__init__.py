"""The all-reduce family: ring, butterfly, hierarchical, torus2d, aggregator, native and auto.

``hybridpipe.comm.allreduce(tensor, algorithm="auto", group=None)`` sums in place; keep an
:class:`AllReducer` for repeated calls. The algorithms are written once, as data, in
``partitioner/cost/collectives.py`` (what the cost model prices); ``schedule.py`` maps them onto
element ranges, ``executor.py`` runs them over isend/irecv, ``dedicated/`` is the aggregator process.

This package is callable: ``hybridpipe.comm.allreduce(...)`` is :func:`allreduce`. (A plain
function of that name in ``hybridpipe.comm`` would shadow the package and break
``import hybridpipe.comm.allreduce.<module> as name``.)
"""

import sys
import types

from hybridpipe.comm.allreduce.api import ALGORITHMS, CHOICES, AllReducer, allreduce, downward_group
from hybridpipe.comm.allreduce.costs import GroupCosts, group_costs
from hybridpipe.comm.allreduce.topology import Topology

__all__ = ["ALGORITHMS", "CHOICES", "AllReducer", "allreduce", "downward_group", "GroupCosts", "group_costs",
           "Topology"]


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return allreduce(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
