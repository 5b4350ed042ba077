"""Rank programs of tests/runtime/test_trainer_audit.py: the Trainer with optimizer features a plain
PyTorch loop has (parameter groups, schedulers that move more than the learning rate), resumed."""

from __future__ import annotations

from pathlib import Path

import torch

from hybridpipe import Trainer
from hybridpipe.partitioner.plan import load_plan
from tests.runtime.jobs import data_for

SEED, STEPS, SAVE_AT = 3, 6, 3


class FrozenMLP(torch.nn.Module):
    """An MLP whose first layer is frozen (fine-tuning's frozen embedding) and whose bias-free middle
    layer has no vector parameter: requires_grad must survive every rank's build, the replicas'
    sync, clipping and the optimizer's groups."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(12, 16)
        self.b = torch.nn.Linear(16, 16, bias=False)
        self.norm = torch.nn.LayerNorm(16)
        self.c = torch.nn.Linear(16, 5)
        self.a.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.norm(torch.relu(self.b(torch.tanh(self.a(x))))))


def frozen_mlp():
    """``tests.runtime.audit_ranks:frozen_mlp``: (module, example input)."""
    return FrozenMLP(), torch.randn(4, 12)


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


def train_grouped(rank: int, world: int, plan_path: str, clip: float) -> dict:
    """STEPS steps of AdamW in two groups under OneCycleLR with clipping: each step's loss and norm."""
    plan = load_plan(plan_path)
    trainer = Trainer(plan.model, plan, optimizer=grouped_adamw, lr_scheduler=one_cycle, clip_grad_norm=clip,
                      seed=SEED, timeout=60)
    data = data_for(plan, STEPS, SEED)
    losses, norms = [], []
    for k in range(STEPS):
        losses.append(trainer.train_step(*_batch(trainer, data, k)))
        norms.append(trainer.last_grad_norm)
    with trainer.gathered() as module:          # ZeRO-3: trainer.module is freed between steps
        frozen = {n: p.detach().clone().tolist() for n, p in module.named_parameters() if not p.requires_grad}
    trainer.save(f"{Path(plan_path).parent}/grouped")
    trainer.close()
    return {"losses": losses, "norms": norms, "frozen": frozen}


def resume_resharded(rank: int, world: int, plan_path: str, other_path: str, out: str, resume: bool,
                     precision: str) -> dict:
    """STEPS steps of grouped AdamW under OneCycleLR on ``plan_path`` saved after SAVE_AT (or, with
    ``resume``, resumed from there on ``other_path``, another split of the same world: resharded):
    the hyperparameters of each step, the loss scale after each (fp16), the losses."""
    plan = load_plan(other_path if resume else plan_path)
    trainer = Trainer(plan.model, plan, optimizer=grouped_adamw, lr_scheduler=one_cycle, seed=SEED, timeout=60,
                      precision=precision, **({"loss_scale": 2.0 ** 28} if precision == "fp16" else {}))
    data = data_for(plan, STEPS, SEED)
    if resume:
        restored = trainer.load(f"{out}/mid")
        assert restored is not None and restored.step == SAVE_AT and restored.resharded
    losses, hypers, scales = {}, {}, {}
    for k in range(trainer.step, STEPS):
        hypers[k] = [[g["lr"], g["betas"][0]] for g in trainer.optimizer.param_groups]
        losses[k] = trainer.train_step(*_batch(trainer, data, k))
        scales[k] = trainer.scaler.scale if trainer.scaler is not None else None
        if k + 1 == SAVE_AT and not resume:
            trainer.save(f"{out}/mid")
    trainer.save(f"{out}/{'resumed' if resume else 'end'}")
    trainer.close()
    return {"losses": losses, "hypers": hypers, "scales": scales}
