"""What a training run measured, reduced to the numbers ``refine.py`` compares with the cost model.

Pure functions over plain data: each rank's timeline events (the Chrome trace events that
``runtime/timeline.py`` writes: phases with ``args.step`` / ``args.micro_batch``, p2p transfers
with ``args.peer`` / ``args.bytes``, durations in microseconds) and the run's ``summary.json``
(stage node ranges, micro-batches, schedule, the all-reduce each layer ran, the measured step).
The commands read the files (``commands/refine_io.py``); nothing here touches a process group.

Per stage, over the steady steps (the summary's warm-up steps left out) and its replicas: the
median forward (the first stage's with loading the batch) and backward of one micro-batch, and
the median wait per step at the end of the backward for the gradient all-reduce (the ``sync``
phase: what the all-reduces did not hide).
Per rank: every p2p transfer (peer, bytes, seconds).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from hybridpipe.errors import UserError
from hybridpipe.jsonfile import field


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


@dataclass(frozen=True)
class Transfer:
    rank: int
    peer: int
    nbytes: int
    seconds: float


@dataclass(frozen=True)
class RunObservation:
    """One run, as refine.py reads it."""

    name: str                         # the run directory (provenance)
    stages: tuple[StageObservation, ...]
    transfers: tuple[Transfer, ...]
    schedule: str
    micro_batches: int
    measured_step_ms: float | None
    predicted_step_ms: float | None   # what the plan said when it ran


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
    """The steps every rank recorded, without the first ``warmup`` of them."""
    seen = [{int(e["args"]["step"]) for e in r.events if e.get("args", {}).get("step") is not None} for r in ranks]
    common = sorted(set.intersection(*seen)) if seen else []
    return set(common[warmup:] if len(common) > warmup else common[-1:])


def rank_medians(events: Sequence[dict], steps: set[int], *, loads_input: bool = False,
                 ) -> tuple[float | None, float | None, float | None]:
    """(forward ms, backward ms, sync wait ms per step) medians of one rank over ``steps``.

    A micro-batch's forward is every ``run_for`` record of it (the last stage records its
    target's loading apart) and, where the rank ``loads_input`` (the first stage), its
    ``receive_for``: loading the batch is compute on that rank, which every plan pays there."""
    fwd: dict[tuple[int, int], float] = {}
    bwd: dict[tuple[int, int], float] = {}
    sync_per_step: dict[int, float] = {}
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
        elif e["name"] == "sync":
            sync_per_step[step] = sync_per_step.get(step, 0.0) + ms
    return _median(list(fwd.values())), _median(list(bwd.values())), _median(list(sync_per_step.values()))


def rank_transfers(rank: int, events: Sequence[dict], steps: set[int]) -> list[Transfer]:
    """The p2p transfers of one rank over ``steps`` (empty messages left out)."""
    out = []
    for e in events:
        args = e.get("args", {})
        if e.get("cat") == "transfer" and args.get("step") in steps and int(args.get("bytes", 0)) > 0:
            out.append(Transfer(rank, int(args["peer"]), int(args["bytes"]), float(e["dur"]) / 1e6))
    return out


def observe_run(name: str, summary: dict, ranks: Sequence[RankEvents]) -> RunObservation:
    """A run's observation from its summary.json (parsed) and its ranks' traces; UserError if they disagree."""
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
    steps = steady_steps(ranks, warmup)
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
                                       _median([m[0] for m in med if m[0] is not None]),
                                       _median([m[1] for m in med if m[1] is not None]),
                                       _median([m[2] for m in med if m[2] is not None]) if entry[2] > 1 else None,
                                       algos))
    transfers = [t for r in ranks for t in rank_transfers(r.rank, r.events, steps)]
    return RunObservation(name, tuple(stages), tuple(transfers), schedule, micro,
                          float(measured) if isinstance(measured, (int, float)) else None,
                          float(predicted) if isinstance(predicted, (int, float)) else None)
