"""A forward that draws from numpy's (or Python's) global generator, as Wav2Vec2's SpecAugment time
mask does: torch.export froze the capture's draw into the graph as a constant, so every step replayed
one mask where the model draws anew (the captured graph run twice gave the same output, the model
two different ones). Capture now refuses it in one line naming the line that draws."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from hybridpipe.errors import UserError
from hybridpipe.profiles.capture import capture_model
from hybridpipe.profiles.host_random import host_draws


class NumpyMask(nn.Module):
    """Zeroes a random half of the features, the mask drawn with numpy (SpecAugment's way)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.from_numpy(np.random.rand(8) < 0.5)
        return self.fc(x) * keep


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mask, self.out = NumpyMask(), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.mask(x))


def test_host_draws_records_the_callers_line_and_restores_the_generators():
    rand, choice = np.random.rand, random.choice
    with host_draws() as drawn:
        np.random.rand(2)
        random.choice([1, 2])
    assert [d.split(" at ")[0] for d in drawn] == ["numpy.random.rand", "random.choice"]
    assert all(__file__ in d for d in drawn)
    assert np.random.rand is rand and random.choice is choice


def test_a_forward_drawing_host_random_numbers_is_refused_not_frozen():
    model = Net()
    with pytest.raises(UserError, match=r"draws host random numbers \(numpy.random.rand at .*test_host_random.py"):
        capture_model(model, torch.randn(2, 8))
    captured = capture_model(model, torch.randn(2, 8), leaf_modules=[NumpyMask])     # run whole: draws anew
    assert captured.front_end == "export"
