"""Tiny Hugging Face models of the memory-prediction matrix (tests/pipeline/test_memory_families.py)
that the ``hf:`` names cannot spell (list-valued config fields)."""

from __future__ import annotations

import torch


def hf_convnext(labels: int = 5):
    """A tiny ConvNeXt (depthwise convolutions, LayerNorm, layer scale) computing its own loss from ``labels``."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    config = ConvNextConfig(num_stages=2, hidden_sizes=[8, 16], depths=[1, 1], num_labels=labels, drop_path_rate=0.0)
    example = {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.arange(2) % labels}
    return ConvNextForImageClassification(config), example


def hf_resnet(labels: int = 5):
    """A tiny ResNet (BatchNorm after every convolution) computing its own loss from ``labels``."""
    from transformers import ResNetConfig, ResNetForImageClassification

    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], num_labels=labels)
    example = {"pixel_values": torch.randn(2, 3, 32, 32), "labels": torch.arange(2) % labels}
    return ResNetForImageClassification(config), example
