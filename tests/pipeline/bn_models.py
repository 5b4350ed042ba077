"""Models with buffers that training changes, named ``tests.pipeline.bn_models:FACTORY`` (not a test file)."""

from __future__ import annotations

import torch
from torch import nn


class BNMLP(nn.Sequential):
    """Linear -> BatchNorm1d -> ReLU blocks and a classifier head."""

    def __init__(self, features: int = 12, hidden: int = 16, layers: int = 3, classes: int = 5,
                 momentum: float | None = 0.1):
        blocks: list[nn.Module] = []
        width = features
        for _ in range(layers):
            blocks += [nn.Linear(width, hidden), nn.BatchNorm1d(hidden, momentum=momentum), nn.ReLU()]
            width = hidden
        blocks.append(nn.Linear(width, classes))
        super().__init__(*blocks)


def bn_mlp(features: int = 12, momentum: float = 0.1):
    """A BatchNorm MLP (captured by torch.export: ``aten.batch_norm`` and ``num_batches_tracked.add_``)."""
    return BNMLP(features, momentum=momentum), torch.randn(4, features)


def bn_mlp_cumulative(features: int = 12):
    """BatchNorm with ``momentum=None`` (a cumulative average): torch.export cannot capture its
    ``1 / num_batches_tracked``, so torch.fx does and the BatchNorm modules are called as they are."""
    return BNMLP(features, momentum=None), torch.randn(4, features)


class Counted(nn.Module):
    """An MLP that counts its forwards in a buffer nothing reads (a counter, like num_batches_tracked)."""

    def __init__(self, features: int = 12):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(features, 16), nn.Linear(16, 16), nn.Linear(16, 5)
        self.register_buffer("seen", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        h = torch.relu(self.a(x))
        self.seen.add_(1)
        return self.c(torch.relu(self.b(h)))


def counted(features: int = 12):
    return Counted(features), torch.randn(4, features)


class Smoothed(nn.Module):
    """Keeps an exponential moving average of its hidden activations' mean in a buffer (a write
    hybridpipe cannot combine across replicas), and a constant buffer it only reads."""

    def __init__(self, features: int = 12):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(features, 16), nn.Linear(16, 16), nn.Linear(16, 5)
        self.register_buffer("ema", torch.zeros(16))
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 16), persistent=False)

    def forward(self, x):
        h = torch.relu(self.a(x)) * self.scale
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * h.mean(0))
        return self.c(torch.relu(self.b(h)))


def smoothed(features: int = 12):
    return Smoothed(features), torch.randn(4, features)


class Tally(nn.Module):
    """Counts, inside a module torch.export cannot capture (data-dependent branch), how often the
    input's sum was positive: a buffer change only the forward itself shows (``--leaf Tally``)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("positive", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        if x.sum() > 0:
            self.positive.add_(1)
        return x


class Tallied(nn.Module):
    def __init__(self, features: int = 12):
        super().__init__()
        self.a, self.tally, self.b, self.c = nn.Linear(features, 16), Tally(), nn.Linear(16, 16), nn.Linear(16, 5)

    def forward(self, x):
        return self.c(torch.relu(self.b(self.tally(torch.relu(self.a(x))))))


def tallied(features: int = 12):
    return Tallied(features), torch.randn(4, features)


class SharedNorm(nn.Module):
    """One BatchNorm applied at the front and at the back (its statistics updated twice per forward)."""

    def __init__(self, features: int = 12):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(features, 16), nn.Linear(16, 16), nn.Linear(16, 5)
        self.norm = nn.BatchNorm1d(16)

    def forward(self, x):
        h = torch.relu(self.norm(self.a(x)))
        return self.c(torch.relu(self.norm(self.b(h))))


def shared_norm(features: int = 12):
    return SharedNorm(features), torch.randn(4, features)


def hf_resnet(labels: int = 5):
    """A tiny Hugging Face ResNet (BatchNorm after every convolution), computing its own loss from ``labels``."""
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=labels)
    example = {"pixel_values": torch.randn(4, 3, 32, 32), "labels": torch.arange(4) % labels}
    return ResNetForImageClassification(config), example
