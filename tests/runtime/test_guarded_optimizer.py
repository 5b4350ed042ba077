"""The loss watch's optimizer wrapper (runtime/nonfinite.py): its ``zero_grad`` does what torch's
does with ``set_to_none`` (every parameter's gradient dropped) without dispatching anything, and
leaves any other zeroing to the wrapped optimizer."""

from __future__ import annotations

import torch

from hybridpipe.runtime.nonfinite import GuardedOptimizer, NonFiniteWatch
from tests.pipeline.test_loss_seed import Ops


def with_grads() -> list[torch.nn.Parameter]:
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2)),
              torch.nn.Parameter(torch.randn(4))]
    (params[0].sum() * 2 + params[1].pow(2).sum()).backward()       # params[2] gets no gradient
    return params


def guarded(optimizer) -> GuardedOptimizer:
    return NonFiniteWatch(torch.device("cpu"), skip=False, flushing=True).wrap_optimizer(optimizer)


def test_zero_grad_drops_every_gradient_as_torchs_does_and_dispatches_nothing():
    ours, theirs = with_grads(), with_grads()
    opt = guarded(torch.optim.SGD(ours, lr=0.1, momentum=0.9))
    ops = Ops()
    with ops:
        opt.zero_grad()
    torch.optim.SGD(theirs, lr=0.1, momentum=0.9).zero_grad(set_to_none=True)
    assert [p.grad for p in ours] == [p.grad for p in theirs] == [None, None, None]
    assert not ops.seen, ops.seen        # torch's own: a profiler range (2 ops) around the loop


def test_zero_grad_leaves_other_zeroing_to_the_wrapped_optimizer():
    params = with_grads()
    guarded(torch.optim.SGD(params, lr=0.1)).zero_grad(set_to_none=False)       # zeros, kept
    assert [float(p.grad.abs().sum()) for p in params[:2]] == [0.0, 0.0] and params[2].grad is None

    class Own(torch.optim.SGD):
        def zero_grad(self, set_to_none: bool = True) -> None:
            self.zeroed = set_to_none

    own = Own(with_grads(), lr=0.1)
    guarded(own).zero_grad()
    assert own.zeroed is True and own.param_groups[0]["params"][0].grad is not None
