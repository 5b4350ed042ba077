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


class Evaluating(Protocol):
    """What the evaluation step uses of an engine (``PipelineEngine`` is one)."""

    topo: Topology
    rank: int
    stages: dict[int, PipelineStage]
    device: torch.device
    flight: InFlight
    recorder: Any
    clock: Callable[[], float]

    def compute_context(self) -> contextlib.AbstractContextManager: ...
    def send(self, peer: int, key: str, tensors: dict[str, torch.Tensor]) -> None: ...
    def recv(self, peer: int, key: str) -> dict[str, torch.Tensor]: ...


def run_eval(engine: Evaluating, data: DataSource, *, recorder=None) -> dict[int, torch.Tensor]:
    """One forward-only evaluation step over ``data`` (micro-batches addressed as step 0):
    evaluation mode, no autograd, nothing in flight afterwards. Returns the last stage's
    losses by micro-batch (empty elsewhere). Under pipedream, call it only after a drained step
    (messages of the training stream would otherwise be in transit)."""
    if not engine.flight.empty():
        raise RuntimeError(f"rank {engine.rank}: an evaluation step needs an empty pipeline, but micro-batches "
                           f"{engine.flight.micro_batches()} are in flight; drain first")
    recorder = recorder if recorder is not None else engine.recorder
    M = engine.topo.micro_batches
    inputs: dict[tuple[int, int], dict[str, torch.Tensor]] = {}     # per (stage, micro-batch)
    acts: dict[tuple[int, int], Activation] = {}
    targets: dict[tuple[int, int], Any] = {}
    losses: dict[int, torch.Tensor] = {}
    for ins in eval_program(engine.topo, engine.rank):
        if not isinstance(ins, MicroBatchInstruction):
            raise TypeError(f"{ins!r} has no place in an evaluation step")
        t0, m = engine.clock(), ins.micro_batch
        stage, key = engine.stages[ins.stage], (ins.stage, ins.micro_batch)
        match ins:
            case LoadInput():
                named = stage.data_inputs(data.input(0, m))
                inputs[key] = {k: v.to(engine.device, non_blocking=True) for k, v in named.items()}
            case RecvActivations():
                inputs[key] = engine.recv(ins.peer, message_key(ins, m, M))
            case Forward():
                with engine.compute_context():
                    acts[key] = stage.forward_eval(inputs.pop(key))
            case SendActivations():
                engine.send(ins.peer, message_key(ins, m, M), acts.pop(key).outputs)
            case LoadTarget():
                target = data.target(0, m)
                targets[key] = target.to(engine.device, non_blocking=True) if target is not None else None
            case Loss():
                with torch.no_grad(), engine.compute_context():
                    losses[m] = stage.loss(acts.pop(key).output, targets.pop(key)).detach()
            case RecvGradients() | Backward() | BackwardInput() | BackwardWeight() | SendGradients() | SyncStart():
                raise TypeError(f"{ins!r} has no place in an evaluation step")
            case _:
                assert_never(ins)
        phase = PHASES.get(type(ins))
        if recorder is not None and phase is not None:
            recorder.record(phase, m, t0, engine.clock(), ins.stage)
    return losses

