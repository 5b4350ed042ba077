"""What runs taught about all-reduces, as a factor on the model's price: by size, and by group size.

Refinement (``refine/sync.py``) learns, from each replicated stage's wait for its gradients, how much
longer its all-reduces took than the model priced them. The model already prices a group of ``g`` ranks
by the algorithm's own structure at ``g`` (rounds, link loads: ``costmodel.py``), so what is left over is a
factor. It is kept per size class of the all-reduce's bytes (``points``: ``(bytes, factor)``, log-log between
classes, constant beyond them) and, where the runs had replicated stages of several sizes, per group size
(``groups``: ``((g, points), ...)``): a 2-replica stage's wait then no longer sets the price of an 8-rank
all-reduce. A group size the runs did not have takes log(factor) interpolated linearly in log(g) between the
nearest sizes they did have, and the nearest one's beyond them (:func:`group_factor`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

Points = Sequence[tuple[float, float]]
Groups = Sequence[tuple[int, Points]]


def size_factor(points: Points, nbytes):
    """Factor at ``nbytes`` from (bytes, factor) points: log-log interpolation, constant beyond the ends."""
    if not points:
        return np.ones_like(nbytes, dtype=float) if isinstance(nbytes, np.ndarray) else 1.0
    xs = np.log([b for b, _ in points])
    ys = np.log([f for _, f in points])
    out = np.exp(np.interp(np.log(np.maximum(nbytes, 1.0)), xs, ys))
    return out if isinstance(nbytes, np.ndarray) else float(out)


def group_factor(groups: Groups, nbytes, ranks: int):
    """Factor at ``nbytes`` for a group of ``ranks`` ranks from per-group-size points (module docstring):
    that size's points where the runs had it, else log(factor) linear in log(ranks) between the nearest
    sizes they had, the nearest size's beyond them; 1 without any."""
    if not groups:
        return size_factor((), nbytes)
    by_size = dict(groups)
    sizes = sorted(by_size)
    if ranks in by_size or ranks <= sizes[0] or ranks >= sizes[-1]:
        pick = ranks if ranks in by_size else sizes[0] if ranks <= sizes[0] else sizes[-1]
        return size_factor(by_size[pick], nbytes)
    hi = next(k for k in sizes if k > ranks)
    lo = max(k for k in sizes if k < ranks)
    w = (np.log(ranks) - np.log(lo)) / (np.log(hi) - np.log(lo))
    out = np.exp((1 - w) * np.log(size_factor(by_size[lo], nbytes)) + w * np.log(size_factor(by_size[hi], nbytes)))
    return out if isinstance(nbytes, np.ndarray) else float(out)


def least_group_factor(groups: Groups, points: Points, nbytes):
    """The smallest factor any group size (or the size-only ``points``) gives ``nbytes``: a lower bound for
    every group (interpolation in log g never leaves the range of the sizes' own factors)."""
    out = size_factor(points, nbytes) if points or not groups else np.inf * np.ones_like(nbytes, dtype=float)
    for _, pts in groups:
        out = np.minimum(out, size_factor(pts, nbytes))
    return out if isinstance(nbytes, np.ndarray) else float(out)
