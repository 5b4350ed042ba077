"""Cuts a plan cannot make: a profile node may name a value (an int, None, a shape tuple) computed at or
before it and read after it that cannot cross a stage boundary (``ProfileNode.cut_blocker``).

A stage may then not end right after that node. Every strategy respects it: the optimal DP and
PipeDream's recurrence never consider such a split, the balanced baselines (params, time) only
balance over free cuts, and uniform moves each boundary it wants to the nearest free cut (or refuses,
in one line naming the value, when there are not enough free cuts).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridpipe.errors import UserError
from hybridpipe.partitioner.search.modelcosts import ModelCosts
from hybridpipe.partitioner.search.objective import StageSpec


def blocked_stage(costs: ModelCosts, stages: Sequence[StageSpec]) -> tuple[int, str] | None:
    """(index, value) of the first stage that ends at a blocked cut, or None."""
    for idx, st in enumerate(stages):
        value = costs.blocked_cut(st.last)
        if value is not None:
            return idx, value
    return None


def blocked_message(costs: ModelCosts, stages: Sequence[StageSpec], strategy: str) -> str | None:
    """The one-line error for a stage list that cuts where a value cannot cross (None: it does not)."""
    hit = blocked_stage(costs, stages)
    if hit is None:
        return None
    idx, value = hit
    node = costs.names[stages[idx].last]
    return (f"--strategy {strategy} ends stage {idx} after node {node!r}, but graph value {value!r} computed there "
            "is read later and cannot cross a stage boundary; use another --stages or --strategy optimal")


def nearest_free_ends(costs: ModelCosts, ends: Sequence[int], strategy: str) -> list[int]:
    """Move each stage end (last node of every stage but the last) to the nearest free cut, in order.

    Ends stay strictly increasing and below the last node; a wanted end keeps its place when free.
    Among free cuts the nearest is taken, the earlier one on a tie, as long as enough free cuts remain
    for the stages after it. Raises a one-line UserError when there are fewer free cuts than ends.
    """
    free = np.nonzero(costs.cut_ok[:-1])[0]
    if len(free) < len(ends):
        value = next(b for b in costs.cut_blockers[:-1] if b)
        raise UserError(f"--strategy {strategy} needs {len(ends) + 1} stages but only {len(free) + 1} are possible: "
                        f"the other cuts would split a value that cannot cross a stage boundary (e.g. {value!r}); "
                        f"use --stages {len(free) + 1} or fewer, or --strategy optimal")
    out: list[int] = []
    lo = 0
    for k, want in enumerate(ends):
        hi = len(free) - (len(ends) - k)              # leave one free cut for every later end
        options = free[lo:hi + 1]
        pick = int(np.argmin(np.abs(options - want)))
        out.append(int(options[pick]))
        lo += pick + 1
    return out


def free_ends_mask(costs: ModelCosts) -> np.ndarray:
    """[p] for p = 0..n: may a group of the first p nodes end there (p = n always)."""
    ok = np.ones(costs.n + 1, dtype=bool)
    ok[1:] = costs.cut_ok
    return ok
