"""The dedicated aggregator (seed 001's in-network aggregation, in software): a TCP server that
sums the workers' vectors chunk by chunk as they arrive and streams the sum back.

A session is ``world`` workers connected at once; it serves their all-reduces one after the
other until one of them leaves. Each all-reduce is summed cut-through by ``stream.py``: chunk i
of the sum leaves while chunk i+1 is still arriving, with a pool of buffers per worker.
"""

from __future__ import annotations

import logging
import socket
import threading

from hybridpipe.comm.allreduce.dedicated.stream import reduce_stream
from hybridpipe.comm.allreduce.dedicated.wire import (
    DTYPES,
    HELLO,
    MAGIC,
    OP,
    VERSION,
    recv_struct,
    send_status,
    set_blocking_timeout,
)

log = logging.getLogger(__name__)

DEFAULT_CHUNK_BYTES = 256 << 10


class AggregatorServer:
    """Serves one group of ``world`` workers at ``host:port`` (port 0: any free port).

    Run it in a process of its own with ``torch.set_num_threads(1)`` (``hybridpipe aggregator``
    does): with more, OpenMP workers spin after every sum and starve the event loop (measured
    here: 400 ms instead of 13 ms for 4 MB from 4 workers on a busy 2-core machine).
    """

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
            set_blocking_timeout(conn, self.timeout_s)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            try:
                magic, version, pos, world = recv_struct(conn, HELLO)
                error = ""
                if magic != MAGIC or version != VERSION:
                    error = f"protocol mismatch (expected version {VERSION})"
                elif world != self.world:
                    error = (f"this aggregator serves a group of {self.world}, not {world}; "
                             f"start it with --world {world}")
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
            try:
                reduce_stream(conns, dtype, numel, max(1, self.chunk_bytes // dtype.itemsize), self.buffers,
                              self.timeout_s)
            except (OSError, ConnectionError) as e:
                log.warning("all-reduce of %d elements failed: %s; ending the session", numel, e)
                return
