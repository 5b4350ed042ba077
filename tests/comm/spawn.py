"""Run N real gloo processes for a test, bounded by a timeout, always reaped.

``spawn(fn, world, *args, timeout=...)`` runs ``fn(rank, world, *args)`` in every process (forked
from the session's warm fork server: tests/comm/p2p/procs.py) and returns their return values by
rank, or fails the test quoting every rank that raised, died or hung. ``fn`` must be a
module-level function (it is pickled). (hybridpipe.comm.local.run_local, which spawns new
interpreters, is tested through bench-allreduce: test_bench_allreduce_cli.py.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.comm.p2p.procs import expect_ok, run_ranks


def spawn(fn: Callable, world: int, *args: Any, timeout: float = 60.0) -> list[Any]:
    values = expect_ok(run_ranks(fn, world, args=args, timeout=timeout, pg_timeout_s=120.0))
    return [values[r] for r in range(world)]
