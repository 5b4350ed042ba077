"""The model zoo: models written in the project (torchvision is not needed).

``ZOO`` maps a zoo name to a function ``(spec, **kwargs) -> ModelSpec``; use
``resolve_model(spec)`` to turn any model spec (zoo name or ``module:factory``) into a ModelSpec.
"""

from collections.abc import Callable

from hybridpipe.profiles.zoo.alexnet import alexnet_small_spec, alexnet_spec
from hybridpipe.profiles.zoo.gpt import gpt_spec
from hybridpipe.profiles.zoo.mlp import mlp_spec
from hybridpipe.profiles.zoo.registry import ModelSpec, parse_spec, resolve_model
from hybridpipe.profiles.zoo.resnet import resnet50_spec, resnet_small_spec
from hybridpipe.profiles.zoo.vgg import vgg16_spec

ZOO: dict[str, Callable[..., ModelSpec]] = {
    "mlp": mlp_spec,
    "alexnet": alexnet_spec,
    "alexnet-small": alexnet_small_spec,
    "vgg16": vgg16_spec,
    "resnet50": resnet50_spec,
    "resnet-small": resnet_small_spec,
    "gpt": gpt_spec,
}

__all__ = ["ZOO", "ModelSpec", "parse_spec", "resolve_model"]
