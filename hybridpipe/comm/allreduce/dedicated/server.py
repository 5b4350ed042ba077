"""The dedicated aggregator (seed 001's in-network aggregation, in software): a TCP server that
sums the workers' vectors chunk by chunk as they arrive and streams the sum back.

Per session (``world`` workers connected) there is a reader thread and a writer thread per
worker and one summing thread. A reader receives its worker's stream into a pool of
``buffers`` chunk buffers (when the pool is empty it stops reading and TCP holds the worker
back); the summing thread adds chunk i of every worker, in position order, into an
accumulator (a pool of ``buffers`` more) as soon as each arrives, and hands it to every writer;
chunk i of the sum leaves while chunk i+1 is still arriving (cut-through).
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from dataclasses import dataclass

import torch

from hybridpipe.comm.allreduce.dedicated.wire import (DTYPES, HELLO, MAGIC, OP, VERSION, byte_view, recv_exact,
                                                      recv_struct, send_status)

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 256 << 10
_STOP = object()


@dataclass(frozen=True)
class _Job:
    dtype: torch.dtype
    numel: int
    chunk_elems: int

    @property
    def chunks(self) -> list[tuple[int, int]]:
        return [(lo, min(lo + self.chunk_elems, self.numel)) for lo in range(0, self.numel, self.chunk_elems)]


class AggregatorServer:
    """Serves one group of ``world`` workers at ``host:port`` (port 0: any free port)."""

    def __init__(self, host: str, port: int, world: int, *, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 buffers: int = 4, timeout_s: float = 300.0):
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        if buffers < 1 or chunk_bytes < 64:
            raise ValueError("need at least one buffer of at least 64 bytes")
        self.world = world
        self.chunk_bytes = chunk_bytes
        self.buffers = buffers
        self.timeout_s = timeout_s
        self._listener = socket.create_server((host, port), reuse_port=False)
        self._listener.settimeout(0.5)
        self.address = self._listener.getsockname()[:2]
        self._stopped = threading.Event()
        self.sessions_served = 0

    def stop(self) -> None:
        """Ask :meth:`serve` to return (within half a second, after the current session)."""
        self._stopped.set()

    def close(self) -> None:
        self.stop()
        self._listener.close()

    def serve(self, sessions: int | None = None) -> None:
        """Accept sessions until stopped (or ``sessions`` have ended)."""
        while not self._stopped.is_set() and (sessions is None or self.sessions_served < sessions):
            conns = self._gather()
            if conns is None:
                continue
            try:
                self._session(conns)
            finally:
                for c in conns:
                    c.close()
                self.sessions_served += 1

    # ---- connecting --------------------------------------------------------------------
    def _gather(self) -> list[socket.socket] | None:
        """Wait for ``world`` distinct positions to say hello; None when stopped."""
        slots: dict[int, socket.socket] = {}
        while len(slots) < self.world:
            if self._stopped.is_set():
                for c in slots.values():
                    c.close()
                return None
            try:
                conn, peer = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:                    # the listener was closed: stop
                if self._stopped.is_set():
                    continue
                raise
            conn.settimeout(self.timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                magic, version, pos, world = recv_struct(conn, HELLO)
                error = ""
                if magic != MAGIC or version != VERSION:
                    error = f"protocol mismatch (expected version {VERSION})"
                elif world != self.world:
                    error = f"this aggregator serves a group of {self.world}, not {world}; start it with --world {world}"
                elif not 0 <= pos < world or pos in slots:
                    error = f"position {pos} is invalid or already connected"
                send_status(conn, error)
            except (OSError, ConnectionError) as e:
                error = str(e)
            if error:
                log.warning("refused %s: %s", peer, error)
                conn.close()
                continue
            slots[pos] = conn
            log.debug("position %d connected from %s (%d/%d)", pos, peer, len(slots), self.world)
        return [slots[p] for p in range(self.world)]

    # ---- one session -------------------------------------------------------------------
    def _session(self, conns: list[socket.socket]) -> None:
        log.info("session with %d workers", len(conns))
        while True:
            try:
                headers = [recv_struct(c, OP) for c in conns]
            except (OSError, ConnectionError):
                log.info("session ended (a worker left)")
                return
            error = ""
            if len({h for h in headers}) != 1:
                error = f"workers disagree on the operation (sequence, dtype, elements): {sorted(set(headers))}"
            elif not 0 <= headers[0][1] < len(DTYPES):
                error = f"unknown dtype code {headers[0][1]}"
            try:
                for c in conns:
                    send_status(c, error)
            except OSError:
                return
            if error:
                log.warning("%s", error)
                return
            _, code, numel = headers[0]
            dtype = DTYPES[code]
            job = _Job(dtype, numel, max(1, self.chunk_bytes // dtype.itemsize))
            if numel and not self._reduce(conns, job):
                return

    def _reduce(self, conns: list[socket.socket], job: _Job) -> bool:
        """Stream one all-reduce; False if a connection broke (the session ends)."""
        itemsize = job.dtype.itemsize
        failed = threading.Event()
        free = [queue.Queue() for _ in conns]
        ready = [queue.Queue() for _ in conns]
        outbox = [queue.Queue() for _ in conns]
        acc_free: queue.Queue = queue.Queue()
        for q in free:
            for _ in range(self.buffers):
                q.put(torch.empty(job.chunk_elems, dtype=job.dtype))
        for _ in range(self.buffers):
            acc_free.put(torch.empty(job.chunk_elems, dtype=job.dtype))
        remaining: dict[int, int] = {}
        lock = threading.Lock()

        def reader(i: int) -> None:
            try:
                for lo, hi in job.chunks:
                    buf = free[i].get()
                    recv_exact(conns[i], byte_view(buf)[: (hi - lo) * itemsize])
                    ready[i].put(buf)
            except (OSError, ConnectionError) as e:
                log.warning("worker %d: %s", i, e)
                failed.set()
                ready[i].put(_STOP)

        def writer(i: int) -> None:
            try:
                for lo, hi in job.chunks:
                    acc = outbox[i].get()
                    if acc is _STOP:
                        return
                    conns[i].sendall(byte_view(acc)[: (hi - lo) * itemsize])
                    with lock:
                        remaining[id(acc)] -= 1
                        done = remaining[id(acc)] == 0
                    if done:
                        acc_free.put(acc)
            except OSError as e:
                log.warning("worker %d: %s", i, e)
                failed.set()

        threads = [threading.Thread(target=f, args=(i,), daemon=True, name=f"agg-{f.__name__}-{i}")
                   for i in range(len(conns)) for f in (reader, writer)]
        for t in threads:
            t.start()
        try:
            for lo, hi in job.chunks:
                acc = acc_free.get()
                part = acc[: hi - lo]
                for i in range(len(conns)):
                    buf = ready[i].get()
                    if buf is _STOP:
                        raise ConnectionError("a worker left mid-operation")
                    if i == 0:
                        part.copy_(buf[: hi - lo])
                    else:
                        part.add_(buf[: hi - lo])
                    free[i].put(buf)
                with lock:
                    remaining[id(acc)] = len(conns)
                for q in outbox:
                    q.put(acc)
        except ConnectionError:
            failed.set()
        if failed.is_set():
            for c in conns:                    # unblock every thread; the session ends
                try:
                    c.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            for q in outbox:
                q.put(_STOP)
            for q in free:
                for _ in range(self.buffers):
                    q.put(torch.empty(job.chunk_elems, dtype=job.dtype))
        for t in threads:
            t.join()
        return not failed.is_set()
