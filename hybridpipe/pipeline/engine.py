"""Executing one rank's instruction list for one training step.

    engine = PipelineEngine(stage, topo, rank, "1f1b", transport=channels, sync=hdp,
                            optimizer=opt, data=data, recorder=recorder)
    for step in range(steps):
        result = engine.run_step(step, drain=step == steps - 1)   # drain matters for pipedream only
        result.losses                                            # last stage: {micro-batch: loss}

Interfaces (duck-typed, see the project's contracts):

* ``transport``: ``send(peer, key, tensors)`` (posts), ``recv(peer, key) -> tensors`` (blocks);
  keys are ``act/<m>`` and ``grad/<m>`` (m = the micro-batch's index in its step; see
  ``schedules.transfer_program`` for the ``sra`` mode's orders).
* ``sync``: ``no_sync()`` (context: backward inside it starts no all-reduce) and ``finish()``
  (wait for the started all-reduces). Gradients must be *summed* across replicas
  (``HybridDataParallel(..., reduce="sum")``): the schedule's Step applies 1/M (or 1/r).
  ``None`` for an unreplicated stage.
* ``optimizer``: a ``torch.optim.Optimizer`` over ``stage.module``'s parameters.
* ``data``: ``input(step, micro_batch)`` and ``target(step, micro_batch)`` (see data.py).
* ``recorder`` (optional): ``record(phase, micro_batch, t0, t1)``, phase one of
  receive_for, run_for, send_for, receive_back, run_back, sync, send_back, step.
* ``before_step`` (optional): called right before each optimizer step, once the gradients are
  final (replicas summed, tied copies summed, scaled by the Step's factor): e.g. clipping; when
  it returns False the step is skipped (gradients zeroed, no update).
* ``loss_scale`` (optional): the last stage multiplies each loss by ``loss_scale()`` before its
  backward (fp16 loss scaling; ``before_step`` divides the gradients back).
* ``autocast`` (optional dtype, e.g. ``torch.bfloat16``): forwards and losses run under
  ``torch.autocast`` (weights, gradients and optimizer state stay float32); ``wire_dtype``
  (optional): floating-point activations and gradients are sent in that dtype (half the bytes
  for bfloat16); a received gradient is cast back to its output's dtype before the backward.

``run_eval(data)`` runs the forward-only evaluation list (``schedules.eval_program``) in
evaluation mode without autograd: no gradient, no weight or optimizer change.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from hybridpipe.errors import UserError
from hybridpipe.partitioner.schedule_registry import get_schedule
from hybridpipe.pipeline import evaluation
from hybridpipe.pipeline.instructions import (
    PHASES,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    Instruction,
    LoadInput,
    LoadTarget,
    Loss,
    MicroBatchInstruction,
    RecvActivations,
    RecvGradients,
    SendActivations,
    SendGradients,
    Step,
    SyncStart,
    SyncWait,
    message_key,
)
from hybridpipe.pipeline.memory import MemoryMeter, optimizer_tensors, tensors_bytes
from hybridpipe.pipeline.schedules import Topology, check_schedulable, rank_program, settle_phase
from hybridpipe.pipeline.splitback import WeightWork
from hybridpipe.pipeline.stage import Activation, PipelineStage
from hybridpipe.pipeline.stash import WeightStash
from hybridpipe.pipeline.validate import in_transit


class Transport(Protocol):
    def send(self, peer: int, key: str, tensors: dict[str, torch.Tensor]) -> None: ...
    def recv(self, peer: int, key: str) -> dict[str, torch.Tensor]: ...


class DataSource(Protocol):
    def input(self, step: int, micro_batch: int) -> Any: ...
    def target(self, step: int, micro_batch: int) -> Any: ...


class TiedReduce(Protocol):
    def reduce(self) -> None: ...


class LocalSync:
    """The gradient sync of an unreplicated stage: nothing to do."""

    def no_sync(self):
        return contextlib.nullcontext()

    def finish(self) -> None:
        pass


@dataclass
class StepResult:
    step: int
    losses: dict[int, torch.Tensor] = field(default_factory=dict)   # last stage: micro-batch of this step -> loss
    optimizer_steps: int = 0
    peak_memory_bytes: int = 0      # what the stage held at its peak this step (memory.py)

    @property
    def mean_loss(self) -> float | None:
        return float(torch.stack(list(self.losses.values())).mean()) if self.losses else None


class PipelineEngine:
    """Runs a rank's schedule step by step (see the module docstring)."""

    def __init__(self, stage: PipelineStage, topo: Topology, rank: int, schedule: str, *, transport: Transport | None,
                 optimizer: torch.optim.Optimizer, data: DataSource, sync=None, recorder=None,
                 tied: TiedReduce | None = None, clock: Callable[[], float] = time.perf_counter,
                 before_step: Callable[[], bool | None] | None = None, autocast: torch.dtype | None = None,
                 wire_dtype: torch.dtype | None = None, loss_scale: Callable[[], float] | None = None):
        check_schedulable(topo, schedule)
        s, _ = topo.locate(rank)
        if s != stage.index:
            raise ValueError(f"rank {rank} runs stage {s} of the plan, but the engine got stage {stage.index}")
        self.stage, self.topo, self.rank, self.schedule = stage, topo, rank, schedule
        self.transport, self.optimizer, self.data = transport, optimizer, data
        self.sync = sync if sync is not None else LocalSync()
        self.tied, self.before_step = tied, before_step
        self.autocast, self.wire_dtype, self.loss_scale = autocast, wire_dtype, loss_scale
        self.kind = get_schedule(schedule)
        if tied is not None and not self.kind.keeps_tied_weights:
            raise UserError(f"{schedule}'s asynchronous updates cannot keep a weight that several stages share (tied "
                            "embeddings) identical; use --schedule 1f1b or gpipe, or a plan that keeps its uses "
                            "in one stage")
        self.recorder, self.clock = recorder, clock
        self.stash = WeightStash(stage.module) if self.kind.asynchronous else None
        self.device = stage.device     # where inputs and targets go (place the stage before the engine)
        self.meter = MemoryMeter(self._held, self._grad_bytes, self.device, stage.module)
        self.phase = 0              # steps since the pipeline was (re)started (pipedream)
        self._last_step: int | None = None
        self._inputs: dict[int, dict[str, torch.Tensor]] = {}
        self._targets: dict[int, Any] = {}
        self._acts: dict[int, Activation] = {}
        self._out_grads: dict[int, dict[str, torch.Tensor]] = {}   # received: grads of the stage's outputs
        self._in_grads: dict[int, dict[str, torch.Tensor]] = {}    # computed: grads of its inputs, to send
        self._weight_work: dict[int, tuple[Activation, WeightWork]] = {}   # split backward: the weight half owed
        self._sync_next: int | None = None
        self._settled: int | None = None    # step after which messages in transit were received early
        self._settle = settle_phase(topo, schedule)
        self._programs: dict[tuple[int, bool], list[Instruction]] = {}

    # ---- public ------------------------------------------------------------------------
    @property
    def in_flight(self) -> list[int]:
        """Micro-batches (numbered over the run) forwarded here but not yet backwarded."""
        return sorted(set(self._acts) | set(self._weight_work))

    def program(self, drain: bool = False) -> list[Instruction]:
        """The instruction list the next ``run_step`` executes (lists repeat once settled: cached)."""
        key = (min(self.phase, self._settle), drain)
        if key not in self._programs:
            self._programs[key] = rank_program(self.topo, self.rank, self.schedule, phase=key[0], drain=drain)
        return self._programs[key]

    def run_step(self, step: int, *, drain: bool = False, recorder=None) -> StepResult:
        """Execute this rank's list for ``step``. With pipedream, ``drain=True`` finishes every
        micro-batch in flight (do it on the last step); steps between drains must be
        consecutive (a checkpoint needs no drain, see :meth:`state_dict`). ``recorder``
        replaces the engine's recorder for this step."""
        recorder = recorder if recorder is not None else self.recorder
        if self._acts and self._last_step is not None and step != self._last_step + 1:
            raise RuntimeError(f"step {step} follows step {self._last_step} while micro-batches "
                               f"{self.in_flight} are in flight; run consecutive steps or drain first")
        program = self.program(drain)
        M = self.topo.micro_batches
        frozen = {step * M + m for m in self._needs_frozen(program)} if self.stash else set()
        result = StepResult(step)
        self.meter.begin_step()
        for ins in program:
            t0 = self.clock()
            if isinstance(ins, MicroBatchInstruction):
                g = step * M + ins.micro_batch
                self._execute(ins, g, frozen, result)
            else:
                g = -1                      # SyncWait and Step are about the step
                self._execute_step_level(ins, result)
            phase = PHASES.get(type(ins))
            if recorder is not None and phase is not None:
                recorder.record(phase, g, t0, self.clock())
        result.peak_memory_bytes = self.meter.end_step()
        self._last_step = step
        self.phase = 0 if drain else self.phase + 1     # the same on every rank
        return result

    def run_eval(self, data: DataSource, *, recorder=None) -> dict[int, torch.Tensor]:
        """One forward-only evaluation step over ``data`` (see ``evaluation.run_eval``)."""
        return evaluation.run_eval(self, data, recorder=recorder)

    def state_dict(self) -> dict:
        """The engine's own state for checkpoints, taken between steps (every rank after the same step).

        pipedream keeps micro-batches in flight across steps. Their activations are not saved;
        instead each one's inputs, weight version (the stash) and, when already here, output
        gradients are, and :meth:`load_state_dict` recomputes their forwards with the stashed
        weights: training resumes exactly (up to random ops such as dropout). To make that
        possible the gradients already on their way to this rank are received now (their
        senders have sent them, so this never waits on a peer's next step).
        """
        state = {"schedule": self.schedule, "step": self._last_step, "phase": self.phase,
                 "stash": self.stash.state_dict() if self.stash else None, "in_flight": {}}
        if self._acts:
            self._receive_in_transit()
            state["in_flight"] = {g: {"inputs": {k: t.detach().clone() for k, t in act.inputs.items()},
                                      "grads": _clone(self._out_grads.get(g))} for g, act in self._acts.items()}
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s state into a fresh engine (same plan and rank), after the
        stage's weights and the optimizer's state have been loaded; recomputes the forwards of
        the micro-batches that were in flight."""
        if state.get("schedule") != self.schedule:
            raise ValueError(f"the engine state was saved by schedule {state.get('schedule')!r}, "
                             f"not {self.schedule!r}")
        if self._acts:
            raise RuntimeError("load_state_dict needs a fresh engine (this one has micro-batches in flight)")
        if self.stash is not None and state.get("stash") is not None:
            self.stash.load_state_dict(state["stash"])
        self._last_step, self.phase = state.get("step"), state.get("phase", 0)
        self._settled = self._last_step
        device = self.device
        M = self.topo.micro_batches
        for g in sorted(state.get("in_flight", {})):
            saved = state["in_flight"][g]
            inputs = {k: t.to(device) for k, t in saved["inputs"].items()}
            act = self.stage.forward(inputs, params=self.stash.replay_params(g) if self.stash else None)
            if self.stage.is_last:
                target = self.data.target(g // M, g % M)
                act.loss = self.stage.loss(act.output, target.to(device) if target is not None else None)
            self._acts[g] = act
            if saved["grads"] is not None:
                self._out_grads[g] = {k: t.to(device) for k, t in saved["grads"].items()}

    def _receive_in_transit(self) -> None:
        """Receive now the messages sent to this rank that its next step's list would receive."""
        if self._settled == self._last_step or self._last_step is None:
            return
        M = self.topo.micro_batches
        base = (self._last_step + 1) * M
        for peer, kind, m in in_transit(self.topo, self.schedule, self.phase - 1)[self.rank]:
            g = base + m
            ins = RecvGradients(m, peer) if kind == "grad" else RecvActivations(m, peer)
            held = self._out_grads if kind == "grad" else self._inputs
            held[g] = self.channel().recv(peer, message_key(ins, g, M))
        self._settled = self._last_step

    def compute_context(self) -> contextlib.AbstractContextManager:
        """Where forwards and losses run: ``torch.autocast`` to the mixed-precision dtype, if any."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def on_wire(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """``tensors`` as they travel: floating-point ones in ``wire_dtype`` (when set)."""
        if self.wire_dtype is None:
            return tensors
        return {k: t.detach().to(self.wire_dtype) if t.is_floating_point() else t for k, t in tensors.items()}

    def channel(self) -> Transport:
        """The transport; an error naming the rank when the engine was built without one."""
        if self.transport is None:
            raise RuntimeError(f"rank {self.rank} sends or receives, but its engine was given no transport")
        return self.transport

    # ---- instructions ------------------------------------------------------------------
    def _execute(self, ins: MicroBatchInstruction, g: int, frozen: set[int], result: StepResult) -> None:
        """Run an instruction about micro-batch ``g`` (numbered over the run)."""
        M = self.topo.micro_batches
        stage = self.stage
        if isinstance(ins, LoadInput):
            named = stage.data_inputs(self.data.input(g // M, g % M))
            self._inputs[g] = {k: v.to(self.device, non_blocking=True) for k, v in named.items()}
        elif isinstance(ins, RecvActivations):
            if g not in self._inputs:       # else received early, at a checkpoint
                self._inputs[g] = self.channel().recv(ins.peer, message_key(ins, g, M))
        elif isinstance(ins, Forward):
            params = self.stash.forward_params(g, g in frozen) if self.stash else None
            with self.meter.forward(), self.compute_context():
                act = self._acts[g] = stage.forward(self._inputs.pop(g), params=params)
            self.meter.hold(g, act.inputs, act.outputs, act.output)
        elif isinstance(ins, SendActivations):
            self.channel().send(ins.peer, message_key(ins, g, M), self.on_wire(self._acts[g].outputs))
        elif isinstance(ins, LoadTarget):
            target = self.data.target(g // M, g % M)
            self._targets[g] = target.to(self.device, non_blocking=True) if target is not None else None
        elif isinstance(ins, Loss):
            act = self._acts[g]
            with self.meter.forward(), self.compute_context():
                act.loss = stage.loss(act.output, self._targets.pop(g))
            self.meter.hold(g, act.loss)
            if g // M == result.step:
                result.losses[g % M] = act.loss.detach()
        elif isinstance(ins, RecvGradients):
            if g not in self._out_grads:    # else received early, at a checkpoint
                self._out_grads[g] = self.channel().recv(ins.peer, message_key(ins, g, M))
        elif isinstance(ins, SyncStart):
            self._sync_next = g
        elif isinstance(ins, Backward):
            act = self._scaled(self._acts.pop(g))
            with self._sync_if(g), self.meter.backward(stage.recompute):
                grads = stage.backward(act, self._out_grads.pop(g, None))
            self.meter.drop(g)
            if self.stash:
                self.stash.backward_done(g)
            if not stage.is_first:
                self._in_grads[g] = grads
        elif isinstance(ins, BackwardInput):
            act = self._scaled(self._acts.pop(g))
            with self.sync.no_sync(), self.meter.backward(stage.recompute):   # no parameter gradient: no sync
                grads, work = stage.backward_input(act, self._out_grads.pop(g, None))
            self._weight_work[g] = (act, work)
            if not stage.is_first:
                self._in_grads[g] = grads
        elif isinstance(ins, BackwardWeight):
            _, work = self._weight_work.pop(g)
            with self._sync_if(g), self.meter.backward(stage.recompute):
                stage.backward_weight(work)
            self.meter.drop(g)
        elif isinstance(ins, SendGradients):
            self.channel().send(ins.peer, message_key(ins, g, M), self.on_wire(self._in_grads.pop(g)))
        else:
            raise TypeError(f"unknown instruction {ins!r}")

    def _scaled(self, act: Activation) -> Activation:
        """The last stage's activation with its loss multiplied by the fp16 loss scale (if any)."""
        if self.loss_scale is not None and self.stage.is_last and act.loss is not None:
            act.loss = act.loss * self.loss_scale()
        return act

    def _sync_if(self, g: int):
        """The context of the backward that completes micro-batch g's parameter gradients: it
        starts the replicas' sync when a SyncStart named g, else accumulates (``no_sync``)."""
        synced = self._sync_next == g
        self._sync_next = None
        return contextlib.nullcontext() if synced else self.sync.no_sync()

    def _execute_step_level(self, ins: Instruction, result: StepResult) -> None:
        if isinstance(ins, SyncWait):
            self.sync.finish()
        elif isinstance(ins, Step):
            self._optimizer_step(ins.grad_scale)
            result.optimizer_steps += 1
        else:
            raise TypeError(f"unknown instruction {ins!r}")

    def _optimizer_step(self, scale: float) -> None:
        if self.tied is not None:
            self.tied.reduce()
        if scale != 1.0:
            with torch.no_grad():
                for p in self.stage.parameters():
                    if p.grad is not None:
                        p.grad.mul_(scale)
        if self.before_step is not None and self.before_step() is False:
            self.optimizer.zero_grad(set_to_none=True)
            return
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.stash:
            self.stash.stepped()

    def _held(self) -> list[torch.Tensor]:
        """Tensors the stage holds outside autograd's graph: weights, optimizer state, stashed versions."""
        out = list(self.stage.parameters()) + optimizer_tensors(self.optimizer)
        return out + (self.stash.tensors() if self.stash else [])

    def _grad_bytes(self) -> int:
        return tensors_bytes(p for p in self.stage.parameters() if p.requires_grad)

    @staticmethod
    def _needs_frozen(program: list[Instruction]) -> set[int]:
        """Micro-batches (relative) whose forward is followed by an optimizer step before their
        backward, in this list or because the backward is in a later step's list."""
        out: set[int] = set()
        open_: dict[int, bool] = {}
        for ins in program:
            if isinstance(ins, Forward):
                open_[ins.micro_batch] = False
            elif isinstance(ins, Step):
                for m in open_:
                    open_[m] = True
            elif isinstance(ins, Backward) and ins.micro_batch in open_:
                if open_.pop(ins.micro_batch):
                    out.add(ins.micro_batch)
        return out | set(open_)


def _clone(tensors: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
    return None if tensors is None else {k: t.detach().clone() for k, t in tensors.items()}
