"""The background communication lane: one thread that issues a sequence of collective calls.

Collectives on a process group must be issued in the same order on every rank; a lane keeps
that order (jobs run one at a time, first in, first out) while the caller goes on computing.
``submit`` returns a :class:`Handle` to wait on later. After a job fails the lane is broken:
the ranks' sequences no longer line up, so every later job fails at once with the first error
instead of hanging in a mismatched collective.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class LaneBroken(RuntimeError):
    """A communication lane cannot run more jobs because an earlier one failed."""


class Handle:
    """The pending result of one job on a lane."""

    def __init__(self, name: str):
        self.name = name
        self._done = threading.Event()
        self._value: Any = None
        self._error: BaseException | None = None

    def done(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the job ran; return its value or raise its error (TimeoutError after ``timeout``)."""
        if not self._done.wait(timeout):
            raise TimeoutError(f"communication job {self.name!r} still running after {timeout} s")
        if self._error is not None:
            raise self._error
        return self._value

    def _finish(self, value: Any = None, error: BaseException | None = None) -> None:
        self._value, self._error = value, error
        self._done.set()


class CommLane:
    """A daemon thread running submitted jobs in order (started on first use)."""

    def __init__(self, name: str = "hybridpipe-comm"):
        self.name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._broken: BaseException | None = None
        self._closed = False
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., Any], *args: Any, name: str = "") -> Handle:
        """Queue ``fn(*args)``; returns its handle at once."""
        handle = Handle(name or getattr(fn, "__name__", "job"))
        with self._lock:
            if self._closed:
                raise RuntimeError(f"communication lane {self.name!r} is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._jobs.put((fn, args, handle))
        return handle

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            fn, args, handle = item
            if self._broken is not None:
                handle._finish(error=LaneBroken(f"lane {self.name!r} stopped after an earlier job failed: "
                                                f"{type(self._broken).__name__}: {self._broken}"))
                continue
            try:
                handle._finish(fn(*args))
            except BaseException as e:      # noqa: BLE001 - handed to whoever waits
                log.debug("lane %s: job %s failed: %s", self.name, handle.name, e)
                self._broken = e
                handle._finish(error=e)

    def close(self, timeout: float | None = None) -> None:
        """Run what is queued, then stop the thread."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._jobs.put(None)
            thread.join(timeout)
