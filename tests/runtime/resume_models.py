"""Models of tests/runtime/test_sharded_resume.py, named ``tests.runtime.resume_models:FACTORY`` (not a test file)."""

from __future__ import annotations

import torch
from torch import nn

from tests.profiles import moe_models


def bn_mlp(features: int = 12, hidden: int = 16, layers: int = 3, classes: int = 5):
    """Linear (no bias) -> BatchNorm1d -> ReLU blocks and a classifier head: weights, running
    statistics and a batch counter. No bias feeds a BatchNorm: such a bias's gradient is zero up to
    rounding, which Adam's g / sqrt(v) turns into full-size steps of chance sign, so no two
    summation orders would agree on it."""
    blocks: list[nn.Module] = []
    width = features
    for _ in range(layers):
        blocks += [nn.Linear(width, hidden, bias=False), nn.BatchNorm1d(hidden), nn.ReLU()]
        width = hidden
    blocks.append(nn.Linear(width, classes))
    return nn.Sequential(*blocks), torch.randn(4, features)


class Experts(moe_models.Experts):
    """tests/profiles/moe_models.py's experts (eager: only the experts some token chose run, found with
    ``unique().tolist()``, so an expert no token chose gets no gradient), their outputs weighted by
    the softmax probabilities as they are (not renormalised over the top k), so every router row has
    a gradient of its own size (renormalised, the rows of the experts not chosen would get gradients
    that are zero up to rounding, which AdamW blows up)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, chosen = torch.softmax(self.router(x), dim=-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for e in chosen.unique().tolist():
            tokens, slot = (chosen == e).nonzero(as_tuple=True)
            h = self.down[e](torch.relu(self.up[e](x[tokens])))
            out = out.index_add(0, tokens, h * weights[tokens, slot, None])
        return out


class _MoE(nn.Module):
    def __init__(self, features: int, width: int, experts: int, top_k: int, classes: int):
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.experts = Experts(width, experts, top_k)
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        return self.head(h + self.experts(h))


def moe(experts: int = 16, top_k: int = 2, features: int = 12, width: int = 16, classes: int = 5):
    """A one-layer mixture of experts (name it with ``[leaf=Experts]``: data-dependent routing runs as
    written); (module, example input)."""
    return _MoE(features, width, experts, top_k, classes), torch.randn(4, features)
