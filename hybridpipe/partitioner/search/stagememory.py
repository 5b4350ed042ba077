"""Peak memory per worker of a stage: what makes a stage infeasible in the objective (``objective.py``).

Weights, gradients and optimizer state (``OPTIMIZER_STATES``: sgd momentum 1 copy, adam 2), plus
the activations of the micro-batches in flight (gpipe: all k; 1f1b: min(k, ceil(W_after / r)),
W_after = workers in this and later stages; zb-h1: min(k, ceil(W / r)), W all workers (a later
stage holds back weight gradients), of them min(k, ceil(W_after / r)) whole and the rest only what
stays between their backward's input and weight halves, ``ModelCosts.half_bytes``; pipedream:
ceil(W_after / r)), plus pipedream's stashed weight versions (one per in-flight minibatch beyond
the live weights), plus the stage's transient bytes (``transient_bytes``: the most one node's
kernels allocate for a moment, at the worst moment of the step). Sharded replicas hold what
``sharding.static_bytes`` says in place of the weights' copies.
"""

from __future__ import annotations

from hybridpipe.partitioner.schedule_registry import Schedule
from hybridpipe.partitioner.search.modelcosts import ModelCosts
from hybridpipe.partitioner.search.options import OPTIMIZER_STATES, Options
from hybridpipe.partitioner.search.sharding import NONE, Variant, stage_units, static_bytes


def inflight_micro_batches(schedule: Schedule, k: int, workers_after: int, replicas: int,
                           workers: int | None = None) -> int:
    """Micro-batches whose activations a replica holds at once (``workers``: all of the pipeline's,
    default ``workers_after``)."""
    depth = -(-workers_after // replicas)
    depth_all = -(-(workers if workers is not None else workers_after) // replicas)
    return schedule.inflight(k, depth, depth_all)


def split_micro_batches(schedule: Schedule, k: int, workers_after: int, replicas: int,
                        workers: int | None = None) -> tuple[int, int]:
    """Of :func:`inflight_micro_batches`, those whose whole activations a replica holds after a
    forward (the rest between a split backward's input and weight halves: ``Schedule.whole``), and
    the most it holds between the halves at once (``Schedule.most_halves``)."""
    depth = -(-workers_after // replicas)
    depth_all = -(-(workers if workers is not None else workers_after) // replicas)
    return schedule.whole(k, depth, depth_all), schedule.most_halves(k, depth, depth_all)


def memory_bytes(costs: ModelCosts, i: int, j: int, inflight: int, opts: Options, recompute: bool = False,
                 variant: Variant = NONE, replicas: int = 1, split: tuple[int, int] | None = None) -> float:
    """Peak bytes per worker of stage i..j (see the module docstring; activations and the weights,
    tied copies included: ``modelcosts.py``).
    A recomputing stage keeps only each in-flight micro-batch's inputs and outputs (and the loss's),
    plus what one micro-batch's rerun of its forward rebuilds (``ModelCosts.rerun_bytes``).
    ``split``: of the ``inflight`` micro-batches, those holding their whole activations after a forward
    and the most between the halves at once (:func:`split_micro_batches`; None: all whole, no
    halves); the rest sit between a split backward's input and weight halves,
    holding ``ModelCosts.half_bytes`` (a recomputing stage: its kept bytes and the recorded gradients,
    ``recorded_bytes``); ``Schedule.held_bytes`` finds the peak.
    ``variant``: what its ``replicas`` shard (``sharding.static_bytes``)."""
    weights = costs.weight_bytes(i, j)        # its own parameters and its copies of tied ones
    versions = opts.schedule.weight_versions(inflight)
    stash = costs.stash_bytes(i, j)
    whole, halves = (inflight, 0) if split is None else split
    if recompute:
        kept = costs.kept_bytes(i, j)
        held = float(opts.schedule.held_bytes(inflight, whole, halves, kept, kept + costs.recorded_bytes(i, j))
                     ) + costs.rerun_bytes(i, j)
    else:
        held = float(opts.schedule.held_bytes(inflight, whole, halves, stash, costs.half_bytes(i, j)))
    transient = transient_bytes(costs, i, j)
    if variant.level != "none":
        unit1, unit2 = stage_units(costs.held[i:j + 1])
        return static_bytes(variant, weights, replicas, OPTIMIZER_STATES[opts.optimizer], unit1, unit2,
                            versions) + held + transient
    return weights * (2 + OPTIMIZER_STATES[opts.optimizer] + versions) + held + transient


def transient_bytes(costs: ModelCosts, i: int, j: int) -> float:
    """What stage i..j allocates for a moment on top of what it holds: the largest forward or backward
    transient of its nodes (their kernels' temporaries, the gradients flowing through a backward:
    ``profiles/transient.py``). Charged once, at the stage's worst moment: a node's backward (or
    forward) while every in-flight micro-batch's activations are held, the weights' gradients exist
    (from the step's first backward on) and so does the optimizer's state (from the first step on)."""
    return costs.transient_bytes(i, j)
