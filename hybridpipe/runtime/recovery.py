"""In-place recovery of a lost replica (``launch --in-place``): the survivors agree through the
c10d store and go on in the same processes (runtime/inplace.py says when and how).

    recovery = Recovery(store, namespace=guard.namespace, rank=rank, world_size=world, grace_s=1.0, wait_s=30)
    guard.recovery = recovery           # the watchdog asks for a recovery instead of stopping the job
    ...
    except Exception as e:              # a peer failure in a training step
        event = recover_in_place(trainer, recovery, guard, phase="step", error=e)   # or it exits

How it goes, generation by generation (store keys under ``NAMESPACE/inplace/<gen>/``):

1. *Request*: the first rank to see a failure (its main thread's collective or p2p failed, or its
   watchdog found a local peer's process gone or the next rank's heartbeat silent) publishes
   ``req`` (compare-and-set: the first wins) and every rank's watchdog sees it within an interval.
   Whoever sees it cuts its process's connections to its peers (connections.py): every wait on
   them ends at once, here and on the other side, so no rank stays blocked in an operation with
   the dead one (a host that vanished without closing its connections included) and every main
   thread reaches its recovery. Each rank checks in (``alive/<rank>``).
2. *Reports*: each main thread publishes ``report/<rank>``: its completed steps and whether it
   was inside a training step.
3. *Decision*: once every rank reported or is counted lost -- its process gone on this host, or
   not checked in ``grace_s`` after the request -- the first rank to get there publishes the
   decision (compare-and-set: everyone adopts the same one): in place, or restart. A rank that
   checked in but sent no report within ``wait_s`` makes it a restart.
4. *Re-forming* (in place): every survivor leaves the old world's process groups behind (never
   destroyed while a thread might still wait in one: their destructors would wait for it),
   initialises a new default group of the survivors on a fresh store prefix, its failure guard
   starts over in a new namespace, and the trainer builds its groups, gradient syncs, channels
   and engine anew for the shrunk plan (its model, optimizer and their state are kept); the
   failed step's gradients are dropped and the step is redone.

A restart decision ends every survivor with exit 75 naming a lost rank (torchrun's restart path,
runtime/restarts.py); a rank that the others counted lost exits 75 as well. The store must
outlive the lost ranks (torchrun's: hosted by rank 0's worker, or its agent).
"""

from __future__ import annotations

import datetime
import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from hybridpipe.runtime.config import RunConfig
from hybridpipe.runtime.connections import cut_connections, store_port
from hybridpipe.runtime.failure import EXIT_PEER_LOST, FailureGuard, default_store, describe_ranks, suspect_of
from hybridpipe.runtime.groups import Process
from hybridpipe.runtime.inplace import IN_PLACE, STEP, Decision, decide, shrink_plan
from hybridpipe.runtime.summary import RankReport
from hybridpipe.runtime.training_config import flushes

log = logging.getLogger(__name__)
POLL_S = 0.02


class Recovery:
    """One rank's side of the agreement (see the module docstring); :meth:`request` and
    :meth:`poll` run on any thread (the failure watchdog's), :meth:`agree` on the main thread."""

    def __init__(self, store: dist.Store, *, namespace: str, rank: int, world_size: int, grace_s: float,
                 wait_s: float) -> None:
        self.base, self.namespace = store, namespace
        self.rank, self.world_size = rank, world_size
        self.grace_s, self.wait_s = grace_s, wait_s
        self.gen = 0
        self.keep_port = store_port(store)
        self.graveyard: list[Any] = []        # the old worlds' groups: kept alive (see the module docstring)
        self._lock = threading.Lock()
        self._stores = (store, store.clone() if hasattr(store, "clone") else store)   # main, other threads
        self._seen: float | None = None       # when this rank first saw this generation's request (monotonic)

    def _store(self, main: bool) -> dist.Store:
        return dist.PrefixStore(f"{self.namespace}/inplace/{self.gen}", self._stores[0 if main else 1])

    def request(self, reason: str, suspect: int | None, *, main: bool = False) -> None:
        """Ask for a recovery (the first request of a generation wins), cut this process's
        connections and check in."""
        record = json.dumps({"time": time.time(), "reporter": self.rank, "suspect": suspect, "reason": reason})
        with self._lock:
            store = self._store(main)
            store.compare_set("req", "", record)
            self._join(store)

    def poll(self) -> None:
        """The watchdog's check: once a recovery was requested, cut and check in (once)."""
        with self._lock:
            if self._seen is None:
                store = self._store(False)
                if store.check(["req"]):
                    self._join(store)

    def _join(self, store: dist.Store) -> None:
        if self._seen is None:
            self._seen = time.monotonic()
            cut_connections(self.keep_port)
            store.set(f"alive/{self.rank}", "1")

    def requested(self) -> dict:
        """This generation's request (time, reporter, suspect, reason)."""
        return json.loads(self._store(True).get("req"))

    def agree(self, report: dict, gone_here: Callable[[], set[int]],
              decide: Callable[[dict[int, dict], set[int], set[int]], Decision]) -> Decision:
        """Publish this rank's ``report``, wait for the others' (see the module docstring) and
        return the decision everyone adopts; ``decide(reports, lost, unreported)`` makes this
        rank's proposal; ``gone_here()``: ranks whose process is gone on this host."""
        store = self._store(True)
        store.set(f"report/{self.rank}", json.dumps(report))
        seen = self._seen if self._seen is not None else time.monotonic()
        everyone = set(range(self.world_size))
        while True:
            if store.check(["decision"]):
                return Decision.from_json(store.get("decision"))
            reported = {r for r in everyone if store.check([f"report/{r}"])}
            waiting = everyone - reported - gone_here()
            alive = {r for r in waiting if store.check([f"alive/{r}"])}
            late = time.monotonic() - seen
            if not waiting or (late > self.grace_s and not alive) or late > self.wait_s:
                reports = {r: json.loads(store.get(f"report/{r}")) for r in reported}
                mine = decide(reports, everyone - reported - alive, alive)
                return Decision.from_json(store.compare_set("decision", "", mine.to_json()))
            time.sleep(POLL_S)

    def advance(self, rank: int, world_size: int) -> None:
        """The next generation, as ``rank`` of ``world_size`` (after an in-place recovery)."""
        with self._lock:
            self.gen += 1
            self.rank, self.world_size, self._seen = rank, world_size, None


