"""The CPU allocator as a reference for memory tests: torch's profiler reports every allocation
with the allocator's running total. And a fresh process to measure in, since what earlier tests
leave in the pytest process (threads, caches) can allocate inside a measuring window."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

from tests import forked

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


def in_fresh_process(module: str, function: str, *args: Any, timeout: float = 600) -> Any:
    """``module.function(*args)`` run in a new process forked from the session's warm server
    (tests/forked.py: it has run no test, so nothing earlier tests left allocates in its windows, and it
    skips a new interpreter's 3-4 s of imports), the checkout on its path; its JSON result."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err, result = (str(Path(tmp) / name) for name in ("out", "err", "result.json"))
        proc = forked.start(_call, (module, function, args, result), env=dict(os.environ, PYTHONPATH=str(ROOT),
                            HF_HUB_OFFLINE="1"), argv=[sys.executable], cwd=str(ROOT), stdout=out, stderr=err)
        try:
            code = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        assert code == 0, Path(err).read_text()[-2000:]
        return json.loads(Path(result).read_text())


def _call(module: str, function: str, args: tuple, result: str) -> None:
    """In the forked process: ``module.function(*args)``'s value written to ``result`` as JSON."""
    value = getattr(importlib.import_module(module), function)(*args)
    Path(result).write_text(json.dumps(value))
