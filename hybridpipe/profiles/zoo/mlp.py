"""A small multi-layer perceptron: the quickest model to pipeline and check."""

from __future__ import annotations

import torch
from torch import nn

from hybridpipe.profiles.zoo.spec import ModelSpec


class MLP(nn.Sequential):
    """``layers`` Linear+ReLU blocks of width ``hidden`` and a classifier head."""

    def __init__(self, features: int = 64, hidden: int = 128, layers: int = 4, classes: int = 10):
        blocks: list[nn.Module] = []
        width = features
        for _ in range(layers):
            blocks += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        blocks.append(nn.Linear(width, classes))
        super().__init__(*blocks)


def mlp_spec(spec: str, features: int = 64, hidden: int = 128, layers: int = 4, classes: int = 10) -> ModelSpec:
    """``mlp[features=64,hidden=128,layers=4,classes=10]``: input (features,) floats."""
    return ModelSpec(name=spec, build=lambda: MLP(features, hidden, layers, classes),
                     sample_shape=(features,), input_dtype=torch.float32,
                     loss=nn.functional.cross_entropy, num_classes=classes)
