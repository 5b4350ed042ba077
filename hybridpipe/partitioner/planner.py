"""``partition``: a profile + a cluster + a request -> a Plan, for every strategy.

The request is validated first (each problem a one-line UserError saying what to change), the
strategy picks stages (``dp.py``, ``pipedream.py``, ``strategies.py``), and every plan is then
predicted with the same objective (``objective.py``), so strategies compare like for like.
"""

from __future__ import annotations

import datetime as dt
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

from hybridpipe.errors import UserError, counted
from hybridpipe.limits import OutOfTime
from hybridpipe.partitioner.cost.calibration import Calibration
from hybridpipe.partitioner.cost.cluster import Cluster
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.cost.syncunits import LayerSync
from hybridpipe.partitioner.cost.wire import activation_wire
from hybridpipe.partitioner.plan import (
    ALGORITHMS,
    STRATEGIES,
    WIRE_BYTES,
    Plan,
    SearchRecord,
    Stage,
    TiedGroup,
)
from hybridpipe.partitioner.schedule_registry import AUTO, DEFAULT_SCHEDULE, REGISTRY, auto_candidates, get_schedule
from hybridpipe.partitioner.search import dp
from hybridpipe.partitioner.search.cuts import blocked_message
from hybridpipe.partitioner.search.modelcosts import ModelCosts, model_costs
from hybridpipe.partitioner.search.objective import Evaluation, StageSpec, evaluate, predict_step_ms
from hybridpipe.partitioner.search.options import Options
from hybridpipe.partitioner.search.pipedream import pipedream_stages
from hybridpipe.partitioner.search.polish import polish_cuts
from hybridpipe.partitioner.search.refusals import memory_message, no_fit_message
from hybridpipe.partitioner.search.stagememory import transient_bytes
from hybridpipe.partitioner.search.strategies import baseline_stages
from hybridpipe.partitioner.search.virtual import (
    BASE_SCHEDULE,
    Simulate,
    check_virtual,
    fastest_virtual_plan,
    group_candidates,
)
from hybridpipe.partitioner.tied import tied_groups
from hybridpipe.profiles.format import Profile

MICRO_BATCHES_PER_WORKER = 2      # default micro-batches per step: enough to keep every stage busy
# every search stops after this long (partition --time-budget): above the slowest optimal search measured
# (50 nodes on 4096 workers, 85 s: benchmarks/RESULTS.md), so it cuts only what would run on and on
DEFAULT_TIME_BUDGET_S = 120.0


@dataclass(frozen=True)
class Request:
    """What ``hybridpipe partition`` was asked for (None = the default)."""

    workers: int | None = None
    strategy: str = "optimal"
    schedule: str = DEFAULT_SCHEDULE            # a schedule's name, or AUTO
    micro_batches: int | None = None
    optimizer: str = "sgd"
    memory_gb: float | None = None
    stages: int | None = None
    algorithms: tuple[str, ...] = ALGORITHMS
    dedicated_aggregator: bool = False
    recompute: str = "none"
    time_budget_s: float | None = DEFAULT_TIME_BUDGET_S   # stop every search then (None: never); optimal keeps
    #                                                      the best plan found and its proven gap
    precision: str = "fp32"                    # bf16/fp16: activations an fp32 profile measured at half the bytes
    reduce_dtype: str = "fp32"                 # what replicas sum gradients in (bf16/fp16: half the bytes)
    virtual_stages: int = 1                    # model chunks per rank (interleaved-1f1b, zbv: virtual.py)
    shard: str = "none"                        # what replicas shard: none|optimizer|gradients|parameters|auto
    zero3: bool = True                         # auto may choose ZeRO-3 (commands/runnable.py: False after its gathers
    #                                            would deadlock in a plan)


@dataclass(frozen=True)
class Outcome:
    """A plan with what predicted it: its evaluation, the cost model and the options it was searched under."""

    plan: Plan
    evaluation: Evaluation
    model: CostModel
    options: Options
    notes: tuple[str, ...] = ()                # what the user should know about how the plan was chosen


