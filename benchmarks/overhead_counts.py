"""Load-independent counts for ``overhead.py``: Python calls and aten ops per kind of instruction.

The measured steps alternate between the two counters, so neither counts the other's work (the
mode's own Python around every op): on even ones, a ``sys.setprofile`` hook on the step's thread
counts every Python function call (``call``) and every call into a C function (``c_call``)
into the kind whose probe the thread is in (``Tally.current``: forward, backward, send, recv,
data, step, or ``dispatch`` outside every probe); the same hook, installed with
``threading.setprofile`` before the system starts its threads, counts the calls of every
Python thread started afterwards (our per-peer receive / send threads) as ``background``
(gloo's own threads run no Python); calls made by the benchmark's own probes and hooks
(overhead_probes.py, overhead_counts.py) are not counted. On odd ones, a ``TorchDispatchMode``
entered around the step counts the
aten ops the step's thread dispatches (backward included: on the CPU autograd runs on the
calling thread) into the current kind; a mode is per thread, so ops on other threads are not
counted (ours: the receive threads' ``unflatten`` views; torch: none). The hooks cost a lot of
CPU, so a counting run is timed by nobody; the counts do not depend on the load.
"""

from __future__ import annotations

import sys
import threading
from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.overhead_probes import Tally

_HARNESS = ("overhead_probes.py", "overhead_counts.py")


class _Ops(TorchDispatchMode):
    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        c = self.counts
        if c.tally.on:
            c.ops[c.tally.current] += 1
            c.op_names[f"{c.tally.current}:{func.overloadpacket.__name__}"] += 1
        return func(*args, **(kwargs or {}))


class Counts:
    """Python calls and aten ops per kind, only while ``tally.on``."""

    def __init__(self, tally: Tally) -> None:
        self.tally = tally
        self.py: Counter[str] = Counter()       # Python function calls
        self.c: Counter[str] = Counter()        # calls into C functions (builtins, torch's bindings)
        self.ops: Counter[str] = Counter()
        self.op_names: Counter[str] = Counter()
        self.fn_names: Counter[str] = Counter()    # kind:file:function, Python and C calls
        self.mode = _Ops(self)
        self.profiling = False
        self.steps = {"calls": 0, "ops": 0}     # measured steps counted by each

    def _hook(self, kind: str | None) -> Any:
        py, c, tally, names = self.py, self.c, self.tally, self.fn_names

        def hook(frame: Any, event: str, arg: Any) -> None:
            if self.profiling and (file := frame.f_code.co_filename.rsplit("/", 1)[-1]) not in _HARNESS:
                k = kind or tally.current
                if event == "call":
                    py[k] += 1
                    names[f"{k}:{file}:{frame.f_code.co_name}"] += 1
                elif event == "c_call":
                    c[k] += 1
                    names[f"{k}:C:{getattr(arg, '__qualname__', '?')}"] += 1
        return hook

    def step(self, step: Any, k: int) -> None:
        """Run ``step(k)`` under one of the counters (by ``k``'s parity) when the tally is on."""
        if not self.tally.on:
            step(k)
        elif k % 2 == 0:
            self.profiling, self.steps["calls"] = True, self.steps["calls"] + 1
            try:
                step(k)
            finally:
                self.profiling = False
        else:
            self.steps["ops"] += 1
            with self.mode:
                step(k)

    def install(self) -> None:
        """Count this thread's calls and those of every thread started from now on."""
        threading.setprofile(self._hook("background"))
        sys.setprofile(self._hook(None))

    def uninstall(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)      # type: ignore[arg-type]

    def split(self, kind: str, shares: dict[str, float]) -> None:
        """Move what was counted into ``kind`` into the kinds of ``shares`` (fractions summing to 1)."""
        for counter in (self.py, self.c, self.ops):
            n = counter.pop(kind, 0)
            for k, f in shares.items():
                counter[k] += n * f
        for name in [x for x in self.op_names if x.startswith(kind + ":")]:
            n = self.op_names.pop(name)
            for k, f in shares.items():
                self.op_names[k + name[len(kind):]] += n * f

    def result(self) -> dict:
        return {"python_calls": dict(self.py), "c_calls": dict(self.c), "aten_ops": dict(self.ops),
                "aten_op_names": dict(self.op_names), "function_names": dict(self.fn_names),
                "steps": dict(self.steps)}
