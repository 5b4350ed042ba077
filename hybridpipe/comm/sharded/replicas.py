"""ShardedReplicas: a replicated stage whose replicas shard optimizer state, gradients, weights (ZeRO-1/2/3).

The stage's sync units (the plan's, as HybridDataParallel runs them) are laid out as flat vectors
(the unit's parameters end to end); after the unit's reduce-scatter each position of the replica
group owns one contiguous range of it (:mod:`.halves`). Backward's post-accumulate-grad hooks start
a unit's reduce-scatter on a background lane as soon as its gradients are complete:

* ``optimizer`` (ZeRO-1): on the backward that completes the step's gradients (outside
  ``no_sync``), in place on the parameters' ``.grad``; the owned range then holds the replicas' sum.
* ``gradients`` (ZeRO-2): on every backward (every micro-batch), summed into this position's
  owned gradient (1/R of the unit); the full gradients are dropped at once, and a unit waits for
  the one before it to be reduced (back-pressure: the lane would otherwise fall behind the backward
  and hold several micro-batches' gradients), so at most the largest unit is in flight.

* ``parameters`` (ZeRO-3): gradients as ``gradients``; the weights too are kept as the owned ranges
  only (:class:`~.gathered.UnitWeights`), each unit gathered for its uses (pipeline/zero3.py puts
  the gates in the stage's graph) and, with ``reshard_after_forward``, freed after each forward and
  after its backward, else kept until the step's update.

The optimizer (runtime/sharded_optimizer.py) updates the owned ranges (:meth:`owned_views`,
:meth:`owned_grads`) and :meth:`gather_weights` all-gathers the updated weights: ZeRO-1/2 on a
gated stage (pipeline/zero3.py) at once, blocking (the default: the module's weights are whole
between steps), or with ``overlap_gather`` by queueing each unit's all-gather, waited for just before
the next forward's first use of the unit (not shown faster on 2 loaded cores: benchmarks/RESULTS.md;
the module's weights are then whole only inside :func:`whole_weights`); ZeRO-3 frees the stale
full weights (the next use gathers them). :func:`whole_weights` makes them whole for a checkpoint. Gradients are
*summed* (the engine's Step scales them) and, with ``wire_dtype``, travel in that dtype.
Parameters outside the units (``exclude``: tied weights, summed by the TiedSync) are not sharded.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from hybridpipe.comm.engine import CommLane, Handle
from hybridpipe.comm.hybrid_dp.policy import SyncUnit, UnitChoice, units_from_choices
from hybridpipe.comm.hybrid_dp.units import model_layers
from hybridpipe.comm.sharded.gathered import LazyGathers, UnitWeights
from hybridpipe.comm.sharded.halves import Halves, HalvesRunner, plan_halves

LEVELS = ("optimizer", "gradients", "parameters")


@dataclass(frozen=True)
class Piece:
    """Elements ``[lo, hi)`` of one parameter's flat view that this position owns."""

    param: nn.Parameter
    lo: int
    hi: int


@dataclass
class UnitShard:
    """A sync unit laid out flat, its halves and this position's pieces of it."""

    unit: SyncUnit
    halves: Halves
    pieces: list[Piece]
    grads: list[torch.Tensor | None] = field(default_factory=list)   # ZeRO-2: the owned gradient per piece
    ready: set[int] = field(default_factory=set)                     # params whose grad came this backward


def _pieces(params: Sequence[nn.Parameter], lo: int, hi: int) -> list[Piece]:
    out, start = [], 0
    for p in params:
        a, b = max(lo, start), min(hi, start + p.numel())
        if a < b:
            out.append(Piece(p, a - start, b - start))
        start += p.numel()
    return out


