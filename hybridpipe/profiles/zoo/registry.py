"""Naming a model: a zoo name or the user's ``package.module:factory``, with optional ``[key=value,...]``.

Examples: ``alexnet``, ``gpt[layers=4,width=256,seq=128]``, ``mypkg.models:build``,
``mypkg.models:build[hidden=64]``. The spec string is recorded verbatim in profiles and
plans, so every rank rebuilds exactly the same model.

The argument ``leaf`` is reserved: ``[leaf=Gate+Router]`` adds module class names to the
ModelSpec's ``leaf_modules`` (kept whole by the tracer) instead of being passed to the factory,
so the tracing choice travels with the spec string to every rank.

A user's factory returns an ``nn.Module``, or a tuple ``(module, example_input)`` or
``(module, example_input, loss_fn)``; ``example_input`` carries a batch dimension.
"""

from __future__ import annotations

import importlib
import inspect
import math
import os
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from hybridpipe.errors import UserError

_SPEC = re.compile(r"^(?P<target>[A-Za-z_][\w.\-]*(?::[A-Za-z_]\w*)?)(?:\[(?P<args>[^\]]*)\])?$")


@dataclass(frozen=True)
class ModelSpec:
    """Everything needed to build, feed and train a model."""

    name: str                                   # the spec string as the user gave it
    build: Callable[[], nn.Module]              # a fresh model (initialised from torch's RNG)
    sample_shape: tuple[int, ...]               # one input sample (no batch dimension)
    input_dtype: torch.dtype
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]   # (output, target) -> mean loss
    target_shape: tuple[int, ...] = ()          # one target sample: () for a class id, (T,) for tokens
    num_classes: int = 0                        # targets are int64 in [0, num_classes)
    leaf_modules: tuple[type | str, ...] = ()   # module types / class names the tracer keeps whole
    example: torch.Tensor | None = None         # the user's example input, if the factory gave one

    def example_input(self, batch_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """A random input batch of the model's shape and dtype."""
        if self.example is not None and self.example.shape[0] == batch_size:
            return self.example
        shape = (batch_size, *self.sample_shape)
        if self.input_dtype.is_floating_point:
            return torch.randn(shape, dtype=self.input_dtype, generator=generator)
        high = self.num_classes or 2
        return torch.randint(0, high, shape, dtype=self.input_dtype, generator=generator)

    def example_target(self, batch_size: int, generator: torch.Generator | None = None) -> torch.Tensor:
        """A random target batch (class ids) matching ``loss``."""
        return torch.randint(0, max(self.num_classes, 1), (batch_size, *self.target_shape), generator=generator)


def parse_spec(spec: str, what: str = "model") -> tuple[str, dict]:
    """Split ``name[k=v,...]`` into the name and keyword arguments (ints, floats, bools, strings)."""
    m = _SPEC.match(spec.strip())
    if not m:
        choices = f"a zoo name ({', '.join(zoo_names())}) or " if what == "model" else ""
        raise UserError(f"cannot read {what} {spec!r}: use {choices}package.module:factory, "
                        "optionally followed by [key=value,...]")
    kwargs: dict = {}
    for item in filter(None, (x.strip() for x in (m.group("args") or "").split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip().isidentifier():
            raise UserError(f"{what} argument {item!r} in {spec!r} is not key=value")
        kwargs[key.strip()] = _literal(value.strip())
    return m.group("target"), kwargs


def _literal(text: str):
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def zoo_names() -> list[str]:
    from hybridpipe.profiles.zoo import ZOO

    return sorted(ZOO)


def resolve_model(spec: str) -> ModelSpec:
    """The ModelSpec for a zoo name or ``package.module:factory`` (see the module docstring).

    A zoo model's options are checked against its function's defaults (type; sizes >= 1) and
    the model is built once on the meta device (no memory), so a bad option is a UserError here;
    a user's factory is called inside :func:`call_user`."""
    from hybridpipe.profiles.zoo import ZOO

    target, kwargs = parse_spec(spec)
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


def meta_build(model: ModelSpec, who: str) -> None:
    """Build ``model`` on the meta device (shapes only, no memory): a constructor that cannot
    build with these options fails here, as ``who``'s error, before any real work."""
    with torch.device("meta"):
        call_user(who, model.build)


def call_user(who: str, fn: Callable, *args: Any, **kwargs: Any) -> Any:
    """Call ``fn`` (a model or dataset factory, or a model it returned); its exception becomes a
    one-line UserError: "``who`` raised RuntimeError: ... (at file:line)", ``who`` being e.g.
    "your factory `pkg.mod:f`"."""
    try:
        return fn(*args, **kwargs)
    except UserError:
        raise
    except Exception as e:      # noqa: BLE001 - the user's code: any exception is theirs to fix
        raise UserError(f"{who} raised {type(e).__name__}: {_message(e)}{_location(e)}") from None


def _message(e: BaseException) -> str:
    if isinstance(e, SyntaxError):
        return e.msg or "invalid syntax"
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    text = lines[0] if lines else ""
    return text if len(text) <= 300 else text[:297] + "..."


def _location(e: BaseException) -> str:
    """`` (at file:line)``: where in the user's code ``e`` was raised (the innermost frame outside
    torch, hybridpipe and the standard library; else the innermost frame)."""
    if isinstance(e, SyntaxError) and e.filename:
        return f" (at {e.filename}:{e.lineno})"
    frames = traceback.extract_tb(e.__traceback__)
    if not frames:
        return ""
    libraries = tuple(os.path.dirname(m.__file__) + os.sep for m in (os, torch) if m.__file__)
    ours = os.path.dirname(sys.modules["hybridpipe"].__file__ or "") + os.sep
    code = [f for f in frames if not f.filename.startswith(libraries) and not f.filename.startswith("<")]
    users = [f for f in code if not f.filename.startswith(ours)]
    frame = (users or code or frames)[-1]           # the user's line; else a zoo model's; else where it broke
    return f" (at {frame.filename}:{frame.lineno})"


def describe_model(spec: str) -> str:
    """How errors name a model: "your model `pkg.mod:f[...]`" or "zoo model 'alexnet[...]'"."""
    return f"your model `{spec}`" if ":" in spec.split("[")[0] else f"zoo model {spec!r}"


def with_leaves(spec: str, leaves: list[str]) -> str:
    """``spec`` with module class names added to its reserved ``leaf`` argument (see the docstring)."""
    if not leaves:
        return spec
    target, kwargs = parse_spec(spec)
    names = [x for x in str(kwargs.pop("leaf", "")).split("+") if x]
    names += [x for x in leaves if x not in names]
    bad = [x for x in names if not all(part.isidentifier() for part in x.split("."))]
    if bad:
        raise UserError(f"leaf module {bad[0]!r} is not a class name (like Gate or mypkg.blocks.Gate)")
    args = [f"{k}={v}" for k, v in kwargs.items()] + [f"leaf={'+'.join(names)}"]
    return f"{target}[{','.join(args)}]"


def import_factory(target: str, what: str) -> Callable:
    """Import ``package.module:attr``; errors name the module or attribute that is missing, or
    the user's error (a SyntaxError, an exception at import) with its location."""
    module_name, _, attr = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_name == e.name or module_name.startswith(e.name + ".")):
            raise UserError(f"cannot import {what} module {module_name!r} ({e}); is it on PYTHONPATH?") from None
        raise UserError(f"your {what} module {module_name!r} raised ModuleNotFoundError: {e}{_location(e)}") from None
    except Exception as e:      # noqa: BLE001 - a SyntaxError or any error while the user's module runs
        raise UserError(f"your {what} module {module_name!r} raised {type(e).__name__}: "
                        f"{_message(e)}{_location(e)}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UserError(f"{module_name!r} has no callable {attr!r} to build the {what}")
    return factory


def _user_model(spec: str, target: str, kwargs: dict) -> ModelSpec:
    factory = import_factory(target, "model")

    def call():
        out = call_user(f"your factory `{target}`", factory, **kwargs)
        items = out if isinstance(out, tuple) else (out,)
        if not items or not isinstance(items[0], nn.Module) or len(items) > 3:
            raise UserError(f"{target} must return an nn.Module, or (module, example_input[, loss]); "
                            f"got {type(out).__name__}")
        return items

    module, *rest = call()
    example = rest[0] if rest else None
    if example is not None and not isinstance(example, torch.Tensor):
        raise UserError(f"{target}: the example input must be a tensor with a batch dimension")
    if example is None:
        raise UserError(f"{target} returned only a module; return (module, example_input) so hybridpipe "
                        "knows the input shape (the example's first dimension is the batch)")
    if example.dim() < 1 or example.shape[0] < 1:
        raise UserError(f"{target}: the example input must have a batch dimension of at least 1, "
                        f"got shape {list(example.shape)}")
    loss = rest[1] if len(rest) > 1 else nn.functional.cross_entropy
    if not callable(loss):
        raise UserError(f"{target}: the third item returned must be a loss function (output, target) -> loss")
    with torch.no_grad():
        out = call_user(f"your model from `{target}` (on its example input)", module, example)
    if not isinstance(out, torch.Tensor):
        raise UserError(f"{target}: the model must return a tensor for its example input, got {type(out).__name__}")
    num_classes = int(out.shape[-1]) if out.dim() >= 2 else 0
    return ModelSpec(name=spec, build=lambda: call()[0], sample_shape=tuple(example.shape[1:]),
                     input_dtype=example.dtype, loss=loss, target_shape=tuple(out.shape[1:-1]),
                     num_classes=num_classes, example=example)
