"""Rank programs of tests/runtime/test_trainer.py: the user's own loop through hybridpipe.Trainer."""

from __future__ import annotations

import copy
import hashlib
from typing import Any

import torch

from hybridpipe import Trainer
from hybridpipe.partitioner.plan import load_plan
from tests.runtime.jobs import data_for

SEED, LR, MOMENTUM, WEIGHT_DECAY, WARMUP, STEPS = 3, 0.05, 0.5, 0.01, 2, 5


def sgd_wd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)


def warm_cosine(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """Any torch scheduler: linear warm-up, then cosine decay (SequentialLR)."""
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=WARMUP)
    cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS - WARMUP)
    return torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[WARMUP])


def state_digest(trainer: Trainer) -> str:
    """SHA-256 of the stage's weights, the optimizer's state and the scheduler's state."""
    h = hashlib.sha256()
    tensors = list(trainer.stage.state_dict().values())
    opt = trainer.optimizer.state_dict()
    for s in opt.get("state", {}).values():
        tensors += [v for v in s.values() if isinstance(v, torch.Tensor)]
    for t in tensors:
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    h.update(repr(opt.get("param_groups")).encode())
    h.update(repr(trainer.scheduler.state_dict() if trainer.scheduler else None).encode())
    return h.hexdigest()


# precision -> a copy of the model a Trainer built from the spec, taken before it trained (a capture is ~0.7 s
# of CPU): train_fp16's Trainers start from it, as from the spec they would (the same seeded build)
_BUILT: dict[str, Any] = {}


def _batch(trainer: Trainer, data, k: int):
    """What this rank passes: the inputs on the first stage, the targets on the last, else nothing."""
    x, y = data.global_batch(k)
    first, last = trainer.stage_plan.index == 0, trainer.is_last
    return (x if first else None), (y if last else None)


def in_turn(rank: int, world: int, calls: list) -> list:
    """Several rank programs of this file one after the other in one process (one job's start-up for
    all): ``calls`` lists [function name, [args]]; returns each one's value. Each program builds and
    closes its own Trainer (the job's process group outlives them): a resume here starts from a new
    Trainer that reseeds and gets everything else (RNG included) from the checkpoint."""
    return [globals()[name](rank, world, *args) for name, args in calls]


def train_api(rank: int, world: int, plan_path: str, out: str, clip: float, eval_at: int, resume: bool) -> dict:
    """Train STEPS steps (or resume from OUT/mid and finish); an eval step after ``eval_at`` steps
    must change nothing; checkpoints OUT/mid after 3 steps and OUT/end (OUT/resumed) at the end."""
    plan = load_plan(plan_path)
    trainer = Trainer(plan.model, plan, optimizer=sgd_wd, lr_scheduler=warm_cosine, clip_grad_norm=clip, seed=SEED,
                      timeout=60)
    data = data_for(plan, STEPS, SEED)
    out_value: dict = {"losses": {}, "norms": {}, "lrs": {}}
    if resume:
        restored = trainer.load(f"{out}/mid")
        assert restored is not None and restored.step == 3 == trainer.step
    for k in range(trainer.step, STEPS):
        out_value["lrs"][k] = trainer.lr
        out_value["losses"][k] = trainer.train_step(*_batch(trainer, data, k))
        out_value["norms"][k] = trainer.last_grad_norm
        if k + 1 == eval_at:
            before = state_digest(trainer)
            xs, ys = _batch(trainer, data, 0)
            out_value["eval"] = [trainer.eval_step(xs, ys), trainer.eval_step(xs, ys)]
            out_value["eval_changed"] = state_digest(trainer) != before
        if k + 1 == 3 and not resume:
            trainer.save(f"{out}/mid")
    trainer.save(f"{out}/{'resumed' if resume else 'end'}")
    trainer.close()
    out_value["allocator"] = trainer.allocator      # CPU: freed memory kept (runtime/allocator.py)
    return out_value


class ByteCounter:
    """A stand-in timeline recorder that counts the bytes this rank's p2p channels move."""

    def __init__(self) -> None:
        self.sent = 0
        self.lock = __import__("threading").Lock()

    def on_transfer(self, peer: int, key: str, nbytes: int, t0: float, t1: float) -> None:
        with self.lock:
            self.sent += nbytes

    def align(self, barrier) -> None:
        barrier()

    def record(self, phase: str, micro_batch: int, t0: float, t1: float, stage: int | None = None) -> None:
        pass


def train_precision(rank: int, world: int, plan_path: str, precision: str, steps: int) -> dict:
    """``steps`` Adam steps of the plan's model in ``precision``: the losses and the p2p bytes."""
    plan = load_plan(plan_path)
    counter = ByteCounter()
    trainer = Trainer(plan.model, plan, optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2), seed=SEED,
                      precision=precision, recorder=counter, timeout=60)
    _BUILT[precision] = copy.deepcopy(trainer.model)
    data = data_for(plan, steps, SEED)
    losses = [trainer.train_step(*_batch(trainer, data, k)) for k in range(steps)]
    dtypes = sorted({str(p.dtype) for p in trainer.stage.parameters()})
    trainer.close()
    return {"losses": losses, "bytes": counter.sent, "param_dtypes": dtypes}


def train_fp16(rank: int, world: int, plan_path: str, out: str, resume: bool) -> dict:
    """10 fp16 steps from a loss scale of 2**24 (or resumed from OUT/fp16 after 5): the scale after
    each step, whether this rank's weights changed, the final digest."""
    plan = load_plan(plan_path)
    model = copy.deepcopy(_BUILT["fp16"]) if "fp16" in _BUILT else plan.model
    trainer = Trainer(model, plan, optimizer=lambda ps: torch.optim.Adam(ps, lr=1e-2), seed=SEED,
                      precision="fp16", loss_scale=2.0**24, timeout=60)
    data = data_for(plan, 10, SEED)
    if resume:
        assert trainer.load(f"{out}/fp16") is not None and trainer.step == 5
    scales, changed = [], []
    for k in range(trainer.step, 10):
        before = state_digest(trainer)
        trainer.train_step(*_batch(trainer, data, k))
        scales.append(trainer.scaler.scale)
        changed.append(state_digest(trainer) != before)
        if k + 1 == 5 and not resume:
            trainer.save(f"{out}/fp16")
    digest = state_digest(trainer)
    has_params = any(True for _ in trainer.stage.parameters())
    trainer.close()
    return {"scales": scales, "changed": changed, "digest": digest, "has_params": has_params}
