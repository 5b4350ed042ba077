"""Per-rank timeline: the pipeline engine's phases written as a Chrome trace (seed 003, table 2).

How the worker uses it (one recorder per rank, created after ``init_process_group``)::

    rec = TimelineRecorder(trace_dir(run_dir), rank=rank, stage=stage.index, replica=replica,
                           world_size=world, keep_steps=200, flush_every=50)
    rec.align(torch.distributed.barrier)       # same time origin on every rank (collective)
    channels = Channels(..., on_transfer=rec.on_transfer)   # optional: wire time of each message
    for step in range(start, steps):
        rec.begin_step(step)
        engine.run_step(..., recorder=rec)     # engine calls rec.record(phase, micro_batch, t0, t1)
        rec.end_step()                         # writes the file every ``flush_every`` steps
    rec.close()                                # final write (also call it on the failure path)

``t0``/``t1`` handed to :meth:`TimelineRecorder.record` (and to ``on_transfer``) are
``rec.clock()`` readings: ``time.perf_counter`` unless another clock is given (the p2p
Channels use the same default). ``phase`` must be one of :data:`PHASES`.

Memory stays bounded on week-long runs: only the newest ``keep_steps`` steps are held (and
written); older ones are dropped and counted in the file's metadata. The file
``TRACE_DIR/rank-00003.json`` is rewritten atomically (temp file + rename), so a reader never
sees a torn file and a crash keeps the last flushed window.

File format: Chrome trace JSON object (opens in Perfetto / chrome://tracing). Process id = rank;
thread 0 holds the phases, thread 1 the p2p transfers, thread 2 one event per step. Metadata
(rank, stage, replica, clock alignment, kept/dropped steps) lives under
``otherData.hybridpipe``. ``hybridpipe timeline RUN_DIR`` merges the ranks (timeline_merge.py).
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hybridpipe.errors import UserError
from hybridpipe.jsonfile import field as json_field
from hybridpipe.jsonfile import read_json, write_text

PHASES = ("receive_for", "run_for", "send_for", "receive_back", "run_back", "sync", "send_back", "step")
TRACE_KIND = "rank-trace"
TRACE_FORMAT = 1
TRACE_SUBDIR = "trace"
TID_PHASES, TID_TRANSFERS, TID_STEPS, TID_SYNCS = 0, 1, 2, 3
_THREAD_NAMES = {TID_PHASES: "phases", TID_TRANSFERS: "p2p transfers", TID_STEPS: "steps", TID_SYNCS: "all-reduces"}


def trace_dir(run_dir: str | os.PathLike) -> Path:
    """Where a run's per-rank traces live: ``RUN_DIR/trace``."""
    return Path(run_dir) / TRACE_SUBDIR


def trace_path(directory: str | os.PathLike, rank: int) -> Path:
    """The trace file of ``rank`` in a trace directory."""
    return Path(directory) / f"rank-{rank:05d}.json"


@dataclass
class _Step:
    step: int | None                      # None: events recorded before the first begin_step
    t_begin: float | None = None
    t_end: float | None = None
    phases: list[tuple[str, int, float, float, int | None]] = field(default_factory=list)
    transfers: list[tuple[int, str, int, float, float]] = field(default_factory=list)
    syncs: list[tuple[str, str, int, float, float]] = field(default_factory=list)
    cache: tuple[float, str] | None = None    # (time origin, events as JSON) once serialised


