"""Refinement: correct the cost model where training runs disagreed with it (issue 18).

A pure function of (profile, cluster, calibrations, observed runs) -> :class:`Refinement`; the
observations are plain numbers (``observed.py``, read run by run against the model in
``evidence.py``), so no process group is needed. What it learns:

* Compute, per node. A stage's measured forward (backward) of one micro-batch, over the
  profile's prediction for its nodes, is that stage's factor; it is spread back to its nodes in
  proportion to the profile. With several runs (different stage boundaries) the node factors
  are fitted to every stage at once by iterative proportional scaling (each node's factor times
  the geometric mean of measured / predicted over the stages that hold it; exact for one run).
  The factors split into a cluster-wide ``compute_slowdown`` (their time-weighted geometric
  mean: contention, the emulated hosts' CPU quota) and per-node residuals (the profile's errors).
  ``node_shrink`` > 0 pulls the residuals toward 1 (``shrinkage.py``); off by default: it did not
  improve leave-one-plan-out on both recorded groups at a strength chosen from the training runs
  (RESULTS 4e).
* All-reduce, per size class. A replicated stage's measured wait for its gradients after its
  last backward is compared with the per-layer lane of ``layersync.py``: each layer's
  all-reduce (the algorithm it ran, priced by the model) queued as the measured backward frees
  it; the lane's wait after the backward grows with a common factor ``f`` on the all-reduce
  times, and ``f`` is solved so that the lane's wait equals the measured one (bisection; the
  wait is monotone in ``f``). A stage whose syncs were fully hidden and predicted so teaches
  nothing and is left out. Each estimate belongs to the size class (powers of 4 bytes) of its
  layers' bytes (weighted by their all-reduce time); a class's factor is the weighted geometric
  mean of its estimates. So a 400 MB layer that crawls beside compute does not slow the model's
  small all-reduces, as one overlap_slowdown number would.
* What is left: each run's measured step against the refined model's prediction for its stages
  (the step by ``refine(step=...)``: ``objective.predict_step_ms`` here; the commands pass the schedule's
  critical path, ``pipeline.simulator.predicted_step_ms``, which this package cannot import).
  Three terms explain the rest. Compute lost beside all-reduces that the stages' own compute
  did not show (on hosts that share CPUs a big all-reduce slows the other stages: it shows in
  the steps only), added to the interference per link byte (``interference.py``), is
  searched like the latency below, after it, and the latency again after that (only where a
  run had an all-reduce). A latency per p2p message beyond the wire time (``p2p_extra_alpha``:
  handing a message over between busy ranks; the model charges it wherever it charges a
  message, so it moves plans) and a cost per step the model does not price (``step_overhead_ms``:
  Python and launch costs per step; added to every prediction, it changes no ranking). The
  latency is searched (a log grid, then a ternary search) for the least absolute relative error
  over the runs, the overhead being the median of what is left (at least 0) at each candidate;
  with one run, or runs that cannot tell them apart, the smaller latency wins. Absolute, not
  squared: one plan the model cannot explain (a host slowed for a whole run) would otherwise set
  the terms for every plan (RESULTS 4e: the squares raised the loss to its grid's end, 30 ms/MB,
  leaving AlexNet's ``0-10x2 | 11-21x2`` out, which it then priced +38%).
* The end of a step (``step.py``): each stage's ``step`` phase against the model's
  optimizer step for its parameter bytes and the tied weights' sums it takes part in; the
  optimizer factor scales the profile's step times, the tied factor the sums' prices
  (``tied_slowdown``). The run's prediction counts the tied sums as the plan's does.
* Two stage terms beside the node factors (``refine(terms=...)``, both by default; ``computefit.py``):
  the replicas' compute stretch per replica count (``replicas``) and gradient accumulation per parameter
  byte (``accumulation``); without them the node factors average both into every stage (RESULTS 4e).
* p2p, per level: each transfer's seconds over the model's for its bytes at the level between
  its ranks. Receivers' records (header to last byte: the wire time, no wait for the sender)
  give the median of their ratios; without them (older traces), the lower quartile of the
  senders' ratios (a send that waited for its receiver reads long; the quickest quarter did not).

The corrections are relative to the model the run is compared with (the calibrations given,
themselves possibly refined before), and apply as data: :func:`refined_profile` (the profile's
node times with the residuals) and :func:`refined_calibrations` (the calibration of the
cluster's outermost level carries ``compute_slowdown`` and ``allreduce_slowdown``; each level's
p2p fit is scaled). Together they reproduce the measured compute; the calibration alone is
what another model on the same cluster reuses. Always refine from the original profile and
calibrations with all the runs: the function is pure, and refining a refined model again with
the same runs would count the corrections twice.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, replace

import numpy as np

from hybridpipe.errors import UserError
from hybridpipe.partitioner.cost.calibration import Calibration, LinkFit
from hybridpipe.partitioner.cost.cluster import Cluster
from hybridpipe.partitioner.cost.costmodel import CostModel, size_factor
from hybridpipe.partitioner.plan import ALGORITHMS
from hybridpipe.partitioner.planner import priced_tied
from hybridpipe.partitioner.refine.computefit import (
    compute_stages,
    fit_accumulation,
    fit_replica_compute,
    without_accumulation,
)
from hybridpipe.partitioner.refine.evidence import (
    p2p_factors,
    stage_layouts,
    stage_load,
    step_evidence,
    without_interference,
)
from hybridpipe.partitioner.refine.interference import fit_interference
from hybridpipe.partitioner.refine.observed import RunObservation
from hybridpipe.partitioner.refine.shrinkage import cross_validated_strength, fit_shrunk
from hybridpipe.partitioner.refine.step import fit_step
from hybridpipe.partitioner.refine.sync import (
    SIZE_CLASS_BASE,
    SyncEvidence,
    fit_classes,
    fit_groups,
    stage_sync_evidence,
)
from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.partitioner.search.modelcosts import ModelCosts, model_costs
from hybridpipe.partitioner.search.objective import Options, StageSpec, StepModel, evaluate, formula_step_ms
from hybridpipe.profiles.format import Profile

TERMS = ("replicas", "accumulation")      # what refine(terms=...) may fit beside the node factors (computefit.py)
DEFAULT_TERMS = TERMS                     # what it fits unless told otherwise (module docstring)


@dataclass(frozen=True)
class Refinement:
    """What runs taught, relative to the model they were compared with (see the module docstring)."""

    forward_factor: tuple[float, ...]      # per node: measured / predicted (1 where no run saw it)
    backward_factor: tuple[float, ...]
    compute_slowdown: float                # the nodes' common part (time-weighted geometric mean)
    allreduce_slowdown: tuple[tuple[float, float], ...]    # (bytes, factor) per size class
    p2p_factor: tuple[tuple[int, float], ...]              # (cluster level, factor)
    runs: tuple[str, ...]
    sync: tuple[SyncEvidence, ...]
    step_overhead_ms: float = 0.0                          # added per step (see the module docstring)
    p2p_extra_alpha_s: tuple[tuple[int, float], ...] = ()  # (cluster level, seconds added per message)
    optimizer_factor: float = 1.0                          # the optimizer step: measured / profiled
    interference_s_per_byte: float | None = None           # compute lost per link byte (None: as calibrated)
    tied_factor: float = 1.0                               # the tied weights' sums: measured / priced
    allreduce_slowdown_groups: tuple[tuple[int, tuple[tuple[float, float], ...]], ...] = ()   # per group size
    replica_compute: tuple[tuple[int, float], ...] = ()    # (replicas, rho): cost/computeterms.py
    accumulate_s_per_byte: float = 0.0                     # per accumulating backward and parameter byte

    def node_factor(self, i: int) -> tuple[float, float]:
        return self.forward_factor[i], self.backward_factor[i]


def base_costs(profile: Profile, model: CostModel) -> ModelCosts:
    """The profile's costs as the model prices them (compute_slowdown of refined calibrations applied)."""
    return model_costs(profile).slowed(model.compute_slowdown)


