"""The instructions of a pipeline schedule: plain frozen values, one list per rank and step.

``micro_batch`` is counted from the first micro-batch of the step the list belongs to: 0..M-1
for this step's micro-batches, negative for earlier steps' (pipedream carries micro-batches
in flight from one step into the next). ``peer`` is the global rank on the other side.
``stage`` is the GLOBAL index of the stage (model chunk) the instruction runs on: a rank of a plan
with virtual stages (interleaved-1f1b, zbv) holds several chunks and runs each instruction on its
``stage``'s module; for the other schedules it is the rank's only stage.

Gradient syncs are per chunk: ``SyncStart(m, stage)`` precedes the op that completes chunk
``stage``'s weight gradients of the step, and ``SyncWait(stage)`` waits for that chunk's all-reduce.
A rank with V chunks starts V syncs in a step and waits for all V (in the order started) just
before its ``Step``; with one chunk this is the old order (SyncStart, Backward, SyncWait, Step).
The engine (engine.py) executes a list; validate.py checks a set of lists without running them.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoadInput:
    """Stage 0: fetch micro-batch ``micro_batch``'s input from the data source."""

    micro_batch: int
    stage: int


@dataclass(frozen=True)
class RecvActivations:
    """Receive the previous stage's outputs for ``micro_batch`` from ``peer``."""

    micro_batch: int
    peer: int
    stage: int


@dataclass(frozen=True)
class Forward:
    micro_batch: int
    stage: int


@dataclass(frozen=True)
class SendActivations:
    """Post this stage's outputs for ``micro_batch`` to ``peer`` (the next stage's replica)."""

    micro_batch: int
    peer: int
    stage: int


@dataclass(frozen=True)
class LoadTarget:
    """Last stage: fetch micro-batch ``micro_batch``'s target from the data source."""

    micro_batch: int
    stage: int


@dataclass(frozen=True)
class Loss:
    """Last stage: the micro-batch's mean loss from the forward's output and the target."""

    micro_batch: int
    stage: int


@dataclass(frozen=True)
class RecvGradients:
    """Receive the gradients of this stage's outputs for ``micro_batch`` from ``peer``."""

    micro_batch: int
    peer: int
    stage: int


@dataclass(frozen=True)
class Backward:
    """Backpropagate ``micro_batch``; parameter grads accumulate (under ``no_sync`` unless a
    SyncStart precedes it)."""

    micro_batch: int
    stage: int


@dataclass(frozen=True)
class BackwardInput:
    """The first half of a split backward (zero-bubble schedules): only the gradients of the
    stage's inputs (to send on); the graph stays alive for :class:`BackwardWeight`."""

    micro_batch: int
    stage: int


@dataclass(frozen=True)
class BackwardWeight:
    """The second half of a split backward: the parameters' gradients of ``micro_batch``, from
    what :class:`BackwardInput` left (accumulates; starts the sync when a SyncStart precedes it)."""

    micro_batch: int
    stage: int


@dataclass(frozen=True)
class SendGradients:
    """Post the gradients of this stage's inputs for ``micro_batch`` to ``peer``."""

    micro_batch: int
    peer: int
    stage: int


@dataclass(frozen=True)
class SyncStart:
    """The next Backward or BackwardWeight (of ``micro_batch``) starts the replicas' gradient all-reduce."""

    micro_batch: int
    stage: int


@dataclass(frozen=True)
class SyncWait:
    """Wait until the all-reduce of ``stage``'s gradients (started by its SyncStart) is done (a collective)."""

    stage: int


@dataclass(frozen=True)
class Step:
    """Multiply the (summed) gradients by ``grad_scale``, step the optimizer, zero the grads."""

    grad_scale: float


# the instructions about one micro-batch (all but SyncWait and Step, which are about the step)
MicroBatchInstruction = (LoadInput | RecvActivations | Forward | SendActivations | LoadTarget | Loss | RecvGradients
                         | Backward | BackwardInput | BackwardWeight | SendGradients | SyncStart)
StepInstruction = SyncWait | Step     # the instructions about the whole step
Instruction = MicroBatchInstruction | StepInstruction
# The interpreters (engine.py, evaluation.py, validate.py, simulator.py) dispatch with ``match`` and end
# in ``assert_never``: a new instruction added to these unions is named by mypy in every one that misses it.

SENDS = (SendActivations, SendGradients)
RECEIVES = (RecvActivations, RecvGradients)


def message_key(instr: Instruction, global_micro_batch: int, micro_batches: int) -> str:
    """The transport key of a send/receive: ``act/<s>/<m>`` or ``grad/<s>/<m>``, s = the stage that
    PRODUCED the activations the message carries or answers (both ends agree on it: activations
    sent by stage s and the gradients stage s+1 sends back for them carry s), m = the micro-batch's
    index in its own step (the run's micro-batch ``global_micro_batch`` modulo M). Both ends agree
    on it even when a message crosses a step boundary, a step's keys repeat every step (as the
    ``sra`` channel mode's per-step transfer orders require), and two chunks exchanging messages
    between the same pair of ranks never collide."""
    if isinstance(instr, (SendActivations, RecvGradients)):
        producer = instr.stage
    elif isinstance(instr, (RecvActivations, SendGradients)):
        producer = instr.stage - 1
    else:
        raise TypeError(f"{instr} is not a send or a receive")
    kind = "act" if isinstance(instr, (SendActivations, RecvActivations)) else "grad"
    return f"{kind}/{producer}/{global_micro_batch % micro_batches}"


def short(instr: Instruction, *, stages: bool = False) -> str:
    """A compact name for printing lists: ``F3``, ``B3``, ``>a3@2`` (send act to rank 2), ``<g3@2``, ...;
    with ``stages`` (a rank with several chunks) the stage follows: ``F3:s5``, ``>a3@2:s5``, ``wait:s5``."""
    m = getattr(instr, "micro_batch", None)
    peer = getattr(instr, "peer", None)
    names = {LoadInput: "in", Forward: "F", LoadTarget: "tgt", Loss: "L", Backward: "B", BackwardInput: "Bi",
             BackwardWeight: "W",
             RecvActivations: "<a", SendActivations: ">a", RecvGradients: "<g", SendGradients: ">g",
             SyncStart: "sync", SyncWait: "wait"}
    if isinstance(instr, Step):
        return f"step(x{instr.grad_scale:.3g})"
    text = f"{names[type(instr)]}{'' if m is None else m}"
    text = f"{text}@{peer}" if peer is not None else text
    return f"{text}:s{instr.stage}" if stages else text


# the timeline phase each instruction's time counts to (runtime/timeline.py's PHASES); SyncStart has none
PHASES: dict[type, str] = {
    LoadInput: "receive_for", RecvActivations: "receive_for", Forward: "run_for", LoadTarget: "run_for",
    Loss: "run_for", SendActivations: "send_for", RecvGradients: "receive_back", Backward: "run_back",
    BackwardInput: "run_back", BackwardWeight: "run_back", SendGradients: "send_back", SyncWait: "sync",
    Step: "step"}
