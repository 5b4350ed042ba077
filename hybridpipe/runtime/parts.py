"""The pieces of one worker, each built from the run configuration (no training loop here).

* :func:`load_model`: the model spec, the full model (same seed on every rank, so every rank
  starts from the weights single-process training would) and its captured graph, the whole plan
  checked against it once before any process group exists (pipeline/plancheck.py). A model whose
  weights all come from files (``hf:DIR``) is built with its parameters on the meta device, and
  each rank reads only its own stages' tensors (:meth:`Model.materialize`; runtime/lazy.py); a
  model initialised from the seed, cut into several stages, is built there the same way and each
  rank builds only its own stages' parameters, with one process's values (runtime/seeded.py).
* :func:`make_sync`: HybridDataParallel (summing) for a replicated stage, running the plan's sync
  choices (or launch's overrides), else nothing to sync.
* :func:`make_optimizer`: SGD (momentum), Adam or AdamW over the stage's parameters.
* :func:`make_data`: the (step, micro-batch) -> samples source both ends of the pipeline read.
* :func:`seed_rank`: each rank's own random stream once the model is built.
* :func:`token_counts`: the bookkeeping of ``--loss-normalization tokens`` (pipeline/tokens.py).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn

from hybridpipe.comm.allreduce import GroupCosts
from hybridpipe.comm.allreduce.transport import GroupTransport
from hybridpipe.comm.hybrid_dp import HybridDataParallel
from hybridpipe.comm.sharded import ShardedReplicas
from hybridpipe.errors import UserError
from hybridpipe.partitioner.cost.calibration import load_calibration
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.plan import Plan, Stage
from hybridpipe.pipeline import LocalSync, MicroBatches
from hybridpipe.pipeline.opaque import run_as_written
from hybridpipe.pipeline.plancheck import CheckedPlan, check_plan
from hybridpipe.pipeline.tokens import TokenCounts
from hybridpipe.profiles.capture import CapturedModel
from hybridpipe.profiles.capture_cache import CaptureCache
from hybridpipe.profiles.data import resolve_dataset
from hybridpipe.profiles.losses import batch_coupled_terms, label_counter
from hybridpipe.profiles.zoo import ModelSpec, resolve_model
from hybridpipe.profiles.zoo.registry import factory_spec
from hybridpipe.profiles.zoo.spec import batch_rows
from hybridpipe.runtime.config import RunConfig
from hybridpipe.runtime.lazy import capture_lazily, load_initial, load_whole, materialize
from hybridpipe.runtime.seeded import Recipe, capture_unbuilt, materialize_seeded
from hybridpipe.runtime.sharded_optimizer import ShardedOptimizer
from hybridpipe.runtime.sync import describe_override, override_layers, stage_layers, unit_choices
from hybridpipe.runtime.tensor_files import Weights, open_weights

log = logging.getLogger(__name__)
CAPTURE_CACHE = "capture"        # RUN_DIR/capture/: the capture cache (profiles/capture_cache.py)

# launch's --precision (and the Trainer's precision / reduce_dtype) -> the autocast dtype (None: float32)
PRECISIONS: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Model:
    spec: ModelSpec
    module: nn.Module
    captured: CapturedModel
    checked: CheckedPlan                # the plan checked against ``captured``: the stages are built from it
    weights: Weights | None = None      # the files the meta parameters are read from (None: all in memory)
    recipe: Recipe | None = None        # or the seeded build that gives them (runtime/seeded.py)
    cache: CaptureCache | None = None   # the capture cache its capture went through (written by keep_capture)

    def materialize(self, plan: Plan, stages: Sequence[int]) -> None:
        """Read the weights of ``stages`` (this rank's) from :attr:`weights`, or build them from
        :attr:`recipe`, before building the stages; nothing to do for a model built whole. With a
        recipe, every rank of the job calls it (one all-gather checks that the ranks agree)."""
        if self.weights is not None:
            materialize(self.module, self.captured, self.weights, plan, stages)
        elif self.recipe is not None:
            materialize_seeded(self.module, self.captured, self.recipe, plan, stages)
        self.weights = self.recipe = None

    def keep_capture(self) -> None:
        """Write a capture made at start into the capture cache once the run directory exists
        (a restarted worker reads it instead of capturing: profiles/capture_cache.py)."""
        if self.cache is not None:
            self.cache.write()

    def start_from(self, path: str) -> dict | None:
        """``launch --init-from PATH``: the model's weights from PATH instead (read per stage by
        :meth:`materialize` when the model was built without them); the name-keyed optimizer state
        PATH holds, if any (runtime/lazy.py load_initial)."""
        weights, optimizer = load_initial(path, self.module)
        if self.weights is not None or self.recipe is not None:
            self.weights, self.recipe = weights, None
        else:
            load_whole(self.module, weights)
        return optimizer


def trainer_model(model: Any, plan: Plan, *, precision: str, seed: int, example: Any,
                  loss: Callable[..., torch.Tensor] | None) -> Model:
    """The Trainer's ``model`` argument built and captured for ``precision`` (:func:`spec_of`), or
    the ``Model`` given, which must have been captured for it."""
    built = model if isinstance(model, Model) else build_model(spec_of(model, plan.model, example, loss), plan,
                                                               seed=seed, autocast=PRECISIONS[precision])
    if built.captured.autocast != PRECISIONS[precision]:
        had = next(name for name, d in PRECISIONS.items() if d == built.captured.autocast)
        raise UserError(f"the model was captured for {had} but the trainer runs {precision}: build it with "
                        f"build_model(..., autocast=PRECISIONS[{precision!r}]), or pass the model spec and let the "
                        "trainer build it")
    return built


def spec_of(model: Any, name: str, example: Any, loss: Callable[..., torch.Tensor] | None) -> ModelSpec:
    """The ModelSpec of the Trainer's ``model`` argument: a spec string, a ModelSpec, a Model, a
    factory returning (module, example_input[, loss[, example_target]]) as ``package.module:factory``
    does, or an ``nn.Module`` / a factory of one with ``example`` (one micro-batch of its input) and ``loss``."""
    if isinstance(model, str):
        return resolve_model(model)
    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, Model):
        return model.spec
    if example is None and callable(model) and not isinstance(model, nn.Module):
        return factory_spec(name, getattr(model, "__qualname__", "the model factory"), model)
    if example is None:
        raise UserError("a model given as an nn.Module needs example= (one micro-batch of its input), or pass a "
                        "factory returning (module, example_input[, loss[, example_target]])")
    build = (lambda: model) if isinstance(model, nn.Module) else model
    return ModelSpec(name=name, build=build, example=example, loss=loss)


def load_model(cfg: RunConfig) -> Model:
    """Build and capture the plan's model (seeded by ``--seed``) and check the whole plan against
    it before any process group exists (pipeline/plancheck.py: graph signature, every cut's values,
    buffers, tied parameters, every replicated stage's sync layers). Captured under autocast for a
    16-bit precision (the plan's, with launch's override)."""
    cache = Path(cfg.run_dir) / CAPTURE_CACHE if cfg.run_dir else None
    return build_model(resolve_model(cfg.model), cfg.plan, seed=cfg.training.seed,
                       autocast=PRECISIONS[cfg.plan.precision], cache=cache)


def build_model(spec: ModelSpec, plan: Plan, *, seed: int, autocast: torch.dtype | None = None,
                cache: Path | None = None, whole: bool = False) -> Model:
    """:func:`load_model` for a resolved spec: the model built after ``torch.manual_seed(seed)``
    (the same weights on every rank), captured with the plan's batch size and granularity (under
    ``torch.autocast`` to ``autocast``, for a job that computes in it; through the capture cache in
    ``cache``: a restarted worker reads it, :meth:`Model.keep_capture` writes a new one,
    profiles/capture_cache.py), and the whole plan checked
    against it once (pipeline/plancheck.py). The model is built and captured with its parameters on
    the meta device when a spec naming its weights' files is covered by them (runtime/lazy.py), or
    when the plan has several stages (runtime/seeded.py), in 16-bit precision too (on fake CPU
    tensors, profiles/meta.py): :meth:`Model.materialize` then gives the rank's stages their
    values. ``whole``: every rank
    builds the whole model on the CPU (as before each rank built only its own stages;
    benchmarks/build_memory.py)."""
    torch.manual_seed(seed)
    example = spec.example_input(plan.batch_size, torch.Generator().manual_seed(seed))
    weights = open_weights(spec.weights) if spec.weights is not None else None
    stagewise = spec.weights is None and len(plan.stages) > 1 and not whole
    captures = CaptureCache(cache)
    lazy = (capture_lazily(spec, example, plan, weights, cache=captures, autocast=autocast) if weights is not None
            else None)
    unbuilt = capture_unbuilt(spec, example, plan, seed, cache=captures, autocast=autocast) if stagewise else None
    recipe = None
    if lazy is not None:
        module, captured, checked, weights = lazy
    elif unbuilt is not None:
        module, captured, checked, recipe = unbuilt
    else:
        weights = None
        module = spec.build()
        captured = captures.capture(module, example, granularity=plan.granularity, leaf_modules=spec.leaf_modules,
                                    autocast=autocast)
        checked = check_plan(captured, plan)
    return Model(spec, module, captured, checked, weights, recipe, captures)


def make_sync(plan: Plan, stage_module: nn.Module, stage: Stage, group: dist.ProcessGroup | None,
              exclude: Collection[nn.Parameter] = (), *, allreduce: str | None = None,
              calibrations: Sequence[str] = (), aggregator: str | None = None, wire_dtype: torch.dtype | None = None):
    """The stage's gradient sync: replicas sum their gradients (the schedule scales them), each
    layer with the plan's algorithm, sync unit and lane, unless ``allreduce`` / ``calibrations``
    (launch's ``--allreduce`` / ``--calibration``) override it (then the stage's first rank prints
    what changed; ``runtime/sync.py``). ``exclude``d parameters (tied across stages) are summed by
    the TiedSync instead. ``wire_dtype``: gradients all-reduced in that dtype (mixed precision)."""
    if stage.replicas == 1:
        return LocalSync()
    measured = [load_calibration(p) for p in calibrations]
    model = CostModel(plan.cluster, measured or None, aggregator_dedicated=aggregator is not None)
    planned = stage_layers(stage, stage_module, model, exclude)
    layers = planned
    if allreduce is not None or measured:
        layers = override_layers(planned, allreduce or "hybrid", stage.ranks, model)
        if dist.get_rank() == stage.ranks[0]:
            flags = " ".join(([f"--allreduce {allreduce}"] if allreduce else [])
                             + [f"--calibration {p}" for p in calibrations])
            print(describe_override(stage.index, flags, planned, layers), flush=True)
    costs = GroupCosts(model, stage.ranks)
    varying = run_as_written(stage_module)
    if stage.shard != "none":                 # ZeRO-1/2/3: the same units, reduce-scattered (comm/sharded)
        log.info("stage %d: replicas shard %s", stage.index, stage.shard)
        return ShardedReplicas(stage_module, GroupTransport(group), unit_choices(layers), stage.shard, exclude=exclude,
                               wire_dtype=wire_dtype, hosts=costs.topology().units, torus_shape=costs.torus_shape(),
                               reshard_after_forward=stage.reshard_after_forward,
                               varying=varying)
    hdp = HybridDataParallel(stage_module, group, units=unit_choices(layers), costs=costs,
                             aggregator=aggregator, reduce="sum", exclude=exclude, wire_dtype=wire_dtype,
                             maybe_absent=varying)
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


def make_optimizer(kind: str, params, *, lr: float, momentum: float = 0.0, weight_decay: float = 0.0,
                   trainable_only: bool = True):
    """``sgd`` (with momentum), ``adam`` (L2 weight decay, added to the gradient) or ``adamw``
    (decoupled weight decay) over ``params`` (partitioner/plan.py OPTIMIZER_HELP); those that
    require no gradient are left out unless not ``trainable_only`` (a sharded optimizer's pieces)."""
    params = [p for p in params if p.requires_grad or not trainable_only]
    if not params:
        return NoParameters()
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=momentum, weight_decay=weight_decay)
    if kind == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=weight_decay)
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
    raise UserError(f"unknown optimizer {kind!r}; choose sgd, adam or adamw")


