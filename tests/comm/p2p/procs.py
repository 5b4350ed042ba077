"""Run a function on N real processes joined by gloo on 127.0.0.1, bounded by a timeout.

The parent hosts the TCP store on a free port (port 0, so no races), forks the ranks from
the session's warm fork server (tests/forked.py: torch and hybridpipe already imported),
collects what each returns (plain picklable data) or raises, and always reaps them: ranks
still running after the deadline, or after every other rank reported, are killed.
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

from tests import forked


@dataclass
class Outcome:
    rank: int
    status: str                 # "ok", "error" (raised), "exit" (died without reporting), "hung"
    value: Any = None           # what the function returned
    error: str = ""             # exception class name
    message: str = ""           # str(exception) or traceback
    exitcode: int | None = None

    def __repr__(self) -> str:
        extra = f" value={self.value!r}" if self.status == "ok" else f" {self.error}: {self.message[-2000:]}"
        return f"<rank {self.rank} {self.status} exit={self.exitcode}{extra}>"


def _child(rank: int, world: int, port: int, fn: Callable, args: tuple, results, pg_timeout_s: float) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                              timeout=datetime.timedelta(seconds=pg_timeout_s))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        value = fn(rank, world, *args)
        results.put((rank, "ok", value, "", ""))
    except BaseException as e:      # noqa: BLE001 - report everything to the parent
        results.put((rank, "error", None, type(e).__name__, f"{e}\n{traceback.format_exc()}"))
    results.close()
    results.join_thread()   # the report must leave before the hard exit below
    # Skip interpreter teardown: a rank whose peer was killed on purpose may hold threads
    # blocked on dead connections, and the parent only needs the report.
    os._exit(0)


def run_ranks(fn: Callable, world: int, *, args: tuple = (), timeout: float = 60.0,
              pg_timeout_s: float = 60.0, grace: float = 3.0,
              wait_for: set[int] | None = None) -> dict[int, Outcome]:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return each rank's outcome.

    Once every rank in ``wait_for`` (default: all) reported or died, ranks that did not report
    are killed (reported as "hung"); those that reported get ``grace`` seconds to exit.
    """
    wait_for = set(range(world)) if wait_for is None else set(wait_for)
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=pg_timeout_s))
    ctx = forked.context()
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, world, store.port, fn, args, results, pg_timeout_s),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out: dict[int, Outcome] = {}
    deadline = time.monotonic() + timeout
    settle: float | None = None     # once the awaited ranks reported or died, drain briefly
    try:
        while len(out) < world and time.monotonic() < deadline:
            try:
                rank, status, value, err, msg = results.get(timeout=0.1)
                out[rank] = Outcome(rank, status, value, err, msg)
            except queue.Empty:
                pass
            if all(r in out or not procs[r].is_alive() for r in wait_for):
                settle = settle or time.monotonic() + 0.5
                if time.monotonic() > settle:
                    break
    finally:
        end = time.monotonic() + grace
        for r, p in enumerate(procs):
            if r in out:            # reported: it exits right away
                p.join(timeout=max(0.0, end - time.monotonic()))
        killed = set()
        for r, p in enumerate(procs):
            if p.is_alive():
                killed.add(r)
                p.kill()
                p.join(5)
        results.close()
    for r, p in enumerate(procs):
        o = out.setdefault(r, Outcome(r, "hung" if r in killed else "exit"))
        o.exitcode = p.exitcode
    return out


def expect_ok(outcomes: dict[int, Outcome]) -> dict[int, Any]:
    """Assert every rank returned normally; return their values."""
    bad = [o for o in outcomes.values() if o.status != "ok"]
    assert not bad, "ranks failed:\n" + "\n".join(map(repr, bad))
    return {r: o.value for r, o in outcomes.items()}
