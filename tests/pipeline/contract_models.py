"""Models named by ``tests.pipeline.contract_models:FACTORY`` in the plan-contract tests (not a test file)."""

from __future__ import annotations

import torch
from torch import nn


class ReadsShapeEarly(nn.Module):
    """A chain of layers that reads a size (or the whole shape) at layer ``take`` and uses it at
    layer ``use`` > take, so the value crosses every cut in between (as GPT-2's Conv1D does)."""

    def __init__(self, depth: int, take: int, use: int, kind: str, width: int = 8, classes: int = 3):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, classes)
        self.take, self.use, self.kind = take, use, kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        saved = None
        h = x
        for i, layer in enumerate(self.layers):
            if i == self.take:
                saved = h.size(0) if self.kind == "size" else tuple(h.shape)
            h = torch.relu(layer(h))
            if i == self.use:
                h = h.reshape(saved, -1) if self.kind == "size" else h.view(saved) * 1.5
        return self.head(h)


def reads_shape_early(depth: int = 6, take: int = 1, use: int = 4, kind: str = "size", batch: int = 4):
    """(module, example input): see ReadsShapeEarly."""
    return ReadsShapeEarly(depth, take, use, kind), torch.randn(batch, 8)