def build_optimizer(kind: Any, module: nn.Module, lr: float, momentum: float, weight_decay: float,
                    sharded: bool = False) -> Any:
    """The Trainer's optimizer: ``kind`` "sgd"/"adam" (:func:`make_optimizer`) or a callable
    ``params -> torch.optim.Optimizer`` given the module's trainable parameters. ``sharded``: a
    ShardedOptimizer running that optimizer on the replicas' shards (bound to them once the syncs
    exist; runtime/sharded_optimizer.py)."""
    if sharded and any(p.requires_grad for p in module.parameters()):
        def make(params: list) -> Any:
            if callable(kind):
                return kind(params)
            return make_optimizer(str(kind), params, lr=lr, momentum=momentum, weight_decay=weight_decay,
                                  trainable_only=False)
        return ShardedOptimizer(module.parameters(), make)
    if callable(kind):
        params = [p for p in module.parameters() if p.requires_grad]
        return kind(params) if params else make_optimizer("sgd", [], lr=lr)
    return make_optimizer(str(kind), module.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)


def make_data(cfg: RunConfig, spec: ModelSpec) -> MicroBatches:
    """Micro-batch m of step k = samples (k*M + m)*B ... + B - 1 of the dataset (wrapping around),
    as every rank and the single-process reference compute it."""
    size = cfg.dataset_size or cfg.steps * cfg.global_batch
    dataset = resolve_dataset(cfg.dataset, spec, size=size, seed=cfg.training.seed)
    return MicroBatches(dataset, cfg.batch_size, cfg.micro_batches, targets=spec.loss is not None,
                        shuffle_seed=cfg.training.seed if cfg.shuffle else None)


