"""Residual networks: ResNet-50 (He et al., bottleneck blocks 3/4/6/3, 25,557,032 parameters with
1000 classes) and a small CIFAR-style ResNet (basic blocks, 16/32/64 channels) for quick runs.

``norm="none"`` builds the networks without BatchNorm (convolutions get biases instead): with
BatchNorm, statistics are taken per micro-batch, so a pipelined run matches single-process
training that accumulates gradients micro-batch by micro-batch (running statistics included,
replicas or not: pipeline/batch_stats.py), not one pass over the concatenated global batch.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridpipe.errors import UserError
from hybridpipe.profiles.zoo.spec import ModelSpec

NORMS = ("batch", "none")


def conv_norm(cin: int, cout: int, kernel: int, stride: int = 1, norm: str = "batch") -> nn.Sequential:
    """A convolution ("same" padding) followed by BatchNorm, or a biased convolution when norm="none"."""
    conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=kernel // 2, bias=norm == "none")
    return nn.Sequential(conv, nn.BatchNorm2d(cout)) if norm == "batch" else nn.Sequential(conv)


class Bottleneck(nn.Module):
    """1x1 reduce, 3x3 (strided), 1x1 expand (x4); the skip is projected when the shape changes."""

    expansion = 4

    def __init__(self, cin: int, width: int, stride: int = 1, norm: str = "batch"):
        super().__init__()
        cout = width * self.expansion
        self.conv1 = conv_norm(cin, width, 1, norm=norm)
        self.relu1 = nn.ReLU()
        self.conv2 = conv_norm(width, width, 3, stride, norm=norm)
        self.relu2 = nn.ReLU()
        self.conv3 = conv_norm(width, cout, 1, norm=norm)
        self.shortcut = conv_norm(cin, cout, 1, stride, norm=norm) if stride != 1 or cin != cout else None
        self.relu3 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.shortcut is None else self.shortcut(x)
        out = self.relu1(self.conv1(x))
        out = self.relu2(self.conv2(out))
        return self.relu3(self.conv3(out) + identity)


class BasicBlock(nn.Module):
    """Two 3x3 convolutions with a skip connection (projected when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int = 1, norm: str = "batch"):
        super().__init__()
        self.conv1 = conv_norm(cin, cout, 3, stride, norm=norm)
        self.relu1 = nn.ReLU()
        self.conv2 = conv_norm(cout, cout, 3, norm=norm)
        self.shortcut = conv_norm(cin, cout, 1, stride, norm=norm) if stride != 1 or cin != cout else None
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.shortcut is None else self.shortcut(x)
        out = self.relu1(self.conv1(x))
        return self.relu2(self.conv2(out) + identity)


class ResNet50(nn.Module):
    def __init__(self, classes: int = 1000, norm: str = "batch"):
        super().__init__()
        self.stem = conv_norm(3, 64, 7, stride=2, norm=norm)
        self.relu = nn.ReLU()
        self.pool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        blocks: list[nn.Module] = []
        cin = 64
        for i, (width, count) in enumerate(zip((64, 128, 256, 512), (3, 4, 6, 3), strict=True)):
            for j in range(count):
                blocks.append(Bottleneck(cin, width, stride=2 if j == 0 and i > 0 else 1, norm=norm))
                cin = width * Bottleneck.expansion
        self.blocks = nn.Sequential(*blocks)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(self.relu(self.stem(x)))
        return self.fc(self.flatten(self.avgpool(self.blocks(x))))


class ResNetSmall(nn.Module):
    """CIFAR ResNet (He et al. section 4.2) with ``blocks`` basic blocks per stage: depth 6*blocks+2."""

    def __init__(self, blocks: int = 1, classes: int = 10, norm: str = "batch"):
        super().__init__()
        self.stem = conv_norm(3, 16, 3, norm=norm)
        self.relu = nn.ReLU()
        layers: list[nn.Module] = []
        cin = 16
        for i, cout in enumerate((16, 32, 64)):
            for j in range(blocks):
                layers.append(BasicBlock(cin, cout, stride=2 if j == 0 and i > 0 else 1, norm=norm))
                cin = cout
        self.blocks = nn.Sequential(*layers)
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.fc = nn.Linear(cin, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.stem(x))
        return self.fc(self.flatten(self.avgpool(self.blocks(x))))


def _check_norm(norm: str) -> None:
    if norm not in NORMS:
        raise UserError(f"norm={norm!r} is not one of {', '.join(NORMS)}")


def resnet50_spec(spec: str, classes: int = 1000, image: int = 224, norm: str = "batch") -> ModelSpec:
    """``resnet50[classes=1000,image=224,norm=batch]``."""
    _check_norm(norm)
    return ModelSpec(name=spec, build=lambda: ResNet50(classes, norm), sample_shape=(3, image, image),
                     input_dtype=torch.float32, loss=nn.functional.cross_entropy, num_classes=classes)


def resnet_small_spec(spec: str, blocks: int = 1, classes: int = 10, norm: str = "batch") -> ModelSpec:
    """``resnet-small[blocks=1,classes=10,norm=batch|none]``: a CIFAR ResNet-(6*blocks+2) on 3x32x32."""
    _check_norm(norm)
    if blocks < 1:
        raise UserError(f"resnet-small needs blocks >= 1, got {blocks}")
    return ModelSpec(name=spec, build=lambda: ResNetSmall(blocks, classes, norm), sample_shape=(3, 32, 32),
                     input_dtype=torch.float32, loss=nn.functional.cross_entropy, num_classes=classes)