class TimelineRecorder:
    """Records phases and transfers of one rank; see the module docstring for the protocol.

    Thread-safe: ``record`` runs on the compute thread, ``on_transfer`` on p2p threads. Each
    step is turned into JSON once, when it ends (about 5 us per event), so rewriting the file
    is a plain write of the kept steps' text, not a re-encoding of all of them.
    """

    def __init__(self, directory: str | os.PathLike, *, rank: int, stage: int, replica: int = 0,
                 world_size: int = 1, keep_steps: int = 200, flush_every: int = 50,
                 clock: Callable[[], float] = time.perf_counter, label: str = "",
                 stages: Iterable[int] = ()) -> None:
        if keep_steps < 1:
            raise ValueError(f"keep_steps must be >= 1, got {keep_steps}")
        self.path = trace_path(directory, rank)
        self.rank, self.stage, self.replica, self.world_size = rank, stage, replica, world_size
        self.stages = list(stages) or [stage]        # a rank's model chunks (virtual stages), in model order
        self.keep_steps, self.flush_every, self.clock, self.label = keep_steps, flush_every, clock, label
        self._lock = threading.Lock()
        self._setup = _Step(None)
        self._steps: deque[_Step] = deque(maxlen=keep_steps)
        self._current = self._setup
        self._dropped = 0
        self._since_flush = 0
        self._anchor, self._anchor_wall, self._aligned_by = clock(), time.time(), "wall clock"

    # ---- clock --------------------------------------------------------------------------
    def align(self, barrier: Callable[[], None]) -> None:
        """Set the time origin to the end of a collective barrier (call on every rank at once).

        Two barriers: the first absorbs stragglers (process start-up), ranks leave the second
        within about one network latency of each other, which becomes every trace's time 0.
        """
        barrier()
        barrier()
        with self._lock:
            self._anchor, self._anchor_wall, self._aligned_by = self.clock(), time.time(), "barrier"

    # ---- recording ----------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Start collecting the events of training step ``step``."""
        with self._lock:
            if len(self._steps) == self._steps.maxlen:
                self._dropped += 1
            self._current = _Step(step, t_begin=self.clock())
            self._steps.append(self._current)

    def end_step(self) -> None:
        """Close the current step; rewrite the file every ``flush_every`` steps."""
        with self._lock:
            self._current.t_end = self.clock()
            self._fragment(self._current)
            self._since_flush += 1
            due = self.flush_every > 0 and self._since_flush >= self.flush_every
        if due:
            self.flush()

    def record(self, phase: str, micro_batch: int, t0: float, t1: float, stage: int | None = None) -> None:
        """One phase of one micro-batch (the pipeline engine's recorder interface); ``stage``: the
        model chunk it ran on (a rank with virtual stages holds several; None: about the rank)."""
        if phase not in PHASES:
            raise ValueError(f"unknown timeline phase {phase!r}; phases are {', '.join(PHASES)}")
        with self._lock:
            self._current.phases.append((phase, int(micro_batch), t0, t1, stage))
            self._current.cache = None

    def on_transfer(self, peer: int, key: str, nbytes: int, t0: float, t1: float) -> None:
        """One completed p2p message (the Channels ``on_transfer`` hook)."""
        with self._lock:
            self._current.transfers.append((peer, key, nbytes, t0, t1))
            self._current.cache = None

    def on_sync(self, layer: str, algorithm: str, nbytes: int, t0: float, t1: float) -> None:
        """One replicated layer's (sync unit's) gradient all-reduce, run on its lane's thread
        (HybridDataParallel's ``on_reduce`` hook): its own time, where the ``sync`` phase is the wait."""
        with self._lock:
            self._current.syncs.append((layer, algorithm, nbytes, t0, t1))
            self._current.cache = None

    # ---- output -------------------------------------------------------------------------
    def events(self) -> list[dict]:
        """The Chrome trace events held now (metadata events first), times in microseconds."""
        return json.loads(f"[{self._events_json()}]")

    def describe(self) -> str:
        text = f"rank {self.rank}: stage {','.join(map(str, self.stages))} replica {self.replica}"
        return f"{text} ({self.label})" if self.label else text

    def metadata(self) -> dict:
        with self._lock:
            kept = [s.step for s in self._steps if s.step is not None]
            return {"kind": TRACE_KIND, "format": TRACE_FORMAT, "rank": self.rank, "stage": self.stage,
                    "stages": self.stages,
                    "replica": self.replica, "world_size": self.world_size, "clock": self._aligned_by,
                    "anchor_wall_s": self._anchor_wall, "keep_steps": self.keep_steps,
                    "steps_dropped": self._dropped, "first_step": min(kept, default=None),
                    "last_step": max(kept, default=None), "phases": list(PHASES), "label": self.label}

    def flush(self) -> Path:
        """Rewrite this rank's trace file atomically with the steps held now."""
        events = self._events_json()
        other = json.dumps({"hybridpipe": self.metadata()}, separators=(",", ":"))
        with self._lock:
            self._since_flush = 0
        return write_text(self.path, f'{{"traceEvents":[{events}],"displayTimeUnit":"ms","otherData":{other}}}')

    def close(self) -> Path:
        """Final flush; the recorder may still be used afterwards (it just writes again)."""
        return self.flush()

    # ---- serialisation ------------------------------------------------------------------
    def _events_json(self) -> str:
        pid = self.rank
        meta = [_meta("process_name", pid, name=self.describe()), _meta("process_sort_index", pid, sort_index=pid)]
        meta += [_meta("thread_name", pid, tid, name=n) for tid, n in _THREAD_NAMES.items()]
        with self._lock:
            parts = [self._fragment(s) for s in (self._setup, *self._steps)]
        return ",".join([json.dumps(meta, separators=(",", ":"))[1:-1], *(p for p in parts if p)])

    def _fragment(self, s: _Step) -> str:
        """``s``'s events as JSON (without brackets), cached per time origin; call under the lock."""
        if s.cache is not None and s.cache[0] == self._anchor:
            return s.cache[1]
        pid, anchor = self.rank, self._anchor

        def us(t: float) -> float:
            return round((t - anchor) * 1e6, 3)

        out = [{"ph": "X", "name": ph, "cat": "phase", "pid": pid, "tid": TID_PHASES, "ts": us(t0),
                "dur": round(max(t1 - t0, 0.0) * 1e6, 3),
                "args": {"step": s.step, "micro_batch": mb, **({} if st is None else {"stage": st})}}
               for ph, mb, t0, t1, st in s.phases]
        out += [{"ph": "X", "name": key, "cat": "transfer", "pid": pid, "tid": TID_TRANSFERS, "ts": us(t0),
                 "dur": round(max(t1 - t0, 0.0) * 1e6, 3), "args": {"step": s.step, "peer": peer, "bytes": n}}
                for peer, key, n, t0, t1 in s.transfers]
        out += [{"ph": "X", "name": layer, "cat": "all-reduce", "pid": pid, "tid": TID_SYNCS, "ts": us(t0),
                 "dur": round(max(t1 - t0, 0.0) * 1e6, 3), "args": {"step": s.step, "algorithm": alg, "bytes": n}}
                for layer, alg, n, t0, t1 in s.syncs]
        if s.step is not None and s.t_begin is not None and s.t_end is not None:
            out.append({"ph": "X", "name": f"step {s.step}", "cat": "step", "pid": pid, "tid": TID_STEPS,
                        "ts": us(s.t_begin), "dur": round((s.t_end - s.t_begin) * 1e6, 3), "args": {"step": s.step}})
        text = json.dumps(out, separators=(",", ":"))[1:-1]
        s.cache = (anchor, text)
        return text


