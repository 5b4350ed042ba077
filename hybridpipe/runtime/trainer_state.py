"""The Trainer's weights and state outside a step: reading them (:attr:`~TrainerState.module`,
:meth:`~TrainerState.gathered`), checkpointing and resuming them (runtime/trainer.py's Trainer is one).

Under ZeRO-3 a rank's weights are freed between steps (comm/sharded/gathered.py): they are read
inside ``gathered()`` (collective), as torch FSDP's ``summon_full_params``; a save or a load
gathers them itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn

from hybridpipe.comm.sharded import readable_weights, whole_weights
from hybridpipe.errors import UserError
from hybridpipe.partitioner.plan import Plan
from hybridpipe.pipeline import PipelineEngine
from hybridpipe.profiles.capture import tied_parameters
from hybridpipe.runtime.checkpoint import Checkpointer, Restored, reseed, restore_rng
from hybridpipe.runtime.dirlock import SaveLocks
from hybridpipe.runtime.groups import Process
from hybridpipe.runtime.lr import SchedulerFactory, replay_scheduler
from hybridpipe.runtime.parts import Model
from hybridpipe.runtime.scaler import LossScaler
from hybridpipe.runtime.sharded_optimizer import for_checkpoint
from hybridpipe.runtime.training_config import TrainingConfig


class TrainerState:
    """The weights, optimizer, scheduler, scaler and engine state of a Trainer, read, saved and
    loaded (every method collective but :attr:`module`). The Trainer sets the attributes below."""

    plan: Plan
    proc: Process
    config: TrainingConfig
    model: Model
    stages: list[Any]
    syncs: dict[int, Any]
    optimizer: Any
    scheduler: Any
    scaler: LossScaler | None
    engine: PipelineEngine
    step: int
    _module: nn.Module
    _make_scheduler: SchedulerFactory | None
    _fresh_groups: list[dict[str, Any]]
    _checkpointers: dict[str, Checkpointer]
    _locks: SaveLocks

    @property
    def module(self) -> nn.Module:
        """This rank's parameters and buffers (every chunk's, each once) with their current values.
        Under ZeRO-3 (a stage's ``shard`` "parameters") they are freed between steps: read them inside
        :meth:`gathered` (or after :meth:`close`); here that is a UserError, not a read of freed memory."""
        if not readable_weights(self.syncs.values()):
            raise UserError("trainer.module: under ZeRO-3 (shard \"parameters\") this rank's weights are freed "
                            "between steps; read them inside `with trainer.gathered() as module:` (collective: "
                            "every rank calls it), or save them with trainer.save()")
        return self._module

    @contextlib.contextmanager
    def gathered(self) -> Iterator[nn.Module]:
        """:attr:`module` with the whole, updated weights inside (collective: every rank enters it
        between steps, like torch FSDP's ``summon_full_params``); under ZeRO-3 the weights are
        gathered, and what is written to them inside is kept (the shards are taken from them) and
        freed at the exit. Nested, or around :meth:`save`, gathers once."""
        with whole_weights(self.syncs.values()):
            yield self._module

    def save(self, directory: str | Path, *, keep: int = 3) -> Path:
        """Checkpoint the steps done so far into ``directory`` (collective; runtime/checkpoint.py's
        format, keeping the ``keep`` newest): weights, optimizer, scheduler, engine and RNG states.
        The first save into a directory locks it until ``close``: UserError on every rank when
        another job holds it or it holds checkpoints this trainer did not :meth:`load` (dirlock.SaveLocks)."""
        self._locks.before_save(directory)
        ckpt = self._checkpointer(directory, keep)
        extra = {"scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                 "scaler": self.scaler.state_dict() if self.scaler is not None else None}
        with whole_weights(self.syncs.values()):                # ZeRO-3: the full weights, gathered
            return ckpt.save(self.step, module=self._module, optimizer=for_checkpoint(self.optimizer),
                             engine=self.engine.state_dict(), extra=extra,
                             chunks={st.index: st.module for st in self.stages})

    def load(self, directory: str | Path) -> Restored | None:
        """Resume from the newest usable checkpoint in ``directory`` (collective): None when it holds
        none; else what was restored (``.step`` steps done). Training continues bit-identically
        (a checkpoint of another plan is resharded; then each rank's RNG is re-seeded)."""
        ckpt = self._checkpointer(directory, 3)
        restored = ckpt.restore(self._module)
        self._locks.loaded(directory)
        if restored is None:
            return None
        if restored.resharded and self.scheduler is not None and self._make_scheduler is not None:
            # the saved schedulers' state is per parameter group of other ranks: replay it to the step
            self.scheduler = replay_scheduler(self._make_scheduler, self.optimizer, self._fresh_groups, restored.step)
        with whole_weights(self.syncs.values()):                # ZeRO-3: each replica keeps its pieces
            ckpt.load_into(restored, self._module, self.optimizer)
        self.step = restored.step
        if restored.engine:
            self.engine.load_state_dict(restored.engine)
        sched = restored.extra.get("scheduler")
        if self.scheduler is not None and sched is not None and not restored.resharded:
            self.scheduler.load_state_dict(sched)
            # the checkpoint keeps the optimizer's state, not its hyperparameters: the schedule's
            # learning rate of the next step comes back from the scheduler
            for group, lr in zip(self.optimizer.param_groups, self.scheduler.get_last_lr(), strict=True):
                group["lr"] = lr
        scaler = restored.extra.get("scaler")
        if self.scaler is not None and scaler is not None:
            self.scaler.load_state_dict(scaler)
        if restored.rng is not None:
            restore_rng(restored.rng)           # after everything that draws random numbers
        else:                                   # resharded from another plan
            reseed(self.config.seed, self.proc.rank, restored.step)
        return restored

    def _checkpointer(self, directory: str | Path, keep: int) -> Checkpointer:
        key = str(Path(directory).resolve())
        if key not in self._checkpointers:
            self._checkpointers[key] = Checkpointer(directory, plan=self.plan, rank=self.proc.rank, keep=keep,
                                                    tied=tied_parameters(self.model.module))
        self._checkpointers[key].keep = keep
        return self._checkpointers[key]
