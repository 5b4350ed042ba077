"""A stage under autocast computes what the unsplit model under autocast computes, bit for bit, when
a value it receives is used by several 16-bit operations (a residual stream read by q, k and v)."""

from __future__ import annotations

import torch
from torch import nn

from hybridpipe.pipeline.stage import build_stage_index
from hybridpipe.profiles.capture import capture_model

BF16 = torch.bfloat16


class Residual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc, self.gain = nn.Linear(width, width), nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gain * x + self.fc(x)     # a float32 residual stream under autocast (gain: float32 grads)


class TwoUses(nn.Module):
    """A float32 value, cut after it, read by two linear layers."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.block, self.fc1, self.fc2 = Residual(width), nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return (self.fc1(y).float() * self.fc2(y).float()).mean()


def test_a_received_value_read_twice_gets_its_gradients_summed_as_the_unsplit_model_sums_them():
    """Autocast caches the 16-bit copy of a leaf that requires grad (meant for weights): fed as the
    leaf it receives, the second stage would cast y once and sum fc1's and fc2's gradients of it in
    bfloat16; the unsplit model casts y (no leaf) once per use and sums them in float32."""
    torch.manual_seed(0)
    model = TwoUses()
    x = torch.randn(32, 16)
    with torch.autocast("cpu", dtype=BF16):
        loss = model(x)
    loss.backward()
    eager = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()

    captured = capture_model(model, x, autocast=BF16)
    names = [b.name for b in captured.blocks]
    cut = names.index("block")                                    # stage 1 receives y
    first, second = (build_stage_index(captured, [(0, cut), (cut + 1, len(names) - 1)], i) for i in (0, 1))
    with torch.autocast("cpu", dtype=BF16):
        a0 = first.forward(first.data_inputs(x))
        a1 = second.forward(a0.outputs)
    assert [t.dtype for t in a0.outputs.values()] == [torch.float32]    # y crosses as float32, as it is
    assert torch.equal(a1.loss.detach(), loss.detach())
    first.backward(a0, second.backward(a1))
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, eager[n]), n
