"""Checkpoints of a pipelined run: save every K steps, resume from the newest complete one.

How the worker uses it (every rank, after the process group and the stage are built)::

    ckpt = Checkpointer(args.checkpoint_dir, plan=plan, rank=rank, every=args.checkpoint_every,
                        keep=args.keep_checkpoints)
    start = 0
    if args.resume:
        restored = ckpt.restore()               # collective; None when there is none yet
        if restored is not None:
            stage_module.load_state_dict(restored.model)
            optimizer.load_state_dict(restored.optimizer)
            engine.load_state_dict(restored.engine)
            restore_rng(restored.rng)           # after everything that draws random numbers
            start = restored.step               # the next step to run
    for step in range(start, steps):
        engine.run_step(step, ...)
        if ckpt.due(step + 1):                  # step + 1 steps are done
            ckpt.save(step + 1, model=stage_module.state_dict(), optimizer=optimizer.state_dict(),
                      engine=engine.state_dict())   # collective: every rank calls it

``save`` and ``restore`` are collectives over ``group`` (default: the whole world): every rank
calls them at the same step. Replica 0 of each stage writes the stage's weights and optimizer
state (replicas hold identical ones); every rank writes its own file with the engine state
(PipeDream's stashed weight versions differ between replicas) and its RNG states. After all
ranks reported their files, the stage-0 replica-0 rank writes the manifest (the commit point)
and deletes all but the ``keep`` newest checkpoints. See checkpoint_files.py for the layout.

``restore`` picks the newest step that every rank sees complete; a checkpoint whose files
fail their SHA-256 check on any rank is skipped for the previous one (with a warning).
"""

from __future__ import annotations

import datetime
import logging
import os
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from hybridpipe.errors import UserError
from hybridpipe.runtime.checkpoint_files import (
    atomic_save,
    complete_steps,
    load_file,
    prune,
    rank_file,
    read_manifest,
    remove_newer_than,
    stage_file,
    step_dir,
    write_manifest,
)

log = logging.getLogger(__name__)


def capture_rng() -> dict:
    """This process's RNG states: torch CPU (and CUDA when present), Python, NumPy."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict) -> None:
    """Put back the RNG states of :func:`capture_rng`."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@dataclass(frozen=True)
class Restored:
    """What this rank gets back from a checkpoint."""

    step: int                   # steps completed; run this step next
    model: dict                 # the stage module's state_dict
    optimizer: dict             # the stage optimizer's state_dict
    engine: dict                # the engine's state_dict (stashed weight versions)
    rng: dict                   # this rank's RNG states (restore_rng)
    extra: dict                 # what the worker passed to save(extra=...)
    path: Path


