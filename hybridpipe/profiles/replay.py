"""Build a part of a model with exactly the values one process gives it, never holding the rest.

One process does ``torch.manual_seed(seed); model = build()``: each parameter's values depend on
every random draw before it (construction order, then a Hugging Face model's ``post_init``
re-initialising every module). :func:`build_part` replays that construction so that the random
stream is consumed exactly as in one process, while only the parameters named in ``keep`` hold
memory:

1. :func:`registration_names` (from a build under :func:`~hybridpipe.profiles.meta.parameters_on_meta`,
   which records the order in which parameters are registered): the names the k-th registered
   parameter ends up under in the finished model (none when it is replaced later, like an LM
   head's own weight before it is tied to the embedding).
2. The build again, after ``torch.manual_seed(seed)``: a registered parameter whose names are all
   outside ``keep`` is moved to the meta device at registration (it was created on the CPU, so
   a random draw made before its registration, like ``nn.Parameter(torch.randn(...))``, happened
   for real). Every later random operation on a meta tensor (``uniform_``, ``normal_`` of an
   ``init`` function or of ``_init_weights``, ``randn_like``, ...: every operator tagged
   ``nondeterministic_seeded``) is run on a CPU scratch tensor of the same shape, strides and
   dtype (a view of one reused buffer, :class:`Scratch`), with the same arguments and generator:
   the generator advances exactly as it does in one process. torch.nn.init's ``trunc_normal_``,
   ``orthogonal_`` and ``sparse_`` return at once for a meta tensor; called on one, they first
   run on a scratch tensor (their draws, trunc_normal_'s value-dependent rejection sampling
   included). Other operations on meta tensors cost nothing.

Peak memory: the kept parameters, the buffers (computed by the constructors, as in one process),
the scratch buffer (the largest parameter that is not kept) and any tensor a constructor makes
with values before registering it as a parameter. The kept values are bitwise one process's:
the same operators run on the same generator states.

What cannot be replayed raises :class:`NotReplayable` (the caller builds the whole model
instead): a construction that registers other parameters than the recorded one (it depends on
the device of its parameters), reads a value from a parameter that is not kept (``.item()``, a
copy into a kept one), leaves a kept tensor without data, or draws ``multinomial`` from a tensor
that is not kept. Not told apart here: a construction that draws differently when a parameter is
on the meta device without failing (user code testing ``.is_meta``), or random operations on
meta tensors the constructor makes itself. :attr:`Part.digest` hashes every random operator run
and the generator's final state, so that builds keeping different parts can be compared (the
runtime compares its ranks': runtime/seeded.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

META = torch.device("meta")
CPU = torch.device("cpu")


class NotReplayable(Exception):
    """The part cannot be built alone with one process's values (the reason is the message)."""


@dataclass
class Part:
    """A model built by :func:`build_part`, and the digest of its construction's random draws:
    every random operator run (name, shapes, dtypes, scalar arguments) and the generator's state
    at the end. Builds of the same model keeping other parts give the same digest when the
    construction did not depend on which parameters were kept (runtime/seeded.py checks it
    across ranks)."""

    module: nn.Module
    digest: str


