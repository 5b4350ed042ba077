"""Fitting the stage compute terms of ``cost/computeterms.py`` from the runs' stages (issue 30 item 4).

Pure functions over plain numbers (each stage of each run as a :class:`ComputeStage`); ``refinement.py``
calls them when asked for the terms (``refine(terms=...)``), and leaves its per-node fit as it was otherwise.

* **Gradient accumulation** ``a`` (seconds per parameter byte): each unreplicated stage with weights whose
  steps had later backwards says ``(later - first) / bytes``: the median of its steps' later backwards less
  the median of their first ones (observed.py), over its parameter bytes. ``a`` is their median weighted by
  the bytes (big stages measure it best; a stage of few weights measures noise), at least 0. Replicated
  stages are left out where an unreplicated one measured it: their later backwards also hold the last
  backward's stretch beside the all-reduces and the replicas' contention, which ``rho`` takes.
  The node factors are then fitted to the backwards without it: a stage's median backward holds
  ``later_share(k, syncs)`` of one accumulation (``computeterms.later_share``), taken out.
* **The replicas' stretch** ``rho(r)`` per replica count ``r > 1`` seen: fitted with the node factors by
  alternation. The node factors are fitted (``shrinkage.fit_shrunk``, as refinement does) to every stage's
  measured times over its ``rho``; then each ``rho(r)`` is the time-weighted geometric mean, over the
  stages of ``r`` replicas, of their measured forward + backward over what their fitted nodes compute;
  until it settles. Nodes seen only in replicated stages take what those measured (nothing tells their
  own speed from the stretch), so ``rho`` is learnt from the nodes seen both ways.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from hybridpipe.partitioner.cost.computeterms import later_share
from hybridpipe.partitioner.refine.observed import RunObservation
from hybridpipe.partitioner.refine.shrinkage import fit_shrunk
from hybridpipe.partitioner.refine.step import weighted_median
from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.partitioner.search.modelcosts import ModelCosts

RHO_ROUNDS = 200           # alternations of the node factors and rho (each a full fit_shrunk)
RHO_TOLERANCE = 1e-9


@dataclass(frozen=True)
class ComputeStage:
    """One stage of one run, as the compute fit reads it (ms; None: not measured)."""

    first: int
    last: int
    replicas: int
    micro_batches: int                 # k: per replica per step
    syncs: int                         # optimizer steps per step
    param_bytes: float
    forward_ms: float | None           # medians of one micro-batch (observed.py)
    backward_ms: float | None
    first_backward_ms: float | None = None
    later_backward_ms: float | None = None


def compute_stages(costs: ModelCosts, run: RunObservation) -> list[ComputeStage]:
    """The stages of ``run`` as ``computefit.py`` reads them."""
    kind = get_schedule(run.schedule)
    out = []
    for st in run.stages:
        r = max(1, len(st.ranks))
        k = -(-run.micro_batches // r)
        out.append(ComputeStage(st.first, st.last, r, k, kind.syncs_per_step(k),
                                float(costs.param_bytes[st.first:st.last + 1].sum()), st.forward_ms, st.backward_ms,
                                st.first_backward_ms, st.later_backward_ms))
    return out


def fit_accumulation(stages: Sequence[ComputeStage]) -> float:
    """``a`` in seconds per parameter byte (module docstring); 0 where no stage measured it."""
    usable = [s for s in stages if s.param_bytes > 0 and s.micro_batches > s.syncs
              and s.first_backward_ms is not None and s.later_backward_ms is not None]
    alone = [s for s in usable if s.replicas == 1]
    chosen = alone or usable
    if not chosen:
        return 0.0
    per_byte = [(s.later_backward_ms - s.first_backward_ms) / s.param_bytes for s in chosen]   # type: ignore[operator]
    return max(0.0, weighted_median(per_byte, [s.param_bytes for s in chosen])) * 1e-3


def without_accumulation(stage: ComputeStage, s_per_byte: float) -> ComputeStage:
    """``stage`` with its median backward less the accumulation it holds (at least 1% of it left)."""
    if stage.backward_ms is None or s_per_byte <= 0:
        return stage
    held = later_share(stage.micro_batches, stage.syncs) * s_per_byte * 1e3 * stage.param_bytes
    return replace(stage, backward_ms=max(stage.backward_ms - held, 0.01 * stage.backward_ms))


def stage_compute(f_fwd: np.ndarray, f_bwd: np.ndarray, forward_ms: np.ndarray, backward_ms: np.ndarray,
                  s: ComputeStage) -> float:
    """What a stage's nodes compute per micro-batch with the node factors (forward + backward, ms)."""
    i, j = s.first, s.last + 1
    return float((f_fwd[i:j] * forward_ms[i:j]).sum() + (f_bwd[i:j] * backward_ms[i:j]).sum())


def fit_replica_compute(forward_ms: np.ndarray, backward_ms: np.ndarray, stages: Sequence[ComputeStage],
                        strength: float = 0.0) -> tuple[np.ndarray, np.ndarray, tuple[tuple[int, float], ...]]:
    """The node factors (forward, backward) and ``rho`` per replica count > 1 (module docstring)."""
    counts = sorted({s.replicas for s in stages if s.replicas > 1})
    rho = dict.fromkeys(counts, 1.0)

    def nodes(phase: str, times: np.ndarray) -> np.ndarray:
        return fit_shrunk(times, [(s.first, s.last, m / rho.get(s.replicas, 1.0)) for s in stages
                                  if (m := getattr(s, phase)) is not None], strength)

    f_fwd, f_bwd = nodes("forward_ms", forward_ms), nodes("backward_ms", backward_ms)
    for _ in range(RHO_ROUNDS if counts else 0):
        new = {}
        for r in counts:
            logs, weight = 0.0, 0.0
            for s in stages:
                if s.replicas != r or s.forward_ms is None or s.backward_ms is None:
                    continue
                fitted = stage_compute(f_fwd, f_bwd, forward_ms, backward_ms, s)
                if fitted > 0 and s.forward_ms + s.backward_ms > 0:
                    logs += fitted * math.log((s.forward_ms + s.backward_ms) / fitted)
                    weight += fitted
            new[r] = math.exp(logs / weight) if weight > 0 else 1.0
        settled = all(abs(new[r] / rho[r] - 1) < RHO_TOLERANCE for r in counts)
        rho = new
        f_fwd, f_bwd = nodes("forward_ms", forward_ms), nodes("backward_ms", backward_ms)
        if settled:
            break
    return f_fwd, f_bwd, tuple((r, float(rho[r])) for r in counts)
