"""The CPU allocator as a reference for memory tests: torch's profiler reports every allocation
with the allocator's running total. And a fresh interpreter to measure in, since what earlier tests
leave in the pytest process (threads, caches) can allocate inside a measuring window."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parents[1]


def allocation_totals(fn: Callable[[], None]) -> list[tuple[int, int]]:
    """Run ``fn`` under torch's profiler: (time ns, bytes allocated in all) at every allocation, in order."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events: list[tuple[int, int]] = []

    def walk(e) -> None:
        if e.tag == _EventType.Allocation:
            events.append((e.start_time_ns, e.extra_fields.total_allocated))
        for c in e.children:
            walk(c)
    for root in prof.profiler.kineto_results.experimental_event_tree():
        walk(root)
    return sorted(events)


def total_at(events: list[tuple[int, int]], t: int) -> int:
    """The allocator's total at time ``t`` (ns) in ``allocation_totals``' events (0 before any)."""
    return next((total for when, total in reversed(events) if when <= t), 0)


def allocator_peak(fn: Callable[[], None]) -> int:
    """The CPU allocator's most bytes above its total when ``fn`` starts."""
    start: list[int] = []

    def run() -> None:
        start.append(time.time_ns())
        fn()
    events = allocation_totals(run)
    return max(total for _, total in events) - total_at(events, start[0])


def in_fresh_interpreter(module: str, function: str, *args: Any, timeout: float = 600) -> Any:
    """``module.function(*args)`` run in a new Python (the checkout on its path); its JSON result."""
    code = f"import json; from {module} import {function} as f; print(json.dumps(f(*{args!r})))"
    env = dict(os.environ, PYTHONPATH=str(ROOT), HF_HUB_OFFLINE="1")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
