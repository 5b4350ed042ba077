"""Naming a model: a zoo name, ``hf:MODEL`` or the user's ``package.module:factory``, with ``[key=value,...]``.

Examples: ``alexnet``, ``gpt[layers=4,width=256,seq=128]``, ``hf:gpt2[n_layer=4,n_embd=64]``
(zoo/hf.py), ``mypkg.models:build``, ``mypkg.models:build[hidden=64]``. The spec string is
recorded verbatim in profiles and plans, so every rank rebuilds exactly the same model.

The argument ``leaf`` is reserved: ``[leaf=Gate+Router]`` adds module class names to the
ModelSpec's ``leaf_modules`` (kept whole, each call one node that runs the module as written:
profiles/leaves.py) instead of being passed to the factory, so the choice travels with the spec string to every rank.

This module is the resolver, with :data:`ZOO`, the table of zoo models; the spec's base
(``ModelSpec``, the syntax, calling the user's code, what a user's factory returns) is ``spec.py``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from hybridpipe.errors import UserError
from hybridpipe.profiles.capture import call_args, own_loss, training_switches
from hybridpipe.profiles.losses import is_pair
from hybridpipe.profiles.meta import parameters_on_meta
from hybridpipe.profiles.zoo.alexnet import alexnet_small_spec, alexnet_spec
from hybridpipe.profiles.zoo.gpt import gpt_spec
from hybridpipe.profiles.zoo.hf import hf_spec
from hybridpipe.profiles.zoo.mlp import mlp_spec
from hybridpipe.profiles.zoo.resnet import resnet50_spec, resnet_small_spec
from hybridpipe.profiles.zoo.spec import (
    ModelSpec,
    batch_rows,
    call_user,
    check_options,
    error_text,
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
    params = {k: v.default for k, v in inspect.signature(fn).parameters.items() if k != "spec"}
    check_options("zoo model", name, params, kwargs)


def build_skeleton(spec: str) -> nn.Module:
    """The model ``spec`` names, built without loading its weights or running it: parameters on the
    meta device (no memory), buffers as its constructor computes them. What its ``state_dict`` keys
    and shapes are, and a frame to write a merged state_dict out in the model's own format. A user's
    factory is only called (its example is not run); one that cannot build with its parameters on
    the meta device (it loads weights itself, say) is built on the CPU instead."""

    text = spec.strip()
    if text.startswith("hf:"):
        model = hf_spec(text)
        build, who = model.skeleton or model.build, f"model {text!r}"
    else:
        target, kwargs = parse_model_spec(text)
        kwargs.pop("leaf", None)
        if ":" in target:
            return _factory_skeleton(target, kwargs)
        model = resolve_model(text)
        build, who = model.build, f"zoo model {text!r}"
    try:
        with parameters_on_meta():
            return build()
    except UserError:
        raise
    except Exception as e:      # noqa: BLE001 - ours to name: the zoo and hf: models build on the meta device
        raise UserError(f"cannot build {who} with its parameters on the meta device ({type(e).__name__}: "
                        f"{error_text(e)})") from None


def _factory_skeleton(target: str, kwargs: dict) -> nn.Module:
    """The module a user's factory returns, built with its parameters on the meta device, else on
    the CPU (as every rank builds it); only a factory that fails on the CPU too is the user's error."""

    factory = import_factory(target, "model")

    def module() -> nn.Module:
        out = call_user(f"your factory `{target}`", factory, **kwargs)
        first = out[0] if isinstance(out, tuple) and out else out
        if not isinstance(first, nn.Module):
            raise UserError(f"{target} must return an nn.Module, or (module, example_input[, loss]); "
                            f"got {type(out).__name__}")
        return first

    try:
        with parameters_on_meta():
            return module()
    except UserError:
        return module()


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
    return factory_spec(spec, target, import_factory(target, "model"), kwargs)


