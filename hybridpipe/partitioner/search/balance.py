"""The min-max linear partition: contiguous groups whose largest (scaled) weight is smallest.

Used by the ``params`` / ``time`` baselines (``strategies.py``: divisors all 1) and by the virtual
stages' chunk boundaries (``virtual.py``: a chunk on a group of r replicas weighs 1/r of its time).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from hybridpipe.limits import check_deadline


def balanced_sizes(weights: np.ndarray, divisors: Sequence[float], ends_ok: np.ndarray | None = None,
                   deadline: float | None = None) -> list[int] | None:
    """Sizes of ``len(divisors)`` contiguous non-empty groups of ``weights`` minimising
    max over groups c of (weight of c) / divisors[c]; ``ends_ok[q]``: may a group end after the
    first q items (default: anywhere). None when no grouping ends only there. OutOfTime once
    ``deadline`` (``time.monotonic()``) has passed.

    ``best[c, j]`` = the smallest such maximum for the first j items in c groups:
    ``min over s < j of max(best[c-1, s], W(s..j-1) / divisors[c-1])``, vectorised over s; ties to
    the earliest cut.
    """
    n, parts = len(weights), len(divisors)
    prefix = np.concatenate([[0.0], np.cumsum(weights, dtype=float)])
    span = prefix[None, :] - prefix[:, None]                     # span[s, j] = weight of s..j-1
    valid = np.triu(np.ones((n + 1, n + 1), dtype=bool), k=1)     # s < j: the group is non-empty
    best = np.full((parts + 1, n + 1), np.inf)
    best[0, 0] = 0.0
    cut = np.zeros((parts + 1, n + 1), dtype=np.int64)
    for c in range(1, parts + 1):
        check_deadline(deadline)
        cand = np.where(valid, np.maximum(best[c - 1][:, None], span / divisors[c - 1]), np.inf)
        cut[c] = cand.argmin(axis=0)
        best[c] = cand[cut[c], np.arange(n + 1)]
        if ends_ok is not None:
            best[c][~ends_ok] = np.inf
    if not np.isfinite(best[parts, n]):
        return None
    sizes, j = [], n
    for c in range(parts, 0, -1):
        s = int(cut[c, j])
        sizes.append(j - s)
        j = s
    return sizes[::-1]
