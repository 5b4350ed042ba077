"""Synthetic data: deterministic per (seed, index), shaped like the model, and learnable."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader

from hybridpipe.errors import UserError
from hybridpipe.profiles.data import SyntheticDataset, resolve_dataset
from hybridpipe.profiles.zoo import resolve_model


@pytest.mark.parametrize("spec", ["alexnet-small", "mlp", "gpt[layers=1,width=16,heads=2,seq=8,vocab=13]"])
def test_samples_match_the_model(spec):
    ms = resolve_model(spec)
    ds = resolve_dataset("synthetic", ms, size=5, seed=3)
    assert len(ds) == 5
    x, y = ds[4]
    assert x.shape == ms.sample_shape and x.dtype == ms.input_dtype
    assert y.shape == ms.target_shape and y.dtype == torch.int64
    assert 0 <= int(y.min()) and int(y.max()) < ms.num_classes
    xb, yb = next(iter(DataLoader(ds, batch_size=5)))
    model = ms.build()
    assert torch.isfinite(ms.loss(model(xb), yb))


def test_deterministic_in_seed_and_index_only():
    ms = resolve_model("mlp")
    a, b = resolve_dataset("synthetic", ms, size=10, seed=1), resolve_dataset("synthetic", ms, size=99, seed=1)
    for i in (0, 7):
        torch.testing.assert_close(a[i], b[i])
    other = resolve_dataset("synthetic", ms, size=10, seed=2)
    assert not torch.equal(a[0][0], other[0][0]) and not torch.equal(a[0][0], a[1][0])
    with pytest.raises(IndexError):
        a[10]


def test_targets_are_the_same_function_of_the_input_for_every_seed():
    ms = resolve_model("gpt[layers=1,width=16,heads=2,seq=32,vocab=13]")
    pairs = [resolve_dataset("synthetic", ms, size=4, seed=s)[i] for s in (0, 5) for i in range(4)]
    mapping: dict[int, int] = {}
    for x, y in pairs:
        for token, target in zip(x.tolist(), y.tolist(), strict=True):
            assert mapping.setdefault(token, target) == target
    assert len(set(mapping.values())) == len(mapping)          # a permutation: every token its own target


def test_classification_targets_are_learnable():
    torch.manual_seed(0)
    ms = resolve_model("mlp[features=64,hidden=64,layers=1,classes=4]")
    data = resolve_dataset("synthetic", ms, size=512, seed=0)
    model = ms.build()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(8):
        for x, y in DataLoader(data, batch_size=64):
            loss = ms.loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
    assert sum(losses[-8:]) / 8 < 0.5 * sum(losses[:8]) / 8
    held_out = resolve_dataset("synthetic", ms, size=256, seed=1)
    x, y = next(iter(DataLoader(held_out, batch_size=256)))
    assert (model(x).argmax(1) == y).float().mean() > 0.6       # chance is 0.25


def test_user_dataset_factory():
    ms = resolve_model("tests.profiles.user_models:tiny")
    ds = resolve_dataset("tests.profiles.user_models:pairs[n=6]", ms, size=100, seed=0)
    assert len(ds) == 6 and ds[0][0].shape == (12,)


@pytest.mark.parametrize("spec, message", [
    ("tests.profiles.user_models:pairs[features=3]", "shape \\[3\\]"),
    ("tests.profiles.user_models:not_a_dataset", "map-style Dataset"),
    ("tests.profiles.user_models:pairs[n=0]", "empty"),
    ("imagenet", "unknown dataset"),
    ("tests.profiles.user_models:nothing", "no callable"),
])
def test_bad_datasets_are_refused(spec, message):
    with pytest.raises(UserError, match=message):
        resolve_dataset(spec, resolve_model("tests.profiles.user_models:tiny"), size=4, seed=0)


def test_synthetic_size_must_be_positive():
    with pytest.raises(UserError, match="size >= 1"):
        SyntheticDataset.for_model(resolve_model("mlp"), size=0)