def refine(profile: Profile, cluster: Cluster, calibrations: Sequence[Calibration], runs: Sequence[RunObservation],
           algorithms: Sequence[str] = ALGORITHMS, node_shrink: float | None = 0.0,
           terms: Collection[str] = DEFAULT_TERMS, step_loss: bool = True,
           step: StepModel = formula_step_ms) -> Refinement:
    """What ``runs`` of ``profile``'s model on ``cluster`` say about the cost model (module docstring).
    ``node_shrink``: how hard the per-node factors are pulled toward the common one (``shrinkage.py``;
    None: cross-validated over the runs' stage layouts). ``terms``: which of :data:`TERMS` to fit as well
    (``computefit.py``; default both; none: the node factors alone). ``step_loss``: :func:`fit_leftover`'s;
    ``step``: the step model its leftover terms are fitted under (:func:`predict_run`'s)."""
    if not runs:
        raise UserError("nothing to refine from: pass at least one run directory")
    model = CostModel(cluster, list(calibrations))
    costs = base_costs(profile, model)
    for run in runs:
        for st in run.stages:
            if not 0 <= st.first <= st.last < costs.n:
                raise UserError(f"{run.name}: stage nodes {st.first}-{st.last} are not nodes of {profile.model}'s "
                                f"profile ({costs.n} nodes); refine with the profile the run's plan was made from")
            if st.ranks and max(st.ranks) >= cluster.total_workers:
                raise UserError(f"{run.name}: rank {max(st.ranks)} is outside the cluster's "
                                f"{cluster.total_workers} workers; refine with the cluster the run ran on")
    if unknown := set(terms) - set(TERMS):
        raise UserError(f"unknown refinement term(s) {', '.join(sorted(unknown))}; known: {', '.join(TERMS)}")
    lost = fit_interference([stage_load(costs, run, k)[0] for run in runs for k in range(len(run.stages))])
    seen = [without_interference(costs, run, lost) for run in runs]     # ms per link byte taken out
    staged = [compute_stages(costs, run) for run in seen]
    accumulate = fit_accumulation([s for st in staged for s in st]) if "accumulation" in terms else 0.0
    fitted = [[without_accumulation(s, accumulate) for s in st] for st in staged]
    # the node factors see the backwards without the accumulation
    fit_runs = [replace(run, stages=tuple(replace(o, backward_ms=c.backward_ms) for o, c in zip(
        run.stages, st, strict=True))) for run, st in zip(seen, fitted, strict=True)] if accumulate else seen
    fwd, bwd = stage_layouts(fit_runs, "forward_ms"), stage_layouts(fit_runs, "backward_ms")
    if node_shrink is None:
        node_shrink = cross_validated_strength([(costs.forward_ms, fwd), (costs.backward_ms, bwd)])
    rho: tuple[tuple[int, float], ...] = ()
    if "replicas" in terms:
        f_fwd, f_bwd, rho = fit_replica_compute(costs.forward_ms, costs.backward_ms, [s for st in fitted for s in st],
                                                node_shrink)
    else:
        f_fwd = fit_shrunk(costs.forward_ms, [s for lay in fwd for s in lay], node_shrink)
        f_bwd = fit_shrunk(costs.backward_ms, [s for lay in bwd for s in lay], node_shrink)
    weight = costs.forward_ms + costs.backward_ms
    logs = costs.forward_ms * np.log(f_fwd) + costs.backward_ms * np.log(f_bwd)
    slowdown = float(math.exp(logs.sum() / weight.sum())) if weight.sum() > 0 else 1.0
    evidence = [e for run in seen for k, st in enumerate(run.stages)
                if (e := stage_sync_evidence(run.name, k, st, costs, model, f_fwd, f_bwd, algorithms)) is not None]
    steps = [step_evidence(profile, costs, model, run) for run in runs]
    ends = fit_step([s for s, _ in steps], [g for _, g in steps])
    ref = Refinement(tuple(float(x) for x in f_fwd), tuple(float(x) for x in f_bwd), slowdown,
                     fit_classes(evidence), p2p_factors(runs, model), tuple(r.name for r in runs), tuple(evidence),
                     optimizer_factor=1.0 if ends.optimizer is None else ends.optimizer,
                     interference_s_per_byte=lost * 1e-3 / model.wire_bytes,
                     tied_factor=1.0 if ends.tied is None else max(ends.tied, 1e-3),
                     allreduce_slowdown_groups=fit_groups(evidence), replica_compute=rho,
                     accumulate_s_per_byte=accumulate)
    return fit_leftover(profile, cluster, calibrations, ref, runs, algorithms, step_loss, step)


