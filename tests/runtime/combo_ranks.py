"""Rank programs of tests/runtime/test_combo_audit.py: the Trainer on combinations of features that
each were tested alone (a weight shared by non-adjacent stages that is not an embedding, BatchNorm,
replicas or ZeRO, virtual stages, clipping, parameter groups under a scheduler, evaluation between
steps, resume), returning what the test compares with its plain single-process loop."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridpipe import Trainer
from hybridpipe.partitioner.plan import load_plan
from tests.runtime.jobs import data_for

SEED, STEPS, SAVE_AT, EVAL_AT = 3, 6, 3, 2


class FarTied(nn.Module):
    """One Linear applied at the front and again near the end (a shared block, not an embedding:
    its uses land on non-adjacent stages), a BatchNorm between them."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.shared = nn.Linear(width, width)
        self.a = nn.Linear(width, width)
        self.bn = nn.BatchNorm1d(width)
        self.b = nn.Linear(width, width)
        self.c = nn.Linear(width, width)
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(torch.tanh(self.shared(x))))
        h = torch.relu(self.b(self.bn(h)))
        return self.head(torch.relu(self.c(torch.tanh(self.shared(h)))))


def far_tied() -> tuple[nn.Module, torch.Tensor]:
    """``tests.runtime.combo_ranks:far_tied``: (module, example input)."""
    return FarTied(), torch.randn(4, 8)


