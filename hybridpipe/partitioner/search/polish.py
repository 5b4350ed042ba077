"""Move the DP's cuts where the predicted step, not the search's objective, is lower.

The DP minimises an objective that leaves out what only the whole plan shows: the transfer
latencies of a flushed step's fill and drain, the tied weights' sums across stages, the compute
lost only beside the part of a collective that ran beside compute (objective.predict_step_ms).
So a plan one cut away from the DP's can be predicted faster (one case: 206 vs 171 ms/step).
:func:`polish_cuts` walks from the DP's plan, each round taking the single cut move (to the
nearest allowed cut on either side) that lowers the priced step most, until none does. The
stages' ranks never change, only which nodes they hold.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from hybridpipe.partitioner.search.objective import StageSpec

Price = Callable[[tuple[StageSpec, ...]], float]        # a stage list -> its step (ms); inf where it cannot run


def moves(stages: Sequence[StageSpec], allowed: Callable[[int], bool]) -> list[tuple[StageSpec, ...]]:
    """Every stage list one cut away: a cut after stage i's last node moved to the nearest node after which
    ``allowed`` lets a cut fall, earlier or later, keeping every stage non-empty."""
    out = []
    for i in range(len(stages) - 1):
        left, right = stages[i], stages[i + 1]
        earlier = next((n for n in range(left.last - 1, left.first - 1, -1) if allowed(n)), None)
        later = next((n for n in range(left.last + 1, right.last) if allowed(n)), None)
        for cut in (earlier, later):
            if cut is not None:
                moved = list(stages)
                moved[i], moved[i + 1] = replace(left, last=cut), replace(right, first=cut + 1)
                out.append(tuple(moved))
    return out


def polish_cuts(stages: Sequence[StageSpec], price: Price, allowed: Callable[[int], bool],
                deadline: float | None = None, max_rounds: int = 256) -> tuple[tuple[StageSpec, ...], float, float]:
    """Steepest descent over one-cut moves (:func:`moves`) on ``price``: (the stages, their price before, after).
    Stops where no move lowers the price by more than a millionth, at ``deadline`` (``time.monotonic()``)
    or after ``max_rounds`` moves."""
    best = tuple(stages)
    start = current = price(best)
    for _ in range(max_rounds):
        if not math.isfinite(current) or (deadline is not None and time.monotonic() > deadline):
            break
        priced = [(price(c), c) for c in moves(best, allowed)]
        if not priced:
            break
        step, candidate = min(priced, key=lambda pc: pc[0])
        if not step < current * (1 - 1e-6):
            break
        best, current = candidate, step
    return best, start, current
