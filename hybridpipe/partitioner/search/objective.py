"""The partitioner's objective: what one stage list (node ranges x rank sets) costs per step.

A step is ``M`` micro-batches; a stage with r replicas gives each replica ``k = ceil(M / r)`` of
them; ``F``, ``B`` are a stage's forward and backward time for one micro-batch. Per stage, in
ms per step, the larger of:

* compute and sync. gpipe / 1f1b (a flush ends every step): one micro-batch's trip through all
  nodes (``F + B`` summed over the whole model, the fill and drain every stage waits through),
  plus the stage's other ``k - 1`` micro-batches, plus its gradient sync where it outlasts the
  gap it has to hide in: the rest of its own backward and next forward (the per-layer lane of
  ``layersync.py``) and the drain and fill of the stages before it (``F + B`` of all earlier
  nodes). zb-h1 (backward split into input and weight gradients, the weight part filling the
  drain): the trip counts only the other stages' forwards (the paper's (p - 1)(F + B - W)
  bubble with B = W), plus the stage's own backward. pipedream (no flush, a sync after every
  minibatch): ``k * (F + B + E)``, ``E`` the exposed sync with no extra gap. What tells the
  schedules apart is read from their ``schedule_registry.Schedule`` objects, never their names.
* transfers: ``M * X`` where ``X`` is the stage's share of its activation traffic per
  micro-batch through its links (``transfers.py``).

Both schedules add the stage's overhead per step (``overhead_ms``): its optimizer steps (one per
sync) and the compute it loses to its own communication, ``interference_s_per_byte`` (measured
by ``bench-allreduce``; 0 without a calibration) times the bytes its link carries: a ring's
``2 (r - 1) / r`` of the stage's weights per sync and, per micro-batch, the mean of the bytes it
sends and receives; and, where a refined calibration measured it, the gradient accumulation of its
``k - syncs`` later backwards (``cost/computeterms.py``). Where a refined calibration gives the replicas'
compute stretch ``rho(r)``, a stage's ``F`` and ``B`` are its nodes' times ``rho(r)``, and its own nodes'
part of the trip grows alike (``(rho - 1)`` times their unscaled trip share, added to the trip; the other stages'
stretch in the trip is left to ``predict_step_ms``, which sums the stages' own ``F`` and ``B``).

The objective is the largest stage term; a stage that does not fit in a worker's memory, that ends
where a value that cannot cross a stage boundary would have to (``cuts.py``), or has more replicas
than micro-batches (or, for pipedream, a replica count that does not divide
them: its replicas synchronise in rounds), makes the plan infeasible (infinite). Memory per
worker: ``stagememory.py``. What a plan is for: ``Options`` (``options.py``).

Sharded replicas (``--shard``, ``sharding.py``): a stage of r > 1 replicas may shard its optimizer
state, gradients or weights; its memory, its per-step reduce-scatters and all-gathers (in the
sync lane in place of the all-reduces), the collectives inside the step (``midstep_ms``) and its
optimizer step on 1/r of the weights are charged there. Each stage takes the variant ``--shard``
allows with the smallest term among those that fit (``none``: today's stage, bit for bit).

Every term depends only on the stage's node range and ranks (and the neighbours' ranks for the
transfer level), which is what lets ``dp.py`` compute them exactly in vectorised form; the
brute-force tests compare the two. ``predict_step_ms`` is the same formula with the transfer
latencies added to the trip and to the gaps: the Plan's prediction.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from hybridpipe.partitioner.cost.computeterms import accumulation_ms, replica_factor
from hybridpipe.partitioner.cost.costmodel import CostModel
from hybridpipe.partitioner.cost.layersync import StageSync, choose_layer_algorithms
from hybridpipe.partitioner.cost.sharded import fastest_pair
from hybridpipe.partitioner.search.modelcosts import ModelCosts
from hybridpipe.partitioner.search.options import Options
from hybridpipe.partitioner.search.sharding import NONE, Num, Variant, halves, midstep_ms, runs_with
from hybridpipe.partitioner.search.stagememory import inflight_micro_batches, memory_bytes, split_micro_batches
from hybridpipe.partitioner.search.transfers import transfer_level, transfer_ms


@dataclass(frozen=True)
class StageSpec:
    """Nodes ``first..last`` (inclusive) on ``ranks`` (one per replica)."""

    first: int
    last: int
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class StageEval:
    """One stage's figures under the objective (module docstring), in ms unless named otherwise."""

    forward_ms: float            # one micro-batch, one replica
    backward_ms: float
    micro_batches: int           # k: micro-batches per replica per step
    sync: StageSync              # per-layer algorithms; exposed_ms per sync
    syncs_per_step: int          # 1 (gpipe, 1f1b) or k (pipedream: one per minibatch)
    transfer_ms: float           # X: this stage's share of activation traffic per micro-batch
    send_ms: float               # one micro-batch's activations to the next stage (latency)
    send_grad_ms: float          # its gradients back
    send_bytes: float
    memory_bytes: float
    overhead_ms: float           # optimizer steps + compute lost to communication, per step
    busy_ms: float               # compute and sync per step (see the module docstring)
    term_ms: float               # max(busy, M * X) per step
    recompute: bool = False      # the stage reruns its forward in backward (backward_ms includes it)
    shard: str = "none"          # what its replicas shard (sharding.py)
    reshard_after_forward: bool = True
    midstep_ms: float = 0.0      # a sharded stage's collectives exposed inside the step (sharding.midstep_ms)
    ring_ms: float = 0.0         # of overhead_ms: the compute lost beside the replicas' own collectives

    @property
    def overlapped_ring_ms(self) -> float:
        """The part of ``ring_ms`` lost while compute ran: the lane's hidden share of its busy time (an
        all-reduce running after the backward, exposed, takes no compute from it; predict_step_ms)."""
        busy = self.sync.busy_ms
        return self.ring_ms * max(0.0, busy - self.sync.exposed_ms) / busy if busy > 0 else 0.0

    @property
    def sync_ms_per_step(self) -> float:
        """The exposed sync per step (``syncs_per_step`` syncs)."""
        return self.sync.exposed_ms * self.syncs_per_step


