"""A model spec's base: the ``ModelSpec`` a model is built, fed and trained from, the ``name[k=v,...]``
syntax, and calling the user's code with one-line errors. Resolving a name to a spec is ``registry.py``.

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
import math
import os
import re
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils.data import default_collate

from hybridpipe.errors import UserError

_SPEC = re.compile(r"^(?P<target>[A-Za-z_][\w.\-]*(?::[A-Za-z_]\w*)?)(?:\[(?P<args>(?:[^\[\]]|\[[^\[\]]*\])*)\])?$")


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
    leaf_modules: tuple[type | str, ...] = ()   # module types / class names kept whole, run as written
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


def parse_spec(spec: str, what: str = "model", choices: str = "") -> tuple[str, dict]:
    """Split ``name[k=v,...]`` into the name and keyword arguments (ints, floats, bools, strings);
    ``choices`` (e.g. "a zoo name (...), hf:MODEL or ") goes before package.module:factory in the error."""
    m = _SPEC.match(spec.strip())
    if not m:
        raise UserError(f"cannot read {what} {spec!r}: use {choices}package.module:factory, "
                        "optionally followed by [key=value,...]")
    args = m.group("args")
    return m.group("target"), parse_args(f"[{args}]" if args is not None else "", spec, what)


def parse_args(bracket: str, spec: str, what: str = "model") -> dict:
    """``[k=v,...]`` (or "") -> keyword arguments (ints, floats, bools, strings, lists of them in
    brackets: ``hidden_sizes=[8,16]``, and dicts in braces, ``k=v`` or JSON's ``"k": v``:
    ``rope_scaling={rope_type=linear,factor=2.0}``)."""
    text = bracket.strip()
    if text and not (text.startswith("[") and text.endswith("]")):
        raise UserError(f"cannot read the arguments of {what} {spec!r}: write them as [key=value,...]")
    kwargs: dict = {}
    for item in filter(None, (x.strip() for x in _split_top(text[1:-1]))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip().isidentifier():
            raise UserError(f"{what} argument {item!r} in {spec!r} is not key=value")
        if key.strip() in kwargs:
            raise UserError(f"{what} argument {key.strip()!r} is given twice in {spec!r}; give it once")
        kwargs[key.strip()] = _literal(value.strip())
    return kwargs


def _split_top(text: str) -> list[str]:
    """``text`` split at the commas outside brackets and braces."""
    parts, depth, start = [], 0, 0
    for i, c in enumerate(text):
        depth += (c in "[{") - (c in "]}")
        if c == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def _literal(text: str):
    if len(text) >= 2 and text[0] == "[" and text[-1] == "]":
        return [_literal(x.strip()) for x in _split_top(text[1:-1]) if x.strip()]
    if len(text) >= 2 and text[0] == "{" and text[-1] == "}":
        return dict(_entry(x.strip()) for x in _split_top(text[1:-1]) if x.strip())
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        return text[1:-1]
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for cast in (int, float):
        try:
            return cast(text)
        except ValueError:
            pass
    return text


def _entry(item: str) -> tuple[str, Any]:
    """One ``k=v`` or ``"k": v`` entry of a dict in braces (the key's quotes dropped)."""
    cut = min((i for i in (item.find("="), item.find(":")) if i > 0), default=-1)
    if cut < 0:
        raise UserError(f"cannot read {item!r} in a {{...}} value: write key=value or \"key\": value")
    key = item[:cut].strip().strip("\"'")
    return key, _literal(item[cut + 1:].strip())


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
            whole = isinstance(value, int) and not isinstance(value, bool)
            ok = whole and least <= value < 2 ** 63          # torch's int64: a larger size overflows in any op
            want = "a whole number below 2**63" if whole and value >= 2 ** 63 else f"a whole number >= {least}"
        elif isinstance(default, float):
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            want = "a finite number"
        else:
            ok, want = True, ""
        if not ok:
            shown = repr(value) if isinstance(value, str) else value     # a string may hold a newline
            raise UserError(f"{what} option {key}={shown} of {name!r} must be {want} "
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
        raise UserError(f"{who} raised {type(e).__name__}: {error_text(e)}{_location(e)}") from None


def error_text(e: BaseException) -> str:
    """An exception's message in one line (its first, at most 300 characters)."""
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
    quoted = f"`{spec}`" if spec.isprintable() else repr(spec)     # a newline in it: escaped, one line
    return f"your model {quoted}" if ":" in spec.split("[")[0] else f"zoo model {spec!r}"


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
                        f"{error_text(e)}{_location(e)}") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise UserError(f"{module_name!r} has no callable {attr!r} to build the {what}")
    return factory


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
