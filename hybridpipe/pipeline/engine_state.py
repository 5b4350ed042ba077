"""The pipeline engine's own checkpoint state: pipedream's micro-batches in flight between steps.

pipedream keeps micro-batches in flight across steps. Their activations are not saved; instead
each one's inputs, weight version (the stash) and, when already here, output gradients are, and
:func:`load_engine_state` recomputes their forwards with the stashed weights: training resumes
exactly (up to random ops such as dropout). To make that possible the gradients already on their
way to this rank are received at the save (their senders have sent them, so this never waits on
a peer's next step). pipedream runs one stage per rank; the flushed schedules (also those with
virtual stages) leave nothing in flight between steps, so their state is the step and phase.
"""

from __future__ import annotations

from typing import Protocol

import torch

from hybridpipe.partitioner.schedule_registry import Schedule
from hybridpipe.pipeline.data import DataSource
from hybridpipe.pipeline.inflight import InFlight
from hybridpipe.pipeline.instructions import RecvActivations, RecvGradients, message_key
from hybridpipe.pipeline.schedules import Topology
from hybridpipe.pipeline.stage import PipelineStage
from hybridpipe.pipeline.stash import WeightStash
from hybridpipe.pipeline.validate import in_transit
from hybridpipe.pipeline.values import moved
from hybridpipe.profiles.losses import loss_mean


class Resumable(Protocol):
    """What a checkpoint reads and restores of an engine (``PipelineEngine`` is one)."""

    schedule: Schedule
    topo: Topology
    rank: int
    phase: int                      # steps since the pipeline was (re)started
    last_step: int | None           # the step run last (None: none yet)
    stash: WeightStash | None
    flight: InFlight
    data: DataSource
    device: torch.device

    @property
    def stage(self) -> PipelineStage: ...
    def recv(self, peer: int, key: str) -> dict[str, torch.Tensor]: ...


def engine_state(engine: Resumable) -> dict:
    """The engine's state, taken between steps (every rank after the same step)."""
    state = {"schedule": engine.schedule.name, "step": engine.last_step, "phase": engine.phase,
             "stash": engine.stash.state_dict() if engine.stash else None, "in_flight": {}}
    if engine.flight.acts:
        _receive_in_transit(engine)
        state["in_flight"] = engine.flight.snapshot()
    return state


def load_engine_state(engine: Resumable, state: dict) -> None:
    """Restore :func:`engine_state`'s state into a fresh engine (same plan and rank), after the
    stage's weights and the optimizer's state have been loaded; recomputes the forwards of the
    micro-batches that were in flight."""
    if state.get("schedule") != engine.schedule.name:
        raise ValueError(f"the engine state was saved by schedule {state.get('schedule')!r}, "
                         f"not {engine.schedule.name!r}")
    if engine.flight.acts:
        raise RuntimeError("load_state_dict needs a fresh engine (this one has micro-batches in flight)")
    if engine.stash is not None and state.get("stash") is not None:
        engine.stash.load_state_dict(state["stash"])
    engine.last_step, engine.phase = state.get("step"), state.get("phase", 0)
    engine.flight.settled = engine.last_step
    M, device = engine.topo.micro_batches, engine.device
    for g in sorted(state.get("in_flight", {})):
        stage = engine.stage            # only pipedream leaves micro-batches in flight: one stage
        saved = state["in_flight"][g]
        inputs = {k: t.to(device) for k, t in saved["inputs"].items()}
        act = stage.forward(inputs, params=engine.stash.replay_params(g) if engine.stash else None)
        if stage.is_last:
            target = engine.data.target(g // M, g % M)
            act.loss = loss_mean(stage.loss(act.output, moved(target, device)))
        engine.flight.acts[stage.index, g] = act
        if saved["grads"] is not None:
            engine.flight.out_grads[stage.index, g] = {k: t.to(device) for k, t in saved["grads"].items()}


def _receive_in_transit(engine: Resumable) -> None:
    """Receive now the messages sent to this rank that its next step's list would receive."""
    if engine.flight.settled == engine.last_step or engine.last_step is None:
        return
    M = engine.topo.micro_batches
    base = (engine.last_step + 1) * M
    s = engine.stage.index
    for peer, kind, m in in_transit(engine.topo, engine.schedule, engine.phase - 1)[engine.rank]:
        g = base + m
        ins = RecvGradients(m, peer, s) if kind == "grad" else RecvActivations(m, peer, s)
        held = engine.flight.out_grads if kind == "grad" else engine.flight.inputs
        held[s, g] = engine.recv(peer, message_key(ins, g, M))
    engine.flight.settled = engine.last_step
