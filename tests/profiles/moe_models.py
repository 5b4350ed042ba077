"""Models named by ``tests.profiles.moe_models:FACTORY`` in the tests of leaf modules (not a test
file): a mixture of experts written the eager way (data-dependent routing, ``.tolist()``, a Python
loop over the experts hit, a custom autograd Function), and a dict-input model whose nested module
calls a custom autograd Function."""

from __future__ import annotations

import torch
from torch import nn


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient scaled by ``factor`` (a backward torch.export would lose: it
    differentiates the forward, the identity)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, factor: float) -> torch.Tensor:
        ctx.factor = factor
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad * ctx.factor, None


class Experts(nn.Module):
    """Top-k routing over ``experts`` two-layer MLPs, as eager code writes it: only the experts some
    token chose run (found with ``unique().tolist()``), each on its tokens (``nonzero``); the routing
    weights' gradient is halved by a custom autograd Function."""

    def __init__(self, width: int, experts: int = 4, top_k: int = 2):
        super().__init__()
        self.top_k = top_k
        self.router = nn.Linear(width, experts, bias=False)
        self.up = nn.ModuleList(nn.Linear(width, 2 * width) for _ in range(experts))
        self.down = nn.ModuleList(nn.Linear(2 * width, width) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.softmax(self.router(flat), dim=-1).topk(self.top_k, dim=-1)
        weights = _ScaleGrad.apply(weights / weights.sum(dim=-1, keepdim=True), 0.5)
        out = torch.zeros_like(flat)
        for e in chosen.unique().tolist():
            tokens, slot = (chosen == e).nonzero(as_tuple=True)
            h = self.down[e](torch.nn.functional.gelu(self.up[e](flat[tokens])))
            out = out.index_add(0, tokens, h * weights[tokens, slot, None])
        return out.reshape(x.shape)


class MoEBlock(nn.Module):
    def __init__(self, width: int, experts: int, top_k: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.experts = Experts(width, experts, top_k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.experts(self.norm(x))


class TinyMoE(nn.Module):
    """Features -> width, ``layers`` residual mixture-of-experts blocks, -> classes."""

    def __init__(self, features: int = 12, width: int = 16, layers: int = 2, experts: int = 4, top_k: int = 2,
                 classes: int = 5):
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.blocks = nn.ModuleList(MoEBlock(width, experts, top_k) for _ in range(layers))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def moe(width: int = 16, layers: int = 2, experts: int = 4, top_k: int = 2):
    """The mixture of experts above: (module, example input); cross-entropy over 5 classes."""
    return TinyMoE(12, width, layers, experts, top_k), torch.randn(4, 12, generator=torch.Generator().manual_seed(0))


class GradScale(nn.Module):
    """Calls a custom autograd Function (nothing else here would stop torch.export)."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ScaleGrad.apply(x, self.factor)


class ScaledLayer(nn.Module):
    def __init__(self, width: int, factor: float):
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.scale = GradScale(factor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.scale(self.linear(x)))


class ScaledClassifier(nn.Module):
    """Takes ``x`` and ``labels`` by name and returns ``{"loss", "logits"}`` (as Hugging Face models do);
    the second layer's input gradient is scaled by ``factor`` inside ``layers.1.scale``."""

    def __init__(self, features: int = 8, width: int = 16, classes: int = 3, factor: float = -0.5):
        super().__init__()
        self.layers = nn.ModuleList([ScaledLayer(width, 1.0) if i == 0 else ScaledLayer(width, factor)
                                     for i in range(2)])
        self.inp, self.head = nn.Linear(features, width), nn.Linear(width, classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        h = self.inp(x)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h)
        return {"loss": nn.functional.cross_entropy(logits, labels), "logits": logits}


def scaled(factor: float = -0.5):
    """The dict-input model above: (module, example input)."""
    g = torch.Generator().manual_seed(0)
    return ScaledClassifier(factor=factor), {"x": torch.randn(4, 8, generator=g),
                                             "labels": torch.randint(0, 3, (4,), generator=g)}