def grouped(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    """SGD with momentum in two groups: matrices decayed, vectors not."""
    matrices = [p for p in params if p.ndim >= 2]
    vectors = [p for p in params if p.ndim < 2]
    groups = [{"params": g, "weight_decay": wd} for g, wd in ((matrices, 0.05), (vectors, 0.0)) if g]
    return torch.optim.SGD(groups, lr=0.05, momentum=0.9)


def grouped_adamw(params: list[nn.Parameter]) -> torch.optim.Optimizer:
    matrices = [p for p in params if p.ndim >= 2]
    vectors = [p for p in params if p.ndim < 2]
    groups = [{"params": g, "weight_decay": wd} for g, wd in ((matrices, 0.1), (vectors, 0.0)) if g]
    return torch.optim.AdamW(groups, lr=1e-2)


OPTIMIZERS = {"sgd": grouped, "adamw": grouped_adamw}


def schedule(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LRScheduler:
    """Per-group rates: a linear warm-up then cosine decay for the first group, step decay for the second."""
    warm = [lambda k: min(1.0, (k + 1) / 2) * 0.5 * (1 + __import__("math").cos(__import__("math").pi * k / STEPS)),
            lambda k: 0.5 ** (k // 2)][:len(opt.param_groups)]
    return torch.optim.lr_scheduler.LambdaLR(opt, warm)


def _batch(trainer: Trainer, data: Any, k: int) -> tuple[Any, Any]:
    x, y = data.global_batch(k)
    return (x if trainer.stage_plan.index == 0 else None), (y if trainer.is_last else None)


def in_turn(rank: int, world: int, calls: list) -> list:
    """Several programs of this file one after the other in one job (see trainer_ranks.in_turn)."""
    return [globals()[name](rank, world, *args) for name, args in calls]


def train(rank: int, world: int, plan_path: str, out: str, optimizer: str, clip: float | None, resume: bool,
          precision: str = "fp32") -> dict:
    """STEPS steps (or resumed from OUT/mid after SAVE_AT), an evaluation of batch 0 after EVAL_AT;
    saves OUT/mid after SAVE_AT and OUT/end (OUT/resumed) at the end: losses, norms, lrs, eval."""
    plan = load_plan(plan_path)
    trainer = Trainer(plan.model, plan, optimizer=OPTIMIZERS[optimizer], lr_scheduler=schedule, clip_grad_norm=clip,
                      seed=SEED, timeout=60, precision=precision)
    data = data_for(plan, STEPS, SEED)
    if resume:
        assert trainer.load(f"{out}/mid") is not None and trainer.step == SAVE_AT
    value: dict = {"losses": {}, "norms": {}, "lrs": {}}
    for k in range(trainer.step, STEPS):
        value["lrs"][k] = [g["lr"] for g in trainer.optimizer.param_groups]
        value["losses"][k] = trainer.train_step(*_batch(trainer, data, k))
        value["norms"][k] = trainer.last_grad_norm
        if k + 1 == EVAL_AT:
            value["eval"] = trainer.eval_step(*_batch(trainer, data, 0))
        if k + 1 == SAVE_AT and not resume:
            trainer.save(f"{out}/mid")
    trainer.save(f"{out}/{'resumed' if resume else 'end'}")
    trainer.close()
    return value


def refused(rank: int, world: int, plan_path: str) -> str:
    """Build a Trainer on a plan check_shards refuses: the one-line error every rank gets."""
    plan = load_plan(plan_path)
    try:
        Trainer(plan.model, plan, optimizer=OPTIMIZERS["sgd"], seed=SEED, timeout=60).close()
    except Exception as e:            # noqa: BLE001 -- the test checks it is the one-line UserError
        return f"{type(e).__name__}: {e}"
    return "trained"


VOCAB, SEQ = 11, 6


class TokenNet(nn.Module):
    """A small token model: embedding, a BatchNorm-free MLP, a head over the vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 8)
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)
        self.head = nn.Linear(8, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.b(torch.relu(self.a(self.emb(ids))))))


def smoothed_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Label-smoothed cross-entropy summed over the valid tokens (-100: ignored) and their count."""
    total = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                              label_smoothing=0.1, reduction="sum")
    return total, (labels != -100).sum()


def token_net() -> tuple:
    """``tests.runtime.combo_ranks:token_net``: (module, example ids, loss, example labels)."""
    ids = torch.randint(0, VOCAB, (2, SEQ))
    return TokenNet(), ids, smoothed_sum, ids.clone()


def token_batch(k: int, rows: int, empty: tuple[int, ...] = (), batch_size: int = 2) -> tuple[torch.Tensor, ...]:
    """Step k's global batch of ids and labels: ~1 in 3 labels -100, and every label of the
    micro-batches in ``empty`` (rows m*B .. m*B+B-1) -100 (a micro-batch of padding only)."""
    g = torch.Generator().manual_seed(100 + k)
    ids = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    labels = torch.randint(0, VOCAB, (rows, SEQ), generator=g)
    labels = torch.where(torch.rand(rows, SEQ, generator=g) < 0.33, -100, labels)
    for m in empty:
        labels[m * batch_size:(m + 1) * batch_size] = -100
    return ids, labels


def train_tokens(rank: int, world: int, plan_path: str, out: str, clip: float | None, precision: str,
                 empty: list[int]) -> dict:
    """STEPS token-weighted AdamW steps with the micro-batches ``empty`` of every step all padding;
    an evaluation of step 0's batch after EVAL_AT; saves OUT/tokens."""
    plan = load_plan(plan_path)
    trainer = Trainer(plan.model, plan, optimizer=OPTIMIZERS["adamw"], lr_scheduler=schedule, clip_grad_norm=clip,
                      seed=SEED, timeout=60, precision=precision, loss_normalization="tokens")
    rows = plan.micro_batches * plan.batch_size
    value: dict = {"losses": [], "norms": []}
    for k in range(STEPS):
        x, y = token_batch(k, rows, tuple(empty), plan.batch_size)
        first, last = trainer.stage_plan.index == 0, trainer.is_last
        value["losses"].append(trainer.train_step(x if first else None, y if last else None))
        value["norms"].append(trainer.last_grad_norm)
        if k + 1 == EVAL_AT:
            x, y = token_batch(0, rows, tuple(empty), plan.batch_size)
            value["eval"] = trainer.eval_step(x if first else None, y if last else None)
    trainer.save(f"{out}/tokens")
    trainer.close()
    return value


def train_then_other(rank: int, world: int, plan_path: str, other_path: str, out: str, clip: float | None) -> dict:
    """SAVE_AT steps on ``plan_path`` saved to OUT/first, then a new Trainer on ``other_path`` (another
    plan of the same world and global batch: an elastic restart's re-plan) resumed from there to STEPS;
    saves OUT/other: losses, norms, lrs."""
    value: dict = {"losses": {}, "norms": {}, "lrs": {}}
    for path, resume in ((plan_path, False), (other_path, True)):
        plan = load_plan(path)
        trainer = Trainer(plan.model, plan, optimizer=OPTIMIZERS["sgd"], lr_scheduler=schedule, clip_grad_norm=clip,
                          seed=SEED, timeout=60)
        data = data_for(plan, STEPS, SEED)
        if resume:
            restored = trainer.load(f"{out}/first")
            assert restored is not None and restored.resharded and trainer.step == SAVE_AT
        for k in range(trainer.step, STEPS if resume else SAVE_AT):
            value["lrs"][k] = [g["lr"] for g in trainer.optimizer.param_groups]
            value["losses"][k] = trainer.train_step(*_batch(trainer, data, k))
            value["norms"][k] = trainer.last_grad_norm
        trainer.save(f"{out}/{'other' if resume else 'first'}")
        trainer.close()
    return value


def train_fp16(rank: int, world: int, plan_path: str, out: str, clip: float | None, init_scale: float,
               force_after: int = -1, forced: float = 0.0) -> dict:
    """STEPS fp16 steps from loss scale ``init_scale`` (grouped SGD, LambdaLR, clipping), the scale set
    to ``forced`` after step ``force_after``: losses, norms, scales; saves OUT/fp16."""
    plan = load_plan(plan_path)
    trainer = Trainer(plan.model, plan, optimizer=OPTIMIZERS["sgd"], lr_scheduler=schedule, clip_grad_norm=clip,
                      seed=SEED, timeout=60, precision="fp16", loss_scale=init_scale)
    assert trainer.scaler is not None
    data = data_for(plan, STEPS, SEED)
    value: dict = {"losses": [], "norms": [], "scales": []}
    for k in range(STEPS):
        value["losses"].append(trainer.train_step(*_batch(trainer, data, k)))
        value["norms"].append(trainer.last_grad_norm)
        if k == force_after:
            trainer.scaler.scale = forced
        value["scales"].append(trainer.scaler.scale)
    trainer.save(f"{out}/fp16")
    trainer.close()
    return value


def own_instance(rank: int) -> FarTied:
    """What each rank builds when a user builds the model without seeding it the same everywhere."""
    torch.manual_seed(1000 + rank)
    return FarTied()


def train_own_instance(rank: int, world: int, plan_path: str, out: str, clip: float | None) -> dict:
    """STEPS steps of a Trainer given this rank's own FarTied instance (:func:`own_instance`: every
    rank's differs); saves OUT/own."""
    plan = load_plan(plan_path)
    trainer = Trainer(own_instance(rank), plan, example=torch.randn(4, 8), loss=torch.nn.functional.cross_entropy,
                      optimizer=OPTIMIZERS["sgd"], lr_scheduler=schedule, clip_grad_norm=clip, seed=SEED, timeout=60)
    data = data_for(plan, STEPS, SEED)
    losses = [trainer.train_step(*_batch(trainer, data, k)) for k in range(STEPS)]
    trainer.save(f"{out}/own")
    trainer.close()
    return {"losses": losses}
