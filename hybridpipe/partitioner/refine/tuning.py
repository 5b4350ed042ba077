"""Autotune's decisions (pure): which plan to run next, and when to stop (issue 18 item 2).

Each round, every strategy's plan is made with the model refined by all runs so far, the
distinct plans are ranked by predicted step, and:

* plans whose run failed (no measured step) are out;
* the best predicted plan runs, unless it already ran;
* it already ran: if it is also the fastest measured plan and its prediction *made before it
  ran* was within ``tolerance`` of its measurement (the model earned trust), stop: converged;
* else, if the two fastest measured plans are within the noise of their measurements (see
  below) and one of them ran only once, it runs again (the one with fewer runs): a step time
  measured on a busy machine spreads by several per cent, more than the gaps that matter;
* else the next untried plan predicted within ``close`` of the best runs (a runner-up: until
  the model has earned trust, a measurement settles what its ranking cannot; the default 50%
  spends the budget on the plans the model does not rule out by far);
* else stop: nothing untried is predicted within ``close`` of the best.

A plan's measurement is the median of every steady step of all its runs (pooled). Its noise is
the relative standard error of that median, ``1.25 * 1.4826 * MAD / median / sqrt(n)``; two
plans whose medians differ by less than twice the root sum of squares of their noises (about
95% for a difference) are within noise; a plan whose steps are unknown (or one steady step)
counts as noiseless: nothing says it should run again. The caller stops too when the budget of runs is spent.
The chosen plan is always the fastest measured one, whatever the predictions say.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from hybridpipe.partitioner.plan import Plan


@dataclass(frozen=True)
class Candidate:
    """A distinct plan this round and the strategies that made it."""

    key: tuple
    plan: Plan
    strategies: tuple[str, ...]

    @property
    def predicted_ms(self) -> float:
        return self.plan.predicted_step_ms


@dataclass(frozen=True)
class Trial:
    """A plan that ran: its prediction when it was chosen, what the run measured (None: it failed)."""

    key: tuple
    predicted_ms: float
    measured_ms: float | None
    steps_ms: tuple[float, ...] = ()     # the run's steady step times (empty: only the median is known)


@dataclass(frozen=True)
class Decision:
    candidate: Candidate | None        # None: stop
    reason: str


def plan_key(plan: Plan) -> tuple:
    """What makes two plans the same job: stages (nodes, ranks), per-layer all-reduce, schedule, micro-batches."""
    return (plan.schedule, plan.micro_batches,
            tuple((s.first_node, s.last_node, tuple(s.ranks), tuple((lv.layer, lv.algorithm) for lv in s.layers))
                  for s in plan.stages))


def distinct(plans: Sequence[tuple[str, Plan]]) -> list[Candidate]:
    """(strategy, plan) pairs merged by plan_key, fastest predicted first (ties: the first strategy)."""
    merged: dict[tuple, Candidate] = {}
    for strategy, plan in plans:
        key = plan_key(plan)
        hit = merged.get(key)
        merged[key] = Candidate(key, plan, (strategy,)) if hit is None else \
            Candidate(key, hit.plan, (*hit.strategies, strategy))
    return sorted(merged.values(), key=lambda c: c.predicted_ms)


@dataclass(frozen=True)
class Measured:
    """A plan's runs pooled: median of their steady steps, relative noise of it, number of runs."""

    key: tuple
    median_ms: float
    noise: float
    runs: int


def median_noise(steps: Sequence[float]) -> float:
    """Relative standard error of the median of ``steps`` (module docstring); 0 (unknown) for fewer than 2."""
    if len(steps) < 2:
        return 0.0
    med = statistics.median(steps)
    mad = statistics.median(abs(x - med) for x in steps)
    return 1.25 * 1.4826 * mad / med / math.sqrt(len(steps)) if med > 0 else 0.0


def pooled(trials: Sequence[Trial]) -> list[Measured]:
    """Every plan that measured, its runs pooled, fastest first."""
    out: dict[tuple, list[Trial]] = {}
    for t in trials:
        if t.measured_ms is not None:
            out.setdefault(t.key, []).append(t)
    found = []
    for key, mine in out.items():
        steps = [x for t in mine for x in t.steps_ms]
        if len(steps) >= len(mine):
            found.append(Measured(key, statistics.median(steps), median_noise(steps), len(mine)))
        else:                                      # medians only
            found.append(Measured(key, statistics.median(t.measured_ms or 0.0 for t in mine), 0.0, len(mine)))
    return sorted(found, key=lambda m: m.median_ms)


def within_noise(a: Measured, b: Measured) -> bool:
    """Whether the two medians differ by less than twice their combined noise."""
    gap = abs(a.median_ms - b.median_ms) / min(a.median_ms, b.median_ms)
    return gap < 2 * math.hypot(a.noise, b.noise)


def fastest_measured(trials: Sequence[Trial]) -> Trial | None:
    """A trial of the plan with the fastest pooled measurement (its first run)."""
    ranked = pooled(trials)
    return next(t for t in trials if t.key == ranked[0].key) if ranked else None


def relative_error(predicted: float, measured: float) -> float:
    return abs(predicted - measured) / measured


def decide(candidates: Sequence[Candidate], trials: Sequence[Trial], *, tolerance: float = 0.05,
           close: float = 0.5) -> Decision:
    """The next plan to run, or None with the reason to stop (module docstring)."""
    failed = {t.key for t in trials if t.measured_ms is None}
    candidates = [c for c in candidates if c.key not in failed]
    if not candidates:
        return Decision(None, "no strategy makes a plan" if not failed else "every plan left failed to run")
    ran = {t.key: t for t in trials}
    best = candidates[0]
    if best.key not in ran:
        why = ("the model's best plan" if not trials else "best predicted after refinement" if len(failed) < len(trials)
               else "best predicted of the plans that have not failed")
        return Decision(best, why)
    top = fastest_measured(trials)
    mine = ran[best.key]
    if top is not None and top.key == best.key and mine.measured_ms is not None \
            and relative_error(mine.predicted_ms, mine.measured_ms) <= tolerance:
        return Decision(None, f"converged: the best predicted plan is the fastest measured, and it was predicted "
                              f"within {100 * tolerance:g}% before it ran")
    ranked = pooled(trials)
    if len(ranked) >= 2 and within_noise(ranked[0], ranked[1]) and min(ranked[0].runs, ranked[1].runs) < 2:
        again = min(ranked[:2], key=lambda m: m.runs)
        pick = next((c for c in candidates if c.key == again.key), None)
        if pick is not None:
            gap = 100 * (ranked[1].median_ms / ranked[0].median_ms - 1)
            return Decision(pick, f"re-measured: the two fastest measured plans are {gap:.1f}% apart, within the "
                                  "noise of their steps")
    for c in candidates[1:]:
        if c.key not in ran and c.predicted_ms <= best.predicted_ms * (1 + close):
            gap = 100 * (c.predicted_ms / best.predicted_ms - 1)
            return Decision(c, f"runner-up predicted {gap:.1f}% behind the best (within {100 * close:g}%)")
    return Decision(None, f"no untried plan is predicted within {100 * close:g}% of the best")
