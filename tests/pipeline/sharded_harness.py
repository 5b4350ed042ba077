"""In-process pipelines whose replicated stages shard (ZeRO-1/2/3), for tests/pipeline/test_sharded.py:
one thread per rank, each sharded stage's replicas running comm/sharded's reduce-scatter and
all-gather over an InProcessGroup (the executors of the real collectives, messages between threads)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from hybridpipe.comm.hybrid_dp import UnitChoice, model_layers
from hybridpipe.comm.sharded import ShardedReplicas, whole_weights
from hybridpipe.partitioner.plan import Plan
from hybridpipe.pipeline.chunks import rank_module
from hybridpipe.pipeline.engine import PipelineEngine
from hybridpipe.pipeline.inprocess import InProcessGradSync, InProcessGroup, InProcessNetwork, ReplicaGroup, run_ranks
from hybridpipe.pipeline.opaque import run_as_written
from hybridpipe.pipeline.plancheck import build_stages
from hybridpipe.pipeline.schedules import Topology
from hybridpipe.pipeline.tied import TiedSync, stage_tied_params, tied_ranks
from hybridpipe.pipeline.zero3 import gate_stages
from hybridpipe.profiles.zoo import resolve_model
from hybridpipe.runtime.sharded_optimizer import ShardedOptimizer
from tests.pipeline.harness import _summer, capture, data_for


def sharded(plan: Plan, level: str, reshard_after_forward: bool = True) -> Plan:
    """``plan`` with every replicated stage sharded at ``level``."""
    return dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, shard=level if s.replicas > 1 else "none",
                                                                      reshard_after_forward=reshard_after_forward)
                                                  for s in plan.stages))



def layer_units(module: torch.nn.Module, exclude, algorithm: str) -> list[UnitChoice]:
    """One sync unit per layer (as a plan lists them), every one with ``algorithm``."""
    return [UnitChoice(layer.param_names, algorithm, 0, layer.name) for layer in model_layers(module, exclude)]


def train_sharded(plan: Plan, steps: int, make: Callable[[list], Any], *, algorithm: str = "ring",
                  wire_dtype: torch.dtype | None = None, observe: Callable[[int, int, Any], None] | None = None,
                  before_step: Callable[[int, Any, torch.nn.Module], Callable[[], bool]] | None = None,
                  first: int = 0, start: dict[int, tuple[dict, dict]] | None = None,
                  total: int | None = None, overlap_gather: bool = False) -> dict[int, dict[str, Any]]:
    """Train ``plan`` (its stages' ``shard`` levels as given) with one thread per rank and ``make``
    (params -> torch optimizer); every rank's {"state": module state dict, "engine", "optimizer",
    "results"}. ``observe(rank, step, engine)`` after each step; ``before_step(rank, optimizer,
    module)`` gives the engine's hook. ``first``: the first step's index (the data of steps
    ``first..first+steps-1`` of ``total`` steps' data); ``start``: per rank (module state dict, whole
    optimizer state dict) to begin from, as a checkpoint restores them. ``overlap_gather``: ZeRO-1/2
    queue the updated weights' all-gathers for the next forward (ShardedReplicas)."""
    spec = resolve_model(plan.model)
    topo = Topology.from_plan(plan)
    network = InProcessNetwork(timeout=60)
    groups = {s.index: InProcessGroup(s.replicas) for s in plan.stages}
    plain = {s.index: ReplicaGroup(s.replicas) for s in plan.stages}
    tied_groups = {ranks: ReplicaGroup(len(ranks)) for ranks in {tied_ranks(plan, g) for g in plan.tied}}

    def rank_fn(rank: int):
        captured = capture(spec, plan.batch_size, 0, plan.granularity)
        stages = build_stages(captured, plan, rank, loss=spec.loss)
        module = rank_module([st.module for st in stages])
        mine, replica = plan.stages_of_rank(rank)
        held = stage_tied_params(plan, [st.index for st in stages], captured.module)
        tied = TiedSync([(params, _summer(tied_groups[ranks], ranks.index(rank))) for ranks, params in held.items()])
        syncs: dict[int, Any] = {}
        for s, st in zip(mine, stages, strict=True):
            if s.shard != "none":
                syncs[s.index] = ShardedReplicas(st.module, groups[s.index].transport(replica),
                                                 layer_units(st.module, tied.params, algorithm), s.shard,
                                                 exclude=tied.params, wire_dtype=wire_dtype,
                                                 reshard_after_forward=s.reshard_after_forward,
                                                 overlap_gather=overlap_gather, varying=run_as_written(st.module))
            else:
                syncs[s.index] = InProcessGradSync(st.module, plain[s.index], replica, exclude=tied.params,
                                                   wire_dtype=wire_dtype)
        gate_stages(stages, [syncs[s.index] for s in mine])
        shards = [v for v in syncs.values() if isinstance(v, ShardedReplicas)]
        optimizer: Any = make(list(module.parameters()))
        if shards:
            optimizer = ShardedOptimizer(module.parameters(), make)
            optimizer.bind(shards)
        engine = PipelineEngine(stages, topo, rank, plan.kind, transport=network.transport(rank), optimizer=optimizer,
                                data=data_for(plan, total or first + steps), sync=syncs, tied=tied if held else None,
                                before_step=before_step(rank, optimizer, module) if before_step else None)

        def run():
            if start is not None:
                with whole_weights(shards):
                    module.load_state_dict(start[rank][0])
                optimizer.load_state_dict(start[rank][1])
            results = []
            for k in range(first, first + steps):
                results.append(engine.run_step(k, drain=k == first + steps - 1))
                if observe is not None:
                    observe(rank, k, engine)
            full = optimizer.state_dict()         # collective over the replicas: before the lanes close
            with whole_weights(shards):
                state = {k: v.clone() for k, v in module.state_dict().items()}
            for v in shards:
                v.close()
            return {"state": state, "engine": engine,
                    "optimizer": optimizer, "full_optimizer_state": full, "results": results, "stages": stages,
                    "module": module}
        return run

    ranks = sorted({r for s in plan.stages for r in s.ranks})
    return run_ranks({r: rank_fn(r) for r in ranks}, network, [*plain.values(), *tied_groups.values()])
