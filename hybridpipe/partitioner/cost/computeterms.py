"""Two stage compute terms the per-node factors cannot hold (issue 30 item 4; RESULTS 4e).

* **Replicas' compute stretch** ``rho(r)``: a stage of ``r`` replicas computes ``rho(r)`` times what its nodes
  compute in a stage of one (the replicas share the hosts' CPUs with each other and with their all-reduces,
  which run beside the last backward). Given as points ``((r, factor), ...)`` measured at some replica counts,
  interpolated linearly in ``log r`` between them and held at the nearest beyond them; ``r <= 1`` is 1, and no
  points is 1 everywhere (the neutral value: every stage as before).
* **Gradient accumulation** ``a``: in a step of ``k`` micro-batches and ``syncs`` optimizer steps, every
  backward after the first of a sync period adds its gradients to the ones already there, a cost per
  parameter byte the profile (one backward, no gradient yet) does not have: ``(k - syncs) * a * bytes``
  per step. 0 is the neutral value.

Pure functions over numbers or numpy arrays (elementwise), so ``objective.py`` and the vectorised
``stageterms.py`` price them alike; ``refine/computefit.py`` fits them from the runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np

Num = TypeVar("Num", float, np.ndarray)
Points = Sequence[tuple[int, float]]


def replica_factor(points: Points, replicas: Num) -> Num:
    """``rho(replicas)`` from the measured ``points`` (module docstring); 1 where ``replicas <= 1`` or no points."""
    r = np.asarray(replicas, dtype=float)
    if not points:
        out = np.ones_like(r)
    else:
        pts = sorted(points)
        xs = np.log([max(float(n), 1.0) for n, _ in pts])
        fs = np.array([f for _, f in pts], dtype=float)
        out = np.where(r > 1, np.interp(np.log(np.maximum(r, 1.0)), xs, fs), 1.0)
    return out if isinstance(replicas, np.ndarray) else float(out)


def accumulation_ms(s_per_byte: float, param_bytes: Num, micro_batches: Num | int, syncs: Num | int) -> Num:
    """Per step: the ``micro_batches - syncs`` backwards that accumulate into existing gradients, each
    ``s_per_byte`` (seconds) per parameter byte (module docstring)."""
    return (micro_batches - syncs) * (s_per_byte * 1e3) * param_bytes


def later_share(micro_batches: int, syncs: int) -> float:
    """How much of one accumulation the *median* backward of a replica's step holds: the step has
    ``syncs`` backwards without one and ``micro_batches - syncs`` with one, so the median is a later one
    (1) where those are more than half, a first one (0) where fewer, their mean (0.5) at a tie."""
    later = micro_batches - syncs
    return 1.0 if 2 * later > micro_batches else 0.5 if 2 * later == micro_batches and later > 0 else 0.0
