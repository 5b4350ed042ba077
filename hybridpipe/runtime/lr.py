"""Learning-rate schedules of launch's ``--lr-schedule`` (pure), and the scheduler factory the API takes.

    factor = lr_factor("cosine", step, warmup=100, total=1000)   # multiplies the base learning rate
    make = lr_schedule("cosine", warmup=100, total=1000)       # optimizer -> torch LambdaLR

``step`` counts the training steps done before the one the factor applies to (a scheduler is
stepped once after every training step). Warm-up rises linearly to the full rate:
``(step + 1) / warmup`` for the first ``warmup`` steps, so the first step already learns. After
it: ``constant`` stays at 1, ``linear`` falls linearly to 0 at ``total``, ``cosine`` follows
half a cosine from 1 to 0 at ``total``.
"""

from __future__ import annotations

import copy
import math
import warnings
from collections.abc import Callable
from typing import Any

import torch

from hybridpipe.errors import UserError

SCHEDULES = ("constant", "linear", "cosine")

SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


def lr_factor(kind: str, step: int, *, warmup: int, total: int) -> float:
    """The factor on the base learning rate for the step after ``step`` completed steps."""
    if kind not in SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {kind!r}; choose one of {', '.join(SCHEDULES)}")
    if step < warmup:
        return (step + 1) / warmup
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if kind == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_schedule(kind: str, *, warmup: int, total: int) -> SchedulerFactory:
    """A factory of torch ``LambdaLR`` schedulers following :func:`lr_factor` (for ``Trainer``)."""
    lr_factor(kind, 0, warmup=warmup, total=total)          # refuse an unknown kind now

    def make(optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
        return torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: lr_factor(kind, step, warmup=warmup, total=total))
    return make


def fresh_hyperparameters(optimizer: Any) -> list[dict[str, Any]]:
    """Each param group's hyperparameters before any scheduler touched them (for :func:`replay_scheduler`;
    copies: a tensor learning rate is changed in place)."""
    groups = getattr(optimizer, "param_groups", [])
    return [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in groups]


def replay_scheduler(make: SchedulerFactory, optimizer: torch.optim.Optimizer, fresh: list[dict[str, Any]],
                     steps: int) -> torch.optim.lr_scheduler.LRScheduler:
    """The scheduler ``make`` builds on ``optimizer`` as it stands after ``steps`` training steps: the
    groups' hyperparameters set back to ``fresh`` (what they were before the first scheduler), a new
    scheduler built and stepped ``steps`` times. For a checkpoint resumed under another plan, whose
    ranks hold other parameter groups than the saved schedulers' (a scheduler's state is per group);
    torch's schedulers depend on the step count alone. A ReduceLROnPlateau (it steps on a metric) is refused."""
    for group, hyper in zip(optimizer.param_groups, fresh, strict=True):
        for key in [k for k in group if k != "params"]:
            del group[key]
        group.update(copy.deepcopy(hyper))
    scheduler = make(optimizer)
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise UserError("a checkpoint resumed under another plan replays the learning-rate scheduler from its step "
                        "count, but ReduceLROnPlateau follows a metric: resume under the plan that wrote it")
    with warnings.catch_warnings():       # "lr_scheduler.step() before optimizer.step()": no step is trained here
        warnings.simplefilter("ignore", UserWarning)
        for _ in range(steps):
            scheduler.step()
    return scheduler
