"""Tiny Hugging Face vision models for the model-family matrix, named
``tests.pipeline.hf_families:FACTORY`` (not a test file): each returns ``(model, example)``, the
model computing its own loss from ``labels``. (The text families are ``hf:`` specs: see
tests/pipeline/test_hf_families.py; the BatchNorm ResNet is tests.pipeline.bn_models:hf_resnet.)"""

from __future__ import annotations

import torch


def hf_convnext(labels: int = 5):
    """A tiny ConvNeXt (depthwise convolutions, channels-last LayerNorm, layer scale)."""
    from transformers import ConvNextConfig, ConvNextForImageClassification

    config = ConvNextConfig(num_channels=3, patch_size=4, num_stages=2, hidden_sizes=[8, 16], depths=[1, 1],
                            image_size=16, num_labels=labels)
    example = {"pixel_values": torch.randn(4, 3, 16, 16), "labels": torch.arange(4) % labels}
    return ConvNextForImageClassification(config), example
