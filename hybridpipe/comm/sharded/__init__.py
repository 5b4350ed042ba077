"""Sharded replicas (ZeRO-1/2/3): reduce-scatter per sync unit as backward produces it, the update on
each replica's shard, the all-gather of the updated weights (ZeRO-3: of each unit's weights before
its use, gathered.py); the halves of the all-reduce
algorithms, run from their one description (partitioner/cost/collectives.py)."""

from hybridpipe.comm.sharded.gathered import UnitWeights
from hybridpipe.comm.sharded.halves import Halves, HalvesRunner, plan_halves
from hybridpipe.comm.sharded.replicas import LEVELS, Piece, ShardedReplicas, readable_weights, whole_weights

__all__ = ["Halves", "HalvesRunner", "plan_halves", "LEVELS", "Piece", "ShardedReplicas", "UnitWeights",
           "readable_weights", "whole_weights"]
