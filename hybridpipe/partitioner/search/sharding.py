"""Sharded replicas (ZeRO) in the objective: each stage's memory and collectives at each shard level.

A stage of r > 1 replicas with weights W (bytes, tied copies included), gradients G = W and optimizer
state O = s W (``OPTIMIZER_STATES``: sgd momentum 1, adam / adamw 2) holds per worker, besides its
activations (as for any stage):

* ``none``: W + G + O (every replica everything; today's stages).
* ``optimizer`` (ZeRO-1): W + G + O / r.
* ``gradients`` (ZeRO-2): W + G / r + O / r + the largest sync unit's full gradient (the one being
  reduce-scattered; a unit is a profile node).
* ``parameters`` (ZeRO-3): W / r + G / r + O / r + the gathered working set: with
  ``reshard_after_forward`` the two largest units' full weights (the one in use and the one being
  gathered), without it the whole stage's W (gathered once, kept across the step's micro-batches)
  plus, as ZeRO-2, the largest unit's full gradient being reduce-scattered (measured:
  tests/pipeline/test_zero3.py).

Collectives (``cost/sharded.py``: a reduce-scatter or an all-gather is half of the cheapest paired
all-reduce, H_l for layer l; H = sum over the stage's layers):

* per step, every level: each layer's reduce-scatter as the last backward produces its gradient and
  its all-gather before the next forward needs it (the updated weights; ZeRO-3: the first forward's
  gather), queued on the sync lane exactly like the replicated stage's all-reduce (``layersync.py``,
  ``lanes.lane_row``) with 2 H_l in place of the all-reduce: on a ring the same bytes and
  latencies, so ZeRO-1 costs what the all-reduce did; the exposed part beyond the stage's gap is
  charged as today.
* within the step (``midstep_ms``), with k micro-batches per replica: ``gradients`` and
  ``parameters`` keep only 1/r of the gradients, so each earlier micro-batch's gradients are
  reduce-scattered during its own backward: ``(k - 1) max(0, H - B)``; ``parameters`` with
  ``reshard_after_forward`` also gathers the weights before each later forward and before every
  backward, so its whole mid-step term is ``(k - 1) max(0, 2 H - B) + max(0, H - B) + (k - 1) max(0, H - F)``
  (an earlier micro-batch's backward carries its gather and its reduce-scatter, the last one's only
  its gather: its reduce-scatter is on the lane). Gathers are
  prefetched layer by layer, so a pass hides them up to its own compute (F or B per micro-batch).
* the optimizer step of a sharded stage updates 1/r of the weights (``optimizer_ms / r``); the
  compute lost to communication (``interference``) counts every collective's bytes: ``halves(...)``
  reduce-scatters or all-gathers of (r - 1) / r W per step (an all-reduce is two).

A shard level needs a flushed schedule (pipedream stashes whole weight versions) and r > 1, and
``gradients`` and ``parameters`` a multiple of r micro-batches (each replica reduce-scatters per
micro-batch: one with fewer would leave the others waiting; launch refuses such a plan, so the
search never makes one: :func:`runs_with`);
``--shard auto`` takes, per stage, the variant with the smallest stage term among those that fit (every
level: launch runs them all, ZeRO-3's ``parameters`` included), ties to the first in ``VARIANTS``: less
sharding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from hybridpipe.errors import UserError
from hybridpipe.partitioner.plan_parts import SHARD_LEVELS

SHARD_CHOICES = (*SHARD_LEVELS, "auto")
Num = TypeVar("Num", float, np.ndarray)      # one stage's figure, or arrays of many candidates'


@dataclass(frozen=True)
class Variant:
    """A stage's shard level and, for ``parameters``, whether gathered weights are freed after each forward."""

    level: str = "none"
    reshard: bool = True


NONE = Variant()
VARIANTS = (NONE, Variant("optimizer"), Variant("gradients"), Variant("parameters", True),
            Variant("parameters", False))


