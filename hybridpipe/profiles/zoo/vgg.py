"""VGG16 (configuration D of Simonyan & Zisserman): 13 3x3 convolutions, 3 FC layers, 138,357,544
parameters with 1000 classes. Seed 003 trains it at batch 16 on 3x224x224 synthetic images."""

from __future__ import annotations

import torch
from torch import nn

from hybridpipe.profiles.zoo.spec import ModelSpec

# output channels per conv layer; "M" is a 2x2 max-pool
VGG16_LAYERS = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


class VGG(nn.Module):
    """A plain VGG: ``layers`` (ints: conv3x3+ReLU widths, "M": max-pool), 7x7 adaptive pool, 3 FC."""

    def __init__(self, layers=VGG16_LAYERS, classes: int = 1000, dropout: float = 0.5):
        super().__init__()
        blocks: list[nn.Module] = []
        channels = 3
        for item in layers:
            if item == "M":
                blocks.append(nn.MaxPool2d(kernel_size=2, stride=2))
            else:
                blocks += [nn.Conv2d(channels, item, kernel_size=3, padding=1), nn.ReLU()]
                channels = item
        self.features = nn.Sequential(*blocks)
        self.avgpool = nn.AdaptiveAvgPool2d((7, 7))
        self.classifier = nn.Sequential(
            nn.Flatten(),
            nn.Linear(channels * 7 * 7, 4096), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(4096, 4096), nn.ReLU(), nn.Dropout(dropout),
            nn.Linear(4096, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.avgpool(self.features(x)))


def vgg16_spec(spec: str, classes: int = 1000, image: int = 224, dropout: float = 0.5) -> ModelSpec:
    """``vgg16[classes=1000,image=224,dropout=0.5]``."""
    return ModelSpec(name=spec, build=lambda: VGG(VGG16_LAYERS, classes, dropout), sample_shape=(3, image, image),
                     input_dtype=torch.float32, loss=nn.functional.cross_entropy, num_classes=classes)
