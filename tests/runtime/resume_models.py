"""Models of tests/runtime/test_sharded_resume.py, named ``tests.runtime.resume_models:FACTORY`` (not a test file)."""

from __future__ import annotations

import torch
from torch import nn


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
