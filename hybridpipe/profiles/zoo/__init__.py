"""The model zoo: models written in the project (torchvision is not needed).

``ZOO`` maps a zoo name to a function ``(spec, **kwargs) -> ModelSpec``; use
``resolve_model(spec)`` to turn any model spec (zoo name or ``module:factory``) into a ModelSpec.
"""

from hybridpipe.profiles.zoo.mlp import mlp
from hybridpipe.profiles.zoo.registry import ModelSpec, parse_spec, resolve_model

ZOO = {
    "mlp": mlp,
}

__all__ = ["ZOO", "ModelSpec", "parse_spec", "resolve_model"]
