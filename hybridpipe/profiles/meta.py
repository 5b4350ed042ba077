"""A model captured without its weights: parameters on the meta device, so a rank can load only its
own stage's tensors afterwards (runtime/lazy.py).

    with parameters_on_meta():
        model = spec.skeleton()                    # parameters: shapes only; buffers: real
    captured = capture_on_meta(model, example)      # the same graph capture_model makes on the CPU
    ...                                             # pick the stage, read its tensors
    replace_tensors([model, captured.graph], {id(old): new, ...})

Buffers stay real because a constructor computes some of them (rotary frequencies, causal masks)
and no file holds them (``persistent=False``). The capture itself runs on fake tensors
(``FakeTensorMode``, what torch.export traces with): the parameters, buffers and example stand in as
tensors without data that say they are on the CPU, so the graph is the one a capture of the whole
model on the CPU makes, node for node (its device constants the CPU's; the CPU kernels' strides,
where the meta device's differ; and under ``torch.autocast``, which has no meta device, the CPU's
autocast: a model that reads its activations' dtype, as RMSNorm does, reads bfloat16 as eagerly).
A capture that leaves the graph holding a tensor that is not the model's own (a constant the
forward created) raises :class:`NotOnMeta`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
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
    the capture runs with every parameter, buffer and ``example`` standing in as fake CPU tensors
    (see the module docstring), then the model and the graph get their own tensors back.
    :class:`NotOnMeta` when something else the graph holds is left without data. ``capture``:
    what captures (a capture cache's ``capture``, profiles/capture_cache.py; ``options`` go to it,
    ``autocast=`` among them)."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    cpu = torch.device("cpu")
    fakes: dict[int, torch.Tensor] = {}
    own: dict[int, torch.Tensor] = {}
    for t in [*model.parameters(), *model.buffers()]:
        fake: torch.Tensor = FakeTensor(mode, t, cpu) if t.is_meta else mode.from_tensor(t)
        if isinstance(t, nn.Parameter):
            fake = nn.Parameter(fake, requires_grad=t.requires_grad)
        fakes[id(t)] = fake
        own[id(fake)] = t
    replace_tensors([model], fakes)
    try:
        with mode:
            captured = capture(model, pytree.tree_map(lambda v: mode.from_tensor(v) if isinstance(v, torch.Tensor)
                                                      else v, example), **options)
    finally:
        replace_tensors([model], own)
    replace_tensors([captured.graph], own)
    constants = [str(n.target) for n in captured.graph.graph.nodes if n.op == "get_attr"]
    held = [*captured.graph.named_parameters(), *captured.graph.named_buffers(),
            *((name, _attribute(captured.graph, name)) for name in constants)]
    left = [name for name, t in held if isinstance(t, FakeTensor)]
    if left:
        raise NotOnMeta(f"the captured graph holds {left[0]!r}, which is not the model's own tensor and has no data "
                        "without the model's weights")
    return captured


def _attribute(root: Any, dotted: str) -> Any:
    """``root.a.b`` for ``"a.b"`` (None where a part is missing)."""
    for part in dotted.split("."):
        root = getattr(root, part, None)
    return root