def resolve(cluster: Cluster, req: Request) -> tuple[Cluster, int, Options]:
    """Check the request against the cluster; (cluster cut to the workers, workers, options)."""
    if req.strategy not in STRATEGIES:
        raise UserError(f"unknown strategy {req.strategy!r}; choose from {', '.join(STRATEGIES)}")
    if req.schedule != AUTO:
        get_schedule(req.schedule)
    workers = cluster.total_workers if req.workers is None else req.workers
    if workers < 1:
        raise UserError(f"--workers must be at least 1, got {workers}")
    if workers > cluster.total_workers:
        raise UserError(f"--workers {workers} is more than the cluster's {cluster.total_workers} workers; "
                        "ask for fewer or describe a bigger cluster")
    cluster = cluster.with_workers(workers)
    if req.memory_gb is not None and not req.memory_gb > 0:
        raise UserError(f"--memory-gb must be > 0, got {req.memory_gb}")
    if req.micro_batches is not None and req.micro_batches < 1:
        raise UserError(f"--micro-batches must be at least 1, got {req.micro_batches}")
    if req.time_budget_s is not None and not req.time_budget_s > 0:
        raise UserError(f"--time-budget must be > 0 seconds, got {req.time_budget_s:g}")
    if req.stages is not None and req.stages < 1:
        raise UserError(f"--stages must be at least 1, got {req.stages}")
    if req.stages is not None and req.strategy in ("optimal", "pipedream"):
        raise UserError(f"--stages fixes the stage count of the uniform/params baselines; --strategy {req.strategy} "
                        "chooses its own; drop --stages")
    unknown = [a for a in req.algorithms if a not in ALGORITHMS]
    if unknown or not req.algorithms:
        raise UserError(f"--algorithms must name some of {', '.join(ALGORITHMS)}; "
                        f"got {', '.join(req.algorithms) or 'none'}")
    if req.memory_gb is not None:           # the plan records the budget it was made for
        cluster = replace(cluster, memory_gb=req.memory_gb)
    memory = cluster.memory_gb * 1e9
    micro = req.micro_batches or MICRO_BATCHES_PER_WORKER * workers
    opts = Options(get_schedule(req.schedule), micro, req.optimizer, memory, tuple(req.algorithms), req.recompute,
                   req.shard, req.zero3)
    return cluster, workers, opts


def partition(profile: Profile, cluster: Cluster, req: Request = Request(),
              calibrations: Sequence[Calibration] = (),
              progress: Callable[[dp.Progress], None] | None = None, simulate: Simulate | None = None,
              deadline: float | None = None) -> Outcome:
    """Plan ``profile`` on ``cluster`` as ``req`` asks; UserError when no plan is possible.

    ``progress`` is called as the optimal strategy's search goes (for a progress bar). Every search
    ends by ``deadline`` (``time.monotonic()``; default ``req.time_budget_s`` from now), shared by
    the plans ``auto`` and virtual stages compare.
    ``schedule="auto"``: the plan of the flushed schedule with the smallest predicted step
    (ties to the earlier one in the registry: less memory); the schedules with several chunks per
    rank only with ``virtual_stages`` > 1 (:func:`partition_virtual`). ``simulate`` (a plan -> its
    simulated step, ms) is needed for virtual stages, whose step the simulator predicts.
    """
    if deadline is None and req.time_budget_s is not None:
        deadline = time.monotonic() + req.time_budget_s
    if req.virtual_stages != 1 or (req.schedule != AUTO and get_schedule(req.schedule).chunked):
        return partition_virtual(profile, cluster, req, calibrations, progress, simulate, deadline)
    if req.schedule == AUTO:
        return fastest([partial(partition, profile, cluster, replace(req, schedule=name), calibrations, progress,
                                deadline=deadline) for name in auto_candidates()],
                       key=lambda o: o.plan.predicted_step_ms)
    cluster, workers, opts = resolve(cluster, req)
    for what, value in (("precision", req.precision), ("reduce dtype", req.reduce_dtype)):
        if value not in WIRE_BYTES:
            raise UserError(f"unknown {what} {value!r}; choose one of {', '.join(WIRE_BYTES)}")
    model = CostModel(cluster, list(calibrations), aggregator_dedicated=req.dedicated_aggregator,
                      wire_bytes=WIRE_BYTES[req.reduce_dtype],
                      activation_wire_bytes=activation_wire(req.precision, profile.precision))
    costs = model_costs(profile).slowed(model.compute_slowdown)
    stages, notes, search = choose_stages(req.strategy, costs, model, workers, opts, req.stages, deadline, progress,
                                          req.time_budget_s)
    if req.strategy == "optimal":
        stages, notes = polish_by_prediction(profile, costs, model, opts, stages, notes, deadline)
        stages, notes = prefer_data_parallel(profile, costs, model, workers, opts, stages, notes)
    blocked = blocked_message(costs, stages, req.strategy)
    if blocked:
        raise UserError(blocked)
    if req.strategy == "pipedream" and req.micro_batches is None:
        opts, note = divisible_micro_batches(stages, opts)
        notes += (note,)
    ev = evaluate(costs, model, stages, opts)
    if not ev.fits:
        raise UserError(memory_message(stages, ev, opts, req.strategy))
    plan = build_plan(profile, costs, cluster, stages, ev, opts, req.strategy, model, precision=req.precision,
                      reduce_dtype=req.reduce_dtype)
    if profile.precision != req.precision:      # activation and transient bytes are the profile's
        notes += (f"the profile was measured in {profile.precision} and the plan is for {req.precision}: its "
                  f"activation memory is {profile.precision}'s; `hybridpipe profile --precision {req.precision}` "
                  "measures it as the job runs",)
    return Outcome(replace(plan, search=search), ev, model, opts, notes)


