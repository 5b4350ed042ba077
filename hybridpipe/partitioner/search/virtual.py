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
  plus the largest transient of its chunks (one node runs at a time: ``objective.transient_bytes``);
  ``--recompute all`` recomputes every chunk, ``auto`` the chunks of workers that would not fit
  otherwise;
* shard levels (``--shard``, ``sharding.py``): a chunk on a group of r > 1 replicas holds its weights,
  gradients and optimizer state as its level says (``objective.memory_bytes``); a worker's chunks
  share its memory, so its levels are chosen together (``chunk_shards``: every combination, the least
  added optimizer step, collectives and reruns among those that fit), and the simulator times each
  chunk's reduce-scatters and all-gathers on its group's lane as for a one-chunk stage;
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
from dataclasses import replace

import numpy as np

from hybridpipe.errors import UserError
from hybridpipe.partitioner.chunk_orders import Place
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.plan import Plan
from hybridpipe.partitioner.schedule_registry import REGISTRY, Schedule
from hybridpipe.partitioner.search.balance import balanced_sizes
from hybridpipe.partitioner.search.modelcosts import ModelCosts
from hybridpipe.partitioner.search.objective import (
    Evaluation,
    Options,
    StageEval,
    StageSpec,
    evaluate,
    memory_bytes,
    transient_bytes,
)
from hybridpipe.partitioner.search.sharding import NONE, Variant

Simulate = Callable[[Plan], float]      # a plan -> its simulated step in ms

