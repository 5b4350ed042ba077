"""Spawn N real processes joined by gloo on 127.0.0.1, bounded by a timeout, always reaped.

``spawn(fn, world, *args, timeout=...)`` runs ``fn(rank, world, *args)`` in every process and
returns the list of their return values (picklable), or raises AssertionError quoting every
rank that failed, died or hung. ``fn`` must be a module-level function (spawn pickles it).
"""

from __future__ import annotations

import datetime
import os
import queue
import time
import traceback
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def _child(rank: int, world: int, port: int, fn: Callable, args: tuple, results, env: dict) -> None:
    os.environ.update(env)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=60))
        value = fn(rank, world, *args)
        results.put((rank, True, value))
    except BaseException:           # noqa: BLE001 - the parent reports it
        results.put((rank, False, traceback.format_exc()))
    results.close()
    results.join_thread()
    os._exit(0)                     # no teardown: a failed peer may leave threads blocked


def spawn(fn: Callable, world: int, *args: Any, timeout: float = 60.0, env: dict | None = None) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo processes; their return values by rank."""
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=60))
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=_child, args=(r, world, store.port, fn, args, results, dict(env or {})),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(got) < world and time.monotonic() < deadline:
            try:
                rank, ok, value = results.get(timeout=0.2)
                got[rank] = (ok, value)
            except queue.Empty:
                if all(not p.is_alive() for r, p in enumerate(procs) if r not in got) and len(got) < world:
                    time.sleep(0.5)                # a report may still be in the pipe
                    while not results.empty():
                        rank, ok, value = results.get()
                        got[rank] = (ok, value)
                    break
    finally:
        for p in procs:
            p.join(timeout=2.0)
            if p.is_alive():
                p.kill()
                p.join(5)
        results.close()
    problems = []
    for r in range(world):
        if r not in got:
            problems.append(f"rank {r}: {'hung (killed after timeout)' if time.monotonic() >= deadline else 'died'}"
                            f", exit code {procs[r].exitcode}")
        elif not got[r][0]:
            problems.append(f"rank {r} raised:\n{got[r][1]}")
    assert not problems, "\n".join(problems)
    return [got[r][1] for r in range(world)]
