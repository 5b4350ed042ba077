"""Failure handling: when one rank dies, every other rank stops quickly and names it.

How the worker uses it (right after ``init_process_group``, around everything else)::

    guard = FailureGuard(default_store(), rank=rank, world_size=world, timeout=args.peer_timeout,
                         describe=describe_ranks(plan), on_exit=[recorder.close])
    with guard:                     # starts the watchdog and the stop-signal watch (stop_signals.py)
        train()                     # any exception ends here; ``with guard.critical:`` around a save
    # leaving normally marks this rank done (no longer watched), stops the watchdog

An exception leaving the ``with`` block never returns: the guard finds out which rank failed
first, prints ONE line on stderr naming it, runs ``on_exit`` (quick, local things only: flush
the trace; no collectives, no channels) and ends the process with ``os._exit`` (threads blocked
on dead connections cannot hang the exit). Exit codes (exit_codes.py): :data:`EXIT_PEER_LOST` (75, EX_TEMPFAIL)
- another rank failed, this one is fine (``torchrun --max-restarts`` with ``--resume`` goes on);
1 - this rank failed (traceback printed); 2 - a UserError of its own (one line), or an
:class:`~hybridpipe.errors.AgreedError` every rank raised together (a non-finite loss, no usable
checkpoint, a full disk: nobody blamed, printed by the first local rank of each host, every rank
marked done); 143 / 130 - the job was stopped by SIGTERM / SIGINT (every rank, the same line).

How the failed rank is named: ranks share facts through the c10d store (a prefix per torchrun
restart). The first rank to know publishes ``first`` (compare-and-set: the first report wins):
a rank that fails by itself publishes itself with its error, a p2p ``PeerLost``/``P2PTimeout``
names its peer. A watchdog thread on every rank (a) heartbeats, (b) exits the process as soon as
``first`` is published (so ranks blocked inside an all-reduce or a recv also stop), (c) checks
the processes of the ranks on its own host every ``interval`` (a killed rank is seen at once)
and (d) watches the next rank in a ring through its heartbeat (a rank on another host whose
heartbeat stalls for ``timeout`` s is lost: host or network gone). A gloo collective that fails
("connection reset") names no rank: the guard then waits (at most ``timeout`` + 2 intervals)
for the watchdogs to publish the culprit. The worker passes the shorter of ``--peer-timeout``
and ``--timeout`` as ``timeout``, so no wait outlasts either. A p2p timeout names the silent
peer, unless its heartbeat still moves (it waits on a third rank, whom the watchdogs name).
The first failure in time, not in rank order: a rank that leaves through the guard records its
exit (``exit/<rank>``) first, so of several local processes found gone at one check, the one
that died without a word is named; among several of those, the one whose heartbeat stopped first.

SIGTERM / SIGINT (stop_signals.py): a rank that receives one publishes the cause before it
exits -- a failure already published, a local peer gone without a word (torchrun's agent stops
the survivors of a killed rank), or else a *stop* of the job (every rank on its host received
it; ``Failure.stop``) -- so no rank that was stopped is ever named as failed. Before exiting it
waits (at most :data:`GRACE_S`) for ``critical``: a checkpoint being written finishes whole.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import traceback
from collections.abc import Callable, Iterable
from typing import NoReturn, Protocol

import torch.distributed as dist

from hybridpipe.errors import AgreedError, UserError, one_line
from hybridpipe.runtime.exit_codes import EXIT_ERROR, EXIT_INTERRUPT, EXIT_PEER_LOST, EXIT_SIGTERM, EXIT_USER_ERROR
from hybridpipe.runtime.failure_facts import (
    Failure,
    default_store,
    describe_ranks,
    is_set,
    one_line_of,
    read_first,
    report_first,
    suspect_of,
    try_quietly,
)
from hybridpipe.runtime.liveness import PeerWatch, host_identity
from hybridpipe.runtime.stop_signals import SignalWatch, exit_code, stop_cause, stop_line

GRACE_S = 20.0            # a stopped rank lets a checkpoint being written finish for this long (torchrun: 30 s)


class Recovering(Protocol):
    """What the watchdog tells an in-place recovery (recovery.py) instead of stopping the job."""

    def request(self, reason: str, suspect: int | None) -> None: ...

    def poll(self) -> None: ...


class Terminated(BaseException):
    """SIGTERM arrived (the launcher stops the job): handled like the signal itself (stop_signals.py)."""


class FailureGuard:
    """See the module docstring. ``timeout``: seconds without a heartbeat before a rank on another
    host counts as lost (and the longest wait to name a culprit); ``interval``: heartbeat and
    check period (default ``min(1, timeout / 10)``); ``describe(rank)`` names ranks in messages;
    ``namespace``: store prefix (default: per torchrun restart); ``program`` starts the line of an
    AgreedError."""

    def __init__(self, store: dist.Store, *, rank: int, world_size: int, timeout: float = 30.0,
                 interval: float | None = None, describe: Callable[[int], str] | None = None,
                 on_exit: Iterable[Callable[[], object]] = (), namespace: str | None = None,
                 hint: str = "", program: str = "hybridpipe") -> None:
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        self.rank, self.world_size, self.timeout = rank, world_size, float(timeout)
        self.interval = float(interval) if interval else min(1.0, self.timeout / 10)
        self.describe = describe or (lambda r: f"rank {r}")
        self.on_exit = list(on_exit)
        self.hint, self.program = hint, program
        restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.namespace = namespace if namespace is not None else f"hybridpipe/failure/{restart}"
        self._base = store
        self._use_namespace(self.namespace)
        self._stop = threading.Event()
        self._exiting = threading.Lock()
        self._local = threading.Lock()            # the watchdog and the signal thread both check local peers
        self.critical = threading.RLock()         # held while a checkpoint is written: a stop waits for it
        self._thread: threading.Thread | None = None
        self._signals: SignalWatch | None = None
        self._peers = PeerWatch(rank, world_size, self.timeout)
        self._store_error: BaseException | None = None
        self.exit_code: int | None = None         # set when the guard ends the process (for on_exit)
        self.recovery: Recovering | None = None   # in place (recovery.py): a lost peer is its business

    def _use_namespace(self, ns: str) -> None:
        store = self._base
        self._store = dist.PrefixStore(ns, store)
        self._watch_store = dist.PrefixStore(ns, store.clone() if hasattr(store, "clone") else store)
        self._signal_store = dist.PrefixStore(ns, store.clone() if hasattr(store, "clone") else store)

    # ---- lifecycle --------------------------------------------------------------------
    def start(self) -> FailureGuard:
        me = {"host": host_identity(), "pid": os.getpid()}
        self._store.set(f"who/{self.rank}", json.dumps(me))
        self._store.add(f"hb/{self.rank}", 1)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name=f"failure-watchdog-{self.rank}", daemon=True)
        self._thread.start()
        return self

    def reform(self, rank: int, world_size: int, describe: Callable[[int], str], namespace: str) -> None:
        """Go on as ``rank`` of a re-formed world of ``world_size`` (in-place recovery): the
        watchdog starts over in ``namespace`` (nothing of the old world is watched)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._local:
            self.rank, self.world_size, self.describe = rank, world_size, describe
            self._peers = PeerWatch(rank, world_size, self.timeout)
            self.namespace = namespace
            self._use_namespace(namespace)
        self.start()

    def gone_here(self) -> set[int]:
        """The ranks on this host whose process is gone (in-place recovery counts them lost at once)."""
        try:
            with self._local:
                return {d[3] for d in self._peers.gone_local(self._store)}
        except Exception:           # noqa: BLE001 - the store is gone: nothing known here
            return set()

    def lost(self, rank: int, reason: str) -> NoReturn:
        """Leave because ``rank`` was lost and the job cannot go on without a restart (exit 75,
        the first failure published as usual)."""
        self._leave(self.report(Failure(rank, reason, self.rank)))

    def leave(self, code: int, message: str) -> NoReturn:
        """Leave with ``code`` and ``message`` without publishing a failure."""
        self._exit(code, message)

    def stop(self) -> None:
        """Normal end: this rank is done (never reported as lost) and the watchdog stops."""
        try:
            self._store.set(f"done/{self.rank}", "1")
        except Exception:           # noqa: BLE001 - the store may be gone at the very end
            pass
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval * 3)

    def __enter__(self) -> FailureGuard:
        self.start()
        watch = SignalWatch(self._on_signal)
        self._signals = watch if watch.start() else None
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None or isinstance(exc, SystemExit) and exc.code in (0, None):
            if self._signals is not None:
                self._signals.stop()
            self.stop()
            return
        self.handle(exc)

    # ---- failure path -----------------------------------------------------------------
    def published(self) -> Failure | None:
        """The first failure anyone reported, if any (None too when the store is gone)."""
        try:
            return read_first(self._store)
        except Exception as e:      # noqa: BLE001 - the store's host died: decide locally
            self._store_error = self._store_error or e
            return None

    def report(self, failure: Failure) -> Failure:
        """Publish ``failure`` unless one was published before; return the first one."""
        try:
            return report_first(self._store, failure)
        except Exception as e:      # noqa: BLE001
            self._store_error = self._store_error or e
            return failure

    def handle(self, exc: BaseException) -> NoReturn:
        """Name the first failed rank for ``exc``, print one line, exit (see the module docstring)."""
        peer, how = suspect_of(exc)
        own_text = one_line_of(exc)
        if isinstance(exc, AgreedError):
            self.stop()                 # done, not lost: every rank leaves the same way
            self._exit(EXIT_USER_ERROR, one_line(exc), quiet=os.environ.get("LOCAL_RANK", "0") != "0", bare=True)
        if isinstance(exc, (Terminated, KeyboardInterrupt)):
            self._on_signal(signal.SIGTERM if isinstance(exc, Terminated) else signal.SIGINT)
        if isinstance(exc, SystemExit):
            code = exc.code if isinstance(exc.code, int) else EXIT_ERROR
            self.report(Failure(self.rank, f"exited with code {code}" + (f" ({exc.code})" if code != exc.code else ""),
                                self.rank))
            self._exit(code, f"exited with code {code}")
        if how == "own":
            earlier = self.report(Failure(self.rank, own_text, self.rank))
            if earlier.rank == self.rank and not earlier.stop:
                if not isinstance(exc, UserError):
                    traceback.print_exception(exc, file=sys.stderr)
                self._exit(EXIT_USER_ERROR if isinstance(exc, UserError) else EXIT_ERROR, f"failed: {own_text}")
            self._leave(earlier, f"; then this rank failed: {own_text}")
        first = self.published()
        if first is None and peer is not None and how == "stalled" and self._beating(peer):
            # the peer is alive and silent: it waits on someone else, whom the watchdogs will name
            first = self._wait_published(self.timeout + 2 * self.interval)
        if first is None and peer is not None:
            first = self.report(Failure(peer, self._peer_reason(peer, how, own_text), self.rank))
        if first is None:
            first = self._wait_published(self.timeout + 2 * self.interval)
        if first is None and self._store_error is not None:
            first = self._store_gone(self._store_error)
        if first is None:
            first = self.report(Failure(self.rank, f"a collective failed and no rank was named: {own_text}",
                                        self.rank))
        self._leave(first, f" (this rank saw: {own_text})" if first.reporter != self.rank else "")

    def _leave(self, first: Failure, seen: str = "") -> NoReturn:
        """Exit for ``first``: a stop of the job ends every rank with the signal's exit code and the
        same line (after a checkpoint being written, if any); a failure with EXIT_PEER_LOST naming it."""
        if first.stop:
            self.critical.acquire(timeout=GRACE_S)
            self._exit(exit_code(signal.Signals[first.stop]), first.reason)
        self._exit(EXIT_PEER_LOST, self._blame(first) + seen)

    def _on_signal(self, signum: int) -> NoReturn:
        """SIGTERM or SIGINT arrived (stop_signals.py's thread, or the main thread): name the cause,
        let a checkpoint being written finish (at most GRACE_S), exit."""
        def killed() -> Failure | None:
            with self._local:
                return self._peers.lost_local(self._signal_store, silent_only=True)

        def local_peers() -> list[int]:
            with self._local:
                self._peers.learn(self._signal_store)
                return self._peers.local_alive()

        try:
            first = stop_cause(self._signal_store, self.rank, signum, killed, local_peers, max(1.0, 2 * self.interval))
        except Exception as e:      # noqa: BLE001 - the store is gone: decide alone
            self._store_error = self._store_error or e
            name = signal.Signals(signum).name
            first = Failure(self.rank, stop_line(name), self.rank, stop=name)
        if first.rank == self.rank and not first.stop:     # this rank alone was told to stop
            self.critical.acquire(timeout=GRACE_S)
            self._exit(exit_code(signum), first.reason)
        self._leave(first)

    def _store_gone(self, e: BaseException) -> Failure:
        return Failure(0, f"the c10d store is unreachable ({one_line_of(e)}): the process hosting it is gone "
                          "(rank 0, or torchrun's agent)", self.rank)

    def _peer_reason(self, peer: int, how: str, text: str) -> str:
        try:
            finished = is_set(self._store, f"done/{peer}")
        except Exception as e:      # noqa: BLE001
            self._store_error, finished = self._store_error or e, False
        if finished:
            return f"it finished its steps while this rank still waited for it ({text})"
        return text if how == "lost" else f"stalled: {text}"

    def _blame(self, f: Failure) -> str:
        who = self.describe(f.rank)
        by = "" if f.reporter == f.rank else f", found by {self.describe(f.reporter)}"
        return f"{who} failed first{by}: {f.reason}"

    def _beating(self, peer: int) -> bool:
        """Whether ``peer``'s heartbeat moves within a few intervals (its process runs: if it sent
        nothing, it is itself waiting on another rank)."""
        try:
            start = self._store.add(f"hb/{peer}", 0)
            end = time.monotonic() + 2.5 * self.interval
            while time.monotonic() < end:
                time.sleep(min(self.interval / 4, 0.05))
                if self._store.add(f"hb/{peer}", 0) != start or is_set(self._store, "first"):
                    return True
        except Exception as e:      # noqa: BLE001 - the store is gone: decide without it
            self._store_error = self._store_error or e
        return False

    def _wait_published(self, seconds: float) -> Failure | None:
        end = time.monotonic() + seconds
        while True:
            first = self.published()
            if first is not None or self._store_error is not None or time.monotonic() >= end:
                return first
            time.sleep(min(self.interval / 2, 0.1))

    def _exit(self, code: int, message: str, *, quiet: bool = False, bare: bool = False) -> NoReturn:
        with self._exiting:         # the watchdog and the main thread never both exit
            self._stop.set()
            self.exit_code = code
            self._record_exit(code)
            text = f"{self.program}: error: {message}" if bare else f"hybridpipe {self.describe(self.rank)}: {message}"
            if code == EXIT_PEER_LOST and self.hint:
                text += f". {self.hint}"
            for fn in self.on_exit:
                try:
                    fn()
                except Exception as e:      # noqa: BLE001 - exiting anyway
                    print(f"hybridpipe rank {self.rank}: on-exit callback failed: {one_line_of(e)}", file=sys.stderr)
            if not quiet:       # one write: every rank of a host may say its line into one log at once
                sys.stderr.write(text + "\n")
                sys.stderr.flush()
            sys.stdout.flush()
            os._exit(code)

    def _record_exit(self, code: int) -> None:
        """Tell the others this rank leaves through the guard (so it is never taken for the rank
        that died first); best effort, bounded: a store that hangs cannot hold the exit up."""
        if self._store_error is not None:
            return
        record = json.dumps({"code": code, "time": time.time()})
        t = threading.Thread(target=try_quietly, args=(lambda: self._store.set(f"exit/{self.rank}", record),),
                             daemon=True)
        t.start()
        t.join(timeout=min(0.5, self.interval * 2))

    # ---- watchdog thread --------------------------------------------------------------
    def _watch(self) -> None:
        store, stop = self._watch_store, self._stop
        while not stop.wait(self.interval):
            try:
                store.add(f"hb/{self.rank}", 1)
                first = read_first(store)
                if first is None:
                    with self._local:
                        lost = self._peers.lost_local(store)
                    lost = lost or self._peers.lost_successor(store)
                    if self.recovery is not None:       # the survivors agree on it instead (recovery.py)
                        if lost is not None:
                            self.recovery.request(f"{self.describe(lost.rank)}: {lost.reason}", lost.rank)
                        self.recovery.poll()
                    elif lost is not None:
                        first = report_first(store, lost)
            except Exception as e:  # noqa: BLE001 - the store itself is gone
                if stop.is_set():
                    return
                first = self._store_gone(e)
            if first is None or stop.is_set() or first.rank == first.reporter == self.rank:
                continue            # (this rank's own failure is handled by its main or signal thread)
            if first.rank == self.rank and not first.stop:
                self._exit(EXIT_PEER_LOST, f"stopped because {self.describe(first.reporter)} reported this "
                                           f"rank as failed: {first.reason}")
            self._leave(first)



__all__ = ["EXIT_PEER_LOST", "EXIT_ERROR", "EXIT_USER_ERROR", "EXIT_SIGTERM", "EXIT_INTERRUPT", "Failure",
           "FailureGuard", "Terminated", "default_store", "describe_ranks", "suspect_of"]
