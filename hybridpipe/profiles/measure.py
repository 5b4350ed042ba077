"""Measuring one fx node in isolation: forward ms, backward ms and output bytes.

``reference_pass`` runs the graph once, node by node, and keeps every node's output detached,
with ``requires_grad`` set exactly as in the real model (true where the value depends on a
parameter). ``measure_node`` then replays one node on fresh copies of its real inputs: the
forward is timed with autograd recording (as in training), the backward from random output
gradients into the node's inputs and parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypedDict

import torch
from torch import fx

from hybridpipe.profiles.timing import median_ms


class Timing(TypedDict):
    """The keyword arguments every measurement below takes."""

    device: torch.device | str
    repeats: int
    warmup: int


@dataclass(frozen=True)
class NodeCost:
    forward_ms: float
    backward_ms: float
    activation_bytes: int


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside ``obj`` (nested tuples, lists and dicts), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for x in obj for t in tensors(x)]
    if isinstance(obj, dict):
        return [t for x in obj.values() for t in tensors(x)]
    return []


def nbytes(obj: Any) -> int:
    """Bytes of all tensors in ``obj`` at their real dtype."""
    return sum(t.numel() * t.element_size() for t in tensors(obj))


def map_tensors(fn: Callable[[torch.Tensor], Any], obj: Any) -> Any:
    """``obj`` with every tensor inside replaced by ``fn(tensor)``."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):   # named tuple
        return type(obj)(*(map_tensors(fn, x) for x in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(map_tensors(fn, x) for x in obj)
    if isinstance(obj, dict):
        return {k: map_tensors(fn, v) for k, v in obj.items()}
    return obj


def _leaf(t: torch.Tensor) -> torch.Tensor:
    """A detached copy-free leaf that requires grad iff ``t`` did (and can: floating point)."""
    return t.detach().requires_grad_(t.requires_grad and (t.is_floating_point() or t.is_complex()))


def _fresh(t: torch.Tensor) -> torch.Tensor:
    """A clone, so in-place ops never touch the stored value; autograd still reaches the leaf."""
    return t.clone()


def execute(interp: fx.Interpreter, node: fx.Node, env: dict[fx.Node, Any]) -> Any:
    """Run a non-placeholder ``node`` on fresh copies of its input values in ``env``."""
    args = fx.node.map_arg(node.args, lambda n: map_tensors(_fresh, env[n]))
    kwargs = fx.node.map_arg(node.kwargs, lambda n: map_tensors(_fresh, env[n]))
    if node.op == "output":
        return args[0]
    return getattr(interp, node.op)(node.target, args, kwargs)


def reference_pass(gm: fx.GraphModule, *inputs: Any) -> dict[fx.Node, Any]:
    """Every node's output for ``inputs``, detached, with the real model's ``requires_grad``."""
    interp = fx.Interpreter(gm)
    env: dict[fx.Node, Any] = {}
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(inputs) > len(placeholders):
        raise ValueError(f"the graph takes {len(placeholders)} inputs, got {len(inputs)}")
    with torch.enable_grad():
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                i = placeholders.index(node)
                value = inputs[i] if i < len(inputs) else node.args[0]   # a default argument
            else:
                value = execute(interp, node, env)
            env[node] = map_tensors(_leaf, value)
    return env


def measure_node(gm: fx.GraphModule, node: fx.Node, env: dict[fx.Node, Any], *, device: torch.device | str,
                 repeats: int, warmup: int) -> NodeCost:
    """Time ``node``'s forward and backward on its recorded inputs; bytes of what it outputs."""
    if node.op in ("placeholder", "output", "get_attr"):
        size = 0 if node.op == "output" else nbytes(env[node])
        return NodeCost(0.0, 0.0, size)
    interp = fx.Interpreter(gm)

    def forward(_: Any = None) -> Any:
        with torch.enable_grad():
            return execute(interp, node, env)

    fwd = median_ms(forward, device=device, repeats=repeats, warmup=warmup)
    differentiable = [t for t in tensors(env[node]) if t.requires_grad]
    bwd = 0.0
    if differentiable:
        grads = [torch.randn_like(t) for t in differentiable]

        def prepare() -> list[torch.Tensor]:
            gm.zero_grad(set_to_none=True)
            return [t for t in tensors(forward()) if t.requires_grad]

        def backward(outs: list[torch.Tensor]) -> None:
            torch.autograd.backward(outs, grads)

        bwd = median_ms(backward, prepare=prepare, device=device, repeats=repeats, warmup=warmup)
    return NodeCost(fwd, bwd, nbytes(env[node]))


def measure_loss(loss: Callable[[Any, Any], torch.Tensor], output: Any, target: Any, *,
                 device: torch.device | str, repeats: int, warmup: int) -> tuple[float, float]:
    """(forward ms, backward ms) of the loss on the model's recorded output."""
    def forward(_: Any = None) -> torch.Tensor:
        with torch.enable_grad():
            return loss(map_tensors(_fresh, output), target)

    fwd = median_ms(forward, device=device, repeats=repeats, warmup=warmup)
    if not forward().requires_grad:
        return fwd, 0.0
    bwd = median_ms(lambda value: value.backward(), prepare=forward, device=device, repeats=repeats, warmup=warmup)
    return fwd, bwd


def measure_optimizer(module: torch.nn.Module, kind: str, *, device: torch.device | str, repeats: int,
                       warmup: int) -> float:
    """Milliseconds of one optimizer step over every trainable parameter (``sgd``: momentum 0.9, as
    the runtime's default; ``adam``); the parameters are restored afterwards."""
    params = [p for p in {id(p): p for p in module.parameters()}.values() if p.requires_grad]
    if not params:
        return 0.0
    saved = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.randn_like(p)
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9) if kind == "sgd" else torch.optim.Adam(params, lr=1e-3)
    try:
        return median_ms(lambda _: opt.step(), device=device, repeats=repeats, warmup=warmup)
    finally:
        with torch.no_grad():
            for p, s in zip(params, saved, strict=True):
                p.copy_(s)
                p.grad = None


def measure_step(gm: fx.GraphModule, loss: Callable[[Any, Any], torch.Tensor], inputs: tuple[Any, ...],
                 target: Any, *, device: torch.device | str, repeats: int, warmup: int) -> float:
    """Milliseconds of one full forward + loss + backward of the whole graph (median)."""
    def step(_: Any) -> None:
        loss(gm(*inputs), target).backward()

    return median_ms(step, prepare=lambda: gm.zero_grad(set_to_none=True), device=device,
                     repeats=repeats, warmup=warmup)