def factory_spec(spec: str, target: str, factory: Callable, kwargs: dict | None = None) -> ModelSpec:
    """The ModelSpec of a user's ``factory`` (named ``target`` in messages): it returns (module,
    example_input[, loss[, example_target]]), the form ``package.module:factory`` takes (module
    docstring); called with ``kwargs``."""
    kwargs = kwargs or {}

    def call() -> tuple:
        out = call_user(f"your factory `{target}`", factory, **kwargs)
        items = out if isinstance(out, tuple) else (out,)
        if not items or not isinstance(items[0], nn.Module) or len(items) > 4:
            raise UserError(f"{target} must return an nn.Module, or (module, example_input[, loss[, example_target]]); "
                            f"got {type(out).__name__}")
        return items

    module, *rest = call()
    if not rest:
        raise UserError(f"{target} returned only a module; return (module, example_input) so hybridpipe "
                        "knows the input (a tensor, tuple or dict of tensors whose first dimension is the batch)")
    example = rest[0]
    rows = batch_rows(example)
    if rows is None:
        raise UserError(f"{target}: the example input must be a tensor, or a tuple or dict of tensors, with a "
                        f"batch dimension; got {type(example).__name__}")
    args, kw = call_args(example)
    with torch.no_grad():
        out = call_user(f"your model from `{target}` (on its example input)", module, *args, **kw,
                        **training_switches(module))
    given = rest[1] if len(rest) > 1 else None
    if given is not None and not callable(given):
        raise UserError(f"{target}: the third item returned must be a loss function (output, target) -> loss")
    example_target = rest[2] if len(rest) > 2 else None
    if example_target is not None and given is None:
        raise UserError(f"{target}: an example target (the fourth item) needs a loss function as the third")
    loss = given if given is not None else (None if own_loss(out) is not None else nn.functional.cross_entropy)
    if loss is None:
        return ModelSpec(name=spec, build=lambda: call()[0], loss=None, example=example,
                         sample=shaped_like(example))
    if example_target is not None:           # the user's own targets: synthetic ones are shaped like them
        if batch_rows(example_target) != rows:
            raise UserError(f"{target}: the example target has {batch_rows(example_target)} rows but the example "
                            f"input {rows}; give one target per input row")
        _check_loss(target, loss, out, example_target)
        inputs, targets = shaped_like(example), shaped_like(example_target)
        return ModelSpec(name=spec, build=lambda: call()[0], loss=loss, example=example,
                         sample=lambda g: (inputs(g), targets(g)))
    main = _first_tensor(out)                 # class ids for the output's (first) tensor of scores
    if main is None or main.dim() < 2:
        raise UserError(f"{target}: cannot tell what targets the loss takes (the model's output has no tensor of "
                        "class scores); return (module, example_input, loss_fn, example_target)")
    num_classes, target_shape = int(main.shape[-1]), tuple(main.shape[1:-1])
    if given is not None:
        _check_loss(target, loss, out, torch.randint(0, num_classes, (rows, *target_shape),
                                                     generator=torch.Generator().manual_seed(0)))
    if isinstance(example, torch.Tensor) and isinstance(out, torch.Tensor):
        return ModelSpec(name=spec, build=lambda: call()[0], sample_shape=tuple(example.shape[1:]),
                         input_dtype=example.dtype, loss=loss, target_shape=target_shape,
                         num_classes=num_classes, example=example)
    inputs = shaped_like(example)
    return ModelSpec(name=spec, build=lambda: call()[0], loss=loss, example=example, target_shape=target_shape,
                     num_classes=num_classes,
                     sample=lambda g: (inputs(g), torch.randint(0, num_classes, target_shape, generator=g)))


def _first_tensor(output: Any) -> torch.Tensor | None:
    """The output itself if it is a tensor, else its first tensor (a ModelOutput's logits)."""
    if isinstance(output, torch.Tensor):
        return output
    return next((x for x in pytree.tree_leaves(output) if isinstance(x, torch.Tensor)), None)


def _check_loss(target: str, loss: Callable, output: Any, example_target: Any) -> None:
    """Run the loss function once on the example: it must give a scalar or (loss_sum, count)."""
    with torch.no_grad():
        value = call_user(f"your loss function from `{target}` (on the example's output and target)", loss,
                          output, example_target)
    ok = is_pair(value) or (isinstance(value, torch.Tensor) and value.dim() == 0)
    if not ok:
        got = f"a tensor of shape {list(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
        raise UserError(f"{target}: the loss function must return a scalar tensor (the mean loss) or (loss_sum, "
                        f"count); it returned {got}")

