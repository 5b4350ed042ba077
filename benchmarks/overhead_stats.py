"""Paired spread for ``overhead.py``: per alternation, ours / torch of every measure, and the
median, interquartile range and a bootstrap interval of those ratios.

Runs alternate in one invocation (ours, torch, torch, ours, ...): round ``r``'s ``ours`` and
``torch`` runs are neighbours in time, so drift of the machine's load hits both alike and
their ratio is the sample; the interval says whether the rounds' ratios separate from 1.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence

Pick = Callable[[dict], float | None]


def quantile(xs: Sequence[float], q: float) -> float:
    """Linear-interpolated ``q`` quantile of ``xs`` (numpy's default rule)."""
    s = sorted(xs)
    pos = (len(s) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def bootstrap_median(xs: Sequence[float], draws: int = 2000, level: float = 0.95, seed: int = 0) -> tuple[float, float]:
    """Percentile bootstrap interval of the median of ``xs`` (resampled with replacement)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(xs, k=len(xs))) for _ in range(draws))
    return quantile(meds, (1 - level) / 2), quantile(meds, 1 - (1 - level) / 2)


def ratio_summary(ratios: Sequence[float]) -> dict:
    """Median, quartiles, min/max and a 95% bootstrap interval of the median of ``ratios``; the
    verdict ``lighter`` / ``heavier`` where the interval lies wholly below / above 1."""
    lo, hi = bootstrap_median(ratios)
    verdict = "lighter" if hi < 1.0 else "heavier" if lo > 1.0 else "not separated"
    return {"ratios": list(ratios), "median": statistics.median(ratios), "q1": quantile(ratios, 0.25),
            "q3": quantile(ratios, 0.75), "min": min(ratios), "max": max(ratios), "ci95": [lo, hi],
            "verdict": verdict}


def measures(instructions: Sequence[str], kinds: Sequence[str]) -> dict[str, Pick]:
    """The per-run numbers to pair (from ``overhead.per_run``'s dict): the headline, every
    kind's step-thread CPU per call, the all-thread send + receive, the process CPU per step."""
    out: dict[str, Pick] = {
        "framework_cpu_us_per_instruction": lambda r: r["framework_cpu_us_per_instruction"],
        "comm_all_threads_us_per_instruction": lambda r: r["comm_all_threads_us_per_instruction"],
        "process_cpu_us_per_step": lambda r: r["process_cpu_us_per_step"],
        "wall_ms_per_step": lambda r: r["wall_ms_per_step"],
    }
    for k in kinds:
        out[f"{k}_us_per_call"] = lambda r, k=k: r["us_per_instruction"].get(k)
    for k in instructions[:2]:
        out[f"{k}_overhead_us"] = lambda r, k=k: r["overhead_us"].get(k)
    return out


def paired(ours: Sequence[dict], theirs: Sequence[dict], picks: dict[str, Pick]) -> dict[str, dict]:
    """Per measure, :func:`ratio_summary` of round r's ours / torch (rounds where both are positive)."""
    out = {}
    for name, pick in picks.items():
        rs = [a / b for o, t in zip(ours, theirs, strict=True)
              if (a := pick(o)) is not None and (b := pick(t)) is not None and b > 0 and a > 0]
        if rs:
            out[name] = ratio_summary(rs)
    return out
