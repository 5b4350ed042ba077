"""The Trainer's ``model`` argument (runtime/parts.py spec_of): a factory passed as a Python
callable is read as ``hybridpipe profile package.module:factory`` reads it (a new user passed the
factory they had profiled, and was told to add ``example=``)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridpipe.errors import UserError
from hybridpipe.profiles.zoo import resolve_model
from hybridpipe.runtime.parts import spec_of


def smoothed_mlp():
    """What a user's factory returns: (module, example input, loss, example target)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 5))

    def loss(out, target):
        return nn.functional.cross_entropy(out, target, label_smoothing=0.1)

    return model, torch.randn(3, 6), loss, torch.tensor([0, 4, 2])


def test_a_factory_callable_gives_what_its_spec_string_gives():
    given = spec_of(smoothed_mlp, "mine", None, None)
    named = resolve_model(f"{__name__}:smoothed_mlp")
    assert torch.equal(given.example, named.example)
    g = torch.Generator().manual_seed(1)
    x, y = given.sample(g)
    assert x.shape == (6,) and y.dtype == torch.long
    out = given.build()(torch.ones(2, 6))
    # the factory's own loss, not cross-entropy without smoothing
    t = torch.tensor([1, 3])
    assert torch.equal(given.loss(out, t), nn.functional.cross_entropy(out, t, label_smoothing=0.1))
    assert given.name == "mine"


def test_a_module_without_example_says_what_to_pass():
    with pytest.raises(UserError, match="needs example=.*or pass a factory returning"):
        spec_of(nn.Linear(2, 2), "m", None, None)


def test_a_factory_of_only_a_module_is_told_to_return_its_example():
    with pytest.raises(UserError, match="returned only a module"):
        spec_of(lambda: nn.Linear(2, 2), "m", None, None)


def test_a_factory_of_a_module_with_example_given_still_builds_the_module():
    spec = spec_of(lambda: nn.Linear(2, 2), "m", torch.zeros(1, 2), None)
    assert isinstance(spec.build(), nn.Linear)
