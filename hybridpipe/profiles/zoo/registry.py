"""Naming a model: a zoo name, ``hf:MODEL`` or the user's ``package.module:factory``, with ``[key=value,...]``.

Examples: ``alexnet``, ``gpt[layers=4,width=256,seq=128]``, ``hf:gpt2[n_layer=4,n_embd=64]``
(zoo/hf.py), ``mypkg.models:build``, ``mypkg.models:build[hidden=64]``. The spec string is
recorded verbatim in profiles and plans, so every rank rebuilds exactly the same model.

The argument ``leaf`` is reserved: ``[leaf=Gate+Router]`` adds module class names to the
ModelSpec's ``leaf_modules`` (never split into several profile nodes) instead of being passed to
the factory, so the choice travels with the spec string to every rank.

A user's factory returns ``(module, example_input)``, ``(module, example_input, loss_fn)`` or
``(module, example_input, loss_fn, example_target)``. ``example_input`` is one batch as the model
takes it -- a tensor, a tuple (``model(*x)``) or a dict (``model(**x)``) of tensors whose first
dimension is the batch; ``loss_fn(output, target)`` receives the output as the model returns it
(tensor, tuple, dict, ``ModelOutput``) and the target as the dataset's (input, target) pairs give
it, and returns the mean loss or ``(loss_sum, count)`` (profiles/losses.py). ``example_target``
(any tensor, tuple or dict of tensors with the batch first) shapes the synthetic targets; without
it they are class ids for the output's first tensor: shaped like it without its last dimension,
below its last dimension's size (token ids for logits). The loss function is tried once on the
example's output and target. Without a loss_fn, a model whose output carries a loss (a Hugging
Face model given ``labels``) trains on that loss, and any other model on cross-entropy with such
class-id targets.
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
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.data import default_collate

from hybridpipe.errors import UserError
from hybridpipe.profiles.capture import call_args, own_loss, training_switches
from hybridpipe.profiles.losses import is_pair

_SPEC = re.compile(r"^(?P<target>[A-Za-z_][\w.\-]*(?::[A-Za-z_]\w*)?)(?:\[(?P<args>[^\]]*)\])?$")


LossFn = Callable[[Any, Any], Any]      # (output, target) -> mean loss, or (loss_sum, count) (profiles/losses.py)


@dataclass(frozen=True)
class ModelSpec:
    """Everything needed to build, feed and train a model.

    A batch is what the model's forward takes: a tensor (``model(x)``), a tuple (``model(*x)``) or
    a dict (``model(**x)``), every tensor with the batch as its first dimension. ``loss(output,
    target)`` gives the mean loss or ``(loss_sum, count)`` (profiles/losses.py); ``loss=None`` means
    the model computes its own (a Hugging Face model given ``labels`` returns ``output.loss``) and
    the data has no separate targets. ``sample`` draws one synthetic sample: the input, or with a
    loss function the pair (input, target).
    """

    name: str                                   # the spec string as the user gave it
    build: Callable[[], nn.Module]              # a fresh model (initialised from torch's RNG)
    sample_shape: tuple[int, ...] = ()          # tensor-input models: one input sample (no batch dimension)
    input_dtype: torch.dtype = torch.float32
    loss: LossFn | None = nn.functional.cross_entropy
    target_shape: tuple[int, ...] = ()          # one target sample: () for a class id, (T,) for tokens
    num_classes: int = 0                        # targets are int64 in [0, num_classes)
    leaf_modules: tuple[type | str, ...] = ()   # module types / class names never split into several nodes
    example: Any = None                         # the user's example batch, if the factory gave one
    sample: Callable[[torch.Generator], Any] | None = None   # one synthetic sample: input, or (input, target)
    skeleton: Callable[[], nn.Module] | None = None   # the model, loading and running nothing (None: build)
    weights: str | None = None                  # a safetensors file or directory holding every weight (hf:DIR)

    def example_input(self, batch_size: int, generator: torch.Generator | None = None) -> Any:
        """A random input batch of the model's shape and dtype (the user's example when it fits)."""
        if self.example is not None and batch_rows(self.example) == batch_size:
            return self.example
        if self.sample is not None:
            g = generator if generator is not None else torch.Generator().manual_seed(0)
            items = [self.sample(g) for _ in range(batch_size)]
            return default_collate([x[0] for x in items] if self.loss is not None else items)
        shape = (batch_size, *self.sample_shape)
        if self.input_dtype.is_floating_point:
            return torch.randn(shape, dtype=self.input_dtype, generator=generator)
        high = self.num_classes or 2
        return torch.randint(0, high, shape, dtype=self.input_dtype, generator=generator)

    def example_target(self, batch_size: int, generator: torch.Generator | None = None) -> torch.Tensor | None:
        """A random target batch (class ids) matching ``loss``; None when the model computes its own loss."""
        if self.loss is None:
            return None
        if self.sample is not None:
            g = generator if generator is not None else torch.Generator().manual_seed(0)
            return default_collate([self.sample(g)[1] for _ in range(batch_size)])
        return torch.randint(0, max(self.num_classes, 1), (batch_size, *self.target_shape), generator=generator)


def batch_rows(batch: Any) -> int | None:
    """The batch size of a batch (the first dimension of its first tensor)."""
    for leaf in pytree.tree_leaves(batch):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return int(leaf.shape[0])
    return None


def parse_spec(spec: str, what: str = "model") -> tuple[str, dict]:
    """Split ``name[k=v,...]`` into the name and keyword arguments (ints, floats, bools, strings)."""
    m = _SPEC.match(spec.strip())
    if not m:
        choices = f"a zoo name ({', '.join(zoo_names())}), hf:MODEL or " if what == "model" else ""
        raise UserError(f"cannot read {what} {spec!r}: use {choices}package.module:factory, "
                        "optionally followed by [key=value,...]")
    args = m.group("args")
    return m.group("target"), parse_args(f"[{args}]" if args is not None else "", spec, what)


def parse_args(bracket: str, spec: str, what: str = "model") -> dict:
    """``[k=v,...]`` (or "") -> keyword arguments (ints, floats, bools, strings)."""
    text = bracket.strip()
    if text and not (text.startswith("[") and text.endswith("]")):
        raise UserError(f"cannot read the arguments of {what} {spec!r}: write them as [key=value,...]")
    kwargs: dict = {}
    for item in filter(None, (x.strip() for x in text[1:-1].split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip().isidentifier():
            raise UserError(f"{what} argument {item!r} in {spec!r} is not key=value")
        if key.strip() in kwargs:
            raise UserError(f"{what} argument {key.strip()!r} is given twice in {spec!r}; give it once")
        kwargs[key.strip()] = _literal(value.strip())
    return kwargs


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

    if spec.strip().startswith("hf:"):
        from hybridpipe.profiles.zoo.hf import hf_spec

        return hf_spec(spec.strip())
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
    params = {k: v.default for k, v in inspect.signature(fn).parameters.items() if k != "spec"}
    check_options("zoo model", name, params, kwargs)


def check_options(what: str, name: str, defaults: dict[str, Any], kwargs: dict, *, least: int = 1) -> None:
    """Each of ``kwargs`` must be a key of ``defaults`` and of its default's type: true/false for a
    bool, a whole number >= ``least`` for an int, a finite number for a float (a default of another
    type, None included, takes any value). ``what`` ("zoo model") and ``name`` name the model in
    the one-line UserError."""
    for key, value in kwargs.items():
        if key not in defaults:
            raise UserError(f"{what} {name!r} has no option {key!r}; its options are {', '.join(defaults)}")
        default = defaults[key]
        if isinstance(default, bool):
            ok, want = isinstance(value, bool), "true or false"
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool) and value >= least
            want = f"a whole number >= {least}"
        elif isinstance(default, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            want = "a finite number"
        else:
            ok, want = True, ""
        if not ok:
            raise UserError(f"{what} option {key}={value} of {name!r} must be {want} "
                            f"(default {default}); e.g. {name}[{key}={default}]")


def build_skeleton(spec: str) -> nn.Module:
    """The model ``spec`` names, built without loading its weights or running it: parameters on the
    meta device (no memory), buffers as its constructor computes them. What its ``state_dict`` keys
    and shapes are, and a frame to write a merged state_dict out in the model's own format. A user's
    factory is only called (its example is not run); one that cannot build with its parameters on
    the meta device (it loads weights itself, say) is built on the CPU instead."""
    from hybridpipe.profiles.meta import parameters_on_meta

    text = spec.strip()
    if text.startswith("hf:"):
        from hybridpipe.profiles.zoo.hf import hf_spec

        model = hf_spec(text)
        build, who = model.skeleton or model.build, f"model {text!r}"
    else:
        target, kwargs = parse_spec(text)
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
                        f"{_message(e)})") from None


def _factory_skeleton(target: str, kwargs: dict) -> nn.Module:
    """The module a user's factory returns, built with its parameters on the meta device, else on
    the CPU (as every rank builds it); only a factory that fails on the CPU too is the user's error."""
    from hybridpipe.profiles.meta import parameters_on_meta

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
    if spec.startswith("hf:"):
        name, _, rest = spec.partition("[")
        kwargs = parse_args(f"[{rest}" if rest else "", spec)
        names = [x for x in str(kwargs.pop("leaf", "")).split("+") if x]
        names += [x for x in leaves if x not in names]
        return f"{name}[{','.join([*(f'{k}={v}' for k, v in kwargs.items()), 'leaf=' + '+'.join(names)])}]"
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


def shaped_like(example: Any) -> Callable[[torch.Generator], Any]:
    """Synthetic samples shaped like one row of ``example``: floats from N(0, 1), integers in the
    example's own range, booleans fair coin flips."""
    def draw(t: Any, g: torch.Generator) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        shape = tuple(t.shape[1:])
        if t.dtype == torch.bool:
            return torch.randint(0, 2, shape, generator=g).bool()
        if t.is_floating_point():
            return torch.randn(shape, generator=g).to(t.dtype)
        return torch.randint(0, int(t.max()) + 1 if t.numel() else 1, shape, generator=g, dtype=t.dtype)

    return lambda g: pytree.tree_map(lambda t: draw(t, g), example)
