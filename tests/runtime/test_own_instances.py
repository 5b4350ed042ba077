"""A model each rank builds unseeded (every rank's values differ), given to the Trainer on 3 real
rank processes (gloo), against a plain PyTorch loop written here holding the values the job must
take: each stage's parameters from its first rank's instance, a constant buffer drawn from the RNG
at construction from the lowest stage's first rank holding it, as for a tied weight."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

MODEL = "tests.runtime.test_own_instances:random_buffer"
SEED, LR, STEPS = 3, 0.1, 2


class RandomBuffer(nn.Module):
    """A random constant mixing matrix (a buffer, not trained) used by both halves of the model."""

    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.a = nn.Linear(width, width)
        self.register_buffer("mix", torch.randn(width, width))
        self.b = nn.Linear(width, width)
        self.head = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x) @ self.mix)
        return self.head(torch.tanh(self.b(h) @ self.mix))


def random_buffer() -> tuple[nn.Module, torch.Tensor]:
    """``tests.runtime.test_own_instances:random_buffer``: (module, example input)."""
    return RandomBuffer(), torch.randn(4, 8)


def own_instance(rank: int) -> RandomBuffer:
    """What each rank builds when a user builds the model without seeding it the same everywhere."""
    torch.manual_seed(1000 + rank)
    return RandomBuffer()


def train_own(rank: int, world: int, plan_path: str, out: str) -> list[float]:
    """Rank program: STEPS steps of a Trainer given this rank's own instance; saves OUT."""
    from hybridpipe import Trainer
    from hybridpipe.partitioner.plan import load_plan
    from tests.runtime.jobs import data_for

    plan = load_plan(plan_path)
    trainer = Trainer(own_instance(rank), plan, example=torch.randn(4, 8), loss=nn.functional.cross_entropy,
                      optimizer=lambda ps: torch.optim.SGD(ps, lr=LR), seed=SEED, timeout=60)
    data = data_for(plan, STEPS, SEED)
    first, last = trainer.stage_plan.index == 0, trainer.is_last
    losses = []
    for k in range(STEPS):
        x, y = data.global_batch(k)
        losses.append(trainer.train_step(x if first else None, y if last else None))
    trainer.save(out)
    trainer.close()
    return losses


def reference(plan) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process: rank 0's instance with the last stage's parameters from its first rank's instance
    (the buffer stays rank 0's: the lowest stage's first rank), trained on each global batch."""
    from tests.runtime.jobs import data_for

    model = own_instance(0)
    last = own_instance(plan.stages[-1].ranks[0])
    model.head.load_state_dict(last.head.state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = data_for(plan, STEPS, SEED)
    losses = []
    for k in range(STEPS):      # equal micro-batches: the global batch's mean is the micro-batches' mean
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(data.global_batch(k)[0]), data.global_batch(k)[1])
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    return model.state_dict(), losses


@pytest.mark.slow
@pytest.mark.parametrize("level", ["none", "optimizer", "parameters"])
def test_stages_take_their_first_ranks_values_and_the_lowest_stages_buffer(tmp_path: Path, level: str):
    """Stage 0 (Linear a, the buffer's first use, Linear b) on 2 replicas at ``level``, stage 1 (the
    buffer's second use, the head) on rank 2. Before, the replicas of a sharded stage kept their own
    values (ZeRO-1: each replica's forward on its own weights until the first update's gather; the
    buffer never aligned) and stage 1 used rank 2's buffer, stage 0 rank 0's: one process holds one."""
    from hybridpipe.partitioner.plan import save_plan
    from tests.pipeline.harness import make_plan
    from tests.runtime.jobs import final_weights, max_diff
    from tests.runtime.rank_procs import Job

    base = make_plan(MODEL, [1], [2, 1], granularity="modules")
    plan = dataclasses.replace(base, stages=tuple(dataclasses.replace(s, shard=level) if s.replicas > 1 else s
                                                  for s in base.stages))
    path = save_plan(plan, tmp_path / "plan.json")
    with Job(Path(__file__), "train_own", plan.world_size, (str(path), str(tmp_path / "ckpt"))) as job:
        results = job.wait(timeout=240)
    assert all(r.returncode == 0 for r in results), results
    want, losses = reference(plan)
    for r in results:
        assert r.value == pytest.approx(losses, abs=1e-6)
    assert max_diff(final_weights(tmp_path / "ckpt", STEPS), want) <= 1e-6


def test_every_copy_that_differs_from_the_lowest_stages_first_ranks_gets_its_bytes():
    """The transfers against a brute-force reading of the rule, on a plan of stages 0 (ranks 0, 1),
    1 (rank 2) and 2 (ranks 3, 4): a buffer of stages 0 and 2, one of stage 1 alone, one of stage 2."""
    from hybridpipe.runtime.aligned import held_state, transfers
    from tests.pipeline.harness import make_plan

    plan = make_plan(MODEL, [0, 1], [2, 1, 2], granularity="modules")
    assert [s.ranks for s in plan.stages] == [(0, 1), (2,), (3, 4)]
    every = [{"mix": (0, "m0"), "bn": (0, "b0")}, {"mix": (0, "m1"), "bn": (0, "b0")}, {"own": (1, "o2")},
             {"mix": (2, "m0"), "tail": (2, "t3")}, {"mix": (2, "m4"), "tail": (2, "t4")}]
    want = sorted((name, src, r) for name in ("bn", "mix", "own", "tail")
                  for src in [plan.stages[min(every[r][name][0] for r in range(5) if name in every[r])].ranks[0]]
                  for r in range(5) if name in every[r] and every[r][name][1] != every[src][name][1])
    assert transfers(plan, every) == want == [("mix", 0, 1), ("mix", 0, 4), ("tail", 3, 4)]
    unsharded = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, shard="none") for s in plan.stages))
    sharded = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, shard="optimizer") for s in plan.stages))
    module = RandomBuffer()
    assert list(held_state(unsharded, [(0, module)])) == ["mix"]
    assert sorted(held_state(sharded, [(2, module), (0, module)])) == sorted(["mix", *dict(module.named_parameters())])
    assert held_state(sharded, [(2, module), (0, module)])["mix"] == [(0, module.mix)]
