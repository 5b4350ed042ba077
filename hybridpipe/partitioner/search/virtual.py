"""Plans with virtual stages (``partition --schedule interleaved-1f1b|zbv --virtual-stages V``).

A baseline strategy's stage groups and replicas are kept; for ``optimal`` the groups are searched
with the chunks (``group_candidates``): the 1F1B search's groups, and every split of the workers
into contiguous groups (up to ``ENUMERATED_WORKERS`` workers; beyond, the equal splits),
each priced by simulation, the fastest kept. On each, this module cuts the model into p*V
contiguous chunks laid out on the groups as the schedule says (``schedule_registry.Layout``):

* boundaries: ``balance.balanced_sizes``, an exact linear-partition DP minimising the largest
  chunk's forward + backward time over its group's replicas (a group of r replicas does 1/r of
  every chunk's micro-batches), cutting only where a value may cross (``cuts.py``);
* memory per worker: its chunks' weights, gradients and optimizer state, plus the most activation
  bytes its chunks hold at one time, counted by the Schedule object on its own op order
  (``Schedule.held_peak``; the chunks' own peaks, ``chunk_inflight``, come at different times, so
  their sum over-counts: 19% on a zbv GPT-2 worker), plus one chunk's rerun when recomputing,
  plus the largest transient of its chunks (one node runs at a time: ``stagememory.transient_bytes``);
  ``--recompute all`` recomputes every chunk, ``auto`` the chunks of workers that would not fit
  otherwise;
* shard levels (``--shard``, ``sharding.py``): a chunk on a group of r > 1 replicas holds its weights,
  gradients and optimizer state as its level says (``stagememory.memory_bytes``); a worker's chunks
  share its memory, so its levels are chosen together, and the simulator times each chunk's
  reduce-scatters and all-gathers on its group's lane as for a one-chunk stage. A level that holds no
  fewer bytes and is charged no less by the simulator than another is dropped (``undominated``: exact, the
  simulator's durations only push events later); of the combinations that fit (``worker_choices``), up to
  ``EXACT_COMBOS`` over all workers are each simulated and the fastest kept; beyond, each worker takes its
  least added optimizer step, collectives and reruns (``added_ms``, a proxy: on 4 layers, zbv on 1 + 2
  replicas, it chose a plan simulated 6.6% slower than the fastest);
* per-chunk figures (forward, backward, transfers, per-layer all-reduce choice, overhead) come
  from ``objective.evaluate`` as for any stage; the predicted step is the schedule's simulation
  (``simulate``, given by the caller: the simulator lives in ``hybridpipe.pipeline``), plus the
  tied weights' sums and the per-step overhead, as ``planner.build_plan`` adds them.

Every decision is recorded in the plan: ``virtual_stages``, and per chunk its node range and ranks.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from hybridpipe.errors import UserError
from hybridpipe.partitioner.chunk_orders import Place
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.plan import Plan
from hybridpipe.partitioner.schedule_registry import REGISTRY, Schedule
from hybridpipe.partitioner.search.balance import balanced_sizes
from hybridpipe.partitioner.search.modelcosts import ModelCosts
from hybridpipe.partitioner.search.objective import Evaluation, StageEval, StageSpec, evaluate
from hybridpipe.partitioner.search.options import OPTIMIZER_STATES, Options
from hybridpipe.partitioner.search.sharding import NONE, Variant
from hybridpipe.partitioner.search.simcosts import StageCosts, one_stage_costs
from hybridpipe.partitioner.search.stagememory import memory_bytes, transient_bytes

Simulate = Callable[[Plan], float]      # a plan -> its simulated step in ms

BASE_SCHEDULE = "1f1b"     # the one-chunk schedule whose plan gives a virtual plan its groups and replicas
ENUMERATED_WORKERS = 8     # up to this many workers, every split into contiguous groups is tried (2^(W-1))
EXACT_COMBOS = 256         # up to this many combinations of the workers' shard levels, each one is simulated


def group_candidates(base: Sequence[tuple[int, ...]], workers: int) -> list[tuple[tuple[int, ...], ...]]:
    """Rank groups a virtual plan may use: ``base`` first (the 1F1B search's), then every split of ranks
    0..W-1 into contiguous groups (W <= ``ENUMERATED_WORKERS``), else the splits into equal groups."""
    out = [tuple(tuple(g) for g in base)]
    if workers <= ENUMERATED_WORKERS:
        sizes_list = _compositions(workers)
    else:
        sizes_list = [[workers // p] * p for p in range(1, workers + 1) if workers % p == 0]
    for sizes in sizes_list:
        groups, start = [], 0
        for r in sizes:
            groups.append(tuple(range(start, start + r)))
            start += r
        if tuple(groups) not in out:
            out.append(tuple(groups))
    return out


def _compositions(total: int) -> list[list[int]]:
    """Every ordered list of positive ints summing to ``total``."""
    if total == 0:
        return [[]]
    return [[first, *rest] for first in range(1, total + 1) for rest in _compositions(total - first)]


def check_virtual(kind: Schedule, virtual: int) -> None:
    """A one-line UserError for a schedule and a chunk count that do not go together."""
    if not kind.chunked and virtual > 1:
        raise UserError(f"--virtual-stages {virtual} needs a schedule with several model chunks per rank: "
                        "--schedule interleaved-1f1b, zbv (--virtual-stages 2) or auto")
    if kind.chunked and virtual == 1:
        raise UserError(f"--schedule {kind.name} runs several model chunks per rank; give --virtual-stages V "
                        f"({kind.virtual_need()}), or use --schedule 1f1b for one")
    if not kind.virtual_ok(virtual):
        raise UserError(f"--schedule {kind.name} runs {kind.virtual_need()} model chunks per rank, not "
                        f"--virtual-stages {virtual}")


def chunk_specs(costs: ModelCosts, groups: Sequence[tuple[int, ...]], kind: Schedule, virtual: int
                ) -> tuple[StageSpec, ...]:
    """The p*V chunks (model order) on the groups as ``kind`` lays them out, balanced by ``balance.balanced_sizes``."""
    p = len(groups)
    ranks = [groups[kind.group_of(c, p)] for c in range(p * virtual)]
    if costs.n < len(ranks):
        raise UserError(f"the model has {costs.n} nodes, too few for {p} stages x {virtual} virtual stages; lower "
                        "--virtual-stages or profile at a finer --granularity")
    ends_ok = np.concatenate([[True], costs.cut_ok])            # ends_ok[q]: a chunk may end after q nodes
    sizes = balanced_sizes(costs.forward_ms + costs.backward_ms, [len(r) for r in ranks], ends_ok)
    if sizes is None:
        raise UserError(f"the model cannot be cut into {len(ranks)} chunks where values may cross stage boundaries "
                        "(see `hybridpipe profile` cut notes); lower --virtual-stages")
    out, first = [], 0
    for size, r in zip(sizes, ranks, strict=True):
        out.append(StageSpec(first, first + size - 1, r))
        first += size
    return tuple(out)


def worker_places(specs: Sequence[StageSpec], opts: Options) -> list[tuple[tuple[int, ...], Place]]:
    """Each rank group of the chunks (pipeline order) and its place in the schedule."""
    groups = list(dict.fromkeys(s.ranks for s in specs))
    return [(g, Place(i, tuple(len(x) for x in groups), opts.micro_batches)) for i, g in enumerate(groups)]


def worker_bytes(costs: ModelCosts, specs: Sequence[StageSpec], mine: Sequence[int], variants: Sequence[Variant],
                 kind: Schedule, place: Place, opts: Options, virtual: int) -> tuple[float, bool]:
    """(peak bytes, recomputes) of the worker holding chunks ``mine`` sharded as ``variants``: every chunk's
    weights, gradients and optimizer state (``stagememory.memory_bytes`` at its level), the activations at
    the worker's peak over its chunks together, (recomputing) the largest one rerun: one backward at a
    time, and the largest transient. ``--recompute auto`` recomputes only a worker that does not fit otherwise."""
    ranges = [(specs[c].first, specs[c].last) for c in mine]
    transient = [transient_bytes(costs, i, j) for i, j in ranges]      # one chunk's node at a time
    static = sum(memory_bytes(costs, i, j, 0, opts, variant=v, replicas=len(specs[c].ranks)) - t
                 for (i, j), t, v, c in zip(ranges, transient, variants, mine, strict=True))
    if all(v.level == "none" for v in variants):
        static -= shared_tied_bytes(costs, ranges) * (2 + OPTIMIZER_STATES[opts.optimizer]
                                                      + kind.weight_versions(0))

    def total(rc: bool) -> float:
        per_mb = [costs.kept_bytes(i, j) if rc else costs.stash_bytes(i, j) for i, j in ranges]
        per_half = ([k + costs.recorded_bytes(i, j) for k, (i, j) in zip(per_mb, ranges, strict=True)] if rc
                    else [costs.half_bytes(i, j) for i, j in ranges])     # between B and W
        rerun = max(costs.rerun_bytes(i, j) for i, j in ranges) if rc else 0.0
        return static + kind.held_peak(place, virtual, per_mb, per_half) + rerun + max(transient)
    rc = opts.recompute == "all" or (opts.recompute == "auto" and total(False) > opts.memory_bytes)
    return total(rc), rc


def shared_tied_bytes(costs: ModelCosts, ranges: Sequence[tuple[int, int]]) -> float:
    """Bytes of tied weights the chunks ``ranges`` of one rank each count (``ModelCosts.weight_bytes``:
    the owner its own, every later reader a copy) beyond the one copy the rank holds
    (``pipeline/tied.py``: a rank's chunks share one)."""
    extra = 0.0
    for size, owner, readers in costs.tied:
        copies = sum(owner < i and any(i <= r <= j for r in readers) for i, j in ranges)
        owns = any(i <= owner <= j for i, j in ranges)
        extra += size * max(copies - (0 if owns else 1), 0)
    return extra


def added_ms(e: StageEval, recompute: bool) -> float:
    """What a chunk's shard level changes in its worker's step: its optimizer step and lost compute
    (``overhead_ms``, of the compute lost beside its replicas' collectives only the part lost while compute
    ran, as the simulator counts it), its collectives inside the step (``midstep_ms``), the time its layers'
    syncs occupy the group's lane (``sync.busy_ms``: what the simulator queues), and the forward rerun when
    recomputing."""
    lost = e.overhead_ms - e.ring_ms + e.overlapped_ring_ms
    return lost + e.midstep_ms + e.sync.busy_ms + (e.micro_batches * e.forward_ms if recompute else 0.0)


@dataclass(frozen=True)
class WorkerChoice:
    """One combination of levels for a worker's chunks: its peak bytes, whether it recomputes, whether that
    fits and its summed ``added_ms`` (the proxy)."""

    levels: tuple[Variant, ...]
    bytes: float
    recompute: bool
    fits: bool
    added_ms: float


def worker_choices(costs: ModelCosts, specs: Sequence[StageSpec], kind: Schedule, opts: Options, virtual: int,
                   evals: dict[Variant, Evaluation], allowed: Sequence[Sequence[Variant]]
                   ) -> list[tuple[list[int], list[WorkerChoice]]]:
    """Per worker (pipeline order) its chunks and the combinations of their levels (chunk c among
    ``allowed[c]``) that fit, least summed ``added_ms`` first (ties: the earlier, less sharding); none
    fitting, the one needing the least memory alone (for the refusal). ``evals[v]``: every chunk evaluated
    at level ``v`` (``NONE`` where its group cannot shard)."""
    out = []
    for g, place in worker_places(specs, opts):
        mine = [c for c, s in enumerate(specs) if s.ranks == g]
        tried = []
        for combo in itertools.product(*(allowed[c] for c in mine)):
            w, rc = worker_bytes(costs, specs, mine, combo, kind, place, opts, virtual)
            added = sum(added_ms(evals[v].stages[c], rc) for v, c in zip(combo, mine, strict=True))
            tried.append(WorkerChoice(combo, w, rc, w <= opts.memory_bytes, added))
        fitting = sorted((t for t in tried if t.fits), key=lambda t: t.added_ms)
        out.append((mine, fitting or [min(tried, key=lambda t: t.bytes)]))
    return out


def undominated(specs: Sequence[StageSpec], opts: Options, static: dict[tuple[int, Variant], float],
                charged: Callable[[int, Variant, bool], StageCosts]) -> list[Sequence[Variant]]:
    """Per chunk, the levels its group allows that no other allowed level dominates (the earlier of equals).

    Level v dominates u on chunk c when it holds no more static bytes (``static[c, v]``: weights, gradients,
    optimizer state; a worker's activations do not depend on its levels) and the simulator charges the chunk
    no more (``charged(c, level, recompute)``: every duration of ``simcosts.StageCosts``, layer by layer) at
    every pair of recompute flags v's worker may then take (no more memory: it recomputes only if u's did).
    The simulator is a max-plus system whose event order is fixed by the schedule, not by durations (a
    rank's instructions in order, links and a group's syncs first come first served in program order), so
    no duration's growth makes any event earlier: swapping u for v in any combination that fits gives one
    that fits and is simulated no slower (the worker's other chunks too: dropping a rerun shortens them)."""
    flags = {"none": ((False, False),), "all": ((True, True),)}.get(opts.recompute,
                                                                    ((False, False), (False, True), (True, True)))

    def dominates(c: int, v: Variant, u: Variant) -> bool:
        return static[c, v] <= static[c, u] and all(at_most(charged(c, v, a), charged(c, u, b)) for a, b in flags)
    out: list[Sequence[Variant]] = []
    for c, spec in enumerate(specs):
        levels = opts.variants(len(spec.ranks))
        out.append([u for x, u in enumerate(levels)
                    if not any(dominates(c, v, u) and (y < x or not dominates(c, u, v))
                               for y, v in enumerate(levels) if y != x)])
    return out


def at_most(a: StageCosts, b: StageCosts) -> bool:
    """Every duration the simulator charges ``a`` is at most ``b``'s (the same layers, the same split backward)."""
    return (a.forward_ms <= b.forward_ms and a.backward_ms <= b.backward_ms and a.send_ms <= b.send_ms
            and a.send_bytes <= b.send_bytes and a.lost_ms <= b.lost_ms and a.input_share == b.input_share
            and len(a.allreduce_ms) == len(b.allreduce_ms)
            and all(x <= y for x, y in zip(a.allreduce_ms, b.allreduce_ms, strict=True)))


def virtual_plan(groups: Sequence[tuple[int, ...]], costs: ModelCosts, model: CostModel, opts: Options, virtual: int,
                 build: Callable[[Sequence[StageSpec], Evaluation, Options], Plan],
                 simulate: Simulate, shards: Sequence[Variant] | None = None,
                 exact_combos: int = EXACT_COMBOS) -> tuple[Plan, Evaluation]:
    """The plan of ``opts.schedule`` with ``virtual`` chunks per rank on these rank groups (their replicas).

    ``build(specs, evaluation, options)`` makes a Plan as ``planner.build_plan`` does (tied
    weights priced, per-step overhead added); ``simulate`` predicts its step. Each chunk shards as ``shards``
    (one per chunk) when given, else as chosen under ``opts.shard``: a worker's chunks share its memory, so
    its levels are chosen together among the combinations that fit (``worker_choices``) of the levels no
    other dominates (``undominated``); up to ``exact_combos`` combinations over all workers, each is simulated
    and the fastest kept (ties: the least added time); beyond, each worker takes its least summed
    ``added_ms`` (a proxy: the simulator may hide some of it in the schedule's bubbles)."""
    kind = opts.schedule
    check_virtual(kind, virtual)
    if any(not opts.replicas_ok(len(g)) for g in groups):
        raise UserError(f"a group of {max(len(g) for g in groups)} replicas needs more than {opts.micro_batches} "
                        "micro-batches per step")
    specs = chunk_specs(costs, groups, kind, virtual)
    plain = replace(opts, schedule=REGISTRY[BASE_SCHEDULE], memory_bytes=math.inf, recompute="none")
    if shards is not None and any(v not in opts.variants(len(s.ranks)) for v, s in zip(shards, specs, strict=True)):
        raise UserError("a chunk is given a shard level its group cannot take (one replica, or not under --shard)")
    levels = set(shards) if shards is not None else {v for s in specs for v in opts.variants(len(s.ranks))}
    evals = {v: evaluate(costs, model, specs, plain, [v if v in opts.variants(len(s.ranks)) else NONE for s in specs])
             for v in levels}     # every chunk at each level (NONE where its group cannot shard)

    def assembled(chosen: Sequence[Variant], worker: Sequence[float], recompute: Sequence[bool]) -> Evaluation:
        stages = []
        for c, spec in enumerate(specs):
            e = evals[chosen[c]].stages[c]
            b = e.backward_ms + (e.forward_ms if recompute[c] else 0.0)
            e = replace(e, memory_bytes=worker[c], recompute=recompute[c], backward_ms=b,
                        term_ms=e.micro_batches * (e.forward_ms + b))       # the chunk's own compute per step
            if c + 1 < len(specs) and specs[c + 1].ranks == spec.ranks:      # zbv's middle: handed over in the rank
                e = replace(e, send_ms=0.0, send_grad_ms=0.0, send_bytes=0.0)
            stages.append(e)
        return Evaluation(tuple(stages), math.inf, all(w <= opts.memory_bytes for w in worker))

    def priced(choices: Sequence[tuple[list[int], WorkerChoice]]) -> tuple[Plan, Evaluation]:
        chosen, worker, recompute = [NONE] * len(specs), [0.0] * len(specs), [False] * len(specs)
        for mine, ch in choices:
            for v, c in zip(ch.levels, mine, strict=True):
                chosen[c], worker[c], recompute[c] = v, ch.bytes, ch.recompute
        ev = assembled(chosen, worker, recompute)
        if not ev.fits:
            c = max(range(len(specs)), key=worker.__getitem__)
            raise UserError(f"{kind.name} with {virtual} virtual stages does not fit: the workers of stage {c} "
                            f"(ranks {list(specs[c].ranks)}) need {worker[c] / 1e9:.2f} GB for their {virtual} "
                            f"chunks, more than {opts.memory_bytes / 1e9:g} GB; raise --memory-gb, use --recompute "
                            f"auto{'' if opts.shard != 'none' else ', --shard auto'}, fewer --virtual-stages or more "
                            "workers")
        plan = replace(build(specs, ev, plain), schedule=kind.name, virtual_stages=virtual)
        step = simulate(plan) + sum(t.predicted_ms for t in plan.tied) + model.step_overhead_ms
        samples = opts.micro_batches * plan.batch_size / (step / 1e3) if step > 0 else 0.0
        return replace(plan, predicted_step_ms=step, predicted_samples_per_s=samples), replace(ev, objective_ms=step)

    if shards is not None:
        allowed: list[Sequence[Variant]] = [(v,) for v in shards]
    elif levels != {NONE} and exact_combos > 1:
        allowed = undominated(specs, opts, *_charges(costs, specs, opts, evals, assembled, build, plain))
    else:
        allowed = [opts.variants(len(s.ranks)) for s in specs]
    workers = worker_choices(costs, specs, kind, opts, virtual, evals, allowed)
    fits = all(w[0].fits for _, w in workers)
    if not fits or not 1 < math.prod(len(w) for _, w in workers) <= exact_combos:
        return priced([(mine, w[0]) for mine, w in workers])
    every = [(priced(list(zip((m for m, _ in workers), combo, strict=True))), sum(ch.added_ms for ch in combo))
             for combo in itertools.product(*(w for _, w in workers))]
    return min(every, key=lambda pa: (pa[0][1].objective_ms, pa[1]))[0]


def _charges(costs: ModelCosts, specs: Sequence[StageSpec], opts: Options,
             evals: dict[Variant, Evaluation], assembled: Callable[..., Evaluation],
             build: Callable[[Sequence[StageSpec], Evaluation, Options], Plan], plain: Options
             ) -> tuple[dict[tuple[int, Variant], float], Callable[[int, Variant, bool], StageCosts]]:
    """For ``undominated``: each chunk's static bytes at each level its group allows, and what the simulator
    charges it at a level with or without recomputing (from the plan's stage, as the simulator reads it)."""
    static = {(c, v): memory_bytes(costs, s.first, s.last, 0, opts, variant=v, replicas=len(s.ranks))
              for c, s in enumerate(specs) for v in opts.variants(len(s.ranks))}
    n = len(specs)
    table: dict[tuple[int, Variant, bool], StageCosts] = {}

    def charged(c: int, v: Variant, rc: bool) -> StageCosts:
        if (c, v, rc) not in table:
            chosen = [v if v in opts.variants(len(s.ranks)) else NONE for s in specs]
            plan = build(specs, assembled(chosen, [0.0] * n, [rc] * n), plain)
            for k, st in enumerate(plan.stages):
                table[k, chosen[k], rc] = one_stage_costs(st, opts.micro_batches, opts.schedule)
        return table[c, v, rc]
    return static, charged


def fastest_virtual_plan(options: Sequence[Sequence[tuple[int, ...]]], costs: ModelCosts, model: CostModel,
                         opts: Options, virtual: int, build: Callable[[Sequence[StageSpec], Evaluation, Options], Plan],
                         simulate: Simulate) -> tuple[Plan, Evaluation]:
    """The fastest simulated :func:`virtual_plan` over these rank groupings (ties: the earlier); the first
    grouping's UserError when none can run. With shard levels to choose and several groupings, each grouping
    is priced with its workers' levels from the proxy alone (one simulation each, ``exact_combos=0``) and the
    fastest one's levels are then chosen by simulation (kept if faster): the exact search on every grouping
    would simulate thousands of combinations on 8 workers."""
    several = len(options) > 1 and opts.shard != "none"
    built, refused = [], []
    for groups in options:
        try:
            built.append((virtual_plan(groups, costs, model, opts, virtual, build, simulate,
                                       exact_combos=0 if several else EXACT_COMBOS), groups))
        except UserError as e:
            refused.append(e)
    if not built:
        raise refused[0]
    best, groups = min(built, key=lambda b: b[0][1].objective_ms)
    if several:
        exact = virtual_plan(groups, costs, model, opts, virtual, build, simulate)
        best = min((best, exact), key=lambda pe: pe[1].objective_ms)
    return best