def search_log(score: Callable[[float], float], grid: Sequence[float]) -> float:
    """The x of ``grid`` (0 first, then increasing) with the least score, refined by a ternary search in
    log space between its neighbours; ties go to the smaller x."""
    errors = [score(x) for x in grid]
    k = min(range(len(grid)), key=lambda i: (round(errors[i], 12), grid[i]))
    if len(grid) < 3 or k == 0:
        return grid[k]
    lo, hi = math.log(grid[k - 1] or grid[1] / 10), math.log(grid[min(k + 1, len(grid) - 1)])
    for _ in range(30):
        a, b = lo + (hi - lo) / 3, hi - (hi - lo) / 3
        if score(math.exp(a)) <= score(math.exp(b)):
            hi = b
        else:
            lo = a
    mid = math.exp((lo + hi) / 2)
    return mid if score(mid) < errors[k] else grid[k]


def fit_leftover(profile: Profile, cluster: Cluster, calibrations: Sequence[Calibration], ref: Refinement,
                 runs: Sequence[RunObservation], algorithms: Sequence[str], step_loss: bool = True,
                 step: StepModel = formula_step_ms) -> Refinement:
    """``ref`` with the p2p message latency, the compute lost to all-reduces beyond what the stages'
    own compute showed (``step_loss``; else none), and the step overhead that best explain the measured
    steps (coordinate search: latency, then the loss, then the latency again)."""
    measured = [r for r in runs if r.measured_step_ms]
    if not measured:
        return ref
    prof = refined_profile(profile, ref)
    levels = sorted({lv for lv, _ in ref.p2p_factor})
    seen = ref.interference_s_per_byte or 0.0

    def scored(delta: float, lost: float) -> tuple[float, float]:
        trial = replace(ref, p2p_extra_alpha_s=tuple((lv, delta) for lv in levels),
                        interference_s_per_byte=seen + lost)
        cals = refined_calibrations(cluster, calibrations, trial)
        pred = [predict_run(prof, cluster, cals, r, algorithms=algorithms, step=step) for r in measured]
        left = max(0.0, statistics.median([r.measured_step_ms - p for r, p in zip(measured, pred, strict=True)
                                           if r.measured_step_ms]))
        err = sum(abs((p + left - (r.measured_step_ms or 0)) / (r.measured_step_ms or 1))
                  for r, p in zip(measured, pred, strict=True))
        return err, left

    alphas = [0.0, *np.geomspace(1e-6, 0.2, 40).tolist()] if levels else [0.0]
    losses = [0.0, *np.geomspace(1e-11, 3e-8, 25).tolist()] if any(len(s.ranks) > 1 for r in measured
                                                                      for s in r.stages) and step_loss else [0.0]
    delta = search_log(lambda d: scored(d, 0.0)[0], alphas)
    lost = search_log(lambda g: scored(delta, g)[0], losses)
    if lost:
        delta = search_log(lambda d: scored(d, lost)[0], alphas)
    return replace(ref, p2p_extra_alpha_s=tuple((lv, delta) for lv in levels) if delta else (),
                   interference_s_per_byte=seen + lost, step_overhead_ms=scored(delta, lost)[1])


