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

from typing import TYPE_CHECKING

import torch

from hybridpipe.pipeline.instructions import RecvActivations, RecvGradients, message_key
from hybridpipe.pipeline.validate import in_transit
from hybridpipe.pipeline.values import moved
from hybridpipe.profiles.losses import loss_mean

if TYPE_CHECKING:
    from hybridpipe.pipeline.engine import PipelineEngine


def engine_state(engine: PipelineEngine) -> dict:
    """The engine's state, taken between steps (every rank after the same step)."""
    state = {"schedule": engine.schedule, "step": engine._last_step, "phase": engine.phase,
             "stash": engine.stash.state_dict() if engine.stash else None, "in_flight": {}}
    if engine._acts:
        _receive_in_transit(engine)
        state["in_flight"] = {g: {"inputs": {k: t.detach().clone() for k, t in act.inputs.items()},
                                  "grads": _clone(engine._out_grads.get((s, g)))}
                              for (s, g), act in engine._acts.items()}
    return state


def load_engine_state(engine: PipelineEngine, state: dict) -> None:
    """Restore :func:`engine_state`'s state into a fresh engine (same plan and rank), after the
    stage's weights and the optimizer's state have been loaded; recomputes the forwards of the
    micro-batches that were in flight."""
    if state.get("schedule") != engine.schedule:
        raise ValueError(f"the engine state was saved by schedule {state.get('schedule')!r}, "
                         f"not {engine.schedule!r}")
    if engine._acts:
        raise RuntimeError("load_state_dict needs a fresh engine (this one has micro-batches in flight)")
    if engine.stash is not None and state.get("stash") is not None:
        engine.stash.load_state_dict(state["stash"])
    engine._last_step, engine.phase = state.get("step"), state.get("phase", 0)
    engine._settled = engine._last_step
    M, device = engine.topo.micro_batches, engine.device
    for g in sorted(state.get("in_flight", {})):
        stage = engine.stage            # only pipedream leaves micro-batches in flight: one stage
        saved = state["in_flight"][g]
        inputs = {k: t.to(device) for k, t in saved["inputs"].items()}
        act = stage.forward(inputs, params=engine.stash.replay_params(g) if engine.stash else None)
        if stage.is_last:
            target = engine.data.target(g // M, g % M)
            act.loss = loss_mean(stage.loss(act.output, moved(target, device)))
        engine._acts[stage.index, g] = act
        if saved["grads"] is not None:
            engine._out_grads[stage.index, g] = {k: t.to(device) for k, t in saved["grads"].items()}


def _receive_in_transit(engine: PipelineEngine) -> None:
    """Receive now the messages sent to this rank that its next step's list would receive."""
    if engine._settled == engine._last_step or engine._last_step is None:
        return
    M = engine.topo.micro_batches
    base = (engine._last_step + 1) * M
    s = engine.stage.index
    for peer, kind, m in in_transit(engine.topo, engine.schedule, engine.phase - 1)[engine.rank]:
        g = base + m
        ins = RecvGradients(m, peer, s) if kind == "grad" else RecvActivations(m, peer, s)
        held = engine._out_grads if kind == "grad" else engine._inputs
        held[s, g] = engine.channel().recv(peer, message_key(ins, g, M))
    engine._settled = engine._last_step


def _clone(tensors: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    return None if tensors is None else {k: t.detach().clone() for k, t in tensors.items()}
