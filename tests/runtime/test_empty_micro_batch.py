"""An all-padding micro-batch under per-micro-batch loss normalization, on 2 real rank processes
(gloo, 2 stages of 1f1b) against a plain gradient accumulation loop written here.

A loss function returning ``(loss_sum, count)`` gives (0, 0) on a micro-batch whose every label is
-100: its mean was 0 / 0, a NaN that stopped the run with the generic non-finite error. Now it adds
no loss and no gradient, as the accumulation loop that skips it computes (each micro-batch's mean
/ M, the M of the schedule): the weights and every step's loss equal that loop's. A step whose
whole global batch counts nothing stops every rank in one line naming the cause, no weight of it
applied. On one last-stage rank (its verdict carried or broadcast) and on two (the max over the ranks,
one of them with nothing to count in a step the other counts).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

MODEL = "tests.runtime.test_empty_micro_batch:classifier"
SEED, LR, STEPS, M, B = 3, 0.1, 3, 4, 2
# (step, micro-batch) whose every label is padding: on 2 last-stage replicas (micro-batch m on m % 2)
# step 1 leaves replica 1 nothing to count, the other replica something; step STEPS is all padding
EMPTY = {(0, 1), (1, 1), (1, 3), (2, 0), *((STEPS, m) for m in range(M))}


def masked_sum(output: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return F.cross_entropy(output, labels, ignore_index=-100, reduction="sum"), (labels != -100).sum()


def classifier():
    """``tests.runtime.test_empty_micro_batch:classifier``: (module, example, loss, example target)."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 5))
    return model, torch.randn(B, 8), masked_sum, torch.zeros(B, dtype=torch.long)


def global_batch(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Step k's inputs and labels: some labels -100, every label of EMPTY's micro-batches."""
    g = torch.Generator().manual_seed(100 + k)
    x, y = torch.randn(M * B, 8, generator=g), torch.randint(0, 5, (M * B,), generator=g)
    y[torch.rand(M * B, generator=g) < 0.25] = -100
    for step, m in EMPTY:
        if step == k:
            y[m * B:(m + 1) * B] = -100
    return x, y


def train(rank: int, world: int, plan_path: str) -> dict:
    """Rank program: STEPS steps; the losses and (last stage) its weights."""
    from hybridpipe import Trainer
    from hybridpipe.errors import AgreedError
    from hybridpipe.partitioner.plan import load_plan

    plan = load_plan(plan_path)
    trainer = Trainer(plan.model, plan, optimizer=lambda ps: torch.optim.SGD(ps, lr=LR, momentum=0.5), seed=SEED,
                      timeout=60)
    first, last = trainer.stage_plan.index == 0, trainer.is_last
    losses = []
    for k in range(STEPS):
        x, y = global_batch(k)
        losses.append(trainer.train_step(x if first else None, y if last else None))
    x, y = global_batch(STEPS)
    try:
        trainer.train_step(x if first else None, y if last else None)
        stopped = None
    except AgreedError as e:
        stopped = str(e)
    weights = {n: t.tolist() for n, t in trainer.module.state_dict().items()}
    trainer.close()
    return {"losses": losses, "weights": weights, "stopped": stopped}


def reference() -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process accumulating the micro-batches' mean losses / M, skipping a micro-batch without labels."""
    from hybridpipe.profiles.zoo import resolve_model

    spec = resolve_model(MODEL)
    torch.manual_seed(SEED)
    model = spec.build()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.5)
    losses = []
    for k in range(STEPS):
        opt.zero_grad()
        x, y = global_batch(k)
        total = 0.0
        for m in range(M):
            xm, ym = x[m * B:(m + 1) * B], y[m * B:(m + 1) * B]
            if (ym != -100).sum() == 0:
                continue
            loss = F.cross_entropy(model(xm), ym, ignore_index=-100)
            (loss / M).backward()
            total += float(loss.detach()) / M
        opt.step()
        losses.append(total)
    return model.state_dict(), losses


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [[1, 1], [1, 2]])
def test_an_all_padding_micro_batch_adds_nothing_as_the_accumulation_loop_that_skips_it(tmp_path: Path, replicas):
    """... and a step with nothing to count stops every rank in one line naming the cause, its
    update withheld (the weights are the loop's before it)."""
    from hybridpipe.partitioner.plan import save_plan
    from tests.pipeline.harness import make_plan
    from tests.runtime.rank_procs import Job

    plan = make_plan(MODEL, [1], replicas, micro_batches=M, batch_size=B, granularity="modules")
    path = save_plan(plan, tmp_path / "plan.json")
    with Job(Path(__file__), "train", plan.world_size, (str(path),)) as job:
        results = job.wait(timeout=180)
    assert all(r.returncode == 0 for r in results), results       # before: the non-finite loss error
    want, losses = reference()
    got = {}
    for r in results:
        assert r.value["losses"] == pytest.approx(losses, abs=1e-6)
        stopped = r.value["stopped"]
        assert "\n" not in stopped and f"no micro-batch of step {STEPS} counted anything" in stopped, stopped
        got.update(r.value["weights"])
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert torch.allclose(torch.tensor(got[name]), t, atol=1e-6, rtol=0), name