@dataclass(frozen=True)
class Evaluation:
    """A stage list's figures: every stage's and the objective (the largest term)."""

    stages: tuple[StageEval, ...]
    objective_ms: float          # max term (inf when a stage does not fit in memory)
    fits: bool                   # every stage fits in memory and gives each replica micro-batches


def overhead_ms(optimizer_ms: Num, weights: Num, p2p_bytes: Num, replicas: Num | int, k: Num | int, syncs: Num | int,
                interference: float, variant: Variant = NONE) -> Num:
    """Per step: ``syncs`` optimizer steps and the compute lost to communication (module docstring).

    ``p2p_bytes``: mean of the bytes a replica sends and receives per micro-batch. Works on
    numbers and elementwise on numpy arrays (``stageterms.py``). A sharded ``variant`` steps 1/r of the
    weights and moves ``sharding.halves`` reduce-scatters / all-gathers per step."""
    if variant.level != "none":
        optimizer_ms = optimizer_ms / replicas
        ring = halves(variant, k) * (replicas - 1) / replicas * weights
    else:
        ring = 2 * (replicas - 1) / replicas * weights          # 0 for one replica
    return syncs * (optimizer_ms + interference * 1e3 * ring) + k * interference * 1e3 * p2p_bytes


def evaluate(costs: ModelCosts, model: CostModel, stages: Sequence[StageSpec], opts: Options,
             variants: Sequence[Variant] | None = None) -> Evaluation:
    """Every stage's figures and the objective for a stage list covering all nodes.

    Each stage shards as the best variant ``opts.variants`` allows, or as ``variants[k]`` when given
    (infeasible where that stage cannot: one replica, an asynchronous schedule)."""
    evals = []
    workers_after = sum(len(s.ranks) for s in stages)
    kind = opts.schedule
    workers = workers_after
    pipedream = kind.asynchronous
    forced_ok = True
    share = kind.drain_backward_share
    trip = float(costs.forward_ms.sum() + share * costs.backward_ms.sum())     # fill + drain (flushed)
    for idx, st in enumerate(stages):
        i, j, ranks = st.first, st.last, st.ranks
        r = len(ranks)
        k = -(-opts.micro_batches // r)
        inflight = inflight_micro_batches(opts.schedule, k, workers_after, r, workers)
        split = split_micro_batches(opts.schedule, k, workers_after, r, workers)
        gap = 0.0 if pipedream else float(costs.forward_ms[:i].sum() + costs.backward_ms[:i].sum())
        cuts, send_ms, send_grad_ms, send_bytes = [], 0.0, 0.0, 0.0
        a_in, g_out = costs.input_bytes(i)
        a_out, g_in = costs.output_bytes(j) if idx < len(stages) - 1 else (0.0, 0.0)
        if idx > 0:
            cuts.append((transfer_level(model, ranks, stages[idx - 1].ranks), g_out, a_in))
        if idx < len(stages) - 1:
            level = transfer_level(model, ranks, stages[idx + 1].ranks)
            cuts.append((level, a_out, g_in))
            send_ms = model.p2p_seconds(a_out, level) * 1e3
            send_grad_ms = model.p2p_seconds(g_in, level) * 1e3
            send_bytes = a_out
        x = transfer_ms(model, ranks, cuts)

        place = _Place(i, j, tuple(ranks), k, inflight, split, gap, x, send_ms, send_grad_ms, send_bytes,
                       (a_in + g_out + a_out + g_in) / 2, trip, share)
        allowed = opts.variants(r)
        if variants is not None:
            allowed = (variants[idx],)
            forced_ok = forced_ok and (variants[idx] == NONE or (r > 1 and not pipedream))
        tried = [_stage_eval(costs, model, opts, place, v) for v in allowed]
        fitting = [e for e in tried if e.memory_bytes <= opts.memory_bytes]
        evals.append(min(fitting, key=lambda e: e.term_ms) if fitting else tried[0])
        forced_ok = forced_ok and bool(runs_with(Variant(evals[-1].shard), r, opts.micro_batches))
        workers_after -= r
    fits = forced_ok and all(e.memory_bytes <= opts.memory_bytes for e in evals) and all(
        opts.replicas_ok(len(s.ranks)) for s in stages) and all(costs.blocked_cut(s.last) is None for s in stages)
    return Evaluation(tuple(evals), max(e.term_ms for e in evals) if fits else math.inf, fits)


@dataclass(frozen=True)
class _Place:
    """What ``evaluate`` knows of a stage before choosing what its replicas shard."""

    i: int
    j: int
    ranks: tuple[int, ...]
    k: int
    inflight: int
    split: tuple[int, int]      # of inflight, whole after a forward; the most between B and W (split_micro_batches)
    gap: float
    x: float
    send_ms: float
    send_grad_ms: float
    send_bytes: float
    p2p_bytes: float
    trip: float
    share: float


def _stage_eval(costs: ModelCosts, model: CostModel, opts: Options, p: _Place, v: Variant) -> StageEval:
    """A stage's figures when its replicas shard as ``v`` (``NONE``: replicated)."""
    i, j, r, k, kind = p.i, p.j, len(p.ranks), p.k, opts.schedule
    f0 = float(costs.forward_ms[i:j + 1].sum())
    b0 = float(costs.backward_ms[i:j + 1].sum())
    rho = replica_factor(model.replica_compute, r)
    f, b = f0 * rho, b0 * rho
    stretch = (rho - 1) * (f0 + p.share * b0)       # its own nodes' part of the trip, stretched as its compute
    mem = memory_bytes(costs, i, j, p.inflight, opts, variant=v, replicas=r, split=p.split)
    rc = opts.recompute == "all" or (opts.recompute == "auto" and mem > opts.memory_bytes)
    if rc:          # charged as part of the backward: the simulator then times it there too
        mem = memory_bytes(costs, i, j, p.inflight, opts, recompute=True, variant=v, replicas=r, split=p.split)
        b += f
    paired = None if v.level == "none" else (
        lambda nbytes, group: fastest_pair(nbytes, group, model, opts.algorithms))
    sync = choose_layer_algorithms(costs.names[i:j + 1], costs.param_bytes[i:j + 1], costs.backward_ms[i:j + 1],
                                   costs.forward_ms[i:j + 1], p.ranks, model, opts.algorithms,
                                   params=costs.params[i:j + 1], gap_ms=p.gap, fastest=paired)
    extra = overhead_ms(float(costs.optimizer_ms(opts.optimizer)[i:j + 1].sum()),
                        float(costs.param_bytes[i:j + 1].sum()), p.p2p_bytes, r, k,
                        kind.syncs_per_step(k), model.interference_s_per_byte, v)
    ring = extra - overhead_ms(float(costs.optimizer_ms(opts.optimizer)[i:j + 1].sum()), 0.0, p.p2p_bytes, r, k,
                               kind.syncs_per_step(k), model.interference_s_per_byte, v)
    if model.accumulate_s_per_byte:
        extra += accumulation_ms(model.accumulate_s_per_byte, float(costs.param_bytes[i:j + 1].sum()), k,
                                 kind.syncs_per_step(k))
    mid = 0.0 if v.level == "none" else float(midstep_ms(v, k, sync.busy_ms / 2, f, b))
    busy = extra + (k * (f + b + sync.exposed_ms) if kind.asynchronous
                    else p.trip + stretch + (1 - p.share) * b + (k - 1) * (f + b) + sync.exposed_ms) + mid
    return StageEval(f, b, k, sync, kind.syncs_per_step(k), p.x, p.send_ms, p.send_grad_ms, p.send_bytes,
                     mem, extra, busy, max(busy, opts.micro_batches * p.x), rc,
                     v.level, v.reshard, mid, ring)


def predict_step_ms(ev: Evaluation, opts: Options) -> float:
    """The Plan's step time: the objective with transfer latencies in the trip and the gaps.

    gpipe/1f1b: max over stages of (trip + (k - 1) (F + B) + sync beyond the gap + overhead), where the trip
    and each stage's gap also count one micro-batch's activation and gradient transfers over
    the cuts they cross; never below a stage's transfer term. pipedream: the objective.

    Unlike the objective, the compute a stage loses beside its replicas' collectives counts only for the
    part of them that ran beside its compute (``StageEval.overlapped_ring_ms``), and it stretches the
    backward the exposed sync is measured from: the stage pays the larger of the two, not their sum.
    (The objective charges every collective byte, an upper bound the search keeps.)
    """
    if opts.schedule.asynchronous or not ev.fits:
        return ev.objective_ms
    st = ev.stages
    share = opts.schedule.drain_backward_share
    transfers = [s.send_ms + s.send_grad_ms for s in st]
    trip = sum(s.forward_ms + share * s.backward_ms for s in st) + sum(transfers)
    worst, before = 0.0, 0.0
    for s, moved in zip(st, transfers, strict=True):
        late = max(0.0, s.sync.exposed_ms - before)         # its gap grows by the transfers before it
        own = (1 - share) * s.backward_ms
        ends = max(late, s.overlapped_ring_ms) + s.overhead_ms - s.ring_ms
        worst = max(worst, trip + own + (s.micro_batches - 1) * (s.forward_ms + s.backward_ms) + ends
                    + s.midstep_ms,
                    opts.micro_batches * s.transfer_ms)
        before += moved
    return worst


# (evaluation, the model's costs, its stages, options) -> the step (ms) before tied sums and the per-step overhead
StepModel = Callable[[Evaluation, ModelCosts, Sequence[StageSpec], Options], float]


def formula_step_ms(ev: Evaluation, costs: ModelCosts, stages: Sequence[StageSpec], opts: Options) -> float:  # noqa: ARG001
    """:func:`predict_step_ms` as a ``StepModel`` (the closed form; ``pipeline.simulator.predicted_step_ms``
    is the schedule's critical path)."""
    return predict_step_ms(ev, opts)