def reform_world(recovery: Recovery, rank: int, world_size: int, backend: str, timeout_s: float) -> None:
    """Leave the old default group and its groups behind (kept alive in ``recovery.graveyard``)
    and join a new default group of ``world_size`` as ``rank`` (collective among the survivors)."""
    recovery.graveyard.extend(c10d._world.pg_map)
    dist.destroy_process_group()
    store = dist.PrefixStore(f"{recovery.namespace}/world/{recovery.gen}", recovery.base)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def recover_in_place(trainer: Any, recovery: Recovery, guard: FailureGuard, *, phase: str, error: BaseException,
                     decide: Callable[[dict[int, dict], set[int], set[int]], Decision], backend: str,
                     timeout_s: float) -> dict:
    """Agree with the other survivors after ``error`` and either re-form in place (returns the
    event: who was lost, the world before and after, the steps done, when the failure was
    detected, how long agreeing and re-forming took) or leave (exit 75; never returns)."""
    t0 = time.time()
    recovery.request(f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:300], None,
                     main=True)
    detected = float(recovery.requested()["time"])
    stats = any(getattr(st, "stats", None) is not None for st in trainer.stages)    # replicas' batch norm
    decision = recovery.agree({"steps": trainer.step, "phase": phase, "stats": stats}, guard.gone_here, decide)
    before = recovery.world_size
    if decision.kind != IN_PLACE:
        lost = decision.lost[0] if decision.lost else recovery.rank
        guard.lost(lost, f"lost; no in-place recovery: {decision.reason}")
    rank = decision.new_rank(recovery.rank)
    if rank is None:
        guard.leave(EXIT_PEER_LOST, "the other ranks counted this rank lost and went on without it")
    agreed = time.time()
    plan = shrink_plan(trainer.plan, decision.survivors)
    recovery.advance(rank, len(decision.survivors))
    reform_world(recovery, rank, len(decision.survivors), backend, timeout_s)
    guard.reform(rank, len(decision.survivors), describe_ranks(plan), f"{recovery.namespace}/{recovery.gen}")
    trainer.reform(plan)
    log.info("rank %d: in place as rank %d of %d after losing %s", decision.survivors[rank], rank,
             len(decision.survivors), list(decision.lost))
    return {"kind": IN_PLACE, "lost_ranks": list(decision.lost), "world_size_before": before,
            "world_size_after": len(decision.survivors), "failure_detected_at": round(detected, 3),
            "steps_done": decision.steps, "agree_s": round(agreed - max(t0, detected), 3),
            "reform_s": round(time.time() - agreed, 3), "detected_to_reformed_s": round(time.time() - detected, 3)}


def recoverer(cfg: RunConfig, proc: Process, trainer: Any, guard: FailureGuard) -> Callable[..., dict]:
    """``recover(error, phase)``: the in-place recovery of this rank after ``error`` (runtime/recovery.py)."""
    recovery = Recovery(default_store(), namespace=guard.namespace, rank=proc.rank, world_size=proc.world_size,
                        grace_s=min(guard.timeout, max(1.0, 3 * guard.interval)), wait_s=guard.timeout)
    guard.recovery = recovery

    def decide_here(reports: dict, lost: set, unreported: set) -> Decision:
        return decide(trainer.plan, recovery.world_size, reports, lost, flushing=flushes(trainer.plan),
                      unreported=unreported)

    def recover(error: BaseException, phase: str) -> dict:
        return recover_in_place(trainer, recovery, guard, phase=phase, error=error, decide=decide_here,
                                backend=proc.backend, timeout_s=cfg.training.timeout)
    return recover


def train_step_recovering(trainer: Any, drain: bool, recover: Callable[..., dict] | None) -> dict | None:
    """One training step; with ``recover`` (--in-place), a peer's failure re-forms the job in place
    and the step is redone (or, when every survivor had applied it, counted done). Returns the
    recovery's event (with ``before_s``: seconds of the step before the recovery finished), if any."""
    step, t0, event = trainer.step, time.perf_counter(), None
    while True:
        try:
            trainer.train_step(drain=drain)
            return event
        except Exception as e:
            if recover is None or suspect_of(e)[1] == "own":
                raise
            event = {**recover(e, STEP), "step": step, "before_s": time.perf_counter() - t0}
            if trainer.step > step:
                event["steps_redone"] = 0
                return event
            event["steps_redone"] = 1
            t0 = time.perf_counter()


def renamed_report(report: RankReport, trainer: Any) -> RankReport:
    """This rank's report under its rank, stage and replica in the re-formed world."""
    stages = trainer.stage_plans
    return replace(report, rank=trainer.proc.rank, stage=stages[0].index, replica=trainer.replica,
                   more_stages=tuple(s.index for s in stages[1:]))