def registration_names(model: nn.Module, registered: Sequence[nn.Parameter]) -> list[tuple[str, ...]]:
    """For each parameter in ``registered`` (in registration order), every name it has in ``model``
    (several for a tied parameter; none when the model no longer holds it)."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return [tuple(names.get(id(p), ())) for p in registered]


def build_part(build: Callable[[], nn.Module], seed: int, keep: Collection[str],
               registrations: Sequence[tuple[str, ...]], shapes: Sequence[tuple[tuple[int, ...], torch.dtype]]
               ) -> Part:
    """``torch.manual_seed(seed); build()`` holding only the parameters named in ``keep`` (their
    values bitwise one process's); the others on the meta device. ``registrations`` and ``shapes``:
    each registered parameter's names (:func:`registration_names`) and (shape, dtype), from a build
    of the same model. The global random state is left as it was. :class:`NotReplayable` when the
    construction does not replay (see the module docstring)."""
    import torch._dynamo  # noqa: F401 - a dispatch mode's first operator imports it (torch._disable_dynamo):
    # imported here, not under the profile hook below, which every call of that import would pass through
    wanted = set(keep)
    scratch = Scratch()
    draws = _RandomOnScratch(scratch)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            with _keep_registered(registrations, shapes, wanted), draws, _inits_on_scratch(scratch):
                model = build()
        except NotReplayable:
            raise
        except Exception as e:      # noqa: BLE001 - whatever the construction did with a meta tensor
            raise NotReplayable(f"{type(e).__name__}: {_first_line(e)}") from None
        draws.trace.update(torch.get_rng_state().numpy().tobytes())
    empty = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if n in wanted and t.is_meta]
    if empty:
        raise NotReplayable(f"{empty[0]!r} was left without data (its values come from a parameter that is not kept)")
    return Part(model, draws.trace.hexdigest())


@contextlib.contextmanager
def _keep_registered(registrations: Sequence[tuple[str, ...]], shapes: Sequence[tuple[tuple[int, ...], torch.dtype]],
                     keep: set[str]) -> Iterator[None]:
    """While inside, the k-th parameter registered stays on the CPU when one of its names
    (``registrations[k]``) is in ``keep``, else moves to the meta device; a registration of
    another shape or dtype than recorded, or past the recorded ones, raises NotReplayable."""
    register = nn.Module.register_parameter
    moved = WeakIdKeyDictionary()                # a CPU parameter -> its meta stand-in (registered twice: tied)
    count = [0]

    def hook(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param in moved:
            param = moved[param]
        register(module, name, param)
        held = module._parameters.get(name)
        if held is None:
            return
        k = count[0]
        count[0] += 1
        if k >= len(registrations) or shapes[k] != (tuple(held.shape), held.dtype):
            raise NotReplayable(f"its construction registers parameters in another order than when recorded "
                                f"({type(module).__name__}.{name}, registration {k})")
        if held.is_meta or keep.intersection(registrations[k]):
            return
        stand_in = nn.Parameter(torch.empty_like(held, device=META), requires_grad=held.requires_grad)
        stand_in.__dict__.update(held.__dict__)
        moved[held] = stand_in
        module._parameters[name] = stand_in

    nn.Module.register_parameter = hook          # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.register_parameter = register     # type: ignore[method-assign]
    if count[0] != len(registrations):
        raise NotReplayable(f"its construction registered {count[0]} parameters, {len(registrations)} when recorded")


def _skipping_meta() -> dict[Any, Callable]:
    """torch.nn.init's functions that return at once for a meta tensor (their code -> them)."""
    found = [getattr(nn.init, name, None) for name in ("_no_grad_trunc_normal_", "orthogonal_", "sparse_")]
    return {f.__code__: f for f in found if f is not None}


@contextlib.contextmanager
def _inits_on_scratch(scratch: Scratch) -> Iterator[None]:
    """While inside, a call of torch.nn.init's ``trunc_normal_``, ``orthogonal_`` or ``sparse_``
    on a meta tensor (which they leave alone at once) first runs on a CPU scratch tensor of its
    shape, strides and dtype: the draws one process makes, those of trunc_normal_'s rejection
    sampling (as many as the values drawn ask for) included. A profile function sees the calls
    (``sys.setprofile``, chained to any already set)."""
    codes = _skipping_meta()
    previous = sys.getprofile()
    busy = [False]

    def profile(frame: Any, event: Any, arg: Any) -> None:
        if previous is not None:
            previous(frame, event, arg)
        fn = codes.get(frame.f_code) if event == "call" and not busy[0] else None
        tensor = frame.f_locals.get("tensor") if fn is not None else None
        if fn is None or not isinstance(tensor, torch.Tensor) or not tensor.is_meta:
            return
        args = dict(frame.f_locals)                 # at the call: its arguments only
        args["tensor"] = scratch.like([tensor])[0]
        busy[0] = True
        try:
            fn(**args)
        finally:
            busy[0] = False

    sys.setprofile(profile)
    try:
        yield
    finally:
        sys.setprofile(previous)


class _RandomOnScratch(TorchDispatchMode):
    """Every random operator that touches a meta tensor (or is asked for a meta result) also runs
    on CPU scratch tensors of the same shapes, strides and dtypes, so the generator it draws from
    advances as it would have on the CPU tensors the meta ones stand for. ``trace`` hashes every
    random operator run (on real or meta tensors): its name, tensor shapes and dtypes, other
    arguments."""

    def __init__(self, scratch: Scratch) -> None:
        super().__init__()
        self.trace = hashlib.sha256()
        self.scratch = scratch

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if torch.Tag.nondeterministic_seeded in func.tags:
            self.trace.update(_describe(func, args, kwargs).encode())
            if _touches_meta(args, kwargs):
                _draw_on_scratch(func, args, kwargs, self.scratch)
        return func(*args, **kwargs)


def _describe(func: Any, args: tuple, kwargs: dict) -> str:
    """One random operator call, device-blind: its name, each tensor's shape and dtype, the rest."""
    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return (tuple(x.shape), str(x.dtype))
        if isinstance(x, torch.device):
            return "device"
        if isinstance(x, torch.Generator):
            return "generator"
        return x
    return f"{func};{pytree.tree_map(one, (args, kwargs))!r}\n"


def _touches_meta(args: tuple, kwargs: dict) -> bool:
    leaves = pytree.tree_leaves((args, kwargs))
    return any((isinstance(x, torch.Tensor) and x.is_meta) or (isinstance(x, torch.device) and x.type == "meta")
               for x in leaves)


class Scratch:
    """One CPU byte buffer that every scratch tensor of a build is a view of (grown to the largest
    request, freed with the build): freed and reallocated tensors of a parameter's size would leave
    the C allocator holding pages it does not give back, a whole model's worth by the end."""

    def __init__(self) -> None:
        self.buffer = torch.empty(0, dtype=torch.uint8)

    def like(self, metas: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """CPU tensors of the shapes, strides and dtypes of ``metas``, each on its own bytes."""
        spans = [_span(x) for x in metas]
        if self.buffer.numel() < sum(spans):
            self.buffer = torch.empty(0, dtype=torch.uint8)
            self.buffer = torch.empty(sum(spans), dtype=torch.uint8)
        out, offset = [], 0
        for x, span in zip(metas, spans, strict=True):
            whole = self.buffer[offset:offset + span].view(x.dtype)
            out.append(whole.as_strided(tuple(x.shape), tuple(x.stride())))
            offset += span
        return out


def _span(x: torch.Tensor) -> int:
    """The bytes a tensor of ``x``'s shape and strides reaches, rounded up to 64."""
    if x.numel() == 0:
        return 64
    reach = 1 + sum((n - 1) * abs(st) for n, st in zip(x.shape, x.stride(), strict=True))
    return -(-reach * x.element_size() // 64) * 64


def _draw_on_scratch(func: Any, args: tuple, kwargs: dict, scratch: Scratch) -> None:
    """Run ``func`` with every meta tensor replaced by a CPU one of its shape, strides and dtype
    (the one written in place as it is; the others, read for their values -- a probability, a
    mean, a standard deviation -- filled with 0.5, which draws the same amount)."""
    if func.overloadpacket is torch.ops.aten.multinomial:
        raise NotReplayable("multinomial draws from a tensor that is not kept (its values decide how much it draws)")
    written = args[0] if args and func._schema.is_mutable and isinstance(args[0], torch.Tensor) else None
    metas = [x for x in pytree.tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.is_meta]
    on_cpu = dict(zip([id(x) for x in metas], scratch.like(metas), strict=True))
    for x in metas:
        if x is not written:
            on_cpu[id(x)].fill_(0.5)

    def swap(x: Any) -> Any:
        if isinstance(x, torch.device) and x.type == "meta":
            return CPU
        return on_cpu.get(id(x), x) if isinstance(x, torch.Tensor) else x

    func(*pytree.tree_map(swap, args), **pytree.tree_map(swap, kwargs))


def _first_line(e: BaseException) -> str:
    text = next((x.strip() for x in str(e).splitlines() if x.strip()), "")
    return text[:200]
