"""SIGTERM and SIGINT to a running job: seen at once, without interrupting the main thread.

Torchrun's agent, on SIGTERM or SIGINT (a scheduler preempting the job, Ctrl-C), raises
``SignalException``, sends the same signal to every worker, waits up to 30 s (then SIGKILL), and
exits 1; it does not restart the job. It sends SIGTERM to its workers as well when one of them
fails (it stops the survivors). So a worker told to stop asks: did a rank fail first? A failure
already published, or a local peer gone without a word (killed), is the cause; else, when every
rank on this host received the signal at once, the job itself was stopped (no rank failed); a
signal that only this rank received is this rank's own end.

:class:`SignalWatch` makes that decision possible while the main thread is blocked in a
collective or writing a checkpoint: Python runs signal handlers only in the main thread, between
bytecodes, so the handlers installed here do nothing, and ``signal.set_wakeup_fd`` (written by
the C-level handler the moment the signal arrives) wakes a thread that calls ``on_signal``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterable

import torch.distributed as dist

from hybridpipe.runtime.failure_facts import Failure, is_set, read_first, report_first

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def stop_line(name: str, *, agent: bool | None = None) -> str:
    """What every rank says when the job was stopped by signal ``name`` and no rank had failed
    (``agent``: torchrun's agent relayed it; default: whether this process runs under torchrun)."""
    agent = "TORCHELASTIC_RUN_ID" in os.environ if agent is None else agent
    to = " to the agent" if agent else ""
    return (f"stopped by {name}{to}: no rank failed (every rank on {socket.gethostname()} received it at once: the "
            "job was stopped or preempted)")


def alone_line(name: str) -> str:
    """What a rank says (and the others repeat) when it alone received ``name``."""
    return f"stopped by {name} sent to its process alone (no other rank on its host received it)"


def stop_cause(store: dist.Store, rank: int, signum: int, killed: Callable[[], Failure | None],
               local_peers: Callable[[], list[int]], wait_s: float) -> Failure:
    """Why ``rank``, which just received ``signum``, must stop (see the module docstring): the
    failure already published, else a local peer ``killed()`` without a word, else a stop of the
    job when every rank of ``local_peers()`` received a signal too within ``wait_s``, else this
    rank alone. Records ``sig/<rank>`` first and publishes what it found (the first report wins)."""
    name = signal.Signals(signum).name
    store.set(f"sig/{rank}", json.dumps({"signal": name, "time": time.time()}))
    first = read_first(store)
    if first is not None:
        return first
    dead = killed()
    if dead is not None:
        return report_first(store, dead)
    end = time.monotonic() + wait_s
    while not (everyone := all(is_set(store, f"sig/{r}") for r in local_peers())) and time.monotonic() < end:
        time.sleep(0.02)
    if everyone:
        return report_first(store, Failure(rank, stop_line(name), rank, stop=name))
    return report_first(store, Failure(rank, alone_line(name), rank))


def exit_code(signum: int) -> int:
    """The shell's convention for a process ended by ``signum`` (143 for SIGTERM, 130 for SIGINT)."""
    return 128 + int(signum)


class SignalWatch:
    """Calls ``on_signal(signum)`` from its own thread the moment one of ``signals`` arrives (the
    first one only; later ones are ignored); see the module docstring. Only in the main thread."""

    def __init__(self, on_signal: Callable[[int], None], signals: Iterable[int] = STOP_SIGNALS) -> None:
        self.on_signal, self.signals = on_signal, tuple(int(s) for s in signals)
        self._old: dict[int, object] = {}
        self._old_fd: int | None = None
        self._pipe: tuple[int, int] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """Install the handlers and start the thread; False (nothing installed) off the main thread."""
        if threading.current_thread() is not threading.main_thread():
            return False
        r, w = os.pipe()
        os.set_blocking(w, False)
        self._pipe = (r, w)
        self._old_fd = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
        for s in self.signals:
            self._old[s] = signal.signal(s, _ignore)
        self._thread = threading.Thread(target=self._wait, name="stop-signals", daemon=True)
        self._thread.start()
        return True

    def stop(self) -> None:
        """Put the previous handlers and wakeup fd back and end the thread."""
        if self._pipe is None:
            return
        for s, old in self._old.items():
            signal.signal(s, old)  # type: ignore[arg-type]  # what signal.signal returned
        signal.set_wakeup_fd(self._old_fd if self._old_fd is not None else -1)
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=1.0)
        for fd in self._pipe:
            try:
                os.close(fd)
            except OSError:
                pass
        self._pipe = None

    def _wait(self) -> None:
        assert self._pipe is not None
        r = self._pipe[0]
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([r], [], [], 0.2)
                data = os.read(r, 64) if ready else b""
            except (OSError, ValueError):
                return
            got = next((b for b in data if b in self.signals), None)
            if got is not None:
                self.on_signal(got)
                return


def _ignore(signum, frame) -> None:
    """The Python-level handler: nothing (the wakeup fd already told the watching thread)."""
