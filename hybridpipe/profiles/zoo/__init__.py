"""The model zoo: models written in the project (torchvision is not needed).

``ZOO`` maps a zoo name to a function ``(spec, **kwargs) -> ModelSpec``; use
``resolve_model(spec)`` to turn any model spec (zoo name or ``module:factory``) into a ModelSpec.
``spec.py`` is the spec's base (every model module builds on it), ``registry.py`` the resolver.
"""

from hybridpipe.profiles.zoo.registry import ZOO, resolve_model
from hybridpipe.profiles.zoo.spec import ModelSpec, parse_spec

__all__ = ["ZOO", "ModelSpec", "parse_spec", "resolve_model"]
