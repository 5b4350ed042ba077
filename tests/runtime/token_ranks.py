"""Rank programs of tests/runtime/test_trainer_tokens.py: Trainer(loss_normalization="tokens")."""

from __future__ import annotations

import torch

from hybridpipe import Trainer
from hybridpipe.partitioner.plan import load_plan
from tests.pipeline.loss_models import Ragged

M, B, STEPS, LR, MOMENTUM = 4, 2, 3, 0.05, 0.5


def step_parts(data: Ragged, k: int) -> list:
    """Step k's micro-batches, each padded to its own longest sequence."""
    return [data.collate_fn([data[((k * M + m) * B + i) % len(data)] for i in range(B)]) for m in range(M)]


def train_tokens(rank: int, world: int, plan_path: str, out: str, clip: float, precision: str) -> dict:
    """STEPS token-weighted steps (clipped by the global norm), then one evaluation of step 0's
    micro-batches; the final checkpoint in OUT."""
    plan = load_plan(plan_path)
    trainer = Trainer(plan.model, plan, optimizer=lambda ps: torch.optim.SGD(ps, lr=LR, momentum=MOMENTUM),
                      clip_grad_norm=clip, seed=0, loss_normalization="tokens", precision=precision, timeout=60)
    data = Ragged("lm")
    losses, norms = [], []
    for k in range(STEPS):
        losses.append(trainer.train_step(iter(step_parts(data, k))))
        norms.append(trainer.last_grad_norm)
    evaluated = trainer.eval_step(iter(step_parts(data, 0)))
    trainer.save(out)
    trainer.close()
    return {"losses": losses, "norms": norms, "eval": evaluated}


def train_precision_tokens(rank: int, world: int, plan_path: str, precision: str, steps: int) -> dict:
    """``steps`` token-weighted Adam steps in ``precision`` on the plan's synthetic data: the losses
    and (fp16) the loss scale after each step."""
    from tests.runtime.jobs import data_for
    from tests.runtime.trainer_ranks import _batch

    plan = load_plan(plan_path)
    trainer = Trainer(plan.model, plan, optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2), seed=0,
                      loss_normalization="tokens", precision=precision, timeout=60)
    data = data_for(plan, steps, 0)
    losses, scales = [], []
    for k in range(steps):
        losses.append(trainer.train_step(*_batch(trainer, data, k)))
        scales.append(trainer.scaler.scale if trainer.scaler is not None else None)
    trainer.close()
    return {"losses": losses, "scales": scales}


def resume_tokens(rank: int, world: int, plan_path: str, out: str) -> dict:
    """STEPS token-weighted steps of padded micro-batches, uninterrupted (saved to OUT/end), and
    again saved after one step (OUT/first), reloaded into a fresh Trainer and run to STEPS
    (OUT/resumed)."""
    plan = load_plan(plan_path)

    def trainer() -> Trainer:
        return Trainer(plan.model, plan, optimizer=lambda ps: torch.optim.SGD(ps, lr=LR, momentum=MOMENTUM),
                       seed=0, loss_normalization="tokens", timeout=60)
    data = Ragged("lm")
    whole = trainer()
    for k in range(STEPS):
        whole.train_step(iter(step_parts(data, k)))
    whole.save(f"{out}/end")
    whole.close()
    first = trainer()
    first.train_step(iter(step_parts(data, 0)))
    first.save(f"{out}/first")
    first.close()
    again = trainer()
    again.load(f"{out}/first")
    for k in range(again.step, STEPS):
        again.train_step(iter(step_parts(data, k)))
    again.save(f"{out}/resumed")
    again.close()
    return {}