def check_shard(shard: str) -> None:
    """UserError unless ``shard`` is a --shard choice."""
    if shard not in SHARD_CHOICES:
        raise UserError(f"unknown --shard {shard!r}; choose from {', '.join(SHARD_CHOICES)}")


def sharded_variants(shard: str) -> tuple[Variant, ...]:
    """The variants a stage with replicas may take under ``--shard`` (a stage of one replica: ``NONE`` only);
    ``auto`` chooses among every level."""
    if shard == "auto":
        return VARIANTS
    return tuple(v for v in VARIANTS if v.level == shard)


def runs_with(v: Variant, replicas: Num | int, micro_batches: int) -> Num | bool:
    """Whether a stage of ``replicas`` can shard as ``v`` with ``micro_batches`` per step (module docstring;
    elementwise on arrays)."""
    per_micro_batch = v.level in ("gradients", "parameters")
    return np.logical_or(not per_micro_batch, micro_batches % np.maximum(replicas, 1) == 0)


def static_bytes(v: Variant, weights: Num, replicas: Num | int, states: int, unit1: Num, unit2: Num,
                 versions: Num | int = 0) -> Num:
    """Weights, gradients and optimizer state per worker (module docstring); numbers or numpy arrays.
    ``unit1``: the largest node's parameter bytes, ``unit2``: the two largest nodes' together."""
    if v.level == "none":
        return weights * (2 + states + versions)
    if v.level == "optimizer":
        return weights * (2 + versions) + weights * states / replicas
    if v.level == "gradients":
        return weights * (1 + versions) + weights * (1 + states) / replicas + unit1
    gathered = unit2 if v.reshard else weights + unit1
    return weights * versions + weights * (2 + states) / replicas + gathered


def least_static_bytes(shard: str, weights: Num, most_replicas: int, states: int, unit1: Num, unit2: Num) -> Num:
    """The least of ``static_bytes`` any variant ``--shard`` allows can have on at most ``most_replicas``
    replicas (for the relaxation: a stage needing more than this never fits)."""
    least = static_bytes(NONE, weights, 1, states, unit1, unit2)
    if most_replicas > 1:
        for v in sharded_variants(shard):
            least = np.minimum(least, static_bytes(v, weights, most_replicas, states, unit1, unit2))
    return least


def midstep_ms(v: Variant, k: Num | int, half: Num, forward: Num, backward: Num) -> Num:
    """Exposed collective time inside a step, beyond the per-step lane (module docstring); numbers or arrays.
    ``half``: one reduce-scatter (= one all-gather) of the stage's weights, ms; ``k``: micro-batches per replica."""
    if v.level in ("none", "optimizer"):
        return 0.0 * half
    earlier = k - 1
    scatter = earlier * np.maximum(0.0, half - backward)
    if v.level == "gradients" or not v.reshard:
        return scatter
    return (earlier * np.maximum(0.0, 2 * half - backward) + np.maximum(0.0, half - backward)
            + earlier * np.maximum(0.0, half - forward))


def halves(v: Variant, k: Num | int) -> Num | int:
    """Reduce-scatters and all-gathers of the stage's weights per step (an all-reduce counts as two)."""
    if v.level in ("none", "optimizer"):
        return 2 + 0 * k
    if v.level == "gradients" or not v.reshard:
        return k + 1
    return 3 * k


def largest_units(param_bytes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """n x n tables [i, j] of stage i..j: its largest node's parameter bytes, and its two largest together."""
    n = len(param_bytes)
    top1 = np.zeros((n, n))
    top2 = np.zeros((n, n))
    for i in range(n):
        first = second = 0.0
        for j in range(i, n):
            b = float(param_bytes[j])
            if b > first:
                first, second = b, first
            elif b > second:
                second = b
            top1[i, j], top2[i, j] = first, first + second
    return top1, top2


def stage_units(param_bytes: np.ndarray) -> tuple[float, float]:
    """(largest, two largest together) of one stage's nodes' parameter bytes."""
    top = sorted((float(b) for b in param_bytes), reverse=True) + [0.0, 0.0]
    return top[0], top[0] + top[1]
