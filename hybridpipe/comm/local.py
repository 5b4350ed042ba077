"""Run a function on N local processes joined by gloo on 127.0.0.1 (bench-allreduce, benchmarks,
tests), bounded by a timeout; processes are always reaped.

The parent hosts the TCP store on a free port (port 0: no races) and collects what each rank
returns, or the traceback of what it raised. A rank that neither reports nor exits by the
deadline is killed and reported as hung.
"""

from __future__ import annotations

import datetime
import os
import queue
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass(frozen=True)
class RankOutcome:
    rank: int
    ok: bool
    value: Any = None          # what fn returned (ok) or the traceback text (not ok)
    status: str = "ok"         # ok, raised, died, hung


def _child(rank: int, world: int, port: int, fn: Callable, args: tuple, results, env: dict,
           threads: int, pg_timeout_s: float) -> None:
    os.environ.update(env)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    torch.set_num_threads(threads)
    try:
        timeout = datetime.timedelta(seconds=pg_timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
        value = fn(rank, world, *args)
        results.put((rank, True, value))
    except BaseException:           # noqa: BLE001 - the parent reports it
        results.put((rank, False, traceback.format_exc()))
    results.close()
    results.join_thread()
    os._exit(0)                     # skip teardown: a failed peer may leave threads blocked


def run_local(fn: Callable, world: int, *args: Any, timeout_s: float = 600.0, env: dict | None = None,
              threads: int = 1, pg_timeout_s: float = 120.0) -> list[RankOutcome]:
    """Run ``fn(rank, world, *args)`` on ``world`` spawned processes; one outcome per rank.

    ``fn`` must be importable (a module-level function); its return value must pickle.
    """
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=pg_timeout_s))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, world, store.port, fn, args, results, dict(env or {}), threads,
                                              pg_timeout_s), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout_s
    quiet_since: float | None = None
    try:
        while len(got) < world and time.monotonic() < deadline:
            try:
                rank, ok, value = results.get(timeout=0.2)
                got[rank] = (ok, value)
            except queue.Empty:
                if all(r in got or not p.is_alive() for r, p in enumerate(procs)):
                    quiet_since = quiet_since or time.monotonic()
                    if time.monotonic() - quiet_since > 1.0:      # reports still in the pipe had time
                        break
    finally:
        for p in procs:
            p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join(5)
        results.close()
    out = []
    for r in range(world):
        if r in got:
            ok, value = got[r]
            out.append(RankOutcome(r, ok, value, "ok" if ok else "raised"))
        else:
            hung = time.monotonic() >= deadline
            out.append(RankOutcome(r, False, f"exit code {procs[r].exitcode}", "hung" if hung else "died"))
    return out


def describe_failures(outcomes: list[RankOutcome]) -> str:
    """'' when every rank succeeded, else one paragraph per failed rank."""
    return "\n".join(f"rank {o.rank} {o.status}: {o.value}" for o in outcomes if not o.ok)
