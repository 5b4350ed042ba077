"""What a training run measured, reduced to the numbers ``refinement.py`` compares with the cost model.

Pure functions over plain data: each rank's timeline events (the Chrome trace events that
``runtime/timeline.py`` writes: phases with ``args.step`` / ``args.micro_batch``, p2p transfers
with ``args.peer`` / ``args.bytes``, durations in microseconds) and the run's ``summary.json``
(stage node ranges, micro-batches, schedule, the all-reduce each layer ran, the measured step).
The commands read the files (``commands/refine_io.py``); nothing here touches a process group.

Per stage, over the steady steps (the summary's warm-up steps left out, and always the run's
first step: it builds buffers, warms caches and waits for every rank to arrive) and its
replicas: the median forward (the first stage's with loading the batch) and backward of one
micro-batch, the median wait per step at the end of the backward for the gradient all-reduce
(the ``sync`` phase: what the all-reduces did not hide; of a replicated stage, each step the wait
of the replica whose last backward ended last: the others also wait for it to free its gradients,
time that is the replicas' skew, not the all-reduces'), and the median ``step`` phase per step
(the tied weights' sum across stages, then the optimizer step), and the median of each step's first
backward apart from the median of its later ones (these add to gradients already there:
``cost/computeterms.py``).
Per rank: every p2p transfer (peer, bytes, seconds, and whether the rank sent or received it:
a message ``act/<m>`` goes to a later stage, ``grad/<m>`` to an earlier one). A sender's time
runs from posting the message to its last byte leaving; a receiver's from the header's
arrival to the last byte's, the wire time without the wait for the sender.
Per run: the job's step times over the steady steps (how noisy its median is).

The steady steps also leave out the leading ones still warming up (:func:`settling_steps`: each slower than
``SETTLE_LIMIT`` times the median of the steps after it, at most half of them): the summary's warm-up is a
fixed fifth of the run (one step of 6), and on the Llama of the pred7 recording the second step of every
short run was still 1.56x the later ones (every rank's forwards and backwards slower), which a median of 5
steps does not absorb.

With ``stall_limit``, a steady step in which some rank's compute (its forwards and backwards)
ran more than ``stall_limit`` times that rank's own median over the steady steps is left out
of every number above, the measured step included (the median of the job's other steady
steps): the host stalled (the machine's other work took its CPU), which no plan's model
prices. One rule for every run, so a plan's reruns and its prediction are judged alike.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from hybridpipe.errors import UserError
from hybridpipe.jsonfile import field

SETTLE_LIMIT = 1.2    # a leading step slower than this times the median of the steps after it is warming up


@dataclass(frozen=True)
class StageObservation:
    """One stage of a run: node range, the ranks of its replicas, and what they measured (ms)."""

    first: int
    last: int
    ranks: tuple[int, ...]
    forward_ms: float | None          # median of one micro-batch (None: never seen)
    backward_ms: float | None
    sync_wait_ms: float | None        # median per step (None: not replicated / never seen)
    algorithms: dict[str, str]        # layer name -> all-reduce algorithm that ran (the summary's)
    step_ms: float | None = None      # median per step of the ``step`` phase: tied sum + optimizer step
    first_backward_ms: float | None = None   # median of each step's first backward (no gradients yet)
    later_backward_ms: float | None = None   # median of the step's other backwards (they accumulate)


@dataclass(frozen=True)
class Transfer:
    rank: int
    peer: int
    nbytes: int
    seconds: float
    sent: bool | None = None          # True: the rank sent it, False: received it, None: unknown


@dataclass(frozen=True)
class RunObservation:
    """One run, as refinement.py reads it."""

    name: str                         # the run directory (provenance)
    stages: tuple[StageObservation, ...]
    transfers: tuple[Transfer, ...]
    schedule: str
    micro_batches: int
    measured_step_ms: float | None
    predicted_step_ms: float | None   # what the plan said when it ran
    step_times_ms: tuple[float, ...] = ()   # the job's steady steps (the summary's job_step_ms)


@dataclass(frozen=True)
class RankEvents:
    """One rank's trace: its rank, stage, replica and its complete ("X") events."""

    rank: int
    stage: int
    replica: int
    events: Sequence[dict]


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def steady_steps(ranks: Sequence[RankEvents], warmup: int) -> set[int]:
    """The steps every rank recorded, without the first ``max(warmup, 1)`` of them (the first is
    a warm-up whatever the summary says; a run of one step keeps it, having nothing else)."""
    seen = [{int(e["args"]["step"]) for e in r.events if e.get("args", {}).get("step") is not None} for r in ranks]
    common = sorted(set.intersection(*seen)) if seen else []
    skip = max(warmup, 1)
    return set(common[skip:] if len(common) > skip else common[-1:])


