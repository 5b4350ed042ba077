"""The optimal partition: PipeDream's recurrence, generalised, solved exactly over its search space.

Search space (a *layout*): R identical copies of one pipeline, copy c on the top-level units
``c*W/R .. (c+1)*W/R - 1`` (R divides the top level's fan-out; R = 1 is a single pipeline over
every worker). Inside a copy, stages are contiguous node ranges on contiguous blocks of ranks, in
stage order; a stage's replicas are its block in every copy. Every stage term of ``objective.py``
depends only on the stage's node range and its block, so with ``A[p, y]`` = the best objective for
nodes ``0..p-1`` on copy ranks ``0..y-1``::

    A[p, y] = min over i < p, x < y of max(A[i, x], term(nodes i..p-1, block x..y-1))

is exact (the brute-force tests enumerate every layout). Many plans share the optimal bottleneck; a
second pass picks, among them, the one with the smallest sum of stage terms (less work and traffic
off the critical stage; ties to fewer copies, then to the first block and start node).

Solved over all (p, y) that recurrence costs O(N^2 W^2): minutes at a few hundred workers. It is
solved here over a small part of it, and exactly (``tests/partitioner/test_dp_scale.py`` compares
plans bit for bit with the exhaustive solver): for a threshold U, ``relaxation.py`` bounds the ranks
every stage and every prefix of a plan with all terms <= U can have; ``region.py`` runs the same
recurrence over the states and stages inside those bounds, which contain every such plan. U starts
at the relaxation's own optimum (no plan is cheaper) and grows until some copy count has a plan
within it: that plan's objective is then the optimum, since every plan within U was searched. Each
failed U is a proven lower bound, which ``--time-budget`` reports as the optimality gap.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from hybridpipe.limits import OutOfTime
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.search.modelcosts import ModelCosts
from hybridpipe.partitioner.search.objective import StageSpec
from hybridpipe.partitioner.search.options import Options
from hybridpipe.partitioner.search.region import RegionResult, solve_region
from hybridpipe.partitioner.search.relaxation import lower_bound, min_block, windows
from hybridpipe.partitioner.search.stageterms import StageTerms

_NONE = RegionResult(math.inf, (), 0)
TIE = 1e-9          # relative slack when re-solving for plans that reach the optimal objective
FIRST_STEP = 1e-4   # the first threshold above the lower bound (relative); each failed one grows the step 25%
HUGE_MS = 1e15


@dataclass(frozen=True)
class Solution:
    """The stage list the search chose, its objective, the copy count it lays out, and what the search proved."""

    stages: tuple[StageSpec, ...]
    objective_ms: float
    copies: int
    lower_bound_ms: float = 0.0      # no plan is better (== objective_ms when solved to the end)
    complete: bool = True            # False: stopped by the deadline; ``stages`` is the best found so far


@dataclass(frozen=True)
class Progress:
    """Where a search stands: every plan costs at least ``lower_ms``; ``best_ms`` is the best found yet."""

    lower_ms: float
    best_ms: float
    phase: str
    candidates: int


def copy_counts(model: CostModel, workers: int) -> list[int]:
    """R values to try: 1, and every divisor of the top level's fan-out when there are >= 2 levels."""
    levels = model.cluster.levels
    if len(levels) < 2 or workers != model.cluster.total_workers:
        return [1]
    top = levels[-1].workers
    return [r for r in range(1, top + 1) if top % r == 0]


def solve(costs: ModelCosts, model: CostModel, workers: int, opts: Options, upper_bound: float = math.inf, *,
          deadline: float | None = None, progress: Callable[[Progress], None] | None = None) -> Solution:
    """The best layout over every copy count (see the module docstring).

    ``upper_bound`` is the objective of any feasible plan (e.g. pure data parallelism): only plans
    within it are searched (none found: an empty Solution with an infinite objective).
    ``deadline`` (``time.monotonic()``): stop there and return the best plan found so far (possibly
    none) with ``complete=False`` and the proven lower bound. ``progress`` is called as it goes.
    """
    search = _Search(costs, model, workers, opts, upper_bound, deadline, progress)
    try:
        return search.run()
    except OutOfTime:
        return search.interrupted()


