"""Rank programs of tests/runtime/test_trainer_dirlock.py: two Trainer jobs given one checkpoint
directory, the second started while the first still uses it (marker files order them)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from hybridpipe import Trainer
from hybridpipe.errors import UserError
from hybridpipe.partitioner.plan import load_plan
from tests.runtime.jobs import data_for

STEPS = 2


def _trained(plan_path: str, seed: int, steps: int = STEPS) -> Trainer:
    plan = load_plan(plan_path)
    trainer = Trainer(plan.model, plan, seed=seed, lr=0.05, timeout=60)
    data = data_for(plan, STEPS, seed)
    for k in range(steps):
        trainer.train_step(*data.global_batch(k))
    return trainer


def first(rank: int, world: int, plan_path: str, ckpt: str, markers: str) -> dict:
    """Train, save into ``ckpt``, let the second job run, then resume from ``ckpt``: did the weights
    come back as this job saved them?"""
    trainer = _trained(plan_path, seed=3)
    trainer.save(ckpt)
    saved = {k: v.clone() for k, v in trainer.module.state_dict().items()}
    (Path(markers) / "first-saved").touch()
    deadline = time.monotonic() + 120
    while not (Path(markers) / "second-done").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    with torch.no_grad():
        for p in trainer.module.parameters():
            p.zero_()
    restored = trainer.load(ckpt)
    state = trainer.module.state_dict()
    trainer.close()
    return {"step": restored.step if restored is not None else None,
            "same": all(torch.equal(state[k], v) for k, v in saved.items())}


def second(rank: int, world: int, plan_path: str, ckpt: str, markers: str) -> str:
    """Another job (another seed) saving into the same directory: "saved", or the error it got."""
    try:
        trainer = _trained(plan_path, seed=4)
        try:
            trainer.save(ckpt)
        finally:
            trainer.close()
        return "saved"
    except UserError as e:
        return str(e)
    finally:
        (Path(markers) / "second-done").touch()


def fresh_after(rank: int, world: int, plan_path: str, ckpt: str) -> dict:
    """A run saves 2 steps into ``ckpt`` and ends; a fresh run (another seed, nothing loaded) then saves
    its step 1 there, and its restart loads ``ckpt``: which run's weights does the restart hold?"""
    first = _trained(plan_path, seed=3)
    first.save(ckpt)
    theirs = {k: v.clone() for k, v in first.module.state_dict().items()}
    first.close()
    fresh = _trained(plan_path, seed=4, steps=1)
    try:
        fresh.save(ckpt)
        refused = ""
    except UserError as e:
        refused = str(e)
    fresh.close()
    restart = Trainer(load_plan(plan_path).model, plan_path, seed=4, lr=0.05, timeout=60)
    restored = restart.load(ckpt)
    state = restart.module.state_dict()
    restart.close()
    return {"refused": refused, "step": restored.step if restored is not None else None,
            "theirs": all(torch.equal(state[k], v) for k, v in theirs.items())}