BASE_SCHEDULE = "1f1b"     # the one-chunk schedule whose plan gives a virtual plan its groups and replicas
ENUMERATED_WORKERS = 8     # up to this many workers, every split into contiguous groups is tried (2^(W-1))


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
    weights, gradients and optimizer state (``objective.memory_bytes`` at its level), the activations at
    the worker's peak over its chunks together, (recomputing) the largest one rerun: one backward at a
    time, and the largest transient. ``--recompute auto`` recomputes only a worker that does not fit otherwise."""
    ranges = [(specs[c].first, specs[c].last) for c in mine]
    transient = [transient_bytes(costs, i, j) for i, j in ranges]      # one chunk's node at a time
    static = sum(memory_bytes(costs, i, j, 0, opts, variant=v, replicas=len(specs[c].ranks)) - t
                 for (i, j), t, v, c in zip(ranges, transient, variants, mine, strict=True))

    def total(rc: bool) -> float:
        per_mb = [costs.kept_bytes(i, j) if rc else costs.stash_bytes(i, j) for i, j in ranges]
        rerun = max(costs.rerun_bytes(i, j) for i, j in ranges) if rc else 0.0
        return static + kind.held_peak(place, virtual, per_mb) + rerun + max(transient)
    rc = opts.recompute == "all" or (opts.recompute == "auto" and total(False) > opts.memory_bytes)
    return total(rc), rc


def added_ms(e: StageEval, recompute: bool) -> float:
    """What a chunk's shard level changes in its worker's step: its optimizer step and lost compute
    (``overhead_ms``, of the compute lost beside its replicas' collectives only the part lost while compute
    ran, as the simulator counts it), its collectives inside the step (``midstep_ms``), the time its layers'
    syncs occupy the group's lane (``sync.busy_ms``: what the simulator queues), and the forward rerun when
    recomputing."""
    lost = e.overhead_ms - e.ring_ms + e.overlapped_ring_ms
    return lost + e.midstep_ms + e.sync.busy_ms + (e.micro_batches * e.forward_ms if recompute else 0.0)


def chunk_shards(costs: ModelCosts, specs: Sequence[StageSpec], kind: Schedule, opts: Options, virtual: int,
                 evals: dict[Variant, Evaluation], forced: Sequence[Variant] | None = None
                 ) -> tuple[list[Variant], list[float], list[bool]]:
    """Each chunk's shard level, its worker's peak bytes and whether it recomputes.

    A worker's chunks share its memory, so its levels are chosen together: every combination of
    the levels ``opts.variants`` allows its group (at most 3^V under ``auto``), the one with the
    least ``added_ms`` summed over its chunks among those that fit (ties: the earlier, less
    sharding); none fitting, the one needing the least memory (for the refusal). ``evals[v]``: every
    chunk evaluated at level ``v`` (``NONE`` where its group cannot shard); ``forced``: the levels
    given (brute force)."""
    variants = list(forced) if forced is not None else [NONE] * len(specs)
    worker = [0.0] * len(specs)
    recompute = [opts.recompute == "all"] * len(specs)
    for g, place in worker_places(specs, opts):
        mine = [c for c, s in enumerate(specs) if s.ranks == g]
        allowed = opts.variants(len(g))
        combos = [tuple(variants[c] for c in mine)] if forced is not None else itertools.product(allowed,
                                                                                              repeat=len(mine))
        best: tuple[bool, float, tuple[Variant, ...], float, bool] | None = None
        for combo in combos:
            w, rc = worker_bytes(costs, specs, mine, combo, kind, place, opts, virtual)
            fits = w <= opts.memory_bytes
            key = sum(added_ms(evals[v].stages[c], rc) for v, c in zip(combo, mine, strict=True)) if fits else w
            if best is None or (fits, -key) > (best[0], -best[1]):
                best = (fits, key, combo, w, rc)
        assert best is not None
        for v, c in zip(best[2], mine, strict=True):
            variants[c], worker[c], recompute[c] = v, best[3], best[4]
    return variants, worker, recompute


def virtual_plan(groups: Sequence[tuple[int, ...]], costs: ModelCosts, model: CostModel, opts: Options, virtual: int,
                 build: Callable[[Sequence[StageSpec], Evaluation, Options], Plan],
                 simulate: Simulate, shards: Sequence[Variant] | None = None) -> tuple[Plan, Evaluation]:
    """The plan of ``opts.schedule`` with ``virtual`` chunks per rank on these rank groups (their replicas).

    ``build(specs, evaluation, options)`` makes a Plan as ``planner.build_plan`` does (tied
    weights priced, per-step overhead added); ``simulate`` predicts its step. Each chunk shards as
    :func:`chunk_shards` chooses under ``opts.shard``, or as ``shards`` (one per chunk) when given."""
    kind = opts.schedule
    check_virtual(kind, virtual)
    if any(not opts.replicas_ok(len(g)) for g in groups):
        raise UserError(f"a group of {max(len(g) for g in groups)} replicas needs more than {opts.micro_batches} "
                        "micro-batches per step")
    specs = chunk_specs(costs, groups, kind, virtual)
    plain = replace(opts, schedule=REGISTRY[BASE_SCHEDULE], memory_bytes=math.inf, recompute="none")
    if shards is not None and any(v not in opts.variants(len(s.ranks)) for v, s in zip(shards, specs, strict=True)):
        raise UserError("a chunk is given a shard level its group cannot take (one replica, or not under --shard)")
    levels = {v for s in specs for v in opts.variants(len(s.ranks))} | set(shards or ())
    if levels == {NONE}:
        evals = {NONE: evaluate(costs, model, specs, plain)}
    else:       # every chunk at every level its group allows (NONE where it cannot shard)
        evals = {v: evaluate(costs, model, specs, plain,
                             [v if v in opts.variants(len(s.ranks)) else NONE for s in specs]) for v in levels}
    chosen, worker, recompute = chunk_shards(costs, specs, kind, opts, virtual, evals, shards)
    ev = evaluate(costs, model, specs, plain, chosen) if levels != {NONE} else evals[NONE]
    stages = []
    for c, (e, spec) in enumerate(zip(ev.stages, specs, strict=True)):
        b = e.backward_ms + (e.forward_ms if recompute[c] else 0.0)
        e = replace(e, memory_bytes=worker[c], recompute=recompute[c], backward_ms=b,
                    term_ms=e.micro_batches * (e.forward_ms + b))       # the chunk's own compute per step
        if c + 1 < len(specs) and specs[c + 1].ranks == spec.ranks:      # zbv's middle: handed over in the rank
            e = replace(e, send_ms=0.0, send_grad_ms=0.0, send_bytes=0.0)
        stages.append(e)
    ev = Evaluation(tuple(stages), ev.objective_ms, all(w <= opts.memory_bytes for w in worker))
    if not ev.fits:
        c = max(range(len(specs)), key=worker.__getitem__)
        raise UserError(f"{kind.name} with {virtual} virtual stages does not fit: the workers of stage {c} "
                        f"(ranks {list(specs[c].ranks)}) need {worker[c] / 1e9:.2f} GB for their {virtual} chunks, "
                        f"more than {opts.memory_bytes / 1e9:g} GB; raise --memory-gb, use --recompute auto"
                        f"{'' if opts.shard != 'none' else ', --shard auto'}, fewer --virtual-stages or more workers")
    plan = replace(build(specs, ev, plain), schedule=kind.name, virtual_stages=virtual)
    step = simulate(plan) + sum(t.predicted_ms for t in plan.tied) + model.step_overhead_ms
    samples = opts.micro_batches * plan.batch_size / (step / 1e3) if step > 0 else 0.0
    return replace(plan, predicted_step_ms=step, predicted_samples_per_s=samples), replace(ev, objective_ms=step)


def fastest_virtual_plan(options: Sequence[Sequence[tuple[int, ...]]], costs: ModelCosts, model: CostModel,
                         opts: Options, virtual: int, build: Callable[[Sequence[StageSpec], Evaluation, Options], Plan],
                         simulate: Simulate) -> tuple[Plan, Evaluation]:
    """The fastest simulated :func:`virtual_plan` over these rank groupings (ties: the earlier); the first
    grouping's UserError when none can run."""
    built, refused = [], []
    for groups in options:
        try:
            built.append(virtual_plan(groups, costs, model, opts, virtual, build, simulate))
        except UserError as e:
            refused.append(e)
    if not built:
        raise refused[0]
    return min(built, key=lambda pe: pe[1].objective_ms)
