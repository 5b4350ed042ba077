"""Rank programs of tests/runtime/test_sharded_audit.py: the Trainer on sharded replicas (ZeRO-1/2/3)
with fp16's loss scale forced to overflow, clipping over tied weights, and evaluation between steps.
Each returns what the test compares with its plain single-process loop and saves a checkpoint."""

from __future__ import annotations

from typing import Any

import torch

from hybridpipe import Trainer
from hybridpipe.partitioner.plan import load_plan
from tests.runtime.jobs import data_for

SEED, STEPS, LR, WD, EVAL_SEED, MOMENTUM = 3, 6, 1e-2, 0.1, 11, 0.9


def adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """The audit's optimizer: AdamW (its step count and moments must not move on a skipped step)."""
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD)


def sgd(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with momentum: no per-element normalization (AdamW's first steps move every element by
    about lr whatever its gradient, so a gradient that is rounding noise moves by its sign)."""
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WD)


OPTIMIZERS = {"adamw": adamw, "sgd": sgd}


def _batch(trainer: Trainer, data: Any, k: int) -> tuple[Any, Any]:
    x, y = data.global_batch(k)
    return (x if trainer.stage_plan.index == 0 else None), (y if trainer.is_last else None)


def in_turn(rank: int, world: int, calls: list) -> list:
    """Several programs of this file one after the other in one job (see trainer_ranks.in_turn)."""
    return [globals()[name](rank, world, *args) for name, args in calls]


def fp16_forced(rank: int, world: int, plan_path: str, out: str, optimizer: str, init_scale: float,
                force_after: int, forced: float) -> dict:
    """STEPS fp16 steps of ``optimizer`` (adamw or sgd) from loss scale ``init_scale``; after step
    ``force_after`` the scale is set to ``forced`` (every rank): each step's loss and the scale
    after it, the skipped count."""
    plan = load_plan(plan_path)
    trainer = Trainer(plan.model, plan, optimizer=OPTIMIZERS[optimizer], seed=SEED, timeout=60, precision="fp16",
                      loss_scale=init_scale)
    assert trainer.scaler is not None
    data = data_for(plan, STEPS, SEED)
    losses, scales = [], []
    for k in range(STEPS):
        losses.append(trainer.train_step(*_batch(trainer, data, k)))
        if k == force_after:
            trainer.scaler.scale = forced
        scales.append(trainer.scaler.scale)
    trainer.save(f"{out}/fp16")
    trainer.close()
    return {"losses": losses, "scales": scales, "skipped": trainer.scaler.skipped}


def clipped(rank: int, world: int, plan_path: str, out: str, clip: float) -> dict:
    """STEPS steps of AdamW clipped to global norm ``clip``: each step's loss and norm."""
    plan = load_plan(plan_path)
    trainer = Trainer(plan.model, plan, optimizer=adamw, clip_grad_norm=clip, seed=SEED, timeout=60)
    data = data_for(plan, STEPS, SEED)
    losses, norms = [], []
    for k in range(STEPS):
        losses.append(trainer.train_step(*_batch(trainer, data, k)))
        norms.append(trainer.last_grad_norm)
    trainer.save(f"{out}/clipped")
    trainer.close()
    return {"losses": losses, "norms": norms}


def evaluated(rank: int, world: int, plan_path: str, out: str, every: int) -> dict:
    """STEPS steps of SGD with momentum with an evaluation of held-out global batch e after every ``every``
    training steps (and before the first): each step's loss, each evaluation's."""
    plan = load_plan(plan_path)
    trainer = Trainer(plan.model, plan, optimizer=sgd, seed=SEED, timeout=60)
    data, held = data_for(plan, STEPS, SEED), data_for(plan, STEPS, EVAL_SEED)
    losses, evals = [], []
    for k in range(STEPS):
        if k % every == 0:
            evals.append(trainer.eval_step(*_batch(trainer, held, k // every)))
        losses.append(trainer.train_step(*_batch(trainer, data, k)))
    evals.append(trainer.eval_step(*_batch(trainer, held, STEPS // every)))
    trainer.save(f"{out}/evaluated")
    trainer.close()
    return {"losses": losses, "evals": evals}
