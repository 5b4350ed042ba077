"""Leaf modules inside torch.export: every call of a leaf (``--leaf CLASS``) is one opaque call that
runs the module as written, eagerly, whatever its forward does (data-dependent routing over
experts, ``.item()``, Python loops, custom autograd Functions); the rest of the model is exported.

How: one eager forward of the model on the example records every leaf call (its inputs' structure
and its outputs' structure, shapes and dtypes). During the export each leaf's ``forward`` is
replaced by a call of the operator ``hybridpipe::leaf``, which torch.export records as one graph
node without looking inside; its fake implementation (what export runs instead of the module)
returns tensors shaped like the recorded outputs. Afterwards each such node is replaced by a
``call_module`` node on the leaf itself, so running the graph runs the module's own forward, and
autograd records the module's own backward (a custom Function's included).

Output sizes with dynamic shapes: an output dimension whose recorded size equals an input's size
at the same position (an input of the same rank first) follows that input's size; any other
dimension is the recorded constant (export then fixes the input sizes it depends on: the capture
holds for the example's shapes only, and says so in the log).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn

from hybridpipe.errors import UserError
from hybridpipe.profiles.export_support import side_effect_free

log = logging.getLogger(__name__)

Shape = tuple[int, ...]


@dataclass(frozen=True)
class LeafCall:
    """One call of a leaf module, as one eager forward of the model made it."""

    path: str                             # the module's qualified name in the model
    in_spec: pytree.TreeSpec              # structure of (args, kwargs)
    in_kinds: tuple[Any, ...]             # per flat input: "tensor", "int", or ("const", value)
    in_shapes: tuple[Shape, ...]          # the tensor inputs' shapes
    out_spec: pytree.TreeSpec             # structure of the output
    out_consts: dict[int, Any]            # flat output position -> its non-tensor value
    outs: tuple[tuple[Shape, torch.dtype, torch.device], ...]   # the tensor outputs


_CALLS: contextvars.ContextVar[dict[str, LeafCall]] = contextvars.ContextVar("hybridpipe_leaf_calls")


@torch.library.custom_op("hybridpipe::leaf", mutates_args=())
def _leaf_op(inputs: list[torch.Tensor], sizes: list[int], state: list[torch.Tensor], key: str) -> list[torch.Tensor]:
    """A leaf module's call while the model is exported (replaced by the module itself afterwards):
    its tensor and integer inputs, its parameters and buffers (``state``: so that the outputs
    require grad where the module's would, and a custom Function applied to them is seen)."""
    raise RuntimeError(f"hybridpipe::leaf ({key}) only stands for a leaf module during torch.export")


@_leaf_op.register_fake
def _leaf_fake(inputs: list[torch.Tensor], sizes: list[int], state: list[torch.Tensor],
               key: str) -> list[torch.Tensor]:
    call = _CALLS.get()[key]
    return [torch.empty(_size(shape, inputs, call.in_shapes), dtype=dtype, device=device)
            for shape, dtype, device in call.outs]


def _no_backward(ctx: Any, *grads: Any) -> Any:
    raise RuntimeError("hybridpipe::leaf has no backward: the leaf module itself runs in its place")


torch.library.register_autograd("hybridpipe::leaf", _no_backward)


def _size(shape: Shape, inputs: Sequence[torch.Tensor], recorded: Sequence[Shape]) -> list[Any]:
    """An output's sizes in terms of the inputs' (possibly symbolic) sizes."""
    return [inputs[src[0]].shape[src[1]] if isinstance(src, tuple) else src for src in size_sources(shape, recorded)]


def size_sources(shape: Shape, recorded: Sequence[Shape]) -> list[tuple[int, int] | int]:
    """Where each dimension of an output of recorded ``shape`` takes its size from: ``(input,
    dimension)``, the first input (those of the same rank first) with the same size at the same
    position, else the recorded size itself (a constant)."""
    order = sorted(range(len(recorded)), key=lambda i: len(recorded[i]) != len(shape))
    out: list[tuple[int, int] | int] = []
    for d, s in enumerate(shape):
        same = next((i for i in order if len(recorded[i]) > d and recorded[i][d] == s), None)
        out.append((same, d) if same is not None else s)
    return out


def leaf_paths(model: nn.Module, leaf_modules: Iterable[type | str]) -> list[str]:
    """Qualified names of the modules of a leaf class, outermost only (a leaf inside a leaf runs
    inside it), the model itself excluded."""
    leaf_modules = tuple(leaf_modules)
    types = tuple(x for x in leaf_modules if isinstance(x, type))
    names = {x for x in leaf_modules if isinstance(x, str)}
    out: list[str] = []
    for path, module in model.named_modules():
        cls = type(module)
        if not path or any(path.startswith(p + ".") for p in out):
            continue
        classes = {cls.__name__, cls.__qualname__, f"{cls.__module__}.{cls.__qualname__}"}
        if isinstance(module, types) or classes & names:
            out.append(path)
    return out


def record_calls(model: nn.Module, paths: Sequence[str], args: tuple, kwargs: dict) -> dict[str, LeafCall]:
    """Every call of the leaves at ``paths`` in one eager forward of ``model`` (which leaves no
    trace), keyed ``path#n`` for the n-th call of that module."""
    calls: dict[str, LeafCall] = {}
    counts: dict[str, int] = {}

    def hook(path: str):
        def after(module: nn.Module, a: tuple, kw: dict, output: Any) -> None:
            n = counts.get(path, 0)
            counts[path] = n + 1
            calls[f"{path}#{n}"] = _describe(path, a, kw, output)
        return after

    handles = [model.get_submodule(p).register_forward_hook(hook(p), with_kwargs=True) for p in paths]
    try:
        with side_effect_free(model), torch.no_grad():
            model(*args, **kwargs)
    finally:
        for h in handles:
            h.remove()
    return calls


def _describe(path: str, args: tuple, kwargs: dict, output: Any) -> LeafCall:
    flat, in_spec = pytree.tree_flatten((args, kwargs))
    kinds: list[Any] = []
    for v in flat:
        if isinstance(v, torch.Tensor):
            kinds.append("tensor")
        elif isinstance(v, int) and not isinstance(v, bool):
            kinds.append("int")
        else:
            kinds.append(("const", v))
    outs, out_spec = pytree.tree_flatten(output)
    return LeafCall(path=path, in_spec=in_spec, in_kinds=tuple(kinds),
                    in_shapes=tuple(tuple(v.shape) for v in flat if isinstance(v, torch.Tensor)),
                    out_spec=out_spec,
                    out_consts={i: v for i, v in enumerate(outs) if not isinstance(v, torch.Tensor)},
                    outs=tuple((tuple(v.shape), v.dtype, v.device) for v in outs if isinstance(v, torch.Tensor)))


@contextlib.contextmanager
def opaque_leaves(model: nn.Module, calls: dict[str, LeafCall]) -> Iterator[None]:
    """Within: each recorded leaf's forward is one ``hybridpipe::leaf`` call (for torch.export)."""
    paths = sorted({c.path for c in calls.values()})
    counts = dict.fromkeys(paths, 0)

    def opaque(path: str):
        def forward(*args: Any, **kwargs: Any) -> Any:
            key = f"{path}#{counts[path]}"
            counts[path] += 1
            if key not in calls:
                raise UserError(f"leaf module {path} is called more often while torch.export traces the model than "
                                "in an eager forward; make the number of its calls independent of the data")
            flat = pytree.tree_leaves((args, kwargs))
            tensors = [v for v in flat if isinstance(v, torch.Tensor)]
            sizes = [v for v in flat if isinstance(v, (int, torch.SymInt)) and not isinstance(v, bool)]
            state = [*modules[path].parameters(), *modules[path].buffers()]
            result = iter(_leaf_op(tensors, sizes, state, key))
            call = calls[key]
            leaves = [call.out_consts[i] if i in call.out_consts else next(result)
                      for i in range(call.out_spec.num_leaves)]
            return pytree.tree_unflatten(leaves, call.out_spec)
        return forward

    token = _CALLS.set(calls)
    modules = {p: model.get_submodule(p) for p in paths}
    try:
        for p, m in modules.items():
            m.forward = opaque(p)         # an instance attribute: nn.Module.__call__ (and its hooks) still run
        yield
    finally:
        for m in modules.values():
            del m.forward
        _CALLS.reset(token)


def inline_leaves(gm: fx.GraphModule, model: nn.Module, calls: dict[str, LeafCall]) -> None:
    """Replace every ``hybridpipe::leaf`` node of ``gm`` (an export of ``model`` under
    :func:`opaque_leaves`) by a call of the leaf module itself."""
    for path in sorted({c.path for c in calls.values()}):
        _set_submodule(gm, path, model.get_submodule(path))   # the model's own module: its parameters, its forward
    op = torch.ops.hybridpipe.leaf.default
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target is not op:
            continue
        tensors, sizes, _, key = node.args
        call = calls[key]
        it_t, it_s = iter(tensors), iter(sizes)
        flat = [next(it_t) if k == "tensor" else next(it_s) if k == "int" else k[1] for k in call.in_kinds]
        args, kwargs = pytree.tree_unflatten(flat, call.in_spec)
        with gm.graph.inserting_before(node):
            run = gm.graph.call_module(call.path, tuple(args), dict(kwargs))
            flat_out = gm.graph.call_function(tensor_leaves, (run,))
        vals = iter(node.meta.get("val") or [])
        run.meta = {**node.meta, "val": pytree.tree_unflatten(
            [call.out_consts[i] if i in call.out_consts else next(vals) for i in range(call.out_spec.num_leaves)],
            call.out_spec)}
        flat_out.meta = dict(node.meta)
        node.replace_all_uses_with(flat_out)
        gm.graph.erase_node(node)
    for node in list(gm.graph.nodes):
        if node.op == "get_attr" and not node.users:      # the leaves' own parameters: read by the module now
            gm.graph.erase_node(node)
    gm.graph.lint()
    gm.recompile()


def _set_submodule(root: nn.Module, path: str, module: nn.Module) -> None:
    """Put ``module`` at ``path`` in ``root``, making the missing modules on the way (a leaf
    without parameters has none in the exported graph)."""
    *parents, name = path.split(".")
    owner = root
    for part in parents:
        if not hasattr(owner, part):
            owner.add_module(part, nn.Module())
        owner = getattr(owner, part)
    setattr(owner, name, module)


def tensor_leaves(value: Any) -> list[torch.Tensor]:
    """The tensors of a leaf module's output, in order (what the exported graph reads of it)."""
    return [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]


__all__ = ["LeafCall", "size_sources", "leaf_paths", "record_calls", "opaque_leaves", "inline_leaves", "tensor_leaves"]
