"""Sharded parameters (ZeRO-3): each position keeps its owned pieces of every sync unit's weights;
a unit's full weights exist only while gathered for use.

A unit's parameters keep their ``nn.Parameter`` objects (shapes, names, ``state_dict`` keys, the
graph's references), but their storages are resized to nothing while the unit is *free*. To use a
unit, :meth:`UnitWeights.gather` gives the storages their bytes back, writes this position's owned
pieces into them and queues the unit's all-gather (the halves of the plan's algorithm,
``halves.py``) on the replicas' lane; :meth:`UnitWeights.need` waits for it. :meth:`free` drops
the bytes again. The owned pieces (:attr:`owned`, 1-D tensors of their own) are what the optimizer
updates; a gather after the step spreads the new values. Writes go through ``param.data`` (a
tensor of its own version counter), so a weight autograd saved before it was freed is valid again
once regathered (the backward's saved-tensor hooks regather it: pipeline/zero3.py).

Every gather is a collective: callers issue them in the same order on every replica (the forward's
gates in graph order, the backward's needs in autograd's order, :meth:`whole` in unit order).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from hybridpipe.comm.engine import CommLane, Handle
from hybridpipe.comm.sharded.halves import HalvesRunner

FREE, PENDING, READY = "free", "pending", "ready"


class UnitWeights:
    """The weights of sharded units (module docstring). ``units``: per unit, its parameters and
    this position's pieces ``(param, lo, hi)``; ``rounds``: per unit, its all-gather rounds and
    algorithm; ``on_bytes(delta)`` is told each change of the gathered bytes (the meter's peak)."""

    def __init__(self, params: Sequence[Sequence[nn.Parameter]], pieces: Sequence[Sequence[Any]],
                 rounds: Sequence[tuple[Sequence[Any], str]], runner: HalvesRunner, lane: CommLane,
                 on_bytes: Callable[[int], None] = lambda _: None):
        self.params = [list(ps) for ps in params]
        self.pieces = [list(pcs) for pcs in pieces]
        self.rounds, self.runner, self.lane = list(rounds), runner, lane
        self.on_bytes: Callable[[int], None] = lambda _: None
        for ps in self.params:
            for p in ps:
                if not p.is_contiguous() or p.storage_offset() != 0 or \
                        p.untyped_storage().nbytes() != p.numel() * p.element_size():
                    raise ValueError("sharded parameters need each parameter to own its whole storage "
                                     f"(a {tuple(p.shape)} parameter is a view or shares its storage)")
        self.owned = [[pc.param.detach().view(-1)[pc.lo:pc.hi].clone() for pc in pcs] for pcs in self.pieces]
        self.nbytes = [sum(p.numel() * p.element_size() for p in ps) for ps in self.params]
        self._state = [READY] * len(self.params)
        self._handles: dict[int, Handle] = {}
        self._unit_of = {p.untyped_storage()._cdata: i for i, ps in enumerate(self.params) for p in ps}
        self.order = list(range(len(self.params)))     # units in the order the forward uses them
        self.pinned: set[int] = set()       # units kept gathered from a forward to the backward's end (a leaf module's)
        for i in range(len(self.params)):
            self.free(i)
        self.on_bytes = on_bytes

    def unit_of(self, t: torch.Tensor) -> int | None:
        """The unit whose parameter's storage ``t`` lives in (None: none of them)."""
        return self._unit_of.get(t.untyped_storage()._cdata)

    def gathered(self, i: int) -> bool:
        """Whether unit ``i``'s full weights are there or on their way."""
        return self._state[i] != FREE

    def whole_now(self) -> bool:
        """Whether every unit's full weights are there (not freed, no gather on its way)."""
        return all(state == READY for state in self._state)

    def gather(self, i: int) -> None:
        """Start unit ``i``'s all-gather (nothing when it is gathered or on its way)."""
        if self._state[i] != FREE:
            return
        for p in self.params[i]:
            self._resizable(p, i).resize_(p.numel() * p.element_size())
        with torch.no_grad():
            for pc, mine in zip(self.pieces[i], self.owned[i], strict=True):
                pc.param.data.view(-1)[pc.lo:pc.hi].copy_(mine)
        self._state[i] = PENDING
        self.on_bytes(self.nbytes[i])
        rounds, algorithm = self.rounds[i]
        self._handles[i] = self.lane.submit(self.runner.run, rounds, [p.data for p in self.params[i]], algorithm,
                                            name=f"gather unit {i}")

    def need(self, i: int) -> None:
        """Unit ``i``'s full weights, now (gathering them if free)."""
        self.gather(i)
        if self._state[i] == PENDING:
            self._handles.pop(i).wait()
            self._state[i] = READY

    def free(self, i: int) -> None:
        """Drop unit ``i``'s full weights (waiting for a gather on its way)."""
        if self._state[i] == FREE:
            return
        if self._state[i] == PENDING:
            self._handles.pop(i).wait()
        for p in self.params[i]:
            self._resizable(p, i).resize_(0)
        self._state[i] = FREE
        self.on_bytes(-self.nbytes[i])

    def _resizable(self, p: nn.Parameter, i: int) -> torch.UntypedStorage:
        """``p``'s storage, first moved to one of its own that can be resized where it cannot (a
        storage from a mapped file, or one numpy has seen); the full values are kept."""
        storage = p.untyped_storage()
        if not storage.resizable():
            self._unit_of.pop(storage._cdata, None)
            p.data = p.detach().clone()
            storage = p.untyped_storage()
            self._unit_of[storage._cdata] = i
        return storage

    def free_all(self) -> None:
        """Drop every unit's full weights."""
        for i in range(len(self.params)):
            self.free(i)

    @contextlib.contextmanager
    def whole(self) -> Iterator[None]:
        """Every unit gathered inside (collective: a checkpoint reads or loads the whole weights);
        afterwards the owned pieces are taken from the weights (a load changed them) and freed.
        Inside another :meth:`whole` (or once the weights stay whole) nothing is gathered or freed:
        the outer one takes the pieces back."""
        if self.whole_now():
            yield
            return
        for i in range(len(self.params)):
            self.gather(i)
        for i in range(len(self.params)):
            self.need(i)
        try:
            yield
        finally:
            with torch.no_grad():
                for i, (pcs, mine) in enumerate(zip(self.pieces, self.owned, strict=True)):
                    for pc, t in zip(pcs, mine, strict=True):
                        t.copy_(pc.param.data.view(-1)[pc.lo:pc.hi])
                    self.free(i)


class LazyGathers:
    """ZeRO-1/2's all-gather of the updated weights, overlapped with the next forward: :meth:`start`
    (at the end of the optimizer step) queues every unit's all-gather on the replicas' lane in the
    order the forward uses the units and returns; the stage's gates (pipeline/zero3.py) wait for a
    unit's just before its first use; :meth:`whole` waits for all (evaluation outside the gates,
    checkpoints, the end). The weights stay allocated: nothing is freed."""

    def __init__(self, params: Sequence[Sequence[nn.Parameter]], rounds: Sequence[tuple[Sequence[Any], str]],
                 runner: HalvesRunner, lane: CommLane):
        self.params = [list(ps) for ps in params]
        self.rounds, self.runner, self.lane = list(rounds), runner, lane
        self.order = list(range(len(self.params)))
        self.gated = False          # the stage's gates wait for the gathers (pipeline/zero3.py sets it)
        self._handles: dict[int, Handle] = {}

    def start(self) -> None:
        """Queue every unit's all-gather (forward order)."""
        for i in self.order:
            rounds, algorithm = self.rounds[i]
            self._handles[i] = self.lane.submit(self.runner.run, rounds, [p.detach() for p in self.params[i]],
                                                algorithm, name=f"gather unit {i}")

    @staticmethod
    def unit_of(t: torch.Tensor) -> None:
        """No saved weight needs regathering (the weights are never freed)."""
        return None

    def need(self, i: int) -> None:
        """Unit ``i``'s updated weights, now."""
        handle = self._handles.pop(i, None)
        if handle is not None:
            handle.wait()

    def gather(self, i: int) -> None:
        """Nothing: every gather was queued by :meth:`start`."""

    def free(self, i: int) -> None:
        """Nothing: the weights stay."""

    def free_all(self) -> None:
        """Nothing: the weights stay."""

    def wait_all(self) -> None:
        """Every queued gather done."""
        for i in list(self._handles):
            self.need(i)

    @contextlib.contextmanager
    def whole(self) -> Iterator[None]:
        """The updated weights inside (waits for the gathers on their way)."""
        self.wait_all()
        yield
