"""Pruning a checkpoint directory: keep the ``keep`` newest *good* checkpoints of one lineage.

A checkpoint is good once its bytes are verified against its manifest (every file present, of
its size and SHA-256), or when this job hashed them as it wrote them or verified them as every
rank loaded them (``trusted``). Walking the lineage's checkpoints from the newest, each one that
would be kept is verified (once: the caller remembers the good ones); one that fails is moved
aside to ``step-N.corrupt-K`` (never deleted: the evidence stays, and it no longer counts as a
step) and does not count; once ``keep`` good ones are found, the older ones are deleted unread.
So a verified-good checkpoint is never deleted while an unverified or corrupt one is kept.

Checkpoints of other lineages and directories without a readable manifest are never touched. A
deletion renames the directory to a staging name (``.step-N.deleted-X.tmp``) before removing it,
so a prune cut short never leaves a torn ``step-N``; staging directories of steps older than the
newest good checkpoint (a save or a deletion cut short) are removed.

Cost: SHA-256 of the kept checkpoints this job neither wrote nor resumed from, once per job
(after a resume: the older ones it keeps), on the committing rank.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path

from hybridpipe.runtime.checkpoint_files import lineage_of, set_aside, staging_dirs, step_dirs, why_incomplete


@dataclass(frozen=True)
class Choice:
    """What pruning does with each step of the lineage (newest first in each list)."""

    kept: tuple[int, ...]
    aside: tuple[tuple[int, str], ...]      # (step, why it is not good)
    deleted: tuple[int, ...]


def choose(steps: Sequence[int], keep: int, problem: Callable[[int], str]) -> Choice:
    """Which of ``steps`` to keep, set aside and delete (pure): from the newest, a step is checked
    with ``problem(step)`` ("" when good; called only for steps that would be kept) until ``keep``
    good ones are found; the bad ones go aside, every step older than the last kept one is
    deleted. ``keep`` <= 0 keeps every step and checks none (nothing is deleted)."""
    newest_first = sorted(set(steps), reverse=True)
    if keep <= 0:
        return Choice(tuple(newest_first), (), ())
    kept: list[int] = []
    aside: list[tuple[int, str]] = []
    deleted: list[int] = []
    for s in newest_first:
        if len(kept) >= keep:
            deleted.append(s)
            continue
        why = problem(s)
        if why:
            aside.append((s, why))
        else:
            kept.append(s)
    return Choice(tuple(kept), tuple(aside), tuple(deleted))


@dataclass(frozen=True)
class Pruned:
    """What :func:`prune` did."""

    kept: tuple[int, ...]                       # good checkpoints of the lineage still there
    aside: tuple[tuple[Path, Path, str], ...]   # (step-N, where it went, why)
    deleted: tuple[Path, ...]                   # step-N and staging directories removed


def prune(root: str | os.PathLike, keep: int, lineage: str, trusted: Collection[int] = ()) -> Pruned:
    """Keep the ``keep`` newest good checkpoints of ``lineage`` in ``root`` (see the module
    docstring); ``trusted``: steps known good without reading them again."""
    dirs = step_dirs(root)
    ours = [s for s in dirs if lineage and lineage_of(dirs[s]) == lineage]

    def problem(step: int) -> str:
        return "" if step in trusted else why_incomplete(dirs[step], verify=True)

    choice = choose(ours, keep, problem)
    aside = tuple((dirs[s], set_aside(dirs[s], "corrupt"), why) for s, why in choice.aside)
    doomed: list[tuple[Path, int | None]] = [(dirs[s], s) for s in choice.deleted]
    if choice.kept:
        doomed += [(p, None) for p, step in staging_dirs(root).items() if step < max(choice.kept)]
    for d, step in doomed:
        _remove(d, step)
    return Pruned(choice.kept, aside, tuple(d for d, _ in doomed))


def _remove(d: Path, step: int | None) -> None:
    """Delete a directory; a ``step-N`` one is first renamed to a staging name (out of resume's
    sight at once, and removed by a later prune if this one is cut short)."""
    if step is not None:
        gone = d.parent / f".step-{step:06d}.deleted-{uuid.uuid4().hex[:8]}.tmp"
        try:
            os.rename(d, gone)
            d = gone
        except OSError:
            pass
    shutil.rmtree(d, ignore_errors=True)


def describe_aside(aside: Sequence[tuple[Path, Path, str]]) -> str:
    """One line naming each checkpoint set aside and why."""
    return "; ".join(f"{a.name} to {b.name} ({why})" for a, b, why in aside)
