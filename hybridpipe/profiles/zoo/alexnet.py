"""AlexNet: the 1000-class network of the papers (224x224) and a small CIFAR-sized variant (32x32).

The full model has the filter counts 96/256/384/384/256 and three fully connected layers of
4096/4096/classes, without grouped convolutions, so its per-layer parameter counts are those of
seed 000's Table 1 (conv1 34,944 ... fc3 4,097,000; 62,378,344 in all). The adaptive pool keeps
fc1 at 256*6*6 = 9216 inputs for any image size, so smaller images (e.g. 64x64) give the same
parameters with less compute.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridpipe.profiles.zoo.spec import ModelSpec


class AlexNet(nn.Module):
    """Krizhevsky et al.'s AlexNet as a single-tower network (no local response normalisation)."""

    def __init__(self, classes: int = 1000, dropout: float = 0.5):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 96, kernel_size=11, stride=4, padding=2)
        self.relu1 = nn.ReLU()
        self.pool1 = nn.MaxPool2d(kernel_size=3, stride=2)
        self.conv2 = nn.Conv2d(96, 256, kernel_size=5, padding=2)
        self.relu2 = nn.ReLU()
        self.pool2 = nn.MaxPool2d(kernel_size=3, stride=2)
        self.conv3 = nn.Conv2d(256, 384, kernel_size=3, padding=1)
        self.relu3 = nn.ReLU()
        self.conv4 = nn.Conv2d(384, 384, kernel_size=3, padding=1)
        self.relu4 = nn.ReLU()
        self.conv5 = nn.Conv2d(384, 256, kernel_size=3, padding=1)
        self.relu5 = nn.ReLU()
        self.pool5 = nn.MaxPool2d(kernel_size=3, stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.flatten = nn.Flatten()
        self.drop1 = nn.Dropout(dropout)
        self.fc1 = nn.Linear(256 * 6 * 6, 4096)
        self.relu6 = nn.ReLU()
        self.drop2 = nn.Dropout(dropout)
        self.fc2 = nn.Linear(4096, 4096)
        self.relu7 = nn.ReLU()
        self.fc3 = nn.Linear(4096, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool1(self.relu1(self.conv1(x)))
        x = self.pool2(self.relu2(self.conv2(x)))
        x = self.relu3(self.conv3(x))
        x = self.relu4(self.conv4(x))
        x = self.pool5(self.relu5(self.conv5(x)))
        x = self.flatten(self.avgpool(x))
        x = self.relu6(self.fc1(self.drop1(x)))
        x = self.relu7(self.fc2(self.drop2(x)))
        return self.fc3(x)


class AlexNetSmall(nn.Module):
    """AlexNet's shape (5 conv, 3 max-pools, 3 FC) scaled to 32x32 images: ~0.6 M parameters."""

    def __init__(self, classes: int = 10, dropout: float = 0.5):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 32, kernel_size=5, padding=2), nn.ReLU(), nn.MaxPool2d(2),     # 16x16
            nn.Conv2d(32, 64, kernel_size=5, padding=2), nn.ReLU(), nn.MaxPool2d(2),    # 8x8
            nn.Conv2d(64, 96, kernel_size=3, padding=1), nn.ReLU(),
            nn.Conv2d(96, 96, kernel_size=3, padding=1), nn.ReLU(),
            nn.Conv2d(96, 64, kernel_size=3, padding=1), nn.ReLU(), nn.MaxPool2d(2),    # 4x4
            nn.Flatten(),
        )
        self.classifier = nn.Sequential(
            nn.Dropout(dropout), nn.Linear(64 * 4 * 4, 256), nn.ReLU(),
            nn.Dropout(dropout), nn.Linear(256, 256), nn.ReLU(),
            nn.Linear(256, classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def alexnet_spec(spec: str, classes: int = 1000, image: int = 224, dropout: float = 0.5) -> ModelSpec:
    """``alexnet[classes=1000,image=224,dropout=0.5]``: the papers' AlexNet on 3 x image x image."""
    return ModelSpec(name=spec, build=lambda: AlexNet(classes, dropout), sample_shape=(3, image, image),
                     input_dtype=torch.float32, loss=nn.functional.cross_entropy, num_classes=classes)


def alexnet_small_spec(spec: str, classes: int = 10, dropout: float = 0.5) -> ModelSpec:
    """``alexnet-small[classes=10,dropout=0.5]``: the CIFAR-sized AlexNet on 3x32x32."""
    return ModelSpec(name=spec, build=lambda: AlexNetSmall(classes, dropout), sample_shape=(3, 32, 32),
                     input_dtype=torch.float32, loss=nn.functional.cross_entropy, num_classes=classes)
