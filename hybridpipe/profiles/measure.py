"""Measuring each block of a captured model in isolation: forward ms, backward ms, bytes.

Every block is cut out as its own one-block stage (cut.py: the same graph surgery the pipeline
uses for its stages). ``reference_pass`` runs the blocks in order on the example batch and keeps every value that
crosses a block boundary, detached, with ``requires_grad`` exactly as in the real model (true
where the value depends on a parameter). ``measure_block`` then replays one block on fresh
copies of its real inputs: the forward timed with autograd recording (as in training), the
backward from random output gradients (the last block: from the loss) into the block's inputs and
parameters.

What a block keeps for its backward (``saved_tensors``) is split by where it lives: tensors of
the block's own (inner), the boundary values among its inputs and outputs that it saves (by name:
a value two blocks save is one tensor, which ``partitioner/search/modelcosts.py`` counts once per
stage), and, on the last block, what the loss function keeps beside the model's output. Storages
are what count (a view shares its base's bytes); parameters and buffers are not activations.

What a zero-bubble schedule's split backward leaves between its halves: ``weighthalf.py``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypedDict

import torch
import torch.utils._pytree as pytree
from torch import fx

from hybridpipe.errors import UserError
from hybridpipe.profiles.capture import CapturedModel, own_loss
from hybridpipe.profiles.cut import stage_boundaries, stage_graph_module
from hybridpipe.profiles.timing import median_ms
from hybridpipe.profiles.transient import PeakMeter

LossFn = Callable[[Any, Any], torch.Tensor]


class Timing(TypedDict):
    """The keyword arguments every measurement below takes."""

    device: torch.device | str
    repeats: int
    warmup: int


@dataclass(frozen=True)
class BlockModule:
    """One block as a callable graph (a one-block stage): ``inputs`` in, ``outputs`` out (the last
    block returns the model's flat output). ``produced`` are the outputs the block computes itself
    (the rest it only relays)."""

    module: fx.GraphModule
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    produced: tuple[str, ...]
    last: bool


@dataclass(frozen=True)
class BlockCost:
    forward_ms: float
    backward_ms: float
    output_bytes: int             # tensors the block hands to later blocks (or the model's output)
    saved: SavedSplit             # what autograd keeps from its forward for its backward
    forward_transient: int = 0    # bytes its forward allocates above the start and frees before it ends
    backward_transient: int = 0   # the most bytes above the start during its backward, gradients in included


@dataclass(frozen=True)
class SavedSplit:
    """What one forward of a block leaves for its backward (module docstring)."""

    inner_bytes: int              # distinct storages that are neither its inputs, its outputs nor parameters
    saves: tuple[str, ...]        # its inputs and produced outputs (value names) whose storage it saves
    loss_bytes: int = 0           # last block: what the loss function keeps besides the model's output


def tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor inside ``obj`` (nested tuples, lists, dicts, model outputs), in order."""
    return [t for t in pytree.tree_leaves(obj) if isinstance(t, torch.Tensor)]


def nbytes(obj: Any) -> int:
    """Bytes of all tensors in ``obj`` at their real dtype."""
    return sum(t.numel() * t.element_size() for t in tensors(obj))


def block_modules(captured: CapturedModel) -> list[BlockModule]:
    """Every block of ``captured`` cut out as a one-block stage (profiles/cut.py)."""
    n = len(captured.blocks)
    out = []
    for b in stage_boundaries(captured, [(i, i) for i in range(n)]):
        last = b.index == n - 1
        produced = tuple(v for v in b.outputs if v not in b.relayed)
        out.append(BlockModule(stage_graph_module(captured, b, last), b.inputs, b.outputs, produced, last))
    return out


def _leaf(value: Any) -> Any:
    """A detached copy-free leaf that requires grad iff ``value`` did (and can: floating point)."""
    if isinstance(value, torch.Tensor):
        return value.detach().requires_grad_(value.requires_grad and (value.is_floating_point() or value.is_complex()))
    return value


def _fresh(value: Any) -> Any:
    """A clone, so in-place ops never touch the stored value; autograd still reaches the leaf."""
    return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, value)


def reference_pass(captured: CapturedModel, blocks: Sequence[BlockModule], batch: Any,
                   autocast: torch.dtype | None = None) -> dict[str, Any]:
    """Every value that crosses a block boundary for ``batch``, detached, with the real ``requires_grad``;
    the model's output under ``"__output__"`` (under ``torch.autocast`` to ``autocast`` where given)."""
    env: dict[str, Any] = {k: _leaf(v) for k, v in captured.flatten_input(batch).items()}
    device = next((t.device for t in tensors(batch)), torch.device("cpu"))
    with torch.enable_grad(), _autocast(device, autocast):
        for b in blocks:
            result = b.module(*(env[name] for name in b.inputs))
            if b.last:
                env["__output__"] = pytree.tree_map(_leaf, captured.rebuild_output(result))
            else:
                env.update({name: pytree.tree_map(_leaf, v) for name, v in zip(b.outputs, result, strict=True)})
    return env


