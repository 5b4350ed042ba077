"""What the training engine (engine.py) is connected to: the transport between ranks, each model
chunk's gradient sync (a replicated chunk's HybridDataParallel, else :class:`LocalSync`) and the
sum of tied weights' copies; the engine's docstring says what each must do."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch

from hybridpipe.pipeline.stepnews import NewsRoute


class Transport(Protocol):
    def send(self, peer: int, key: str, tensors: dict[str, torch.Tensor]) -> None: ...
    def recv(self, peer: int, key: str) -> dict[str, torch.Tensor]: ...


class StepNews(Protocol):
    """The step's news on gradient frames (stepnews.py): this rank's route, the note a carrying
    send attaches (``outgoing``, given the step's losses so far) and what a carrying receive brought."""

    route: NewsRoute

    def outgoing(self, step: int, losses: dict[int, torch.Tensor]) -> torch.Tensor: ...
    def incoming(self, step: int, note: torch.Tensor) -> None: ...


class TiedReduce(Protocol):
    def reduce(self) -> None: ...


class LocalSync:
    """The gradient sync of an unreplicated stage: nothing to do."""

    def no_sync(self):
        return contextlib.nullcontext()

    def finish(self) -> None:
        pass

    def sum_replicas(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` in place across the stage's replicas: one replica, nothing to add."""


def chunk_syncs(sync: Any, stages: Sequence[int]) -> dict[int, Any]:
    """Each chunk's gradient sync: one given for the rank's only stage, or a mapping per stage."""
    if isinstance(sync, Mapping):
        missing = [s for s in stages if s not in sync]
        if missing:
            raise ValueError(f"no gradient sync for stage(s) {missing}")
        return {s: sync[s] if sync[s] is not None else LocalSync() for s in stages}
    if len(stages) > 1 and sync is not None:
        raise ValueError(f"a rank with stages {list(stages)} needs one gradient sync per stage (a mapping)")
    return {s: sync if sync is not None else LocalSync() for s in stages}


def step_gradients(module: torch.nn.Module, optimizer: Any,
                   params: Sequence[torch.nn.Parameter] | None = None) -> list[torch.Tensor]:
    """The gradients an optimizer step reads (the Step's scaling applies to them): those the
    optimizer names (a sharded stage's optimizer: its replica's owned pieces, runtime/sharded_optimizer.py),
    else every parameter's ``.grad`` (``params``: ``module.parameters()`` listed before, once)."""
    own = getattr(optimizer, "gradients", None)
    if callable(own):
        return own()
    return [p.grad for p in (module.parameters() if params is None else params) if p.grad is not None]