def partition_virtual(profile: Profile, cluster: Cluster, req: Request, calibrations: Sequence[Calibration] = (),
                      progress: Callable[[dp.Progress], None] | None = None,
                      simulate: Simulate | None = None, deadline: float | None = None) -> Outcome:
    """A plan with ``req.virtual_stages`` chunks per rank (virtual.py): the groups and replicas of
    the 1F1B plan the strategy finds, the model cut into p*V chunks on them. ``auto``: the fastest
    simulated of the one-chunk schedules' best plan and each schedule that runs V chunks."""
    if simulate is None:
        raise ValueError("plans with virtual stages are predicted by simulation: pass simulate=")
    virtual = req.virtual_stages
    if virtual < 1:
        raise UserError(f"--virtual-stages must be at least 1, got {virtual}")
    if req.schedule == AUTO:
        names = [n for n, s in REGISTRY.items() if s.flushed and s.chunked and s.virtual_ok(virtual)]

        def plain() -> Outcome:            # the one-chunk schedules' best plan, its step simulated
            found = partition(profile, cluster, replace(req, virtual_stages=1), calibrations, progress,
                              deadline=deadline)
            return replace(found, evaluation=replace(found.evaluation, objective_ms=simulated_ms(found, simulate)))
        return fastest([partial(partition_virtual, profile, cluster, replace(req, schedule=name), calibrations,
                                progress, simulate, deadline) for name in names] + [plain],
                       key=lambda o: o.evaluation.objective_ms)
    kind = get_schedule(req.schedule)
    check_virtual(kind, virtual)
    base = partition(profile, cluster, replace(req, schedule=BASE_SCHEDULE, virtual_stages=1), calibrations, progress,
                     deadline=deadline)
    opts = replace(base.options, schedule=kind)
    costs = model_costs(profile).slowed(base.model.compute_slowdown)

    def build(specs: Sequence[StageSpec], ev: Evaluation, o: Options) -> Plan:
        return build_plan(profile, costs, base.plan.cluster, specs, ev, o, req.strategy, base.model,
                          precision=req.precision, reduce_dtype=req.reduce_dtype)
    groups = [tuple(s.ranks) for s in base.plan.stages]
    options = group_candidates(groups, base.plan.world_size) if req.strategy == "optimal" else [groups]
    plan, ev = fastest_virtual_plan(options, costs, base.model, opts, virtual, build, simulate)
    chosen = len({s.ranks for s in plan.stages})
    how = (f"the {req.strategy} strategy's {chosen} stage groups and replicas" if req.strategy != "optimal" else
           f"{chosen} stage groups, the fastest simulated of {len(options)} groupings (the 1F1B search's and every "
           "contiguous split)")
    note = f"{req.schedule}: {how}, each holding {virtual} of the model's {len(plan.stages)} chunks; step predicted " \
           "by simulation"
    notes = base.notes + (note,)
    return Outcome(replace(plan, search=base.plan.search), ev, base.model, opts, notes)


def fastest(attempts: Sequence[Callable[[], Outcome]], key: Callable[[Outcome], float]) -> Outcome:
    """The outcome with the smallest ``key`` (the earliest on a tie) among the attempts that find a plan;
    the first attempt's UserError when none does."""
    found, errors = [], []
    for attempt in attempts:
        try:
            found.append(attempt())
        except UserError as e:
            errors.append(e)
    if not found:
        raise errors[0]
    return min(found, key=key)


def simulated_ms(outcome: Outcome, simulate: Simulate) -> float:
    """A one-chunk plan's step as the simulator predicts it, with the tied sums and per-step
    overhead its prediction adds (to compare with plans whose step only the simulator predicts)."""
    plan = outcome.plan
    return simulate(plan) + sum(t.predicted_ms for t in plan.tied) + outcome.model.step_overhead_ms


