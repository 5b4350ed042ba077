"""The zoo: parameter counts against the papers' tables, shapes, losses and options."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hybridpipe.errors import UserError
from hybridpipe.profiles.zoo import ZOO, parse_spec, resolve_model

# seed 000, Table 1 (see shared/seeds/README.md): the 1000-class AlexNet, 96/256/384/384/256 filters
ALEXNET_PAPER = {"conv1": 34_944, "conv2": 614_656, "conv3": 885_120, "conv4": 1_327_488, "conv5": 884_992,
                 "fc1": 37_752_832, "fc2": 16_781_312, "fc3": 4_097_000}


def layer_counts(model: nn.Module) -> dict[str, int]:
    return {name: sum(p.numel() for p in m.parameters()) for name, m in model.named_children()
            if any(True for _ in m.parameters())}


def test_alexnet_per_layer_parameters_equal_the_paper_table():
    model = resolve_model("alexnet").build()
    assert layer_counts(model) == ALEXNET_PAPER
    assert sum(p.numel() for p in model.parameters()) == 62_378_344


def test_alexnet_parameters_do_not_depend_on_the_image_size():
    small = resolve_model("alexnet[image=64]")
    assert small.sample_shape == (3, 64, 64)
    model = small.build()
    assert layer_counts(model) == ALEXNET_PAPER
    assert model(small.example_input(2)).shape == (2, 1000)


@pytest.mark.parametrize("spec, total", [("vgg16", 138_357_544), ("resnet50", 25_557_032)])
def test_published_parameter_totals(spec, total):
    assert sum(p.numel() for p in resolve_model(spec).build().parameters()) == total


@pytest.mark.parametrize("spec", ["mlp", "alexnet-small", "resnet-small", "resnet-small[norm=none,blocks=2]",
                                  "gpt[layers=2,width=32,heads=4,seq=16,vocab=50]", "vgg16[image=32,classes=10]",
                                  "resnet50[image=32,classes=10]"])
def test_every_model_runs_forward_and_its_loss_backward(spec):
    ms = resolve_model(spec)
    model = ms.build()
    x, y = ms.example_input(2), ms.example_target(2)
    assert x.shape == (2, *ms.sample_shape) and x.dtype == ms.input_dtype
    out = model(x)
    loss = ms.loss(out, y)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_zoo_names_are_the_contract():
    assert set(ZOO) == {"mlp", "alexnet", "alexnet-small", "vgg16", "resnet50", "resnet-small", "gpt"}


def test_gpt_head_is_untied_and_loss_is_token_level():
    ms = resolve_model("gpt[layers=1,width=16,heads=2,seq=8,vocab=11]")
    model = ms.build()
    assert model.head.weight.data_ptr() != model.embed.tokens.weight.data_ptr()
    x = ms.example_input(3)
    logits = model(x)
    assert logits.shape == (3, 8, 11) and ms.target_shape == (8,)
    y = ms.example_target(3)
    manual = torch.stack([nn.functional.cross_entropy(logits[b, t:t + 1], y[b, t:t + 1])
                          for b in range(3) for t in range(8)]).mean()
    torch.testing.assert_close(ms.loss(logits, y), manual)


def test_gpt_is_causal():
    ms = resolve_model("gpt[layers=2,width=16,heads=2,seq=8,vocab=11]")
    model = ms.build().eval()
    x = ms.example_input(1)
    changed = x.clone()
    changed[0, 5] = (x[0, 5] + 1) % 11
    a, b = model(x), model(changed)
    torch.testing.assert_close(a[0, :5], b[0, :5])
    assert not torch.allclose(a[0, 5:], b[0, 5:])


def test_resnet_small_norm_option():
    with_bn = resolve_model("resnet-small").build()
    without = resolve_model("resnet-small[norm=none]").build()
    assert any(isinstance(m, nn.BatchNorm2d) for m in with_bn.modules())
    assert not any(isinstance(m, nn.BatchNorm2d) for m in without.modules())
    with pytest.raises(UserError, match="norm"):
        resolve_model("resnet-small[norm=layer]")


def test_alexnet_small_dropout_zero_is_deterministic_in_training_mode():
    ms = resolve_model("alexnet-small[dropout=0]")
    model = ms.build().train()
    x = ms.example_input(4)
    torch.testing.assert_close(model(x), model(x))
    noisy = resolve_model("alexnet-small").build().train()
    assert not torch.equal(noisy(x), noisy(x))


@pytest.mark.parametrize("spec, message", [
    ("alexnet[bogus=1]", "zoo model 'alexnet' has no option 'bogus'"),
    ("nosuchmodel", "unknown model"),
    ("gpt[width=30,heads=4]", "divisible"),
    ("mlp[layers=1,layers=1000000000]", "given twice"),
    ("alexnet[image=", "cannot read model"),
    ("tests.profiles.user_models:module_only", "example_input"),
    ("tests.profiles.user_models:missing", "no callable"),
    ("no_such_package.mod:build", "cannot import"),
])
def test_bad_model_specs_are_user_errors(spec, message):
    with pytest.raises(UserError, match=message):
        resolve_model(spec)


def test_user_factory_model_with_arguments_and_loss():
    ms = resolve_model("tests.profiles.user_models:tiny[hidden=7,classes=4]")
    model = ms.build()
    assert model[0].out_features == 7 and ms.num_classes == 4
    assert ms.sample_shape == (12,) and ms.loss is nn.functional.cross_entropy
    assert ms.example_input(4).shape == (4, 12)


def test_leaf_argument_is_reserved_for_the_tracer():
    ms = resolve_model("tests.profiles.user_models:gated[width=6,leaf=Gate]")
    assert ms.leaf_modules == ("Gate",)
    assert ms.build().inp.in_features == 6


@pytest.mark.parametrize("spec, expected", [
    ("hf:convnext[hidden_sizes=[8,16],depths=[1, 1],image_size=32]",
     ("hf:convnext", {"hidden_sizes": [8, 16], "depths": [1, 1], "image_size": 32})),
    ("m:f[names=[a,b],empty=[],flag=true]", ("m:f", {"names": ["a", "b"], "empty": [], "flag": True})),
])
def test_a_list_option_in_brackets(spec, expected):
    """Vision configs take lists (ConvNeXt's hidden_sizes, Swin's depths): was "'16]' is not key=value"."""
    assert parse_spec(spec) == expected


@pytest.mark.parametrize("spec", ["mlp[a=[1]]]", "mlp[a=[[1]]]", "mlp[a=[1,2]", "mlp[a=1]]"])
def test_unbalanced_or_nested_brackets_are_refused(spec):
    with pytest.raises(UserError, match="cannot read model"):
        parse_spec(spec)