def held_out_seed(seed: int) -> int:
    """The seed of the synthetic held-out samples (never one a training run of a nearby seed uses)."""
    return seed + 1_000_003


def make_eval_data(cfg: RunConfig, spec: ModelSpec) -> MicroBatches:
    """The held-out micro-batches of ``--eval-every`` (evaluation j reads step j of this source):
    ``--eval-dataset``, or synthetic samples of another seed (the same task, other samples)."""
    size = cfg.eval_batches * cfg.global_batch
    dataset = resolve_dataset(cfg.eval_dataset or "synthetic", spec, size=size, seed=held_out_seed(cfg.training.seed))
    return MicroBatches(dataset, cfg.batch_size, cfg.micro_batches, targets=spec.loss is not None)


def weights_digest(module: nn.Module) -> str:
    """SHA-256 of every parameter (names, dtypes, shapes and bytes)."""
    return _digest(module.named_parameters())


def buffers_digest(module: nn.Module) -> str:
    """SHA-256 of every buffer, saved or not (BatchNorm's running statistics, which replicas combine
    exactly, and constants such as rotary frequencies)."""
    return _digest(module.named_buffers())


def _digest(named) -> str:
    h = hashlib.sha256()
    for name, p in named:
        t = p.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def seed_rank(seed: int, rank: int) -> None:
    """Give this rank its own random stream (dropout etc.) after the common one built the model."""
    torch.manual_seed(int(np.random.SeedSequence((seed, rank)).generate_state(1, np.uint64)[0]))


