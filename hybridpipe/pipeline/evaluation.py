"""The forward-only evaluation step: ``schedules.eval_program`` run on an engine's stage and channels.

Evaluation mode (no dropout, batch norm on running statistics), no autograd, nothing left in flight;
the same list for every schedule. Kept apart from the training engine, whose state it does not touch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from hybridpipe.pipeline.instructions import (
    PHASES,
    Forward,
    LoadInput,
    LoadTarget,
    Loss,
    MicroBatchInstruction,
    RecvActivations,
    SendActivations,
    message_key,
)
from hybridpipe.pipeline.schedules import eval_program
from hybridpipe.pipeline.stage import Activation
from hybridpipe.pipeline.values import moved
from hybridpipe.profiles.losses import loss_mean

if TYPE_CHECKING:
    from hybridpipe.pipeline.engine import DataSource, PipelineEngine


def run_eval(engine: PipelineEngine, data: DataSource, *, recorder=None,
             counts: dict[int, torch.Tensor] | None = None) -> dict[int, torch.Tensor]:
    """One forward-only evaluation step over ``data`` (micro-batches addressed as step 0):
    evaluation mode, no autograd, nothing in flight afterwards. Returns the last stage's
    losses by micro-batch (empty elsewhere): their means, or with the engine's token-weighted
    loss and a ``counts`` dict their loss sums (``counts`` receives their tokens). Under
    pipedream, call it only after a drained step (messages of the training stream would
    otherwise be in transit)."""
    if engine._acts or engine._inputs or engine._out_grads:
        raise RuntimeError(f"rank {engine.rank}: an evaluation step needs an empty pipeline, but micro-batches "
                           f"{engine.in_flight} are in flight; drain first")
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
        if isinstance(ins, LoadInput):
            batch = data.input(0, m)
            inputs[key] = {k: v.to(engine.device, non_blocking=True) for k, v in stage.data_inputs(batch).items()}
            if tokens is not None:
                tokens.loaded(key, batch, engine.device)
        elif isinstance(ins, RecvActivations):
            got = engine.recv(ins.peer, message_key(ins, m, M))
            inputs[key] = tokens.incoming(key, got) if tokens is not None else got
        elif isinstance(ins, Forward):
            with engine.compute_context():
                acts[key] = stage.forward_eval(inputs.pop(key))
        elif isinstance(ins, SendActivations):
            out = acts.pop(key).outputs
            engine.send(ins.peer, message_key(ins, m, M), tokens.outgoing(key, out) if tokens is not None else out)
        elif isinstance(ins, LoadTarget):
            target = data.target(0, m)
            targets[key] = moved(target, engine.device)
        elif isinstance(ins, Loss):
            with torch.no_grad(), engine.compute_context():
                value = stage.loss(acts.pop(key).output, targets.pop(key))
            if tokens is None:
                losses[m] = loss_mean(value).detach()
            else:
                _, total, count = tokens.split(key, value)
                losses[m] = total.detach() if counts is not None else total.detach() / count.clamp(min=1)
                if counts is not None:
                    counts[m] = count
        else:
            raise TypeError(f"{ins!r} has no place in an evaluation step")
        phase = PHASES.get(type(ins))
        if recorder is not None and phase is not None:
            recorder.record(phase, m, t0, engine.clock(), ins.stage)
    return losses

