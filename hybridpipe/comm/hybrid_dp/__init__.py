"""Hybrid data parallelism (seed 000): per-layer all-reduce started from gradient hooks on a
background lane, the algorithm per layer from the cost model, waits deferred to the layer's
next use."""

from hybridpipe.comm.hybrid_dp.optimizer import LayerwiseOptimizer
from hybridpipe.comm.hybrid_dp.policy import POLICIES, SyncUnit, UnitChoice, plan_units, units_from_choices
from hybridpipe.comm.hybrid_dp.units import Layer, group_small, latency_bound_bytes, model_layers
from hybridpipe.comm.hybrid_dp.wrapper import HybridDataParallel

__all__ = ["HybridDataParallel", "LayerwiseOptimizer", "POLICIES", "SyncUnit", "UnitChoice", "plan_units",
           "units_from_choices", "Layer", "group_small", "latency_bound_bytes", "model_layers"]
