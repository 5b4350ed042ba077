"""Per-node compute factors pulled toward their common factor (RESULTS 4e, issue 30 item 4).

The unshrunk fit (``strength`` 0: iterative proportional scaling, refinement.py's docstring) explains every
measured stage exactly where it can; a node seen in few stage contexts then carries whatever those stages did
(a stage of its own running faster than the profile, say) into every other grouping. Here the factors are
f_i = c * r_i and the fit minimises, in log space, approximately

    sum over stages (log measured - log predicted)^2  +  strength * sum over nodes (log r_i)^2

by penalised proportional scaling: each round ``c`` steps by the mean of every stage's log ratio, then a
node's residual steps by the sum of its stages' log ratios less ``strength * log r_i``, over its stages'
count plus ``strength`` (the ridge's fixed point). So a node measured in many stages keeps its residual, one
measured in one or two is pulled toward ``c``. ``strength`` 0 is the unshrunk fit; a large one puts every
seen node at ``c``. :func:`cross_validated_strength` picks it from the training stages alone: leave one
stage layout out, fit on the rest, score the held-out stages' |log error| (ties to the smaller strength).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

FIT_ROUNDS = 50
STRENGTHS = (0.0, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 64.0)

Stage = tuple[int, int, float]      # first node, last node, measured ms


def fit_shrunk(times: np.ndarray, stages: Sequence[Stage], strength: float = 0.0) -> np.ndarray:
    """Per-node factors f = c * r with ``sum(f[i..j] * times[i..j]) ~ measured`` for every (i, j, measured),
    the residuals r pulled toward 1 with ``strength`` (module docstring); unseen nodes stay at 1."""
    usable = [(i, j, m) for i, j, m in stages if m > 0 and times[i:j + 1].sum() > 0]
    seen = np.zeros(len(times), dtype=bool)
    for i, j, _ in usable:
        seen[i:j + 1] = True
    c, r = 1.0, np.ones(len(times))

    def residuals() -> list[float]:
        return [math.log(m / float((c * r[i:j + 1] * times[i:j + 1]).sum())) for i, j, m in usable]

    for _ in range(FIT_ROUNDS if len(usable) > 1 or strength > 0 else 1):
        if strength > 0 and usable:
            c *= math.exp(sum(residuals()) / len(usable))        # the common part: a full step
        logs = np.zeros(len(times))
        counts = np.zeros(len(times))
        for (i, j, _), e in zip(usable, residuals(), strict=True):
            logs[i:j + 1] += e
            counts[i:j + 1] += 1
        logs -= strength * np.log(r) * seen
        step = np.exp(np.divide(logs, counts + strength, out=np.zeros_like(logs), where=seen))
        r = r * step
        if np.all(np.abs(step[seen] - 1) < 1e-9):
            break
    return np.where(seen, c * r, 1.0)


def held_out_error(times: np.ndarray, layouts: Sequence[Sequence[Stage]], strength: float) -> float:
    """Sum over layouts of the |log(measured / predicted)| of its stages, fitted on the other layouts."""
    total = 0.0
    for k, mine in enumerate(layouts):
        rest = [s for q, other in enumerate(layouts) if q != k for s in other]
        f = fit_shrunk(times, rest, strength)
        for i, j, m in mine:
            predicted = float((f[i:j + 1] * times[i:j + 1]).sum())
            if m > 0 and predicted > 0:
                total += abs(math.log(m / predicted))
    return total


def cross_validated_strength(pairs: Sequence[tuple[np.ndarray, Sequence[Sequence[Stage]]]],
                             grid: Sequence[float] = STRENGTHS) -> float:
    """The strength of ``grid`` with the least held-out error summed over ``pairs`` (profile times, the
    stages grouped by layout: forward and backward, say); 0 with fewer than three layouts."""
    if min((len(layouts) for _, layouts in pairs), default=0) < 3:
        return 0.0
    scores = [sum(held_out_error(t, layouts, s) for t, layouts in pairs) for s in grid]
    k = min(range(len(grid)), key=lambda q: (round(scores[q], 12), grid[q]))
    return grid[k]
