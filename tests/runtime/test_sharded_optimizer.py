"""ShardedOptimizer without processes: an optimizer whose state cannot be split is one line
(UserError: exit 2 at the CLI); unbound, it is the optimizer it wraps, parameter groups included."""

from __future__ import annotations

import pytest
import torch

from hybridpipe.errors import UserError
from hybridpipe.runtime.sharded_optimizer import ShardedOptimizer


class Custom(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})


@pytest.mark.parametrize("make", [lambda ps: torch.optim.RMSprop(ps), lambda ps: Custom(ps)])
def test_an_optimizer_whose_state_cannot_be_split_is_one_line(make):
    model = torch.nn.Linear(3, 2)
    with pytest.raises(UserError) as e:
        ShardedOptimizer(model.parameters(), make)
    assert "\n" not in str(e.value) and "cannot be split" in str(e.value)


def test_unbound_it_steps_like_the_optimizer_it_wraps():
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    plain = torch.optim.AdamW(a.parameters(), lr=0.01)
    wrapped = ShardedOptimizer(b.parameters(), lambda ps: torch.optim.AdamW(ps, lr=0.01))
    for _ in range(3):
        x = torch.randn(4, 3)
        for m, opt in ((a, plain), (b, wrapped)):
            opt.zero_grad()
            m(x).square().sum().backward()
            opt.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    assert wrapped.state_dict()["state"].keys() == plain.state_dict()["state"].keys()


def test_parameter_groups_are_kept_unbound_as_torch_keeps_them():
    """Two groups (decayed matrices, undecayed vectors) at their own learning rates, moved by a
    scheduler as the outer groups: the same steps and torch's own state_dict layout."""
    def grouped(ps):
        return torch.optim.AdamW([{"params": [p for p in ps if p.ndim > 1], "weight_decay": 0.1},
                                  {"params": [p for p in ps if p.ndim < 2], "weight_decay": 0.0, "lr": 0.02}], lr=0.01)
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 2), torch.nn.Linear(3, 2)
    b.load_state_dict(a.state_dict())
    plain, wrapped = grouped(list(a.parameters())), ShardedOptimizer(b.parameters(), grouped)
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in (plain, wrapped)]
    for _ in range(3):
        x = torch.randn(4, 3)
        for m, opt, sched in ((a, plain, scheds[0]), (b, wrapped, scheds[1])):
            opt.zero_grad()
            m(x).square().sum().backward()
            opt.step()
            sched.step()
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    ours, theirs = wrapped.state_dict(), plain.state_dict()
    assert [g["params"] for g in ours["param_groups"]] == [g["params"] for g in theirs["param_groups"]] == [[0], [1]]
    assert [g["lr"] for g in ours["param_groups"]] == [g["lr"] for g in theirs["param_groups"]]
