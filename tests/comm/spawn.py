"""Spawn N real gloo processes for a test, bounded by a timeout, always reaped.

``spawn(fn, world, *args, timeout=...)`` runs ``fn(rank, world, *args)`` in every process and
returns their return values by rank, or fails the test quoting every rank that raised, died or
hung. ``fn`` must be a module-level function (spawn pickles it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridpipe.comm.local import describe_failures, run_local


def spawn(fn: Callable, world: int, *args: Any, timeout: float = 60.0, env: dict | None = None) -> list[Any]:
    outcomes = run_local(fn, world, *args, timeout_s=timeout, env=env)
    problems = describe_failures(outcomes)
    assert not problems, problems
    return [o.value for o in outcomes]
