"""Models and datasets named by ``tests.profiles.user_models:FACTORY`` in the tests (not a test file)."""

from __future__ import annotations

import time

import torch
from torch import nn
from torch.utils.data import Dataset


class Gate(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace it."""

    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return self.linear(x)
        return -self.linear(x)


class Gated(nn.Module):
    def __init__(self, width: int = 8, classes: int = 3):
        super().__init__()
        self.inp = nn.Linear(width, width)
        self.gate = Gate(width)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.gate(torch.relu(self.inp(x))))


def tiny(hidden: int = 16, classes: int = 5):
    """A user's factory returning (module, example input, loss)."""
    model = nn.Sequential(nn.Linear(12, hidden), nn.Tanh(), nn.Linear(hidden, classes))
    return model, torch.randn(4, 12), nn.functional.cross_entropy


def gated(width: int = 8):
    """A model with an untraceable submodule (Gate) inside a traceable one."""
    return Gated(width), torch.randn(2, width)


def gated_sequential(width: int = 8):
    """An nn.Sequential whose children cannot be traced: profiled child by child."""
    return nn.Sequential(nn.Linear(width, width), Gate(width), Gate(width), nn.Linear(width, 3)), torch.randn(2, width)


def module_only():
    return nn.Linear(3, 3)


class _Sleep(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward_s: float, backward_s: float):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x * 1.0

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad * 1.0, None, None


class Sleepy(nn.Module):
    """Identity whose forward and backward take at least the given seconds (a deliberately slow layer)."""

    def __init__(self, forward_s: float = 0.0, backward_s: float = 0.0):
        super().__init__()
        self.forward_s, self.backward_s = forward_s, backward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(x, self.forward_s, self.backward_s)


def slow_backward():
    """Linear layers with one Sleepy layer whose backward (not forward) is slow."""
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), Sleepy(0.0, 0.03),
                          nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    return model, torch.randn(4, 8)


def slow_forward():
    model = nn.Sequential(nn.Linear(8, 8), Sleepy(0.03, 0.0), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3))
    return model, torch.randn(4, 8)


class Pairs(Dataset):
    """A user's map-style dataset of (input, target) pairs."""

    def __init__(self, n: int = 10, features: int = 12):
        self.x = torch.randn(n, features, generator=torch.Generator().manual_seed(1))
        self.y = torch.arange(n) % 5

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def pairs(n: int = 10, features: int = 12) -> Pairs:
    return Pairs(n, features)


def not_a_dataset():
    return 42


# ---- a user's code that goes wrong (tests/test_bad_inputs.py) ------------------------------------
def raising(width: int = 4):
    """A model factory that raises (the line below is named in the error)."""
    raise RuntimeError(f"cannot build a model of width {width}")


def misfit():
    """A model whose example input does not fit its first layer."""
    return nn.Sequential(nn.Linear(8, 3)), torch.randn(2, 5)


def raising_dataset():
    raise ValueError("the data directory is empty")


class NaNAfter(Dataset):
    """Samples of the zoo ``mlp``'s shape (64 features, 10 classes) whose inputs are NaN for
    indices in ``[start, stop)`` (a corrupt stretch of a data set)."""

    def __init__(self, n: int, start: int, stop: int):
        g = torch.Generator().manual_seed(5)
        self.x = torch.randn(n, 64, generator=g)
        self.x[start:stop] = float("nan")
        self.y = torch.randint(0, 10, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], self.y[i]


def nan_after(n: int = 64, start: int = 16, stop: int = 24) -> NaNAfter:
    return NaNAfter(n, start, stop)
