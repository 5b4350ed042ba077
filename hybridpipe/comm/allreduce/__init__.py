"""The all-reduce family: ring, butterfly, hierarchical, torus2d, aggregator, native and auto.

``hybridpipe.comm.allreduce(tensor, algorithm="auto", group=None)`` sums in place; keep an
:class:`AllReducer` for repeated calls. ``schedule.py`` holds the algorithms as data,
``executor.py`` runs them over isend/irecv, ``dedicated/`` is the aggregator process.
"""

from hybridpipe.comm.allreduce.api import ALGORITHMS, CHOICES, AllReducer, allreduce
from hybridpipe.comm.allreduce.costs import GroupCosts, group_costs
from hybridpipe.comm.allreduce.topology import Topology

__all__ = ["ALGORITHMS", "CHOICES", "AllReducer", "allreduce", "GroupCosts", "group_costs", "Topology"]