class _Search:
    def __init__(self, costs: ModelCosts, model: CostModel, workers: int, opts: Options, upper_bound: float,
                 deadline: float | None, progress: Callable[[Progress], None] | None):
        self.counts = sorted(copy_counts(model, workers), reverse=True)
        shared: dict = {}
        self.terms = {r: StageTerms(costs, model, workers, r, opts, shared) for r in self.counts}
        self.bound = math.inf if math.isnan(upper_bound) else upper_bound * (1 + TIE) + TIE     # nan: no bound
        self.deadline, self.progress = deadline, progress
        self.lower, self.best = 0.0, math.inf
        self.found: dict[int, RegionResult] = {}
        self.seen = 0
        self.phase = "bounds"
        self.limit = 0.0

    def report(self) -> None:
        if self.progress is not None:
            self.progress(Progress(self.lower, min(self.best, self.bound), self.phase, self.seen))
        if self.deadline is not None and time.monotonic() > self.deadline:
            raise OutOfTime

    def proven(self, lower: float) -> None:
        """No plan is below ``lower``."""
        self.lower = lower
        self.report()

    def region(self, copies: int, limit: float, total: bool = False) -> RegionResult:
        """The best plan of one copy count within ``limit`` (inf: none)."""
        t = self.terms[copies]
        bmin = min_block(t, limit)
        lo, hi = windows(t, bmin)
        if not lo[-1] <= t.wc <= hi[-1]:
            return RegionResult(math.inf, (), 0)
        res = solve_region(t, bmin, lo, hi, limit, total=total, keep_below=limit, deadline=self.deadline,
                           tick=self.report)
        self.seen += res.candidates
        return res

    def run(self) -> Solution:
        self.report()
        # a copy count's relaxation is at least as tight as one pipeline's: R = 1 bounds them all
        self.lower = lower_bound(self.terms[1], self.bound, on_lower=self.proven)
        if not math.isfinite(self.lower):
            return Solution((), math.inf, 1, math.inf)
        self.phase = "search"
        step, limit = FIRST_STEP, self.lower * (1 + FIRST_STEP) + FIRST_STEP
        while True:
            limit = self.limit = min(limit, self.bound)
            if limit > HUGE_MS:
                limit = self.limit = math.inf
            self.report()
            for copies in self.counts:
                res = self.region(copies, limit)
                if res.stages and res.value < self.found.get(copies, _NONE).value:
                    self.found[copies] = res
                    self.best = min(self.best, res.value)
            if math.isfinite(self.best) and self.best <= limit:
                break
            if limit >= self.bound or not math.isfinite(limit):     # every plan was searched: there is none
                return Solution((), math.inf, 1, self.bound)
            self.lower = limit
            step *= 1.25
            # the best plan found is within reach: at its objective the next search must succeed
            limit = min(self.best, self.lower * (1 + step) + step)
        return self.tie_break(self.best)

    def tie_break(self, optimum: float) -> Solution:
        """Among plans reaching the optimum: the smallest sum of terms, then the fewest copies."""
        self.phase, self.lower = "ties", optimum
        cap = optimum * (1 + TIE) + TIE
        bound, tied = self.bound, []
        for copies in self.counts:             # most copies first: the exhaustive solver's bound tightened so
            res = self.found.get(copies)
            res = res if res is not None and res.value <= self.limit else None
            if res is None and self.limit < cap:
                res = self.region(copies, min(cap, bound))
            if res is not None and res.stages and res.value <= min(cap, bound):
                tied.append(copies)
                bound = min(bound, res.value)
        sums = [(res, c) for c in tied if (res := self.region(c, cap, total=True)).stages]
        if not sums:          # cannot happen (a tied plan has every term within cap); keep an optimal plan anyway
            copies, res = min(self.found.items(), key=lambda kv: (kv[1].value, kv[0]))
            return Solution(res.stages, optimum, copies, optimum)
        best, copies = min(sums, key=lambda rc: (rc[0].value, rc[1]))
        return Solution(best.stages, optimum, copies, optimum)

    def interrupted(self) -> Solution:
        """The best plan found before the deadline (objective-optimal if the search had ended)."""
        if self.found:
            copies, res = min(self.found.items(), key=lambda kv: (kv[1].value, kv[0]))
            return Solution(res.stages, res.value, copies, self.lower, complete=False)
        return Solution((), math.inf, 1, self.lower, complete=False)