def trace_all_reduces(recorder: Any, syncs: Iterable[Any]) -> None:
    """Each gradient all-reduce of ``syncs`` (HybridDataParallel's ``on_reduce``) reported to the
    recorder's ``on_sync``; nothing for a recorder without one (a stand-in) or a sync without the hook."""
    on_sync = getattr(recorder, "on_sync", None)
    for sync in syncs if on_sync is not None else ():
        if hasattr(sync, "on_reduce"):
            sync.on_reduce = on_sync


def _meta(kind: str, pid: int, tid: int = 0, **args) -> dict:
    return {"ph": "M", "name": kind, "pid": pid, "tid": tid, "args": args}


@dataclass(frozen=True)
class RankTrace:
    """One rank's trace file as read back: its metadata and its events."""

    path: Path
    meta: dict
    events: list[dict]

    @property
    def rank(self) -> int:
        return int(self.meta["rank"])


def load_rank_trace(path: str | os.PathLike) -> RankTrace:
    """Read a file written by :class:`TimelineRecorder`; a foreign or broken file is a UserError."""
    p = Path(path)
    data = read_json(p, "trace")
    other = data.get("otherData") if isinstance(data, dict) else None
    meta = other.get("hybridpipe") if isinstance(other, dict) else None
    if not isinstance(meta, dict) or meta.get("kind") != TRACE_KIND:
        raise UserError(f"{p} is not a hybridpipe rank trace (no otherData.hybridpipe of kind {TRACE_KIND!r})")
    if meta.get("format") != TRACE_FORMAT:
        raise UserError(f"{p}: trace format {meta.get('format')!r} is not supported (this hybridpipe "
                        f"reads format {TRACE_FORMAT})")
    where = f"{p}: otherData.hybridpipe"
    json_field(meta, "rank", int, where, minimum=0)
    json_field(meta, "stage", int, where, minimum=0)
    json_field(meta, "stages", list, where, default=[], items=int)
    json_field(meta, "replica", int, where, minimum=0)
    json_field(meta, "world_size", int, where, minimum=1, default=1)
    json_field(meta, "anchor_wall_s", float, where)
    json_field(meta, "clock", str, where, default="")
    events = data.get("traceEvents")
    if not isinstance(events, list):
        raise UserError(f"{p}: \"traceEvents\" must be a list")
    for i, e in enumerate(events):
        _check_event(e, f"{p}: event {i}")
    return RankTrace(p, meta, events)


def _check_event(e: object, where: str) -> None:
    """The fields the merge and the table read: every event an object; a complete ("X") event
    with a pid, tid, name, finite ts and dur >= 0, and args whose step is an integer or null."""
    if not isinstance(e, dict):
        raise UserError(f"{where}: expected an object")
    json_field(e, "pid", int, where, default=0)
    if e.get("ph") != "X":
        return
    for key in ("pid", "tid"):
        json_field(e, key, int, where)
    json_field(e, "name", str, where)
    json_field(e, "ts", float, where)
    json_field(e, "dur", float, where, minimum=0)
    args = e.setdefault("args", {})
    json_field(e, "args", dict, where)
    if args.get("step") is not None:
        json_field(args, "step", int, f"{where}: args")


def find_rank_traces(run_dir: str | os.PathLike) -> list[Path]:
    """The rank trace files of a run: ``RUN_DIR/trace/rank-*.json`` (or RUN_DIR itself holding them)."""
    base = Path(run_dir)
    if not base.is_dir():
        raise UserError(f"run directory {base} does not exist; pass the directory the run wrote "
                        f"(it holds {TRACE_SUBDIR}/rank-*.json)")
    for d in (trace_dir(base), base):
        found = sorted(d.glob("rank-*.json"))
        if found:
            return found
    raise UserError(f"no rank traces in {base} or {trace_dir(base)}: the run wrote none (was the "
                    "timeline enabled, and did any step finish?)")


def phases_of(events: Iterable[dict]) -> set[str]:
    """The phase names present among ``events``."""
    return {e["name"] for e in events if e.get("cat") == "phase"}
