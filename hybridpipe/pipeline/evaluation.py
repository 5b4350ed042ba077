"""The forward-only evaluation step: ``schedules.eval_program`` run on an engine's stage and channels.

Evaluation mode (no dropout, batch norm on running statistics), no autograd, nothing left in flight;
the same list for every schedule. Kept apart from the training engine, whose state it does not touch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
from typing_extensions import assert_never

from hybridpipe.pipeline.data import DataSource
from hybridpipe.pipeline.inflight import InFlight
from hybridpipe.pipeline.instructions import (
    PHASES,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    LoadInput,
    LoadTarget,
    Loss,
    MicroBatchInstruction,
    RecvActivations,
    RecvGradients,
    SendActivations,
    SendGradients,
    SyncStart,
    message_key,
)
from hybridpipe.pipeline.schedules import Topology, eval_program
from hybridpipe.pipeline.stage import Activation, PipelineStage
from hybridpipe.pipeline.tokens import TokenCounts
from hybridpipe.pipeline.values import moved
from hybridpipe.profiles.losses import loss_mean


class Evaluating(Protocol):
    """What the evaluation step uses of an engine (``PipelineEngine`` is one)."""

    topo: Topology
    rank: int
    stages: dict[int, PipelineStage]
    device: torch.device
    flight: InFlight
    tokens: TokenCounts | None
    recorder: Any
    clock: Callable[[], float]

    def compute_context(self) -> contextlib.AbstractContextManager: ...
    def send(self, peer: int, key: str, tensors: dict[str, torch.Tensor]) -> None: ...
    def recv(self, peer: int, key: str) -> dict[str, torch.Tensor]: ...


def run_eval(engine: Evaluating, data: DataSource, *, recorder=None,
             counts: dict[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
    """One forward-only evaluation step over ``data`` (micro-batches addressed as step 0):
    evaluation mode, no autograd, nothing in flight afterwards. Returns the last stage's
    losses by micro-batch (empty elsewhere): their means, or with the engine's token-weighted
    loss and a ``counts`` dict their loss sums (``counts`` receives their tokens). Under
    pipedream, call it only after a drained step (messages of the training stream would
    otherwise be in transit)."""
    if not engine.flight.empty():
        raise RuntimeError(f"rank {engine.rank}: an evaluation step needs an empty pipeline, but micro-batches "
                           f"{engine.flight.micro_batches()} are in flight; drain first")
    recorder = recorder if recorder is not None else engine.recorder
    M = engine.topo.micro_batches
    inputs: dict[tuple[int, int], dict[str, torch.Tensor]] = {}     # per (stage, micro-batch)
    acts: dict[tuple[int, int], Activation] = {}
    targets: dict[tuple[int, int], Any] = {}
    losses: dict[int, torch.Tensor] = {}
    tokens = engine.tokens.fresh() if engine.tokens is not None else None
    for ins in eval_program(engine.topo, engine.rank):
        if not isinstance(ins, MicroBatchInstruction):
            raise TypeError(f"{ins!r} has no place in an evaluation step")
        t0, m = engine.clock(), ins.micro_batch
        stage, key = engine.stages[ins.stage], (ins.stage, ins.micro_batch)
        match ins:
            case LoadInput():
                batch = data.input(0, m)
                inputs[key] = {k: v.to(engine.device, non_blocking=True)
                               for k, v in stage.data_inputs(batch).items()}
                if tokens is not None:
                    tokens.loaded(key, batch, engine.device)
            case RecvActivations():
                got = engine.recv(ins.peer, message_key(ins, m, M))
                inputs[key] = tokens.incoming(key, got) if tokens is not None else got
            case Forward():
                with engine.compute_context():
                    acts[key] = stage.forward_eval(inputs.pop(key))
            case SendActivations():
                out = acts.pop(key).outputs
                engine.send(ins.peer, message_key(ins, m, M),
                            tokens.outgoing(key, out) if tokens is not None else out)
            case LoadTarget():
                targets[key] = moved(data.target(0, m), engine.device)
            case Loss():
                with torch.no_grad(), engine.compute_context():
                    value = stage.loss(acts.pop(key).output, targets.pop(key))
                _score(value, key, tokens, losses, counts)
            case RecvGradients() | Backward() | BackwardInput() | BackwardWeight() | SendGradients() | SyncStart():
                raise TypeError(f"{ins!r} has no place in an evaluation step")
            case _:
                assert_never(ins)
        phase = PHASES.get(type(ins))
        if recorder is not None and phase is not None:
            recorder.record(phase, m, t0, engine.clock(), ins.stage)
    return losses



def _score(value: Any, key: tuple[int, int], tokens: TokenCounts | None, losses: dict[int, torch.Tensor],
           counts: dict[int, torch.Tensor] | None) -> None:
    """Micro-batch ``key``'s loss into ``losses``: its mean, or with ``tokens`` and ``counts`` its sum
    (``counts`` gets its valid tokens), or with ``tokens`` alone its sum over its tokens."""
    m = key[1]
    if tokens is None:
        losses[m] = loss_mean(value).detach()
        return
    _, total, count = tokens.split(key, value)
    losses[m] = total.detach() if counts is not None else total.detach() / count.clamp(min=1)
    if counts is not None:
        counts[m] = count