def refined_profile(profile: Profile, ref: Refinement) -> Profile:
    """The profile with each node's residual factor (its factor over compute_slowdown) and the
    optimizer factor (on its optimizer step times) applied.

    Its graph (and signature) is unchanged, so plans made from it launch as the original's."""
    c = ref.compute_slowdown
    nodes = tuple(replace(n, forward_ms=n.forward_ms * ref.forward_factor[n.id] / c,
                          backward_ms=n.backward_ms * ref.backward_factor[n.id] / c) for n in profile.nodes)
    o = ref.optimizer_factor
    totals = replace(profile.totals, forward_ms=sum(n.forward_ms for n in nodes),
                     backward_ms=sum(n.backward_ms for n in nodes),
                     sgd_step_ms=profile.totals.sgd_step_ms * o, adam_step_ms=profile.totals.adam_step_ms * o)
    note = f"refined from {len(ref.runs)} run(s) (hybridpipe partition --refine); use with the refined calibration"
    return replace(profile, nodes=nodes, totals=totals, notes=(*profile.notes, note))


def nominal_calibration(model: CostModel, level: int) -> Calibration:
    """A calibration holding the cluster file's nominal numbers for ``level`` (to carry refinements)."""
    cluster = model.cluster
    below = cluster.span(level - 1) if level > 0 else 1
    return Calibration(world_size=cluster.total_workers, hosts=max(1, cluster.total_workers // below),
                       backend="nominal", device="nominal", level=cluster.levels[level].name,
                       gamma_s_per_byte=model.gamma, p2p=model.link(level), algorithms={},
                       notes=("the cluster file's nominal costs (no bench-allreduce), carrying refinements",))


def refined_calibrations(cluster: Cluster, calibrations: Sequence[Calibration],
                         ref: Refinement) -> tuple[Calibration, ...]:
    """The calibrations with ``ref`` applied (module docstring); levels without one get a nominal one."""
    model = CostModel(cluster, list(calibrations))
    by_level = dict(model.calibrations)
    top = len(cluster.levels) - 1
    for lv in {top, *(lv for lv, _ in ref.p2p_factor), *(lv for lv, _ in ref.p2p_extra_alpha_s)}:
        by_level.setdefault(lv, nominal_calibration(model, lv))
    out = {}
    for lv, cal in by_level.items():
        factor, extra = dict(ref.p2p_factor).get(lv), dict(ref.p2p_extra_alpha_s).get(lv, 0.0)
        if factor is not None or extra:
            factor = 1.0 if factor is None else factor
            algos = {a: cal.algorithms.get(a, cal.p2p) for a in ALGORITHMS}       # all-reduces stay as they were
            cal = replace(cal, algorithms=algos, p2p=LinkFit(cal.p2p.alpha_s * factor + extra,
                                                              cal.p2p.beta_s_per_byte * factor, cal.p2p.rel_error))
        if ref.interference_s_per_byte is not None:
            cal = replace(cal, interference_s_per_byte=ref.interference_s_per_byte)
        out[lv] = replace(cal, allreduce_slowdown=(), allreduce_slowdown_groups=(), compute_slowdown=1.0,
                          step_overhead_ms=0.0, tied_slowdown=1.0, replica_compute=(), accumulate_s_per_byte=0.0)
    carrier = out[top]
    old = model.allreduce_points
    new_classes = {math.floor(math.log(b, SIZE_CLASS_BASE)) for b, _ in ref.allreduce_slowdown}
    points = [(b, f * float(size_factor(old, b))) for b, f in ref.allreduce_slowdown]
    points += [(b, f) for b, f in old if math.floor(math.log(b, SIZE_CLASS_BASE)) not in new_classes]
    merged: dict[float, float] = dict(sorted(points))
    groups = tuple((g, tuple((b, f * float(model.allreduce_factor(b, g))) for b, f in pts))
                   for g, pts in ref.allreduce_slowdown_groups)
    out[top] = replace(carrier, allreduce_slowdown=tuple(sorted(merged.items())),
                       allreduce_slowdown_groups=groups or model.allreduce_groups,
                       compute_slowdown=model.compute_slowdown * ref.compute_slowdown,
                       tied_slowdown=model.tied_slowdown * ref.tied_factor,
                       step_overhead_ms=max(0.0, model.step_overhead_ms + ref.step_overhead_ms),
                       replica_compute=ref.replica_compute or model.replica_compute,
                       accumulate_s_per_byte=model.accumulate_s_per_byte + ref.accumulate_s_per_byte,
                       refined_from=tuple(dict.fromkeys((*carrier.refined_from, *ref.runs))))
    return tuple(out[lv] for lv in sorted(out))


def predict_run(profile: Profile, cluster: Cluster, calibrations: Sequence[Calibration], run: RunObservation,
                optimizer: str = "sgd", algorithms: Sequence[str] = ALGORITHMS,
                step: StepModel = formula_step_ms) -> float:
    """The step time the model predicts for the stages a run ran (its ranks, schedule, micro-batches),
    tied weights' sums included, as a plan's prediction counts them; the step itself by ``step``."""
    return predict_stages(profile, cluster, calibrations, [StageSpec(s.first, s.last, s.ranks) for s in run.stages],
                          run.schedule, run.micro_batches, optimizer, algorithms, step)


def predict_stages(profile: Profile, cluster: Cluster, calibrations: Sequence[Calibration],
                   stages: Sequence[StageSpec], schedule: str, micro_batches: int, optimizer: str = "sgd",
                   algorithms: Sequence[str] = ALGORITHMS, step: StepModel = formula_step_ms) -> float:
    """:func:`predict_run` for ``stages`` (unsharded, without recomputation, fp32 on the wire) run with
    ``schedule`` and ``micro_batches``: what a plan of them is predicted to take a step."""
    model = CostModel(cluster, list(calibrations))
    opts = Options(get_schedule(schedule), micro_batches, optimizer, math.inf, tuple(algorithms))
    costs = base_costs(profile, model)
    tied = sum(t.predicted_ms for t in priced_tied(profile, stages, model))
    return step(evaluate(costs, model, stages, opts), costs, stages, opts) + tied + model.step_overhead_ms
