"""Small models with the awkward shapes stage building must handle (or refuse)."""

from __future__ import annotations

import torch
from torch import nn


class LongSkip(nn.Module):
    """The input feeds the last layer too: a skip that jumps every stage."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(width, width) for _ in range(4))
        self.head = nn.Linear(2 * width, 3)

    def forward(self, x):
        h = torch.relu(self.a(x))
        h = torch.relu(self.b(h))
        h = torch.relu(self.c(h)) + h
        return self.head(torch.cat([self.d(h), x], dim=-1))


class Reused(nn.Module):
    """One Linear applied twice (weights tied across its two uses)."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.shared = nn.Linear(width, width)
        self.mid = nn.Linear(width, width)

    def forward(self, x):
        return self.shared(self.mid(self.shared(x)))


class SizeAcross(nn.Module):
    """Reads the batch size early and uses it late: an int crosses a cut."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        n = x.size(0)
        return self.b(self.a(x)).reshape(n, -1)


class BareParam(nn.Module):
    """A bare parameter read in the last stage while defined at the front (a get_attr node)."""

    def __init__(self, width: int = 8):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, width))
        self.a, self.b = nn.Linear(width, width), nn.Linear(width, 3)

    def forward(self, x):
        s = self.scale
        return self.b(torch.relu(self.a(x)) * s)
