"""runtime/lr.py (launch's schedules) and runtime/batches.py (what train_step is given): pure."""

from __future__ import annotations

import math

import pytest
import torch

from hybridpipe.errors import UserError
from hybridpipe.pipeline.data import concat
from hybridpipe.runtime.batches import GivenBatches, is_micro_batch_stream, split_batch, take_micro_batches
from hybridpipe.runtime.lr import fresh_hyperparameters, lr_factor, lr_schedule, replay_scheduler


def test_lr_factors_warm_up_linearly_then_follow_the_schedule():
    assert [lr_factor("constant", k, warmup=4, total=10) for k in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert [lr_factor("linear", k, warmup=2, total=6) for k in range(2, 7)] == [1.0, 0.75, 0.5, 0.25, 0.0]
    cos = [lr_factor("cosine", k, warmup=0, total=4) for k in range(5)]
    assert cos == pytest.approx([1.0, 0.5 + 0.5 * math.cos(math.pi / 4), 0.5, 0.5 - 0.5 * math.cos(math.pi / 4), 0.0])
    with pytest.raises(ValueError):
        lr_factor("step", 0, warmup=0, total=1)


def test_lr_schedule_is_a_torch_scheduler_stepped_once_per_step():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=0.1)
    sched = lr_schedule("cosine", warmup=2, total=6)(opt)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([0.1 * lr_factor("cosine", k, warmup=2, total=6) for k in range(6)])


def test_split_batch_cuts_the_global_batch_into_micro_batches_in_order():
    x = {"ids": torch.arange(12).reshape(6, 2), "flag": True, "mask": torch.ones(6, 2)}
    parts = split_batch(x, 3, 2)
    assert [p["ids"][:, 0].tolist() for p in parts] == [[0, 2], [4, 6], [8, 10]]
    assert all(p["flag"] is True for p in parts)
    assert torch.equal(concat(parts)["ids"], x["ids"])
    with pytest.raises(UserError, match="has 6 rows, but a step of the plan takes 2 micro-batches of 2 = 4 rows"):
        split_batch(x, 2, 2)


def test_iterators_of_micro_batches_are_taken_as_such():
    assert is_micro_batch_stream(iter([1])) and not is_micro_batch_stream(torch.zeros(2))
    assert not is_micro_batch_stream((torch.zeros(2), torch.zeros(2)))
    xs, ys = take_micro_batches(iter([(1, "a"), (2, "b"), (3, "c")]), 2, targets=True)
    assert (xs, ys) == ([1, 2], ["a", "b"])
    with pytest.raises(UserError, match="ended after 1 of the step's 2"):
        take_micro_batches(iter([1]), 2, targets=False)


def test_given_batches_serve_recent_steps_and_say_which_rank_lacks_what():
    given = GivenBatches(keep=2, rank=3)
    given.put(0, ["x0"], ["y0"])
    given.put(1, ["x1"], None)
    assert given.input(0, 0) == "x0" and given.target(0, 0) == "y0"
    given.put(2, ["x2"], ["y2"])
    with pytest.raises(UserError, match="rank 3 runs the first stage"):
        given.input(0, 0)                                   # forgotten
    with pytest.raises(UserError, match="pass target= on this rank too"):
        given.target(1, 0)
    assert GivenBatches(targets=False).target(0, 0) is None


def test_the_loss_scale_backs_off_on_overflow_and_grows_after_good_steps():
    from hybridpipe.runtime.scaler import LossScaler

    s = LossScaler(8.0, growth_interval=2)
    for found in (True, False, False, False, True):
        s.update(found)
    assert (s.scale, s.good_steps, s.skipped) == (4.0, 0, 2)      # 8 -> 4 -> (2 good) 8 -> (1 good) -> 4
    t = LossScaler()
    t.load_state_dict(s.state_dict())
    assert t.state_dict() == s.state_dict()


@pytest.mark.parametrize("kind", ["one-cycle", "warm-cosine", "cosine-annealing", "launch-cosine"])
def test_a_replayed_scheduler_is_where_the_uninterrupted_one_is(kind):
    """A checkpoint resumed under another plan (an elastic restart's re-plan) gets a scheduler replayed
    to its step from the factory, whatever its optimizer's groups went through since (CosineAnnealingLR
    computes from the groups' current lr, OneCycleLR moves the betas); before, the resharded resume
    kept a fresh scheduler and warmed up again (OneCycleLR's lr 8e-8 for 0.02 two steps later)."""
    def make(opt):
        if kind == "one-cycle":
            return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.02, 0.01], total_steps=8)
        if kind == "warm-cosine":
            warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2)
            cos = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=6)
            return torch.optim.lr_scheduler.SequentialLR(opt, [warm, cos], milestones=[2])
        if kind == "cosine-annealing":
            return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=8)
        return lr_schedule("cosine", warmup=2, total=8)(opt)

    def optimizer():
        a, b = torch.nn.Parameter(torch.zeros(2, 2)), torch.nn.Parameter(torch.zeros(2))
        return torch.optim.AdamW([{"params": [a]}, {"params": [b], "weight_decay": 0.0}], lr=0.01)
    whole = optimizer()
    sched = make(whole)
    other = optimizer()
    fresh = fresh_hyperparameters(other)
    stale = make(other)
    for k in range(5):
        if k < 3:
            whole.step()
            sched.step()
        other.step()
        stale.step()                               # the resumed rank's own scheduler: somewhere else
    for g in other.param_groups:
        g["lr"] = 123.0                            # whatever the checkpoint put there
    replayed = replay_scheduler(make, other, fresh, 3)
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in whole.param_groups]
    assert [{k: v for k, v in g.items() if k != "params"} for g in other.param_groups] == hyper
    for _ in range(3):
        sched.step()
        replayed.step()
        assert replayed.get_last_lr() == sched.get_last_lr()
    with pytest.raises(UserError, match="ReduceLROnPlateau follows a metric"):
        replay_scheduler(lambda o: torch.optim.lr_scheduler.ReduceLROnPlateau(o), other, fresh, 2)