class Checkpointer:
    """Periodic, atomic, collective checkpoints of one rank's part (see the module docstring)."""

    def __init__(self, root: str | os.PathLike, *, plan, rank: int, every: int = 0, keep: int = 3,
                 group: dist.ProcessGroup | None = None, tied: Sequence[Sequence[str]] = ()) -> None:
        if every < 0:
            raise UserError(f"--checkpoint-every must be >= 0 (0: never), got {every}")
        self.root = Path(root)
        self.plan = plan
        self.rank = rank
        self.every = every
        self.keep = keep
        self.group = group
        self.tied = [list(names) for names in tied]      # names of one parameter (merge fills them all in)
        stage, replica = plan.stage_of_rank(rank)
        self.stage, self.replica = stage.index, replica
        self.n_stages = len(plan.stages)
        self.committer = plan.stages[0].ranks[0]

    def due(self, steps_done: int) -> bool:
        """Whether a checkpoint is taken after ``steps_done`` completed steps."""
        return self.every > 0 and steps_done > 0 and steps_done % self.every == 0

    def save(self, steps_done: int, *, model: dict, optimizer: dict, engine: dict | None = None,
             extra: dict | None = None) -> Path:
        """Write this rank's files for ``steps_done``; the committer writes the manifest last."""
        t0 = time.perf_counter()
        d = step_dir(self.root, steps_done)
        records = []
        if self.replica == 0:
            records.append(atomic_save({"step": steps_done, "stage": self.stage, "model": model,
                                        "optimizer": optimizer}, d / stage_file(self.stage)))
        records.append(atomic_save({"step": steps_done, "rank": self.rank, "engine": engine or {},
                                    "rng": capture_rng(), "extra": extra or {}}, d / rank_file(self.rank)))
        everyone = self._gather(records)
        if self.rank == self.committer:
            files = [r for recs in everyone for r in recs]
            write_manifest(self.root, steps_done, files, self._meta(time.perf_counter() - t0))
            for old in prune(self.root, self.keep):
                log.info("deleted old checkpoint %s", old)
        log.info("checkpoint of step %d written in %.2f s", steps_done, time.perf_counter() - t0)
        return d

    def restore(self) -> Restored | None:
        """Load this rank's part of the newest checkpoint complete on every rank (collective)."""
        seen = self._gather(complete_steps(self.root, self.n_stages))
        common = sorted(set.intersection(*map(set, seen)))
        if not common and any(seen):
            newest = max((max(s), r) for r, s in enumerate(seen) if s)
            blind = [r for r, s in enumerate(seen) if not s]
            raise UserError(f"rank {newest[1]} sees checkpoint step {newest[0]} in {self.root} but rank(s) "
                            f"{', '.join(map(str, blind[:8]))} see none: --checkpoint-dir must be one directory "
                            "shared by every node")
        for step in reversed(common):
            self._check_plan(step)
            loaded, problem = self._load(step)
            problems = self._gather(problem)
            if not any(problems):
                if self.rank == self.committer:
                    remove_newer_than(self.root, step)
                log.info("resuming from checkpoint %s", step_dir(self.root, step))
                return loaded
            bad = next(p for p in problems if p)
            log.warning("checkpoint of step %d is unusable (%s); trying the previous one", step, bad)
        return None

    # ---- helpers ----------------------------------------------------------------------
    def _load(self, step: int) -> tuple[Restored | None, str]:
        try:
            own = load_file(self.root, step, rank_file(self.rank))
            part = load_file(self.root, step, stage_file(self.stage))
        except (UserError, OSError, RuntimeError) as e:
            return None, f"rank {self.rank}: {e}"
        return Restored(step=step, model=part["model"], optimizer=part["optimizer"], engine=own["engine"],
                        rng=own["rng"], extra=own["extra"], path=step_dir(self.root, step)), ""

    def _meta(self, seconds: float) -> dict:
        p = self.plan
        return {"model": p.model, "schedule": p.schedule, "micro_batches": p.micro_batches,
                "batch_size": p.batch_size, "n_stages": self.n_stages, "world_size": p.world_size,
                "stages": [{"first_node": s.first_node, "last_node": s.last_node, "ranks": list(s.ranks)}
                           for s in p.stages],
                "tied": self.tied,
                "created": datetime.datetime.now().isoformat(timespec="seconds"), "save_seconds": round(seconds, 3)}

    def _check_plan(self, step: int) -> None:
        m = read_manifest(step_dir(self.root, step))
        mine = self._meta(0.0)
        for key in ("model", "schedule", "micro_batches", "batch_size", "n_stages", "world_size", "stages"):
            if m.get(key) != mine[key]:
                raise UserError(f"checkpoint {step_dir(self.root, step)} was written with another plan "
                                f"({key}: {m.get(key)!r} vs {mine[key]!r}); resume with the plan it was made "
                                "with, or merge it (hybridpipe merge-checkpoint) and start a new run from it")

    def _gather(self, obj: Any) -> list[Any]:
        if not dist.is_initialized():
            if self.plan.world_size != 1:
                raise RuntimeError("Checkpointer needs torch.distributed initialised for a multi-rank plan")
            return [obj]
        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out
