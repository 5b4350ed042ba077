"""The training engine's micro-batch instructions (engine.py): load, receive, forward, send, loss,
backward (whole or split) and the replicas' sync start, on one model chunk of the rank.

What each keeps between instructions lives in the engine's :class:`~inflight.InFlight`, per (stage,
micro-batch); the memory meter sees what a forward holds and a backward frees.
"""

from __future__ import annotations

import contextlib
from typing import Any, Protocol

import torch
from typing_extensions import assert_never

from hybridpipe.pipeline.data import DataSource
from hybridpipe.pipeline.inflight import InFlight
from hybridpipe.pipeline.instructions import (
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
from hybridpipe.pipeline.memory import MemoryMeter
from hybridpipe.pipeline.ports import StepNews
from hybridpipe.pipeline.schedules import Topology
from hybridpipe.pipeline.stage import Activation, PipelineStage
from hybridpipe.pipeline.stash import WeightStash
from hybridpipe.pipeline.step_result import StepResult
from hybridpipe.pipeline.stepnews import NEWS
from hybridpipe.pipeline.tokens import TokenCounts
from hybridpipe.pipeline.values import moved
from hybridpipe.profiles.losses import loss_mean


class Running(Protocol):
    """What the micro-batch instructions use of an engine (``PipelineEngine`` is one)."""

    topo: Topology
    stages: dict[int, PipelineStage]
    flight: InFlight
    data: DataSource
    device: torch.device
    stash: WeightStash | None
    meter: MemoryMeter
    syncs: dict[int, Any]
    tokens: TokenCounts | None
    loss_scale: Any
    loss_seed: float | None     # the last stage's backward seed (loss_seed.py), None: ones
    news: StepNews | None
    news_receive: Any           # the receive that brings the step's news (stepnews.py), found by identity
    news_sends: frozenset[int]  # ids of the sends that carry it

    def compute_context(self) -> contextlib.AbstractContextManager: ...
    def send(self, peer: int, key: str, tensors: dict[str, torch.Tensor]) -> None: ...
    def recv(self, peer: int, key: str) -> dict[str, torch.Tensor]: ...


def run_micro_batch(engine: Running, ins: MicroBatchInstruction, s: int, g: int, frozen: set[int],
                    result: StepResult) -> None:
    """Run an instruction about micro-batch ``g`` (numbered over the run) on chunk ``s``; ``frozen``:
    the micro-batches whose forward uses stashed weights (pipedream), ``result``: the step's."""
    M = engine.topo.micro_batches
    stage, key, flight, tokens, meter = engine.stages[s], (s, g), engine.flight, engine.tokens, engine.meter
    match ins:
        case LoadInput():
            batch = engine.data.input(g // M, g % M)
            flight.inputs[key] = {k: v.to(engine.device, non_blocking=True)
                                  for k, v in stage.data_inputs(batch).items()}
            if tokens is not None:
                tokens.loaded(key, batch, engine.device)
        case RecvActivations():
            if key not in flight.inputs:       # else received early, at a checkpoint
                got = engine.recv(ins.peer, message_key(ins, g, M))
                flight.inputs[key] = tokens.incoming(key, got) if tokens is not None else got
        case Forward():
            params = engine.stash.forward_params(g, g in frozen) if engine.stash else None
            with meter.forward(), engine.compute_context():
                act = flight.acts[key] = stage.forward(flight.inputs.pop(key), params=params, micro_batch=g,
                                                             owned=True)    # a receive's (stage 0: no grad)
            meter.hold(key, act.inputs, act.outputs, act.output)
        case SendActivations():
            out = flight.acts[key].outputs
            engine.send(ins.peer, message_key(ins, g, M), tokens.outgoing(key, out) if tokens else out)
        case LoadTarget():
            flight.targets[key] = moved(engine.data.target(g // M, g % M), engine.device)
        case Loss():
            _loss(engine, stage, key, g, result)
        case RecvGradients():
            if key not in flight.out_grads:    # else received early, at a checkpoint
                got = flight.out_grads[key] = engine.recv(ins.peer, message_key(ins, g, M))
                if ins is engine.news_receive and engine.news is not None:    # stepnews.py
                    engine.news.incoming(g // M, got.pop(NEWS))
        case SyncStart():
            flight.sync_next.add(key)
        case Backward():
            act = _scaled(engine, stage, flight.acts.pop(key))
            with _sync_if(engine, s, g), meter.backward(stage.recompute, stage.module):
                grads = stage.backward(act, flight.out_grads.pop(key, None), loss_seed=engine.loss_seed)
            meter.drop(key)
            if engine.stash:
                engine.stash.backward_done(g)
            if not stage.is_first:
                flight.in_grads[key] = grads
        case BackwardInput():
            act = _scaled(engine, stage, flight.acts.pop(key))
            with engine.syncs[s].no_sync(), meter.backward(stage.recompute, stage.module):   # no param grads
                grads, work = stage.backward_input(act, flight.out_grads.pop(key, None), loss_seed=engine.loss_seed)
            flight.weight_work[key] = (act, work)
            # the graph is freed: what the weight half reads, and the gradients it was recorded
            meter.hold(key, work.held(), work.recorded())
            if not stage.is_first:
                flight.in_grads[key] = grads
        case BackwardWeight():
            _, work = flight.weight_work.pop(key)
            with _sync_if(engine, s, g), meter.backward(stage.recompute, stage.module):
                stage.backward_weight(work)
            meter.drop(key)
        case SendGradients():
            grads = flight.in_grads.pop(key)
            if engine.news_sends and id(ins) in engine.news_sends and engine.news is not None:
                grads = {**grads, NEWS: engine.news.outgoing(g // M, result.losses)}
            engine.send(ins.peer, message_key(ins, g, M), grads)
        case _:
            assert_never(ins)


def _loss(engine: Running, stage: PipelineStage, key: tuple[int, int], g: int, result: StepResult) -> None:
    """The last stage's loss of micro-batch ``g``: its mean, or with ``tokens`` its sum (the
    step's result gets the mean and the micro-batch's valid tokens)."""
    act, M, tokens = engine.flight.acts[key], engine.topo.micro_batches, engine.tokens
    with engine.meter.forward(), engine.compute_context():
        value = stage.loss(act.output, engine.flight.targets.pop(key))
        act.loss, total, count = tokens.split(key, value) if tokens else (loss_mean(value),) * 3
    engine.meter.hold(key, act.loss)
    if g // M == result.step:
        result.losses[g % M] = total.detach() if tokens is None else total.detach() / count.clamp(min=1)
        if tokens is not None:
            result.counts[g % M] = count


def _scaled(engine: Running, stage: PipelineStage, act: Activation) -> Activation:
    """The last stage's activation with its loss multiplied by the fp16 loss scale (if any)."""
    if engine.loss_scale is not None and stage.is_last and act.loss is not None:
        act.loss = act.loss * engine.loss_scale()
    return act


def _sync_if(engine: Running, s: int, g: int) -> contextlib.AbstractContextManager:
    """The context of the backward (on chunk ``s``) that completes micro-batch g's parameter
    gradients: it starts the chunk's replicas' sync when a SyncStart named g, else
    accumulates (``no_sync``)."""
    synced = (s, g) in engine.flight.sync_next
    engine.flight.sync_next.discard((s, g))
    return contextlib.nullcontext() if synced else engine.syncs[s].no_sync()
