"""Refinement of the compute a stage loses to its own communication (issue 18).

The cost model charges a stage ``interference_s_per_byte`` times the bytes its link carries
per step (objective.py's ``overhead_ms``: the replicas' ring and the mean of the p2p bytes in
and out) on top of its compute. A run's measured forward and backward already hold that loss,
so refining compute from them and keeping the calibrated interference would count it twice
(measured 2026-11-25 on 4 emulated hosts: data-parallel AlexNet's backward took 1.8x its
profile beside 366 MB of ring traffic per step, and the refined model still added the
calibrated 8.8 ms/MB: +53% on a run it had just seen).

So the interference is fitted with the compute, per stage of every run (pure):

    measured compute per step ~ c * profiled compute per step + i * bytes per step

by least squares on relative errors, ``c, i >= 0``. ``i`` is then taken out of each stage's
measured times (shared between forward and backward by their measured times) before the node
factors are fitted, and becomes the refined calibration's ``interference_s_per_byte``. Where
the stages cannot tell ``c`` from ``i`` (one stage, or every stage carrying the same bytes per
profiled millisecond), ``i`` is 0: the compute factors keep the loss the runs saw. ``i`` is
fitted only where some stage ran an all-reduce (where the loss is large enough to see), and
only where it explains most (``EXPLAINED``) of the squared relative error that one compute
factor leaves: otherwise a node slower than its profile in one stage would pass for it.
What the stages' compute does not show but the measured steps do (other stages slowed beside
an all-reduce, on hosts that share CPUs) is added later, by refinement.py's fit of what is left.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

SPREAD = 0.25     # the stages' bytes per profiled ms must differ by this much (relative) to fit i
EXPLAINED = 0.6   # ... and i must explain this share of what one compute factor leaves unexplained


@dataclass(frozen=True)
class StageLoad:
    """One stage of one run, per step (per replica): profiled and measured compute (ms), link bytes."""

    profiled_ms: float
    measured_ms: float
    nbytes: float
    ring_bytes: float = 0.0     # of which the replicas' all-reduce


def link_bytes(replicas: int, weights: float, p2p_bytes: float, micro_batches: int, syncs: int) -> tuple[float, float]:
    """Bytes a replica's link carries per step, as objective.overhead_ms counts them: (ring + p2p, ring)."""
    ring = syncs * 2 * (replicas - 1) / replicas * weights
    return ring + micro_batches * p2p_bytes, ring


def fit_interference(loads: Sequence[StageLoad]) -> float:
    """``i`` in ms per byte (module docstring); 0 where the stages cannot tell it from compute."""
    use = [s for s in loads if s.profiled_ms > 0 and s.measured_ms > 0]
    if len(use) < 2 or not any(s.ring_bytes > 0 for s in use):
        return 0.0
    density = np.array([s.nbytes / s.profiled_ms for s in use])
    if density.max() <= 0 or (density.max() - density.min()) / density.max() < SPREAD:
        return 0.0
    y = np.array([s.measured_ms for s in use])
    a = np.stack([np.array([s.profiled_ms for s in use]) / y, np.array([s.nbytes for s in use]) / y], axis=1)
    ones = np.ones(len(use))
    (c, i), *_ = np.linalg.lstsq(a, ones, rcond=None)
    if i <= 0 or c <= 0:
        return 0.0
    c_only = float(a[:, 0] @ ones / (a[:, 0] @ a[:, 0]))
    before = float(((a[:, 0] * c_only - 1) ** 2).sum())
    after = float(((a @ np.array([c, i]) - 1) ** 2).sum())
    return float(i) if after <= (1 - EXPLAINED) * before else 0.0
