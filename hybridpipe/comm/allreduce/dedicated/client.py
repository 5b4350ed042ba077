"""A worker's connection to the dedicated aggregator (``hybridpipe aggregator``)."""

from __future__ import annotations

import socket
import threading
from typing import Sequence

import torch

from hybridpipe.comm.allreduce.dedicated.wire import (HELLO, MAGIC, OP, VERSION, AggregatorError, byte_view,
                                                      dtype_code, parse_address, recv_exact, recv_status)


class AggregatorClient:
    """One worker (``position`` of ``world``) of the group the aggregator at ``address`` serves.

    Connects on first use and keeps the connection; every worker of the group must call
    :meth:`allreduce` with the same shapes in the same order.
    """

    def __init__(self, address: str, position: int, world: int, *, timeout_s: float = 300.0):
        self.host, self.port = parse_address(address)
        self.position = position
        self.world = world
        self.timeout_s = timeout_s
        self._sock: socket.socket | None = None
        self._seq = 0

    def _connect(self) -> socket.socket:
        if self._sock is None:
            try:
                sock = socket.create_connection((self.host, self.port), timeout=self.timeout_s)
            except OSError as e:
                raise AggregatorError(f"cannot reach the aggregator at {self.host}:{self.port} ({e}); start it "
                                      f"with `hybridpipe aggregator --port {self.port} --world {self.world}`") from None
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.sendall(HELLO.pack(MAGIC, VERSION, self.position, self.world))
            error = self._status(sock)
            if error:
                sock.close()
                raise AggregatorError(f"the aggregator at {self.host}:{self.port} refused position "
                                      f"{self.position}: {error}")
            self._sock = sock
        return self._sock

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
        views = [byte_view(t) for t in tensors]
        failure: list[BaseException] = []

        def stream() -> None:
            try:
                for v in views:
                    sock.sendall(v)
            except OSError as e:
                failure.append(e)

        try:
            sock.sendall(OP.pack(self._seq & 0xFFFFFFFF, dtype_code(dtype), numel))
            error = self._status(sock)
            if error:
                self.close()
                raise AggregatorError(f"the aggregator refused all-reduce #{self._seq}: {error}")
            sender = threading.Thread(target=stream, daemon=True, name="aggregator-send")
            sender.start()
            try:
                for v in views:              # the sum of chunk i overwrites it after it was sent
                    recv_exact(sock, v)
            finally:
                sender.join()
        except (OSError, ConnectionError) as e:
            self.close()
            raise AggregatorError(f"lost the aggregator at {self.host}:{self.port} during all-reduce "
                                  f"#{self._seq}: {e}") from None
        if failure:
            self.close()
            raise AggregatorError(f"sending to the aggregator failed: {failure[0]}")

    def close(self) -> None:
        if self._sock is not None:
            try:
                self._sock.close()
            finally:
                self._sock = None
