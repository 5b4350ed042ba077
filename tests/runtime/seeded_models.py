"""Models named by ``tests.runtime.seeded_models:FACTORY`` in test_seeded_build.py (not a test file):
initialisations a rank must replay a stage at a time, and two it cannot."""

from __future__ import annotations

import torch
from torch import nn


class Layer(nn.Module):
    """A layer initialised its own way: a parameter drawn before it is registered, orthogonal and
    truncated-normal weights, a random buffer."""

    def __init__(self, width: int):
        super().__init__()
        self.scale = nn.Parameter(torch.randn(width) * 0.1 + 1)
        self.linear = nn.Linear(width, width)
        nn.init.orthogonal_(self.linear.weight)
        nn.init.trunc_normal_(self.linear.bias, std=0.02)
        self.register_buffer("shift", torch.randn(width) * 0.01)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x) * self.scale + self.shift)


class Stack(nn.Module):
    def __init__(self, width: int, layers: int, classes: int):
        super().__init__()
        self.layers = nn.Sequential(*(Layer(width) for _ in range(layers)))
        self.head = nn.Linear(width, classes)
        nn.init.xavier_uniform_(self.head.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(x))


def initialised(width: int = 8, layers: int = 4, classes: int = 3):
    """The model, then its example input drawn from the same random stream (as one process draws it)."""
    model = Stack(width, layers, classes)
    return model, torch.randn(4, width)


def copying(width: int = 8, layers: int = 4, classes: int = 3):
    """The first layer's weights copied into the last: the last cannot be built without the first."""
    model = Stack(width, layers, classes)
    with torch.no_grad():
        model.layers[-1].linear.weight.copy_(model.layers[0].linear.weight)
    return model, torch.randn(4, width)


def device_dependent(width: int = 8, layers: int = 4, classes: int = 3):
    """An initialisation that draws more for parameters on the meta device: it replays without an
    error, and other values."""
    model = Stack(width, layers, classes)
    for layer in model.layers:
        if layer.linear.weight.is_meta:
            torch.randn(3)
        nn.init.normal_(layer.linear.weight, std=0.1)
    return model, torch.randn(4, width)


def reading(width: int = 8, layers: int = 4, classes: int = 3):
    """A constructor that reads a parameter's value: it cannot be built on the meta device at all."""
    model = Stack(width, layers, classes)
    with torch.no_grad():
        model.head.bias.fill_(float(model.head.weight.sum()))
    return model, torch.randn(4, width)