def choose_stages(strategy: str, costs: ModelCosts, model: CostModel, workers: int, opts: Options,
                  stages: int | None = None, deadline: float | None = None,
                  progress: Callable[[dp.Progress], None] | None = None, budget_s: float | None = None
                  ) -> tuple[tuple[StageSpec, ...], tuple[str, ...], SearchRecord | None]:
    """The stage list a strategy picks, notes on how, and the optimal strategy's search record (stopped
    by ``deadline``: the best plan found and its proven gap to the optimum)."""
    if strategy == "optimal":
        start = time.monotonic()
        data_parallel = baseline_stages("dp", costs, workers)
        bound = evaluate(costs, model, data_parallel, opts).objective_ms
        sol = dp.solve(costs, model, workers, opts, bound, deadline=deadline, progress=progress)
        chosen = sol.stages if sol.stages else data_parallel if math.isfinite(bound) else None
        if chosen is None:
            raise UserError(no_fit_message(costs, workers, opts) if sol.complete else
                            "no plan found within --time-budget (not even data parallelism fits); "
                            "raise --time-budget or --memory-gb")
        objective = float(sol.objective_ms if sol.stages else bound)
        lower = objective if sol.complete else float(sol.lower_bound_ms)
        gap = max(0.0, objective / lower - 1) if lower > 0 else 0.0 if objective == 0 else None
        record = SearchRecord(sol.complete, round(time.monotonic() - start, 3), budget_s, objective, lower,
                              None if gap is None else round(gap, 6))
        return chosen, (), record
    try:
        if strategy == "pipedream":
            found = pipedream_stages(costs, model.cluster.with_workers(workers), opts.memory_bytes, deadline=deadline)
            if found is None:
                raise UserError("PipeDream's partitioner finds no plan within its memory check "
                                f"({opts.memory_bytes / 1e9:g} GB per worker); raise --memory-gb or add workers")
            return found, (), None
        return baseline_stages(strategy, costs, workers, stages, deadline=deadline), (), None
    except OutOfTime:
        raise UserError(f"--strategy {strategy} did not finish within --time-budget {budget_s or 0:g} s ({costs.n} "
                        f"nodes on {workers} workers); raise --time-budget, or use --strategy optimal (it keeps "
                        "the best plan found when stopped)") from None


def polish_by_prediction(profile: Profile, costs: ModelCosts, model: CostModel, opts: Options,
                         chosen: tuple[StageSpec, ...], notes: tuple[str, ...], deadline: float | None
                         ) -> tuple[tuple[StageSpec, ...], tuple[str, ...]]:
    """The DP's stages with their cuts moved while that lowers the predicted step (search/polish.py)."""
    def price(stages: tuple[StageSpec, ...]) -> float:
        ev = evaluate(costs, model, stages, opts)
        return predict_step_ms(ev, opts) + tied_ms(profile, stages, model) if ev.fits else math.inf
    stages, before, after = polish_cuts(chosen, price, lambda last: costs.blocked_cut(last) is None, deadline)
    if stages == tuple(chosen):
        return stages, notes
    return stages, notes + (f"the search's cuts moved to where the predicted step is lower ({before:.1f} -> "
                            f"{after:.1f} ms/step: its objective leaves out fill and drain transfers and tied sums)",)


def prefer_data_parallel(profile: Profile, costs: ModelCosts, model: CostModel, workers: int, opts: Options,
                         chosen: tuple[StageSpec, ...], notes: tuple[str, ...]
                         ) -> tuple[tuple[StageSpec, ...], tuple[str, ...]]:
    """The DP minimises the objective, which leaves out the transfer latencies of a flushed step's
    fill and drain and the tied weights' sum across stages; where those make the pipeline's
    predicted step slower than data parallelism's, keep data parallelism and say so, so that
    ``optimal`` is never predicted slower than ``dp``."""
    data_parallel = baseline_stages("dp", costs, workers)
    if tuple(chosen) == tuple(data_parallel):
        return chosen, notes
    ev_dp = evaluate(costs, model, data_parallel, opts)
    if not ev_dp.fits:
        return chosen, notes
    ours = predict_step_ms(evaluate(costs, model, chosen, opts), opts) + tied_ms(profile, chosen, model)
    theirs = predict_step_ms(ev_dp, opts) + tied_ms(profile, data_parallel, model)
    if theirs >= ours:
        return chosen, notes
    return data_parallel, notes + (
        f"the best pipeline found ({len(chosen)} stages, {ours:.1f} ms/step predicted) is slower than data "
        f"parallelism ({theirs:.1f} ms/step) once its fill and drain transfers and tied-weight sums are counted; "
        "using data parallelism",)


