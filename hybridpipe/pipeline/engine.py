"""Executing one rank's instruction list for one training step.

    engine = PipelineEngine(stages, topo, rank, plan.kind, transport=channels, sync=hdp,
                            optimizer=opt, data=data, recorder=recorder)
    for step in range(steps):
        result = engine.run_step(step, drain=step == steps - 1)   # drain matters for pipedream only
        result.losses                                            # last stage: {micro-batch: loss}

``stages``: the rank's stage, or with virtual stages (interleaved-1f1b, zbv) its chunks, one
PipelineStage per entry of ``topo.stages_of(rank)``: every micro-batch instruction runs on its
``stage``'s chunk, and activations, gradients and split-backward weight work are kept per chunk.
What is per rank works on :attr:`PipelineEngine.module` (chunks.rank_module: every chunk's
parameters, a weight two chunks share once): the optimizer, the Step's gradient scaling, the
memory meter.

Interfaces (duck-typed, see the project's contracts; the protocols are in ports.py):

* ``transport``: ``send(peer, key, tensors)`` (posts), ``recv(peer, key) -> tensors`` (blocks);
  keys are ``act/<s>/<m>`` and ``grad/<s>/<m>`` (``instructions.message_key``: s the producing
  stage, m the micro-batch's index in its step; see ``schedules.transfer_program`` for the ``sra``
  mode's orders). A message from one chunk of this rank to another never reaches the transport.
* ``sync``: ``no_sync()`` (context: backward inside it starts no all-reduce), ``finish()``
  (wait for the started all-reduces) and ``sum_replicas(tensor)`` (sum in place across the
  replicas, blocking: after each step, a replicated chunk's batch-norm statistics;
  batch_stats.py). Gradients must be *summed* across replicas
  (``HybridDataParallel(..., reduce="sum")``): the schedule's Step applies 1/M (or 1/r; where exact,
  the last stage's backward seed applies the 1/M instead: loss_seed.py).
  ``None`` for an unreplicated stage. With several chunks, a mapping stage index -> sync (each
  chunk's replicas sync its own parameters: ``SyncStart(m, s)`` / ``SyncWait(s)`` name the chunk).
* ``optimizer``: a ``torch.optim.Optimizer`` over :attr:`PipelineEngine.module`'s parameters.
* ``data``: ``input(step, micro_batch)`` and ``target(step, micro_batch)`` (see data.py).
* ``recorder`` (optional): ``record(phase, micro_batch, t0, t1, stage)``, phase one of
  receive_for, run_for, send_for, receive_back, run_back, sync, send_back, step; ``stage`` the
  chunk's global stage index (None for Step, which is about the rank).
* ``before_step`` (optional): called right before each optimizer step, once the gradients are
  final (replicas summed, tied copies summed, scaled by the Step's factor): e.g. clipping; when
  it returns False the step is skipped (gradients zeroed, no update).
* ``loss_scale`` (optional): the last stage multiplies each loss by ``loss_scale()`` before its
  backward (fp16 loss scaling; ``before_step`` divides the gradients back). Give it, ``tokens`` and
  ``autocast`` to every rank's engine alike: whether the last stage's backward seed carries the
  Step's 1/M, and so whether every rank's Step skips it, depends on them (loss_seed.py).
* ``tokens`` (optional, pipeline/tokens.py): token-weighted loss; each backward starts from the
  micro-batch's loss sum and the Step multiplies by 1 / (the step's valid tokens) instead of 1/M.
* ``news`` (optional, stepnews.py): the sends in ``news.route.sends`` carry ``news.outgoing(step, losses)``
  (as ``stepnews.NEWS``); the receive ``news.route.receive`` hands it to ``news.incoming``.
* ``autocast`` (optional dtype, e.g. ``torch.bfloat16``): forwards and losses run under
  ``torch.autocast`` (weights, gradients and optimizer state stay float32; the stages must be
  captured under the same autocast, ``capture_model(autocast=)``). Activations and gradients travel
  in the dtype the stage computed them in, as the unsplit model holds them: what autocast made
  16-bit crosses in 16 bits, a float32 residual stream in float32.

The instructions themselves run in micro_batch_ops.py (a micro-batch's: load, receive, forward,
send, loss, backward) and step_ops.py (SyncWait, the optimizer Step); StepResult is step_result.py's.

``run_eval(data)`` runs the forward-only evaluation list (``schedules.eval_program``) in
evaluation mode without autograd: no gradient, no weight or optimizer change.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from hybridpipe.errors import UserError
from hybridpipe.partitioner.schedule_registry import Schedule
from hybridpipe.pipeline import engine_state, evaluation
from hybridpipe.pipeline.chunks import rank_module
from hybridpipe.pipeline.data import DataSource
from hybridpipe.pipeline.inflight import InFlight
from hybridpipe.pipeline.instructions import PHASES, Instruction, MicroBatchInstruction, StepInstruction
from hybridpipe.pipeline.loss_seed import loss_seed
from hybridpipe.pipeline.memory import MemoryMeter, optimizer_tensors, tensors_bytes
from hybridpipe.pipeline.micro_batch_ops import run_micro_batch
from hybridpipe.pipeline.ports import StepNews, TiedReduce, Transport, chunk_syncs
from hybridpipe.pipeline.schedules import Topology, check_schedulable, forwarded, rank_program, settle_phase
from hybridpipe.pipeline.stage import PipelineStage
from hybridpipe.pipeline.stash import WeightStash, needs_frozen
from hybridpipe.pipeline.step_ops import run_step_level
from hybridpipe.pipeline.step_result import StepResult
from hybridpipe.pipeline.stepnews import carried_by
from hybridpipe.pipeline.tokens import TokenCounts, check_normalization


class PipelineEngine:
    """Runs a rank's schedule step by step (see the module docstring)."""

    def __init__(self, stages: PipelineStage | Sequence[PipelineStage], topo: Topology, rank: int,
                 schedule: Schedule, *,
                 transport: Transport | None, optimizer: torch.optim.Optimizer, data: DataSource,
                 sync: Any = None, recorder=None, tied: TiedReduce | None = None,
                 clock: Callable[[], float] = time.perf_counter,
                 before_step: Callable[[], bool | None] | None = None, autocast: torch.dtype | None = None,
                 loss_scale: Callable[[], float] | None = None, tokens: TokenCounts | None = None,
                 memory_every: int = 1, news: StepNews | None = None):
        check_schedulable(topo, schedule)
        chunks = [stages] if isinstance(stages, PipelineStage) else list(stages)
        expected = list(topo.stages_of(rank))
        if [s.index for s in chunks] != expected:
            raise ValueError(f"rank {rank} runs stage {','.join(map(str, expected))} of the plan, but the engine got "
                             f"stage {','.join(str(s.index) for s in chunks)}")
        self.stages: dict[int, PipelineStage] = {s.index: s for s in chunks}
        self.module = rank_module([s.module for s in chunks])
        self.topo, self.rank, self.schedule = topo, rank, schedule
        self.transport, self.optimizer, self.data = transport, optimizer, data
        self.syncs = chunk_syncs(sync, expected)
        self.tied, self.before_step = tied, before_step
        self.autocast, self.loss_scale, self.tokens = autocast, loss_scale, tokens
        if tokens is not None:
            check_normalization("tokens", schedule.flushed, schedule.name)
        if tied is not None and not schedule.keeps_tied_weights:
            raise UserError(f"{schedule.name}'s asynchronous updates cannot keep a weight that several stages share "
                            "(tied embeddings) identical; use --schedule 1f1b or gpipe, or a plan that keeps its uses "
                            "in one stage")
        if schedule.asynchronous and len(chunks) > 1:
            raise UserError(f"{schedule.name} runs one stage per rank, but rank {rank} holds stages {expected}; "
                            "use --schedule interleaved-1f1b or zbv for virtual stages")
        self.recorder, self.clock = recorder, clock
        self.stash = WeightStash(chunks[0].module) if schedule.asynchronous else None
        self.device = chunks[0].device     # where inputs and targets go (place the stages before the engine)
        self.meter = MemoryMeter(self._held, self._grad_bytes, self.device, [c.module for c in chunks],
                                 static_changes=self.stash is not None)
        self.memory_every = memory_every
        self.phase = 0              # steps since the pipeline was (re)started (pipedream)
        self.last_step: int | None = None   # the step run last
        self.flight = InFlight()            # per (stage, micro-batch): what the rank holds between instructions
        self._settle = settle_phase(topo, schedule)
        self._programs: dict[tuple[int, bool], list[Instruction]] = {}
        self._forwarded: dict[tuple[int, int, bool], tuple[int, ...]] = {}    # (stage, phase, drain): all replicas
        self._local: dict[str, dict[str, torch.Tensor]] = {}    # messages from one chunk of this rank to another
        self.params = tuple(self.module.parameters())      # fixed objects: listed once, not every Step
        # the Step's 1/M in the last stage's backward seed where that gives the same bits (loss_seed.py)
        self.loss_seed = loss_seed(topo.micro_batches, schedule, tokens=tokens is not None,
                               loss_scale=loss_scale is not None, autocast=autocast)
        self.news = news        # its route's instructions stand in the lists, found by identity (carried_by)
        self.news_receive = news.route.receive if news is not None else None
        self.news_sends = frozenset(map(id, news.route.sends)) if news is not None else frozenset()

    # ---- public ------------------------------------------------------------------------
    @property
    def stage(self) -> PipelineStage:
        """The rank's stage (a rank with several chunks has :attr:`stages`)."""
        if len(self.stages) > 1:
            raise RuntimeError(f"rank {self.rank} holds stages {list(self.stages)}; use engine.stages")
        return next(iter(self.stages.values()))

    @property
    def in_flight(self) -> list[int]:
        """Micro-batches (numbered over the run) forwarded here but not yet backwarded."""
        return self.flight.micro_batches()

    def program(self, drain: bool = False) -> list[Instruction]:
        """The instruction list the next ``run_step`` executes (lists repeat once settled: cached)."""
        key = (min(self.phase, self._settle), drain)
        if key not in self._programs:
            program = rank_program(self.topo, self.rank, self.schedule, phase=key[0], drain=drain)
            self._programs[key] = carried_by(program, self.news.route) if self.news is not None else program
        return self._programs[key]

    def run_step(self, step: int, *, drain: bool = False, recorder=None) -> StepResult:
        """Execute this rank's list for ``step``. With pipedream, ``drain=True`` finishes every
        micro-batch in flight (do it on the last step); steps between drains must be
        consecutive (a checkpoint needs no drain, see :meth:`state_dict`). ``recorder``
        replaces the engine's recorder for this step."""
        recorder = recorder if recorder is not None else self.recorder
        if self.flight.acts and self.last_step is not None and step != self.last_step + 1:
            raise RuntimeError(f"step {step} follows step {self.last_step} while micro-batches "
                               f"{self.in_flight} are in flight; run consecutive steps or drain first")
        program = self.program(drain)
        M = self.topo.micro_batches
        frozen = {step * M + m for m in needs_frozen(program)} if self.stash else set()
        result = StepResult(step)
        self.meter.begin_step(self.measures_memory(step))
        clock = self.clock if recorder is not None else None    # no recorder: no clock read, no lookup
        for ins in program:
            t0 = clock() if clock is not None else 0.0
            if isinstance(ins, MicroBatchInstruction):
                g = step * M + ins.micro_batch
                self._execute(ins, ins.stage, g, frozen, result)
            else:
                g = -1                      # SyncWait and Step are about the step
                self._execute_step_level(ins, result)
            if clock is not None and (phase := PHASES.get(type(ins))) is not None:
                recorder.record(phase, g, t0, clock(), getattr(ins, "stage", None))
        result.peak_memory_bytes = self.meter.end_step()
        self._combine_stats(step, drain)
        self.last_step = step
        self.phase = 0 if drain else self.phase + 1     # the same on every rank
        return result

    def measures_memory(self, step: int) -> bool:
        """Whether ``step``'s peak memory is measured (``memory_every``: 1 every step, 0 none, N steps
        0, 1 and every Nth; asynchronous schedules, whose micro-batches cross steps, every step but with 0)."""
        every = self.memory_every
        return every > 0 and (every == 1 or self.schedule.asynchronous or step < 2 or step % every == 0)

    def run_eval(self, data: DataSource, *, recorder=None, counts: dict[int, torch.Tensor] | None = None
                 ) -> dict[int, torch.Tensor]:
        """One forward-only evaluation step over ``data`` (see ``evaluation.run_eval``)."""
        return evaluation.run_eval(self, data, recorder=recorder, counts=counts)

    def state_dict(self) -> dict:
        """The engine's own state for checkpoints (see ``engine_state.engine_state``)."""
        return engine_state.engine_state(self)

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s state into a fresh engine (see ``engine_state.load_engine_state``)."""
        engine_state.load_engine_state(self, state)

    def compute_context(self) -> contextlib.AbstractContextManager:
        """Where forwards and losses run: ``torch.autocast`` to the mixed-precision dtype, if any."""
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast)

    def send(self, peer: int, key: str, tensors: dict[str, torch.Tensor]) -> None:
        """Post ``tensors`` to ``peer``; to this very rank (two neighbouring model chunks of one
        rank, e.g. zbv's turn of the V) they stay here."""
        if peer == self.rank:
            self._local[key] = {k: t.detach() for k, t in tensors.items()}
        elif self.transport is not None:         # checked here, not in a call per message
            self.transport.send(peer, key, tensors)
        else:
            self.channel()

    def recv(self, peer: int, key: str) -> dict[str, torch.Tensor]:
        """The tensors ``peer`` sent under ``key`` (blocks until they arrive)."""
        if peer == self.rank:
            if key not in self._local:
                raise RuntimeError(f"rank {self.rank} receives {key!r} from itself before sending it")
            return self._local.pop(key)
        if self.transport is not None:
            return self.transport.recv(peer, key)
        return self.channel().recv(peer, key)

    def channel(self) -> Transport:
        """The transport; an error naming the rank when the engine was built without one."""
        if self.transport is None:
            raise RuntimeError(f"rank {self.rank} sends or receives, but its engine was given no transport")
        return self.transport

    # ---- instructions (micro_batch_ops.py, step_ops.py; methods: what a profiler wraps) ---------------
    def _execute(self, ins: MicroBatchInstruction, s: int, g: int, frozen: set[int], result: StepResult) -> None:
        """Run an instruction about micro-batch ``g`` (numbered over the run) on chunk ``s``."""
        run_micro_batch(self, ins, s, g, frozen, result)

    def _execute_step_level(self, ins: StepInstruction, result: StepResult) -> None:
        run_step_level(self, ins, result)

    def _combine_stats(self, step: int, drain: bool) -> None:
        """Replicated chunks: every replica's running statistics of the step's micro-batches,
        replayed in micro-batch order (batch_stats.py: one sum over the chunk's replicas)."""
        M = self.topo.micro_batches
        for s, stage in sorted(self.stages.items()):
            if stage.stats is not None and stage.stats.combines:
                key = (s, min(self.phase, self._settle), drain)
                if key not in self._forwarded:
                    self._forwarded[key] = forwarded(self.topo, self.schedule, s, phase=key[1], drain=drain)
                stage.stats.combine([step * M + m for m in self._forwarded[key]], self.syncs[s].sum_replicas)

    def _held(self) -> list[torch.Tensor]:
        """Tensors the rank holds outside autograd's graph: weights, optimizer state, stashed versions."""
        out = list(self.module.parameters()) + optimizer_tensors(self.optimizer)
        shards = getattr(self.optimizer, "shard_tensors", None)      # ZeRO-3: the owned pieces of the weights
        out += shards() if callable(shards) else []
        return out + (self.stash.tensors() if self.stash else [])

    def _grad_bytes(self) -> int:
        own = getattr(self.optimizer, "grad_bytes", None)      # a sharded stage's: its share (comm/sharded)
        if callable(own):
            return int(own())
        return tensors_bytes(p for p in self.params if p.requires_grad)