def settling_steps(times: Sequence[float], limit: float = SETTLE_LIMIT) -> int:
    """How many of the leading steps of ``times`` (the steady steps in order) are still warming up: the first
    while it is slower than ``limit`` times the median of the steps after it, then the next likewise; at most
    as many as leave half of them (and two) behind."""
    keep = max(2, (len(times) + 1) // 2)
    drop = 0
    while len(times) - drop > keep and times[drop] > limit * statistics.median(times[drop + 1:]):
        drop += 1
    return drop


def without_settling(steps: set[int], jobs: dict[int, float]) -> set[int]:
    """``steps`` less their leading ones still warming up by the job's times ``jobs`` (step -> ms;
    :func:`settling_steps`); steps without a time stay."""
    timed = [k for k in sorted(steps) if k in jobs]
    return steps - set(timed[:settling_steps([jobs[k] for k in timed])])


def stalled_steps(ranks: Sequence[RankEvents], steps: set[int], limit: float) -> set[int]:
    """The steps of ``steps`` in which some rank's forwards and backwards took more than ``limit`` times
    that rank's median over ``steps`` (module docstring); empty where that would leave no step."""
    stalled: set[int] = set()
    for r in ranks:
        per_step: dict[int, float] = {}
        for e in r.events:
            step = e.get("args", {}).get("step")
            if e.get("cat") == "phase" and e.get("name") in ("run_for", "run_back") and step in steps:
                per_step[int(step)] = per_step.get(int(step), 0.0) + float(e["dur"])
        if len(per_step) > 1:
            typical = statistics.median(per_step.values())
            stalled |= {s for s, us in per_step.items() if us > limit * typical}
    return stalled if stalled < steps else set()


@dataclass(frozen=True)
class RankMedians:
    """One rank's medians over the steady steps (ms; None where never seen), and its per-step sync waits and
    last backwards' ends (what :func:`last_replica_wait_ms` compares across replicas)."""

    forward_ms: float | None          # one micro-batch
    backward_ms: float | None
    step_ms: float | None             # per step
    sync_by_step: dict[int, float]    # step -> its sync wait (ms), where one was recorded
    back_end_by_step: dict[int, float]  # step -> when its last backward ended (trace us)
    first_backward_ms: float | None = None   # the step's first backward in time (median over the steps)
    later_backward_ms: float | None = None   # the others (median over them all)


def rank_medians(events: Sequence[dict], steps: set[int], *, loads_input: bool = False) -> RankMedians:
    """Forward, backward (per micro-batch), sync wait and ``step`` phase (per step) medians of one rank.

    A micro-batch's forward is every ``run_for`` record of it (the last stage records its
    target's loading apart) and, where the rank ``loads_input`` (the first stage), its
    ``receive_for``: loading the batch is compute on that rank, which every plan pays there."""
    fwd: dict[tuple[int, int], float] = {}
    bwd: dict[tuple[int, int], float] = {}
    sync_per_step: dict[int, float] = {}
    step_per_step: dict[int, float] = {}
    back_end: dict[int, float] = {}
    back_start: dict[tuple[int, int], float] = {}
    forward_phases = ("run_for", "receive_for") if loads_input else ("run_for",)
    for e in events:
        args = e.get("args", {})
        step = args.get("step")
        if e.get("cat") != "phase" or step not in steps:
            continue
        ms, key = float(e["dur"]) / 1e3, (int(step), int(args.get("micro_batch", -1)))
        if e["name"] in forward_phases:
            fwd[key] = fwd.get(key, 0.0) + ms
        elif e["name"] == "run_back":
            bwd[key] = bwd.get(key, 0.0) + ms
            back_end[step] = max(back_end.get(step, 0.0), float(e["ts"]) + float(e["dur"]))
            back_start[key] = min(back_start.get(key, float(e["ts"])), float(e["ts"]))
        elif e["name"] == "sync":
            sync_per_step[step] = sync_per_step.get(step, 0.0) + ms
        elif e["name"] == "step":
            step_per_step[step] = step_per_step.get(step, 0.0) + ms
    firsts = {step: min((t, key) for key, t in back_start.items() if key[0] == step)[1]
              for step in {key[0] for key in back_start}}
    first = set(firsts.values())
    return RankMedians(_median(list(fwd.values())), _median(list(bwd.values())),
                       _median(list(step_per_step.values())), sync_per_step, back_end,
                       _median([v for key, v in bwd.items() if key in first]),
                       _median([v for key, v in bwd.items() if key not in first]))


def last_replica_wait_ms(replicas: Sequence[RankMedians], steps: set[int]) -> float | None:
    """Median over ``steps`` of the sync wait of the replica whose last backward of the step ended last
    (the traces share a time origin: runtime/timeline.py aligns them at a barrier); None: no sync seen."""
    if not any(r.sync_by_step for r in replicas):
        return None
    waits = []
    for step in sorted(steps):
        if all(step in r.back_end_by_step for r in replicas):
            waits.append(max((r.back_end_by_step[step], r.sync_by_step.get(step, 0.0)) for r in replicas)[1])
    return _median(waits)


def direction(key: str, stage: int, peer_stage: int | None) -> bool | None:
    """Whether a rank of ``stage`` sent (True) or received (False) message ``key`` with a rank of ``peer_stage``."""
    kind = key.split("/", 1)[0]
    if peer_stage is None or peer_stage == stage or kind not in ("act", "grad"):
        return None
    return (peer_stage > stage) == (kind == "act")


def rank_transfers(rank: int, events: Sequence[dict], steps: set[int], stage: int = 0,
                   stage_of: dict[int, int] | None = None) -> list[Transfer]:
    """The p2p transfers of one rank over ``steps`` (empty messages left out); ``stage_of``: rank -> stage."""
    out = []
    for e in events:
        args = e.get("args", {})
        if e.get("cat") == "transfer" and args.get("step") in steps and int(args.get("bytes", 0)) > 0:
            peer = int(args["peer"])
            sent = direction(str(e.get("name", "")), stage, (stage_of or {}).get(peer))
            out.append(Transfer(rank, peer, int(args["bytes"]), float(e["dur"]) / 1e6, sent))
    return out


def job_step_map(summary: dict) -> dict[int, float]:
    """The summary's ``job_step_ms``: step -> the job's time for it (ms), in step order."""
    raw = summary.get("job_step_ms") or {}
    if not isinstance(raw, dict):
        return {}
    return dict(sorted((int(k), float(v)) for k, v in raw.items() if isinstance(v, (int, float)) and str(k).isdigit()))


def job_steps(summary: dict, warmup: int) -> tuple[float, ...]:
    """The job's step times after the warm-up (and the first step), from the summary's ``job_step_ms``."""
    steps = list(job_step_map(summary).values())
    skip = max(warmup, 1)
    return tuple(steps[skip:] if len(steps) > skip else steps[-1:])


def observe_run(name: str, summary: dict, ranks: Sequence[RankEvents],
                stall_limit: float | None = None) -> RunObservation:
    """A run's observation from its summary.json (parsed) and its ranks' traces; UserError if they disagree.
    ``stall_limit``: leave out the steps where a host stalled (module docstring)."""
    where = f"{name}: summary.json"
    stages_raw = field(summary, "stages", list, where)
    micro = field(summary, "micro_batches", int, where, minimum=1)
    schedule = field(summary, "schedule", str, where)
    warmup = field(summary, "warmup_steps", int, where, minimum=0, default=0)
    measured = summary.get("measured_step_ms")
    predicted = summary.get("predicted_step_ms")
    sync = summary.get("sync") or {}
    if not ranks:
        raise UserError(f"{name}: the run has no rank traces; run it with the timeline on (no --no-trace)")
    jobs = job_step_map(summary)
    every = steady_steps(ranks, warmup)
    steps = without_settling(every, jobs)
    times = job_steps(summary, warmup)
    if steps != every:
        times = tuple(jobs[k] for k in sorted(steps) if k in jobs)
        measured = statistics.median(times)
    if stall_limit is not None:
        steps -= stalled_steps(ranks, steps, stall_limit)
        kept = tuple(jobs[k] for k in sorted(steps) if k in jobs)
        if kept:
            times, measured = kept, statistics.median(kept)
    stages = []
    for k, entry in enumerate(stages_raw):
        if not (isinstance(entry, list) and len(entry) == 3 and all(isinstance(x, int) for x in entry)):
            raise UserError(f"{where}: stage {k} must be [first node, last node, replicas], got {entry!r}")
        mine = sorted((r for r in ranks if r.stage == k), key=lambda r: r.replica)
        if len(mine) != entry[2]:
            raise UserError(f"{name}: stage {k} has {entry[2]} replicas in summary.json but {len(mine)} rank traces; "
                            "pass the run directory of one complete run")
        med = [rank_medians(r.events, steps, loads_input=k == 0) for r in mine]
        algos = {str(e.get("layer")): str(e.get("algorithm")) for e in sync.get(str(k), []) or []
                 if isinstance(e, dict)}
        stages.append(StageObservation(entry[0], entry[1], tuple(r.rank for r in mine),
                                       _median([m.forward_ms for m in med if m.forward_ms is not None]),
                                       _median([m.backward_ms for m in med if m.backward_ms is not None]),
                                       last_replica_wait_ms(med, steps) if entry[2] > 1 else None,
                                       algos, _median([m.step_ms for m in med if m.step_ms is not None]),
                                       _median([m.first_backward_ms for m in med if m.first_backward_ms is not None]),
                                       _median([m.later_backward_ms for m in med if m.later_backward_ms is not None])))
    stage_of = {r.rank: r.stage for r in ranks}
    transfers = [t for r in ranks for t in rank_transfers(r.rank, r.events, steps, r.stage, stage_of)]
    return RunObservation(name, tuple(stages), tuple(transfers), schedule, micro,
                          float(measured) if isinstance(measured, (int, float)) else None,
                          float(predicted) if isinstance(predicted, (int, float)) else None, times)