def priced_tied(profile: Profile, stages: Sequence[StageSpec], model: CostModel) -> list[TiedGroup]:
    """The tied groups of these stages, each priced as one float32 all-reduce over its stages' ranks per step."""
    out = []
    for group in tied_groups(profile, [(s.first, s.last) for s in stages]):
        ranks = sorted({r for i in group.stages for r in stages[i].ranks})     # zbv: stages 0 and 2p-1 share ranks
        # the runtime sums tied weights in float32 whatever the precision: undo the wire's scaling
        ms = model.allreduce_seconds("native", group.bytes / model.wire_bytes, ranks) * 1e3 * model.tied_slowdown
        out.append(replace(group, predicted_ms=round(ms, 6)))
    return out


def tied_ms(profile: Profile, stages: Sequence[StageSpec], model: CostModel) -> float:
    """Milliseconds per step the tied weights' sums across stages add."""
    return sum(t.predicted_ms for t in priced_tied(profile, stages, model))


def divisible_micro_batches(stages: Sequence[StageSpec], opts: Options) -> tuple[Options, str]:
    """PipeDream's replicas take micro-batches in rounds: the default count rounded up to a multiple of every
    stage's replica count."""
    step = math.lcm(*(len(s.ranks) for s in stages))
    micro = step * -(-opts.micro_batches // step)
    counts = ", ".join(str(len(s.ranks)) for s in stages)
    return (replace(opts, micro_batches=micro),
            f"--strategy pipedream: {counted(micro, 'micro-batch')} per step, a multiple of every "
            f"stage's replicas ({counts}); "
            "give --micro-batches to choose another")


def build_plan(profile: Profile, costs: ModelCosts, cluster: Cluster, stages: Sequence[StageSpec],
               ev: Evaluation, opts: Options, strategy: str, model: CostModel | None = None,
               precision: str = "fp32", reduce_dtype: str = "fp32") -> Plan:
    """The Plan: stages with their predicted figures, the step time and throughput.

    Parameters read by several stages (tied weights) are summed across those stages' ranks once
    per step, after the last backward (torch's own all-reduce): it is added to the predicted step."""
    model = model or CostModel(cluster)
    tied = priced_tied(profile, stages, model)
    step_ms = predict_step_ms(ev, opts) + sum(t.predicted_ms for t in tied) + model.step_overhead_ms
    out = []
    for idx, (spec, e) in enumerate(zip(stages, ev.stages, strict=True)):
        out.append(Stage(index=idx, first_node=spec.first, last_node=spec.last, replicas=len(spec.ranks),
                         ranks=tuple(spec.ranks), compute_ms=e.forward_ms + e.backward_ms, forward_ms=e.forward_ms,
                         backward_ms=e.backward_ms, sync_ms=e.sync_ms_per_step + e.midstep_ms, send_ms=e.send_ms,
                         send_bytes=int(e.send_bytes), memory_bytes=int(e.memory_bytes),
                         transient_bytes=int(transient_bytes(costs, spec.first, spec.last)),
                         layers=without_tied(e.sync.layers, {t.param: t.bytes for t in tied if idx in t.stages}),
                         overhead_ms=e.overhead_ms, ring_ms=e.ring_ms, overlapped_ring_ms=e.overlapped_ring_ms,
                         recompute=e.recompute, shard=e.shard,
                         reshard_after_forward=e.reshard_after_forward))
    samples = opts.micro_batches * profile.batch_size / (step_ms / 1e3) if step_ms > 0 else 0.0
    return Plan(model=profile.model, batch_size=profile.batch_size, input_shape=tuple(profile.input_shape),
                profile_signature=profile.signature(), cluster=cluster, strategy=strategy, schedule=opts.schedule.name,
                micro_batches=opts.micro_batches, optimizer=opts.optimizer, stages=tuple(out),
                predicted_step_ms=step_ms, predicted_samples_per_s=samples,
                created=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                granularity=profile.granularity, tied=tuple(tied), precision=precision,
                profile_precision=profile.precision, reduce_dtype=reduce_dtype, graph_nodes=len(profile.nodes),
                profile_threads=profile.threads if profile.device == "cpu" else 0)


def without_tied(layers: Sequence[LayerSync], tied: dict[str, int]) -> tuple[LayerSync, ...]:
    """A stage's layers without the parameters the stages' tied sync sums instead (``tied``: name -> bytes)."""
    out = []
    for lv in layers:
        kept = tuple(p for p in lv.params if p not in tied)
        if kept:
            out.append(replace(lv, params=kept, bytes=lv.bytes - sum(tied[p] for p in lv.params if p in tied)))
    return tuple(out)