def token_counts(model: Model, device: torch.device, group: dist.ProcessGroup | None, batch_size: int,
                 note: Callable[[torch.Tensor], None] | None = None, micro_batches: int = 1) -> TokenCounts:
    """Token-weighted loss's bookkeeping (pipeline/tokens.py): the step's [loss sum, tokens] summed
    over ``group`` (every rank) by one all-reduce; a Hugging Face model's
    own-loss labels counted on the first stage; the first step's divisor from the tokens
    ``micro_batches`` micro-batches of ``batch_size`` rows of the example hold. Refuses an own-loss
    model it cannot count, or an example without labels."""
    spec = model.spec
    count = label_counter(model.module) if spec.loss is None else None
    if spec.loss is None and count is None:
        raise UserError(f"--loss-normalization tokens: {spec.name} computes its own loss and hybridpipe cannot "
                        "count the tokens it averages over; give its factory a loss function returning "
                        "(loss_sum, count), or use --loss-normalization micro-batch")
    coupled = batch_coupled_terms(model.module) if count is not None else []
    if coupled and (not dist.is_initialized() or dist.get_rank() == 0):       # one line per job, not per rank
        log.warning("hybridpipe: --loss-normalization tokens: %s's router loss (%s) is computed per micro-batch and "
                    "weighted by its tokens, as with gradient accumulation, not over the global batch at once",
                    spec.name, ", ".join(coupled))
    example = spec.example if spec.example is not None else spec.example_input(1)
    rows = batch_rows(example) or 1
    if count is not None:                   # an example without labels: refused here, in one line
        per_row = float(count(example)) / rows
    else:
        target = spec.example_target(1)
        per_row = float(sum(t.numel() for t in pytree.tree_leaves(target) if isinstance(t, torch.Tensor)) or 1)

    def total(part: torch.Tensor) -> torch.Tensor:
        t = part.to(device=device, dtype=torch.float64).clone()
        dist.all_reduce(t, group=group)
        return t
    return TokenCounts(total, count_input=count, note=note, divisor=per_row * batch_size * micro_batches)
