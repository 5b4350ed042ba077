"""Refinement of the per-step end of a run: the optimizer step and the tied weights' sum (issue 18).

A pure function of the model's per-stage predictions and the runs' ``step`` phases (observed.py:
the median per step of what a stage spent between its last backward's sync and the next step,
which is the tied weights' sum across stages, then the optimizer step). Per stage ``s``:

    measured_s ~ o * optimizer_s + tied_s

``optimizer_s`` is the model's optimizer time of the stage's nodes (the profile's step time over
all parameters, shared by parameter bytes, times the steps a step takes), so ``o`` (the optimizer
factor) scales with the stage's parameter bytes. It is fitted on the stages that take part in
no tied sum, as the median of their ratios weighted by their predicted times (big stages weigh
most: a step phase also holds a constant few hundred microseconds of bookkeeping that would
swamp the ratio of a stage with few weights). A median, not a ratio of sums: on a shared
machine one stage's step can crawl while the others' all-reduce takes the CPU (measured
2026-11-25, AlexNet on 4 emulated hosts: a 10 MB stage's step took 1.2 s, 45x its price, beside
fc1's 151 MB all-reduce; a ratio of sums put every optimizer step at 3x).

A tied group's sum ends when its last stage arrives: the others wait in it for that stage's
drain, which is time the pipeline's critical path already holds. So a group's real sum is the
least, over its stages, of what that stage's step phase holds beyond its optimizer step (shared
among the groups the stage takes part in by their predicted times), and the tied factor ``t``
is the ratio of sums of those real sums to the model's prices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StepStage:
    """One stage of one run: the model's optimizer and tied times per step, and the measured step phase (ms)."""

    optimizer_ms: float
    tied_ms: float
    measured_ms: float


@dataclass(frozen=True)
class TiedEvidence:
    """One tied group of one run: its stages' indices (into that run's StepStage list) and its price (ms)."""

    stages: tuple[int, ...]
    predicted_ms: float


@dataclass(frozen=True)
class StepFactors:
    optimizer: float | None        # None: no stage with weights measured its step
    tied: float | None             # None: no tied group ran


def weighted_median(values: Sequence[float], weights: Sequence[float]) -> float:
    """The value at half the total weight (values sorted; the lower one on a tie)."""
    pairs = sorted(zip(values, weights, strict=True))
    half, acc = sum(weights) / 2, 0.0
    for v, w in pairs:
        acc += w
        if acc >= half:
            return v
    return pairs[-1][0]


def optimizer_factor(runs: Sequence[Sequence[StepStage]]) -> float | None:
    """``o``: the median of measured over predicted optimizer time on the stages in no tied group,
    each weighted by its predicted time (module docstring)."""
    plain = [s for run in runs for s in run if s.tied_ms <= 0 and s.optimizer_ms > 0]
    if not plain:
        return None
    return weighted_median([s.measured_ms / s.optimizer_ms for s in plain], [s.optimizer_ms for s in plain])


def tied_factor(runs: Sequence[Sequence[StepStage]], groups: Sequence[Sequence[TiedEvidence]],
                optimizer: float) -> float | None:
    """``t``: the groups' real sums (each the least over its stages) over their prices (module docstring)."""
    real, priced = 0.0, 0.0
    for stages, mine in zip(runs, groups, strict=True):
        for g in mine:
            if g.predicted_ms <= 0 or not g.stages:
                continue
            left = []
            for k in g.stages:
                s = stages[k]
                share = g.predicted_ms / s.tied_ms if s.tied_ms > 0 else 1.0
                left.append(max(0.0, s.measured_ms - optimizer * s.optimizer_ms) * share)
            real += min(left)
            priced += g.predicted_ms
    return real / priced if priced > 0 else None


def fit_step(runs: Sequence[Sequence[StepStage]], groups: Sequence[Sequence[TiedEvidence]]) -> StepFactors:
    """The optimizer and tied factors the runs' step phases imply (None where they say nothing).

    Where every stage with weights takes part in a tied sum (a two-stage pipeline of a model whose
    embedding and head are tied), the step phases cannot tell the optimizer from the sum: both
    are None, and the model keeps its prices (what is left lands in the step overhead)."""
    o = optimizer_factor(runs)
    return StepFactors(o, None if o is None else tied_factor(runs, groups, o))
