"""ShardedOptimizer without processes: an optimizer whose state cannot be split is one line
(UserError: exit 2 at the CLI); unbound, it is the optimizer it wraps."""

from __future__ import annotations

import pytest
import torch

from hybridpipe.errors import UserError
from hybridpipe.runtime.sharded_optimizer import ShardedOptimizer


class Custom(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})


@pytest.mark.parametrize("make", [lambda ps: torch.optim.RMSprop(ps), lambda ps: Custom(ps),
                                  lambda ps: torch.optim.SGD([{"params": ps[:1]}, {"params": ps[1:]}], lr=0.1)])
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
