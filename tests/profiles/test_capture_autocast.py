"""Capturing for mixed precision: a graph captured under ``torch.autocast`` and run under it computes
bit for bit what the eager model under autocast computes, forward and backward, including what the
model's Python read from a dtype. A float32 capture run under autocast stops at torch.export's dtype
checks (the bug of issue 28), and with those checks removed it runs but computes something else."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridpipe.profiles.capture import capture_model
from hybridpipe.profiles.graphinfo import graph_edges, node_infos

BF16 = torch.bfloat16


class ReadsDtype(nn.Module):
    """A softmax computed in float32 and cast back to the dtype of its input (as Hugging Face's
    attention does: ``softmax(w, dtype=torch.float32).to(query.dtype)``), added to a float32 stream."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)                                       # bfloat16 under autocast
        p = torch.softmax(h, dim=-1, dtype=torch.float32).to(h.dtype)
        return self.fc2(x + p).float().pow(2).mean()


def run(fn, model: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The loss and every parameter's gradient of one forward and backward under bf16 autocast."""
    model.zero_grad()
    with torch.autocast("cpu", dtype=BF16):
        loss = fn(x)
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters()]


def test_an_autocast_capture_computes_what_eager_autocast_computes_and_a_float32_one_does_not():
    torch.manual_seed(0)
    model = ReadsDtype()
    x = torch.randn(8, 16)
    eager_loss, eager_grads = run(model, model, x)

    ours = capture_model(model, x, autocast=BF16)
    assert ours.autocast is BF16
    loss, grads = run(lambda t: ours.graph(t)[0], model, x)
    assert torch.equal(loss, eager_loss) and all(torch.equal(a, b) for a, b in zip(grads, eager_grads, strict=True))

    float32 = capture_model(model, x)
    assert float32.autocast is None
    # the same blocks and edges as the float32 capture: a profile made in float32 plans a bf16 run
    assert node_infos(ours) == node_infos(float32) and graph_edges(ours) == graph_edges(float32)
    with pytest.raises(RuntimeError, match="dtype mismatch"):      # what --precision bf16 met on every HF model
        run(lambda t: float32.graph(t)[0], model, x)
    gm = float32.graph
    for node in [n for n in gm.graph.nodes if "_assert_tensor_metadata" in str(n.target)]:
        gm.graph.erase_node(node)
    gm.recompile()
    # without the checks it runs, but its `.to(h.dtype)` was traced as a float32 no-op: the softmax is
    # never rounded to bfloat16 as eager autocast rounds it
    loss, _ = run(lambda t: gm(t)[0], model, x)
    assert not torch.equal(loss, eager_loss)