class ShardedReplicas:
    """The engine's sync for a stage sharded at ``level`` (module docstring). ``transport``: the
    replica group's GroupTransport (or the in-process one); ``units``: the plan's sync units."""

    def __init__(self, module: nn.Module, transport: Any, units: Sequence[UnitChoice], level: str, *,
                 exclude: Collection[nn.Parameter] = (), wire_dtype: torch.dtype | None = None,
                 hosts: Sequence[Sequence[int]] | None = None, torus_shape: tuple[int, int] | None = None,
                 lane: int = 1, reshard_after_forward: bool = True, overlap_gather: bool = False,
                 varying: Collection[nn.Parameter] | None = None):
        if level not in LEVELS:
            raise ValueError(f"shard level {level!r} is not one this runtime runs; choose {', '.join(LEVELS)}")
        self.module, self.level, self.wire_dtype = module, level, wire_dtype
        self.reshard_after_forward = reshard_after_forward
        self.size, self.position = transport.size, transport.position
        self._runner = HalvesRunner(transport, lane)
        self._lane = CommLane(f"hybridpipe-zero-lane{lane}")
        self.units = [UnitShard(u, h := plan_halves(u.algorithm, self.size, sum(p.numel() for p in u.params),
                                                    units=hosts, shape=torus_shape),
                                _pieces(u.params, *h.owned[self.position]))
                      for u in units_from_choices(model_layers(module, exclude), units)]
        self._shard_of = {id(p): s for s in self.units for p in s.unit.params}
        self._pending: list[Handle] = []
        self._syncing = True
        self._lock = threading.Lock()
        self._inflight = 0                # ZeRO-2: bytes of full gradients handed to the lane, not yet reduced
        self.peak_inflight = 0            # ... at most, over the last step's backwards
        self._fresh = True
        self._cap = max((sum(p.numel() * p.element_size() for p in s.unit.params) for s in self.units), default=0)
        self._gathered = 0                # ZeRO-3: bytes of full weights gathered now
        self.peak_transient = 0           # ... most full weights and gradients alive at once, last step
        self._fresh_transient = True
        self.weights = UnitWeights([s.unit.params for s in self.units], [s.pieces for s in self.units],
                                   [(s.halves.all_gather, s.halves.algorithm) for s in self.units], self._runner,
                                   self._lane, self._count_gathered) if level == "parameters" else None
        # what the stage's gates (pipeline/zero3.py) wait on: ZeRO-3's weights, or ZeRO-1/2's gathers
        self.gates: UnitWeights | LazyGathers | None = self.weights or (
            LazyGathers([s.unit.params for s in self.units], [(s.halves.all_gather, s.halves.algorithm)
                                                             for s in self.units], self._runner, self._lane)
            if overlap_gather else None)
        self._got: set[int] = set()       # ids of the parameters that had a gradient at a launch this step
        # units holding a parameter whose gradient may come on some replicas or steps only (a leaf
        # module's): agree_present asks the other replicas, and they are reduce-scattered once, at finish
        varied = {id(p) for p in (self.sharded if varying is None else varying)}
        self._deferred = {id(u) for u in self.units if any(id(p) in varied for p in u.unit.params)}
        self._varying = bool(self._deferred)
        if self.weights is not None:    # ZeRO-3: which of them a backward regathers would vary too
            self.weights.pinned = {i for i, u in enumerate(self.units) if id(u) in self._deferred}
        self._deferred_sent = False
        self._present: set[int] | None = None   # ... on any replica (agree_present); None: not agreed yet
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready)
                       for s in self.units for p in s.unit.params]

    # ---- what the optimizer sees -----------------------------------------------------------
    @property
    def sharded(self) -> list[nn.Parameter]:
        """The parameters whose state is split across the replicas."""
        return [p for s in self.units for p in s.unit.params]

    def pieces(self) -> list[Piece]:
        """This position's owned pieces, unit by unit."""
        return [pc for s in self.units for pc in s.pieces]

    def owned_views(self) -> list[torch.Tensor]:
        """The weights of each piece as the optimizer updates them: views into the parameters, or
        (ZeRO-3) the owned pieces themselves."""
        if self.weights is not None:
            return [t for ts in self.weights.owned for t in ts]
        return [pc.param.detach().view(-1)[pc.lo:pc.hi] for pc in self.pieces()]

    def owned_grads(self) -> list[torch.Tensor | None]:
        """The summed gradient of each piece (None where the step produced none: after
        :meth:`agree_present`, also where no replica computed one for the piece's parameter), after :meth:`finish`."""
        if self.level != "optimizer":
            grads = [g for s in self.units for g in (s.grads or [None] * len(s.pieces))]
        else:
            grads = [pc.param.grad.view(-1)[pc.lo:pc.hi] if pc.param.grad is not None else None
                     for s in self.units for pc in s.pieces]
        present = self._present
        if present is None:
            return grads
        return [g if id(pc.param) in present else None for pc, g in zip(self.pieces(), grads, strict=True)]

    def agree_present(self) -> None:
        """Agree with the other replicas which sharded parameters got a gradient this step (after
        :meth:`finish`). A unit is reduce-scattered whole, a parameter without a gradient counted as
        zeros; one that no replica computed a gradient for (an expert no token chose) then gets None
        from :meth:`owned_grads`, so the optimizer leaves it alone as torch's leave a parameter whose
        ``.grad`` is None (no weight decay, no momentum, its step count kept). Collective (one sum of
        a flag per parameter) where the constructor's ``varying`` parameters are sharded here (run by
        modules a graph calls as they are, or ``varying=None``: any); elsewhere every replica computes
        the same parameters' gradients and its own record is the answer."""
        params = self.sharded
        if not self._varying:
            self._present = set(self._got)
            return
        flags = torch.zeros(max(len(params), self.size), device=params[0].device)
        flags[:len(params)] = torch.tensor([float(id(p) in self._got) for p in params])
        self.sum_replicas(flags)
        self._present = {id(p) for p, f in zip(params, flags.tolist(), strict=False) if f > 0}

    def drop_grads(self) -> None:
        """Forget the step's gradients (the optimizer's zero_grad)."""
        self._fresh = self._fresh_transient = True
        self._got.clear()
        self._present = None
        self._deferred_sent = False
        for s in self.units:
            s.grads = []
            for p in s.unit.params:
                p.grad = None

    def full_grad_bytes(self) -> int:
        """Bytes of gradients this position holds at the step's peak: all (ZeRO-1), or its owned
        ranges plus the full gradients that were in flight at once (ZeRO-2: measured over the last
        step; at least the largest unit, which the backward holds whole before its reduce-scatter),
        plus the deferred units' (a leaf module's: held whole over the step)."""
        def nbytes(ps: Sequence[nn.Parameter]) -> int:
            return sum(p.numel() * p.element_size() for p in ps)
        if self.level == "optimizer":
            return nbytes(self.sharded)
        owned = sum((pc.hi - pc.lo) * pc.param.element_size() for pc in self.pieces())
        held = sum(nbytes(s.unit.params) for s in self.units if id(s) in self._deferred)
        if self.weights is not None:         # ZeRO-3: the full weights gathered and gradients in flight at once
            return owned + self.peak_transient + held
        return owned + held + max([self.peak_inflight] + [nbytes(s.unit.params) for s in self.units
                                                          if id(s) not in self._deferred])

    def _count_gathered(self, delta: int) -> None:
        with self._lock:
            if self._fresh_transient:        # the first change of a step: the last step's peak is over
                self.peak_transient, self._fresh_transient = self._gathered + self._inflight, False
            self._gathered += delta
            self.peak_transient = max(self.peak_transient, self._gathered + self._inflight)

    # ---- backward ---------------------------------------------------------------------------
    def _grad_ready(self, param: torch.Tensor) -> None:
        if not self._syncing and self.level == "optimizer":
            return
        shard = self._shard_of[id(param)]
        if id(shard) in self._deferred:       # reduce-scattered at finish: the same count on every replica
            return
        if id(param) in shard.ready:          # a second backward before the unit completed: send the first
            self._launch(shard)
        shard.ready.add(id(param))
        if len(shard.ready) == len(shard.unit.params):
            self._launch(shard)

    def _launch(self, shard: UnitShard) -> None:
        shard.ready.clear()
        self._got.update(id(p) for p in shard.unit.params if p.grad is not None)
        if self.level == "optimizer":              # the sum lands in .grad: give every parameter one
            for p in shard.unit.params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in shard.unit.params]
        if self.level != "optimizer":
            for p in shard.unit.params:
                p.grad = None
            if self.weights is not None and self.reshard_after_forward:
                self.weights.free(self.units.index(shard))       # its backward is done
            nbytes = sum(g.numel() * g.element_size() for g in grads)
            while self._pending and self._inflight + nbytes > self._cap:    # back-pressure: one unit in flight
                self._pending.pop(0).wait()
            with self._lock:
                if self._fresh:
                    self.peak_inflight, self._fresh = 0, False
                if self._fresh_transient:
                    self.peak_transient, self._fresh_transient = self._gathered, False
                self._inflight += nbytes
                self.peak_inflight = max(self.peak_inflight, self._inflight)
                self.peak_transient = max(self.peak_transient, self._gathered + self._inflight)
        self._pending.append(self._lane.submit(self._reduce, shard, grads, name=shard.unit.name))

    def _reduce(self, shard: UnitShard, grads: list[torch.Tensor]) -> None:
        wire = self.wire_dtype if self.wire_dtype is not None and grads[0].is_floating_point() else grads[0].dtype
        moving = [g.to(wire) for g in grads] if wire != grads[0].dtype else grads
        self._runner.run(shard.halves.reduce_scatter, moving, shard.halves.algorithm)
        owned = [m.view(-1)[pc.lo:pc.hi] for pc in shard.pieces for m in [moving[_index(shard, pc.param)]]]
        if self.level == "optimizer":
            if moving is not grads:
                for pc, o in zip(shard.pieces, owned, strict=True):
                    grads[_index(shard, pc.param)].view(-1)[pc.lo:pc.hi].copy_(o)
            return
        if not shard.grads:
            shard.grads = [o.to(pc.param.dtype, copy=True) for pc, o in zip(shard.pieces, owned, strict=True)]
        else:
            for acc, o in zip(shard.grads, owned, strict=True):
                if acc is not None:
                    acc.add_(o)
        with self._lock:
            self._inflight -= sum(g.numel() * g.element_size() for g in grads)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """ZeRO-1: backward inside accumulates locally; ZeRO-2 reduce-scatters every backward."""
        before = self._syncing
        self._syncing = False
        try:
            yield
        finally:
            self._syncing = before

    def finish(self) -> None:
        """The step's gradients are complete (its last backward ran): start the units a backward left
        partly complete and, once a step, the deferred units (a leaf module's: every replica
        reduce-scatters each of them once, whatever its micro-batches used), then wait for every
        reduce-scatter. A unit reduce-scattered as the backward completes it could be sent a different
        number of times, or in another order, on a replica whose micro-batches gave some of its
        parameters no gradient (an expert no token chose): the replicas' collectives fell out of step."""
        if not self._deferred_sent:
            for s in self.units:
                if id(s) in self._deferred:
                    self._launch(s)
            self._deferred_sent = bool(self._deferred)
        self._settle()

    def _settle(self) -> None:
        """Start the units a backward left partly complete, then wait for every reduce-scatter."""
        for s in self.units:
            if s.ready:
                self._launch(s)
        pending, self._pending = self._pending, []
        for h in pending:
            h.wait()

    # ---- after the step ---------------------------------------------------------------------
    def gather_weights(self) -> None:
        """All-gather every unit's updated weights from their owners (blocking); ZeRO-3: free the
        stale full weights (each unit's next use gathers it)."""
        if self.weights is not None:
            self.weights.free_all()
            return
        if isinstance(self.gates, LazyGathers) and self.gates.gated:      # waited for by the next forward's gates
            self.gates.start()
            return
        self.gather([[p.detach() for p in s.unit.params] for s in self.units])

    def gather(self, per_unit: Sequence[Sequence[torch.Tensor]]) -> None:
        """All-gather, unit by unit, tensors laid out like the unit's parameters (each filled on
        its owned pieces: weights, or an optimizer state's full copy), in place."""
        handles = [self._lane.submit(self._runner.run, s.halves.all_gather, list(ts), s.halves.algorithm,
                                     name=f"gather {s.unit.name}")
                   for s, ts in zip(self.units, per_unit, strict=True) if ts]
        for h in handles:
            h.wait()

    def sum_replicas(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` across the replicas (batch statistics): a reduce-scatter and an all-gather."""
        self._settle()
        halves = plan_halves("ring", self.size, tensor.numel())
        flat = tensor.view(-1)

        def both() -> None:
            self._runner.run(halves.reduce_scatter, [flat], "ring")
            self._runner.run(halves.all_gather, [flat], "ring")
        self._lane.submit(both, name="sum_replicas").wait()

    def close(self) -> None:
        """Wait for what is in flight, remove the hooks, stop the lane; ZeRO-3: the full weights are
        gathered first (collective) and stay, so the module holds the trained weights afterwards."""
        self._settle()
        if self.weights is not None:
            for i in range(len(self.units)):
                self.weights.need(i)
        if isinstance(self.gates, LazyGathers):
            self.gates.wait_all()
        self.abandon()

    def abandon(self) -> None:
        """Remove the hooks and stop the lane without waiting (a peer is gone)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._pending.clear()
        self._lane.close(timeout=0)


@contextlib.contextmanager
def whole_weights(syncs: Iterable[Any]) -> Iterator[None]:
    """Every sharded sync's full, updated weights inside (ZeRO-3: gathered, collective over each
    replica group; ZeRO-1/2: their gathers waited for): a checkpoint reads or loads them."""
    with contextlib.ExitStack() as stack:
        for sync in syncs:
            gates = getattr(sync, "gates", None)
            if isinstance(gates, (UnitWeights, LazyGathers)):
                stack.enter_context(gates.whole())
        yield


def readable_weights(syncs: Iterable[Any]) -> bool:
    """Whether the modules of ``syncs`` hold their whole, updated weights now, for a reader outside
    the step (not collective): ZeRO-1/2's gathers on their way are waited for; False where a ZeRO-3
    sync's weights are freed (their storages have no bytes: reading them reads freed memory)."""
    for sync in syncs:
        gates = getattr(sync, "gates", None)
        if isinstance(gates, LazyGathers):
            gates.wait_all()
        elif isinstance(gates, UnitWeights) and not gates.whole_now():
            return False
    return True


def _index(shard: UnitShard, param: nn.Parameter) -> int:
    return next(i for i, p in enumerate(shard.unit.params) if p is param)