def measure_block(captured: CapturedModel, block: BlockModule, env: dict[str, Any], *, loss: LossFn | None,
                  target: Any, device: torch.device | str, repeats: int, warmup: int,
                  autocast: torch.dtype | None = None) -> BlockCost:
    """Time ``block``'s forward and backward on its recorded inputs (the last block: with the loss);
    forwards (and the loss) under ``torch.autocast`` to ``autocast`` where given, as the engine runs them."""
    def run(inputs: list[Any], keep_output: bool = False) -> Any:
        with torch.enable_grad(), _autocast(device, autocast):
            result = block.module(*inputs)
            if block.last:
                output = captured.rebuild_output(result)
                value = loss(output, target) if loss is not None else _own_loss(output)
                return (value, output) if keep_output else value     # the engine keeps the model's output
            return result

    def forward(_: Any = None) -> Any:
        return run([_fresh(env[name]) for name in block.inputs])

    fwd = median_ms(forward, device=device, repeats=repeats, warmup=warmup)
    saved = saved_split(captured, block, env, loss=loss, target=target, autocast=autocast, device=device)
    fwd_transient = forward_transient(run, [_fresh(env[name]) for name in block.inputs], device)
    outs = [t for t in tensors(forward()) if t.requires_grad]
    bwd, bwd_transient = 0.0, 0
    if outs:
        grads = [torch.ones_like(t) if t.dim() == 0 else torch.randn_like(t) for t in outs]

        def prepare() -> list[torch.Tensor]:
            block.module.zero_grad(set_to_none=True)
            return [t for t in tensors(forward()) if t.requires_grad]

        bwd = median_ms(lambda o: torch.autograd.backward(o, grads), prepare=prepare, device=device,
                        repeats=repeats, warmup=warmup)
        del outs
        bwd_transient = backward_transient(prepare(), grads, device)
        block.module.zero_grad(set_to_none=True)
    size = nbytes(env["__output__"]) if block.last else sum(nbytes(env[name]) for name in block.produced)
    return BlockCost(fwd, bwd, size, saved, fwd_transient, bwd_transient)


def forward_transient(run: Callable[..., Any], inputs: list[Any], device: torch.device | str) -> int:
    """Bytes ``run(inputs, keep_output=True)`` allocates at its peak beyond what it leaves allocated (its
    outputs, the model's output on the last block, and what autograd saves): its kernels' temporaries
    (profiles/transient.py)."""
    with PeakMeter(device) as meter:
        result = run(inputs, keep_output=True)
    del result
    return meter.transient


def backward_transient(outputs: list[torch.Tensor], grads: list[torch.Tensor], device: torch.device | str) -> int:
    """The most bytes a backward from ``outputs`` with ``grads`` holds above its start, the incoming
    gradients counted (they arrive from the next block's backward): gradients flowing through it,
    the parameters' new gradients (an accumulation's addend), its kernels' temporaries."""
    with PeakMeter(device) as meter:
        torch.autograd.backward(outputs, grads)
    return meter.peak + sum(g.numel() * g.element_size() for g in grads)


def _autocast(device: torch.device | str, dtype: torch.dtype | None) -> contextlib.AbstractContextManager:
    """``torch.autocast`` on ``device``'s type to ``dtype`` (None: a context that does nothing)."""
    return contextlib.nullcontext() if dtype is None else torch.autocast(torch.device(device).type, dtype=dtype)


def _own_loss(output: Any) -> torch.Tensor:
    loss = own_loss(output)
    if loss is None:
        raise UserError(f"the model returned a {type(output).__name__} without a loss and has no loss function")
    return loss


def storage_keys(obj: Any) -> set[int]:
    """The storages behind every tensor in ``obj``."""
    return {_storage(t)[0] for t in tensors(obj)}


def _storage(t: torch.Tensor) -> tuple[int, int]:
    try:
        return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
    except (RuntimeError, NotImplementedError):      # tensors without storage (subclasses, fakes)
        return id(t), t.numel() * t.element_size()


class _SavedStorages:
    """Storages autograd saves inside the context (their pointers stay valid while the graph lives)."""

    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        ptr, size = _storage(t)
        self.sizes[ptr] = max(self.sizes.get(ptr, 0), size)
        # detached: a saved output kept as itself would hold its own grad_fn, a cycle through C++ that
        # Python's collector never frees (the whole graph, parameters and activations, leaked per block)
        return t.detach()

    def __enter__(self) -> _SavedStorages:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


def saved_split(captured: CapturedModel, block: BlockModule, env: dict[str, Any], *, loss: LossFn | None,
                target: Any, autocast: torch.dtype | None = None, device: torch.device | str = "cpu") -> SavedSplit:
    """What one forward of ``block`` on fresh copies of its recorded inputs keeps for the backward."""
    fixed = {t.untyped_storage().data_ptr() for t in (*block.module.parameters(), *block.module.buffers())}
    inputs = {name: _fresh(env[name]) for name in block.inputs}
    with torch.enable_grad(), _autocast(device, autocast), _SavedStorages() as in_block:
        result = block.module(*inputs.values())
    if block.last:
        output = captured.rebuild_output(result)
        values = {}
        with torch.enable_grad(), _autocast(device, autocast), _SavedStorages() as in_loss:
            kept = loss(output, target) if loss is not None else None
        skip = fixed | storage_keys(output) | set(in_block.sizes)
        loss_bytes = sum(size for ptr, size in in_loss.sizes.items() if ptr not in skip)
        del kept
        outside = storage_keys(output)
    else:
        values = {name: v for name, v in zip(block.outputs, result, strict=True) if name in block.produced}
        loss_bytes, outside = 0, set()
    named = {**{n: storage_keys(v) for n, v in inputs.items()}, **{n: storage_keys(v) for n, v in values.items()}}
    boundary = set().union(outside, *named.values())
    inner = sum(size for ptr, size in in_block.sizes.items() if ptr not in fixed and ptr not in boundary)
    saves = tuple(name for name, keys in named.items() if keys & set(in_block.sizes))
    del result
    return SavedSplit(inner, saves, loss_bytes)


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


def measure_step(run_loss: Callable[[], torch.Tensor], module: torch.nn.Module, *, device: torch.device | str,
                 repeats: int, warmup: int) -> float:
    """Milliseconds of one full forward + loss + backward of the whole model (median)."""
    return median_ms(lambda _: run_loss().backward(), prepare=lambda: module.zero_grad(set_to_none=True),
                     device=device, repeats=repeats, warmup=warmup)
