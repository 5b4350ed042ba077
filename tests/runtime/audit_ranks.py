"""Rank programs of tests/runtime/test_trainer_audit.py: the Trainer with optimizer features a plain
PyTorch loop has (parameter groups, schedulers that move more than the learning rate), resumed."""

from __future__ import annotations

import torch

from hybridpipe import Trainer
from hybridpipe.partitioner.plan import load_plan
from tests.runtime.jobs import data_for

SEED, STEPS, SAVE_AT = 3, 6, 3


def grouped_adamw(params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """AdamW with two parameter groups as transformer recipes make them: matrices decayed, vectors
    (biases, norms) not (:func:`one_cycle` gives them different learning rates)."""
    matrices = [p for p in params if p.ndim >= 2]
    vectors = [p for p in params if p.ndim < 2]
    groups = [{"params": g, **h} for g, h in ((matrices, {"weight_decay": 0.1}), (vectors, {"weight_decay": 0.0})) if g]
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.99))


def one_cycle(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """OneCycleLR as the README's example uses it: it moves Adam's beta1 with the learning rate."""
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[2e-2 if g["weight_decay"] else 1e-2
                                                       for g in opt.param_groups], total_steps=STEPS, pct_start=0.5)


def _batch(trainer: Trainer, data, k: int):
    x, y = data.global_batch(k)
    return (x if trainer.stage_plan.index == 0 else None), (y if trainer.is_last else None)


def resume_one_cycle(rank: int, world: int, plan_path: str, out: str, resume: bool, clip: float) -> dict:
    """STEPS steps of AdamW in two groups under OneCycleLR with clipping, saved after SAVE_AT (or resumed
    from there): each step's loss and the hyperparameters it ran with."""
    plan = load_plan(plan_path)
    trainer = Trainer(plan.model, plan, optimizer=grouped_adamw, lr_scheduler=one_cycle, clip_grad_norm=clip,
                      seed=SEED, timeout=60)
    data = data_for(plan, STEPS, SEED)
    if resume:
        assert trainer.load(f"{out}/mid") is not None and trainer.step == SAVE_AT
    losses, hypers = {}, {}
    for k in range(trainer.step, STEPS):
        hypers[k] = [[g["lr"], g["betas"][0], g["weight_decay"]] for g in trainer.optimizer.param_groups]
        losses[k] = trainer.train_step(*_batch(trainer, data, k))
        if k + 1 == SAVE_AT and not resume:
            trainer.save(f"{out}/mid")
    trainer.save(f"{out}/{'resumed' if resume else 'end'}")
    trainer.close()
    return {"losses": losses, "hypers": hypers}


def in_turn(rank: int, world: int, calls: list) -> list:
    """Several programs of this file one after the other in one job (see trainer_ranks.in_turn)."""
    return [globals()[name](rank, world, *args) for name, args in calls]
