"""The pieces of one worker, each built from the run configuration (no training loop here).

* :func:`load_model`: the model spec, the full model (same seed on every rank, so every rank
  starts from the weights single-process training would) and its traced graph, checked against
  the plan before any process group exists.
* :func:`make_sync`: HybridDataParallel (summing) for a replicated stage, running the plan's sync
  choices (or launch's overrides), else nothing to sync.
* :func:`make_optimizer`: SGD (momentum) or Adam over the stage's parameters.
* :func:`make_data`: the (step, micro-batch) -> samples source both ends of the pipeline read.
* :func:`seed_rank`: each rank's own random stream once the model is built.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
from torch import fx, nn

from hybridpipe.comm.allreduce import GroupCosts
from hybridpipe.comm.hybrid_dp import HybridDataParallel
from hybridpipe.errors import UserError
from hybridpipe.partitioner.calibration import load_calibration
from hybridpipe.partitioner.costmodel import CostModel
from hybridpipe.partitioner.plan import Stage, check_plan_fits
from hybridpipe.pipeline import LocalSync, MicroBatches
from hybridpipe.profiles.data import resolve_dataset
from hybridpipe.profiles.format import graph_signature
from hybridpipe.profiles.trace import graph_edges, node_infos, trace_model
from hybridpipe.profiles.zoo import ModelSpec, resolve_model
from hybridpipe.runtime.config import RunConfig
from hybridpipe.runtime.sync import describe_override, override_layers, stage_layers, unit_choices

log = logging.getLogger(__name__)


@dataclass
class Model:
    spec: ModelSpec
    module: nn.Module
    graph: fx.GraphModule


def load_model(cfg: RunConfig) -> Model:
    """Build and trace the plan's model (seeded by ``cfg.seed``); refuse a plan made for another graph."""
    spec = resolve_model(cfg.model)
    torch.manual_seed(cfg.seed)
    module = spec.build()
    gm = trace_model(module, spec.leaf_modules)
    signature = graph_signature(node_infos(gm), graph_edges(gm))
    check_plan_fits(cfg.plan, model=None, signature=None, batch_size=None, world_size=None,
                    n_nodes=len(gm.graph.nodes))
    check_plan_fits(cfg.plan, model=None, signature=signature, batch_size=None, world_size=None)
    return Model(spec, module, gm)


def make_sync(cfg: RunConfig, stage_module: nn.Module, stage: Stage, group: dist.ProcessGroup | None):
    """The stage's gradient sync: replicas sum their gradients (the schedule scales them), each
    layer with the plan's algorithm, sync unit and lane, unless ``--allreduce`` / ``--calibration``
    override it (then the stage's first rank prints what changed; ``runtime/sync.py``)."""
    if stage.replicas == 1:
        return LocalSync()
    calibrations = [load_calibration(p) for p in cfg.calibrations]
    model = CostModel(cfg.plan.cluster, calibrations or None, aggregator_dedicated=cfg.aggregator is not None)
    planned = stage_layers(stage, stage_module, model)
    layers = planned
    if cfg.allreduce is not None or calibrations:
        layers = override_layers(planned, cfg.allreduce or "hybrid", stage.ranks, model)
        if dist.get_rank() == stage.ranks[0]:
            flags = " ".join(([f"--allreduce {cfg.allreduce}"] if cfg.allreduce else [])
                             + [f"--calibration {p}" for p in cfg.calibrations])
            print(describe_override(stage.index, flags, planned, layers), flush=True)
    hdp = HybridDataParallel(stage_module, group, units=unit_choices(layers), costs=GroupCosts(model, stage.ranks),
                             aggregator=cfg.aggregator, reduce="sum")
    log.info("stage %d: gradient sync: %s", stage.index,
             ", ".join(f"{u.name}:{u.algorithm}{'/lane 1' if u.lane else ''}" for u in hdp.units))
    return hdp


class NoParameters:
    """The optimizer of a stage without parameters (e.g. only a pooling or reshaping layer)."""

    param_groups: list = []

    def step(self) -> None:
        pass

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


def make_optimizer(kind: str, params, *, lr: float, momentum: float = 0.0, weight_decay: float = 0.0):
    """``sgd`` (with momentum) or ``adam`` over ``params``."""
    params = [p for p in params if p.requires_grad]
    if not params:
        return NoParameters()
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    raise UserError(f"unknown optimizer {kind!r}; choose sgd or adam")


def make_data(cfg: RunConfig, spec: ModelSpec) -> MicroBatches:
    """Micro-batch m of step k = samples (k*M + m)*B ... + B - 1 of the dataset (wrapping around),
    as every rank and the single-process reference compute it."""
    size = cfg.dataset_size or cfg.steps * cfg.global_batch
    dataset = resolve_dataset(cfg.dataset, spec, size=size, seed=cfg.seed)
    return MicroBatches(dataset, cfg.batch_size, cfg.micro_batches)


def weights_digest(module: nn.Module) -> str:
    """SHA-256 of every parameter (names, dtypes, shapes and bytes). Buffers are left out: like
    BatchNorm's running statistics, they may differ between replicas that saw different data."""
    h = hashlib.sha256()
    for name, p in module.named_parameters():
        t = p.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def seed_rank(seed: int, rank: int) -> None:
    """Give this rank its own random stream (dropout etc.) after the common one built the model."""
    torch.manual_seed(int(np.random.SeedSequence((seed, rank)).generate_state(1, np.uint64)[0]))
