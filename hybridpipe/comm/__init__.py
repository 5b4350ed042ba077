"""hybridpipe.comm: everything that crosses a process.

``allreduce(tensor, algorithm, group)`` / ``AllReducer``: the all-reduce algorithms
(``comm/allreduce``, a callable package); ``HybridDataParallel``: layer-wise overlapped gradient
sync (``comm/hybrid_dp``); ``p2p``: the pipeline's point-to-point channels (``comm/p2p``).
"""

from hybridpipe.comm import allreduce
from hybridpipe.comm.allreduce import ALGORITHMS, CHOICES, AllReducer, Topology
from hybridpipe.comm.hybrid_dp import HybridDataParallel, LayerwiseOptimizer, UnitChoice

__all__ = ["ALGORITHMS", "CHOICES", "AllReducer", "Topology", "allreduce", "HybridDataParallel",
           "LayerwiseOptimizer", "UnitChoice"]
