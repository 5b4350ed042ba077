"""Checkpoints of a pipelined run: save every K steps, resume from the newest usable one, in any
plan of the same model.

How the worker uses it (every rank, after the process group and the stage are built)::

    ckpt = Checkpointer(args.checkpoint_dir, plan=plan, rank=rank, every=args.checkpoint_every,
                        keep=args.keep_checkpoints, tied=tied_parameters(model))
    start = 0
    if args.resume:
        restored = ckpt.restore(stage.module)   # collective; None when the directory holds none
        if restored is not None:
            ckpt.load_into(restored, stage.module, optimizer)     # weights + optimizer state by name
            if restored.engine:                 # written by this very plan
                engine.load_state_dict(restored.engine)
            restore_rng(restored.rng) if restored.rng else reseed(seed, rank, restored.step)
            start = restored.step               # the next step to run
    for step in range(start, steps):
        engine.run_step(step, drain=ckpt.due(step + 1))     # pipedream: nothing in flight at a save
        if ckpt.due(step + 1):                  # step + 1 steps are done
            ckpt.save(step + 1, module=stage.module, optimizer=optimizer, engine=engine.state_dict())

``save`` and ``restore`` are collectives over ``group`` (default: the whole world): every rank
calls them at the same step. Replica 0 of each stage writes the stage's weights and optimizer
state under the model's names (a rank with several model chunks -- virtual stages -- writes each
chunk's stage file) (runtime/reshard.py: a tied parameter once, by the lowest stage
that reads it, after every rank compared its copy's digest; optimizer state keyed by parameter
name); every rank writes its own file with the engine state and its RNG states. After all ranks
reported their files and names, the stage-0 replica-0 rank writes the manifest (the plan, and
an index name -> stage file), commits the directory (checkpoint_files.commit) and keeps the
``keep`` newest *verified-good* checkpoints of its own lineage (this training and the runs it
was resumed from; checkpoint_prune.py: a corrupt one is moved aside, never counted, never
deleted), never touching anyone else's; every rank returns once the step is committed. The
files go to a staging directory named by the job (``.step-N.TAG.tmp``: two jobs never share
one). A file that cannot be written on any rank (a full disk) stops every rank with one line
naming it and the cause (AgreedError); the step is not committed and older ones stay as they were.

``restore`` reads, for this rank's stage, the names it needs from whichever stage files hold
them (resharding), whatever plan wrote them; when that plan is this one it also gives back the
rank's engine and RNG states, else ``resharded`` says how the plans differ (engine state empty,
RNG to be re-seeded). It never starts over silently. It walks the checkpoints from the newest:
one that is incomplete (killed while saving), corrupt (SHA-256), or not plain data on some rank
is skipped for the previous one, and named in ``Restored.skipped``; one of another model or
another global batch, or one whose file matches its manifest yet is not plain data (replaced:
possibly hostile), stops the run (``AgreedError``, every rank the same line); when every one is
skipped the run stops too, naming each and why. Only a directory holding no checkpoint at all
starts from step 0 (``restore`` returns None). Nothing is deleted on the way.

Everything saved is plain data for ``torch.load(weights_only=True)``: tensors, numbers,
strings, lists and dicts; the Python and NumPy RNG states are stored as lists of ints. (No
torch.distributed.checkpoint: its metadata file is a pickle.)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from hybridpipe.errors import AgreedError, UserError, one_line
from hybridpipe.runtime.checkpoint_files import (
    MANIFEST,
    NotPlainData,
    atomic_save,
    commit,
    load_file,
    rank_file,
    read_manifest,
    stage_file,
    staging_dir,
    step_dir,
    step_dirs,
    why_incomplete,
    write_manifest,
)
from hybridpipe.runtime.checkpoint_meta import plan_change, plan_meta
from hybridpipe.runtime.checkpoint_prune import describe_aside, prune
from hybridpipe.runtime.reshard import (
    canonical_names,
    canonical_state,
    indexed_optimizer_state,
    merge_named,
    named_optimizer_state,
    optimizer_names,
    pick,
    restrict_named,
    tensor_digest,
)
from hybridpipe.runtime.rng_state import capture_rng
from hybridpipe.runtime.rng_state import reseed as reseed
from hybridpipe.runtime.rng_state import restore_rng as restore_rng

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Restored:
    """What this rank gets back from a checkpoint."""

    step: int                   # steps completed; run this step next
    model: dict                 # the stage module's state_dict (its own keys)
    optimizer: dict             # the stage's optimizer state, name-keyed (reshard.named_optimizer_state)
    engine: dict                # the engine's state_dict (stashed weight versions); {} after a reshard
    rng: dict | None            # this rank's RNG states (restore_rng); None after a reshard
    extra: dict                 # what the worker passed to save(extra=...) (resharded: rank 0's)
    path: Path
    skipped: tuple[str, ...] = ()   # newer checkpoints passed over: "step-000009: why"
    resharded: str = ""         # "" when written by this very plan, else how that plan differs


class Checkpointer:
    """Periodic, atomic, collective checkpoints of one rank's part (see the module docstring)."""

    def __init__(self, root: str | os.PathLike, *, plan, rank: int, every: int = 0, keep: int = 3,
                 group: dist.ProcessGroup | None = None, tied: Sequence[Sequence[str]] = (), tag: str = "") -> None:
        if every < 0:
            raise UserError(f"--checkpoint-every must be >= 0 (0: never), got {every}")
        self.root = Path(root)
        self.plan = plan
        self.rank = rank
        self.every = every
        self.keep = keep
        self.group = group
        self.tied = [list(names) for names in tied]      # names of one parameter (merge fills them all in)
        self.canon = canonical_names(self.tied)
        stages, replica = plan.stages_of_rank(rank)
        self.stages = [s.index for s in stages]      # one, or the rank's model chunks (virtual stages)
        self.stage, self.replica = self.stages[0], replica
        self.committer = plan.stages[0].ranks[0]
        self.lineage = ""           # set by restore (the checkpoint's) or by the first save (new)
        self.tag = tag              # the job's staging name (staging_dir); "": agreed at the first save
        self.trusted: set[int] = set()  # steps known good: written by this job, or verified by every rank's load

    def for_plan(self, plan, rank: int) -> Checkpointer:
        """This directory's checkpointer for another plan or rank (an in-place recovery re-formed the
        world): the lineage (every rank knows it), staging name and known-good steps carried over, so
        the ``keep`` newest are still counted over the whole run."""
        again = Checkpointer(self.root, plan=plan, rank=rank, every=self.every, keep=self.keep, tied=self.tied)
        again.lineage, again.tag, again.trusted = self.lineage, self.tag, set(self.trusted)
        return again

    def not_mine(self, stage: int) -> set[str]:
        """Tied parameters another stage writes than ``stage`` (the lowest stage that reads one writes it)."""
        return {self.canon.get(t.param, t.param) for t in getattr(self.plan, "tied", ()) if min(t.stages) != stage}

    def due(self, steps_done: int) -> bool:
        """Whether a checkpoint is taken after ``steps_done`` completed steps."""
        return self.every > 0 and steps_done > 0 and steps_done % self.every == 0

    def save(self, steps_done: int, *, module: nn.Module, optimizer: Any, engine: dict | None = None,
             extra: dict | None = None, chunks: Mapping[int, nn.Module] | None = None) -> Path:
        """Write this rank's files for ``steps_done`` (weights and optimizer state under the model's
        names); the committer writes the manifest last. ``module``: the rank's module (with
        virtual stages every chunk's, pipeline/chunks.rank_module) and ``chunks`` its model chunks
        by stage: each chunk's names go to that stage's file. A file that cannot be written (a
        full disk) on any rank stops every rank with the same line (AgreedError): the step is not
        committed, its staging directory is removed, older checkpoints are left as they were."""
        t0 = time.perf_counter()
        if not self.tag:        # one staging name per job and, unless resumed, a new lineage: rank 0's picks
            tag, lineage = self._gather((uuid.uuid4().hex[:12], uuid.uuid4().hex[:16]))[0]
            self.tag, self.lineage = str(tag), self.lineage or str(lineage)
        d = staging_dir(self.root, steps_done, self.tag)
        records: list = []
        held: dict[int, list[str]] = {}
        digests: dict[str, str] = {}
        try:
            self._write(steps_done, d, module, optimizer, engine, extra, chunks, records, held, digests)
            problem = ""
        except UserError as e:
            problem = f"rank {self.rank}: {one_line(e)}"
        everyone = self._gather((problem, records, held, digests, self._copies(module, chunks)))
        self._agree_saved(steps_done, d, [p for p, _, _, _, _ in everyone])
        _check_tied_copies([dg for _, _, _, dg, _ in everyone], steps_done)
        problem = ""
        if self.rank == self.committer:
            try:
                self._commit(steps_done, d, [(recs, by_stage) for _, recs, by_stage, _, _ in everyone],
                             [copies for *_, copies in everyone], t0)
            except UserError as e:
                problem = f"rank {self.rank}: {one_line(e)}"
        self._agree_saved(steps_done, d, self._gather(problem))     # every rank returns once it is committed
        self.trusted.add(steps_done)
        log.info("checkpoint of step %d written in %.2f s", steps_done, time.perf_counter() - t0)
        return step_dir(self.root, steps_done)

    def _write(self, steps_done: int, d: Path, module: nn.Module, optimizer: Any, engine: dict | None,
               extra: dict | None, chunks: Mapping[int, nn.Module] | None, records: list,
               held: dict[int, list[str]], digests: dict[str, str]) -> None:
        """This rank's files of a save (its stages' files on replica 0, its own rank file), filling
        ``records``, ``held`` (names by stage) and ``digests`` (of tied parameters)."""
        if self.replica == 0:
            model = canonical_state(module.state_dict(), self.canon)
            named = named_optimizer_state(optimizer.state_dict(), optimizer_names(optimizer, module, self.canon))
            tied_here = sorted(set(self.canon.values()) & set(model))
            digests.update({n: tensor_digest([model[n], named["state"].get(n)]) for n in tied_here})
            for s in self.stages:
                keys = model if chunks is None else {self.canon.get(k, k) for k in chunks[s].state_dict()}
                held[s] = [n for n in model if n in keys and n not in self.not_mine(s)]
                records.append(atomic_save({"step": steps_done, "stage": s, "model": {n: model[n] for n in held[s]},
                                            "optimizer": restrict_named(named, held[s])}, d / stage_file(s)))
        records.append(atomic_save({"step": steps_done, "rank": self.rank, "engine": engine or {},
                                    "rng": capture_rng(), "extra": extra or {}}, d / rank_file(self.rank)))

    def _commit(self, steps_done: int, d: Path, parts: list[tuple[list, dict[int, list[str]]]],
                copies: list[dict[int, dict[str, str]]], t0: float) -> None:
        """The committer's part: the manifest (with every rank's replica ``copies``: their digests by
        stage), the rename to step-N, pruning."""
        self.lineage = self.lineage or uuid.uuid4().hex[:16]
        files = [r for recs, _ in parts for r in recs]
        index: dict[str, str] = {}
        for _, by_stage in parts:
            for s, names in by_stage.items():
                for n in names:
                    index.setdefault(n, stage_file(s))
        replicas: dict[str, dict[str, dict[str, str]]] = {}
        for rank, mine in enumerate(copies):
            for s, named in mine.items():
                replicas.setdefault(str(s), {})[str(rank)] = named
        write_manifest(d, steps_done, files, {**self._meta(time.perf_counter() - t0), "index": index,
                                              "replicas": replicas})
        try:
            final, aside = commit(self.root, steps_done, {f.name for f in files}, self.tag)
        except OSError as e:
            raise UserError(f"cannot commit {d} as {step_dir(self.root, steps_done).name}: {e.strerror or e}") from None
        if aside is not None:
            log.warning("an unusable checkpoint was in the way: moved %s aside to %s", final, aside)
        self.trusted.add(steps_done)
        pruned = prune(self.root, self.keep, self.lineage, self.trusted)
        self.trusted.update(pruned.kept)
        if pruned.aside:
            log.warning("failed verification, moved aside (never deleted, not one of the %d kept): %s", self.keep,
                        describe_aside(pruned.aside))
        for old in pruned.deleted:
            log.info("deleted old checkpoint %s", old)

    def _agree_saved(self, steps_done: int, d: Path, problems: list[str]) -> None:
        """Stop every rank with the first problem any rank had saving ``steps_done`` (the
        committer removes the staging directory: it never becomes a step)."""
        problem = next((p for p in problems if p), "")
        if not problem:
            return
        if self.rank == self.committer:
            shutil.rmtree(d, ignore_errors=True)
        older = [s for s in step_dirs(self.root) if s < steps_done]
        newest = f" (newest: {step_dir(self.root, max(older)).name})" if older else ""
        fix = ("free space there or pass another --checkpoint-dir" if "No space left" in problem
               else "fix that")
        raise AgreedError(f"checkpoint of step {steps_done} not saved: {problem}; nothing of it was committed and "
                          f"the older checkpoints{newest} are as they were; {fix}, then restart with --resume")

    def _copies(self, module: nn.Module, chunks: Mapping[int, nn.Module] | None) -> dict[int, dict[str, str]]:
        """This rank's copy of each of its replicated stages: name -> digest of every weight and saved
        buffer (merge-checkpoint checks that the replicas' agree; runtime/merged.py)."""
        out = {}
        for s in self.stages:
            if self.plan.stages[s].replicas > 1:
                state = canonical_state((chunks[s] if chunks is not None else module).state_dict(), self.canon)
                out[s] = {n: tensor_digest([t]) for n, t in state.items() if n not in self.not_mine(s)}
        return out

    def restore(self, module: nn.Module) -> Restored | None:
        """This rank's part of the newest checkpoint usable on every rank, resharded for this plan
        (collective; see the module docstring): None when the directory holds no checkpoint at
        all, else Restored, else AgreedError naming every checkpoint and why it cannot be resumed from."""
        seen = self._gather(sorted(step_dirs(self.root)))
        steps = sorted(set().union(*map(set, seen)), reverse=True)
        if not steps:
            return None
        blind = [r for r, s in enumerate(seen) if not s]
        if blind:
            newest = max((max(s), r) for r, s in enumerate(seen) if s)
            raise AgreedError(f"rank {newest[1]} sees checkpoint step {newest[0]} in {self.root} but rank(s) "
                              f"{', '.join(map(str, blind[:8]))} see none: --checkpoint-dir must be one "
                              "directory shared by every node")
        skipped: list[str] = []
        for step in steps:
            name = step_dir(self.root, step).name
            loaded, problem = self._try_step(step, seen[self.rank], module)
            problems = [p for p in self._gather(problem) if p]
            if not problems:
                if loaded is None:
                    raise RuntimeError(f"rank {self.rank} loaded nothing from {name} yet reported no problem")
                self.lineage = str(read_manifest(step_dir(self.root, step)).get("lineage", ""))
                if not loaded.resharded:        # every file of it was read and its SHA-256 checked
                    self.trusted.add(step)
                return dataclasses.replace(loaded, skipped=tuple(skipped))
            unsafe = next((p for p in problems if p.startswith("unsafe:")), None)
            if unsafe is not None:
                raise AgreedError(f"--resume: {unsafe[7:]} (its manifest vouches for it, so it was replaced after "
                                  "the save); nothing was loaded or changed")
            other = next((p for p in problems if p.startswith("other:")), None)
            if other is not None:
                raise AgreedError(f"--resume: {step_dir(self.root, step)} {other[6:]}; nothing was loaded or "
                                  "changed" + (f" (newer ones skipped: {'; '.join(skipped)})" if skipped else ""))
            here = str(step_dir(self.root, step))         # name its files relative to it
            skipped.append(f"{name}: {problems[0].replace(here + os.sep, '').replace(here, name)}")
        raise AgreedError(f"--resume: no usable checkpoint in {self.root} ({'; '.join(skipped)}); repair or "
                          "move them away, or start afresh with another --checkpoint-dir (nothing was changed)")

    def load_into(self, restored: Restored, module: nn.Module, optimizer: Any) -> None:
        """Put ``restored``'s weights and optimizer state into this rank's module and optimizer (its
        param groups' hyperparameters too, as a resumed run had them: reshard.indexed_optimizer_state)."""
        module.load_state_dict(restored.model)
        names = optimizer_names(optimizer, module, self.canon)
        optimizer.load_state_dict(indexed_optimizer_state(restored.optimizer, names, optimizer.state_dict(),
                                                          saved_hyperparameters=True))

    # ---- helpers ----------------------------------------------------------------------
    def _try_step(self, step: int, visible: list[int], module: nn.Module) -> tuple[Restored | None, str]:
        """Load this rank's part of ``step``: (Restored, "") or (None, why not); a reason that
        starts with "other:" stops the resume (another model or global batch), "unsafe:" too."""
        d = step_dir(self.root, step)
        if step not in visible:
            return None, f"rank {self.rank} cannot see it"
        if not (d / MANIFEST).exists():
            return None, f"incomplete (no {MANIFEST}: its save was cut short)"
        problem = why_incomplete(d, None)
        if problem:
            return None, f"incomplete ({problem})"
        m = read_manifest(d)
        mine = self._meta(0.0)
        if m.get("model") != mine["model"]:
            return None, (f"other:was written for model {m.get('model')!r}, not {mine['model']!r}: resume only the "
                          "same model (or pass another --checkpoint-dir)")
        if m.get("global_batch") != mine["global_batch"]:
            there = f"{m.get('global_batch')} ({m.get('micro_batches')} micro-batches x {m.get('batch_size')})"
            here = f"{mine['global_batch']} ({mine['micro_batches']} x {mine['batch_size']})"
            return None, (f"other:was written with global batch {there}, not {here}: a checkpoint resumes at its "
                          "own global batch (keep micro-batches x micro-batch size)")
        index = m.get("index")
        if not isinstance(index, dict):
            return None, "other:has no name index (written by an older hybridpipe); resume with that version"
        state_keys = list(module.state_dict())
        try:
            wanted = pick(index, {self.canon.get(k, k) for k in state_keys})
            parts = {f: load_file(self.root, step, f) for f in sorted(wanted)}
            own = load_file(self.root, step, rank_file(self.rank)) if self._same_plan(m) else None
            # resharded: what is the same on every rank (the fp16 loss scale) comes from rank 0's file
            shared = own if own is not None else load_file(self.root, step, rank_file(0))
        except NotPlainData as e:
            return None, f"unsafe:{e}"
        except UserError as e:
            return (None, f"other:{e}") if "another model" in str(e) else (None, f"rank {self.rank}: {e}")
        if any(not isinstance(p.get(k), dict) for p in parts.values() for k in ("model", "optimizer")):
            return None, f"rank {self.rank}: a stage file holds no model or optimizer state"
        held = {n: parts[f]["model"][n] for f, names in wanted.items() for n in names}
        model = {k: held[self.canon.get(k, k)] for k in state_keys}
        named = merge_named(restrict_named(parts[f]["optimizer"], names) for f, names in wanted.items())
        if own is not None and not (isinstance(own.get("engine"), dict) and isinstance(own.get("rng"), dict)):
            return None, f"rank {self.rank}: its file holds no engine or RNG state"
        return Restored(step=step, model=model, optimizer=named, engine=own["engine"] if own else {},
                        rng=own["rng"] if own else None, extra=shared.get("extra") or {}, path=d,
                        resharded="" if own is not None else self._plan_change(m)), ""

    def _meta(self, seconds: float) -> dict:
        return plan_meta(self.plan, self.tied, self.lineage, seconds)

    def _same_plan(self, m: dict) -> bool:
        return not self._plan_change(m)

    def _plan_change(self, m: dict) -> str:
        """How the plan that wrote manifest ``m`` differs from this one ("" when it is the same)."""
        return plan_change(m, self._meta(0.0))

    def _gather(self, obj: Any) -> list[Any]:
        if not dist.is_initialized():
            if self.plan.world_size != 1:
                raise RuntimeError("Checkpointer needs torch.distributed initialised for a multi-rank plan")
            return [obj]
        out: list[Any] = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out


def _check_tied_copies(digests: list[dict[str, str]], step: int) -> None:
    """Every stage's copy of a tied parameter (weights and optimizer state) must be bit-identical."""
    first: dict[str, str] = {}
    for dg in digests:
        for name, h in dg.items():
            if first.setdefault(name, h) != h:
                raise AgreedError(f"checkpoint of step {step}: the stages' copies of tied parameter {name!r} differ; "
                                  "their gradients were not summed across stages (a bug: please report it)")

