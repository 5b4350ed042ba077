"""A model captured without its weights: parameters on the meta device, so a rank can load only its
own stage's tensors afterwards (runtime/lazy.py).

    with parameters_on_meta():
        model = spec.skeleton()                    # parameters: shapes only; buffers: real
    captured = capture_on_meta(model, example)      # the same graph capture_model makes on the CPU
    ...                                             # pick the stage, read its tensors
    replace_tensors([model, captured.graph], {id(old): new, ...})

Buffers stay real because a constructor computes some of them (rotary frequencies, causal masks)
and no file holds them (``persistent=False``). torch.export records the device the tensors were on
as constants in the graph (``arange(..., device=meta)``); :func:`capture_on_meta` rewrites them to
the CPU, where the eager capture would have put them. A capture that still leaves a tensor on the
meta device that is not a parameter (a constant the forward created) raises :class:`NotOnMeta`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import fx, nn
from torch.utils.weak import WeakIdKeyDictionary

from hybridpipe.profiles.capture import CapturedModel, capture_model

META = torch.device("meta")


class NotOnMeta(Exception):
    """The model cannot be built or captured without its weights (the reason is the message)."""


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[list[nn.Parameter]]:
    """While inside, every parameter a module registers is moved to the meta device (no memory,
    no initialisation work); buffers are left as the constructor computes them. The same as
    accelerate's ``init_empty_weights(include_buffers=False)``: ``nn.Module.register_parameter``
    is wrapped for the duration (one thread builds at a time). Yields the list of the parameters
    registered, in order (one entry per registration: a parameter registered under two names
    twice; profiles/replay.py)."""
    register = nn.Module.register_parameter
    registered: list[nn.Parameter] = []
    moved = WeakIdKeyDictionary()             # a CPU parameter -> its meta stand-in (tied: registered again)

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param in moved:
            param = moved[param]
        register(module, name, param)
        held = module._parameters.get(name)
        if held is not None and held.device != META:
            stand_in = nn.Parameter(held.detach().to(META), requires_grad=held.requires_grad)
            stand_in.__dict__.update(held.__dict__)
            moved[held] = stand_in
            module._parameters[name] = held = stand_in
        if held is not None:
            registered.append(held)

    nn.Module.register_parameter = on_meta          # type: ignore[method-assign,assignment]
    try:
        yield registered
    finally:
        nn.Module.register_parameter = register     # type: ignore[method-assign]


def replace_tensors(roots: Iterable[nn.Module], new: Mapping[int, torch.Tensor]) -> int:
    """Put ``new[id(t)]`` wherever a parameter or buffer ``t`` is registered in the module trees of
    ``roots`` (a model and the graph modules that share its tensors); the number of places."""
    count = 0
    for root in roots:
        for module in root.modules():
            tables: tuple[dict[str, Any], ...] = (module._parameters, module._buffers)
            for table in tables:
                for key, value in table.items():
                    if value is not None and id(value) in new:
                        table[key] = new[id(value)]
                        count += 1
    return count


def capture_on_meta(model: nn.Module, example: Any, *, capture: Callable[..., CapturedModel] = capture_model,
                    **options: Any) -> CapturedModel:
    """:func:`capture_model` of a model whose parameters are on the meta device (its buffers real):
    the capture runs with buffers and ``example`` on the meta device, then the real buffers go back
    into the model and the graph, and the graph's device constants are the CPU's.
    :class:`NotOnMeta` when something else the graph holds is left without data. ``capture``:
    what captures (a capture cache's ``capture``, profiles/capture_cache.py; ``options`` go to it)."""
    real: dict[int, torch.Tensor] = {}
    to_meta: dict[int, torch.Tensor] = {}
    for _, b in model.named_buffers(remove_duplicate=False):
        if id(b) not in to_meta and b.device != META:
            shadow = torch.empty_like(b, device=META)
            to_meta[id(b)] = shadow
            real[id(shadow)] = b
    replace_tensors([model], to_meta)
    try:
        captured = capture(model, pytree.tree_map(_on_meta, example), **options)
    finally:
        replace_tensors([model], real)
    replace_tensors([captured.graph], real)
    params = {id(p) for p in model.parameters()}
    left = [name for name, t in [*captured.graph.named_parameters(), *captured.graph.named_buffers()]
            if t.device == META and id(t) not in params]
    if left:
        raise NotOnMeta(f"the captured graph holds {left[0]!r}, which is not the model's own parameter and has no "
                        "data on the meta device")
    retarget_devices(captured.graph, META, torch.device("cpu"))
    return captured


def retarget_devices(gm: fx.GraphModule, old: torch.device, new: torch.device) -> int:
    """Rewrite every ``device=old`` constant in ``gm``'s node arguments to ``new``; the number changed."""
    changed = 0

    def swap(value: Any) -> Any:
        nonlocal changed
        if isinstance(value, torch.device) and value.type == old.type:
            changed += 1
            return new
        return value

    for node in gm.graph.nodes:
        node.args = fx.node.map_aggregate(node.args, swap)
        node.kwargs = fx.node.map_aggregate(node.kwargs, swap)
    if changed:
        gm.recompile()
    return changed


def _on_meta(value: Any) -> Any:
    return value.to(META) if isinstance(value, torch.Tensor) else value
