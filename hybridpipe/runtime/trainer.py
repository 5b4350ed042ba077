"""hybridpipe's Python API for the user's own training loop, run under torchrun (one process per rank).

    trainer = hybridpipe.Trainer("gpt[layers=4]", "plan.json", lr=3e-4, optimizer="adam",
                                 lr_scheduler=lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, 100),
                                 clip_grad_norm=1.0)
    for step in range(100):
        loss = trainer.train_step(x, y)         # the global batch: micro-batch size x micro-batches rows
        held_out = trainer.eval_step(xv, yv)    # forward only, evaluation mode, nothing changes
    trainer.save("ckpt")                        # collective; trainer.load("ckpt") resumes
    trainer.close()

The trainer builds this rank's part of the plan: the model (built after ``torch.manual_seed(seed)``
so every rank starts from the same weights), its capture and the plan's checks, the process
groups, the stage, the replicas' gradient sync, the tied-weight sync, the p2p channels, the
optimizer (and scheduler) and the engine. Every call is collective: every rank makes it, in the
same order. ``train_step`` returns the step's mean loss on every rank: the last stage's ranks
hold it; where the plan's lists prove it (step_news.py: plain chains under gpipe/1f1b/zb-h1, ...)
it rides upstream on the step's last gradient frames, else one 16-byte broadcast (or all-reduce)
per step hands it to all (``clip_grad_norm`` adds one 8-byte all-reduce per step for the global norm).
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable, Collection
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from hybridpipe.comm.sharded import ShardedReplicas
from hybridpipe.errors import UserError
from hybridpipe.partitioner.plan import Plan, load_plan
from hybridpipe.pipeline import PipelineEngine, Topology, check_plan
from hybridpipe.pipeline.chunks import rank_module
from hybridpipe.pipeline.schedules import settle_phase
from hybridpipe.pipeline.stage import loss_of
from hybridpipe.pipeline.zero3 import gate_stages
from hybridpipe.profiles.zoo import ModelSpec
from hybridpipe.runtime.aligned import align_state
from hybridpipe.runtime.allocator import keep_freed_memory
from hybridpipe.runtime.batches import GivenBatches, is_micro_batch_stream, split_batch, take_micro_batches
from hybridpipe.runtime.checkpoint import Checkpointer
from hybridpipe.runtime.dirlock import SaveLocks
from hybridpipe.runtime.groups import init_distributed, replica_groups, stage_channels
from hybridpipe.runtime.loader import MicroBatchSlice, StepLoader
from hybridpipe.runtime.lr import SchedulerFactory, fresh_hyperparameters
from hybridpipe.runtime.nonfinite import NonFiniteWatch
from hybridpipe.runtime.parts import (
    PRECISIONS,
    Model,
    build_optimizer,
    make_sync,
    seed_rank,
    token_counts,
    trainer_model,
)
from hybridpipe.runtime.prestep import BeforeStep
from hybridpipe.runtime.scaler import LossScaler
from hybridpipe.runtime.sharded_optimizer import ShardedOptimizer
from hybridpipe.runtime.step_news import FrameNews, carried_routes, loss_totals
from hybridpipe.runtime.tied import align_tied, repeated_tied, tied_process_groups, tied_sync
from hybridpipe.runtime.timeline import trace_all_reduces
from hybridpipe.runtime.trainer_state import TrainerState
from hybridpipe.runtime.training_config import TrainingConfig, flushes, with_settings

ModelArg = str | ModelSpec | Model | nn.Module | Callable[[], nn.Module]
OptimizerArg = str | Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None


class Trainer(TrainerState):
    """This rank's part of a pipelined hybrid-parallel job (see the module docstring).

    ``model``: a zoo / ``hf:`` / ``package.module:factory`` spec string, an ``nn.Module`` (built the
    same on every rank), or a factory called after ``torch.manual_seed(seed)``; with the last two
    give ``example`` (one micro-batch of input) and ``loss(output, target)`` (None: the model
    returns its own loss, e.g. a Hugging Face model given ``labels``). A ``Model`` given must have
    been captured for the precision (``build_model(autocast=)``). ``plan``: a Plan or a path.
    ``config``: the settings (runtime/training_config.py's TrainingConfig, a ``help`` per field:
    optimizer, lr, clipping, precision, loss normalization, communication, ...); ``settings``:
    field names replacing its values (``Trainer(spec, plan, lr=3e-4)``); None fields take the
    plan's. :attr:`config` is the result. ``optimizer``: a name (a setting) or ``params ->
    torch.optim.Optimizer``. ``lr_scheduler``: ``optimizer -> torch.optim.lr_scheduler.*``
    (stepped once per training step on every rank; see runtime/lr.py for launch's schedules).
    ``data``: a source of micro-batches by (step, micro-batch) for steps given no batch (launch's
    ``MicroBatches``). ``recorder``: a timeline recorder (launch's). ``locked_dir``: a checkpoint
    directory whose lock (runtime/dirlock.py) this job already holds (launch's ``--checkpoint-dir``).
    """

    def __init__(self, model: ModelArg, plan: Plan | str | Path, config: TrainingConfig | None = None, *,
                 loss: Callable[..., torch.Tensor] | None = None, optimizer: OptimizerArg = None,
                 lr_scheduler: SchedulerFactory | None = None, data: Any = None, example: Any = None,
                 recorder: Any = None, locked_dir: str | Path | None = None, **settings: Any) -> None:
        self.plan = plan if isinstance(plan, Plan) else load_plan(str(plan))
        if isinstance(optimizer, str):
            settings["optimizer"] = optimizer
        self.config = cfg = with_settings(config, settings).for_plan(self.plan)
        precision = str(cfg.precision)
        self.model = trainer_model(model, self.plan, precision=precision, seed=cfg.seed, example=example, loss=loss)
        self.proc, self._owned = init_distributed(cfg.backend, cfg.timeout)
        if self.proc.world_size != self.plan.world_size:
            raise UserError(f"the plan needs {self.plan.world_size} workers but the job has {self.proc.world_size}; "
                            f"start it with torchrun --nproc-per-node {self.plan.world_size} (or on as many hosts)")
        plan, rank = self.plan, self.proc.rank
        # on the CPU, freed activations stay with the process for the next micro-batch (allocator.py)
        self.allocator = keep_freed_memory() if cfg.cpu_allocator == "keep" and self.proc.device.type == "cpu" \
            else "system"
        self.stage_plans, self.replica = plan.stages_of_rank(rank)    # one, or V model chunks (virtual stages)
        self.stage_plan = self.stage_plans[0]
        mine = [s.index for s in self.stage_plans]
        self.model.materialize(plan, mine)       # hf:DIR built without weights: read this rank's stages only
        self.is_last = len(plan.stages) - 1 in mine
        self.takes_targets = self.model.spec.loss is not None
        self.scaler = LossScaler(cfg.loss_scale) if precision == "fp16" else None
        self._scaler_at: tuple[int, dict] | None = None   # (step, the scaler's state when that step began)
        self.step = 0                                # training steps done
        self._recorder = recorder
        self.watch = NonFiniteWatch(self.proc.device, skip=cfg.skip_nonfinite, flushing=flushes(plan),
                                    stage=self.stage_plan.index)
        loss_fn = loss_of(self.model.spec.loss) if cfg.loss_normalization == "tokens" else \
            self.watch.wrap_mean(loss_of(self.model.spec.loss))
        checked = self.model.checked if self.model.checked.plan == plan else check_plan(self.model.captured, plan)
        self.stages = [st.to(self.proc.device) for st in checked.stages_of_rank(rank, loss=loss_fn)]
        self._module = rank_module([st.module for st in self.stages])    # every chunk's parameters, each once
        align_state(plan, rank, [(st.index, st.module) for st in self.stages])   # each rank's own build: one model
        uncounted: Collection[int] = repeated_tied(plan, mine, self.model.module)
        seed_rank(cfg.seed, rank)
        sharded = any(s.shard != "none" for s in self.stage_plans)
        if sharded and cfg.in_place:
            raise UserError("in-place recovery re-forms the replica groups, which a sharded stage's optimizer state is "
                            "split over; use \"shard\": \"none\" or restart from checkpoints")
        self.optimizer = build_optimizer(optimizer if callable(optimizer) else cfg.optimizer, self._module, cfg.lr,
                                         cfg.momentum, cfg.weight_decay, sharded)
        self._make_scheduler, self._fresh_groups = lr_scheduler, fresh_hyperparameters(self.optimizer)
        self.scheduler = lr_scheduler(self.optimizer) if lr_scheduler is not None and \
            isinstance(self.optimizer, torch.optim.Optimizer) else None
        self._before_step = BeforeStep(self._module, self.optimizer, self.proc.device, self.scaler, cfg.clip_grad_norm,
                                       uncounted)
        self._feed = GivenBatches(keep=settle_phase(Topology.from_plan(plan), plan.kind) + 2, fallback=data,
                                  rank=rank, targets=self.takes_targets)
        self._connect()
        if recorder is not None:
            recorder.align(dist.barrier)
        self.last_losses: dict[int, float] = {}      # this rank's micro-batch losses of the last step (last stage)
        self.last_tokens: dict[int, float] = {}      # with tokens: their valid tokens
        self.last_peak_memory_bytes = 0               # what this rank's stage held at its peak in the last step
        self._checkpointers: dict[str, Checkpointer] = {}
        self._locks = SaveLocks(self.proc.rank, held=locked_dir)      # the checkpoint directories saved into

    def _connect(self) -> None:
        """Everything of this rank that talks to others, for :attr:`plan` (collective: every rank,
        in the same order): replica, tied and statistics groups, gradient syncs, p2p channels, engine."""
        plan, rank, cfg = self.plan, self.proc.rank, self.config
        timeout = cfg.timeout
        self.stage_plans, self.replica = plan.stages_of_rank(rank)
        self.stage_plan = self.stage_plans[0]
        groups = replica_groups(plan, timeout)
        tied_groups, mine = tied_process_groups(plan, timeout), [s.index for s in self.stage_plans]
        align_tied(plan, mine, self.model.module, tied_groups)
        tied = tied_sync(plan, mine, self.model.module, tied_groups)
        # the last stage alone knows a loss was bad: unreplicated, it need not wait for the others and
        # they need only its flag, unless a recovery in place needs every rank to pass the check first;
        # where the lists prove it, the flag and the loss totals ride on gradient frames (step_news.py)
        last = plan.stages[-1]
        self.watch.source = last.ranks[0] if last.replicas == 1 and not cfg.in_place else None
        routes = carried_routes(plan, cfg)
        self.news = FrameNews(routes[rank], self.watch, self.proc.device) if routes is not None else None
        self.watch.carried = routes is not None
        self._stats: dist.ProcessGroup | None = None     # made where a step needs it, else at a first eval
        if routes is None or self._before_step.needed or cfg.loss_normalization == "tokens":
            self._stats_group()
        self._before_step.group, self._before_step.replica = self._stats, self.replica
        self.tokens = (token_counts(self.model, self.proc.device, self._stats, plan.batch_size, self.watch.note,
                                    plan.micro_batches) if cfg.loss_normalization == "tokens" else None)
        self.syncs = {s.index: make_sync(plan, st.module, s, groups.get(s.index), allreduce=cfg.allreduce,
                                         calibrations=cfg.calibrations, aggregator=cfg.aggregator,
                                         wire_dtype=PRECISIONS[str(cfg.reduce_dtype)],
                                         exclude=tied.params if tied is not None else ())
                      for s, st in zip(self.stage_plans, self.stages, strict=True)}
        gate_stages(self.stages, self.syncs.values())          # sharded replicas: gates in the graphs
        if isinstance(self.optimizer, ShardedOptimizer):      # its state lives on the replicas' shards
            self.optimizer.bind([v for v in self.syncs.values() if isinstance(v, ShardedReplicas)])
        topo = Topology.from_plan(plan)
        recorder = self._recorder
        trace_all_reduces(recorder, self.syncs.values())
        self.channels = stage_channels(topo, rank, plan.kind, cfg.comm_mode, self.proc.device, timeout,
                                       on_transfer=recorder.on_transfer if recorder is not None else None)
        guarded: Any = self.watch.wrap_optimizer(self.optimizer)     # an optimizer that checks the loss first
        self.engine = PipelineEngine(self.stages, topo, rank, plan.kind, transport=self.channels,
                                     optimizer=guarded, data=self._feed,
                                     sync=self.syncs, recorder=recorder, tied=tied,
                                     before_step=self._before_step if self._before_step.needed else None,
                                     autocast=PRECISIONS[str(cfg.precision)],
                                     loss_scale=self._loss_scale if self.scaler is not None else None,
                                     tokens=self.tokens, memory_every=cfg.memory_every, news=self.news)

    def _stats_group(self) -> dist.ProcessGroup:
        """The whole world's group for the step's statistics (collective when it is made: every rank
        makes it at the same call, in _connect or at the first eval_step)."""
        if self._stats is None:
            self._stats = dist.new_group(list(range(self.proc.world_size)),
                                         timeout=datetime.timedelta(seconds=self.config.timeout))
        return self._stats

    def reform(self, plan: Plan) -> None:
        """Go on in a re-formed world (in-place recovery, runtime/recovery.py: the default group is
        already the survivors'): ``plan`` gives this rank the same stages; its groups, syncs,
        channels and engine are built anew (collective among the survivors), the model, optimizer,
        scheduler and their state kept. What the interrupted step left is dropped: its gradients,
        its messages, the loss scale it changed."""
        self.channels.abandon()
        for sync in self.syncs.values():
            abandon = getattr(sync, "abandon", None)
            if abandon is not None:
                abandon()
        for p in self._module.parameters():
            p.grad = None
        if self.scaler is not None and self._scaler_at is not None and self._scaler_at[0] == self.step:
            self.scaler.load_state_dict(self._scaler_at[1])
        self.watch.reset()
        self.plan = plan
        self.proc = replace(self.proc, rank=dist.get_rank(), world_size=dist.get_world_size())
        self._feed.rank = self._locks.rank = self.proc.rank
        self._checkpointers = {k: c.for_plan(plan, self.proc.rank) for k, c in self._checkpointers.items()}
        self._connect()

    @property
    def stage(self):
        """This rank's stage (a rank with several model chunks has :attr:`stages`; :attr:`module`
        holds every chunk's parameters)."""
        if len(self.stages) > 1:
            raise UserError(f"rank {self.proc.rank} holds stages {[st.index for st in self.stages]} (virtual "
                            "stages): use trainer.stages, or trainer.module for all their parameters")
        return self.stages[0]

    @property
    def sync(self):
        """The gradient sync of this rank's stage (see :attr:`syncs` for one per model chunk)."""
        return self.syncs[self.stage_plan.index]

    # ---- steps ---------------------------------------------------------------------------
    def train_step(self, batch: Any = None, target: Any = None, *, drain: bool = False) -> float:
        """One training step of the plan's schedule on the global ``batch`` (and ``target``), on
        an iterator of micro-batches, or on what :meth:`loader` yields; ranks whose stage reads
        neither may pass nothing. Returns the step's mean loss over its micro-batches (with
        ``tokens``: over the global batch's tokens), on every rank. ``drain``: pipedream only, finish
        every micro-batch in flight (before an ``eval_step`` or the end)."""
        step = self.step
        if self.scaler is not None:
            self._scaler_at = (step, self.scaler.state_dict())
        if batch is not None or target is not None:
            self._feed.put(step, *self._micro_batches(batch, target))
        result = self.engine.run_step(step, drain=drain)
        self.watch.after_step(step, result.losses)
        if self.scheduler is not None:
            self.scheduler.step()
        self.step += 1
        self.last_losses = {m: float(v) for m, v in sorted(result.losses.items())}
        self.last_tokens = {m: float(v) for m, v in sorted(result.counts.items())}
        self.last_peak_memory_bytes = result.peak_memory_bytes
        if result.total is not None:            # tokens: summed over every rank at the step already
            return float(result.mean_loss or 0.0)
        if self.news is not None:               # the totals came with the step's last gradient frames
            t = self.news.totals(step, result.losses)
            return float(t[0] / t[1]) if t[1] > 0 else math.nan
        return self._mean(result.losses)

    def eval_step(self, batch: Any = None, target: Any = None) -> float:
        """Forward-only evaluation of one global batch (or iterator of micro-batches), pipelined
        like a training step, in evaluation mode (no dropout, batch norm on running statistics),
        without gradients: no weight, optimizer or scheduler state changes. The mean loss on every
        rank."""
        if self.config.comm_mode == "sra":
            raise UserError("eval_step needs comm_mode 'sa' or 'per-tensor': the 'sra' channels follow the "
                            "training step's fixed order of transfers")
        if self.plan.kind.asynchronous and self.engine.phase != 0:
            raise UserError(f"under {self.plan.schedule}, micro-batches of the training stream are in flight: call "
                            "train_step(..., drain=True) before eval_step")
        given = GivenBatches(keep=1, rank=self.proc.rank, targets=self.takes_targets)
        if batch is not None or target is not None:
            given.put(0, *self._micro_batches(batch, target))
        counts: dict[int, torch.Tensor] | None = {} if self.tokens is not None else None
        return self._mean(self.engine.run_eval(given, counts=counts), counts)

    def loader(self, dataset: Dataset, *, epoch: int = 0, shuffle: bool = True, seed: int | None = None,
               num_workers: int = 0, collate_fn: Any = None, start: int = 0) -> StepLoader:
        """One epoch of ``dataset`` for this rank, a step at a time (pass each item to train_step or
        eval_step): the first stage's replicas load only their own micro-batches, the last stage's
        their targets, the others nothing (runtime/loader.py). ``seed`` (default: the trainer's)
        and ``epoch`` fix the shuffle, the same on every rank; pinned memory on GPU. ``start``: the
        epoch's first step to yield (after :meth:`load` inside an epoch, the steps it already did)."""
        M = self.plan.micro_batches
        mine = [m for m in range(M) if m % self.stage_plan.replicas == self.replica]
        return StepLoader(dataset, batch_size=self.plan.batch_size, micro_batches=M, mine=mine,
                          inputs=self.stage_plan.index == 0, targets=self.is_last, pairs=self.takes_targets,
                          seed=self.config.seed if seed is None else seed, epoch=epoch, shuffle=shuffle,
                          num_workers=num_workers, pin_memory=self.proc.device.type == "cuda",
                          collate_fn=collate_fn, start=start)

    @property
    def last_grad_norm(self) -> float | None:
        """The global gradient norm before clipping, of the last step (None: no clipping)."""
        return self._before_step.last_grad_norm

    @property
    def lr(self) -> float | None:
        """The learning rate of the next step (None on a stage without parameters)."""
        groups = getattr(self.optimizer, "param_groups", [])
        return float(groups[0]["lr"]) if groups else None

    def close(self) -> None:
        """Close the channels and the sync's threads; release the checkpoint directories' locks;
        leave the job if the trainer joined it."""
        self.channels.close()
        self._locks.release()
        for sync in self.syncs.values():
            close = getattr(sync, "close", None)
            if close is not None:
                close()
        if self._owned and dist.is_initialized():
            dist.destroy_process_group()
            self._owned = False

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- helpers -------------------------------------------------------------------------
    def _micro_batches(self, batch: Any, target: Any) -> tuple[Any, Any]:
        M, B = self.plan.micro_batches, self.plan.batch_size
        if isinstance(batch, MicroBatchSlice):
            return batch.inputs, batch.targets
        if is_micro_batch_stream(batch):
            return take_micro_batches(batch, M, targets=self.takes_targets)
        inputs = split_batch(batch, M, B) if batch is not None else None
        targets = split_batch(target, M, B, "target") if target is not None else None
        return inputs, targets

    def _mean(self, losses: dict[int, torch.Tensor], counts: dict[int, torch.Tensor] | None = None) -> float:
        """The mean of the step's micro-batch losses, on every rank (one all-reduce of two numbers, or
        a broadcast from the last stage's one rank, which then holds every loss: see ``watch.source``);
        with ``counts`` the losses are sums and the mean is over the counted tokens."""
        t = loss_totals(losses, counts, self.proc.device)
        if self.watch.source is not None:
            dist.broadcast(t, src=self.watch.source, group=self._stats_group())
        else:
            dist.all_reduce(t, group=self._stats_group())
        return float(t[0] / t[1]) if t[1] > 0 else math.nan

    def _loss_scale(self) -> float:
        return self.scaler.scale if self.scaler is not None else 1.0
