"""A worker's connection to the dedicated aggregator (``hybridpipe aggregator``)."""

from __future__ import annotations

import selectors
import socket
import time
from collections.abc import Sequence

import torch

from hybridpipe.comm.allreduce.dedicated.wire import (
    HELLO,
    MAGIC,
    OP,
    VERSION,
    AggregatorError,
    AggregatorUnreachable,
    byte_view,
    dtype_code,
    parse_address,
    recv_status,
    wake_after,
)

CONNECT_S = 10.0        # how long a worker keeps dialling an aggregator that does not answer (it may start late)


class AggregatorClient:
    """One worker (``position`` of ``world``) of the group the aggregator at ``address`` serves.

    Connects on first use and keeps the connection; every worker of the group must call
    :meth:`allreduce` with the same shapes in the same order.
    """

    def __init__(self, address: str, position: int, world: int, *, timeout_s: float = 300.0,
                 connect_s: float = CONNECT_S):
        self.host, self.port = parse_address(address)
        self.position = position
        self.world = world
        self.timeout_s = timeout_s
        self.connect_s = connect_s
        self._sock: socket.socket | None = None
        self._seq = 0

    def _connect(self) -> socket.socket:
        if self._sock is None:
            sock = self._dial()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(HELLO.pack(MAGIC, VERSION, self.position, self.world))
            error = self._status(sock)
            if error:
                sock.close()
                raise AggregatorError(f"the aggregator at {self.host}:{self.port} refused position "
                                      f"{self.position}: {error}")
            self._sock = sock
        return self._sock

    def _dial(self) -> socket.socket:
        """A TCP connection to the aggregator, retried (it may start just after the job) for at most
        ``connect_s`` seconds; AggregatorUnreachable (a UserError: one line) when nobody answers."""
        start = time.monotonic()
        tries, wait = 0, 0.1
        while True:
            tries += 1
            try:
                left = max(self.connect_s - (time.monotonic() - start), 0.1)
                sock = socket.create_connection((self.host, self.port), timeout=min(left, self.timeout_s))
                sock.settimeout(self.timeout_s)
                return sock
            except socket.gaierror as e:              # no such host: waiting will not make one
                error: OSError = e
                break
            except OSError as e:
                error = e
                if time.monotonic() - start + wait > self.connect_s:
                    break
                time.sleep(wait)
                wait = min(2 * wait, 1.0)
        raise AggregatorUnreachable(
            f"cannot reach the aggregator at {self.host}:{self.port} ({error.strerror or error}; {tries} "
            f"tr{'y' if tries == 1 else 'ies'} in {time.monotonic() - start:.1f} s): start it with `hybridpipe "
            f"aggregator --port {self.port} --world {self.world}` before the job, or fix --aggregator HOST:PORT")

    def _status(self, sock: socket.socket) -> str:
        try:
            return recv_status(sock)
        except (OSError, ConnectionError) as e:
            self.close()
            raise AggregatorError(f"lost the aggregator at {self.host}:{self.port}: {e}") from None

    def allreduce(self, tensors: Sequence[torch.Tensor]) -> None:
        """Sum contiguous CPU tensors of one dtype in place, as one vector."""
        if not tensors:
            return
        dtype = tensors[0].dtype
        numel = sum(t.numel() for t in tensors)
        sock = self._connect()
        self._seq += 1
        try:
            sock.sendall(OP.pack(self._seq & 0xFFFFFFFF, dtype_code(dtype), numel))
            error = self._status(sock)
            if error:
                self.close()
                raise AggregatorError(f"the aggregator refused all-reduce #{self._seq}: {error}")
            _exchange(sock, [byte_view(t) for t in tensors], self.timeout_s)
        except (OSError, ConnectionError) as e:
            self.close()
            raise AggregatorError(f"lost the aggregator at {self.host}:{self.port} during all-reduce "
                                  f"#{self._seq}: {e}") from None

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None


def _exchange(sock: socket.socket, views: list[memoryview], timeout_s: float) -> None:
    """Stream ``views`` out while the sum streams back into them (one thread, non-blocking).

    The sum of a byte can only arrive after that byte left, so overwriting in place is safe.
    """
    total = sum(len(v) for v in views)
    out = [0, 0]                                   # (view index, offset) still to send
    back = [0, 0]                                  # (view index, offset) still to receive
    sent = received = 0
    level = wake_after(sock, total, 0)
    sock.setblocking(False)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ | selectors.EVENT_WRITE)
    try:
        while received < total:
            if sent == total:
                selector.modify(sock, selectors.EVENT_READ)
            if not selector.select(timeout_s):
                raise TimeoutError(f"no progress for {timeout_s:.0f} s")
            if sent < total:
                try:
                    n = sock.send(views[out[0]][out[1]:])
                    sent += n
                    out = _advance(views, out, n)
                except BlockingIOError:
                    pass
            try:
                n = sock.recv_into(views[back[0]][back[1]:])
            except BlockingIOError:
                continue
            if n == 0:
                raise ConnectionError("the aggregator closed the connection")
            received += n
            back = _advance(views, back, n)
            level = wake_after(sock, total - received, level) if received < total else level
    finally:
        selector.close()
        wake_after(sock, 1, level)
        sock.settimeout(timeout_s)


def _advance(views: list[memoryview], where: list[int], n: int) -> list[int]:
    i, off = where[0], where[1] + n
    while i < len(views) and off >= len(views[i]):
        off -= len(views[i])
        i += 1
    return [i, off]
