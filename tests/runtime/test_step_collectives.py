"""A training step's own collectives on real gloo processes (torch's pipelining has none): the
non-finite loss check's verdicts and the step's mean loss reach every rank exactly, by a broadcast
from the last stage's one rank instead of an all-reduce over the world where it is unreplicated."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.distributed as dist

from hybridpipe.partitioner.plan import load_plan, save_plan
from hybridpipe.runtime.nonfinite import NonFiniteWatch
from tests.comm.spawn import spawn
from tests.pipeline.harness import make_plan

STEPS = 4


@contextlib.contextmanager
def counted(*names: str):
    """Count calls of ``torch.distributed.<name>`` (wrapped, still called)."""
    real = {n: getattr(dist, n) for n in names}
    calls = dict.fromkeys(names, 0)

    def wrap(n):
        def call(*args, **kwargs):
            calls[n] += 1
            return real[n](*args, **kwargs)
        return call

    for n in names:
        setattr(dist, n, wrap(n))
    try:
        yield calls
    finally:
        for n, f in real.items():
            setattr(dist, n, f)


def agree_steps(rank: int, world: int, source: int | None, bad: dict[int, int]) -> dict:
    """Every rank agrees STEPS times; rank r notes a NaN loss at step bad[r] (a finite one otherwise,
    where it computes losses: the source only, or the ranks in ``bad``)."""
    watch = NonFiniteWatch(torch.device("cpu"), skip=True, flushing=True, source=source)
    assert watch.decides_alone == (source == rank)
    verdicts = []
    with counted("all_reduce", "broadcast") as calls:
        for step in range(STEPS):
            if rank == source or rank in bad:
                watch.note(torch.tensor(float("nan") if bad.get(rank) == step else 1.5))
            verdicts.append(watch.agree())
        for work in watch._pending:               # the source's last broadcast
            work.wait()
    return {"verdicts": verdicts, **calls}


def test_an_unreplicated_last_stage_broadcasts_its_verdict_instead_of_an_all_reduce():
    out = spawn(agree_steps, 4, 3, {3: 2}, timeout=60)
    assert all(r["verdicts"] == [False, False, True, False] for r in out), out
    assert all(r["all_reduce"] == 0 and r["broadcast"] == STEPS for r in out), out


def test_a_replicated_last_stage_keeps_the_all_reduce():
    out = spawn(agree_steps, 4, None, {2: 1, 3: 3}, timeout=60)
    assert all(r["verdicts"] == [False, True, False, True] for r in out), out
    assert all(r["all_reduce"] == STEPS and r["broadcast"] == 0 for r in out), out


def train_counted(rank: int, world: int, plan_path: str) -> dict:
    """STEPS training steps of a Trainer; the collectives they called and the losses returned."""
    from hybridpipe import Trainer
    from tests.runtime.jobs import data_for
    from tests.runtime.trainer_ranks import _batch

    plan = load_plan(plan_path)
    trainer = Trainer(plan.model, plan, lr=0.05, seed=3, timeout=60)
    data = data_for(plan, STEPS, 3)
    try:
        with counted("all_reduce", "broadcast") as calls:
            losses = [trainer.train_step(*_batch(trainer, data, k)) for k in range(STEPS)]
    finally:
        trainer.close()
    return {"losses": losses, **calls}


@pytest.mark.slow           # ~10 s: a Trainer per rank
def test_a_pipeline_step_hands_out_its_loss_and_verdict_by_broadcast(tmp_path):
    plan = make_plan("mlp", [3], [1, 1], schedule="1f1b", micro_batches=2, batch_size=2)
    path = str(save_plan(plan, tmp_path / "plan.json"))
    out = spawn(train_counted, 2, path, timeout=120)
    assert out[0]["losses"] == out[1]["losses"] and all(0 < v < 100 for v in out[0]["losses"]), out
    # one broadcast for the non-finite check and one for the mean loss per step; no all-reduce
    assert all(r["all_reduce"] == 0 and r["broadcast"] == 2 * STEPS for r in out), out
