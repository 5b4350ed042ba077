"""The joint search: the schedule, the virtual stages per worker and the precision chosen together with
the stages (``partition --schedule auto`` without ``--virtual-stages``, ``--virtual-stages auto``,
``--precision auto``; issue 30).

A loop over the discrete choices around the exact searches: for every (schedule, V, precision) the
request leaves open, ``planner.partition`` finds that choice's best plan (the DP over stages,
replicas and per-stage recomputation for one chunk per worker; for V > 1 the chunk DP on every
contiguous grouping of the workers, ``search/virtual.py``), and the plan whose step the schedule
simulator predicts fastest wins (ties: the earlier choice, so fewer chunks, the earlier schedule
in the registry, fp32 before bf16). V runs from 1 to the most chunks the model's nodes allow for
two groups, at most ``MAX_VIRTUAL``; where simulating the plans would be too large (``MAX_SIMULATED_OPS``),
V = 1 and the DP's prediction, as without the joint search. Recomputation is searched inside each choice already
(``--recompute auto``: per stage, only where it is needed to fit).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from hybridpipe.errors import UserError
from hybridpipe.partitioner.cost.calibration import Calibration
from hybridpipe.partitioner.cost.cluster import Cluster
from hybridpipe.partitioner.planner import Outcome, Request, partition, resolve, simulated_ms
from hybridpipe.partitioner.schedule_registry import AUTO, REGISTRY, auto_candidates
from hybridpipe.partitioner.search import dp
from hybridpipe.partitioner.search.virtual import Simulate
from hybridpipe.profiles.format import Profile

MAX_VIRTUAL = 4            # the most chunks per worker the joint search tries
# the joint search simulates its plans: past this many instructions (ranks x micro-batches x chunks, about 6
# each) a cluster plans with one chunk per worker as before, by the DP's prediction (the search stays fast)
MAX_SIMULATED_OPS = 500_000
AUTO_VIRTUAL = 0           # Request.virtual_stages for "search V" (the CLI's --virtual-stages auto or none with auto)
SEARCHED_PRECISIONS = ("fp32", "bf16")    # --precision auto (fp16 prices as bf16)


@dataclass(frozen=True)
class Choice:
    """One point of the discrete space."""

    schedule: str
    virtual: int
    precision: str


@dataclass(frozen=True)
class Tried:
    """One choice of the joint search and how it came out."""

    choice: Choice
    step_ms: float | None          # simulated step of the choice's best plan; None: no plan (``why``)
    why: str = ""


@dataclass(frozen=True)
class Joint:
    """The joint search's pick and every choice it tried."""

    outcome: Outcome
    tried: tuple[Tried, ...]


def choices(schedule: str, virtual: int, precision: str, nodes: int) -> list[Choice]:
    """The (schedule, V, precision) the request leaves open, in tie-break order."""
    if schedule == AUTO:
        names = [n for n in REGISTRY if REGISTRY[n].flushed and (REGISTRY[n].chunked or n in auto_candidates())]
    else:
        names = [schedule]
    most = max(1, min(MAX_VIRTUAL, nodes // 2))
    virtuals = list(range(1, most + 1)) if virtual == AUTO_VIRTUAL else [virtual]
    precisions = list(SEARCHED_PRECISIONS) if precision == AUTO else [precision]
    out: list[Choice] = []
    for v in virtuals:
        for name in names:
            kind = REGISTRY[name]
            if kind.virtual_ok(v) and (kind.chunked == (v > 1)):
                out.extend(Choice(name, v, p) for p in precisions)
    return out


def joint_partition(profile: Profile, cluster: Cluster, req: Request, calibrations: Sequence[Calibration] = (),
                    progress: Callable[[dp.Progress], None] | None = None, simulate: Simulate | None = None,
                    deadline: float | None = None) -> Joint:
    """The fastest simulated plan over the choices ``req`` leaves open (module docstring); UserError when none."""
    if simulate is None:
        raise ValueError("the joint search compares plans by simulation: pass simulate=")
    if deadline is None and req.time_budget_s is not None:
        deadline = time.monotonic() + req.time_budget_s
    if req.virtual_stages != AUTO_VIRTUAL and req.precision != AUTO:        # nothing open: the plain search
        return Joint(partition(profile, cluster, req, calibrations, progress, simulate, deadline), ())
    _, workers, opts = resolve(cluster, replace(req, virtual_stages=1, schedule="1f1b"))
    small = workers * opts.micro_batches * MAX_VIRTUAL * 6 <= MAX_SIMULATED_OPS
    if req.virtual_stages == AUTO_VIRTUAL and not small:
        req = replace(req, virtual_stages=1)
        if req.precision != AUTO:
            out = partition(profile, cluster, req, calibrations, progress, simulate, deadline)
            note = (f"virtual stages not searched: simulating {workers} workers x {opts.micro_batches} "
                    "micro-batches is too large; give --virtual-stages V to plan with V chunks")
            return Joint(replace(out, notes=out.notes + (note,)), ())
    options = choices(req.schedule, req.virtual_stages, req.precision, len(profile.nodes))
    if not options:
        raise UserError(f"--schedule {req.schedule} with --virtual-stages {req.virtual_stages or 'auto'} leaves "
                        "nothing to plan; see --help for which schedules run several chunks per worker")
    best: tuple[float, Outcome] | None = None
    tried, errors = [], []
    for c in options:
        sub = replace(req, schedule=c.schedule, virtual_stages=c.virtual, precision=c.precision)
        try:
            out = partition(profile, cluster, sub, calibrations, progress, simulate, deadline)
        except UserError as e:
            tried.append(Tried(c, None, str(e)))
            errors.append(e)
            continue
        step = (out.evaluation.objective_ms if c.virtual > 1 else simulated_ms(out, simulate) if small
                else out.plan.predicted_step_ms)
        tried.append(Tried(c, step))
        if best is None or step < best[0]:
            best = (step, out)
    if best is None:
        raise errors[0]
    step, out = best
    if len(options) > 1:
        note = (f"joint search: {out.plan.schedule}, {out.plan.virtual_stages} chunk(s) per worker, "
                f"{out.plan.precision}: the fastest simulated ({step:.1f} ms/step) of {len(options)} choices of "
                "schedule x virtual stages x precision")
        out = replace(out, notes=out.notes + (note,))
    return Joint(out, tuple(tried))
