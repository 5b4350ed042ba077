"""Where a flushed step's 1/M gradient factor is applied: in the backward's seed instead of the Step.

The Step's gradients are the micro-batches' gradients summed, times ``grad_scale`` (1/M; replicas
sum theirs). Starting each micro-batch's backward on the last stage from ``grad_scale`` instead of
1 (the ``grad_tensors`` seed of ``torch.autograd.backward``, made in place of the ones it would
make) scales every gradient of every stage by the same factor: backward is linear in its seed and
gradients cross stages already scaled. When the factor is a power of two the two orders give the
same bits (multiplying by 2^-k commutes with every rounding of a binary float; only values in
the subnormal range, below ~1e-38 in float32 and bfloat16, could differ), so the Step then skips
its pass over the gradients. Otherwise (M not a power of two, or float16 whose range is narrow),
the Step scales as before.

With an fp16 loss scale the seed is 1/M for any M: a plain loop under ``torch.amp.GradScaler``
backpropagates ``scaler.scale(loss / M)``, so its float16 gradients carry scale/M and its overflow
check sees those; seeded with 1 they would be M times larger and overflow at an M times smaller
scale (steps skipped that the plain loop takes). The loss scale is a power of two, so seed x scale
is scale/M rounded once, as the plain loop's.

The answer depends only on settings every rank shares (the topology, the schedule, the engine's
``tokens``, ``loss_scale`` and ``autocast``), so the last stage seeds exactly when the others skip.
"""

from __future__ import annotations

import math

import torch

from hybridpipe.partitioner.schedule_registry import Schedule


def loss_seed(micro_batches: int, schedule: Schedule, *, tokens: bool, loss_scale: bool,
              autocast: torch.dtype | None) -> float | None:
    """The seed of the last stage's backward (the Step's 1/M), or None: seed 1, the Step scales.

    ``tokens``: token-weighted losses (their factor is known only at the Step); ``loss_scale``:
    an fp16 loss scale is in use; ``autocast``: the forwards' mixed-precision dtype."""
    if schedule.asynchronous or tokens:
        return None
    scale = 1.0 / micro_batches
    if loss_scale:                      # as GradScaler's scale(loss / M), whatever M (module docstring)
        return scale
    if autocast == torch.float16:
        return None
    return scale if math.frexp(scale)[0] == 0.5 else None       # a power of two: exact
