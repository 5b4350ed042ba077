"""Naming a model: a zoo name, ``hf:MODEL`` or the user's ``package.module:factory``, with ``[key=value,...]``.

Examples: ``alexnet``, ``gpt[layers=4,width=256,seq=128]``, ``hf:gpt2[n_layer=4,n_embd=64]``
(zoo/hf.py), ``mypkg.models:build``, ``mypkg.models:build[hidden=64]``. The spec string is
recorded verbatim in profiles and plans, so every rank rebuilds exactly the same model.

The argument ``leaf`` is reserved: ``[leaf=Gate+Router]`` adds module class names to the
ModelSpec's ``leaf_modules`` (never split into several profile nodes) instead of being passed to
the factory, so the choice travels with the spec string to every rank.

This module is the resolver, with :data:`ZOO`, the table of zoo models; the spec's base
(``ModelSpec``, the syntax, calling the user's code, what a user's factory returns) is ``spec.py``.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from hybridpipe.errors import UserError
from hybridpipe.profiles.capture import call_args, own_loss, training_switches
from hybridpipe.profiles.zoo.alexnet import alexnet_small_spec, alexnet_spec
from hybridpipe.profiles.zoo.gpt import gpt_spec
from hybridpipe.profiles.zoo.hf import hf_spec
from hybridpipe.profiles.zoo.mlp import mlp_spec
from hybridpipe.profiles.zoo.resnet import resnet50_spec, resnet_small_spec
from hybridpipe.profiles.zoo.spec import (
    ModelSpec,
    batch_rows,
    call_user,
    import_factory,
    meta_build,
    parse_args,
    parse_spec,
    shaped_like,
)
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


def parse_model_spec(spec: str) -> tuple[str, dict]:
    """:func:`spec.parse_spec` for a model: its error lists the zoo's names."""
    return parse_spec(spec, "model", f"a zoo name ({', '.join(zoo_names())}), hf:MODEL or ")


def zoo_names() -> list[str]:
    return sorted(ZOO)


def resolve_model(spec: str) -> ModelSpec:
    """The ModelSpec for a zoo name or ``package.module:factory`` (see the module docstring).

    A zoo model's options are checked against its function's defaults (type; sizes >= 1) and
    the model is built once on the meta device (no memory), so a bad option is a UserError here;
    a user's factory is called inside :func:`call_user`."""
    if spec.strip().startswith("hf:"):
        return hf_spec(spec.strip())
    target, kwargs = parse_model_spec(spec)
    leaves = tuple(x for x in str(kwargs.pop("leaf", "")).split("+") if x)
    if ":" not in target:
        if target not in ZOO:
            raise UserError(f"unknown model {target!r}: the zoo has {', '.join(zoo_names())}; "
                            "for your own model pass package.module:factory")
        check_zoo_options(target, ZOO[target], kwargs)
        model = call_user(f"zoo model {spec!r}", ZOO[target], spec, **kwargs)
        meta_build(model, f"zoo model {spec!r}")
    else:
        model = _user_model(spec, target, kwargs)
    return replace(model, leaf_modules=model.leaf_modules + leaves) if leaves else model


def check_zoo_options(name: str, fn: Callable, kwargs: dict) -> None:
    """Each option of a zoo model must be one of its function's keywords, of its default's type;
    whole-number options (sizes, counts) must be >= 1 and numbers finite."""
    params = {k: v for k, v in inspect.signature(fn).parameters.items() if k != "spec"}
    for key, value in kwargs.items():
        if key not in params:
            raise UserError(f"zoo model {name!r} has no option {key!r}; its options are {', '.join(params)}")
        default = params[key].default
        if isinstance(default, bool):
            ok, want = isinstance(value, bool), "true or false"
        elif isinstance(default, int):
            ok, want = isinstance(value, int) and not isinstance(value, bool) and value >= 1, "a whole number >= 1"
        elif isinstance(default, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            want = "a finite number"
        else:
            ok, want = True, ""
        if not ok:
            raise UserError(f"zoo model option {key}={value} of {name!r} must be {want} "
                            f"(default {default}); e.g. {name}[{key}={default}]")


def with_leaves(spec: str, leaves: list[str]) -> str:
    """``spec`` with module class names added to its reserved ``leaf`` argument (see the docstring)."""
    if not leaves:
        return spec
    if spec.startswith("hf:"):
        name, _, rest = spec.partition("[")
        kwargs = parse_args(f"[{rest}" if rest else "", spec)
        names = [x for x in str(kwargs.pop("leaf", "")).split("+") if x]
        names += [x for x in leaves if x not in names]
        return f"{name}[{','.join([*(f'{k}={v}' for k, v in kwargs.items()), 'leaf=' + '+'.join(names)])}]"
    target, kwargs = parse_model_spec(spec)
    names = [x for x in str(kwargs.pop("leaf", "")).split("+") if x]
    names += [x for x in leaves if x not in names]
    bad = [x for x in names if not all(part.isidentifier() for part in x.split("."))]
    if bad:
        raise UserError(f"leaf module {bad[0]!r} is not a class name (like Gate or mypkg.blocks.Gate)")
    args = [f"{k}={v}" for k, v in kwargs.items()] + [f"leaf={'+'.join(names)}"]
    return f"{target}[{','.join(args)}]"


def _user_model(spec: str, target: str, kwargs: dict) -> ModelSpec:
    factory = import_factory(target, "model")

    def call() -> tuple:
        out = call_user(f"your factory `{target}`", factory, **kwargs)
        items = out if isinstance(out, tuple) else (out,)
        if not items or not isinstance(items[0], nn.Module) or len(items) > 3:
            raise UserError(f"{target} must return an nn.Module, or (module, example_input[, loss]); "
                            f"got {type(out).__name__}")
        return items

    module, *rest = call()
    if not rest:
        raise UserError(f"{target} returned only a module; return (module, example_input) so hybridpipe "
                        "knows the input (a tensor, tuple or dict of tensors whose first dimension is the batch)")
    example = rest[0]
    if batch_rows(example) is None:
        raise UserError(f"{target}: the example input must be a tensor, or a tuple or dict of tensors, with a "
                        f"batch dimension; got {type(example).__name__}")
    args, kw = call_args(example)
    with torch.no_grad():
        out = call_user(f"your model from `{target}` (on its example input)", module, *args, **kw,
                        **training_switches(module))
    loss = rest[1] if len(rest) > 1 else (None if own_loss(out) is not None else nn.functional.cross_entropy)
    if loss is not None and not callable(loss):
        raise UserError(f"{target}: the third item returned must be a loss function (output, target) -> loss")
    if isinstance(example, torch.Tensor) and isinstance(out, torch.Tensor):
        num_classes = int(out.shape[-1]) if out.dim() >= 2 else 0
        return ModelSpec(name=spec, build=lambda: call()[0], sample_shape=tuple(example.shape[1:]),
                         input_dtype=example.dtype, loss=loss, target_shape=tuple(out.shape[1:-1]),
                         num_classes=num_classes, example=example)
    if loss is not None:
        raise UserError(f"{target}: with a {type(example).__name__} example input the model must compute its own "
                        "loss (return it as output.loss, e.g. pass labels) or be a tensor-in, tensor-out model")
    return ModelSpec(name=spec, build=lambda: call()[0], loss=None, example=example,
                     sample=shaped_like(example))
