"""profiles/gradflow.py against autograd itself: every value the dataflow leaves unmarked does not
require grad in a real forward; an in-place write of grad-carrying data gives up (None)."""

from __future__ import annotations

import torch
from torch import fx, nn

from hybridpipe.profiles.gradflow import grad_values


class Rotary(nn.Module):
    """Values from a buffer and the input's shape (cos/sin), a weight's output, and their product."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("freq", torch.arange(4.0))

    def forward(self, x):
        pos = torch.arange(x.shape[0], dtype=x.dtype)
        angles = pos[:, None] * self.freq[None, :]
        cos = angles.cos()
        h = self.lin(x)
        return h * cos, cos


class Overwrite(nn.Module):
    """A zero buffer-like tensor filled in place with a weight's output: it carries a gradient."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        z = torch.zeros_like(x)
        z.narrow(1, 0, 1).copy_(self.lin(x).narrow(1, 0, 1))
        return z * 2


def _requires_grad(gm: fx.GraphModule, x: torch.Tensor) -> dict[str, bool]:
    """Every node's value's requires_grad in a real forward (fx's Interpreter)."""
    seen: dict[str, bool] = {}

    class Record(fx.Interpreter):
        def run_node(self, n):
            out = super().run_node(n)
            if isinstance(out, torch.Tensor):
                seen[n.name] = out.requires_grad
            return out
    Record(gm).run(x)
    return seen


def test_unmarked_values_do_not_require_grad():
    gm = fx.symbolic_trace(Rotary())
    marked = grad_values(gm)
    assert marked is not None
    real = _requires_grad(gm, torch.randn(3, 4))
    assert {name for name, rg in real.items() if rg} <= marked        # never misses a gradient
    assert not marked & {"arange", "_tensor_constant0", "mul", "cos"}   # the buffer-only values need none
    assert "lin" in marked and "mul_1" in marked


def test_an_in_place_write_of_a_gradient_gives_up():
    gm = fx.symbolic_trace(Overwrite())
    assert grad_values(gm) is None
    real = _requires_grad(gm, torch.randn(3, 4))
    assert real["mul"] and not real["zeros_like"]     # z * 2 needs grad though z was made without: no dataflow sees it
