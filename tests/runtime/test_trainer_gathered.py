"""Reading a Trainer's weights between steps on 2 real rank processes (gloo), one stage of 2 sharded
replicas, against a plain PyTorch loop written here.

Under ZeRO-3 the weights are freed between steps: ``trainer.module`` is refused in one line naming
``trainer.gathered()`` (it read freed memory before: a segfault); inside ``with trainer.gathered()``
every rank sees the plain loop's weights after each step, and what it writes there (every weight
halved after step 1) is what the next steps train on. Under ZeRO-1 ``trainer.module`` is readable
and whole after each step (its gathers on their way waited for).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from hybridpipe import Trainer
from hybridpipe.errors import UserError
from hybridpipe.partitioner.plan import load_plan, save_plan
from hybridpipe.profiles.zoo import resolve_model
from tests.pipeline.harness import make_plan, model_loss
from tests.runtime.jobs import data_for
from tests.runtime.rank_procs import Job

SEED, LR, STEPS, HALVED_AFTER = 3, 0.05, 3, 1


def _halve(module: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in module.parameters():
            p.mul_(0.5)


def reads(rank: int, world: int, plan_path: str) -> dict:
    """Rank program: STEPS steps, the weights read after each (halved after step HALVED_AFTER)."""
    plan = load_plan(plan_path)
    trainer = Trainer(plan.model, plan, optimizer=lambda ps: torch.optim.SGD(ps, lr=LR), seed=SEED, timeout=60)
    data = data_for(plan, STEPS, SEED)
    out: dict = {"refused": None, "direct": [], "gathered": []}
    for k in range(STEPS):
        trainer.train_step(*data.global_batch(k))
        try:
            module = trainer.module
            out["sum"] = float(sum(p.sum() for p in module.parameters()))
            out["direct"].append({n: t.tolist() for n, t in module.state_dict().items()})
        except UserError as e:
            out["refused"] = str(e)
        with trainer.gathered() as module:
            out["gathered"].append({n: t.tolist() for n, t in module.state_dict().items()})
            if k + 1 == HALVED_AFTER:
                _halve(module)
    trainer.close()
    return out


def reference(plan) -> list[dict[str, torch.Tensor]]:
    """The unsplit model trained in one process as the ranks are: its state_dict after each step."""
    spec = resolve_model(plan.model)
    torch.manual_seed(SEED)
    model = spec.build()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    data = data_for(plan, STEPS, SEED)
    after = []
    for k in range(STEPS):
        opt.zero_grad()
        model_loss(spec, model, *data.global_batch(k)).backward()
        opt.step()
        after.append({n: t.detach().clone() for n, t in model.state_dict().items()})
        if k + 1 == HALVED_AFTER:
            _halve(model)
    return after


def _close(got: dict, want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert torch.allclose(torch.tensor(got[name], dtype=t.dtype), t, atol=1e-5, rtol=0), name


@pytest.mark.slow
@pytest.mark.parametrize("level", ["parameters", "optimizer"])
def test_weights_read_between_steps_are_the_plain_loops_or_refused_in_one_line(tmp_path: Path, level: str):
    base = make_plan("mlp", [], [2])
    plan = dataclasses.replace(base, stages=tuple(dataclasses.replace(s, shard=level) for s in base.stages))
    path = save_plan(plan, tmp_path / "plan.json")
    with Job(Path(__file__), "reads", 2, (str(path),)) as job:
        results = job.wait(timeout=180)
    assert all(r.returncode == 0 for r in results), results      # a read of freed memory: -11
    want = reference(plan)
    for r in results:
        got = r.value
        for k in range(STEPS):
            _close(got["gathered"][k], want[k])
        if level == "parameters":
            assert got["direct"] == [] and "\n" not in got["refused"] and "trainer.gathered()" in got["refused"]
        else:
            assert got["refused"] is None
            for k in range(STEPS):
                _close(got["direct"][k], want[k])
